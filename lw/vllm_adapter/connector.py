"""``LwConnector``: vLLM's ``KVConnectorBase_V1`` for lw's layerwise, decode-first transfer.

The connector only translates. vLLM calls become core events (``add_request``,
``layer_computed``, ``abort``) fed to the worker's :class:`~lw.transport.runtime.WorkerLoop`;
core effects become vLLM return values (``SendFinished`` -> finished sending; ``RecvDone`` ->
finished receiving; ``RecvFailed`` -> finished *and* failed receiving plus load-error blocks).
Every protocol decision (deadlines, retries, quarantine, when blocks may be freed) is the core's.

Prefill (``kv_producer``): a request carrying ``do_remote_decode`` is pushed layer by layer as
its chunks compute (``push_mode``: from the chunk after which the compute left no longer covers
the transfer, from the first chunk, or in its last chunk only); each layer's write covers the
blocks its chunk completed. ``request_finished`` keeps the blocks (delay_free) until the core's
``SendFinished``.
Decode (``kv_consumer``): blocks are allocated first (``get_num_new_matched_tokens`` returns the
whole uncached prompt, loaded asynchronously); the prefill is requested from the proxy's
metaserver by a background thread; the request decodes when the core reports ``RecvDone``.
The core's request id is a transfer id D derives per vLLM request from the proxy's
``transfer_id`` (vLLM's request ids differ on P and D; one HTTP request may make several).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from lw.vllm_adapter.config import LwConfig
from lw.vllm_adapter.connector_meta import (
    LwConnectorMetadata,
    LwWorkerMeta,
    RecvSpec,
    SendSpec,
    kv_geometry,
)
from lw.vllm_adapter.metrics import LwKVConnectorStats, LwPromMetrics
from lw.vllm_adapter.scheduler_side import SchedulerSide
from lw.vllm_adapter.worker_side import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


__all__ = ["LwConnector", "LwConnectorMetadata", "RecvSpec", "SendSpec", "kv_geometry"]

# ------------------------------------------------------------------------------ the connector
class LwConnector(KVConnectorBase_V1):
    """lw's KV connector; load with kv_connector="LwConnector", module path "lw.vllm_adapter"."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.cfg = LwConfig.from_vllm(vllm_config)
        self.geometry = kv_geometry(kv_cache_config)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(self.cfg, vllm_config, self.geometry, self._block_ids)
        else:
            self._worker = WorkerSide(self.cfg, vllm_config, kv_cache_config)

    # ---------------------------------------------------------------------- scheduler side
    @property
    def scheduler_side(self) -> SchedulerSide | None:
        """The scheduler-role half (None in a worker): lw's scheduler classes read it."""
        return self._sched

    def _block_ids(self, rid: str) -> list[int]:
        """A request's block ids (one KV cache group), from the manager vLLM bound to us."""
        manager = self._kv_cache_manager
        assert manager is not None, "bind_kv_cache_manager was not called"
        (block_ids,) = manager.get_block_ids(rid)
        return block_ids

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """D: the uncached prompt arrives asynchronously (a short tail is computed); P: none."""
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
        params = self._sched.response_params(request)
        return self._sched.request_finished(request), params

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

    def build_connector_worker_meta(self) -> LwWorkerMeta | None:
        """P worker: its measured forward and wire rates, for the scheduler's push_mode auto;
        D worker: the re-prefills its core asked for (prefill failover)."""
        return self._worker.worker_meta() if self._worker is not None else None

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

    def tokens_sampled(self, req_ids: Sequence[str], tokens: Sequence[Sequence[int]],
                       params: Callable[[str], Any]) -> None:
        """P's runner sampled this step's tokens (lw's worker class calls it): a prompt this
        step completed sends its first token to D now, not a scheduler turn later."""
        if self._worker is not None and self._worker.loop is not None:
            self._worker.tokens_sampled(req_ids, tokens, params)

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




def register_with_vllm() -> None:
    """Make ``LwConnector`` known to vLLM's connector factory by name (idempotent): vLLM's
    MultiConnector rebuilds each wrapped connector's stats in its logger process by name and
    fails on an unregistered one, which would lose lw's series behind a MultiConnector."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # registered already (this module imported twice)
        KVConnectorFactory.register_connector("LwConnector", __name__, "LwConnector")


register_with_vllm()
