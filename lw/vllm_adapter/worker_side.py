"""The worker-role half of lw's connector: owns the WorkerLoop and translates vLLM's hooks.

vLLM calls become core events (add_request, layer_computed, abort, prefill_routed); core effects
become vLLM results (finished sending / receiving, failed receiving, load-error blocks), and a
D core's ``Reprefill`` goes to the scheduler side in the worker metadata (it asks the proxy).
The start (planes, data plane, endpoint, loop) is :mod:`lw.vllm_adapter.worker_start`'s.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from lw.fsm.failures import FailureKind
from lw.fsm.kvmap import expected_senders, targets_of
from lw.fsm.push_schedule import PushEstimate, writes_wait_for_forward
from lw.fsm.timeline import drain
from lw.vllm_adapter.ahead_client import AheadFetcher
from lw.vllm_adapter.config import LwConfig, ModelHeads, model_heads
from lw.vllm_adapter.connector_meta import (
    FetchSpec,
    FirstTokenIn,
    LwConnectorMetadata,
    LwWorkerMeta,
    Reprefill,
    SendSpec,
    log,
)
from lw.vllm_adapter.metrics import BY_REASON, LwKVConnectorStats
from lw.vllm_adapter.push_rates import PushRates
from lw.vllm_adapter.ready_gate import ReadyGate
from lw.vllm_adapter.tracing import LifecycleTracer, tracing_endpoint
from lw.vllm_adapter.worker_binds import AheadBinds
from lw.vllm_adapter.worker_first_tokens import FirstTokenRelay
from lw.vllm_adapter.worker_start import WorkerShape, start_worker

if TYPE_CHECKING:
    from lw.fsm.messages import FirstTokenStatus
    from lw.transport.runtime import WorkerLoop

__all__ = ["WorkerSide"]


_STAT_MAP = {  # our stats key -> WorkerLoop.stats() key (monotonic counters)
    "transfers": "loop.transfers_ok",
    "transfer_bytes": "loop.bytes_ok",
    "requests_done": "core.done",
    "requests_failed": "core.failed",
    "deadlines_fired": "core.deadlines",
    "leases_expired": "core.leases_expired",
    "protocol_errors": "loop.protocol_errors",
    "stuck_requests": "loop.stuck_requests",
    "checksum_mismatches": "core.checksum_mismatches",
}


class WorkerSide(AheadBinds, FirstTokenRelay):
    """Worker-role half: owns the WorkerLoop (endpoint, side channel, data plane, timers)."""

    def __init__(self, cfg: LwConfig, vllm_config: Any, kv_cache_config: Any) -> None:
        self.cfg = cfg
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.kv_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        self.heads = model_heads(vllm_config) or ModelHeads(1, False)
        self.fmt: Any = None
        try:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.tp_rank = int(get_tensor_model_parallel_rank())
        except Exception:  # noqa: BLE001 - no TP group (tests, single worker): rank 0
            self.tp_rank = 0
        self.rank = cfg.dp_rank * cfg.tp_size + self.tp_rank
        self.incarnation = time.time_ns()
        self.loop: WorkerLoop | None = None
        self.planes: list[Any] = []
        self._plane_idx: dict[str, tuple[int, ...]] = {}
        self._gate: ReadyGate | None = None
        self._sample: Any = None
        self._step_sends: list[str] = []
        self._step_planes = 0
        # P: this step's pushes whose writes wait for its forward's end, and the layers that
        # wait for it (lw.fsm.push_schedule.writes_wait_for_forward)
        self._step_wait: set[str] = set()
        self._wait_planes: list[int] = []
        self._loop_tid: Future | None = None  # P: the loop thread's kernel id, once it said
        self._idle_step = False
        self._step_t0 = 0.0  # when this step's metadata arrived (its forward starts)
        self._step_tokens = 0
        self._step_pairs = 0
        self.rates: PushRates | None = None  # P: forward and wire rates (push_mode "auto")
        self._idle_wait_s = cfg.idle_wait_ms / 1000
        self._rid: dict[str, str] = {}  # transfer id -> vLLM request id (live in the core)
        # P: a request computed ahead and bound here before the scheduler knew: its ahead id ->
        # D's id, for the scheduler's metadata still naming it by the first (worker_binds); a
        # step's metadata and a bind from the fetch thread take turns (RLock: the metadata's
        # own binds run under it)
        self._alias: dict[str, str] = {}
        self._bound_early: OrderedDict[str, None] = OrderedDict()  # (worker_binds)
        self._fetches: OrderedDict[str, FetchSpec] = OrderedDict()  # ahead id -> until bound
        self._step_lock = threading.RLock()
        self._fetcher: AheadFetcher | None = None  # P: D's params of requests computed ahead
        self._ahead_answers: list[tuple[str, str, Any]] = []  # for the scheduler's next step
        self._held: dict[str, int] = {}  # transfer id -> blocks held for it
        self._aborted: set[str] = set()  # transfer ids aborted by our scheduler (for logs)
        self._ours: set[str] = set()  # P: request ids pushed and not yet reported
        self._sched_finished: set[str] = set()
        self._pending_sending: set[str] = set()
        self._pending_recving: set[str] = set()
        self._pending_failed: set[str] = set()
        self._failed_by: dict[str, int] = {}  # D: failed receives by failure kind, since stats()
        self._load_errors: set[int] = set()
        self._reprefills: list[Reprefill] = []  # D: for the scheduler's next worker metadata
        self._first_in: list[FirstTokenIn] = []  # D: P's first tokens, likewise
        self._step_final: dict[str, str] = {}  # P: (worker_first_tokens.tokens_sampled)
        self._token_first: dict[str, tuple[int, PushEstimate]] = {}  # P: (hold_for_token)
        self._held_for_token: list[tuple[tuple[int, ...], tuple[str, ...], float]] = []
        self._hands_tokens = False
        self._final_hook_t: float | None = None
        self._sample_s: float | None = None
        self._done_rid: OrderedDict[str, str] = OrderedDict()  # D: receives done (their token)
        self._ft_status: FirstTokenStatus | None = None  # the engine's, for `lw status`
        self._ft_refused = 0  # first-token status snapshots refused (malformed, oversized)
        self._t0: dict[str, float] = {}  # P: transfer id -> first layer hook time
        self._lock = threading.Lock()  # guards the pending sets (Future callbacks)
        self._last: dict[str, float] = {}
        self._extra = dict.fromkeys(("transfer_seconds", "quarantines", "ahead_bound_early"),
                                    0.0)
        self._last_stats_t = 0.0
        self._dirty = False
        self._reported_gauges: tuple[int, int] = (0, 0)
        self._trace_endpoint = tracing_endpoint(vllm_config)
        self.tracer: LifecycleTracer | None = None  # vLLM's tracing on: transfer spans

    # ---------------------------------------------------------------------------- start
    def register(self, kv_caches: dict[str, Any]) -> None:
        """Planes from the KV tensors, data plane + registration, endpoint, loop thread
        (lw.vllm_adapter.worker_start); then the push rates, spans and the ready gate."""
        from lw.vllm_adapter.device import ready_marker

        if self.loop is not None:
            raise RuntimeError("register_kv_caches called twice")
        shape = WorkerShape(self.cfg, self.num_blocks, self.kv_spec, self.heads, self.tp_rank,
                            self.rank, self.incarnation)
        started = start_worker(shape, kv_caches, self._ft_status)
        self.loop, self.fmt, name = started.loop, started.fmt, started.name
        self.planes, self._plane_idx, self._sample = (started.planes, started.plane_idx,
                                                      started.sample)
        if self.cfg.is_producer:
            self.rates = PushRates(self._block_bytes())
            self._loop_tid = self.loop.run(lambda _loop: threading.get_native_id())
        if self._trace_endpoint:
            try:
                self.tracer = LifecycleTracer(self._trace_endpoint, "prefill" if
                                              self.cfg.is_producer else "decode", name,
                                              len(self.planes))
            except Exception as exc:  # noqa: BLE001 - no spans, the transfers go on
                log.warning("lw: OpenTelemetry spans off: %s", exc)
        if ready_marker(self._sample) is not None:
            self._gate = ReadyGate(self.loop)

    # ---------------------------------------------------------------------------- per step
    def _call(self, method: str, *args: Any, rid: str, tid: str, **kwargs: Any) -> None:
        assert self.loop is not None
        fut = self.loop.call(method, *args, **kwargs)
        fut.add_done_callback(lambda f: self._call_done(f, method, rid, tid))

    def _call_done(self, fut: Any, method: str, rid: str, tid: str) -> None:
        exc = fut.exception()
        if exc is None:
            return
        log.error("lw: %s(%s) refused by the core: %r", method, tid, exc)
        if method in ("add_request", "add_ahead"):
            self._give_back(rid, tid, f"core refused the request: {exc}")

    def _give_back(self, rid: str, tid: str, reason: str) -> None:
        """Report a request the core never took (so vLLM frees its blocks)."""
        with self._lock:
            if self._rid.get(tid) == rid:
                del self._rid[tid]
                self._held.pop(tid, None)
            if self.cfg.is_producer:
                self._pending_sending.add(rid)
            else:
                self._pending_recving.add(rid)
                self._pending_failed.add(rid)
        log.error("lw: request %s (transfer %s) not transferred: %s", rid, tid, reason)

    def bind(self, meta: LwConnectorMetadata) -> None:
        """New receives/pushes and aborts to the core, in order, before the forward pass."""
        with self._step_lock:
            self._take(meta)

    def _take(self, meta: LwConnectorMetadata) -> None:
        from lw.fsm import PrefillRequest

        self.release_held_layers()  # a step whose runner did not hand its tokens over
        self._step_sends = []
        self._step_planes = 0
        self._step_wait = set()
        self._wait_planes = []
        self._step_final = {}
        self._idle_step = meta.idle
        self._step_t0 = time.monotonic()
        self._step_tokens = meta.step_tokens
        self._step_pairs = meta.step_pairs
        if meta.first_token is not None:
            self._keep_first_token_status(meta.first_token)
        if self.loop is None:
            if meta.sends or meta.recvs:
                raise RuntimeError("lw: connector metadata before register_kv_caches")
            return
        for r in meta.recvs:
            if r.transfer_id in self._rid:
                self._give_back(r.req_id, r.transfer_id, "transfer id already in use")
                continue
            with self._lock:
                self._rid[r.transfer_id] = r.req_id
                self._held[r.transfer_id] = len(r.block_ids)
            if self.tracer is not None:
                self.tracer.begin(r.transfer_id, r.trace, {"lw.request_id": r.req_id})
            senders = expected_senders(self.fmt, self.cfg.peer_tp_size or self.cfg.tp_size)
            self._call("add_request", r.transfer_id, r.block_ids, senders, rid=r.req_id,
                       tid=r.transfer_id, prompt=r.prompt)
        for f in meta.fetches:
            self.fetch(f)
        for b in meta.binds:  # before this step's chunks, which already carry D's id
            self._bind(b)
        alias = self._alias
        for s in meta.sends:
            if not s.first:  # a further chunk of a request the core holds (or released)
                tid = alias.get(s.transfer_id, s.transfer_id) if alias else s.transfer_id
                if self._rid.get(tid) != s.req_id:
                    continue  # released already (failed): nothing more is sent
                with self._lock:
                    self._held[tid] = self._held.get(tid, 0) + len(s.local_blocks)
                self._call("add_chunk", tid, s.local_blocks, s.final, rid=s.req_id, tid=tid)
                self._step_sends.append(tid)
                if s.final and self.cfg.first_token_from_p:
                    self._step_final[s.req_id] = s.transfer_id
                    self._may_hold_for_token(tid, s)
                continue
            if s.transfer_id in self._rid:
                with self._lock:
                    self._ours.add(s.req_id)
                self._give_back(s.req_id, s.transfer_id, "transfer id already in use")
                continue
            with self._lock:
                self._rid[s.transfer_id] = s.req_id
                self._held[s.transfer_id] = len(s.local_blocks)
                self._ours.add(s.req_id)
            if self.tracer is not None:
                self.tracer.begin(s.transfer_id, s.trace, {
                    "lw.request_id": s.req_id, "lw.peer": f"{s.decoder_host}:{s.decoder_port}",
                    "lw.decode_tp": s.decoder_tp})
            if s.final and self.cfg.first_token_from_p:
                self._step_final[s.req_id] = s.transfer_id
            if s.ahead:  # computed before D's params are known: nothing is sent until bound
                self._call("add_ahead", s.transfer_id, s.local_blocks, s.final, s.prompt,
                           rid=s.req_id, tid=s.transfer_id)
                if s.local_blocks:
                    self._step_sends.append(s.transfer_id)
                continue
            addrs = self._addrs(s.decoder_host, s.decoder_port, s.decoder_tp)
            self._call("add_request", PrefillRequest(s.transfer_id, addrs, s.local_blocks,
                                                     s.remote_blocks, 1, s.final, s.epoch,
                                                     s.prompt),
                       rid=s.req_id, tid=s.transfer_id)
            if s.local_blocks:  # a first chunk that completes no block reports no layer
                self._step_sends.append(s.transfer_id)
                if s.final and self._waits_for_forward(s):
                    self._step_wait.add(s.transfer_id)
                if s.final and self.cfg.first_token_from_p:
                    self._may_hold_for_token(s.transfer_id, s)
        for tid, rid, reason in meta.aborts:
            why = meta.abort_kinds.get(tid)  # D: the scheduler's own cause (metaserver)
            tid = alias.get(tid, tid) if alias else tid
            if self._rid.get(tid) != rid:
                continue  # finished already, or never taken (a transfer id used twice)
            self._aborted.add(tid)
            kw = {"kind": FailureKind(why)} if why else {}
            self._call("abort", tid, reason, rid=rid, tid=tid, **kw)
        if meta.first_tokens and self.cfg.is_producer:
            self._send_first_tokens(meta)
        for r in meta.routes:  # the core ignores a route of an epoch it has left
            tid = alias.get(r.transfer_id, r.transfer_id) if alias else r.transfer_id
            if self._rid.get(tid) == r.req_id:
                self._call("prefill_routed", tid, r.engine_id, r.addr, r.epoch, rid=r.req_id,
                           tid=tid)

    def _addrs(self, host: str, port: int, decoder_tp: int) -> tuple[str, ...]:
        """The side channels of the D TP ranks this P rank writes into: D's rank j listens on
        its rank-0 port + j, and which ranks we feed follows the heads."""
        return tuple(f"tcp://{host}:{port + j}" for j in targets_of(self.fmt, decoder_tp))

    def layer_done(self, layer_name: str, kv_layer: Any) -> None:
        """Forward hook: enqueue "layer computed" for this step's pushes, and time a prefill
        step's forward at its last layer (push_mode auto); never waits."""
        tids = self._step_sends
        rates = self.rates
        if not tids and (rates is None or self._step_tokens < rates.min_tokens):
            return
        planes = self._plane_idx.get(layer_name)
        if not planes:
            return
        then = None
        if rates is not None and planes[-1] == len(self.planes) - 1:  # the forward's last layer
            # Every prefill step is timed, pushing or not: "auto" needs the early chunks' cost
            # before it decides to push them.
            t0, n, pairs = self._step_t0, self._step_tokens, self._step_pairs

            def then() -> None:
                rates.forward_done(time.monotonic() - t0, n, pairs)
        if not tids:
            if then is not None:
                self._after_ready(kv_layer, (), tids, then)
            return
        if planes[0] == 0:
            now = time.monotonic()
            for tid in tids:
                self._t0.setdefault(tid, now)
        self._step_planes += len(planes)
        wait = self._step_wait
        if not wait:
            self._after_ready(kv_layer, planes, tids, then)
            return
        now = [t for t in tids if t not in wait]
        if planes[-1] != len(self.planes) - 1:  # the waiting pushes' layers go at the last
            self._wait_planes.extend(planes)
            if now:
                self._after_ready(kv_layer, planes, now, None)
            return
        if now:
            self._after_ready(kv_layer, planes, now, None)
        self._after_ready(kv_layer, (*self._wait_planes, *planes), [t for t in tids if t in wait],
                          then)
        self._wait_planes = []

    def _waits_for_forward(self, s: SendSpec) -> bool:
        """Whether push ``s`` (its first and last chunk in this step) writes once the forward
        is done: P's first token goes to D, the forward runs on the host's CPUs (no device),
        lw's loop thread runs only on the forward's CPUs and the link measured to D is fast
        enough (lw.fsm.push_schedule)."""
        rates, fut = self.rates, self._loop_tid
        if rates is None or fut is None or not fut.done() or fut.exception() is not None:
            return False
        if self._gate is not None:  # a device's forward: the host's CPUs do not run it
            return False
        if not self.cfg.first_token_from_p or self.cfg.write_during_forward or self.loop is None:
            return False
        try:  # called on the forward's thread: 0 is its own affinity
            shares = os.sched_getaffinity(fut.result()) <= os.sched_getaffinity(0)
        except OSError:
            return False
        est = self._estimate(s)
        assert est is not None
        return writes_wait_for_forward(blocks_to_send=len(s.local_blocks),
                                       tokens=self._step_tokens, pairs=self._step_pairs,
                                       est=est, shares_core=shares)

    def _estimate(self, s: SendSpec) -> PushEstimate | None:
        """P's forward rates and the link's to push ``s``'s D (None: no rates kept)."""
        if self.rates is None or self.loop is None:
            return None
        return self.rates.estimate(self.loop.writes.link.goodput.get(s.decoder_host))

    def _after_ready(self, kv_layer: Any, planes: tuple[int, ...], tids: list[str],
                     then: Callable[[], None] | None) -> None:
        """Once the layer's kernels finished (at once on a CPU): report its planes computed for
        ``tids``, then run ``then``."""
        if self._gate is not None:
            from lw.vllm_adapter.device import ready_marker

            self._gate.put(ready_marker(kv_layer), planes, tids, then)
            return
        loop = self.loop
        assert loop is not None
        if planes and planes[-1] == len(self.planes) - 1:  # the forward's last hook
            tids = self.hold_for_token(planes, tids)
        if tids:
            for i in planes:
                loop.layer_computed(i, tids)
        if then is not None:
            then()

    def end_of_forward(self) -> None:
        """A step whose forward skipped layer hooks cannot send: fail its pushes now."""
        if self._step_sends and self._step_planes != len(self.planes):
            for tid in self._step_sends:
                rid = self._rid.get(tid)
                if rid is not None:
                    self._call("abort", tid, f"only {self._step_planes} of {len(self.planes)} "
                               "layer hooks ran in the prefill step (CUDA graphs?)",
                               rid=rid, tid=tid)
        self._step_sends = []

    def results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Core reports -> vLLM: finished sending (once vLLM finished the request), finished /
        failed receiving, load-error blocks."""
        from lw.fsm import (
            FirstTokenTaken,
            Quarantine,
            RecvDone,
            RecvFailed,
            ReleaseBlocks,
            SendFinished,
        )
        from lw.fsm import Reprefill as CoreReprefill

        loop = self.loop
        if loop is None:
            return KVConnectorTransferResults()
        if self._idle_step and self._idle_wait_s and self._rid:
            # Nothing computed in this step and lw has transfers in progress: end the step when
            # one finishes (or after idle_wait_ms) rather than spin the engine loop.
            self._idle_step = False
            loop.wait_reports(self._idle_wait_s)
        now = time.monotonic()
        ended: list[tuple[str, bool, str, dict[str, Any]]] = []  # traced requests that ended
        for e in loop.drain_reports():
            self._dirty = True
            tid = e.req_id
            if isinstance(e, FirstTokenTaken):  # the KV's lifecycle goes on regardless
                self._first_taken(e)
                continue
            with self._lock:
                rid = self._rid.get(tid)
                if rid is None:
                    continue
                if isinstance(e, Quarantine):
                    self._extra["quarantines"] += 1
                    log.warning("lw: %s (transfer %s) failed, blocks quarantined: %s", rid, tid,
                                e.reason)
                    continue
                if isinstance(e, CoreReprefill):  # the core keeps the blocks; the proxy picks
                    self._reprefills.append(Reprefill(tid, rid, e.epoch, e.avoid, e.reason))
                    continue
                if isinstance(e, ReleaseBlocks):  # never: this loop grants no fresh blocks
                    log.error("lw: %s: release of blocks this worker never gave up: %s", rid,
                              e.reason)
                    continue
                del self._rid[tid]
                blocks = self._held.pop(tid, 0)
            if self._alias:  # (not under _lock: bind_now takes the two the other way round)
                self._unalias(tid)
            if self.tracer is not None and self.tracer.traced(tid):
                ok = isinstance(e, (SendFinished, RecvDone)) and getattr(e, "ok", True)
                ended.append((tid, ok, getattr(e, "reason", ""), {
                    "lw.blocks": blocks, "lw.bytes": blocks * self._block_bytes()}))
            with self._lock:
                if isinstance(e, SendFinished):
                    self._pending_sending.add(rid)
                    t0 = self._t0.pop(tid, None)
                    if e.ok and t0 is not None:
                        self._extra["transfer_seconds"] += now - t0
                    if not e.ok:
                        log.warning("lw: push of %s (transfer %s) failed: %s", rid, tid,
                                    e.reason)
                elif isinstance(e, RecvDone):
                    self._pending_recving.add(rid)
                    self._done_receiving(tid, rid)
                elif isinstance(e, RecvFailed):
                    # Always reported as failed: vLLM ignores the failure of a request it already
                    # finished, and a request still waiting must never decode on partial KV.
                    self._pending_recving.add(rid)
                    self._pending_failed.add(rid)
                    self._load_errors.update(e.block_ids)
                    kind = e.kind.value  # the core decided it (lw.fsm.failures)
                    self._failed_by[kind] = self._failed_by.get(kind, 0) + 1
                    if tid not in self._aborted:
                        log.warning("lw: receive of %s (transfer %s) failed: %s", rid, tid,
                                    e.reason)
                self._aborted.discard(tid)
        if ended and self.tracer is not None:  # list() of a deque is one C call: no torn read
            self.tracer.finish_all(ended, list(loop.endpoint.timeline.ring or ()))
        if loop.crashed is not None:
            self._fail_everything(f"lw worker loop crashed: {loop.crashed!r}")
        with self._lock:
            self._sched_finished.update(r for r in finished_req_ids if r in self._ours)
            sending = self._pending_sending & self._sched_finished
            self._pending_sending -= sending
            self._sched_finished -= sending
            self._ours -= sending
            recving, self._pending_recving = self._pending_recving, set()
            failed, self._pending_failed = self._pending_failed & recving, (
                self._pending_failed - recving)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def _block_bytes(self) -> int:
        """Bytes of one block over every layer plane of this worker."""
        return sum(p.block_len for p in self.planes)

    def _fail_everything(self, reason: str) -> None:
        with self._lock:
            live = list(self._rid.items())
        for tid, rid in live:
            self._give_back(rid, tid, reason)

    def take_load_errors(self) -> set[int]:
        """Blocks of failed receives since the last call."""
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def stats(self) -> LwKVConnectorStats | None:
        """Deltas of the loop's counters since the last report, plus gauges (only on change)."""
        loop = self.loop
        if loop is None:
            return None
        now = time.monotonic()
        with self._lock:
            gauges = (len(self._rid), sum(self._held.values()))
        # Every counter change ends in a report drained by results() (which sets _dirty) or
        # shows in the gauges; the periodic refresh catches the rest (e.g. protocol errors).
        if not self._dirty and gauges == self._reported_gauges and now - self._last_stats_t < 1:
            return None
        self._dirty = False
        self._last_stats_t = now
        raw = loop.stats()
        data: dict[str, float] = {}
        for key, src in _STAT_MAP.items():
            cur = float(raw.get(src, 0) or 0)
            data[key] = cur - self._last.get(key, 0.0)
            self._last[key] = cur
        fails = float(raw.get("loop.transfers_failed", 0)) + float(
            raw.get("loop.write_setup_failures", 0))
        data["transfer_failures"] = fails - self._last.get("transfer_failures", 0.0)
        self._last["transfer_failures"] = fails
        with self._lock:
            data.update(self._extra)
            self._extra = dict.fromkeys(self._extra, 0.0)
            failed_by, self._failed_by = self._failed_by, {}
        data_s: dict[str, Any] = dict(data)
        data_s[BY_REASON] = failed_by
        data_s["time_in_state"] = [list(x) for x in loop.endpoint.timeline.drain_durations()]
        data_s["layer_write_seconds"] = drain(loop.writes.latencies)
        if not any(data_s.values()) and gauges == self._reported_gauges:
            return None
        self._reported_gauges = gauges
        data_s["live_requests"], data_s["held_blocks"] = gauges
        return LwKVConnectorStats(data=data_s)

    def worker_meta(self) -> LwWorkerMeta | None:
        """P: the forward and wire rates for the scheduler's push_mode "auto" and the answers
        of its fetches (computing ahead); D: the re-prefills the core asked for and P's first
        tokens it took since the last step."""
        if self.loop is None:
            return None
        if self.rates is None:
            with self._lock:
                out, self._reprefills = self._reprefills, []
                firsts = self._take_first_in()
            return LwWorkerMeta(reprefills=out, first_tokens=firsts) if out or firsts else None
        wm = self.rates.meta(self.loop.writes.link.goodput)
        if self._ahead_answers:
            with self._lock:
                answers, self._ahead_answers = self._ahead_answers, []
            wm = wm or LwWorkerMeta()
            wm.ahead_answers = answers
        return wm

    def close(self) -> None:
        """Stop the loop (closes side channel and data plane)."""
        if self._gate is not None:
            self._gate.close()
        if self._fetcher is not None:
            self._fetcher.close()
        if self.loop is not None:
            self.loop.stop()
