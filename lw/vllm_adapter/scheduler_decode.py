"""D's half of lw's scheduler side: a request whose prefill runs elsewhere allocates first, then
asks the proxy's metaserver (in the background) to start the prefill of exactly this vLLM
request's prompt tokens, under a transfer id of its own (one per vLLM request: n > 1 children
and the prompts of a list share the proxy's id); a short uncached tail after a prefix-cache hit
is computed locally instead. With ``retry_prefill`` > 0, a re-prefill the core asks for (its P
was lost) is a second call to the same metaserver, with the new claim epoch and the P engines
to avoid. P's first tokens that D's workers took wait here for lw's scheduler class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lw.contract.params import (
    CONTRACT_VERSION,
    ContractError,
    DecodeParams,
    decode_params_for_decoder,
    is_remote_prefill_request,
    prompt_digest,
)
from lw.contract.transfer_ids import sub_transfer_id
from lw.fsm.block_choice import blocks_to_receive
from lw.fsm.prefill_request import received_blocks
from lw.vllm_adapter.connector_meta import FirstTokenIn, RecvSpec, Reprefill, Route, log
from lw.vllm_adapter.tracing import trace_headers_of

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

__all__ = ["DReq", "DecodeScheduling"]


@dataclass
class DReq:
    """D: a request whose blocks are allocated and whose KV is awaited."""

    transfer_id: str
    aborted: bool = False
    # retry_prefill > 0: the metaserver URL and the fields that name this sub-transfer, for a
    # re-prefill call (D keeps no notion of where the prefill runs: that is the core's)
    recall: tuple[str, dict[str, Any]] | None = None


class DecodeScheduling:
    """The D side of :class:`lw.vllm_adapter.scheduler_side.SchedulerSide` (it uses its
    ``cfg``, ``_d``, ``_d_seen``, ``_tails``, ``_meta``, ``_to_post``, ``_poster``, counters)."""

    _d: dict[str, DReq]
    _first_in: list[FirstTokenIn]

    def _remote_prefill(self, request: Request) -> DecodeParams | None:
        """D: the proxy's signed params of a request to prefill elsewhere, or None (a plain
        request, or params refused: computed here, no call made to any URL they name)."""
        params = request.kv_transfer_params
        if self.cfg.is_producer or params is None or request.request_id in self._d_seen:
            return None
        if not is_remote_prefill_request(params):
            return None
        try:
            out = decode_params_for_decoder(self._key, params)
            if self._metaservers and out.metaserver not in self._metaservers:
                raise ContractError("kv_transfer_params.metaserver", "not one of the "
                                    "metaservers this decode engine may call "
                                    "(allowed_metaservers)")
            return out
        except ContractError as exc:
            self._refused(request, exc, "computing its prefill locally")
            return None

    def num_new_matched_tokens(self, request: Request, n: int) -> tuple[int | None, bool]:
        """D: (uncached prompt tokens, async) for a fresh remote-prefill request; else (0, F).
        P: (None, F) while a request admitted ahead waits for D's params.

        ``n`` is D's own prefix-cache hit (whole blocks, at most the prompt minus one token):
        a remainder of at most ``local_tail_tokens`` after a hit is computed here instead.
        """
        if self.cfg.is_producer:
            return self._ahead_ready(request), False
        if self._remote_prefill(request) is None:
            return 0, False
        rid = request.request_id
        count = request.num_prompt_tokens - n
        if n > 0 and count <= self.local_tail_tokens:
            self._tails[rid] = n // self.block_size  # counted once allocated (after_alloc)
            return 0, False
        self._tails.pop(rid, None)  # the hit changed since an earlier, unallocated call
        try:
            received_blocks(request.num_prompt_tokens, n, self.block_size)
        except ValueError as exc:  # not from vLLM's own block-sized hits; never written over
            if rid not in self._bad_params:
                self._bad_params.add(rid)
                log.error("lw: request %s: %s; computing its prefill locally", rid, exc)
            return 0, False
        if request.prompt_token_ids is None:
            if rid not in self._bad_params:
                self._bad_params.add(rid)
                log.error("lw: request %s has no prompt token ids (prompt embeddings?); "
                          "computing its prefill locally", rid)
            return 0, False
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        """D: the blocks for the remote tokens exist: register them and ask for the prefill."""
        rid = request.request_id
        if num_external == 0:
            # Second call after a load, a plain request, or a local tail now scheduled.
            held = self._tails.pop(rid, None)
            if held is not None and rid not in self._d_seen:
                self._d_seen.add(rid)  # a preempted tail is recomputed, not loaded
                with self._lock:
                    self._counts["local_tails"] += 1
                    self._counts["prefix_hit_blocks"] += held
            return
        params = self._remote_prefill(request)
        if params is None:
            return
        self._d_seen.add(rid)
        (block_ids,) = blocks.get_block_ids()
        # The blocks P writes, after D's own hit (checked whole blocks by num_new_matched_tokens;
        # vLLM allocated every block of the prompt, so this does not raise).
        first, remote = blocks_to_receive(block_ids, request.num_prompt_tokens,
                                          request.num_prompt_tokens - num_external,
                                          self.block_size)
        tid = sub_transfer_id(params.transfer_id, rid)
        dr = self._d[rid] = DReq(tid)
        digest = prompt_digest(request.prompt_token_ids or ())
        self._meta.recvs.append(RecvSpec(tid, rid, remote, trace_headers_of(request)
                                         if self._traced else (), digest))
        with self._lock:
            self._counts["prefix_hit_blocks"] += first
        kv = {
            "remote_engine_id": self.cfg.engine_id,
            "remote_host": self.cfg.host,
            "remote_port": self.cfg.port(tp_rank=0),
            "remote_block_ids": list(remote),
            "remote_first_block": first,
            "remote_dp_rank": self.cfg.dp_rank,
            "remote_tp_size": self.cfg.tp_size,
            "lw_geometry": self.geometry,
            "lw_params_version": CONTRACT_VERSION,
            "lw_prompt_digest": digest,
        }
        seed = getattr(request.sampling_params, "seed", None)
        if seed is not None:
            kv["lw_seed"] = seed
        body = {"transfer_id": params.transfer_id, "sub_transfer_id": tid,
                "prompt_token_ids": list(request.prompt_token_ids or ()),
                "kv_transfer_params": kv,
                "grant": params.metaserver_grant}  # binds the call to this transfer
        if self.cfg.retry_prefill:
            # The proxy leaves a failed prefill of this sub-transfer to D while D may retry it.
            body["retry_prefill"] = self.cfg.retry_prefill
            dr.recall = (params.metaserver, {k: body[k] for k in (
                "transfer_id", "sub_transfer_id", "grant") if k in body})
        self._to_post.append((rid, tid, params.metaserver, body))

    def _reprefill(self, rp: Reprefill) -> None:
        """D: the core lost this request's P and keeps its blocks: ask the proxy again, with the
        new claim epoch and the engines to avoid (a failed call aborts it, as a first one)."""
        dr = self._d.get(rp.req_id)
        if dr is None or dr.aborted or dr.transfer_id != rp.transfer_id or dr.recall is None:
            return  # ended meanwhile: the core already failed or released it
        url, base = dr.recall
        body = {**base, "epoch": rp.epoch, "avoid": list(rp.avoid), "reason": rp.reason[:300]}
        log.warning("lw: request %s (transfer %s): prefill epoch %d asked again, avoiding %s: "
                    "%s", rp.req_id, rp.transfer_id, rp.epoch, list(rp.avoid) or "none",
                    rp.reason)
        with self._lock:
            self._counts["prefill_retries"] += 1
        self._to_post.append((rp.req_id, rp.transfer_id, url, body))

    def take_first_tokens(self) -> list[FirstTokenIn]:
        """D: P's first tokens that reached live receives since the last call (lw's
        scheduler decides whether each request continues from its token)."""
        out, self._first_in = self._first_in, []
        return out

    def _take_routes(self) -> list[Route]:
        """Where the proxy said it sent each prefill attempt (only with a retry budget: without
        one, the core does not watch a P before it claims)."""
        if self._poster is None or not self.cfg.retry_prefill:
            return []
        return self._poster.take_routes()

    def _take_post_failures(self) -> list[tuple[str, str, str]]:
        if self._poster is None:
            return []
        failures = self._poster.take_failures()
        with self._lock:
            self._counts["metaserver_failures"] += len(failures)
        return failures
