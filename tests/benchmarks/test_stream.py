"""The byte stream beside ``single-stream``: it delivers the rate it is asked for through a
benchmark link, no more than the link's cap, and stops; the rate a row asks for. Needs root
and iproute2 for the link; about 4 s."""

from __future__ import annotations

import pytest

from benchmarks._link import Link, missing_requirements
from benchmarks._plan import LinkInfo
from benchmarks._stream import ByteStream
from benchmarks.serving import stream_rate_bps


@pytest.mark.skipif(bool(missing_requirements()), reason=missing_requirements() or "ok")
def test_stream_delivers_its_rate_and_not_more_than_the_cap() -> None:
    import time

    with Link.create(40e6) as link:
        paced = ByteStream.start(link, 16e6, 0, 1)
        time.sleep(1.0)
        got = paced.stop()
        assert 10e6 < got < 20e6, got  # paced, not as fast as the link
        capped = ByteStream.start(link, 200e6, 0, 1)
        time.sleep(1.0)
        got = capped.stop()
        assert 20e6 < got < 44e6, got


def test_stream_rate_is_the_kv_within_the_prefill() -> None:
    info = LinkInfo(kv_bytes=10_000_000, prefill_s=0.5)
    assert stream_rate_bps(info) == pytest.approx(160e6)  # no goodput measured: all of it
    info.goodputs_bps, info.goodput_prefills_s = [400e6], [0.5]  # factor 0.4: all of it
    assert stream_rate_bps(info) == pytest.approx(160e6)
    info.goodputs_bps = [40e6]  # factor 4: what the link carries within the prefill
    assert stream_rate_bps(info) == pytest.approx(40e6)
