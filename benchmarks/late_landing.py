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
variables, e.g. ``MC_TCP_PROGRESS_TIMEOUT_SEC=10``). With ``--fence`` the receiver, once every
write is reported (D's lease expiring after the failures), fences inbound Mooncake connections
from this side's address (:func:`lw.transport.dataplane.fence.fence_inbound`), and the report
adds how many block changes came after the fence completed; ``--sender-close`` makes this side
close its data plane first (dropping its Mooncake engine and the failed writes it still holds),
as a fence alone does not stop an engine that resends them on new connections. Both processes read
CLOCK_MONOTONIC, which one host shares across namespaces. Needs root, ``/dev/net/tun`` and
Mooncake.

``PYTHONPATH=$PWD .venv/bin/python benchmarks/late_landing.py [--loss 0.3] [--writes 200]
[--timeout 10] [--env NAME=VALUE ...] [--fence] [--sender-close]``
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
# of every block each few ms, records (block, time seen, start of the sample before: it landed
# after that) of every change; on a stdin line
# "fence <ip>" fences inbound Mooncake connections from <ip> and prints "fenced <done at> <ok>
# <connections cut> <seconds>"; prints the changes as JSON when its stdin closes.
_RX = r"""
import json, sys, threading, time
import numpy as np
from lw.lab.synthetic import netns
netns.enter(sys.argv[1])
from mooncake.engine import TransferEngine
from lw.transport.dataplane.fence import fence_inbound, listening_ports
BLOCK, BLOCKS = int(sys.argv[3]), int(sys.argv[4])
e = TransferEngine()
before = listening_ports()
assert e.initialize(sys.argv[2], "P2PHANDSHAKE", "tcp", "") == 0
ports = listening_ports() - before
buf = np.zeros(BLOCK * BLOCKS, np.uint8)
assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
print(e.get_rpc_port(), buf.ctypes.data, flush=True)
words = buf.view(np.uint64).reshape(BLOCKS, BLOCK // 8)
cols = [0, BLOCK // 16, BLOCK // 8 - 1]
seen = words[:, cols].copy()
changes = []
stop = threading.Event()
def commands():
    for line in sys.stdin:
        if line.startswith("fence "):
            r = fence_inbound(line.split()[1], ports, 10.0)
            print("fenced", time.monotonic(), int(r.ok), len(r.cut), r.elapsed_s, flush=True)
    stop.set()
threading.Thread(target=commands, daemon=True).start()
prev = time.monotonic()
while not stop.is_set():
    started = time.monotonic()
    now = words[:, cols]
    diff = np.nonzero((now != seen).any(axis=1))[0]
    if len(diff):
        t = time.monotonic()
        changes += [(int(b), t, prev) for b in diff]
        seen = now.copy()
    prev = started
    time.sleep(0.002)
print(json.dumps(changes), flush=True)
"""


def run(loss: float, writes: int, timeout_s: float, env: dict[str, str], seed: int,
        concurrency: int, settle_s: float, fence: bool = False,
        sender_close: bool = False, fence_after_s: float = 0.0) -> dict[str, float]:
    """One configuration: its failed writes, those that landed late, the latest landing (and
    with ``fence``, the fence's outcome and the block changes after it completed)."""
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
        if sender_close:  # P drops its engine, and with it the writes Mooncake still holds
            dp.close()
        fenced: list[str] = []
        if fence:  # every write is reported: D's lease on the failed ones runs out now
            time.sleep(fence_after_s)  # (or this much later: the rest of a longer lease)
            rx.stdin.write(f"fence {link.host_ip}\n")
            rx.stdin.flush()
            fenced = rx.stdout.readline().split()
            assert fenced and fenced[0] == "fenced", fenced
        time.sleep(settle_s)  # late bytes keep coming: watch them this long after the last
        rx.stdin.close()
        changes = json.loads(rx.stdout.readline())
        rx.wait(30)
        dp.close()
    failed = {k: t for k, (ok, t) in reported.items() if not ok}
    late = [t - failed[b] for b, t, _ in changes if b in failed and t > failed[b]]
    late_writes = {b for b, t, _ in changes if b in failed and t > failed[b]}
    out = {"writes": writes, "failed": len(failed), "late_writes": len(late_writes),
           "latest_s": max(late, default=0.0)}
    if fenced:
        done = float(fenced[1])
        out.update(fence_ok=float(fenced[2]), fence_cut=float(fenced[3]),
                   fence_s=float(fenced[4]),
                   # landed after the fence for sure / maybe (seen after it, sample began before)
                   after_fence=sum(1 for _, _, lo in changes if lo > done),
                   around_fence=sum(1 for _, t, lo in changes if t > done >= lo))
    return out


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
    ap.add_argument("--fence", action="store_true",
                    help="the receiver fences inbound connections once every write is reported")
    ap.add_argument("--fence-after", type=float, default=0.0, metavar="S",
                    help="with --fence: fence this many seconds after the last report (what "
                         "is left of D's lease then)")
    ap.add_argument("--sender-close", action="store_true",
                    help="this side closes its data plane (and engine) once every write is "
                    "reported, before any fence")
    args = ap.parse_args(argv)
    if args.writes > BLOCKS:
        ap.error(f"--writes must be <= {BLOCKS}")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    extra = dict(kv.split("=", 1) for kv in args.env)
    configs = [("defaults", {})] + ([("with " + " ".join(args.env), extra)] if extra else [])
    for rep in range(args.repeats):
        for name, env in (configs if rep % 2 == 0 else list(reversed(configs))):
            r = run(args.loss, args.writes, args.timeout, env, rep, args.concurrency,
                    args.settle, args.fence, args.sender_close, args.fence_after)
            line = (f"repeat {rep + 1} {name}: loss {args.loss}, {r['writes']} writes of 64 KiB, "
                    f"{r['failed']} reported failed, {r['late_writes']} of those landed after "
                    f"their report, the latest {r['latest_s']:.1f} s after it")
            if "fence_s" in r:
                line += (f"; fence {'ok' if r['fence_ok'] else 'NOT ok'} in "
                         f"{r['fence_s'] * 1e3:.0f} ms, {r['fence_cut']:.0f} connections cut, "
                         f"{r['after_fence']:.0f} block changes after it completed "
                         f"({r['around_fence']:.0f} more seen after it by a sample begun "
                         "before it)")
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
