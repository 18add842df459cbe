"""How long after lw's Mooncake data plane reports a write failed can its bytes still land?

D's lease (``lease_s``) releases a failed request's blocks on the premise that a write the data
plane gave up on lands within its timeout or never. This measures that premise on the fault
table's lossy link (:class:`lw.lab.synthetic.netem.Link`, ``--loss`` of the packets dropped each
way): a receiver in the decoder's namespace registers 1,024 blocks of 64 KiB and records, every
few milliseconds, when each block's first, middle and last words change; this side writes
``--writes`` distinct blocks through :class:`MooncakeDataPlane` (poll mode, ``--timeout``), a
few at a time, and notes when each is reported done or failed. For a failed write, every change
of its block after the report is a late landing; the report prints how many failed writes landed
late and the latest landing after its report, per configuration (``--env`` adds ``MC_*``
variables, e.g. ``MC_TCP_PROGRESS_TIMEOUT_SEC=10``). Both processes read CLOCK_MONOTONIC, which
one host shares across namespaces. Needs root, ``/dev/net/tun`` and Mooncake.

``PYTHONPATH=$PWD .venv/bin/python benchmarks/late_landing.py [--loss 0.3] [--writes 200]
[--timeout 10] [--env NAME=VALUE ...]``
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time

BLOCK = 64 << 10
BLOCKS = 1024

# The receiver: registers BLOCKS zeroed blocks, prints "port base", then samples three words
# of every block each few ms, records (block, time) of every change; prints them as JSON when
# its stdin closes.
_RX = r"""
import json, sys, threading, time
import numpy as np
from lw.lab.synthetic import netns
netns.enter(sys.argv[1])
from mooncake.engine import TransferEngine
BLOCK, BLOCKS = int(sys.argv[3]), int(sys.argv[4])
e = TransferEngine()
assert e.initialize(sys.argv[2], "P2PHANDSHAKE", "tcp", "") == 0
buf = np.zeros(BLOCK * BLOCKS, np.uint8)
assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
print(e.get_rpc_port(), buf.ctypes.data, flush=True)
words = buf.view(np.uint64).reshape(BLOCKS, BLOCK // 8)
cols = [0, BLOCK // 16, BLOCK // 8 - 1]
seen = words[:, cols].copy()
changes = []
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
while not stop.is_set():
    now = words[:, cols]
    diff = np.nonzero((now != seen).any(axis=1))[0]
    if len(diff):
        t = time.monotonic()
        changes += [(int(b), t) for b in diff]
        seen = now.copy()
    time.sleep(0.002)
print(json.dumps(changes), flush=True)
"""


def run(loss: float, writes: int, timeout_s: float, env: dict[str, str], seed: int,
        concurrency: int, settle_s: float) -> dict[str, float]:
    """One configuration: its failed writes, those that landed late, the latest landing."""
    import numpy as np

    from lw.lab.synthetic.netem import Link
    from lw.transport.dataplane.mooncake import MooncakeDataPlane

    with Link(loss=loss, seed=seed) as link:
        rx = subprocess.Popen([sys.executable, "-c", _RX, link.name, link.ns_ip, str(BLOCK),
                               str(BLOCKS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, **env})
        assert rx.stdin is not None and rx.stdout is not None
        port, base = map(int, rx.stdout.readline().split())
        dp = MooncakeDataPlane(link.host_ip, timeout_s, env=env)
        src = np.zeros(BLOCK * writes, np.uint8)
        for k in range(writes):
            src[k * BLOCK:(k + 1) * BLOCK] = (k % 251) + 1
        dp.register_memory(src.ctypes.data, src.nbytes)
        session = f"{link.ns_ip}:{port}"
        dp.connect(session)
        reported: dict[int, tuple[bool, float]] = {}
        nxt = 0
        while len(reported) < writes:
            while nxt < writes and nxt - len(reported) < concurrency:
                dp.submit(nxt, session, [(src.ctypes.data + nxt * BLOCK,
                                          base + (nxt % BLOCKS) * BLOCK, BLOCK)])
                nxt += 1
            select.select([dp.fileno()], [], [], 0.05)
            for c in dp.poll():
                reported[int(c.xfer_id)] = (c.ok, time.monotonic())  # type: ignore[arg-type]
        time.sleep(settle_s)  # late bytes keep coming: watch them this long after the last
        rx.stdin.close()
        changes = json.loads(rx.stdout.readline())
        rx.wait(30)
        dp.close()
    failed = {k: t for k, (ok, t) in reported.items() if not ok}
    late = [t - failed[b] for b, t in changes if b in failed and t > failed[b]]
    late_writes = {b for b, t in changes if b in failed and t > failed[b]}
    return {"writes": writes, "failed": len(failed), "late_writes": len(late_writes),
            "latest_s": max(late, default=0.0)}


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loss", type=float, default=0.3)
    ap.add_argument("--writes", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=10.0, help="lw's transfer timeout (s)")
    ap.add_argument("--concurrency", type=int, default=32, help="writes in flight at once")
    ap.add_argument("--settle", type=float, default=60.0,
                    help="seconds to watch for late bytes after the last report")
    ap.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE",
                    help="MC_* variables for both engines (a second configuration)")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args(argv)
    if args.writes > BLOCKS:
        ap.error(f"--writes must be <= {BLOCKS}")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    extra = dict(kv.split("=", 1) for kv in args.env)
    configs = [("defaults", {})] + ([("with " + " ".join(args.env), extra)] if extra else [])
    for rep in range(args.repeats):
        for name, env in (configs if rep % 2 == 0 else list(reversed(configs))):
            r = run(args.loss, args.writes, args.timeout, env, rep, args.concurrency,
                    args.settle)
            print(f"repeat {rep + 1} {name}: loss {args.loss}, {r['writes']} writes of 64 KiB, "
                  f"{r['failed']} reported failed, {r['late_writes']} of those landed after "
                  f"their report, the latest {r['latest_s']:.1f} s after it", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
