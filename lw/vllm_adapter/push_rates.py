"""What a P worker measures for ``push_mode`` "auto" and reports to the scheduler: seconds of
forward per prompt token, and per decode host seconds of wire per KV block.

The forward is timed from the step's metadata to its last layer being computed (on a device,
when the ready gate sees that layer's kernels finish), over steps that push something and
compute at least ``min_tokens``; the wire from the WorkerLoop's :class:`LinkMeter` goodput.
"""

from __future__ import annotations

import threading

from lw.vllm_adapter.connector_meta import LwWorkerMeta

__all__ = ["PushRates"]


class PushRates:
    """Averages of the forward's seconds per token; the worker meta made from them."""

    def __init__(self, bytes_per_block: int, alpha: float = 0.3, min_tokens: int = 32) -> None:
        if bytes_per_block < 1:
            raise ValueError(f"bytes_per_block must be >= 1, got {bytes_per_block}")
        self.bytes_per_block = bytes_per_block
        self.alpha = alpha
        self.min_tokens = min_tokens
        self.compute_s_per_token: float | None = None
        self._lock = threading.Lock()  # the ready gate's thread and the engine's both time

    def forward_done(self, seconds: float, tokens: int) -> None:
        """A forward of ``tokens`` tokens took ``seconds`` (to its last layer)."""
        if tokens < self.min_tokens or seconds <= 0:
            return
        x = seconds / tokens
        with self._lock:
            old = self.compute_s_per_token
            self.compute_s_per_token = x if old is None else old + self.alpha * (x - old)

    def meta(self, goodput: dict[str, float]) -> LwWorkerMeta | None:
        """The figures for the scheduler, every step once something is measured: vLLM combines
        the workers' reports of one step, so a worker that stayed silent would let a faster
        worker's figures stand for the slowest's."""
        c = self.compute_s_per_token
        if c is None and not goodput:
            return None
        wire = {h: self.bytes_per_block / g for h, g in goodput.items() if g > 0}
        return LwWorkerMeta(c, wire)
