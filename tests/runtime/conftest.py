"""Fixtures of the runtime tests: side channels that are always closed, Mooncake availability."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from lw.transport.sidechannel import SideChannel


def _mooncake_available() -> bool:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


MOONCAKE = _mooncake_available()
needs_mooncake = pytest.mark.skipif(not MOONCAKE, reason="mooncake-transfer-engine not installed")


@pytest.fixture
def channels() -> Iterator[Callable[..., SideChannel]]:
    """Factory of SideChannels on random loopback ports, all closed after the test."""
    made: list[SideChannel] = []

    def make(**kw: object) -> SideChannel:
        ch = SideChannel(**kw)  # type: ignore[arg-type]
        made.append(ch)
        return ch

    yield make
    for ch in made:
        ch.close()
