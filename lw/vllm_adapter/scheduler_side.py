"""The scheduler-role half of lw's connector: tracks requests, builds per-step metadata.

P: validates the decoder's params and pushes a request's blocks chunk by chunk as its chunked
prefill completes them (``push_mode`` "progressive"), from the chunk after which the compute left
would no longer cover the transfer ("auto", :mod:`lw.fsm.push_schedule`, on the rates the
workers measure), or all in the step its prefill completes ("last_chunk").
D: allocates first and asks for the prefill (:mod:`lw.vllm_adapter.scheduler_decode`); where
the proxy sent each attempt goes back to the core (``Route``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lw.contract.ahead import HELD_KEY, ahead_url, decode_ahead_params, is_ahead_request
from lw.contract.params import (
    ContractError,
    PrefillParams,
    decode_params_for_prefiller,
    is_prefill_request,
    is_remote_prefill_request,
    prompt_digest,
)
from lw.contract.sampling import spec_digest
from lw.contract.transfer_ids import sub_transfer_id
from lw.contract.worker_addrs import PREFILL_ENGINE_KEY, PREFILL_WORKERS_KEY, worker_addrs
from lw.fsm.block_choice import PushCursor
from lw.fsm.messages import MAX_TEXT, FirstTokenStatus
from lw.fsm.push_schedule import PushEstimate, attended_pairs, push_starts_now
from lw.transport.ratelog import RateLog
from lw.transport.sidechannel import parse_cluster_key
from lw.vllm_adapter.ahead_admission import AheadAdmissions
from lw.vllm_adapter.ahead_compute import AheadComputes, bind_spec
from lw.vllm_adapter.config import LwConfig
from lw.vllm_adapter.connector_meta import (
    FetchSpec,
    FirstTokenIn,
    FirstTokenSpec,
    LwConnectorMetadata,
    LwWorkerMeta,
    SendSpec,
    log,
)
from lw.vllm_adapter.first_token import COUNTS as FIRST_TOKEN_COUNTS
from lw.vllm_adapter.first_token import scheduler_is_lws, side_off_reason
from lw.vllm_adapter.metaserver_client import MetaserverPoster
from lw.vllm_adapter.metrics import FALLBACKS, LwKVConnectorStats
from lw.vllm_adapter.params_fit import check_fit, decode_fetched
from lw.vllm_adapter.scheduler_decode import DecodeScheduling, DReq
from lw.vllm_adapter.tracing import trace_headers_of, tracing_endpoint

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["SchedulerSide", "sub_transfer_id"]

_NORMAL_FINISH = {"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION"}


@dataclass
class _PReq:
    """P: a request whose blocks are pushed as its chunks complete them."""

    request: Any
    transfer_id: str
    host: str
    port: int
    remote_blocks: tuple[int, ...]
    push: PushCursor  # how far its push got (from D's prefix hit on)
    decoder_tp: int = 1
    epoch: int = 0  # D's claim epoch of this attempt (lw_epoch)
    prompt: str = ""  # the digest of the prompt D's blocks are for, named in P's claim


def step_pairs(so: SchedulerOutput) -> int:
    """The (token, earlier token) pairs a step's tokens attend: the attention part of its
    forward, which P's workers time it by (lw.fsm.push_schedule)."""
    done = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    # vLLM keeps the two lists parallel; timing figures are not worth stopping a scheduler for
    done.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
    return sum(attended_pairs(done.get(rid, 0), done.get(rid, 0) + n)
               for rid, n in so.num_scheduled_tokens.items())


class SchedulerSide(DecodeScheduling):
    """Scheduler-role half: tracks requests, builds per-step metadata, calls the metaserver."""

    def __init__(self, cfg: LwConfig, vllm_config: Any, geometry: str,
                 block_ids: Callable[[str], list[int]]) -> None:
        self.cfg = cfg
        self.block_ids = block_ids  # a request's block ids, from vLLM's KV cache manager
        self.geometry = geometry
        self.block_size = int(vllm_config.cache_config.block_size)
        # the longest prompt computed ahead of D's params (longer ones are admitted ahead)
        self._ahead_max_tokens = cfg.ahead_compute_max_tokens or None
        self._p: dict[str, _PReq] = {}  # vLLM req id -> tracked (P)
        self._pushed: dict[str, str] = {}  # vLLM req id -> transfer id, until finished sending
        self._d: dict[str, DReq] = {}  # vLLM req id -> receiving (D)
        self._d_seen: set[str] = set()  # D requests already handled (never load twice)
        self._ahead = AheadAdmissions(cfg)  # P: requests waiting for D's params
        self._computes = AheadComputes(self._ahead)  # P: computed ahead, not bound yet
        self._tails: dict[str, int] = {}  # D: req -> cached blocks, tail to compute locally
        tail = cfg.local_tail_tokens
        self.local_tail_tokens = self.block_size if tail < 0 else tail
        self._meta = LwConnectorMetadata()
        self._to_post: list[tuple[str, str, str, dict[str, Any]]] = []
        self._poster: MetaserverPoster | None = None
        self._lock = threading.Lock()
        self._counts = {"metaserver_failures": 0, "prefix_hit_blocks": 0, "local_tails": 0,
                        "early_chunk_blocks": 0, "preempted_pushes": 0, "prefill_retries": 0,
                        "refused_params": 0, "ahead_admitted": 0, "ahead_fallbacks": 0,
                        "ahead_computed": 0, "ahead_bound": 0}
        self._compute_s_per_token: float | None = None  # from the workers (LwWorkerMeta)
        self._compute_s_per_pair = 0.0
        self._wire_s_per_block: dict[str, float] = {}  # D host -> seconds per block
        self._bad_params: set[str] = set()
        self._key = parse_cluster_key(cfg.cluster_key or None)  # checks the proxy's signature
        self._refusals = RateLog(log, "lw", 5.0)  # ticked by build_meta, every step
        self._metaservers = frozenset(filter(None, (
            u.strip() for u in cfg.allowed_metaservers.split(","))))
        self._traced = tracing_endpoint(vllm_config) is not None  # hand trace context on
        self._first_in: list[FirstTokenIn] = []  # D: P's first tokens, for lw's scheduler
        self._received: dict[str, str] = {}  # D: req -> transfer, KV landed, request live
        self._fallbacks: dict[str, int] = {}  # D: requests that took vLLM's path, by reason
        if not cfg.is_producer:  # started now: the first prefill request pays no thread start
            self._poster = MetaserverPoster(cfg)
        # The first token from P: whether it is on and what became of it, kept for `lw status`
        # (the totals; stats() hands /metrics the deltas). D: lw's scheduler class, when the
        # engine runs it, says whether it is on (first_token_mode) and takes P's tokens.
        self._ft_off = side_off_reason(cfg, vllm_config)
        self._ft_claimed = False
        self._ft_totals = dict.fromkeys(FIRST_TOKEN_COUNTS, 0)
        self._ft_fallbacks: dict[str, int] = {}
        self._ft_dirty = True  # the workers' copy is stale (sent with the next step's metadata)
        if cfg.is_producer:
            if self._ft_off is None:
                log.info("lw: first token from P on: this prefill engine sends each pushed "
                         "request's sampled token to its decode engine")
            else:
                log.info("lw: first token from P off (%s): decode engines recompute the last "
                         "prompt token and sample token 1 themselves", self._ft_off)
        elif self._ft_off is not None and not scheduler_is_lws(
                getattr(vllm_config.scheduler_config, "scheduler_cls", None)):
            # lw's scheduler class never runs here: this is the engine's only word on it
            log.warning("lw: first token from P off (%s): D recomputes the last prompt token "
                        "and samples token 1 itself", self._ft_off)

    # ------------------------------------------------------------------------------- P side
    def _refused(self, request: Request, exc: ContractError, what: str) -> None:
        """Count and log (once per request) params that are not the proxy's contract."""
        rid = request.request_id
        if rid in self._bad_params:
            return
        self._bad_params.add(rid)
        with self._lock:
            self._counts["refused_params"] += 1
        self._refusals.note("params", "kv_transfer_params refused (%s); %s", exc, what,
                            req_id=rid)

    def on_new_request(self, request: Request) -> None:
        """Both: params that are not the contract's are refused and dropped from the request
        (vLLM's scheduler itself reads them next: a non-object would raise there). P: track a
        request to push."""
        params = request.kv_transfer_params
        if params is None:
            return
        if not isinstance(params, Mapping):
            self._refused(request, ContractError("kv_transfer_params", f"must be an object, "
                          f"got {type(params).__name__}"), "served as a plain request")
            request.kv_transfer_params = None
            return
        if not self.cfg.is_producer:
            if is_remote_prefill_request(params) and self._remote_prefill(request) is None:
                request.kv_transfer_params = None  # refused: vLLM must not wait for KV either
            return
        if not is_prefill_request(params):
            return
        rid = request.request_id
        if is_ahead_request(params):
            if not self._admit_ahead(request, params):
                return
        else:
            try:
                self._p[rid] = self._parse_decoder_params(
                    request, decode_params_for_prefiller(self._key, params))
            except ContractError as exc:
                self._refused(request, exc, "computed, nothing pushed")
                return
            except ValueError as exc:
                log.error("lw: request %s (transfer %s) will not be pushed: %s", rid,
                          params.get("transfer_id"), exc)
                self._bad_params.add(rid)
                return
        if request.max_tokens != 1:
            # A pushed request must finish in its prefill step: vLLM frees a preempted
            # request's blocks without asking the connector, under a write still reading them.
            log.warning("lw: prefill request %s asked for max_tokens=%s; P computes 1 token",
                        rid, request.max_tokens)
            request.max_tokens = 1

    def _admit_ahead(self, request: Request, params: Mapping[str, Any]) -> bool:
        """A request the proxy sent ahead of D's params: start fetching them (it is scheduled
        once they are here: num_new_matched_tokens). False: refused, computed as a plain one."""
        rid = request.request_id
        try:
            ap = decode_ahead_params(self._key, params)
            if self._metaservers and ap.lw_ahead_url not in map(ahead_url, self._metaservers):
                raise ContractError("kv_transfer_params.lw_ahead_url", "not beside one of the "
                                    "metaservers this engine may call (allowed_metaservers)")
        except ContractError as exc:
            self._refused(request, exc, "computed, nothing pushed")
            return False
        if request.prompt_token_ids is None:
            log.error("lw: request %s admitted ahead has no prompt token ids; computed, nothing "
                      "pushed", rid)
            self._bad_params.add(rid)
            return False
        # Computed ahead: scheduled at once, pushed ahead from its first chunk. With P TP > 1
        # each worker would decide its own bind, which the checker does not cover: such a P
        # admits ahead only (it waits for the params, then computes); so does a prompt longer
        # than ahead_compute_max_tokens.
        compute = (ap.lw_ahead_compute and self.cfg.tp_size == 1
                   and (self._ahead_max_tokens is None
                        or request.num_prompt_tokens <= self._ahead_max_tokens))
        self._ahead.admit(request, ap, compute)
        if compute:  # the worker fetches: the params then bind it mid-step, as they come
            digest = prompt_digest(request.prompt_token_ids)
            self._meta.fetches.append(FetchSpec(
                rid, ap.transfer_id, ap.lw_ahead_url, ap.lw_ahead_grant, digest,
                request.num_prompt_tokens, self.geometry, self.block_size))
            self._computes.admit(request, ap.transfer_id)
            self._p[rid] = _PReq(request, ap.transfer_id, "", 0, (), PushCursor(0),
                                 prompt=digest)
            self.count("ahead_computed")
            return True
        self.count("ahead_admitted")
        return True

    def count(self, name: str) -> None:
        """Add one to counter ``name`` (a key of lw.vllm_adapter.metrics.COUNTERS)."""
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + 1
            if name in self._ft_totals:
                self._ft_totals[name] += 1
                self._ft_dirty = True

    def fallback(self, reason: str) -> None:
        """D: a request that took vLLM's path for token 1, for ``reason``
        (lw.vllm_adapter.first_token.FALLBACK_REASONS)."""
        with self._lock:
            self._fallbacks[reason] = self._fallbacks.get(reason, 0) + 1
            self._ft_fallbacks[reason] = self._ft_fallbacks.get(reason, 0) + 1
            self._ft_dirty = True

    def first_token_mode(self, off: str | None) -> None:
        """D: lw's scheduler class runs this engine and takes P's tokens from here; ``off``:
        why it cannot use them (None: on). Called once, as it starts."""
        self._ft_claimed = True
        self._ft_off = off
        self._ft_dirty = True

    def first_token_status(self) -> FirstTokenStatus:
        """This engine's first-token mode and counts since it started (``lw status``)."""
        with self._lock:
            totals, fallbacks = dict(self._ft_totals), dict(self._ft_fallbacks)
        off = self._ft_off
        if off is None and not self.cfg.is_producer and not self._ft_claimed:
            # lw's scheduler class runs but reaches another connector (vLLM's MultiConnector)
            off = "lw's scheduler class does not reach this connector (inside a MultiConnector?)"
        return FirstTokenStatus("prefill" if self.cfg.is_producer else "decode",
                                off is None, (off or "")[:MAX_TEXT],
                                self.cfg.dp_rank, fallbacks=fallbacks, **totals)

    def _ahead_ready(self, request: Request) -> int | None:
        """P: 0 when a request may be scheduled (admitted ahead and D's params are here, or an
        ordinary one); None while it waits for them (vLLM asks again next step)."""
        rid = request.request_id
        if rid in self._computes:
            return 0  # computed at once; its params bind it later (AheadComputes.poll)
        verdict, val = self._ahead.verdict(rid)
        if verdict in ("plain", "wait"):
            return 0 if verdict == "plain" else None
        if verdict == "go":
            try:
                self._p[rid] = self.fetched_params(request, val, self._ahead.transfer_of(rid))
            except (ContractError, ValueError) as exc:
                val = f"D's params refused: {exc}"
            else:
                request.kv_transfer_params = val
                self._ahead.bound(rid)
                return 0
        self._ahead.give_up(rid, val)  # the proxy cancels it (and starts the prefill D first)
        with self._lock:
            self._counts["ahead_fallbacks"] += 1
        return None

    def fetched_params(self, request: Request, fetched: Any, transfer_id: str) -> _PReq:
        """P: D's params fetched for ``request`` (admitted or computed ahead under
        ``transfer_id``) as the request to push; ContractError or ValueError where unfit."""
        return self._parse_decoder_params(request, decode_fetched(self._key, fetched, transfer_id))

    def bind_ahead(self, rid: str, ahead_id: str, new: _PReq) -> None:
        """P: D's params ``new`` came for ``rid``, computed ahead under ``ahead_id``: not
        pushed yet, an ordinary D-first prefill from here on; else bound, its later chunks too."""
        tr = self._p.get(rid)  # None once vLLM finished computing it
        if rid not in self._pushed:
            if tr is not None:
                self._p[rid] = new
            else:
                log.error("lw: request %s ended before its push started; D's params came after "
                          "it (transfer %s): nothing is sent", rid, ahead_id)
            return
        # (the worker bound it as the params came, mid-step: it ignores this copy)
        self._meta.binds.append(bind_spec(ahead_id, rid, new))
        self._pushed[rid] = new.transfer_id
        if tr is not None:  # still computing: its later chunks go to the bound request
            tr.transfer_id, tr.host, tr.port = new.transfer_id, new.host, new.port
            tr.remote_blocks, tr.decoder_tp = new.remote_blocks, new.decoder_tp
            tr.epoch, tr.prompt = new.epoch, new.prompt

    def unbind_ahead(self, rid: str, ahead_id: str, reason: str) -> None:
        """P: ``rid``, computed ahead under ``ahead_id``, will not be bound: the workers abort
        its push, or (nothing pushed yet) it is computed as a plain request."""
        if rid in self._pushed:
            self._meta.aborts.append((ahead_id, rid, reason))
        else:
            self._p.pop(rid, None)

    def _parse_decoder_params(self, request: Request, pp: PrefillParams) -> _PReq:
        """What the proxy's signed params (already of their declared type) ask of this engine,
        or ValueError where they do not fit it (TP, geometry, the prompt)."""
        check_fit(pp, peer_tp_size=self.cfg.peer_tp_size, geometry=self.geometry,
                  num_prompt_tokens=request.num_prompt_tokens,
                  prompt=prompt_digest(request.prompt_token_ids or ()),
                  block_size=self.block_size)
        first, blocks = pp.remote_first_block, pp.remote_block_ids
        if pp.lw_seed is not None and request.sampling_params is not None:
            request.sampling_params.seed = pp.lw_seed  # D's child of n > 1 has its own
        return _PReq(request, pp.transfer_id, pp.remote_host, pp.remote_port, tuple(blocks),
                     PushCursor(first), pp.remote_tp_size, pp.lw_epoch, pp.lw_prompt_digest)

    def _push_chunk(self, rid: str, num_scheduled: int) -> None:
        """This step computes a chunk of ``rid``: push the blocks it completes (progressive), or
        every block if it is the prompt's last chunk."""
        tr = self._p.get(rid)
        if tr is None or tr.push.final or tr.push.stopped:
            return
        req = tr.request
        computed = req.num_computed_tokens + num_scheduled
        try:  # what this chunk pushes, if anything, is the core's decision
            push = tr.push.chunk(self.block_ids(rid), req.num_prompt_tokens, computed,
                                 self.block_size, lambda: self._starts_now(tr, req, computed))
        except ValueError as exc:
            log.error("lw: request %s: %s; not pushed", rid, exc)
            if tr.push.stop():  # the workers hold it: stop them (D is told)
                self._meta.aborts.append((tr.transfer_id, rid, "P lost track of its blocks"))
            else:
                del self._p[rid]
            return
        if push is None:
            return
        if not push.final:
            with self._lock:
                self._counts["early_chunk_blocks"] += len(push.local)
        self._pushed[rid] = tr.transfer_id
        trace = trace_headers_of(req) if push.first and self._traced else ()
        self._meta.sends.append(SendSpec(tr.transfer_id, rid, tr.host, tr.port, push.local,
                                         tr.remote_blocks, tr.decoder_tp, push.first,
                                         push.final, trace, tr.epoch, tr.prompt,
                                         ahead=not tr.host))

    def _starts_now(self, tr: _PReq, req: Any, computed: int) -> bool:
        """Whether a request not pushed yet starts its push with a chunk that is not its last.
        Computed ahead, its decoder is not known yet: judged by the slowest link measured to
        any decode host, for every block of the prompt (none measured: at once)."""
        if tr.host:
            wire, blocks = self._wire_s_per_block.get(tr.host), len(tr.remote_blocks)
        else:
            wire = max(self._wire_s_per_block.values(), default=None)
            blocks = -(-req.num_prompt_tokens // self.block_size)
        est = PushEstimate(self._compute_s_per_token, wire, self._compute_s_per_pair)
        return push_starts_now(blocks_to_send=blocks,
                               tokens_after_chunk=req.num_prompt_tokens - computed, est=est,
                               margin=self.cfg.push_start_margin, mode=self.cfg.push_mode,
                               tokens_computed=computed)

    def _preempted(self, rid: str) -> None:
        """vLLM preempted ``rid``: it freed the request's blocks without asking us, under writes
        of earlier chunks that may still read them. Stop the push (D fails the request; the
        bytes read from reused blocks are never decoded); the recomputation is not pushed."""
        tr = self._p.get(rid)
        if tr is None or not tr.push.stop():
            return
        with self._lock:
            self._counts["preempted_pushes"] += 1
        log.warning("lw: prefill request %s (transfer %s) was preempted between chunks; its "
                    "push fails", rid, tr.transfer_id)
        self._meta.aborts.append((tr.transfer_id, rid, "request preempted on P between chunks"))

    def has_pending_pushes(self) -> bool:
        """Pushed requests not yet reported finished sending."""
        return bool(self._pushed)

    # ------------------------------------------------------------------------------- common
    def build_meta(self, so: SchedulerOutput) -> LwConnectorMetadata:
        """Collect this step's metadata and reset."""
        self._refusals.tick()
        if self.cfg.is_producer:
            self._computes.poll(self)  # binds go before this step's chunks
            for rid in getattr(so, "preempted_req_ids", None) or ():
                self._preempted(rid)
            for rid, n in so.num_scheduled_tokens.items():
                self._push_chunk(rid, n)
        else:
            for rid, _tid, reason in self._take_post_failures():
                dr = self._d.get(rid)
                if dr is not None and not dr.aborted:
                    dr.aborted = True
                    self._meta.aborts.append((dr.transfer_id, rid, reason))
                    self._meta.abort_kinds[dr.transfer_id] = "metaserver"  # FailureKind value
            for route in self._take_routes():
                dr = self._d.get(route.req_id)
                if dr is not None and not dr.aborted and dr.transfer_id == route.transfer_id:
                    self._meta.routes.append(route)
        meta, self._meta = self._meta, LwConnectorMetadata()
        if self._ft_dirty:  # only when it changed: a step with no news carries none
            self._ft_dirty = False
            meta.first_token = self.first_token_status()
        meta.idle = not so.total_num_scheduled_tokens
        meta.step_tokens = int(so.total_num_scheduled_tokens or 0)
        if self.cfg.is_producer:
            meta.step_pairs = step_pairs(so)
        if self._to_post:
            # Posted after the worker has the request in this step's metadata: P's first
            # MetaRequest normally finds it registered (if not, D answers "unknown" and P retries).
            if self._poster is None:
                self._poster = MetaserverPoster(self.cfg)
            for item in self._to_post:
                self._poster.post(*item)
            self._to_post = []
        return meta

    def response_params(self, request: Request) -> dict[str, Any] | None:
        """P: what a finished prefill tells its caller (the proxy) in ``kv_transfer_params``:
        this engine's workers, which ``lw status --proxy`` then asks."""
        if not self.cfg.is_producer or request.request_id not in self._p:
            return None
        rid = request.request_id
        first = self.cfg.port(tp_rank=0)
        # The engine id lets the proxy tell a decode engine which P its next prefills go to
        # (the core watches that P before it claims) and map the engines D avoids to servers.
        out = {PREFILL_WORKERS_KEY: worker_addrs(self.cfg.host, first, self.cfg.tp_size),
               PREFILL_ENGINE_KEY: self.cfg.engine_id}
        if rid in self._computes and rid in self._pushed:  # computed ahead, KV held to bind
            out[HELD_KEY] = True
        return out

    def request_finished(self, request: Request) -> bool:
        """Whether the blocks must outlive the request (P: pushed); queue aborts for workers."""
        rid = request.request_id
        self._bad_params.discard(rid)
        if self.cfg.is_producer:
            normal = request.status.name in _NORMAL_FINISH
            if not self._computes.ended(rid, normal):  # a request computed ahead waits on
                self._ahead.forget(rid)
            tr = self._p.pop(rid, None)
            if tr is None or not tr.push.started:
                return False
            if request.status.name not in _NORMAL_FINISH:
                self._meta.aborts.append((tr.transfer_id, rid,
                                          f"request {request.status.name}"))
            elif self.cfg.first_token_from_p and request.output_token_ids:
                # P's sampled token goes to D with the next step's metadata (the engine steps
                # on while the push holds the blocks: has_pending_push_work)
                self._meta.first_tokens.append(FirstTokenSpec(
                    tr.transfer_id, rid, int(request.output_token_ids[0]),
                    spec_digest(request.sampling_params)))
            return True
        self._d_seen.discard(rid)
        self._received.pop(rid, None)
        self._tails.pop(rid, None)
        dr = self._d.get(rid)
        if dr is not None and not dr.aborted:
            # Still receiving: the core stops P and releases (or quarantines) the blocks; vLLM
            # keeps them until the worker reports the request finished receiving.
            dr.aborted = True
            self._meta.aborts.append((dr.transfer_id, rid, f"request {request.status.name}"))
            if self._poster is not None:
                self._poster.cancel(rid)
        return False

    def update_output(self, out: KVConnectorOutput) -> None:
        """Requests released by the workers; D: P's first tokens they took."""
        wm = getattr(out, "kv_connector_worker_meta", None)
        # before the receives that finished: a token and the KV may land in one step
        for ft in wm.first_tokens if isinstance(wm, LwWorkerMeta) else ():
            if not self._ft_claimed:  # no lw scheduler class takes it: vLLM's path
                self.fallback("off")
                continue
            dr = self._d.get(ft.req_id)
            live = dr.transfer_id if dr is not None and not dr.aborted else \
                self._received.get(ft.req_id)  # its KV landed first: lw's scheduler decides
            if live == ft.transfer_id:
                self._first_in.append(ft)
        for rid in out.finished_sending or ():
            self._pushed.pop(rid, None)
            self._computes.released(rid)
        for rid in out.finished_recving or ():
            dr = self._d.pop(rid, None)
            if dr is not None and not dr.aborted:
                self._received[rid] = dr.transfer_id
                if not self._ft_claimed and rid not in (out.failed_recving or ()):
                    self.count("last_token_recomputed")  # vLLM's own scheduler: always
        if isinstance(wm, LwWorkerMeta):
            self._take_rates(wm)
            for rp in wm.reprefills:
                self._reprefill(rp)
            for rid, status, val in wm.ahead_answers:
                self._ahead.answered(rid, status, val)

    def _take_rates(self, wm: LwWorkerMeta) -> None:
        """The workers' latest rates (push_mode auto decides on them)."""
        if wm.compute_s_per_token is not None:
            self._compute_s_per_token = wm.compute_s_per_token
            self._compute_s_per_pair = wm.compute_s_per_pair
        for host, s in wm.wire_s_per_block.items():
            old = self._wire_s_per_block.get(host)
            # Logged when first known and when it moves by a quarter: what auto decides on.
            if self.cfg.push_mode == "auto" and (old is None or abs(s - old) > old / 4):
                c = self._compute_s_per_token
                log.info("lw: push_mode auto: decode host %s: %.3f ms of wire per block%s; "
                         "forward %s ms per token + %.3f us per attended pair", host, s * 1e3,
                         "" if old is None else f" (was {old * 1e3:.3f})",
                         "?" if c is None else f"{c * 1e3:.3f}",
                         self._compute_s_per_pair * 1e6)
            self._wire_s_per_block[host] = s

    def stats(self) -> LwKVConnectorStats | None:
        """Scheduler-side counters (metaserver failures, prefix hits) since the last call."""
        with self._lock:
            if not any(self._counts.values()) and not self._fallbacks:
                return None
            out = LwKVConnectorStats()
            out.data.update(self._counts)
            out.data[FALLBACKS], self._fallbacks = self._fallbacks, {}
            self._counts = dict.fromkeys(self._counts, 0)
            return out

    def close(self) -> None:
        """Stop the metaserver thread and the ahead fetches."""
        if self._poster is not None:
            self._poster.close()
        self._ahead.close()
