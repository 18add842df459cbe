"""One P DP rank of the synthetic engine: admit requests, step through the layers in lock step
with the other ranks, write each layer's KV and hand it to lw's loop (the forward hook)."""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from lw.fsm import PrefillEndpoint, PrefillRequest, SendFinished
from lw.fsm.kvmap import expected_senders, targets_of
from lw.lab.synthetic.config import ClusterConfig
from lw.lab.synthetic.corrupt import CorruptingPlane
from lw.lab.synthetic.pattern import Pattern
from lw.lab.synthetic.workers import (
    Outbox,
    TPWorker,
    data_plane_for,
    faults_for,
    layer_layouts,
    merged_stats,
    p_engine,
    run_reporting,
    setup_process,
)
from lw.transport.runtime import WorkerLoop
from lw.transport.sidechannel import SideChannel
from lw.transport.wire import KVLayout, Sender


def prefill_main(cfg: ClusterConfig, rank: int, cmd: Connection, out: Connection,
                 barrier: Any, flags: Any, incarnation: int, as_process: bool) -> None:
    """One P DP rank: admit requests, step through the layers in lock step, push each layer."""
    name = f"prefill-dp{rank}"
    if as_process:
        setup_process(name, cfg)
    run_reporting(name, out,
                  lambda outbox: _prefill(cfg, rank, cmd, outbox, barrier, flags, incarnation))


def _prefill_tp(cfg: ClusterConfig, rank: int, t: int, incarnation: int,
                epochs: dict[str, int]) -> TPWorker:
    """TP worker ``t`` of P DP rank ``rank``: its heads of every block, and its loop
    (``epochs``: the claim epoch of each request the rank was asked to prefill again)."""
    fmt = cfg.p_format(t)
    kv = np.zeros((cfg.layers, cfg.p_blocks, cfg.rank_block_bytes(fmt)), dtype=np.uint8)
    dp = data_plane_for(cfg, f"p{rank}t{t}", cfg.p_host, writer=True)
    dp.register_memory(kv.ctypes.data, kv.nbytes)
    if cfg.fault in ("corrupt-write", "mix"):
        # With a retry budget the fault hits first attempts only: what a bad transfer's retry
        # must show is that the request then completes (issue 40)
        dp = CorruptingPlane(dp, every=7 if cfg.fault == "corrupt-write" else 61,
                             memory=(kv.ctypes.data, kv.nbytes),
                             spare=(lambda rid: epochs.get(rid, 0) > 0) if cfg.retry_prefill
                             else None)
    keyless = cfg.fault == "no-cluster-key" and rank == cfg.prefill_dp - 1
    side = SideChannel(cfg.p_host, cluster_key=None if keyless else cfg.cluster_key,
                       faults=faults_for(cfg, 1 + rank + 1000 * t))
    me = Sender(p_engine(rank), t, incarnation, side.addr)
    local = KVLayout(me.engine_id, incarnation, dp.session, layer_layouts(kv), fmt)
    ep = PrefillEndpoint(me, cfg.layers, cfg.prefill_config(), local=local)
    loop = WorkerLoop(ep, side, dp, cfg.loop_config(f"lw-loop-p{rank}t{t}"),
                      local_layout=local.layers)
    return TPWorker(fmt, kv, loop.start())


def _prefill(cfg: ClusterConfig, rank: int, cmd: Connection, outbox: Outbox, barrier: Any,
             flags: Any, incarnation: int) -> None:
    L = cfg.layers
    pattern = Pattern(cfg.head_bytes)
    tps: list[TPWorker] = []
    epochs: dict[str, int] = {}  # request -> the claim epoch D asked this prefill under
    try:
        for t in range(cfg.prefill_tp):
            tps.append(_prefill_tp(cfg, rank, t, incarnation, epochs))
        _prefill_steps(cfg, rank, cmd, outbox, barrier, flags, tps, pattern, L, epochs)
    finally:
        for tp in tps:
            tp.loop.stop()


def _prefill_steps(cfg: ClusterConfig, rank: int, cmd: Connection, outbox: Outbox,
                   barrier: Any, flags: Any, tps: list[TPWorker], pattern: Pattern, L: int,
                   epochs: dict[str, int]) -> None:
    """The DP rank's scheduler and forward pass: one block allocation per request for all TP
    workers, blocks freed once every TP worker released them."""
    # Per TP worker: the D TP ranks it writes into, and how many P ranks write into each.
    targets = [targets_of(tp.fmt, cfg.decode_tp) for tp in tps]
    n_senders = [max((len(expected_senders(cfg.d_format(j), cfg.prefill_tp)) for j in tg),
                     default=1) for tg in targets]
    free = deque(range(cfg.p_blocks))
    held: dict[str, tuple[int, ...]] = {}
    unreleased: dict[str, set[int]] = {}  # request -> TP workers that still hold its blocks
    bounds = cfg.chunk_bounds()
    progressive = cfg.push_mode == "progressive"
    # Requests still computing a chunk: request -> (local blocks, remote blocks, next chunk).
    # Their blocks stay held until the last chunk ran, even if lw released them earlier (as
    # vLLM frees a request's blocks only once it is finished).
    computing: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[str, ...], int]] = {}
    failures: dict[str, str] = {}  # request -> first failure reason of a TP worker

    def add_request(rid: str, d_addrs: tuple[str, ...], local: tuple[int, ...],
                    remote: tuple[int, ...], final: bool) -> None:
        """Hand ``rid`` to every TP worker's core, each aimed at the D ranks it feeds."""
        for t, tp in enumerate(tps):
            addrs = tuple(d_addrs[j] for j in targets[t])
            tp.loop.call("add_request", PrefillRequest(rid, addrs, local, remote, n_senders[t],
                                                       final, epochs.get(rid, 0)))

    waiting: deque[tuple[str, tuple[str, ...], tuple[int, ...]]] = deque()
    steps = busy_steps = 0
    max_step = max_busy_step = max_hook = 0.0
    busy_times: list[float] = []  # durations of steps that had requests (bounded below)
    hook_times: list[float] = []
    crash_armed = False
    outbox.put(("ready", "p", rank, {"pid": os.getpid(), "addr": tps[0].loop.addr,
                                     "addrs": [tp.loop.addr for tp in tps]}))

    def stats() -> dict[str, Any]:
        return {"rank": rank, "held_blocks": cfg.p_blocks - len(free), "steps": steps,
                "busy_steps": busy_steps, "max_step_s": max_step, "busy_step_s": busy_times[:],
                "max_hook_s": max_hook, "hook_s": hook_times[:],
                "max_busy_step_s": max_busy_step, "waiting": len(waiting),
                "tails": [x for tp in tps for x in tp.loop.tail_samples()],
                **merged_stats(tps)}

    def drain() -> None:
        for t, tp in enumerate(tps):
            for rep in tp.loop.drain_reports():
                if not isinstance(rep, SendFinished) or rep.req_id not in unreleased:
                    continue
                rid = rep.req_id
                if not rep.ok:
                    failures.setdefault(rid, rep.reason or "failed")
                left = unreleased[rid]
                left.discard(t)
                if not left:
                    del unreleased[rid]
                    epochs.pop(rid, None)
                    if rid not in computing:
                        free.extend(held.pop(rid, ()))
                    reason = failures.pop(rid, None)
                    outbox.put(("p_finished", rank, rid, reason is None, reason or ""))

    def cancel(rid: str) -> None:
        """Like the real proxy closing the prefill request: drop it if not admitted yet, else
        abort it in every TP worker's core, which releases it once no write is in flight (one
        not yet handed to the core, last_chunk mode, ends by heartbeat or deadline instead)."""
        for i, item in enumerate(waiting):
            if item[0] == rid:
                del waiting[i]
                outbox.put(("p_finished", rank, rid, False, "cancelled before admission"))
                return
        if rid in unreleased:
            for tp in tps:
                tp.loop.call("abort", rid, "the proxy moved the request to another decoder")

    while True:
        while cmd.poll():
            c = cmd.recv()
            if c[0] == "prefill":
                addrs = (c[2],) if isinstance(c[2], str) else tuple(c[2])
                waiting.append((c[1], addrs, tuple(c[3])))
                if len(c) > 4:  # a re-prefill under a later claim epoch
                    epochs[c[1]] = c[4]
            elif c[0] == "stats":
                outbox.put(("stats", "p", rank, stats()))
            elif c[0] == "crash":
                crash_armed = True
            elif c[0] == "cancel":  # the proxy moved the request to another decoder
                cancel(c[1])
        drain()
        barrier.wait(cfg.barrier_timeout_s)  # step start; the action publishes "stop"
        if flags[1]:
            break
        t0 = time.monotonic()
        # this step's chunk of each request: (request, the blocks it completes)
        batch: list[tuple[str, tuple[int, ...]]] = []
        last = len(bounds) - 1
        for rid, (local, remote, d_addrs, c) in list(computing.items()):
            lo, hi = bounds[c]
            if progressive:
                for tp in tps:
                    tp.loop.call("add_chunk", rid, local[lo:hi], c == last)
            elif c == last:
                add_request(rid, d_addrs, local, remote, True)
            batch.append((rid, local[lo:hi]))
        while (waiting and len(batch) < cfg.max_batch
               and len(free) >= len(waiting[0][2])):
            rid, d_addrs, remote = waiting.popleft()
            local = tuple(free.popleft() for _ in remote)
            held[rid] = local
            unreleased[rid] = set(range(len(tps)))
            lo, hi = bounds[0]
            if progressive or last == 0:
                add_request(rid, d_addrs, local[lo:hi], remote, last == 0)
            if last > 0:
                computing[rid] = (local, remote, d_addrs, 0)
            batch.append((rid, local[lo:hi]))
        # Requests whose layers lw is told about: progressive, every chunk; else the last.
        ids = [rid for rid, _ in batch
               if progressive or rid not in computing or computing[rid][3] == last]
        first = {rid: bounds[computing[rid][3]][0] if rid in computing else bounds[-1][0]
                 for rid, _ in batch}
        layer_s = cfg.layer_ms / 1000
        for layer in range(L):
            t_layer = time.monotonic()
            if batch:
                for tp in tps:  # "compute" the layer on every TP worker: write its heads' KV
                    lo, hi = tp.fmt.head_lo, tp.fmt.head_hi
                    for rid, local in batch:
                        for j, blk in enumerate(local, first[rid]):
                            pattern.fill_heads(tp.kv[layer, blk], rid, layer, j, lo, hi)
                    t_hook = time.perf_counter()
                    tp.loop.layer_computed(layer, ids)  # the forward hook: enqueue, never wait
                    hook_s = time.perf_counter() - t_hook
                    max_hook = max(max_hook, hook_s)
                    if len(hook_times) < 100_000:
                        hook_times.append(hook_s)
                if crash_armed and layer == L // 2:
                    os.kill(os.getpid(), signal.SIGKILL)  # a crash in mid-step
            rest = layer_s - (time.monotonic() - t_layer)
            if rest > 0:
                time.sleep(rest)
            barrier.wait(cfg.barrier_timeout_s)
        for rid, _ in batch:  # next chunk; blocks of a finished computation may go back now
            if rid in computing:
                local, remote, d_addrs, c = computing[rid]
                if c == last:
                    del computing[rid]
                    if rid not in unreleased:
                        free.extend(held.pop(rid, ()))
                else:
                    computing[rid] = (local, remote, d_addrs, c + 1)
        dt = time.monotonic() - t0
        steps += 1
        max_step = max(max_step, dt)
        if batch:
            busy_steps += 1
            if len(busy_times) < 100_000:
                busy_times.append(dt)
            max_busy_step = max(max_busy_step, dt)
    # stopped: give in-flight work a moment, then report what is still held
    deadline = time.monotonic() + 2.0
    while any(tp.loop.endpoint.live_requests() for tp in tps) and time.monotonic() < deadline:
        time.sleep(0.01)
    drain()
    outbox.put(("final", "p", rank, stats()))
