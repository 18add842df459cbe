"""A worker's start: the KV planes from vLLM's tensors, this rank's head format, the data plane
with the planes registered, the side channel, the core endpoint and its loop, started.

Split from :class:`lw.vllm_adapter.worker_side.WorkerSide` (which calls :func:`start_worker`
once, from ``register_kv_caches``, and keeps what it returns).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lw.fsm.kvmap import describe
from lw.vllm_adapter.config import ConfigError, LwConfig, ModelHeads
from lw.vllm_adapter.connector_meta import log
from lw.vllm_adapter.placement import parse_cpus, transport_threads

if TYPE_CHECKING:
    from lw.fsm.messages import FirstTokenStatus
    from lw.transport.runtime import WorkerLoop

__all__ = ["Started", "WorkerShape", "data_plane", "head_format", "layer_order",
           "start_worker"]


def layer_order(name: str) -> tuple[tuple[int, ...], str]:
    """Sort key of a layer name: the integers in it (model.layers.<i>...), then the name."""
    return tuple(int(p) for p in name.split(".") if p.isdigit()), name


@dataclass(frozen=True)
class WorkerShape:
    """What a worker knows of itself before its KV cache exists."""

    cfg: LwConfig
    num_blocks: int
    kv_spec: Any  # vLLM's KV cache spec of the first group
    heads: ModelHeads
    tp_rank: int
    rank: int  # dp_rank * tp_size + tp_rank
    incarnation: int


@dataclass
class Started:
    """A started worker: its loop, its planes (one per layer and K/V part) and their format."""

    loop: WorkerLoop
    name: str  # lw-p<rank> / lw-d<rank>
    planes: list[Any]
    plane_idx: dict[str, tuple[int, ...]]  # layer name -> its planes (() when shared)
    sample: Any  # one KV tensor: device and ready markers
    fmt: Any  # this rank's head format (lw.fsm.kvmap)


def start_worker(shape: WorkerShape, kv_caches: dict[str, Any],
                 first_token: FirstTokenStatus | None) -> Started:
    """Planes from the KV tensors, data plane + registration, endpoint, loop thread."""
    from lw.fsm import DecodeEndpoint, PrefillEndpoint
    from lw.transport.runtime import WorkerLoop
    from lw.transport.sidechannel import SideChannel, parse_cluster_key
    from lw.transport.wire import KVLayout, LayerLayout, Sender
    from lw.vllm_adapter.device import (
        device_type,
        merged_regions,
        planes_of,
        prepare_device,
    )

    cfg = shape.cfg
    seen: dict[int, str] = {}
    planes: list[Any] = []
    plane_idx: dict[str, tuple[int, ...]] = {}
    sample: Any = None
    for name in sorted(kv_caches, key=layer_order):
        kv = kv_caches[name]
        first = kv[0] if isinstance(kv, (tuple, list)) else kv
        ptr = int(first.data_ptr())
        if ptr in seen:  # a layer sharing another layer's KV: transferred once
            plane_idx[name] = ()
            continue
        seen[ptr] = name
        ps = planes_of(kv, shape.num_blocks, name)
        plane_idx[name] = tuple(range(len(planes), len(planes) + len(ps)))
        planes.extend(ps)
        sample = first
    if not planes:
        raise ConfigError("lw: register_kv_caches got no KV cache tensors")
    prepared = prepare_device(sample)
    fmt = head_format(shape, kv_caches[min(seen.values(), key=layer_order)])
    layout = [LayerLayout(p.base_addr, p.block_stride, p.block_len, p.num_blocks)
              for p in planes]
    # Mooncake's and ZMQ's IO threads start inside these constructors and the loop thread
    # at start(): all off the forward's pinned cores (lw.vllm_adapter.placement).
    cpus = parse_cpus(cfg.transport_cpus)
    with transport_threads(cpus):
        dp = data_plane(cfg)
        try:
            for addr, length in merged_regions(planes):
                dp.register_memory(addr, length)
            side = SideChannel(cfg.bind_host or cfg.host, cfg.port(shape.tp_rank),
                               cluster_key=parse_cluster_key(cfg.cluster_key or None),
                               advertise_host=cfg.host)
        except Exception:
            dp.close()
            raise
    me = Sender(cfg.engine_id, shape.rank, shape.incarnation, side.addr)
    name = f"lw-{'p' if cfg.is_producer else 'd'}{shape.rank}"
    loop_cfg = cfg.loop_config(name)
    if device_type(sample) == "cpu":
        # A forward on the host's CPUs runs Python between its kernels: a loop polling every
        # hot_poll_s through it takes the interpreter's lock from it each time, wherever its
        # thread runs (128-token prompts here: ~30 polls in P's step and the step 10 ms longer
        # than a single server's). The loop wakes per layer event (batched) instead.
        loop_cfg = dataclasses.replace(loop_cfg, hot_poll_s=0.0)
    kv_layout = KVLayout(cfg.engine_id, shape.incarnation, dp.session, layout, fmt)
    if cfg.is_producer:
        ep: Any = PrefillEndpoint(me, len(planes), cfg.prefill_config(), local=kv_layout)
        loop = WorkerLoop(ep, side, dp, loop_cfg, local_layout=layout)
    else:
        dcfg = cfg.decode_config()
        if dcfg.fence_data and not getattr(dp, "can_fence", False):
            # Mooncake over TCP whose two ports could not be told apart from another
            # thread's listener: run as before the fence rather than not at all
            log.warning("lw: D %s rank %d cannot fence its Mooncake data plane (its listening "
                        "ports are unknown); a lease's end frees blocks that bytes a lossy "
                        "link still carries may reach: turn kv_checksum on",
                        cfg.engine_id, shape.rank)
            dcfg = dataclasses.replace(dcfg, fence_data=False)
        ep = DecodeEndpoint(me, kv_layout, dcfg)
        # No fresh_blocks allocator: a worker cannot allocate outside vLLM's scheduler (the
        # config refuses retry_fresh_blocks), so D fences before a retry.
        loop = WorkerLoop(ep, side, dp, loop_cfg)
    loop.first_token = first_token  # what the scheduler said before, if anything
    with transport_threads(cpus):
        loop.start()  # the loop starts the data plane's sender and fence threads
    log.info("lw %s: side channel %s, transfer engine %s, %d planes x %d blocks of %d "
             "bytes, %d registered regions, %s%s", name, side.addr, dp.session,
             len(planes), shape.num_blocks, planes[0].block_len,
             len(merged_regions(planes)), describe(fmt),
             f"; {prepared}" if prepared else "")
    return Started(loop, name, planes, plane_idx, sample, fmt)


def head_format(shape: WorkerShape, kv: Any) -> Any:
    """This rank's head format: which of the model's KV heads its blocks hold, and how."""
    from lw.fsm.kvmap import make_format
    from lw.vllm_adapter.device import block_order

    cfg, spec = shape.cfg, shape.kv_spec
    heads = int(getattr(spec, "num_kv_heads", 1) or 1)
    tokens = int(spec.block_size)
    try:
        order = ("HND" if shape.heads.mla
                 else block_order(kv, shape.num_blocks, heads, tokens))
    except ValueError as exc:
        if cfg.peer_tp_size in (0, cfg.tp_size):
            order = "HND"  # equal TP: whole blocks are copied, the order does not matter
        else:
            raise ConfigError(f"lw: prefill and decode TP differ but this KV cache cannot "
                              f"be split by head: {exc}") from None
    fmt = make_format(tp_rank=shape.tp_rank, tp_size=cfg.tp_size,
                      total_heads=shape.heads.total, block_tokens=tokens,
                      dtype=str(spec.dtype).removeprefix("torch."), order=order,
                      mla=shape.heads.mla)
    if not shape.heads.mla and fmt.head_hi - fmt.head_lo != heads:
        raise ConfigError(f"lw: TP rank {shape.tp_rank} of {cfg.tp_size} holds {heads} "
                          f"KV heads, but {shape.heads.total} heads over TP "
                          f"{cfg.tp_size} give {fmt.head_hi - fmt.head_lo}")
    return fmt


def data_plane(cfg: LwConfig) -> Any:
    """The configured data plane (Mooncake, NIXL or in-process), a test's fault wrapped round it."""
    from lw.transport.dataplane import InProcessDataPlane, MooncakeDataPlane
    from lw.transport.dataplane.planted import planted_from_env

    if cfg.data_plane == "inprocess":
        dp: Any = InProcessDataPlane()
    elif cfg.data_plane == "nixl":  # UCX's settings: its UCX_* environment variables
        from lw.transport.dataplane.nixl import NixlDataPlane
        # P only writes: its sender progresses UCX itself (no progress thread on its cores)
        dp = NixlDataPlane(hostname=cfg.host, timeout_s=cfg.transfer_timeout_s,
                           progress_thread=not cfg.is_producer)
    else:
        dp = MooncakeDataPlane(hostname=cfg.host, timeout_s=cfg.transfer_timeout_s,
                               metadata_server=cfg.mooncake_metadata_server,
                               protocol=cfg.mooncake_protocol,
                               device_name=cfg.mooncake_device)
    planted = planted_from_env(dp)  # e2e tests plant wrong KV, or hold writes
    if planted is not dp:
        log.warning("lw: a test fault wraps the data plane: %s around %s",
                    type(planted).__name__, type(dp).__name__)
    return planted
