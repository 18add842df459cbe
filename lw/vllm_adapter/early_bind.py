"""P: D's params for a request computed ahead reach the worker mid-step, when the worker runs in
the scheduler's process (vLLM's one-process executor: TP 1 without DP). The scheduler's fetch
thread hands the bind to the worker at once, instead of with the next step's metadata, so the
writes of the layers computed so far start while the step still computes; the metadata brings
the same bind anyway (a worker in another process takes that one, one that bound already
ignores it). Measured cause: a multi-chunk prompt's writes started a chunk late."""

from __future__ import annotations

import threading
from typing import Any

from lw.vllm_adapter.connector_meta import BindSpec

__all__ = ["deliver", "engine_key", "register", "unregister"]

_workers: dict[tuple[str, int], Any] = {}
_lock = threading.Lock()


def engine_key(engine_id: str, dp_rank: int) -> tuple[str, int]:
    """What the scheduler and its TP-1 worker both know of their engine."""
    return engine_id, dp_rank


def register(key: tuple[str, int], worker: Any) -> None:
    """``worker`` (a WorkerSide with ``bind_now``) takes binds for its engine from now on."""
    with _lock:
        _workers[key] = worker


def unregister(key: tuple[str, int], worker: Any) -> None:
    """``worker`` stopped: binds go by the metadata only."""
    with _lock:
        if _workers.get(key) is worker:
            del _workers[key]


def deliver(key: tuple[str, int], spec: BindSpec) -> bool:
    """Bind ``spec`` in the engine's worker now, if it is in this process and holds the
    request; False otherwise (the next step's metadata carries it)."""
    with _lock:
        worker = _workers.get(key)
    return worker is not None and worker.bind_now(spec)
