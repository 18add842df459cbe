"""When lw's Mooncake data plane (poll mode) resends a transfer Mooncake failed, and when it
does not: a scripted stand-in for ``mooncake.engine.TransferEngine`` decides each entry's
status, so every rule is exercised without a peer (the real engine's behaviour after a fence
is covered by tests/transport/test_fence.py)."""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Iterator

import numpy as np
import pytest

from lw.transport.dataplane import Completion, MooncakeDataPlane


class ScriptedEngine:
    """Answers as Mooncake's TransferEngine does; ``fail_attempts`` submissions of each
    transfer fail (status -1) before one succeeds; ``hang`` leaves every entry in flight."""

    fail_attempts = 0
    hang = False
    fail_after_s = 0.0  # a failure reported this long after the submit (a stall's give-up)

    def __init__(self) -> None:
        self.submits = 0
        self._next = 0
        self._status: dict[int, int] = {}
        self._at: dict[int, float] = {}

    def initialize(self, *_args: object) -> int:
        return 0

    def get_rpc_port(self) -> int:
        return 1

    def register_memory(self, _addr: int, _length: int) -> int:
        return 0

    def batch_transfer_sync_write(self, *_args: object) -> int:
        return 0

    def transfer_submit_write(self, _session: str, _src: int, _dst: int, _n: int) -> int:
        self.submits += 1
        self._next += 1
        status = 0 if self.hang else (-1 if self.submits <= self.fail_attempts else 1)
        self._status[self._next] = status
        self._at[self._next] = time.monotonic()
        return self._next

    def transfer_check_status(self, bid: int) -> int:
        if self._status[bid] < 0 and time.monotonic() - self._at[bid] < self.fail_after_s:
            return 0
        return self._status[bid]


@pytest.fixture
def plane(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[MooncakeDataPlane, np.ndarray]]:
    module = types.ModuleType("mooncake.engine")
    module.TransferEngine = ScriptedEngine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mooncake", types.ModuleType("mooncake"))
    monkeypatch.setitem(sys.modules, "mooncake.engine", module)
    monkeypatch.setenv("MC_TCP_LANES_PER_PEER", "4")
    dp = MooncakeDataPlane("127.0.0.1", 5.0)
    src = np.zeros(4096, np.uint8)
    dp.register_memory(src.ctypes.data, src.nbytes)
    try:
        yield dp, src
    finally:
        dp.close()


def _one(dp: MooncakeDataPlane, timeout: float = 10.0) -> Completion:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done = dp.poll()
        if done:
            assert len(done) == 1
            return done[0]
        time.sleep(0.002)
    raise AssertionError("no completion")


def test_a_transfer_failed_on_reset_connections_is_resent_until_it_lands(plane: tuple) -> None:
    dp, src = plane
    ScriptedEngine.fail_attempts = 3  # three lanes' connections were cut
    dp.submit("t", "peer:1", [(src.ctypes.data, 1 << 20, 4096)], 5.0)
    c = _one(dp)
    assert c.ok, c.reason
    assert dp.stats()["resends"] == 3
    assert dp.engine.submits == 4


def test_resends_are_bounded_and_the_failure_names_them(plane: tuple) -> None:
    dp, src = plane
    ScriptedEngine.fail_attempts = 100  # the peer refuses everything
    dp.submit("t", "peer:1", [(src.ctypes.data, 1 << 20, 4096)], 5.0)
    c = _one(dp)
    assert not c.ok
    assert dp.engine.submits == 1 + 5  # the first try and one resend per lane, plus one
    assert "resent 5 time(s); at first: transfer_check_status returned -1" in c.reason, c.reason


def test_nothing_is_resent_after_the_requests_deadline(plane: tuple) -> None:
    dp, src = plane
    ScriptedEngine.fail_attempts = 100
    dp.submit("t", "peer:1", [(src.ctypes.data, 1 << 20, 4096)], 0.0)  # deadline: now
    c = _one(dp)
    assert not c.ok and "resent" not in c.reason
    assert dp.engine.submits <= 1  # the lease's premise: no write is issued after it


def test_a_timed_out_transfer_is_not_resent(plane: tuple, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    dp, src = plane
    ScriptedEngine.hang = True
    monkeypatch.setattr(dp, "_deadline_s", 0.2)  # lw's own give-up, short for the test
    dp.submit("t", "peer:1", [(src.ctypes.data, 1 << 20, 4096)], 5.0)
    c = _one(dp)
    assert not c.ok and c.reason.startswith("mooncake timeout") and "resent" not in c.reason
    assert dp.engine.submits == 1  # its entries are still Mooncake's: never doubled


def test_a_stall_mooncake_gave_up_on_is_not_resent(plane: tuple, monkeypatch: pytest.MonkeyPatch
                                                   ) -> None:
    dp, src = plane
    ScriptedEngine.fail_attempts = 100
    ScriptedEngine.fail_after_s = 0.3  # past half of lw's transfer timeout: a stalled link
    monkeypatch.setattr(dp, "_deadline_s", 0.5)
    dp.submit("t", "peer:1", [(src.ctypes.data, 1 << 20, 4096)], 5.0)
    c = _one(dp)
    assert not c.ok and "resent" not in c.reason, c.reason
    assert dp.engine.submits == 1  # the writes behind it get the link, not a second copy


@pytest.fixture(autouse=True)
def _reset_script() -> Iterator[None]:
    yield
    ScriptedEngine.fail_attempts = 0
    ScriptedEngine.hang = False
    ScriptedEngine.fail_after_s = 0.0
