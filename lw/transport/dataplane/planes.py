"""Which data planes D can fence: the one statement the vLLM adapter's D settings, the synthetic
cluster and the checker's plane models follow (tests/transport/test_planes.py holds
``lw.sim.config.PLANES`` to it; ``lw.sim`` itself imports nothing of the transport)."""

from __future__ import annotations

__all__ = ["PLANE_NAMES", "can_fence"]

PLANE_NAMES = ("mooncake", "nixl", "inprocess")
"""Every data plane lw has (the vLLM adapter runs the first two)."""


def can_fence(plane: str, protocol: str = "tcp", device: str = "") -> bool:
    """Whether D can cut a failed sender's in-flight writes to it on ``plane`` (so a lease's
    end waits for that fence): Mooncake over TCP only (``lw.transport.dataplane.fence``: lw
    cuts the TCP connections; RDMA has none of lw's to cut); NIXL is lease-only until a fence
    is measured to hold (none did: docs/benchmarks.md, late landings); the in-process plane
    has no bytes in flight. A running Mooncake plane that cannot tell its listening ports
    apart still runs lease-only (its ``can_fence``)."""
    if plane not in PLANE_NAMES:
        raise ValueError(f"unknown data plane {plane!r} (one of {', '.join(PLANE_NAMES)})")
    return plane == "mooncake" and protocol.strip().lower() == "tcp" and not device
