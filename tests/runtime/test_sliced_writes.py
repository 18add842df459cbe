"""Head-sliced writes (WriteLayer.segments): bytes land where the two TP layouts say they must.

P and D workers are WorkerLoops on real sockets with the in-process data plane; every KV head of
every block carries its own random bytes, so a byte written to a wrong offset is seen.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pytest

from lw.fsm import (
    DecodeConfig,
    DecodeEndpoint,
    PrefillConfig,
    PrefillEndpoint,
    PrefillRequest,
    RecvDone,
    SendFinished,
    WriteLayer,
)
from lw.fsm.kvmap import expected_senders, make_format, targets_of
from lw.transport.dataplane import InProcessDataPlane
from lw.transport.loopconfig import LoopConfig
from lw.transport.runtime import WorkerLoop
from lw.transport.sidechannel import SideChannel
from lw.transport.wire import KVLayout, LayerLayout, Sender

from .loops import wait_for

L, NBLK, T, E = 3, 8, 4, 8  # layers, blocks per worker, tokens per block, bytes per head-token
UNIT = T * E  # bytes of one head in one block


def _layouts(mem: np.ndarray) -> list[LayerLayout]:
    blen = mem.shape[2]
    return [LayerLayout(mem[i].ctypes.data, blen, blen, NBLK) for i in range(L)]


def _heads_view(mem: np.ndarray, order: str, k: int) -> np.ndarray:
    """(L, NBLK, k heads, T, E) view of one worker's memory, whatever its in-block order."""
    if order == "HND":
        return mem.reshape(L, NBLK, k, T, E)
    return mem.reshape(L, NBLK, T, k, E).transpose(0, 1, 3, 2, 4)


@dataclass
class _Worker:
    loop: WorkerLoop
    mem: np.ndarray
    fmt: object


def _start(p_tp: int, d_tp: int, heads: int, order: str, mla: bool = False,
           ) -> tuple[list[_Worker], list[_Worker]]:
    """P TP ranks of one engine and D TP ranks of another, started, with zeroed memory."""
    ds: list[_Worker] = []
    for j in range(d_tp):
        fmt = make_format(tp_rank=j, tp_size=d_tp, total_heads=heads, block_tokens=T,
                          dtype="u8", order=order, mla=mla)
        mem = np.zeros((L, NBLK, (fmt.head_hi - fmt.head_lo) * UNIT), dtype=np.uint8)
        dp = InProcessDataPlane(timeout_s=2.0)
        dp.register_memory(mem.ctypes.data, mem.nbytes)
        side = SideChannel()
        inc = time.time_ns()
        layout = KVLayout("D", inc, dp.session, _layouts(mem), fmt)
        ep = DecodeEndpoint(Sender("D", j, inc, side.addr), layout,
                            DecodeConfig(prefill_timeout_s=30, lease_s=60))
        ds.append(_Worker(WorkerLoop(ep, side, dp, LoopConfig(name=f"d{j}")).start(), mem, fmt))
    ps: list[_Worker] = []
    for i in range(p_tp):
        fmt = make_format(tp_rank=i, tp_size=p_tp, total_heads=heads, block_tokens=T,
                          dtype="u8", order=order, mla=mla)
        mem = np.zeros((L, NBLK, (fmt.head_hi - fmt.head_lo) * UNIT), dtype=np.uint8)
        dp = InProcessDataPlane(timeout_s=2.0)
        dp.register_memory(mem.ctypes.data, mem.nbytes)
        side = SideChannel()
        local = KVLayout("P", 1, dp.session, _layouts(mem), fmt)
        ep = PrefillEndpoint(Sender("P", i, 1, side.addr), L,
                             PrefillConfig(meta_retry_s=0.05, ack_retry_s=0.05,
                                           meta_attempts=600, ack_attempts=600,
                                           request_timeout_s=30), local=local)
        loop = WorkerLoop(ep, side, dp, LoopConfig(name=f"p{i}"),
                          local_layout=local.layers).start()
        ps.append(_Worker(loop, mem, fmt))
    return ps, ds


@pytest.mark.parametrize("order", ["HND", "NHD"])
@pytest.mark.parametrize(("p_tp", "d_tp", "heads", "mla"),
                         [(2, 1, 4, False), (1, 2, 4, False), (4, 2, 4, False),
                          (2, 4, 2, False), (2, 1, 1, True)])
def test_head_slices_land_at_the_right_offsets(order: str, p_tp: int, d_tp: int, heads: int,
                                               mla: bool) -> None:
    ps, ds = _start(p_tp, d_tp, heads, order, mla)
    try:
        rng = np.random.default_rng(p_tp * 10 + d_tp)
        truth = rng.integers(1, 256, size=(L, NBLK, heads, T, E), dtype=np.uint8)
        for w in ps:
            f = w.fmt
            _heads_view(w.mem, order, f.head_hi - f.head_lo)[:] = truth[:, :, f.head_lo:f.head_hi]
        local, remote = (1, 2, 3, 6), (5, 6, 0, 2)  # runs contiguous on one side, not the other
        for w in ds:
            w.loop.call("add_request", "r1", remote,
                        expected_senders(w.fmt, p_tp)).result(5)  # type: ignore[arg-type]
        for w in ps:
            addrs = tuple(ds[j].loop.addr for j in targets_of(w.fmt, d_tp))  # type: ignore[arg-type]
            w.loop.call("add_request", PrefillRequest("r1", addrs, local, remote)).result(5)
            for layer in range(L):
                w.loop.layer_computed(layer, ["r1"])
        p_reps: list = []
        d_reps: list = []

        def finished() -> bool:
            for w in ps:
                p_reps.extend(w.loop.drain_reports())
            for w in ds:
                d_reps.extend(w.loop.drain_reports())
            return len(p_reps) == p_tp and len(d_reps) == d_tp

        wait_for(finished)  # up to 8 loops share the GIL: generous on a loaded machine
        assert p_reps == [SendFinished("r1", True, "")] * p_tp
        assert d_reps == [RecvDone("r1")] * d_tp
        for w in ds:
            f = w.fmt
            got = _heads_view(w.mem, order, f.head_hi - f.head_lo)
            for lblk, rblk in zip(local, remote, strict=True):
                assert np.array_equal(got[:, rblk], truth[:, lblk, f.head_lo:f.head_hi])
            untouched = [b for b in range(NBLK) if b not in remote]
            assert not got[:, untouched].any()
        written = sum(int(w.loop.stats()["loop.bytes_ok"]) for w in ps)
        d_bytes = sum(w.mem.shape[2] for w in ds)  # every D block byte written exactly once
        assert written == L * len(local) * d_bytes
    finally:
        for w in ps + ds:
            w.loop.stop()


def _entries_loop(p_fmt_kw: dict, local_len: int) -> WorkerLoop:
    side = SideChannel()
    local = [LayerLayout(0x10000 + i * 0x1000, local_len, local_len, 32) for i in range(2)]
    fmt = make_format(block_tokens=T, dtype="u8", **p_fmt_kw)
    ep = PrefillEndpoint(Sender("P", 0, 1, side.addr), 2,
                         local=KVLayout("P", 1, "s", local, fmt))
    return WorkerLoop(ep, side, None, local_layout=local)


def test_sliced_entries_and_their_cache() -> None:
    loop = _entries_loop(dict(tp_rank=0, tp_size=1, total_heads=2), 2 * UNIT)
    try:
        d = [KVLayout("D", 1, f"s{j}", [LayerLayout(0x90000 + j * 0x8000 + i * 0x1000, UNIT,
                                                    UNIT, 32) for i in range(2)])
             for j in range(2)]
        w0 = WriteLayer("r", 1, d[0], (1, 2), (4, 5), ((0, 0, UNIT),))
        w1 = WriteLayer("r", 1, d[1], (1, 2), (4, 5), ((UNIT, 0, UNIT),))
        # P TP 1 -> D TP 2 (HND): head 0 of each block to D rank 0, head 1 to D rank 1; the
        # local runs are not adjacent (the other head sits between), so nothing merges
        mem = loop.memory
        assert mem.entries(w0) == [(0x11000 + 1 * 2 * UNIT, 0x91000 + 4 * UNIT, UNIT),
                                   (0x11000 + 2 * 2 * UNIT, 0x91000 + 5 * UNIT, UNIT)]
        assert mem.entries(w1) == [(0x11000 + 1 * 2 * UNIT + UNIT, 0x99000 + 4 * UNIT, UNIT),
                                   (0x11000 + 2 * 2 * UNIT + UNIT, 0x99000 + 5 * UNIT, UNIT)]
        # the per-request cache keeps one entry per target and tells the segments apart
        assert len(loop.memory._runs["r"]) == 2
        w0b = WriteLayer("r", 0, d[0], (1, 2), (4, 5), ((UNIT, 0, UNIT),))
        assert loop.memory.entries(w0b)[0] == (0x10000 + 2 * UNIT + UNIT, 0x90000 + 4 * UNIT, UNIT)
        assert len(loop.memory._runs["r"]) == 3
        # runs adjacent on both sides merge, across byte runs and across blocks
        whole = KVLayout("D", 2, "t", [LayerLayout(0xA0000 + i * 0x1000, 2 * UNIT, 2 * UNIT, 32)
                                       for i in range(2)])
        w2 = WriteLayer("q", 0, whole, (1, 2, 3), (4, 5, 7), ((0, 0, UNIT), (UNIT, UNIT, UNIT)))
        assert loop.memory.entries(w2) == [(0x10000 + 2 * UNIT, 0xA0000 + 8 * UNIT, 4 * UNIT),
                                     (0x10000 + 6 * UNIT, 0xA0000 + 14 * UNIT, 2 * UNIT)]
        # a run outside either block is refused (the write fails, not the loop)
        with pytest.raises(ValueError, match="outside"):
            loop.memory.entries(WriteLayer("x", 0, d[0], (1,), (1,), ((UNIT, 0, 2 * UNIT),)))
        with pytest.raises(ValueError, match="block_len"):
            # whole blocks of unequal size
            loop.memory.entries(WriteLayer("y", 0, d[0], (1,), (1,)))
    finally:
        loop.stop()


def test_sliced_entries_without_uniform_geometry() -> None:
    """Layers of different block sizes: the per-layer path computes the same slices."""
    side = SideChannel()
    local = [LayerLayout(0x10000, 2 * UNIT, 2 * UNIT, 32),
             LayerLayout(0x20000, 4 * UNIT, 4 * UNIT, 32)]
    fmt = make_format(tp_rank=0, tp_size=1, total_heads=2, block_tokens=T, dtype="u8")
    ep = PrefillEndpoint(Sender("P", 0, 1, side.addr), 2,
                         local=KVLayout("P", 1, "s", local, fmt))
    loop = WorkerLoop(ep, side, None, local_layout=local)
    try:
        remote = KVLayout("D", 1, "s", [LayerLayout(0x90000, UNIT, UNIT, 32),
                                        LayerLayout(0xA0000, 2 * UNIT, 2 * UNIT, 32)])
        w = WriteLayer("r", 1, remote, (1, 2), (3, 4), ((2 * UNIT, 0, 2 * UNIT),))
        assert loop.memory.entries(w) == [
            (0x20000 + 4 * UNIT + 2 * UNIT, 0xA0000 + 6 * UNIT, 2 * UNIT),
            (0x20000 + 8 * UNIT + 2 * UNIT, 0xA0000 + 8 * UNIT, 2 * UNIT)]
    finally:
        loop.stop()
