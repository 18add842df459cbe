"""What a P worker measures for ``push_mode`` "auto" and reports to the scheduler: seconds of
forward per prompt token and per attended pair (lw.fsm.push_schedule), and per decode host
seconds of wire per KV block.

The forward is timed from the step's metadata to its last layer being computed (on a device,
when the ready gate sees that layer's kernels finish), over steps that compute at least
``min_tokens``; the wire from the WorkerLoop's :class:`LinkMeter` goodput.
"""

from __future__ import annotations

import threading

from lw.fsm.push_schedule import PushEstimate
from lw.vllm_adapter.connector_meta import LwWorkerMeta

__all__ = ["PushRates"]


class PushRates:
    """A least-squares fit of the forward's seconds to its tokens and attended pairs, older
    steps weighing less; the worker meta made from it."""

    def __init__(self, bytes_per_block: int, alpha: float = 0.3, min_tokens: int = 32) -> None:
        if bytes_per_block < 1:
            raise ValueError(f"bytes_per_block must be >= 1, got {bytes_per_block}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.bytes_per_block = bytes_per_block
        self.alpha = alpha
        self.min_tokens = min_tokens
        self.compute_s_per_token: float | None = None
        self.compute_s_per_pair = 0.0
        # Decayed sums of the normal equations: tokens², tokens x pairs, pairs², then tokens x
        # seconds and pairs x seconds. Pairs are counted in thousands to keep them comparable.
        self._s = [0.0] * 5
        self._lock = threading.Lock()  # the ready gate's thread and the engine's both time

    def forward_done(self, seconds: float, tokens: int, pairs: int = 0) -> None:
        """A forward of ``tokens`` tokens attending ``pairs`` (token, earlier token) pairs took
        ``seconds`` (to its last layer)."""
        if tokens < self.min_tokens or seconds <= 0 or pairs < 0:
            return
        n, p = float(tokens), pairs / 1e3
        keep = 1.0 - self.alpha
        with self._lock:
            s = [keep * v for v in self._s]
            for i, v in enumerate((n * n, n * p, p * p, n * seconds, p * seconds)):
                s[i] += v
            self._s = s
            self.compute_s_per_token, per_kpair = _fit(*s)
            self.compute_s_per_pair = per_kpair / 1e3

    def meta(self, goodput: dict[str, float]) -> LwWorkerMeta | None:
        """The figures for the scheduler, every step once something is measured: vLLM combines
        the workers' reports of one step, so a worker that stayed silent would let a faster
        worker's figures stand for the slowest's."""
        c = self.compute_s_per_token
        if c is None and not goodput:
            return None
        wire = {h: self.bytes_per_block / g for h, g in goodput.items() if g > 0}
        return LwWorkerMeta(c, wire, self.compute_s_per_pair)

    def estimate(self, goodput: float | None) -> PushEstimate:
        """The forward's rates with the wire of a link whose goodput (bytes/s) is ``goodput``
        (None or 0: not measured)."""
        wire = self.bytes_per_block / goodput if goodput else None
        return PushEstimate(self.compute_s_per_token, wire, self.compute_s_per_pair)


def _fit(snn: float, snp: float, spp: float, sny: float, spy: float) -> tuple[float, float]:
    """Non-negative (per token, per pair) minimising the weighted squared error. Where the steps
    seen do not tell the two apart (every step with the same pairs per token), or the best fit
    has a negative part, the other part alone is fitted."""
    det = snn * spp - snp * snp
    if det > 1e-6 * snn * spp:
        a, b = (spp * sny - snp * spy) / det, (snn * spy - snp * sny) / det
        if a >= 0 and b >= 0:
            return a, b
        if a < 0 < spy:
            return 0.0, spy / spp
    return max(0.0, sny / snn), 0.0
