"""P: the requests admitted ahead of D's params (the proxy's admit-ahead, lw.contract.ahead)
while they wait for them: their fetch, the verdict the scheduler side asks for each step, how
long one whose params will not come is held for the proxy to cancel, and the interpreter's
thread switch interval while any waits."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from lw.contract.ahead import AheadParams
from lw.contract.params import prompt_digest
from lw.vllm_adapter.ahead_client import AheadFetcher
from lw.vllm_adapter.config import LwConfig
from lw.vllm_adapter.connector_meta import log

__all__ = ["AHEAD_HOLD_S", "AHEAD_SWITCH_S", "AheadAdmissions"]

AHEAD_SWITCH_S = 0.0002
"""The interpreter's thread switch interval while a request waits for its params: the engine
loop steps without work and holds the GIL, and at the default 5 ms the fetch thread that brings
the params waited most of that to run (measured: ~5 ms from the proxy's answer to the push)."""
AHEAD_HOLD_S = 10.0
"""A request admitted ahead whose params will not come waits this long for the proxy to cancel
it (it holds no blocks meanwhile); then it is computed as a plain request, nothing pushed."""


@dataclass
class _Ahead:
    """A request admitted ahead of D's params, not scheduled yet."""

    transfer_id: str
    gave_up: float | None = None  # when its params were found not to be coming
    # computed meanwhile (compute-ahead): the engine does not wait on it, and the worker
    # fetches its params (the answer comes by ``answered``)
    compute: bool = False
    answer: tuple[str, Any] | None = None  # the worker's answer, until the scheduler's step


class AheadAdmissions:
    """P: the requests waiting for D's params, by vLLM request id."""

    def __init__(self, cfg: LwConfig) -> None:
        self.cfg = cfg
        self._waiting: dict[str, _Ahead] = {}
        self._fetcher: AheadFetcher | None = None
        self._switch_was: float | None = None  # the switch interval before requests waited

    def admit(self, request: Any, ap: AheadParams, compute: bool = False) -> None:
        """Start fetching ``request``'s params (it has prompt token ids); ``compute``: it is
        computed meanwhile, and the worker fetches them (:meth:`answered` brings its answer)."""
        rid = request.request_id
        self._waiting[rid] = _Ahead(ap.transfer_id, compute=compute)
        self._changed()
        if compute:
            return
        if self._fetcher is None:
            self._fetcher = AheadFetcher(self.cfg)
        self._fetcher.fetch(rid, ap.lw_ahead_url, {
            "transfer_id": ap.transfer_id, "grant": ap.lw_ahead_grant,
            "prompt_digest": prompt_digest(request.prompt_token_ids)})

    def transfer_of(self, rid: str) -> str:
        """The transfer a waiting request was admitted for."""
        return self._waiting[rid].transfer_id

    def verdict(self, rid: str) -> tuple[str, Any]:
        """("plain", None) for a request not waiting (or held past AHEAD_HOLD_S: computed
        plainly), ("wait", None) while it waits, ("go", params) once they came (the caller
        checks them, then calls :meth:`bound` or :meth:`give_up`), ("fallback", why) when they
        will not come (the caller calls :meth:`give_up`)."""
        a = self._waiting.get(rid)
        if a is None:
            return "plain", None
        if a.gave_up is not None:
            if time.monotonic() - a.gave_up < AHEAD_HOLD_S:
                return "wait", None
            self.forget(rid)
            log.error("lw: prefill request %s (transfer %s) admitted ahead was not cancelled "
                      "within %g s of its fallback; computed, nothing pushed", rid,
                      a.transfer_id, AHEAD_HOLD_S)
            return "plain", None
        if a.compute:
            got, a.answer = a.answer, None
        else:
            got = self._fetcher.take(rid) if self._fetcher is not None else ("error",
                                                                             "no fetcher")
        if got is None:
            return "wait", None
        status, val = got
        return ("go", val) if status == "go" else ("fallback", str(val))

    def answered(self, rid: str, status: str, val: Any) -> None:
        """The worker's fetch of ``rid``'s params answered (a request it fetches itself)."""
        a = self._waiting.get(rid)
        if a is not None and a.compute:
            a.answer = (status, val)

    def bound(self, rid: str) -> None:
        """Its params were taken: it is scheduled as a D-first prefill from now on."""
        self._waiting.pop(rid, None)
        self._changed()

    def give_up(self, rid: str, why: str) -> None:
        """Its params will not come (or were refused): hold it for the proxy's cancel."""
        a = self._waiting[rid]
        a.gave_up = time.monotonic()
        log.warning("lw: prefill request %s (transfer %s) admitted ahead: %s; waiting for the "
                    "proxy to cancel it", rid, a.transfer_id, why)

    def forget(self, rid: str) -> None:
        """The request ended (or is computed plainly): nothing waits for it any more."""
        if self._waiting.pop(rid, None) is not None:
            if self._fetcher is not None:
                self._fetcher.forget(rid)
            self._changed()

    def close(self) -> None:
        """Stop the fetches."""
        if self._fetcher is not None:
            self._fetcher.close()

    def _changed(self) -> None:
        """Switch threads often while a request waits for its params (AHEAD_SWITCH_S), at the
        interpreter's own pace otherwise."""
        idle = any(not a.compute for a in self._waiting.values())
        if idle and self._switch_was is None:
            self._switch_was = sys.getswitchinterval()
            sys.setswitchinterval(AHEAD_SWITCH_S)
        elif not idle and self._switch_was is not None:
            sys.setswitchinterval(self._switch_was)
            self._switch_was = None
