"""P's worker, computing ahead: it fetches D's params for a request the core holds under the
proxy's transfer id (``FetchSpec``) and binds it as they come, mid-step, instead of a step later
with the scheduler's metadata (measured: a multi-chunk prompt's writes started a chunk late);
the scheduler hears the answer in the worker's metadata and sends the same bind (``BindSpec``),
which a worker that bound already ignores. A part of
:class:`lw.vllm_adapter.worker_side.WorkerSide`, split from it as a concern of its own."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from lw.contract.params import ContractError
from lw.transport.sidechannel import parse_cluster_key
from lw.vllm_adapter.ahead_client import AheadFetcher
from lw.vllm_adapter.connector_meta import BindSpec, FetchSpec, log
from lw.vllm_adapter.params_fit import check_fit, decode_fetched

__all__ = ["AheadBinds"]

BOUND_MEMORY = 4096
"""Ahead ids bound mid-step remembered, so that the scheduler's copy of a bind is recognised
even once the request ended (a 128-token prompt's transfer often ends before the copy comes)."""


class AheadBinds:
    """The methods WorkerSide takes from here (they use its ``_rid``, ``_held``, ``_t0``,
    ``_alias``, ``_step_sends``, ``_ahead_answers``, locks, config, loop and tracer)."""

    _alias: dict[str, str]
    _bound_early: OrderedDict[str, None]
    _fetches: OrderedDict[str, FetchSpec]
    _ahead_answers: list[tuple[str, str, Any]]
    _fetcher: AheadFetcher | None
    _extra: dict[str, float]
    _dirty: bool
    cfg: Any
    _rid: dict[str, str]
    _held: dict[str, int]
    _t0: dict[str, float]
    _step_sends: list[str]
    _lock: Any
    _step_lock: Any
    loop: Any
    tracer: Any

    def fetch(self, f: FetchSpec) -> None:
        """Ask the proxy for D's params of a request computed ahead, on a fetch thread."""
        if self._fetcher is None:
            self._fetcher = AheadFetcher(self.cfg)
        with self._lock:  # (kept until bound: a refused bind is reported with it)
            self._fetches[f.ahead_id] = f
            while len(self._fetches) > BOUND_MEMORY:
                self._fetches.popitem(last=False)
        self._fetcher.fetch(f.req_id, f.url, {"transfer_id": f.ahead_id, "grant": f.grant,
                                              "prompt_digest": f.prompt},
                            lambda answer: self._fetched(f, answer))

    def _fetched(self, f: FetchSpec, answer: tuple[str, Any]) -> None:
        """The fetch thread: params that fit bind the request now; the answer, or why the
        params were refused, goes to the scheduler with the worker's metadata."""
        status, val = answer
        if status == "go":
            try:
                spec = self._bind_spec(f, val)
            except (ContractError, ValueError) as exc:
                status, val = "fallback", f"D's params refused: {exc}"
            else:
                if self.bind_now(spec):
                    with self._lock:
                        self._extra["ahead_bound_early"] += 1
                    self._dirty = True
                else:  # not held here: ended before its params came, or bound already
                    self._refuse_if_dropped(f.ahead_id)
        with self._lock:
            self._ahead_answers.append((f.req_id, status, val))
            if status != "go":  # no bind comes: nothing to report
                self._fetches.pop(f.ahead_id, None)

    def _bind_spec(self, f: FetchSpec, params: Any) -> BindSpec:
        """D's params as a bind of ``f``'s request, or ContractError / ValueError where they
        are not the proxy's for this transfer or do not fit (the scheduler's own check)."""
        pp = decode_fetched(parse_cluster_key(self.cfg.cluster_key or None), params, f.ahead_id)
        check_fit(pp, peer_tp_size=self.cfg.peer_tp_size, geometry=f.geometry,
                  num_prompt_tokens=f.num_prompt_tokens, prompt=f.prompt,
                  block_size=f.block_size)
        return BindSpec(f.ahead_id, pp.transfer_id, f.req_id, pp.remote_host, pp.remote_port,
                        tuple(pp.remote_block_ids), pp.remote_first_block, pp.remote_tp_size,
                        pp.lw_epoch, pp.lw_prompt_digest)

    def bind_now(self, b: BindSpec) -> bool:
        """D's params for a request computed ahead, on the fetch thread as they came: bound
        now, mid-step, if this worker holds it; False when not (yet): the scheduler's next
        metadata brings the same bind, or makes it a D-first prefill if its push had not
        started."""
        with self._step_lock:
            if b.ahead_id in self._alias or self._rid.get(b.ahead_id) != b.req_id:
                return False
            self._bind(b)
            self._bound_early[b.ahead_id] = None
            while len(self._bound_early) > BOUND_MEMORY:
                self._bound_early.popitem(last=False)
            # this step's later layers go under D's id; those already queued reach the core
            # after the bind, which knows them by the old one too
            self._step_sends = [b.transfer_id if t == b.ahead_id else t
                                for t in self._step_sends]
            return True

    def _bind(self, b: BindSpec) -> None:
        """D's params for a request computed ahead: the core takes it under D's id. Both ids
        map to the request until the core's answer: a refused bind (the request was dropped
        meanwhile) reports under the old one, an accepted one under the new."""
        from lw.fsm import PrefillRequest

        if b.ahead_id in self._bound_early:
            return  # bound mid-step already (bind_now): this is the scheduler's copy
        if self._rid.get(b.ahead_id) != b.req_id:
            log.error("lw: request %s (transfer %s) bound after it ended here", b.req_id,
                      b.transfer_id)
            self._refuse_if_dropped(b.ahead_id)
            return
        self._alias[b.ahead_id] = b.transfer_id
        with self._lock:
            self._rid[b.transfer_id] = b.req_id
        req = PrefillRequest(b.transfer_id, self._addrs(b.decoder_host, b.decoder_port,
                                                        b.decoder_tp),
                             (), b.remote_blocks, 1, True, b.epoch, b.prompt)
        assert self.loop is not None
        fut = self.loop.call("bind", req, b.first_block, ahead_id=b.ahead_id)
        fut.add_done_callback(lambda f: self._bound(f, b))

    def _bound(self, fut: Any, b: BindSpec) -> None:
        """The core's answer to a bind (on its loop thread, before any report of the new id)."""
        exc = fut.exception()
        dropped = exc is None and not fut.result()  # the core refused: it had dropped it
        refused = exc is not None or dropped
        # the id the core reports the request under from now on, and the one to forget
        keep, drop = (b.ahead_id, b.transfer_id) if refused else (b.transfer_id, b.ahead_id)
        with self._lock:
            if self._rid.get(drop) == b.req_id:
                del self._rid[drop]
            if refused:
                self._alias.pop(b.ahead_id, None)
            else:  # (chunks the metadata named by the ahead id are counted under D's already)
                self._held[keep] = self._held.get(keep, 0) + self._held.pop(drop, 0)
                if drop in self._t0:
                    self._t0.setdefault(keep, self._t0.pop(drop))
        if not refused and self.tracer is not None:
            self.tracer.rename(drop, keep)
        if dropped:
            log.error("lw: request %s computed ahead: bind to transfer %s refused (dropped "
                      "before D's params came); the proxy starts it D first", b.req_id,
                      b.transfer_id)
            self._report_refused(b.ahead_id, "P had dropped it before D's params came")
        elif refused:  # a bug of ours: no decoder was claimed, D fails it at its deadline
            log.error("lw: request %s computed ahead: bind to transfer %s failed: %s",
                      b.req_id, b.transfer_id, exc)
        else:
            with self._lock:
                self._fetches.pop(b.ahead_id, None)

    def _refuse_if_dropped(self, ahead_id: str) -> None:
        """Report the bind refused if P's core would refuse it (the request ended there before
        D's params came: its ahead wait ran out); the core decides, on its loop thread."""
        def answered(fut: Any) -> None:
            if not fut.cancelled() and fut.exception() is None and fut.result():
                self._report_refused(ahead_id, "P had dropped it before D's params came")

        assert self.loop is not None
        self.loop.run(lambda loop: loop.endpoint.refuses_bind(ahead_id)).add_done_callback(
            answered)

    def _report_refused(self, ahead_id: str, why: str) -> None:
        """Tell the proxy the core refused the bind of the params it handed: no decoder was
        claimed, so it starts the prefill D first (else D waits for its prefill deadline)."""
        with self._lock:
            f = self._fetches.pop(ahead_id, None)  # (so a second report finds none)
        if f is None or self._fetcher is None:
            return  # (fetched by the scheduler side: P TP > 1 or a long prompt, admitted ahead)
        self._fetcher.fetch(f"refused:{ahead_id}", f.url, {
            "transfer_id": ahead_id, "grant": f.grant, "prompt_digest": f.prompt,
            "refused": why[:1000]}, lambda answer: log.warning(
                "lw: transfer %s: the proxy answered P's refused bind: %s", ahead_id, answer))

    def _unalias(self, tid: str) -> None:
        """``tid`` ended here: forget the ahead id it was bound from."""
        with self._step_lock:
            for aid in [a for a, t in self._alias.items() if t == tid]:
                del self._alias[aid]
