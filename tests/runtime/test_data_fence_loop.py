"""D's worker loop carries out the core's data-plane fence (issue 40): a lease that ends with a
sender in doubt fences Mooncake's inbound connections from its host, and only then reports the
request failed; a data plane that cannot fence is refused when the loop is made."""

from __future__ import annotations

import time

import numpy as np
import pytest

from lw.fsm import DecodeConfig, DecodeEndpoint, PrefillConfig, PrefillEndpoint, RecvFailed
from lw.transport.dataplane import InProcessDataPlane
from lw.transport.loopconfig import LoopConfig
from lw.transport.runtime import WorkerLoop
from lw.transport.sidechannel import SideChannel
from lw.transport.wire import KVLayout, Sender

from .conftest import needs_mooncake
from .loops import L, Pair, layouts, wait_for


def _pair(dp_kind: type, **d_kw: float) -> Pair:
    p_mem = np.zeros((L, 16, 256), dtype=np.uint8)
    d_mem = np.zeros((L, 16, 256), dtype=np.uint8)
    p_dp, d_dp = dp_kind("127.0.0.1", timeout_s=5.0), dp_kind("127.0.0.1", timeout_s=5.0)
    p_dp.register_memory(p_mem.ctypes.data, p_mem.nbytes)
    d_dp.register_memory(d_mem.ctypes.data, d_mem.nbytes)
    d_side, p_side = SideChannel(), SideChannel()
    inc = time.time_ns()
    d_ep = DecodeEndpoint(Sender("D", 0, inc, d_side.addr),
                          KVLayout("D", inc, d_dp.session, layouts(d_mem)),
                          DecodeConfig(prefill_timeout_s=30, lease_s=0.3, fence_data=True,
                                       **d_kw))
    p_ep = PrefillEndpoint(Sender("P", 0, 1, p_side.addr), L,
                           PrefillConfig(meta_retry_s=0.05, request_timeout_s=0.1))
    d = WorkerLoop(d_ep, d_side, d_dp, LoopConfig(name="fence-d")).start()
    p = WorkerLoop(p_ep, p_side, p_dp, LoopConfig(name="fence-p"), local_layout=layouts(p_mem))
    p.start()
    return Pair(p, d, p_mem, d_mem, p_dp, d_dp)


@needs_mooncake
def test_a_lost_sender_is_fenced_before_its_blocks_are_released() -> None:
    from lw.transport.dataplane import MooncakeDataPlane

    pair = _pair(MooncakeDataPlane)
    try:
        assert pair.d_dp.can_fence
        local, remote = (1, 2), (3, 4)
        pair.start("r1", local, remote)
        wait_for(lambda: pair.p.run(lambda lp: lp.endpoint.state_of("r1")).result(5)
                 == "META_READY")
        pair.compute("r1", local, range(1))  # one layer written: the P connected and wrote
        # P's loop stops (a hung process, say) and D learns it is gone: the sender never
        # confirms it stopped, so the lease ends in a fence of P's host
        pair.p.stop()
        pair.d.call("peer_lost", "P", "heartbeats lost").result(5)

        def failed() -> list[RecvFailed]:
            pair.collect()
            return [r for r in pair.d_reports if isinstance(r, RecvFailed)]

        (rep,) = wait_for(failed, 30)
        assert rep.block_ids == remote
        stats = pair.d.stats()
        assert stats["loop.fences"] == 1
        dp = pair.d_dp.stats()
        assert dp["fences"] == 1 and dp["fence_failures"] == 0
        tl = pair.d.run(lambda lp: [e[2] for e in lp.endpoint.timeline.of("r1")]).result(5)
        assert tl.index("fence_data") < tl.index("fenced") < tl.index("lease_expired")
    finally:
        pair.stop()


def test_fence_data_needs_a_data_plane_that_can_fence() -> None:
    side = SideChannel()
    try:
        dp = InProcessDataPlane()
        inc = time.time_ns()
        ep = DecodeEndpoint(Sender("D", 0, inc, side.addr),
                            KVLayout("D", inc, dp.session, layouts(np.zeros((L, 16, 256),
                                                                            np.uint8))),
                            DecodeConfig(fence_data=True))
        with pytest.raises(ValueError, match="fence_data needs a data plane that can fence"):
            WorkerLoop(ep, side, dp, LoopConfig(name="fence-d"))
    finally:
        side.close()
