"""Where lw's transport threads run: the worker loop, the data plane's senders, and the IO
threads Mooncake and ZMQ start inside their libraries.

A thread inherits the CPU affinity of the thread that starts it, and vLLM's CPU workers pin
their main thread to the forward's cores; so without this lw's threads share those cores with
threads that busy-wait (vLLM's shared-memory broadcast spins with ``sched_yield`` for a second
after each read). Measured on a 2-core machine with P TP 2 -> D TP 1 (D sharing a core with P
rank 1): D's Mooncake and ZMQ IO threads left P rank 0's bytes unread for 30 s at a time while
P rank 1 spun on their core, and requests failed on P's deadline.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

__all__ = ["parse_cpus", "transport_threads"]

log = logging.getLogger("lw.vllm_adapter")


def parse_cpus(spec: str) -> frozenset[int] | None:
    """``transport_cpus`` as a CPU set: "all" (every online CPU), "inherit" (None: the starting
    thread's affinity, as vLLM pinned it) or a list such as "0,2-3"; ValueError otherwise."""
    text = spec.strip().lower()
    if text == "inherit":
        return None
    if text == "all":
        return _online_cpus()
    return _cpu_list(text, spec)


def _online_cpus() -> frozenset[int]:
    """Every online CPU (their numbers need not be contiguous); the kernel narrows a thread's
    affinity to its cpuset."""
    try:
        with open("/sys/devices/system/cpu/online") as f:
            return _cpu_list(f.read().strip(), "online CPUs")
    except (OSError, ValueError):
        return frozenset(range(os.cpu_count() or 1))


def _cpu_list(text: str, spec: str) -> frozenset[int]:
    """A list such as "0,2-3" as a set; ValueError naming ``spec`` otherwise."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"not a CPU list: {spec!r} (\"all\", \"inherit\" or e.g. "
                             "\"0,2-3\")") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part.strip()!r} in {spec!r}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


@contextlib.contextmanager
def transport_threads(cpus: frozenset[int] | None) -> Iterator[None]:
    """Threads started inside this block run on ``cpus`` (None: unchanged); the calling
    thread's own affinity is restored at the end."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)  # 0: the calling thread (Linux)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:  # a cpuset without these CPUs: keep vLLM's placement
        log.warning("lw: transport_cpus %s not usable here (%s); lw's threads stay on %s",
                    sorted(cpus), exc, sorted(before))
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
