"""What the fault table's userspace lossy link lets through: one raw TCP stream against
Mooncake's TCP transport, side by side, at each loss rate.

Each configuration puts a receiver in the decoder's namespace behind :class:`lw.lab.synthetic.
netem.Link` (two TUN devices and a relay dropping ``loss`` of the packets each way) and moves
2 MiB units from this side for ``--seconds``: raw TCP as one stream of 64 KiB sends; Mooncake as
``batch_transfer_sync_write`` batches of 32 x 64 KiB entries (the synthetic engine's request:
8 layers x 4 blocks x 64 KiB). It prints MiB/s and, for Mooncake, each batch's time (p50, max,
failed). Loss rates are rotated per repeat. The raw stream is the link's physical limit; the
gap to it is the transport's. Needs root, ``/dev/net/tun`` and Mooncake.

``PYTHONPATH=$PWD .venv/bin/python benchmarks/link_transport.py [--loss 0.05 0.1 0.3]
[--repeats 2] [--seconds 20]``
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

ENTRY = 64 << 10
UNIT = 2 << 20  # one synthetic request's KV

# The receiving Mooncake engine, inside the decoder's namespace: prints its RPC port and the
# address of the region it registered, then waits to be killed.
_MOONCAKE_RX = r"""
import sys, time
import numpy as np
from lw.lab.synthetic import netns
netns.enter(sys.argv[1])
from mooncake.engine import TransferEngine
e = TransferEngine()
assert e.initialize(sys.argv[2], "P2PHANDSHAKE", "tcp", "") == 0
buf = np.zeros(16 << 20, np.uint8)
assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
print(e.get_rpc_port(), buf.ctypes.data, flush=True)
time.sleep(3600)
"""


def raw_tcp(link: object, seconds: float) -> dict[str, float]:
    """One TCP stream from this side into the namespace for ``seconds``: MiB/s received."""
    from lw.lab.synthetic.netem import in_netns

    srv = in_netns(link.name, lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    srv.bind((link.ns_ip, 0))
    srv.listen(1)
    got = [0]

    def rx() -> None:
        conn, _ = srv.accept()
        with conn:
            while chunk := conn.recv(1 << 20):
                got[0] += len(chunk)

    t = threading.Thread(target=rx, daemon=True)
    t.start()
    cl = socket.create_connection((link.ns_ip, srv.getsockname()[1]), timeout=60.0)
    cl.settimeout(1.0)  # a send that waits on the link is retried until the time is up
    buf = b"\0" * ENTRY
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        try:
            cl.send(buf)
        except TimeoutError:
            pass
    elapsed = time.monotonic() - t0
    moved = got[0]
    cl.close()
    srv.close()
    return {"mib_s": moved / elapsed / (1 << 20)}


def mooncake(link: object, seconds: float) -> dict[str, float]:
    """2 MiB batches of 64 KiB entries into the namespace for ``seconds``."""
    import numpy as np
    from mooncake.engine import TransferEngine

    rx = subprocess.Popen([sys.executable, "-c", _MOONCAKE_RX, link.name, link.ns_ip],
                          stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout is not None
        port, base = map(int, rx.stdout.readline().split())
        e = TransferEngine()
        assert e.initialize(link.host_ip, "P2PHANDSHAKE", "tcp", "") == 0
        src = np.ones(UNIT, np.uint8)
        assert e.register_memory(src.ctypes.data, src.nbytes) == 0
        k = UNIT // ENTRY
        srcs = [src.ctypes.data + j * ENTRY for j in range(k)]
        dsts = [base + j * ENTRY for j in range(k)]
        times, failed = [], 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < seconds:
            t1 = time.monotonic()
            rc = e.batch_transfer_sync_write(f"{link.ns_ip}:{port}", srcs, dsts, [ENTRY] * k)
            times.append(time.monotonic() - t1)
            failed += rc != 0
        elapsed = time.monotonic() - t0
        moved = (len(times) - failed) * UNIT
        return {"mib_s": moved / elapsed / (1 << 20), "p50_s": statistics.median(times),
                "max_s": max(times), "batches": len(times), "failed": failed}
    finally:
        rx.kill()
        rx.wait()


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loss", type=float, nargs="+", default=[0.05, 0.1, 0.3])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args(argv)
    # Mooncake gives a stalled write up after its own timeout: past the run, so each stall shows
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, int(args.seconds) + 10)))
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    from lw.lab.synthetic.netem import Link, unavailable

    why = unavailable()
    if why:
        print(f"link_transport: cannot make the link here: {why}", file=sys.stderr)
        return 2
    rows: dict[float, list[tuple[dict[str, float], dict[str, float]]]] = {}
    for rep in range(args.repeats):
        order = args.loss if rep % 2 == 0 else list(reversed(args.loss))
        for loss in order:
            with Link(loss=loss, seed=rep) as link:
                tcp = raw_tcp(link, args.seconds)
            with Link(loss=loss, seed=rep) as link:
                mc = mooncake(link, args.seconds)
            rows.setdefault(loss, []).append((tcp, mc))
            print(f"repeat {rep + 1} loss {loss:.2f}: raw TCP {tcp['mib_s']:.2f} MiB/s, "
                  f"Mooncake {mc['mib_s']:.2f} MiB/s ({mc['batches']:.0f} batches of 2 MiB, "
                  f"{mc['failed']:.0f} failed, p50 {mc['p50_s']:.2f} s, max {mc['max_s']:.2f} s)",
                  flush=True)
    print("\n| loss each way | raw TCP MiB/s | Mooncake MiB/s | Mooncake / raw | 2 MiB batch max |")
    print("|---|---|---|---|---|")
    for loss in args.loss:
        tcp = [t["mib_s"] for t, _ in rows[loss]]
        mcs = [m["mib_s"] for _, m in rows[loss]]
        ratio = [m / t if t else 0.0 for t, m in zip(tcp, mcs, strict=True)]
        print(f"| {loss:.2f} | {min(tcp):.1f}-{max(tcp):.1f} | {min(mcs):.2f}-{max(mcs):.2f} | "
              f"{min(ratio):.4f}-{max(ratio):.4f} | "
              f"{max(m['max_s'] for _, m in rows[loss]):.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
