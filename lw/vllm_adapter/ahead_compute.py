"""P: requests computed ahead of D's params (the proxy's compute-ahead): scheduled at once, their
first push adds them to the core ahead (``SendSpec.ahead``: no decoder yet). P's worker fetches
D's params (``FetchSpec``) and binds the request as they come, mid-step
(lw.vllm_adapter.worker_binds); its answer reaches this side with the worker's metadata, which
sends the same bind as a :class:`~lw.vllm_adapter.connector_meta.BindSpec` (the one a worker
that has not bound it takes) and updates the request's later chunks; a fallback aborts them
(the core drops what was computed and frees the blocks). What the core decides (writes wait for
the bind; dropped at ``ahead_wait_s``; a later bind refused) is in :mod:`lw.fsm.prefill_ahead`;
this only carries the answer to it, through the scheduler side (``side``:
lw.vllm_adapter.scheduler_side.SchedulerSide) it is a part of.
"""

from __future__ import annotations

from typing import Any, Protocol

from lw.contract.params import ContractError
from lw.vllm_adapter.ahead_admission import AheadAdmissions
from lw.vllm_adapter.connector_meta import BindSpec, log

__all__ = ["AheadComputes", "BindSide", "bind_spec"]


class BindSide(Protocol):
    """What binding a request computed ahead needs of P's scheduler side (its P requests are
    that side's, of a type this module does not import: ``Any`` here)."""

    def count(self, name: str) -> None:
        """Add one to counter ``name``."""

    def fetched_params(self, request: Any, fetched: Any, transfer_id: str) -> Any:
        """D's fetched params as the P request to push (ContractError or ValueError if unfit)."""

    def bind_ahead(self, rid: str, ahead_id: str, new: Any) -> None:
        """Push ``rid`` (computed under ``ahead_id``) to D's params ``new`` from here on."""

    def unbind_ahead(self, rid: str, ahead_id: str, reason: str) -> None:
        """``rid`` will not be bound: abort its push, or compute it as a plain request."""


class AheadComputes:
    """P: the requests being computed ahead whose params have not been answered yet."""

    def __init__(self, admissions: AheadAdmissions) -> None:
        self._admissions = admissions  # the scheduler side's: where the fetches' answers come
        # vLLM request id -> (the request, the id it is pushed under until bound)
        self._requests: dict[str, tuple[Any, str]] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self._requests

    def admit(self, request: Any, transfer_id: str) -> None:
        """Track ``request`` (its fetch started; the scheduler side pushes it ahead from its
        first chunk, under the proxy's transfer id until D's sub-transfer id is known)."""
        self._requests[request.request_id] = (request, transfer_id)

    def ended(self, rid: str, normally: bool) -> bool:
        """vLLM finished ``rid``: whether its fetch goes on (it finished its prefill normally and
        waits for its bind; else it is forgotten)."""
        if rid not in self._requests:
            return False
        if normally:
            return True
        del self._requests[rid]
        return False

    def released(self, rid: str) -> None:
        """The core released ``rid`` before its params were answered (dropped at
        ``ahead_wait_s``): a bind would come too late."""
        if self._requests.pop(rid, None) is not None:
            log.error("lw: request %s computed ahead was dropped before D's params came; a "
                      "decode engine bound to it fails it at its prefill deadline", rid)

    def poll(self, side: BindSide) -> None:
        """Carry every answered fetch to the workers (this step's metadata): a bind, a D-first
        prefill for a request not pushed yet, or an abort when the params will not come."""
        for rid, (request, ahead_id) in list(self._requests.items()):
            verdict, val = self._admissions.verdict(rid)
            if verdict == "wait":
                continue
            if verdict == "plain":  # not fetched any more (never: computing ones are not held)
                verdict, val = "fallback", "its fetch was forgotten"
            del self._requests[rid]
            self._admissions.forget(rid)
            if verdict == "go":
                try:
                    new = side.fetched_params(request, val, ahead_id)
                except (ContractError, ValueError) as exc:
                    verdict, val = "fallback", f"D's params refused: {exc}"
            if verdict == "go":
                side.count("ahead_bound")
                side.bind_ahead(rid, ahead_id, new)
                continue
            side.count("ahead_fallbacks")
            log.warning("lw: request %s computed ahead (transfer %s) not bound: %s", rid,
                        ahead_id, val)
            side.unbind_ahead(rid, ahead_id, f"computed ahead, not bound: {val}")


def bind_spec(ahead_id: str, rid: str, new: Any) -> BindSpec:
    """The bind of ``rid`` (computed under ``ahead_id``) to D's params ``new`` (a P request)."""
    return BindSpec(ahead_id, new.transfer_id, rid, new.host, new.port, new.remote_blocks,
                    new.push.first_block, new.decoder_tp, new.epoch, new.prompt)
