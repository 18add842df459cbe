"""What lw's forward hook costs on a live P/D loop pair (benchmarks/data_plane.py, tests)."""

from __future__ import annotations

import time

from lw.fsm import DecodeEndpoint, PrefillEndpoint
from lw.transport.runtime import WorkerLoop
from lw.transport.sidechannel import SideChannel
from lw.transport.wire import KVLayout, LayerLayout, Sender

__all__ = ["hook_cost_report", "measure_hook_cost"]


def hook_cost_report(
    n_requests: int,
    layers: int = 61,
    *,
    blocks_per_request: int = 4,
    block_bytes: int = 256,
    compute_s: float = 0.002,
    steps: int = 3,
    timeline: bool = True,
) -> dict[str, float]:
    """Cost of ``WorkerLoop.layer_computed`` with ``n_requests`` in the batch, on a live loop.

    Builds a P loop and a D loop in this process (real ZMQ sockets on loopback, in-process data
    plane), gets every request accepted by D, then runs ``steps`` forward passes of ``layers``
    layers, timing each hook call while the loop thread emits and submits the writes (the forward
    sleeps ``compute_s`` per layer, as a GPU kernel would release the GIL). ``timeline`` false
    turns the endpoints' lifecycle timelines off (to price them). Returns seconds.
    """
    import numpy as np

    from lw.fsm import DecodeConfig, PrefillConfig, PrefillRequest
    from lw.transport.dataplane import InProcessDataPlane

    nblk = n_requests * blocks_per_request
    p_mem = np.zeros((layers, nblk, block_bytes), dtype=np.uint8)
    d_mem = np.zeros((layers, nblk, block_bytes), dtype=np.uint8)

    def layout_of(mem: np.ndarray) -> list[LayerLayout]:
        base = mem.ctypes.data
        return [LayerLayout(base + i * nblk * block_bytes, block_bytes, block_bytes, nblk)
                for i in range(layers)]

    p_dp = InProcessDataPlane()
    d_dp = InProcessDataPlane()
    p_dp.register_memory(p_mem.ctypes.data, p_mem.nbytes)
    d_dp.register_memory(d_mem.ctypes.data, d_mem.nbytes)
    d_side, p_side = SideChannel(), SideChannel()
    d_me = Sender("bench-d", 0, 1, d_side.addr)
    d_layout = KVLayout("bench-d", 1, d_dp.session, layout_of(d_mem))
    big = 3600.0
    entries = 32768 if timeline else 0
    d_loop = WorkerLoop(DecodeEndpoint(d_me, d_layout, DecodeConfig(
        big, 2 * big + 60, timeline_entries=entries)), d_side, d_dp)
    p_cfg = PrefillConfig(request_timeout_s=big, meta_retry_s=1.0, ack_retry_s=1.0,
                          timeline_entries=entries)
    p_loop = WorkerLoop(PrefillEndpoint(Sender("bench-p", 0, 1, p_side.addr), layers, p_cfg),
                        p_side, p_dp, local_layout=layout_of(p_mem))
    costs: list[float] = []
    loop_s = 0.0
    try:
        d_loop.start()
        p_loop.start()
        for step in range(steps):
            ids = [f"s{step}-r{i}" for i in range(n_requests)]
            for i, rid in enumerate(ids):
                blocks = tuple(range(i * blocks_per_request, (i + 1) * blocks_per_request))
                d_loop.call("add_request", rid, blocks, 1).result(10)
                p_loop.call("add_request",
                            PrefillRequest(rid, d_side.addr, blocks, blocks, 1)).result(10)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # measure the steady state: writes emitted
                states = p_loop.run(lambda lp, ids=ids: [lp.endpoint.state_of(r) for r in ids])
                if all(s == "META_READY" for s in states.result(10)):
                    break
                time.sleep(0.005)
            before = p_loop.counters["layer_event_s"]
            for layer in range(layers):
                t0 = time.perf_counter()
                p_loop.layer_computed(layer, ids)
                costs.append(time.perf_counter() - t0)
                time.sleep(compute_s)
            deadline = time.monotonic() + 60
            while p_loop.endpoint.live_requests() and time.monotonic() < deadline:
                time.sleep(0.005)
            loop_s += float(p_loop.counters["layer_event_s"]) - before
            p_loop.drain_reports()
            d_loop.drain_reports()
    finally:
        p_loop.stop()
        d_loop.stop()
    costs.sort()
    n = len(costs)
    return {
        "requests": float(n_requests),
        "layers": float(layers),
        "hook_mean_s": sum(costs) / n,
        "hook_p50_s": costs[n // 2],
        "hook_p99_s": costs[min(n - 1, int(n * 0.99))],
        "hook_max_s": costs[-1],
        "loop_per_layer_s": loop_s / n,
    }


def measure_hook_cost(n_requests: int, layers: int = 61) -> float:
    """Mean seconds per forward-hook call (one layer) with ``n_requests`` in the batch."""
    return hook_cost_report(n_requests, layers)["hook_mean_s"]
