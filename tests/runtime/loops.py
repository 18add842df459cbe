"""A P WorkerLoop and a D WorkerLoop in one process: real sockets, in-process data plane."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lw.fsm import (
    DecodeConfig,
    DecodeEndpoint,
    Effect,
    PrefillConfig,
    PrefillEndpoint,
    PrefillRequest,
)
from lw.lab.synthetic.pattern import Pattern
from lw.transport.dataplane import InProcessDataPlane
from lw.transport.loopconfig import LoopConfig
from lw.transport.runtime import WorkerLoop
from lw.transport.sidechannel import SideChannel
from lw.transport.wire import KVLayout, LayerLayout, Sender

L = 4
NBLK = 16
BLEN = 256


def layouts(mem: np.ndarray) -> list[LayerLayout]:
    base = mem.ctypes.data
    return [LayerLayout(base + i * NBLK * BLEN, BLEN, BLEN, NBLK) for i in range(L)]


def wait_for(pred: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Poll ``pred`` until it is truthy; its value, or AssertionError after ``timeout`` (a
    generous deadline: a passing test returns at the condition, however slow the machine)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.005)
    raise AssertionError(f"condition not met within {timeout}s")


@dataclass
class Pair:
    """One P loop and one D loop with their memory; reports collected as they arrive."""

    p: WorkerLoop
    d: WorkerLoop
    p_mem: np.ndarray
    d_mem: np.ndarray
    p_dp: InProcessDataPlane
    d_dp: InProcessDataPlane
    pattern: Pattern = field(default_factory=lambda: Pattern(BLEN))
    p_reports: list[Effect] = field(default_factory=list)
    d_reports: list[Effect] = field(default_factory=list)

    def start(self, rid: str, local: tuple[int, ...], remote: tuple[int, ...],
              d_first: bool = True) -> None:
        if d_first:
            self.d.call("add_request", rid, remote, 1).result(5)
        self.p.call("add_request", PrefillRequest(rid, self.d.addr, local, remote, 1)).result(5)

    def compute(self, rid: str, local: tuple[int, ...], layers: range | None = None) -> None:
        for layer in layers if layers is not None else range(L):
            for j, blk in enumerate(local):
                self.pattern.fill(self.p_mem[layer, blk], rid, layer, j)
            self.p.layer_computed(layer, [rid])

    def verify(self, rid: str, remote: tuple[int, ...]) -> bool:
        return all(self.pattern.check(self.d_mem[layer, blk], rid, layer, j)
                   for layer in range(L) for j, blk in enumerate(remote))

    def collect(self) -> None:
        self.p_reports += self.p.drain_reports()
        self.d_reports += self.d.drain_reports()

    def wait_reports(self, n_p: int, n_d: int, timeout: float = 30.0) -> None:
        def enough() -> bool:
            self.collect()
            return len(self.p_reports) >= n_p and len(self.d_reports) >= n_d
        wait_for(enough, timeout)

    def stop(self) -> None:
        self.p.stop()
        self.d.stop()


def make_pair(pcfg: PrefillConfig | None = None, dcfg: DecodeConfig | None = None,
              d_endpoint: type[DecodeEndpoint] = DecodeEndpoint, p_key: bytes | None = None,
              d_key: bytes | None = None, timeout_s: float = 1.0, **p_kw: Any) -> Pair:
    """A started P/D pair; ``p_kw`` are P's loop settings (LoopConfig's names)."""
    p_loop = LoopConfig(name="test-p", **p_kw)  # a bad setting fails before anything starts
    p_mem = np.zeros((L, NBLK, BLEN), dtype=np.uint8)
    d_mem = np.zeros((L, NBLK, BLEN), dtype=np.uint8)
    p_dp, d_dp = InProcessDataPlane(timeout_s=timeout_s), InProcessDataPlane(timeout_s=timeout_s)
    p_dp.register_memory(p_mem.ctypes.data, p_mem.nbytes)
    d_dp.register_memory(d_mem.ctypes.data, d_mem.nbytes)
    d_side, p_side = SideChannel(cluster_key=d_key), SideChannel(cluster_key=p_key)
    d_inc = time.time_ns()
    # Retries are quick (a lost message costs 50 ms) but attempts and deadlines generous: on a
    # slow or loaded machine a request still ends by its protocol, not by a loop that was late.
    d_ep = d_endpoint(Sender("D", 0, d_inc, d_side.addr),
                      KVLayout("D", d_inc, d_dp.session, layouts(d_mem)),
                      dcfg or DecodeConfig(prefill_timeout_s=30, lease_s=60))
    p_ep = PrefillEndpoint(Sender("P", 0, 1, p_side.addr), L,
                           pcfg or PrefillConfig(meta_retry_s=0.05, ack_retry_s=0.05,
                                                 meta_attempts=600, ack_attempts=600,
                                                 request_timeout_s=30))
    d = WorkerLoop(d_ep, d_side, d_dp, LoopConfig(name="test-d")).start()
    p = WorkerLoop(p_ep, p_side, p_dp, p_loop, local_layout=layouts(p_mem))
    p.start()
    return Pair(p, d, p_mem, d_mem, p_dp, d_dp)
