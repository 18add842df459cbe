"""The synthetic engine's workers: P DP ranks stepping in lock step, and the decoders.

A worker is an engine: a P DP rank (with its scheduler) or a decoder (with its block pool; once a
request's KV is verified it streams ``decode_tokens`` tokens to the client, then frees it). It
has one TP worker per tensor-parallel rank, each with its own KV memory (its KV heads of every
block, HND), data plane, side channel and :class:`~lw.transport.runtime.WorkerLoop`, and talks to
the coordinator (:mod:`lw.lab.synthetic.cluster`) through two one-way pipes: commands in,
events out.
An engine is an OS process (Mooncake data plane) or a thread of the coordinator's process
(in-process data plane); its TP workers are its loops' threads; the code is the same.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from lw.fsm import (
    DecodeEndpoint,
    Effect,
    PrefillEndpoint,
    PrefillRequest,
    Quarantine,
    RecvDone,
    RecvFailed,
    ReleaseBlocks,
    Reprefill,
    SendFinished,
)
from lw.fsm.kvmap import expected_senders, targets_of
from lw.fsm.messages import KVFormat
from lw.lab.synthetic import netns
from lw.lab.synthetic.config import ClusterConfig
from lw.lab.synthetic.corrupt import CorruptingPlane
from lw.lab.synthetic.pattern import Pattern
from lw.transport.runtime import WorkerLoop
from lw.transport.sidechannel import FaultInjection, SideChannel
from lw.transport.wire import KVLayout, LayerLayout, Sender


def d_engine(slot: int) -> str:
    """Engine id of D engine ``slot`` (its own id, so P keeps each engine's layouts apart)."""
    return f"decode-{slot}"


def p_engine(rank: int) -> str:
    """Engine id of P DP rank ``rank`` (one engine per DP rank, like one vLLM engine core)."""
    return f"prefill-dp{rank}"


def barrier_action(flags: Any) -> None:
    """Runs once per barrier generation: publish the stop request so all ranks agree on it."""
    flags[1] = flags[0]


class BarrierAction:
    """Picklable barrier action: publish the stop request (see barrier_action)."""

    def __init__(self, flags: Any) -> None:
        self.flags = flags

    def __call__(self) -> None:
        barrier_action(self.flags)


def ghost_steps(barrier: Any) -> None:
    """Dummy steps for a dead rank: take its turn in every lock-step wait until the barrier is
    aborted at the end (it cannot tell a step's first wait from the others, so it never leaves
    on its own: the live ranks leave at a step start and the ghost is then alone)."""
    while True:
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            return


# ----------------------------------------------------------------------------- shared setup
def _as_process(name: str, cfg: ClusterConfig) -> None:
    """Worker-process setup: stderr to a log file, die with the coordinator."""
    if cfg.log_dir:
        fd = os.open(os.path.join(cfg.log_dir, f"{name}.log"),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s {name} %(name)s %(levelname)s %(message)s")
    parent = os.getppid()

    def watchdog() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:  # coordinator gone: never outlive it
                os._exit(3)

    threading.Thread(target=watchdog, name="lw-watchdog", daemon=True).start()


def _faults(cfg: ClusterConfig, salt: int) -> FaultInjection | None:
    seed = cfg.seed * 1000 + salt
    if cfg.fault == "drop-messages":
        return FaultInjection(drop=0.15, seed=seed)
    if cfg.fault == "duplicate-messages":
        return FaultInjection(duplicate=0.3, seed=seed)
    if cfg.fault == "garbage-messages":
        return FaultInjection(garbage=0.1, seed=seed)
    if cfg.fault == "mix":
        return FaultInjection(drop=0.05, duplicate=0.1, garbage=0.03, seed=seed)
    return None


def _data_plane(cfg: ClusterConfig, name: str, host: str = "127.0.0.1") -> Any:
    if cfg.data_plane == "mooncake":
        from lw.transport.dataplane import MooncakeDataPlane

        return MooncakeDataPlane(host, timeout_s=cfg.transfer_timeout_s)
    from lw.transport.dataplane import InProcessDataPlane

    return InProcessDataPlane(f"{name}-{os.getpid()}-{time.monotonic_ns()}",
                              timeout_s=cfg.transfer_timeout_s)


def _layouts(kv: np.ndarray) -> list[LayerLayout]:
    layers, nblk, blen = kv.shape
    base = kv.ctypes.data
    return [LayerLayout(base + i * nblk * blen, blen, blen, nblk) for i in range(layers)]


class _TP:
    """One TP worker of an engine: its head format, KV memory (layers, blocks, bytes) and loop."""

    def __init__(self, fmt: KVFormat, kv: np.ndarray, loop: WorkerLoop) -> None:
        self.fmt = fmt
        self.kv = kv
        self.loop = loop


def rss_kib() -> int:
    """This process's resident memory (KiB), from /proc; 0 where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _merged_stats(tps: list[_TP]) -> dict[str, Any]:
    """The TP workers' loop stats as one engine's: counts summed, percentiles their maximum."""
    out: dict[str, Any] = {"rss_kib": rss_kib()}
    for tp in tps:
        for k, v in tp.loop.stats().items():
            if isinstance(v, bool) or not isinstance(v, int | float):
                if v and not out.get(k):
                    out[k] = v
                else:
                    out.setdefault(k, v)
            elif k.endswith(("_p50_s", "_p99_s", "_max_s")):
                out[k] = max(out.get(k, 0.0), v)
            else:
                out[k] = out.get(k, 0) + v
    return out


class _Outbox:
    """Events to the coordinator, sent by a thread so a worker never waits on the pipe."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._t = threading.Thread(target=self._pump, name="lw-outbox", daemon=True)
        self._t.start()

    def put(self, item: tuple) -> None:
        self._q.put(item)

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until everything put so far has been handed to the pipe."""
        done = threading.Event()
        self._q.put(done)
        done.wait(timeout)

    def _pump(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            try:
                self._conn.send(item)
            except (OSError, EOFError, ValueError):
                return

    def close(self, timeout: float = 5.0) -> None:
        self._q.put(None)
        self._t.join(timeout)


# ----------------------------------------------------------------------------- prefill rank
def prefill_main(cfg: ClusterConfig, rank: int, cmd: Connection, out: Connection,
                 barrier: Any, flags: Any, incarnation: int, as_process: bool) -> None:
    """One P DP rank: admit requests, step through the layers in lock step, push each layer."""
    name = f"prefill-dp{rank}"
    if as_process:
        _as_process(name, cfg)
    outbox = _Outbox(out)
    try:
        _prefill(cfg, rank, cmd, outbox, barrier, flags, incarnation)
    except BaseException:
        outbox.put(("error", name, traceback.format_exc()))
        raise
    finally:
        outbox.close()


def _prefill_tp(cfg: ClusterConfig, rank: int, t: int, incarnation: int,
                epochs: dict[str, int]) -> _TP:
    """TP worker ``t`` of P DP rank ``rank``: its heads of every block, and its loop
    (``epochs``: the claim epoch of each request the rank was asked to prefill again)."""
    fmt = cfg.p_format(t)
    kv = np.zeros((cfg.layers, cfg.p_blocks, cfg.rank_block_bytes(fmt)), dtype=np.uint8)
    dp = _data_plane(cfg, f"p{rank}t{t}", cfg.p_host)
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
                       faults=_faults(cfg, 1 + rank + 1000 * t))
    me = Sender(p_engine(rank), t, incarnation, side.addr)
    local = KVLayout(me.engine_id, incarnation, dp.session, _layouts(kv), fmt)
    ep = PrefillEndpoint(me, cfg.layers, cfg.prefill_config(), local=local)
    loop = WorkerLoop(ep, side, dp, cfg.loop_config(f"lw-loop-p{rank}t{t}"),
                      local_layout=local.layers)
    return _TP(fmt, kv, loop.start())


def _prefill(cfg: ClusterConfig, rank: int, cmd: Connection, outbox: _Outbox, barrier: Any,
             flags: Any, incarnation: int) -> None:
    L = cfg.layers
    pattern = Pattern(cfg.head_bytes)
    tps: list[_TP] = []
    epochs: dict[str, int] = {}  # request -> the claim epoch D asked this prefill under
    try:
        for t in range(cfg.prefill_tp):
            tps.append(_prefill_tp(cfg, rank, t, incarnation, epochs))
        _prefill_steps(cfg, rank, cmd, outbox, barrier, flags, tps, pattern, L, epochs)
    finally:
        for tp in tps:
            tp.loop.stop()


def _prefill_steps(cfg: ClusterConfig, rank: int, cmd: Connection, outbox: _Outbox,
                   barrier: Any, flags: Any, tps: list[_TP], pattern: Pattern, L: int,
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
                **_merged_stats(tps)}

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


# ----------------------------------------------------------------------------- decoder
def decode_main(cfg: ClusterConfig, cmd: Connection, out: Connection, ports: list[int],
                incarnation: int, generation: int, as_process: bool, slot: int = 0) -> None:
    """D engine ``slot``: allocate first, ask for the prefill, verify every byte, decode,
    free the blocks."""
    name = f"decode-gen{generation}" if slot == 0 else f"decode{slot}-gen{generation}"
    if as_process:
        _as_process(name, cfg)
        if cfg.d_netns:  # before any socket: the decoder lives behind the partitionable link
            netns.enter(cfg.d_netns)
    outbox = _Outbox(out)
    try:
        _decode(cfg, cmd, outbox, ports, incarnation, generation, slot)
    except BaseException:
        outbox.put(("error", name, traceback.format_exc()))
        raise
    finally:
        outbox.close()


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
               wake: threading.Event, slot: int, pool: BlockPool) -> _TP:
    """TP worker ``j`` of the decoder: its heads of every block of the shared pool, its loop."""
    fmt = cfg.d_format(j)
    kv = np.zeros((cfg.layers, cfg.d_blocks, cfg.rank_block_bytes(fmt)), dtype=np.uint8)
    dp = _data_plane(cfg, f"d{slot}g{generation}t{j}", cfg.d_host)
    dp.register_memory(kv.ctypes.data, kv.nbytes)
    side = SideChannel(cfg.d_host, port=port, cluster_key=cfg.cluster_key,
                       faults=_faults(cfg, 1000 * j))
    me = Sender(d_engine(slot), j, incarnation, side.addr)
    layout = KVLayout(d_engine(slot), incarnation, dp.session, _layouts(kv), fmt)
    # Fresh blocks come from the engine's pool; retries exist only with one TP worker
    # (ClusterConfig refuses retry_prefill otherwise: each worker's core decides alone).
    name = f"lw-loop-d{j}" if slot == 0 else f"lw-loop-d{slot}t{j}"
    loop = WorkerLoop(DecodeEndpoint(me, layout, cfg.decode_config()), side, dp,
                      cfg.loop_config(name), on_report=lambda _e: wake.set(),
                      fresh_blocks=lambda _rid, n: pool.take(n))
    return _TP(fmt, kv, loop.start())


def _decode(cfg: ClusterConfig, cmd: Connection, outbox: _Outbox, ports: list[int],
            incarnation: int, generation: int, slot: int) -> None:
    wake = threading.Event()
    tps: list[_TP] = []
    pool = BlockPool(cfg.d_blocks)
    try:
        for j in range(cfg.decode_tp):
            tps.append(_decode_tp(cfg, j, ports[j], incarnation, generation, wake, slot, pool))
        _decode_steps(cfg, cmd, outbox, generation, tps, wake, pool)
    finally:
        for tp in tps:
            tp.loop.stop()


def _decode_steps(cfg: ClusterConfig, cmd: Connection, outbox: _Outbox, generation: int,
                  tps: list[_TP], wake: threading.Event, free: BlockPool) -> None:
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
                **counts, **_merged_stats(tps)}

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
