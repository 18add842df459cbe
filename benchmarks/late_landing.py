"""How long after lw's data plane (Mooncake, NIXL) reports a write failed can its bytes land?

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

``--data-plane nixl`` runs both sides on :class:`~lw.transport.dataplane.nixl.NixlDataPlane`
(UCX over TCP: ``UCX_TLS=tcp``, ``UCX_NET_DEVICES`` the link's interface on each side; D under
``ip netns exec``, as UCX lists devices in sysfs); its ``--fence`` runs one candidate fence on D
(``--fence-kind``, see :data:`NIXL_FENCES`; ``none`` is the comparison). ``--fence-early`` fences
at the first failed report while the other writes are still in flight, and submits no more: a
block change after the fence returned is then a byte the fence did not stop.

``PYTHONPATH=$PWD .venv/bin/python benchmarks/late_landing.py [--loss 0.3] [--writes 200]
[--timeout 10] [--env NAME=VALUE ...] [--fence] [--sender-close] [--data-plane nixl
--fence-kind invalidate|deregister|cut|close|none --fence-early]``
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from typing import Any

BLOCK = 64 << 10
BLOCKS = 1024
NIXL_FENCES = ("none", "invalidate", "deregister", "cut", "close")
"""Candidate fences on NIXL, run by D: nothing (the comparison), remove P's agent
(``remove_remote_agent``: NIXL disconnects), deregister the memory P writes into, cut every TCP
connection with P's host (:func:`~lw.transport.dataplane.fence.fence_inbound` on all of D's
ports), destroy D's agent."""

# The receiver: registers BLOCKS zeroed blocks, prints "port base", then samples three words
# of every block each few ms, records (block, time seen, start of the sample before: it landed
# after that) of every change; on a stdin line
# "fence <ip>" fences inbound Mooncake connections from <ip> and prints "fenced <done at> <ok>
# <connections cut> <seconds>"; prints the changes as JSON when its stdin closes.
_WATCH = r"""
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
"""Both receivers' tail: run ``commands`` on a thread, and sample every block's words each 2 ms
until stdin closes; print the changes seen as JSON."""

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
"""

# The NIXL receiver: registers BLOCKS zeroed blocks with a NixlDataPlane (UCX over TCP on the
# namespace's interface), prints "session base", samples as the Mooncake receiver does; on
# "meet <sender metadata, hex>" loads the sender's metadata (so that "invalidate" has an agent
# to remove) and prints "met"; on "fence <kind> <sender ip> <sender agent>" runs one candidate fence
# and prints "fenced <done at> <ok> <count> <seconds>".
_RX_NIXL = r"""
import gc, json, sys, threading, time
import numpy as np
from lw.lab.synthetic import netns
netns.enter(sys.argv[1])
from lw.transport.dataplane.nixl import NixlDataPlane
from lw.transport.dataplane.fence import fence_inbound, tcp_sockets
BLOCK, BLOCKS = int(sys.argv[3]), int(sys.argv[4])
dp = NixlDataPlane(sys.argv[2], 30.0, connect_timeout_s=30.0)
buf = np.zeros(BLOCK * BLOCKS, np.uint8)
dp.register_memory(buf.ctypes.data, buf.nbytes)
print(dp.session, buf.ctypes.data, flush=True)
words = buf.view(np.uint64).reshape(BLOCKS, BLOCK // 8)
cols = [0, BLOCK // 16, BLOCK // 8 - 1]
seen = words[:, cols].copy()
changes = []
stop = threading.Event()
def fence(kind, ip, agent):
    if kind == "none":
        return True, 0
    if kind == "invalidate":  # forget the sender's metadata: NIXL disconnects from it
        dp.agent.remove_remote_agent(agent)
        return True, 1
    if kind == "deregister":  # the memory the writer targets is no longer registered
        for reg in dp._regs:
            dp.agent.deregister_memory(reg, ["UCX"])
        n = len(dp._regs)
        dp._regs.clear()
        return True, n
    if kind == "cut":  # tcp_disconnect every TCP connection of this process with the sender
        socks = tcp_sockets()
        ports = {s.local_port for s in socks if s.remote_ip == ip or not s.remote_ip}
        r = fence_inbound(ip, ports, 10.0)
        return r.ok, len(r.cut)
    if kind == "close":  # destroy the agent (its UCX worker, every endpoint and socket)
        dp.close()
        gc.collect()
        return True, 1
    raise ValueError(kind)
def commands():
    for line in sys.stdin:
        w = line.split()
        if w[0] == "meet":  # P's metadata handed over here, not fetched across the link
            name = dp.agent.add_remote_agent(bytes.fromhex(w[1]))
            print("met", int(dp.agent.check_remote_metadata(name)), flush=True)
        elif w[0] == "fence":
            t0 = time.monotonic()
            try:
                ok, n = fence(w[1], w[2], w[3])
            except Exception as exc:
                print("fence error", repr(exc), file=sys.stderr, flush=True)
                ok, n = False, 0
            done = time.monotonic()
            print("fenced", done, int(ok), n, done - t0, flush=True)
    stop.set()
"""


def run(loss: float, writes: int, timeout_s: float, env: dict[str, str], seed: int,
        concurrency: int, settle_s: float, fence: bool = False,
        sender_close: bool = False, fence_after_s: float = 0.0, plane: str = "mooncake",
        fence_kind: str = "cut", fence_early: bool = False) -> dict[str, float]:
    """One configuration: its failed writes, those that landed late, the latest landing (and
    with ``fence``, the fence's outcome and the block changes after it completed)."""
    import numpy as np

    from lw.lab.synthetic.netem import Link

    with Link(loss=loss, seed=seed) as link:
        dp: Any
        if plane == "nixl":
            from lw.transport.dataplane.nixl import NixlDataPlane

            # UCX over TCP on the link's interface only (else it takes shared memory or lo)
            rx_env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": link.ns_if, **env}
            tx_env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": link.host_if, **env}
            # ends at once: NIXL's agent teardown is not what is measured
            script = _RX_NIXL + _WATCH + "import os\nos._exit(0)\n"
        else:
            from lw.transport.dataplane.mooncake import MooncakeDataPlane

            rx_env = tx_env = env
            script = _RX + _WATCH
        # NIXL's D under ``ip netns exec``: UCX lists devices in /sys/class/net, which only a
        # sysfs mounted in the namespace shows
        wrap = ["ip", "netns", "exec", link.name] if plane == "nixl" else []
        rx = subprocess.Popen([*wrap, sys.executable, "-c", script, link.name, link.ns_ip,
                               str(BLOCK), str(BLOCKS)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, **rx_env})
        assert rx.stdin is not None and rx.stdout is not None
        where, base_text = rx.stdout.readline().split()
        base = int(base_text)
        if plane == "nixl":
            dp = NixlDataPlane(link.host_ip, timeout_s, env=tx_env, connect_timeout_s=30.0)
            session = where
            if fence and fence_kind == "invalidate":  # D must know P's agent to remove it
                rx.stdin.write(f"meet {dp.agent.get_agent_metadata().hex()}\n")
                rx.stdin.flush()
                met = rx.stdout.readline().split()
                assert met == ["met", "1"], met
        else:
            dp = MooncakeDataPlane(link.host_ip, timeout_s, env=tx_env)
            session = f"{link.ns_ip}:{where}"
        src = np.zeros(BLOCK * writes, np.uint8)
        for k in range(writes):
            src[k * BLOCK:(k + 1) * BLOCK] = (k % 251) + 1
        dp.register_memory(src.ctypes.data, src.nbytes)
        dp.connect(session)
        reported: dict[int, tuple[bool, float]] = {}
        nxt = 0
        t0 = time.monotonic()
        fenced: list[str] = []

        def fence_now() -> list[str]:
            rx.stdin.write(f"fence {fence_kind} {link.host_ip} {getattr(dp, 'name', '-')}\n"
                           if plane == "nixl" else f"fence {link.host_ip}\n")
            rx.stdin.flush()
            out = rx.stdout.readline().split()
            assert out and out[0] == "fenced", out
            return out

        while len(reported) < nxt or nxt < writes:
            while not fenced and nxt < writes and nxt - len(reported) < concurrency:
                dp.submit(nxt, session, [(src.ctypes.data + nxt * BLOCK,
                                          base + (nxt % BLOCKS) * BLOCK, BLOCK)])
                nxt += 1
            select.select([dp.fileno()], [], [], 0.05)
            for c in dp.poll():
                reported[int(c.xfer_id)] = (c.ok, time.monotonic())  # type: ignore[arg-type]
            if fence and fence_early and not fenced and not all(ok for ok, _ in
                                                                reported.values()):
                fenced = fence_now()  # the first failure: fence while the rest is in flight
            if fenced and len(reported) == nxt:
                break
        last_report = time.monotonic()
        span = last_report - t0
        if sender_close:  # P drops its engine, and with it the writes Mooncake still holds
            dp.close()
        if fence and not fenced:  # every write is reported: D's lease on the failed ones ends
            time.sleep(fence_after_s)  # (or this much later: the rest of a longer lease)
            fenced = fence_now()
        time.sleep(settle_s)  # late bytes keep coming: watch them this long after the last
        rx.stdin.close()
        changes = json.loads(rx.stdout.readline())
        rx.wait(30)
        dp.close()
    failed = {k: t for k, (ok, t) in reported.items() if not ok}
    late = [t - failed[b] for b, t, _ in changes if b in failed and t > failed[b]]
    late_writes = {b for b, t, _ in changes if b in failed and t > failed[b]}
    landed = {b for b, _, _ in changes if b in failed}
    out = {"writes": len(reported), "failed": len(failed), "late_writes": len(late_writes),
           "failed_landed": len(landed),
           "latest_s": max(late, default=0.0), "span_s": span,
           # what a fence at the last report would have to stop: changes seen after it
           "after_last": sum(1 for _, _, lo in changes if lo > last_report)}
    if fenced:
        done = float(fenced[1])
        out.update(fence_ok=float(fenced[2]), fence_cut=float(fenced[3]),
                   fence_s=float(fenced[4]),
                   # landed after the fence for sure / maybe (seen after it, sample began before)
                   after_fence=sum(1 for _, _, lo in changes if lo > done),
                   # failed writes of which nothing was seen before the fence returned
                   unlanded_at_fence=sum(1 for b in failed
                                         if not any(c[0] == b and c[1] <= done
                                                    for c in changes)),
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
    ap.add_argument("--data-plane", choices=("mooncake", "nixl"), default="mooncake",
                    help="lw's data plane on both sides (nixl: UCX over TCP on the link's "
                         "interfaces, UCX_TLS=tcp and UCX_NET_DEVICES)")
    ap.add_argument("--fence-kind", choices=NIXL_FENCES, default="cut",
                    help="with --data-plane nixl --fence: the candidate fence D runs")
    ap.add_argument("--fence-early", action="store_true",
                    help="with --fence: fence at the first failed report, while the other "
                         "writes are still in flight, and submit no more (every block change "
                         "after the fence returned is then a byte the fence did not stop)")
    args = ap.parse_args(argv)
    if args.writes > BLOCKS:
        ap.error(f"--writes must be <= {BLOCKS}")
    if args.data_plane == "nixl" and (args.repeats > 1 or args.env):
        # a second agent's UCX keeps the interfaces of the process's first (a link since gone)
        ap.error("--data-plane nixl runs one configuration once per process: repeat it in the "
                 "shell")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    extra = dict(kv.split("=", 1) for kv in args.env)
    configs = [("defaults", {})] + ([("with " + " ".join(args.env), extra)] if extra else [])
    for rep in range(args.repeats):
        for name, env in (configs if rep % 2 == 0 else list(reversed(configs))):
            r = run(args.loss, args.writes, args.timeout, env, rep, args.concurrency,
                    args.settle, args.fence, args.sender_close, args.fence_after,
                    args.data_plane, args.fence_kind, args.fence_early)
            kind = f" ({args.fence_kind})" if args.data_plane == "nixl" and args.fence else ""
            line = (f"repeat {rep + 1} {args.data_plane} {name}{kind}: loss {args.loss}, "
                    f"{r['writes']} writes of 64 KiB, "
                    f"{r['failed']} reported failed ({r['failed_landed']} of them landed at all), "
                    f"{r['late_writes']} of those landed after "
                    f"their report, the latest {r['latest_s']:.1f} s after it (all reported in "
                    f"{r['span_s']:.1f} s; {r['after_last']} block changes after the last "
                    "report)")
            if "fence_s" in r:
                cut = args.data_plane == "mooncake" or args.fence_kind == "cut"
                line += (f"; {r['unlanded_at_fence']:.0f} failed writes not seen at all by "
                         f"the fence's return; fence {'ok' if r['fence_ok'] else 'NOT ok'} in "
                         f"{r['fence_s'] * 1e3:.0f} ms, "
                         + (f"{r['fence_cut']:.0f} connections cut, " if cut else "")
                         + f"{r['after_fence']:.0f} block changes after it completed "
                         f"({r['around_fence']:.0f} more seen after it by a sample begun "
                         "before it)")
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
