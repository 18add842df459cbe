"""Give the calling thread its Python name at the OS level too (``top -H``, ``/proc/*/comm``).

vLLM's worker process names itself ``VLLM::Worker`` and every thread inherits that, so without
this lw's loop and data-plane senders cannot be told from the forward pass in ``top`` or in
``benchmarks/push_cpu.py``'s per-thread CPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

_PR_SET_NAME = 15


def _prctl() -> object | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl
    except (OSError, AttributeError):
        return None  # not Linux: names stay Python-only


_PRCTL = _prctl()


def name_os_thread(name: str | None = None) -> None:
    """Set the OS name of the calling thread (at most 15 bytes; longer names keep their end,
    which tells peers and ranks apart) to ``name`` or its ``threading`` name."""
    if _PRCTL is None:
        return
    raw = (name or threading.current_thread().name).encode("utf-8", "replace")
    if len(raw) > 15:
        raw = raw[:3] + raw[-12:]
    _PRCTL(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0)  # type: ignore[operator]
