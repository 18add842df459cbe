"""The synthetic engine's workers: P DP ranks stepping in lock step, and the decoder.

Each worker runs one :class:`~lw.transport.runtime.WorkerLoop` and talks to the coordinator
(:mod:`lw.synthetic.cluster`) through two one-way pipes: commands in, events out. A worker is an
OS process (Mooncake data plane) or a thread of the coordinator's process (in-process data plane);
the code is the same.
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
    PrefillEndpoint,
    PrefillRequest,
    Quarantine,
    RecvDone,
    RecvFailed,
    SendFinished,
)
from lw.synthetic.config import ClusterConfig
from lw.synthetic.pattern import Pattern
from lw.transport.runtime import WorkerLoop
from lw.transport.sidechannel import FaultInjection, SideChannel
from lw.transport.wire import KVLayout, LayerLayout, Sender

D_ENGINE = "decode-0"


def p_engine(rank: int) -> str:
    """Engine id of P DP rank ``rank`` (one engine per DP rank, like one vLLM engine core)."""
    return f"prefill-dp{rank}"


def barrier_action(flags: Any) -> None:
    """Runs once per barrier generation: publish the stop request so all ranks agree on it."""
    flags[1] = flags[0]


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
    return None


def _data_plane(cfg: ClusterConfig, name: str) -> Any:
    if cfg.data_plane == "mooncake":
        from lw.transport.dataplane import MooncakeDataPlane

        return MooncakeDataPlane("127.0.0.1", timeout_s=cfg.transfer_timeout_s)
    from lw.transport.dataplane import InProcessDataPlane

    return InProcessDataPlane(f"{name}-{os.getpid()}-{time.monotonic_ns()}",
                              timeout_s=cfg.transfer_timeout_s)


def _layouts(kv: np.ndarray) -> list[LayerLayout]:
    layers, nblk, blen = kv.shape
    base = kv.ctypes.data
    return [LayerLayout(base + i * nblk * blen, blen, blen, nblk) for i in range(layers)]


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


def _prefill(cfg: ClusterConfig, rank: int, cmd: Connection, outbox: _Outbox, barrier: Any,
             flags: Any, incarnation: int) -> None:
    L = cfg.layers
    pattern = Pattern(cfg.block_bytes)
    kv = np.zeros((L, cfg.p_blocks, cfg.block_bytes), dtype=np.uint8)
    dp = _data_plane(cfg, f"p{rank}")
    dp.register_memory(kv.ctypes.data, kv.nbytes)
    keyless = cfg.fault == "no-cluster-key" and rank == cfg.prefill_dp - 1
    side = SideChannel(cluster_key=None if keyless else cfg.cluster_key,
                       faults=_faults(cfg, 1 + rank))
    me = Sender(p_engine(rank), 0, incarnation, side.addr)
    loop = WorkerLoop(PrefillEndpoint(me, L, cfg.prefill_config()), side, dp,
                      local_layout=_layouts(kv), name=f"lw-loop-p{rank}").start()
    free = deque(range(cfg.p_blocks))
    held: dict[str, tuple[int, ...]] = {}
    waiting: deque[tuple[str, str, tuple[int, ...]]] = deque()
    steps = busy_steps = 0
    max_step = max_busy_step = max_hook = 0.0
    busy_times: list[float] = []  # durations of steps that had requests (bounded below)
    hook_times: list[float] = []
    crash_armed = False
    outbox.put(("ready", "p", rank, {"pid": os.getpid(), "addr": side.addr}))

    def stats() -> dict[str, Any]:
        return {"rank": rank, "held_blocks": cfg.p_blocks - len(free), "steps": steps,
                "busy_steps": busy_steps, "max_step_s": max_step, "busy_step_s": busy_times[:],
                "max_hook_s": max_hook, "hook_s": hook_times[:],
                "max_busy_step_s": max_busy_step, "waiting": len(waiting),
                "tails": loop.tail_samples(), **loop.stats()}

    try:
        while True:
            while cmd.poll():
                c = cmd.recv()
                if c[0] == "prefill":
                    waiting.append((c[1], c[2], tuple(c[3])))
                elif c[0] == "stats":
                    outbox.put(("stats", "p", rank, stats()))
                elif c[0] == "crash":
                    crash_armed = True
            for rep in loop.drain_reports():
                if isinstance(rep, SendFinished):
                    free.extend(held.pop(rep.req_id, ()))
                    outbox.put(("p_finished", rank, rep.req_id, rep.ok, rep.reason))
            barrier.wait(cfg.barrier_timeout_s)  # step start; the action publishes "stop"
            if flags[1]:
                break
            t0 = time.monotonic()
            batch: list[tuple[str, tuple[int, ...], int]] = []
            while waiting and len(batch) < cfg.max_batch and len(free) >= len(waiting[0][2]):
                rid, d_addr, remote = waiting.popleft()
                local = tuple(free.popleft() for _ in remote)
                held[rid] = local
                loop.call("add_request", PrefillRequest(rid, d_addr, local, remote, 1))
                batch.append((rid, local, len(remote)))
            ids = [b[0] for b in batch]
            layer_s = cfg.layer_ms / 1000
            for layer in range(L):
                t_layer = time.monotonic()
                if batch:
                    for rid, local, _n in batch:  # "compute" the layer: write its KV
                        for j, blk in enumerate(local):
                            pattern.fill(kv[layer, blk], rid, layer, j)
                    t_hook = time.perf_counter()
                    loop.layer_computed(layer, ids)  # the forward hook: enqueue, never wait
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
        while loop.endpoint.live_requests() and time.monotonic() < deadline:
            time.sleep(0.01)
        for rep in loop.drain_reports():
            if isinstance(rep, SendFinished):
                free.extend(held.pop(rep.req_id, ()))
                outbox.put(("p_finished", rank, rep.req_id, rep.ok, rep.reason))
        outbox.put(("final", "p", rank, stats()))
    finally:
        loop.stop()


# ----------------------------------------------------------------------------- decoder
def decode_main(cfg: ClusterConfig, cmd: Connection, out: Connection, port: int,
                incarnation: int, generation: int, as_process: bool) -> None:
    """The decoder: allocate first, ask for the prefill, verify every byte, free the blocks."""
    name = f"decode-gen{generation}"
    if as_process:
        _as_process(name, cfg)
    outbox = _Outbox(out)
    try:
        _decode(cfg, cmd, outbox, port, incarnation, generation)
    except BaseException:
        outbox.put(("error", name, traceback.format_exc()))
        raise
    finally:
        outbox.close()


def _decode(cfg: ClusterConfig, cmd: Connection, outbox: _Outbox, port: int, incarnation: int,
            generation: int) -> None:
    L = cfg.layers
    pattern = Pattern(cfg.block_bytes)
    kv = np.zeros((L, cfg.d_blocks, cfg.block_bytes), dtype=np.uint8)
    dp = _data_plane(cfg, f"d{generation}")
    dp.register_memory(kv.ctypes.data, kv.nbytes)
    side = SideChannel(port=port, cluster_key=cfg.cluster_key, faults=_faults(cfg, 0))
    me = Sender(D_ENGINE, 0, incarnation, side.addr)
    layout = KVLayout(D_ENGINE, incarnation, dp.session, _layouts(kv))
    wake = threading.Event()
    loop = WorkerLoop(DecodeEndpoint(me, layout, cfg.decode_config()), side, dp,
                      on_report=lambda _e: wake.set(), name="lw-loop-d").start()
    free = deque(range(cfg.d_blocks))
    alloc: dict[str, tuple[tuple[int, ...], float]] = {}
    quarantined: set[str] = set()
    waiting: deque[str] = deque()
    counts = {"done": 0, "failed": 0, "corrupt": 0}
    freeze_armed = False
    stopping = False
    outbox.put(("ready", "d", generation, {"pid": os.getpid(), "addr": side.addr,
                                           "port": side.port, "session": dp.session}))

    def stats() -> dict[str, Any]:
        return {"held_blocks": cfg.d_blocks - len(free), "quarantined": len(quarantined),
                "waiting": len(waiting), "generation": generation, **counts, **loop.stats()}

    def verify(rid: str, blocks: tuple[int, ...]) -> int:
        bad = 0
        for layer in range(L):
            for j, blk in enumerate(blocks):
                if not pattern.check(kv[layer, blk], rid, layer, j):
                    bad += 1
        return bad

    try:
        while not stopping:
            if cmd.poll(0.002 if not wake.is_set() else 0):
                while cmd.poll():
                    c = cmd.recv()
                    if c[0] == "request":
                        waiting.append(c[1])
                    elif c[0] == "stats":
                        outbox.put(("stats", "d", generation, stats()))
                    elif c[0] == "freeze_after_alloc":
                        freeze_armed = True
                    elif c[0] == "stop":
                        stopping = True
            wake.clear()
            for rep in loop.drain_reports():
                if isinstance(rep, RecvDone):
                    blocks, t0 = alloc.pop(rep.req_id)
                    bad = verify(rep.req_id, blocks)
                    outcome = "corrupt" if bad else "done"
                    counts[outcome] += 1
                    free.extend(blocks)  # "decoded": the blocks go back to the pool
                    outbox.put(("d_result", rep.req_id, outcome,
                                f"{bad} of {L * len(blocks)} blocks wrong" if bad else "",
                                time.monotonic() - t0))
                elif isinstance(rep, RecvFailed):
                    blocks, t0 = alloc.pop(rep.req_id)
                    quarantined.discard(rep.req_id)
                    counts["failed"] += 1
                    free.extend(blocks)
                    outbox.put(("d_result", rep.req_id, "failed", rep.reason,
                                time.monotonic() - t0))
                elif isinstance(rep, Quarantine):
                    quarantined.add(rep.req_id)
            started = 0
            while waiting and len(free) >= cfg.blocks_per_request:
                rid = waiting.popleft()
                blocks = tuple(free.popleft() for _ in range(cfg.blocks_per_request))
                alloc[rid] = (blocks, time.monotonic())
                # D first: the endpoint knows the request before anyone may ask about it.
                loop.call("add_request", rid, blocks, 1).result(10)
                outbox.put(("start_prefill", rid, side.addr, blocks))
                started += 1
            if freeze_armed and started:
                outbox.put(("freezing", generation))
                outbox.flush()  # the coordinator has the requests: P will contact us now
                os.kill(os.getpid(), signal.SIGSTOP)
                freeze_armed = False
        outbox.put(("final", "d", generation, stats()))
    finally:
        loop.stop()
