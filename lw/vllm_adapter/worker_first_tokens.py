"""The worker's half of the first token: P's worker hands the token its scheduler sampled to the
core (which sends it to D under the request's claim) ahead of the last layer's report where
lw.fsm.push_schedule.last_layer_waits_for_token says so, D's worker hands the token its core took
to its scheduler in the worker metadata; both keep the engine's first-token mode and counts,
which the scheduler sends when they change, for ``lw status``. A part of
:class:`lw.vllm_adapter.worker_side.WorkerSide`, split from it as a concern of its own; it
decides nothing about a request (the core does)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lw.contract.sampling import spec_digest
from lw.fsm.effects import FirstTokenTaken
from lw.fsm.push_schedule import PushEstimate, last_layer_waits_for_token
from lw.vllm_adapter.connector_meta import FirstTokenIn, LwConnectorMetadata, log
from lw.vllm_adapter.first_token import checked_status

if TYPE_CHECKING:
    from lw.fsm.messages import FirstTokenStatus
    from lw.vllm_adapter.connector_meta import SendSpec

__all__ = ["DONE_MEMORY", "FirstTokenRelay"]

DONE_MEMORY = 4096
"""Transfer ids of receives reported done remembered with their vLLM request id: P's token
often reaches D after the KV (P's scheduler hears of it after the prefill)."""


class FirstTokenRelay:
    """The methods WorkerSide takes from here (they use its ``_rid``, ``_alias``, ``_lock``,
    ``_call`` and config)."""

    _rid: dict[str, str]
    _alias: dict[str, str]
    _lock: Any
    _done_rid: OrderedDict[str, str]  # D: transfer id -> vLLM request id, receives done
    _first_in: list[FirstTokenIn]  # D: tokens taken since the last worker metadata
    _step_final: dict[str, str]  # P: vLLM request id -> transfer id, prompts this step ends
    # P: pushes of this step whose last forward hook may wait for the sampled token (transfer
    # id -> the step's blocks, the link's estimate), and the hooks' reports held for it
    _token_first: dict[str, tuple[int, PushEstimate]]
    _held_for_token: list[tuple[tuple[int, ...], tuple[str, ...], float]]
    _hands_tokens: bool  # P: the runner hands its sampled tokens over (tokens_sampled)
    _final_hook_t: float | None  # P: this step's last hook, with a prompt ending in it
    _sample_s: float | None  # P: last hook -> tokens handed over, smoothed over such steps
    planes: list[Any]

    loop: Any  # WorkerSide's WorkerLoop (None before register)
    _ft_status: FirstTokenStatus | None  # the engine's first-token status, last good one
    _ft_refused: int

    if TYPE_CHECKING:  # WorkerSide's, not overridden here
        def _call(self, method: str, *args: Any, rid: str, tid: str, **kwargs: Any) -> None:
            ...

        def _estimate(self, s: SendSpec) -> PushEstimate | None:
            ...

    def _send_first_tokens(self, meta: LwConnectorMetadata) -> None:
        """P: each token the scheduler sampled goes to the core on the loop thread (enqueued,
        never waited for: this runs as the forward's metadata is bound); the core sends it
        (TP rank 0) or holds it until D accepts the claim. The scheduler may name a request
        computed ahead by its ahead id after a mid-step bind renamed it. A token the runner
        handed over as it sampled it (``tokens_sampled``) went already: the core drops this
        copy."""
        alias = self._alias
        for ft in meta.first_tokens:
            tid = alias.get(ft.transfer_id, ft.transfer_id) if alias else ft.transfer_id
            self._call("first_token", tid, ft.token, ft.spec, rid=ft.req_id, tid=tid)

    def tokens_sampled(self, req_ids: Sequence[str], tokens: Sequence[Sequence[int]],
                       params: Callable[[str], Any]) -> None:
        """P, on the forward's thread: the runner sampled ``tokens`` (per request of
        ``req_ids``; ``params``: a request's SamplingParams) in the step whose metadata was
        bound last. A request whose prompt this step completed sends its token now, a P
        engine turn before its scheduler would (the core drops the scheduler's copy); its
        spec digest is taken from the same SamplingParams the scheduler's would be."""
        self._hands_tokens = True
        if self._final_hook_t is not None:
            took = time.monotonic() - self._final_hook_t
            self._sample_s = took if self._sample_s is None else (self._sample_s + took) / 2
            self._final_hook_t = None
        final, self._step_final = self._step_final, {}
        try:
            self._send_sampled(final, req_ids, tokens, params)
        finally:
            self.release_held_layers()  # after the tokens: they cross the link ahead

    def _send_sampled(self, final: dict[str, str], req_ids: Sequence[str],
                      tokens: Sequence[Sequence[int]], params: Callable[[str], Any]) -> None:
        for rid, toks in zip(req_ids, tokens, strict=False):
            tid = final.get(rid)
            if tid is None or len(toks) == 0:
                continue
            try:
                spec = spec_digest(params(rid))
            except Exception as exc:  # noqa: BLE001 - the scheduler's copy still goes
                log.debug("lw: %s: no spec digest at sampling (%s)", rid, exc)
                continue
            alias = self._alias
            live = alias.get(tid, tid) if alias else tid
            self._call("first_token", live, int(toks[0]), spec, rid=rid, tid=live)

    def _may_hold_for_token(self, tid: str, s: SendSpec) -> None:
        """P: push ``tid`` (spec ``s``) ends its prompt in this step: its last hook may wait
        for the token the runner samples (:meth:`hold_for_token`). Only where the runner has
        handed tokens over at sampling before (an asynchronous runner's step would hold them a
        step) and P keeps rates (the link's estimate is read only then)."""
        if not self._hands_tokens or not s.local_blocks:
            return
        est = self._estimate(s)
        if est is not None:
            self._token_first[tid] = (len(s.local_blocks), est)

    def hold_for_token(self, planes: tuple[int, ...], tids: list[str]) -> list[str]:
        """P, at the forward's last hook (``planes``): of ``tids``, those whose writes report
        now; the others' reports are held until the token is handed over (their bytes would
        still be on the wire when it leaves: lw.fsm.push_schedule.last_layer_waits_for_token),
        with the time they were computed. Times the hook for the sampling that follows."""
        if not self._token_first or self.loop is None:
            return tids
        self._final_hook_t = time.monotonic()
        share = len(planes) / max(1, len(self.planes))
        held = tuple(t for t in tids if t in self._token_first and last_layer_waits_for_token(
            blocks_to_send=self._token_first[t][0], share=share, est=self._token_first[t][1],
            sample_s=self._sample_s))
        if not held:
            return tids
        self._held_for_token.append((planes, held, time.monotonic()))
        return [t for t in tids if t not in held]

    def release_held_layers(self) -> None:
        """P: report the layer hooks held for the token (after it was handed over, or at the
        next step's metadata if the runner never handed it), each as of when computed."""
        held, self._held_for_token = self._held_for_token, []
        self._token_first = {}
        self._final_hook_t = None
        loop = self.loop
        if loop is None:
            return
        for planes, tids, t in held:
            for i in planes:
                loop.layer_computed(i, tids, t)

    def _keep_first_token_status(self, snap: Any) -> None:
        """The engine's first-token mode and counts its scheduler sent with a step's metadata:
        kept (checked against their declared bounds) for the loop's status replies; a snapshot
        that is not of its declared type or bounds is refused, the last good one kept."""
        try:
            status = checked_status(snap)
        except ValueError as exc:
            self._ft_refused += 1
            if self._ft_refused == 1:  # a bug in lw's scheduler side, not worth a flood
                log.warning("lw: the scheduler's first-token status was refused (%s); `lw "
                            "status` shows the last good one", exc)
            return
        self._ft_status = status
        if self.loop is not None:
            self.loop.first_token = status  # a reference: the loop thread reads it whole

    def _done_receiving(self, tid: str, rid: str) -> None:
        """D: a receive reported done (its ``_rid`` entry goes): keep its vLLM request id for
        the first token that may still come. Under ``_lock``."""
        self._done_rid[tid] = rid
        while len(self._done_rid) > DONE_MEMORY:
            self._done_rid.popitem(last=False)

    def _first_taken(self, e: FirstTokenTaken) -> None:
        """D: the core took P's first token: for the scheduler's next worker metadata, under
        the vLLM request id (a request the worker no longer knows: nobody waits for it)."""
        with self._lock:
            rid = self._rid.get(e.req_id) or self._done_rid.get(e.req_id)
            if rid is not None:
                self._first_in.append(FirstTokenIn(e.req_id, rid, e.token, e.spec, e.epoch))

    def _take_first_in(self) -> list[FirstTokenIn]:
        """D: the tokens taken since the last call. Under ``_lock``."""
        out, self._first_in = self._first_in, []
        return out
