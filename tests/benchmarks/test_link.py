"""The benchmarks' shaped link (``benchmarks/_link.py``): a tbf cap holds, and nothing is left
behind, also when the ``with`` block raises. Needs root and iproute2; about 3 s."""

from __future__ import annotations

import pytest

from benchmarks._link import Link, missing_requirements

pytestmark = pytest.mark.skipif(bool(missing_requirements()),
                                reason=f"shaped link: {missing_requirements()}")

CAP = 50e6  # bit/s


def test_tbf_cap_holds_and_link_is_removed() -> None:
    with Link.create(CAP) as link:
        assert link.exists()
        goodput = link.goodput(seconds=1.0) * 8
        # timing: a throughput is the property; 50 Mbit/s is a small load even for a busy box
        assert 0.6 * CAP <= goodput <= 1.1 * CAP, f"{goodput / 1e6:.1f} Mbit/s under a 50 Mbit cap"
        assert "tbf" in link.qdisc()
    assert not link.exists()


def test_uncapped_is_faster_than_the_cap() -> None:
    with Link.create() as link:
        assert link.goodput(seconds=0.3) * 8 > 2 * CAP  # timing: loopback veth does Gbit/s
    assert not link.exists()


def test_link_is_removed_after_an_exception() -> None:
    with pytest.raises(ZeroDivisionError), Link.create(CAP) as link:
        assert link.exists()
        1 / 0  # noqa: B018
    assert not link.exists()
