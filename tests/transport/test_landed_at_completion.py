"""What lw's DONE rests on: a Mooncake write reported complete has landed in the receiver's
memory, also on a slow link where the sender's socket buffers could still hold megabytes.

Mooncake's TCP transport had a framing in which a write completed once its last chunk entered
the *sender's* socket buffer (upstream's "protocol v2" adds a receiver acknowledgement); a DONE
sent over the side channel could then overtake KV bytes still queued behind a tbf cap. That
framing is still selectable (``MC_TCP_PROTO=1``): run with it, this test fails (the last
megabyte is not there yet), so lw's data plane refuses to start with it. The receiver sits in
a network namespace behind a 200 Mbit/s tbf-capped veth; about 3 s; needs root."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from benchmarks._link import Link, missing_requirements
from tests.transport.test_dataplane import HAVE_MOONCAKE, Peer, collect

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not HAVE_MOONCAKE, reason="mooncake not importable")]


@pytest.mark.skipif(bool(missing_requirements()), reason=f"link: {missing_requirements()}")
@pytest.mark.parametrize("wait", ["poll", "spin"])
def test_a_completed_write_has_landed_behind_a_capped_link(wait: str) -> None:
    from lw.transport.dataplane import MooncakeDataPlane

    size, step = 8 << 20, 1 << 20
    with Link.create(200e6) as link:
        peer = Peer(size, host=link.ns_addr, wrap=link.wrap)
        plane = MooncakeDataPlane(link.root_addr, wait=wait)  # type: ignore[arg-type]
        try:
            src = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
            plane.register_memory(src.ctypes.data, size)
            plane.submit(1, peer.session, [(src.ctypes.data + o, peer.addr + o, step)
                                           for o in range(0, size, step)])
            [c] = collect(plane, 1, timeout=30.0)
            assert c.ok, c.reason
            # Asked at once: the last megabyte would still be on the wire (40 ms of it at this
            # rate) if completion meant "left the sender".
            assert peer.sha(size - step, step) == hashlib.sha256(src[-step:].tobytes()).hexdigest()
            assert peer.sha(0, size) == hashlib.sha256(src.tobytes()).hexdigest()
        finally:
            plane.close()
            peer.kill()


def test_the_unacknowledged_framing_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from lw.transport.dataplane import MooncakeDataPlane

    monkeypatch.setenv("MC_TCP_PROTO", "1")
    with pytest.raises(ValueError, match="MC_TCP_PROTO=1"):
        MooncakeDataPlane("127.0.0.1")
