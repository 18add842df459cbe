"""``LwConnector``: vLLM's ``KVConnectorBase_V1`` for lw's layerwise, decode-first transfer.

The connector only translates. vLLM calls become core events (``add_request``,
``layer_computed``, ``abort``) fed to the worker's :class:`~lw.transport.runtime.WorkerLoop`;
core effects become vLLM return values (``SendFinished`` -> finished sending; ``RecvDone`` ->
finished receiving; ``RecvFailed`` -> finished *and* failed receiving plus load-error blocks).
Every protocol decision (deadlines, retries, quarantine, when blocks may be freed) is the core's.

Prefill (``kv_producer``): a request carrying ``do_remote_decode`` is pushed only in the step where
its prefill completes (earlier chunks send nothing); each layer's write then covers all its
blocks. ``request_finished`` keeps the blocks (delay_free) until the core's ``SendFinished``.
Decode (``kv_consumer``): blocks are allocated first (``get_num_new_matched_tokens`` returns the
whole uncached prompt, loaded asynchronously); the prefill is requested from the proxy's
metaserver by a background thread; the request decodes when the core reports ``RecvDone``.
The core's request id is the proxy's ``transfer_id`` (vLLM's request ids differ on P and D).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from lw.vllm_adapter.config import ConfigError, LwConfig
from lw.vllm_adapter.metrics import LwKVConnectorStats, LwPromMetrics

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from lw.transport.runtime import WorkerLoop

__all__ = ["LwConnector", "LwConnectorMetadata", "RecvSpec", "SendSpec"]

log = logging.getLogger("vllm.lw.connector")  # under "vllm": shown with vLLM's log settings

PARAMS_VERSION = 1
"""Version of the kv_transfer_params D posts to the metaserver (``lw_params_version``)."""


# ------------------------------------------------------------------------------------ metadata
@dataclass(frozen=True)
class SendSpec:
    """P: push this request's KV (its prefill completes in this step)."""

    transfer_id: str
    req_id: str
    decoder_host: str
    decoder_port: int  # D's side-channel port for tp rank 0 of its DP rank
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]


@dataclass(frozen=True)
class RecvSpec:
    """D: blocks were allocated for this request; its prefill is being requested."""

    transfer_id: str
    req_id: str
    block_ids: tuple[int, ...]


@dataclass
class LwConnectorMetadata(KVConnectorMetadata):
    """What the scheduler side tells every worker for one step."""

    sends: list[SendSpec] = field(default_factory=list)
    recvs: list[RecvSpec] = field(default_factory=list)
    aborts: list[tuple[str, str, str]] = field(default_factory=list)  # (transfer, req, reason)


def kv_geometry(kv_cache_config: KVCacheConfig) -> str:
    """What P and D must share to exchange blocks: layers, block size, page bytes, dtype."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"lw supports models with one KV cache group, this one has "
                          f"{len(groups)} (hybrid attention / HMA is not supported)")
    spec = groups[0].kv_cache_spec
    dtype = str(getattr(spec, "dtype", "?")).removeprefix("torch.")
    return (f"layers={len(groups[0].layer_names)} block_size={spec.block_size} "
            f"page_bytes={spec.page_size_bytes} dtype={dtype}")


_NORMAL_FINISH = {"FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED", "FINISHED_REPETITION"}


# ------------------------------------------------------------------------------ the connector
class LwConnector(KVConnectorBase_V1):
    """lw's KV connector; load with kv_connector="LwConnector", module path "lw.vllm_adapter"."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = LwConfig.from_vllm(vllm_config)
        self.geometry = kv_geometry(kv_cache_config)
        self._sched: _SchedulerSide | None = None
        self._worker: _WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = _SchedulerSide(self.cfg, vllm_config, self.geometry, self)
        else:
            self._worker = _WorkerSide(self.cfg, vllm_config, kv_cache_config)

    # ---------------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """D: the whole uncached prompt arrives asynchronously; P: nothing to load."""
        assert self._sched is not None
        return self._sched.num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """D: blocks allocated -> register with the worker and request the prefill."""
        assert self._sched is not None
        self._sched.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's pushes (P), new receives (D) and aborts."""
        assert self._sched is not None
        return self._sched.build_meta(scheduler_output)

    def on_new_request(self, request: Request) -> None:
        """P: start tracking a request to push."""
        assert self._sched is not None
        self._sched.on_new_request(request)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """P: keep pushed blocks until SendFinished; D: abort a receive still in progress."""
        assert self._sched is not None
        return self._sched.request_finished(request), None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forget requests the workers reported finished."""
        assert self._sched is not None
        self._sched.update_output(connector_output)

    def has_pending_push_work(self) -> bool:
        """P: keep the engine stepping while pushed requests have not been released."""
        return self._sched is not None and self._sched.has_pending_pushes()

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Every group: P writes all of the request's blocks (so none may be zeroed)."""
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def get_kv_connector_stats(self) -> LwKVConnectorStats | None:
        """Worker: counters since the last call and current gauges; scheduler: its own."""
        if self._worker is not None:
            return self._worker.stats()
        if self._sched is not None:
            return self._sched.stats()
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> LwKVConnectorStats | None:
        """Rebuild stats from their dict form (vLLM's logger process)."""
        return LwKVConnectorStats(data=dict(data)) if data else LwKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> LwPromMetrics:
        """``lw_*`` Prometheus series on the server's /metrics."""
        return LwPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe and register the KV memory, then start the worker's event loop."""
        assert self._worker is not None
        self._worker.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Hand this step's new requests and aborts to the core (before the forward)."""
        super().bind_connector_metadata(connector_metadata)
        assert self._worker is not None
        assert isinstance(connector_metadata, LwConnectorMetadata)
        self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Nothing: D's KV is pushed by P before the request is scheduled."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for (see start_load_kv)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """P: tell the core the layer is computed for this step's pushes (enqueue only)."""
        if self._worker is not None:
            self._worker.layer_done(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        """End of the forward: nothing waits (writes are asynchronous, blocks held until
        SendFinished); a push whose layer hooks did not all run is aborted."""
        if self._worker is not None:
            self._worker.end_of_forward()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """The layer hooks must run on every prefill step: no full CUDA graphs."""
        return True

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        """(finished sending, finished receiving) for vLLM versions without transfer results."""
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Core reports since the last step, as vLLM's transfer results."""
        assert self._worker is not None
        return self._worker.results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of receives that failed (reported with the failed request)."""
        assert self._worker is not None
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        """Stop the event loop and the data plane."""
        if self._worker is not None:
            self._worker.close()
        if self._sched is not None:
            self._sched.close()


# ------------------------------------------------------------------------- scheduler side
@dataclass
class _PReq:
    """P: a request to push once its prefill completes."""

    request: Any
    transfer_id: str
    host: str
    port: int
    remote_blocks: tuple[int, ...]
    first_block: int
    pushed: bool = False


@dataclass
class _DReq:
    """D: a request whose blocks are allocated and whose KV is awaited."""

    transfer_id: str
    aborted: bool = False


class _SchedulerSide:
    """Scheduler-role half: tracks requests, builds per-step metadata, calls the metaserver."""

    def __init__(self, cfg: LwConfig, vllm_config: Any, geometry: str,
                 owner: LwConnector) -> None:
        self.cfg = cfg
        self.owner = owner
        self.geometry = geometry
        self.block_size = int(vllm_config.cache_config.block_size)
        self._p: dict[str, _PReq] = {}  # vLLM req id -> tracked (P)
        self._pushed: dict[str, str] = {}  # vLLM req id -> transfer id, until finished sending
        self._d: dict[str, _DReq] = {}  # vLLM req id -> receiving (D)
        self._d_seen: set[str] = set()  # D requests already handled (never load twice)
        self._meta = LwConnectorMetadata()
        self._to_post: list[tuple[str, str, str, dict[str, Any]]] = []
        self._poster: _MetaserverPoster | None = None
        self._lock = threading.Lock()
        self._counts = {"metaserver_failures": 0}
        self._bad_params: set[str] = set()
        if not cfg.is_producer:  # started now: the first prefill request pays no thread start
            self._poster = _MetaserverPoster(cfg)

    # ------------------------------------------------------------------------------- P side
    def on_new_request(self, request: Request) -> None:
        """P: validate the decoder's params and track the request."""
        params = request.kv_transfer_params or {}
        if not self.cfg.is_producer or not params.get("do_remote_decode"):
            return
        rid = request.request_id
        try:
            self._p[rid] = self._parse_decoder_params(request, params)
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

    def _parse_decoder_params(self, request: Request, params: dict[str, Any]) -> _PReq:
        tid = params.get("transfer_id")
        if not isinstance(tid, str) or not tid:
            raise ValueError("kv_transfer_params has no transfer_id")
        version = params.get("lw_params_version")
        if version != PARAMS_VERSION:
            raise ValueError(f"kv_transfer_params lw_params_version={version!r}, this prefill "
                             f"engine speaks {PARAMS_VERSION} (is the decode engine running "
                             "lw's connector?)")
        host, port = params.get("remote_host"), params.get("remote_port")
        blocks = params.get("remote_block_ids")
        first = params.get("remote_first_block", 0)
        if not isinstance(host, str) or not host:
            raise ValueError(f"bad remote_host {host!r}")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ValueError(f"bad remote_port {port!r}")
        if (not isinstance(blocks, list) or not blocks
                or not all(isinstance(b, int) and b >= 0 for b in blocks)):
            raise ValueError("remote_block_ids must be a non-empty list of block ids")
        if not isinstance(first, int) or first < 0:
            raise ValueError(f"bad remote_first_block {first!r}")
        tp = params.get("remote_tp_size")
        if tp != self.cfg.tp_size:
            raise ValueError(f"decode TP {tp} != prefill TP {self.cfg.tp_size}: lw needs "
                             "equal tensor parallel sizes")
        geo = params.get("lw_geometry")
        if geo != self.geometry:
            raise ValueError(f"KV geometry differs: decode has {geo!r}, prefill has "
                             f"{self.geometry!r}")
        need = -(-request.num_prompt_tokens // self.block_size)
        if first + len(blocks) != need:
            raise ValueError(f"{first}+{len(blocks)} remote blocks for a prompt of "
                             f"{request.num_prompt_tokens} tokens ({need} blocks)")
        return _PReq(request, tid, host, port, tuple(blocks), first)

    def _push_if_complete(self, rid: str, num_scheduled: int) -> None:
        tr = self._p.get(rid)
        if tr is None or tr.pushed:
            return
        req = tr.request
        if req.num_computed_tokens + num_scheduled < req.num_prompt_tokens:
            return  # an earlier chunk: nothing is sent before the prefill completes
        manager = self.owner._kv_cache_manager
        assert manager is not None, "bind_kv_cache_manager was not called"
        (block_ids,) = manager.get_block_ids(rid)
        local = tuple(block_ids[tr.first_block:tr.first_block + len(tr.remote_blocks)])
        if len(local) != len(tr.remote_blocks):
            log.error("lw: request %s has %d blocks, %d expected; not pushed", rid,
                      len(block_ids), tr.first_block + len(tr.remote_blocks))
            del self._p[rid]
            return
        tr.pushed = True
        self._pushed[rid] = tr.transfer_id
        self._meta.sends.append(SendSpec(tr.transfer_id, rid, tr.host, tr.port, local,
                                         tr.remote_blocks))

    def has_pending_pushes(self) -> bool:
        """Pushed requests not yet reported finished sending."""
        return bool(self._pushed)

    # ------------------------------------------------------------------------------- D side
    def _remote_prefill(self, request: Request) -> dict[str, Any] | None:
        params = request.kv_transfer_params
        if (self.cfg.is_producer or not params or not params.get("do_remote_prefill")
                or request.request_id in self._d_seen):
            return None
        if not isinstance(params.get("transfer_id"), str) or not isinstance(
                params.get("metaserver"), str):
            if request.request_id not in self._bad_params:
                self._bad_params.add(request.request_id)
                log.error("lw: request %s has do_remote_prefill but no transfer_id/metaserver;"
                          " computing its prefill locally", request.request_id)
            return None
        return params

    def num_new_matched_tokens(self, request: Request, n: int) -> tuple[int, bool]:
        """D: (uncached prompt tokens, async) for a fresh remote-prefill request; else (0, F)."""
        if self._remote_prefill(request) is None:
            return 0, False
        count = request.num_prompt_tokens - n
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        """D: the blocks for the remote tokens exist: register them and ask for the prefill."""
        if num_external == 0:
            return  # second call after the load, or nothing to load
        params = self._remote_prefill(request)
        if params is None:
            return
        rid = request.request_id
        self._d_seen.add(rid)
        (block_ids,) = blocks.get_block_ids()
        first = (request.num_prompt_tokens - num_external) // self.block_size
        need = -(-request.num_prompt_tokens // self.block_size)
        remote = tuple(block_ids[first:need])
        tid = params["transfer_id"]
        self._d[rid] = _DReq(tid)
        self._meta.recvs.append(RecvSpec(tid, rid, remote))
        post = {
            "remote_engine_id": self.cfg.engine_id,
            "remote_host": self.cfg.host,
            "remote_port": self.cfg.port(tp_rank=0),
            "remote_block_ids": list(remote),
            "remote_first_block": first,
            "remote_dp_rank": self.cfg.dp_rank,
            "remote_tp_size": self.cfg.tp_size,
            "lw_geometry": self.geometry,
            "lw_params_version": PARAMS_VERSION,
        }
        self._to_post.append((rid, tid, params["metaserver"], post))

    # ------------------------------------------------------------------------------- common
    def build_meta(self, so: SchedulerOutput) -> LwConnectorMetadata:
        """Collect this step's metadata and reset."""
        if self.cfg.is_producer:
            for rid, n in so.num_scheduled_tokens.items():
                self._push_if_complete(rid, n)
        else:
            for rid, tid, reason in self._take_post_failures():
                dr = self._d.get(rid)
                if dr is not None and not dr.aborted:
                    dr.aborted = True
                    self._meta.aborts.append((tid, rid, reason))
        meta, self._meta = self._meta, LwConnectorMetadata()
        if self._to_post:
            # Posted after the worker has the request in this step's metadata: P's first
            # MetaRequest normally finds it registered (if not, D answers "unknown" and P retries).
            if self._poster is None:
                self._poster = _MetaserverPoster(self.cfg)
            for item in self._to_post:
                self._poster.post(*item)
            self._to_post = []
        return meta

    def request_finished(self, request: Request) -> bool:
        """Whether the blocks must outlive the request (P: pushed); queue aborts for workers."""
        rid = request.request_id
        self._bad_params.discard(rid)
        if self.cfg.is_producer:
            tr = self._p.pop(rid, None)
            if tr is None or not tr.pushed:
                return False
            if request.status.name not in _NORMAL_FINISH:
                self._meta.aborts.append((tr.transfer_id, rid,
                                          f"request {request.status.name}"))
            return True
        self._d_seen.discard(rid)
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
        """Requests released by the workers."""
        for rid in out.finished_sending or ():
            self._pushed.pop(rid, None)
        for rid in out.finished_recving or ():
            self._d.pop(rid, None)

    def _take_post_failures(self) -> list[tuple[str, str, str]]:
        if self._poster is None:
            return []
        failures = self._poster.take_failures()
        self._counts["metaserver_failures"] += len(failures)
        return failures

    def stats(self) -> LwKVConnectorStats | None:
        """Scheduler-side counters (metaserver failures) since the last call."""
        with self._lock:
            if not any(self._counts.values()):
                return None
            out = LwKVConnectorStats()
            out.data.update(self._counts)
            self._counts = dict.fromkeys(self._counts, 0)
            return out

    def close(self) -> None:
        """Stop the metaserver thread."""
        if self._poster is not None:
            self._poster.close()


class _MetaserverPoster:
    """D: one background thread POSTing prefill requests to the proxy's metaserver."""

    def __init__(self, cfg: LwConfig) -> None:
        self.cfg = cfg
        self._q: queue.Queue[tuple[str, str, str, dict[str, Any]] | None] = queue.Queue()
        self._cancelled: set[str] = set()
        self._failures: deque[tuple[str, str, str]] = deque()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="lw-metaserver", daemon=True)
        self._thread.start()

    def post(self, rid: str, tid: str, url: str, params: dict[str, Any]) -> None:
        """Queue one call (never blocks)."""
        self._q.put((rid, tid, url, params))

    def cancel(self, rid: str) -> None:
        """Skip a queued call for a request that ended."""
        with self._lock:
            self._cancelled.add(rid)

    def take_failures(self) -> list[tuple[str, str, str]]:
        """(req id, transfer id, reason) of calls that failed for good."""
        out = []
        while self._failures:
            out.append(self._failures.popleft())
        return out

    def close(self) -> None:
        """Stop after the call in progress."""
        self._q.put(None)

    def _run(self) -> None:
        import httpx

        with httpx.Client(timeout=self.cfg.metaserver_timeout_s) as client:
            while True:
                item = self._q.get()
                if item is None:
                    return
                rid, tid, url, params = item
                with self._lock:
                    if rid in self._cancelled:
                        self._cancelled.discard(rid)
                        continue
                reason = self._call(client, url, tid, params)
                if reason:
                    log.error("lw: prefill request for %s (transfer %s) failed: %s", rid, tid,
                              reason)
                    self._failures.append((rid, tid, f"metaserver: {reason}"))

    def _call(self, client: Any, url: str, tid: str, params: dict[str, Any]) -> str:
        body = {"transfer_id": tid, "kv_transfer_params": params}
        reason = ""
        for attempt in range(self.cfg.metaserver_attempts):
            if attempt:
                time.sleep(min(2.0, 0.2 * 2 ** attempt))
            try:
                resp = client.post(url, json=body)
            except Exception as exc:  # noqa: BLE001 - any transport error: retry, then report
                reason = f"POST {url}: {type(exc).__name__}: {exc}"
                continue
            if resp.status_code < 300:
                return ""
            reason = f"POST {url} answered {resp.status_code}: {resp.text[:300]}"
            if resp.status_code < 500:
                return reason  # 4xx: unknown transfer or bad body; retrying changes nothing
        return reason


# ---------------------------------------------------------------------------- worker side
def _layer_order(name: str) -> tuple[tuple[int, ...], str]:
    """Sort key of a layer name: the integers in it (model.layers.<i>...), then the name."""
    return tuple(int(p) for p in name.split(".") if p.isdigit()), name


class _ReadyGate:
    """cuda/npu: forwards a layer's event to the loop once its kernels have finished."""

    def __init__(self, loop: WorkerLoop) -> None:
        self._loop = loop
        self._q: queue.SimpleQueue[tuple[Any, tuple[int, ...], list[str]] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._run, name="lw-ready-gate", daemon=True)
        self._thread.start()

    def put(self, wait: Any, planes: tuple[int, ...], tids: list[str]) -> None:
        """Queue (never blocks)."""
        self._q.put((wait, planes, tids))

    def close(self) -> None:
        """Stop after the queued items."""
        self._q.put(None)

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            wait, planes, tids = item
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


_STAT_MAP = {  # our stats key -> WorkerLoop.stats() key (monotonic counters)
    "transfers": "loop.transfers_ok",
    "transfer_bytes": "loop.bytes_ok",
    "requests_done": "core.done",
    "requests_failed": "core.failed",
    "deadlines_fired": "core.deadlines",
    "leases_expired": "core.leases_expired",
    "protocol_errors": "loop.protocol_errors",
}


class _WorkerSide:
    """Worker-role half: owns the WorkerLoop (endpoint, side channel, data plane, timers)."""

    def __init__(self, cfg: LwConfig, vllm_config: Any, kv_cache_config: Any) -> None:
        self.cfg = cfg
        self.num_blocks = int(kv_cache_config.num_blocks)
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
        self._gate: _ReadyGate | None = None
        self._sample: Any = None
        self._step_sends: list[str] = []
        self._step_planes = 0
        self._rid: dict[str, str] = {}  # transfer id -> vLLM request id (live in the core)
        self._held: dict[str, int] = {}  # transfer id -> blocks held for it
        self._aborted: set[str] = set()  # transfer ids aborted by our scheduler (for logs)
        self._ours: set[str] = set()  # P: request ids pushed and not yet reported
        self._sched_finished: set[str] = set()
        self._pending_sending: set[str] = set()
        self._pending_recving: set[str] = set()
        self._pending_failed: set[str] = set()
        self._load_errors: set[int] = set()
        self._t0: dict[str, float] = {}  # P: transfer id -> first layer hook time
        self._lock = threading.Lock()  # guards the pending sets (Future callbacks)
        self._last: dict[str, float] = {}
        self._extra = dict.fromkeys(("transfer_seconds", "quarantines"), 0.0)
        self._last_stats_t = 0.0
        self._dirty = False
        self._reported_gauges: tuple[int, int] = (0, 0)

    # ---------------------------------------------------------------------------- start
    def register(self, kv_caches: dict[str, Any]) -> None:
        """Planes from the KV tensors, data plane + registration, endpoint, loop thread."""
        from lw.fsm import DecodeEndpoint, PrefillEndpoint
        from lw.transport.runtime import WorkerLoop
        from lw.transport.sidechannel import SideChannel, parse_cluster_key
        from lw.transport.wire import KVLayout, LayerLayout, Sender
        from lw.vllm_adapter.device import (
            merged_regions,
            planes_of,
            prepare_device,
            ready_marker,
        )

        if self.loop is not None:
            raise RuntimeError("register_kv_caches called twice")
        seen: dict[int, str] = {}
        for name in sorted(kv_caches, key=_layer_order):
            kv = kv_caches[name]
            first = kv[0] if isinstance(kv, (tuple, list)) else kv
            ptr = int(first.data_ptr())
            if ptr in seen:  # a layer sharing another layer's KV: transferred once
                self._plane_idx[name] = ()
                continue
            seen[ptr] = name
            ps = planes_of(kv, self.num_blocks, name)
            self._plane_idx[name] = tuple(range(len(self.planes), len(self.planes) + len(ps)))
            self.planes.extend(ps)
            self._sample = first
        if not self.planes:
            raise ConfigError("lw: register_kv_caches got no KV cache tensors")
        prepared = prepare_device(self._sample)
        layout = [LayerLayout(p.base_addr, p.block_stride, p.block_len, p.num_blocks)
                  for p in self.planes]
        dp = self._data_plane()
        try:
            for addr, length in merged_regions(self.planes):
                dp.register_memory(addr, length)
            side = SideChannel(self.cfg.bind_host or self.cfg.host, self.cfg.port(self.tp_rank),
                               cluster_key=parse_cluster_key(self.cfg.cluster_key or None),
                               advertise_host=self.cfg.host)
        except Exception:
            dp.close()
            raise
        me = Sender(self.cfg.engine_id, self.rank, self.incarnation, side.addr)
        name = f"lw-{'p' if self.cfg.is_producer else 'd'}{self.rank}"
        if self.cfg.is_producer:
            ep: Any = PrefillEndpoint(me, len(self.planes), self.cfg.prefill_config())
            self.loop = WorkerLoop(ep, side, dp, local_layout=layout, name=name)
        else:
            kv_layout = KVLayout(self.cfg.engine_id, self.incarnation, dp.session, layout)
            ep = DecodeEndpoint(me, kv_layout, self.cfg.decode_config())
            self.loop = WorkerLoop(ep, side, dp, name=name)
        self.loop.start()
        if ready_marker(self._sample) is not None:
            self._gate = _ReadyGate(self.loop)
        log.info("lw %s: side channel %s, transfer engine %s, %d planes x %d blocks of %d "
                 "bytes, %d registered regions%s", name, side.addr, dp.session, len(self.planes),
                 self.num_blocks, self.planes[0].block_len, len(merged_regions(self.planes)),
                 f"; {prepared}" if prepared else "")

    def _data_plane(self) -> Any:
        from lw.transport.dataplane import InProcessDataPlane, MooncakeDataPlane

        if self.cfg.data_plane == "inprocess":
            return InProcessDataPlane()
        return MooncakeDataPlane(hostname=self.cfg.host, timeout_s=self.cfg.transfer_timeout_s,
                                 metadata_server=self.cfg.mooncake_metadata_server,
                                 protocol=self.cfg.mooncake_protocol,
                                 device_name=self.cfg.mooncake_device)

    # ---------------------------------------------------------------------------- per step
    def _call(self, method: str, *args: Any, rid: str, tid: str) -> None:
        assert self.loop is not None
        fut = self.loop.call(method, *args)
        fut.add_done_callback(lambda f: self._call_done(f, method, rid, tid))

    def _call_done(self, fut: Any, method: str, rid: str, tid: str) -> None:
        exc = fut.exception()
        if exc is None:
            return
        log.error("lw: %s(%s) refused by the core: %r", method, tid, exc)
        if method == "add_request":
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
        from lw.fsm import PrefillRequest

        self._step_sends = []
        self._step_planes = 0
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
            self._call("add_request", r.transfer_id, r.block_ids, 1, rid=r.req_id,
                       tid=r.transfer_id)
        for s in meta.sends:
            if s.transfer_id in self._rid:
                with self._lock:
                    self._ours.add(s.req_id)
                self._give_back(s.req_id, s.transfer_id, "transfer id already in use")
                continue
            with self._lock:
                self._rid[s.transfer_id] = s.req_id
                self._held[s.transfer_id] = len(s.local_blocks)
                self._ours.add(s.req_id)
            addr = f"tcp://{s.decoder_host}:{s.decoder_port + self.tp_rank}"
            self._call("add_request", PrefillRequest(s.transfer_id, addr, s.local_blocks,
                                                     s.remote_blocks, 1),
                       rid=s.req_id, tid=s.transfer_id)
            self._step_sends.append(s.transfer_id)
        for tid, rid, reason in meta.aborts:
            if self._rid.get(tid) != rid:
                continue  # finished already, or never taken (a transfer id used twice)
            self._aborted.add(tid)
            self._call("abort", tid, reason, rid=rid, tid=tid)

    def layer_done(self, layer_name: str, kv_layer: Any) -> None:
        """Forward hook: enqueue "layer computed" for this step's pushes; never waits."""
        tids = self._step_sends
        if not tids:
            return
        planes = self._plane_idx.get(layer_name)
        if not planes:
            return
        loop = self.loop
        assert loop is not None
        if planes[0] == 0:
            now = time.monotonic()
            for tid in tids:
                self._t0.setdefault(tid, now)
        self._step_planes += len(planes)
        if self._gate is not None:
            from lw.vllm_adapter.device import ready_marker

            self._gate.put(ready_marker(kv_layer), planes, tids)
            return
        for i in planes:
            loop.layer_computed(i, tids)

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
        from lw.fsm import Quarantine, RecvDone, RecvFailed, SendFinished

        loop = self.loop
        if loop is None:
            return KVConnectorTransferResults()
        now = time.monotonic()
        for e in loop.drain_reports():
            self._dirty = True
            tid = e.req_id
            with self._lock:
                rid = self._rid.get(tid)
                if rid is None:
                    continue
                if isinstance(e, Quarantine):
                    self._extra["quarantines"] += 1
                    log.warning("lw: %s (transfer %s) failed, blocks quarantined: %s", rid, tid,
                                e.reason)
                    continue
                del self._rid[tid]
                self._held.pop(tid, None)
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
                elif isinstance(e, RecvFailed):
                    # Always reported as failed: vLLM ignores the failure of a request it already
                    # finished, and a request still waiting must never decode on partial KV.
                    self._pending_recving.add(rid)
                    self._pending_failed.add(rid)
                    self._load_errors.update(e.block_ids)
                    if tid not in self._aborted:
                        log.warning("lw: receive of %s (transfer %s) failed: %s", rid, tid,
                                    e.reason)
                self._aborted.discard(tid)
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
            data["transfer_seconds"] = self._extra["transfer_seconds"]
            data["quarantines"] = self._extra["quarantines"]
            self._extra["transfer_seconds"] = self._extra["quarantines"] = 0.0
        if not any(data.values()) and gauges == self._reported_gauges:
            return None
        self._reported_gauges = gauges
        data["live_requests"], data["held_blocks"] = gauges
        return LwKVConnectorStats(data=data)

    def close(self) -> None:
        """Stop the loop (closes side channel and data plane)."""
        if self._gate is not None:
            self._gate.close()
        if self.loop is not None:
            self.loop.stop()
