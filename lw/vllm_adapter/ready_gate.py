"""cuda/npu: a thread that reports a layer computed to lw's loop only once its kernels have
finished (the forward's hook returns at once; a CPU forward needs none of this)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lw.transport.osthread import name_os_thread
from lw.vllm_adapter.connector_meta import log

if TYPE_CHECKING:
    from lw.transport.runtime import WorkerLoop

__all__ = ["ReadyGate"]


class ReadyGate:
    """cuda/npu: forwards a layer's event to the loop once its kernels have finished."""

    def __init__(self, loop: WorkerLoop) -> None:
        self._loop = loop
        self._q: queue.SimpleQueue[
            tuple[Any, tuple[int, ...], list[str], Callable[[], None] | None] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._run, name="lw-ready-gate", daemon=True)
        self._thread.start()

    def put(self, wait: Any, planes: tuple[int, ...], tids: list[str],
            then: Callable[[], None] | None = None) -> None:
        """Queue (never blocks); ``then`` runs once the layer is ready (the forward's timing)."""
        self._q.put((wait, planes, tids, then))

    def close(self) -> None:
        """Stop after the queued items."""
        self._q.put(None)

    def _run(self) -> None:
        name_os_thread()
        while (item := self._q.get()) is not None:
            wait, planes, tids, then = item
            try:
                if wait is not None:
                    wait()
            except Exception as exc:  # noqa: BLE001 - the layer may be incomplete: never send it
                log.error("lw: waiting for layer planes %s failed: %r; aborting %d pushes",
                          planes, exc, len(tids))
                for tid in tids:
                    self._loop.call("abort", tid, f"device wait failed: {exc!r}")
                continue
            for i in planes:
                self._loop.layer_computed(i, tids)
            if then is not None:
                then()
