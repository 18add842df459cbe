"""A decoder of the synthetic engine: allocate first, ask for the prefill, verify every byte of
the KV it receives, "decode" (stream tokens), free the blocks."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from lw.fsm import (
    DecodeEndpoint,
    Effect,
    Quarantine,
    RecvDone,
    RecvFailed,
    ReleaseBlocks,
    Reprefill,
)
from lw.fsm.kvmap import expected_senders
from lw.lab.synthetic import netns
from lw.lab.synthetic.config import ClusterConfig
from lw.lab.synthetic.pattern import Pattern
from lw.lab.synthetic.workers import (
    Outbox,
    TPWorker,
    d_engine,
    data_plane_for,
    faults_for,
    layer_layouts,
    merged_stats,
    run_reporting,
    setup_process,
)
from lw.transport.runtime import WorkerLoop
from lw.transport.sidechannel import SideChannel
from lw.transport.wire import KVLayout, Sender


def decode_main(cfg: ClusterConfig, cmd: Connection, out: Connection, ports: list[int],
                incarnation: int, generation: int, as_process: bool, slot: int = 0) -> None:
    """D engine ``slot``: allocate first, ask for the prefill, verify every byte, decode,
    free the blocks."""
    name = f"decode-gen{generation}" if slot == 0 else f"decode{slot}-gen{generation}"
    if as_process:
        setup_process(name, cfg)
        if cfg.d_netns:  # before any socket: the decoder lives behind the partitionable link
            netns.enter(cfg.d_netns)
    run_reporting(name, out,
                  lambda outbox: _decode(cfg, cmd, outbox, ports, incarnation, generation, slot))


class BlockPool:
    """The decoder's free blocks, shared by its scheduler thread and its worker loops' threads:
    a retried claim epoch's fresh blocks (``retry_fresh_blocks``) are taken on the loop thread
    that asks, while the scheduler allocates and frees on its own."""

    def __init__(self, n: int) -> None:
        self._free = deque(range(n))
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._free)

    def take(self, n: int) -> tuple[int, ...] | None:
        """``n`` free blocks, or None (and none taken) when fewer are free."""
        with self._lock:
            if len(self._free) < n:
                return None
            return tuple(self._free.popleft() for _ in range(n))

    def put(self, blocks: tuple[int, ...]) -> None:
        """Blocks back to the pool."""
        with self._lock:
            self._free.extend(blocks)


def _decode_tp(cfg: ClusterConfig, j: int, port: int, incarnation: int, generation: int,
               wake: threading.Event, slot: int, pool: BlockPool) -> TPWorker:
    """TP worker ``j`` of the decoder: its heads of every block of the shared pool, its loop."""
    fmt = cfg.d_format(j)
    kv = np.zeros((cfg.layers, cfg.d_blocks, cfg.rank_block_bytes(fmt)), dtype=np.uint8)
    dp = data_plane_for(cfg, f"d{slot}g{generation}t{j}", cfg.d_host)
    dp.register_memory(kv.ctypes.data, kv.nbytes)
    side = SideChannel(cfg.d_host, port=port, cluster_key=cfg.cluster_key,
                       faults=faults_for(cfg, 1000 * j))
    me = Sender(d_engine(slot), j, incarnation, side.addr)
    layout = KVLayout(d_engine(slot), incarnation, dp.session, layer_layouts(kv), fmt)
    # Fresh blocks come from the engine's pool; retries exist only with one TP worker
    # (ClusterConfig refuses retry_prefill otherwise: each worker's core decides alone).
    name = f"lw-loop-d{j}" if slot == 0 else f"lw-loop-d{slot}t{j}"
    loop = WorkerLoop(DecodeEndpoint(me, layout, cfg.decode_config()), side, dp,
                      cfg.loop_config(name), on_report=lambda _e: wake.set(),
                      fresh_blocks=lambda _rid, n: pool.take(n))
    return TPWorker(fmt, kv, loop.start())


def _decode(cfg: ClusterConfig, cmd: Connection, outbox: Outbox, ports: list[int],
            incarnation: int, generation: int, slot: int) -> None:
    wake = threading.Event()
    tps: list[TPWorker] = []
    pool = BlockPool(cfg.d_blocks)
    try:
        for j in range(cfg.decode_tp):
            tps.append(_decode_tp(cfg, j, ports[j], incarnation, generation, wake, slot, pool))
        _decode_steps(cfg, cmd, outbox, generation, tps, wake, pool)
    finally:
        for tp in tps:
            tp.loop.stop()


def _decode_steps(cfg: ClusterConfig, cmd: Connection, outbox: Outbox, generation: int,
                  tps: list[TPWorker], wake: threading.Event, free: BlockPool) -> None:
    """The decoder's scheduler: one allocation per request for every TP worker; a request is
    finished when every TP worker reported it, and its blocks are freed only then."""
    L = cfg.layers
    pattern = Pattern(cfg.head_bytes)
    senders = [expected_senders(tp.fmt, cfg.prefill_tp) for tp in tps]
    alloc: dict[str, tuple[tuple[int, ...], float]] = {}
    alloc_seen: list[str] = []  # every request allocated, to name whose bytes a wrong block holds
    unreported: dict[str, set[int]] = {}  # request -> TP workers that have not finished it
    bad: dict[str, set[tuple[int, int]]] = {}  # request -> (layer, block index) with a bad head
    failures: dict[str, str] = {}  # request -> first failure of a TP worker
    quarantined: set[str] = set()
    # Verified requests being "decoded": request -> (blocks, when the next token is due, tokens
    # streamed so far, allocation -> verified). Their blocks stay held until the last token.
    decoding: dict[str, tuple[tuple[int, ...], float, int, float]] = {}
    token_s = cfg.token_ms / 1000
    waiting: deque[str] = deque()
    counts = {"done": 0, "failed": 0, "corrupt": 0}
    freeze_armed = False
    stopping = False
    outbox.put(("ready", "d", generation, {
        "pid": os.getpid(), "addr": tps[0].loop.addr, "addrs": [tp.loop.addr for tp in tps],
        "ports": [tp.loop.side.port for tp in tps],
        "sessions": [tp.loop.data_plane.session for tp in tps]}))

    def stats() -> dict[str, Any]:
        return {"held_blocks": cfg.d_blocks - len(free), "quarantined": len(quarantined),
                "waiting": len(waiting), "decoding": len(decoding), "generation": generation,
                **counts, **merged_stats(tps)}

    def verify(j: int, rid: str, blocks: tuple[int, ...]) -> set[tuple[int, int]]:
        tp = tps[j]
        lo, hi = tp.fmt.head_lo, tp.fmt.head_hi
        return {(layer, i) for layer in range(L) for i, blk in enumerate(blocks)
                if not pattern.check_heads(tp.kv[layer, blk], rid, layer, i, lo, hi)}

    def fail(j: int, rid: str, reason: str) -> None:
        if rid in failures:
            return
        failures[rid] = reason
        for k in unreported.get(rid, ()):  # the request failed: stop the other TP workers
            if k != j:
                tps[k].loop.call("abort", rid, f"D TP rank {j} failed: {reason}"[:512])

    def finish(j: int, rid: str) -> None:
        left = unreported.get(rid)
        if left is None or j not in left:
            return
        left.discard(j)
        if left:
            return
        del unreported[rid]
        blocks, t0 = alloc.pop(rid)
        quarantined.discard(rid)
        wrong = bad.pop(rid, set())
        reason = failures.pop(rid, None)
        if reason is not None:
            outcome = "failed"
        elif wrong:
            outcome, reason = "corrupt", pattern.corrupt_report(
                rid, wrong, blocks, L, [(t.kv, t.fmt.head_lo, t.fmt.head_hi) for t in tps],
                alloc_seen)
        else:
            outcome, reason = "done", ""
        now = time.monotonic()
        if outcome == "done" and cfg.decode_tokens:
            # only complete, verified KV is decoded (design property 3)
            decoding[rid] = (blocks, now + token_s, 0, now - t0)
            return
        counts[outcome] += 1
        free.put(blocks)  # "decoded" (or failed and released): back to the pool
        outbox.put(("d_result", rid, outcome, reason, now - t0))

    def decode_step() -> None:
        """Stream each decoding request's due token; after its last, the request is done."""
        now = time.monotonic()
        for rid, (blocks, due, n, latency) in list(decoding.items()):
            if now < due:
                continue
            n += 1
            outbox.put(("token", rid, n))
            if n < cfg.decode_tokens:
                decoding[rid] = (blocks, due + token_s, n, latency)
                continue
            del decoding[rid]
            counts["done"] += 1
            free.put(blocks)
            outbox.put(("d_result", rid, "done", "", latency))

    def on_report(j: int, rep: Effect) -> None:
        if isinstance(rep, RecvDone):
            rid = rep.req_id
            if rid in alloc:
                bad.setdefault(rid, set()).update(verify(j, rid, alloc[rid][0]))
            finish(j, rid)
        elif isinstance(rep, RecvFailed):
            fail(j, rep.req_id, rep.reason)
            finish(j, rep.req_id)
        elif isinstance(rep, Quarantine):
            quarantined.add(rep.req_id)
            fail(j, rep.req_id, rep.reason)
        elif isinstance(rep, ReleaseBlocks):  # an abandoned epoch's blocks: nothing lands now
            free.put(rep.block_ids)
        elif isinstance(rep, Reprefill):  # the proxy picks a P
            if rep.req_id in alloc and rep.block_ids != alloc[rep.req_id][0]:
                # fresh blocks (retry_fresh_blocks), taken from the pool by the loop thread:
                # the request is verified and freed from them from now on
                alloc[rep.req_id] = (rep.block_ids, alloc[rep.req_id][1])
            outbox.put(("reprefill", rep.req_id, rep.epoch, rep.avoid,
                        tuple(tp.loop.addr for tp in tps), rep.block_ids, rep.fenced))

    while not stopping:
        if cmd.poll(0.002 if not wake.is_set() else 0):
            while cmd.poll():
                c = cmd.recv()
                if c[0] == "request":
                    waiting.append(c[1])
                elif c[0] == "stats":
                    outbox.put(("stats", "d", generation, stats()))
                elif c[0] == "routed":  # where the proxy sent a prefill: D watches that P
                    _, rid, engine, addr, epoch = c
                    if rid in unreported:
                        for tp in tps:
                            tp.loop.call("prefill_routed", rid, engine, addr, epoch)
                elif c[0] == "freeze_after_alloc":
                    freeze_armed = True
                elif c[0] == "abort":  # the client went away
                    rid = c[1]
                    if rid in waiting:
                        waiting.remove(rid)
                        outbox.put(("d_result", rid, "failed", "aborted before allocation",
                                    0.0))
                    elif rid in unreported:
                        for tp in tps:
                            tp.loop.call("abort", rid, "client went away")
                    elif rid in decoding:  # stops decoding: its blocks go back now
                        blocks, _due, n, latency = decoding.pop(rid)
                        counts["failed"] += 1
                        free.put(blocks)
                        outbox.put(("d_result", rid, "failed",
                                    f"client went away after {n} tokens", latency))
                elif c[0] == "stop":
                    stopping = True
        wake.clear()
        for j, tp in enumerate(tps):
            for rep in tp.loop.drain_reports():
                on_report(j, rep)
        if decoding:
            decode_step()
        started = 0
        while waiting:
            got = free.take(cfg.blocks_per_request)
            if got is None:
                break
            rid = waiting.popleft()
            blocks = got
            alloc[rid] = (blocks, time.monotonic())
            alloc_seen.append(rid)
            unreported[rid] = set(range(len(tps)))
            # D first: every TP worker knows the request before anyone may ask about it.
            futs = [tp.loop.call("add_request", rid, blocks, senders[j])
                    for j, tp in enumerate(tps)]
            for f in futs:
                f.result(10)
            outbox.put(("start_prefill", rid, tuple(tp.loop.addr for tp in tps), blocks))
            started += 1
        if freeze_armed and started:
            outbox.put(("freezing", generation))
            outbox.flush()  # the coordinator has the requests: P will contact us now
            os.kill(os.getpid(), signal.SIGSTOP)
            freeze_armed = False
    outbox.put(("final", "d", generation, stats()))
