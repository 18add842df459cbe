"""Subprocess peer for the data-plane tests (Mooncake, or NIXL with ``--plane nixl``): registers
a buffer and answers checksums.

Prints one JSON line ``{"session", "addr", "size"}`` on stdout, then serves stdin commands:
``sha <offset> <length>`` -> sha256 hex of that slice; ``zero`` -> clears the buffer; ``quit``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from typing import Any

import numpy as np


def _plane(kind: str, host: str) -> Any:
    if kind == "nixl":
        from lw.transport.dataplane.nixl import NixlDataPlane
        return NixlDataPlane(host)
    from lw.transport.dataplane import MooncakeDataPlane
    return MooncakeDataPlane(host)


def main() -> None:
    """Register the buffer (whole, or as two adjacent halves with --split) and serve commands."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, default=16 << 20)
    parser.add_argument("--split", action="store_true")
    parser.add_argument("--host", default="127.0.0.1", help="address peers reach the plane on")
    parser.add_argument("--plane", choices=("mooncake", "nixl"), default="mooncake")
    args = parser.parse_args()
    plane = _plane(args.plane, args.host)
    buf = np.zeros(args.size, dtype=np.uint8)
    addr = buf.ctypes.data
    if args.split:
        half = args.size // 2
        plane.register_memory(addr, half)
        plane.register_memory(addr + half, args.size - half)
    else:
        plane.register_memory(addr, args.size)
    print(json.dumps({"session": plane.session, "addr": addr, "size": args.size}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "sha":
            off, length = int(cmd[1]), int(cmd[2])
            print(hashlib.sha256(buf[off : off + length].tobytes()).hexdigest(), flush=True)
        elif cmd[0] == "zero":
            buf[:] = 0
            print("ok", flush=True)
        elif cmd[0] == "quit":
            break
    plane.close()


if __name__ == "__main__":
    main()
