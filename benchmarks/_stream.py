"""A plain TCP byte stream through a benchmark link, paced at a given rate: the floor of what
moving a prompt's KV during its prefill costs the prefill's core, with no transfer engine.

``ByteStream.start(link, rate_bps)`` runs a receiver in the link's namespace on D's core and a
sender in the root namespace on P's core (``benchmarks/_pin.CORES``); the sender writes
``rate_bps`` in bursts every ``TICK_S`` until ``stop()``, which returns the bytes the receiver
got. ``single-stream`` in ``benchmarks/serving.py`` runs the single server beside it: the
single server's TTFT under the bytes any push overlapping its prefill must move on its core.

``python benchmarks/_stream.py recv`` / ``send HOST PORT RATE_BPS`` are the two processes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from typing import Any

TICK_S = 0.005
"""The sender's pacing period: a burst of ``rate x TICK_S`` bytes each tick (about the
wake-ups of a push batched per layer group, fewer than a per-write one)."""

SOURCE_BYTES = 64 << 20
"""The sender reads its bursts in turn from a buffer this large, as a push reads a prompt's KV
(32 MiB at 1,024 tokens of the benchmark's model) from memory no cache holds, not from one
small buffer the cache keeps."""


def _recv() -> None:
    """Receiver: print the listening port, count bytes until the sender closes, print them and
    the time from the first to the last."""
    srv = socket.create_server(("0.0.0.0", 0))
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    buf = bytearray(1 << 20)
    total = 0
    first = last = 0.0
    with conn:
        while k := conn.recv_into(buf):
            last = time.monotonic()
            first = first or last
            total += k
    print(total, last - first, flush=True)


def _send(host: str, port: int, rate_bps: float) -> None:
    """Sender: ``rate_bps`` bits per second in one burst per tick, until killed."""
    burst = min(max(1, int(rate_bps / 8 * TICK_S)), SOURCE_BYTES)
    source = memoryview(bytearray(os.urandom(1 << 20)) * (SOURCE_BYTES >> 20))
    at = 0
    with socket.create_connection((host, port), timeout=10.0) as c:
        c.settimeout(None)
        print("connected", flush=True)
        due = time.monotonic()
        while True:
            if at + burst > SOURCE_BYTES:
                at = 0
            c.sendall(source[at:at + burst])
            at += burst
            due += TICK_S
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            elif pause < -1.0:  # the link is slower than the rate: do not burst to catch up
                due = time.monotonic()


class ByteStream:
    """A running sender/receiver pair (see the module docstring)."""

    def __init__(self, recv: subprocess.Popen[str], send: subprocess.Popen[str]) -> None:
        self._recv, self._send = recv, send

    @classmethod
    def start(cls, link: Any, rate_bps: float, send_core: int, recv_core: int) -> ByteStream:
        """Start the pair across ``link`` (a ``benchmarks._link.Link``); returns once the
        sender is connected and its buffer made (seconds on a loaded machine)."""
        py = [sys.executable, os.path.abspath(__file__)]
        recv = subprocess.Popen(link.wrap(["taskset", "-c", str(recv_core), *py, "recv"]),
                                stdout=subprocess.PIPE, text=True)
        assert recv.stdout is not None
        port = int(recv.stdout.readline())
        send = subprocess.Popen(["taskset", "-c", str(send_core), *py, "send", link.ns_addr,
                                 str(port), str(rate_bps)], stdout=subprocess.PIPE, text=True)
        assert send.stdout is not None
        if send.stdout.readline().strip() != "connected":
            send.kill()
            recv.kill()
            raise RuntimeError("byte stream: the sender did not connect")
        return cls(recv, send)

    @property
    def sender_pid(self) -> int:
        """The sender's process id (its CPU is the stream's cost on P's core)."""
        return self._send.pid

    def stop(self) -> float:
        """Stop both; the receiver's goodput from its first byte to its last, bits per second
        (0 if it got none)."""
        self._send.terminate()
        self._send.wait(10)
        try:
            out, _ = self._recv.communicate(timeout=10)
            total, span = out.split()[-2:]
        except (subprocess.TimeoutExpired, ValueError):
            self._recv.kill()
            return 0.0
        return int(total) * 8 / float(span) if float(span) > 0 else 0.0


if __name__ == "__main__":
    if sys.argv[1:2] == ["recv"]:
        _recv()
    elif sys.argv[1:2] == ["send"] and len(sys.argv) == 5:
        _send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    else:
        sys.exit(f"usage: {sys.argv[0]} recv | send HOST PORT RATE_BPS")
