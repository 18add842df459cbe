"""Tests for lw.transport.dataplane: pure helpers, the in-process plane, the Mooncake plane."""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lw.transport.dataplane import (
    Completion,
    DataPlane,
    Entry,
    InProcessDataPlane,
    MooncakeDataPlane,
    coalesce,
    split_batches,
)

HERE = Path(__file__).resolve().parent


def collect(plane: DataPlane, n: int, timeout: float = 60.0) -> list[Completion]:
    """Wait on the plane's fileno until ``n`` completions arrived (or fail after ``timeout``, a
    generous deadline: a passing test returns at the completions, however slow the machine)."""
    out: list[Completion] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"only {len(out)} of {n} completions after {timeout}s: {out}")
        select.select([plane.fileno()], [], [], remaining)
        out.extend(plane.poll())
    return out


def wait_until(cond: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    """Poll ``cond`` until it is truthy; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.002)


def expand(entries: list[Entry]) -> list[tuple[int, int]]:
    """Byte-level mapping (src byte, dst byte) of a list of entries, in order."""
    return [(s + k, d + k) for s, d, n in entries for k in range(n)]


# ---------------------------------------------------------------------------------------------
# Pure helpers


def test_coalesce_merges_only_when_src_and_dst_both_continue() -> None:
    entries = [(100, 1000, 10), (110, 1010, 5), (115, 2000, 5), (120, 2005, 5), (200, 2010, 1)]
    assert coalesce(entries) == [(100, 1000, 15), (115, 2000, 10), (200, 2010, 1)]


def test_coalesce_keeps_order_and_handles_empty() -> None:
    assert coalesce([]) == []
    # Contiguous but in reverse order: not merged (order is preserved, no sorting).
    assert coalesce([(110, 1010, 10), (100, 1000, 10)]) == [(110, 1010, 10), (100, 1000, 10)]


def test_coalesce_respects_dst_boundaries() -> None:
    entries = [(100, 1000, 10), (110, 1010, 10), (120, 1020, 10)]
    assert coalesce(entries, {1010}) == [(100, 1000, 10), (110, 1010, 20)]


gap = st.one_of(st.just(0), st.integers(min_value=1, max_value=40))


@st.composite
def entry_lists(draw: st.DrawFn) -> list[Entry]:
    """Entry lists where src/dst are often (but not always) contiguous with the previous one."""
    n = draw(st.integers(min_value=0, max_value=30))
    s, d = draw(st.integers(1, 1000)), draw(st.integers(1, 1000))
    out: list[Entry] = []
    for _ in range(n):
        length = draw(st.integers(min_value=1, max_value=16))
        out.append((s, d, length))
        s += length + draw(gap)
        d += length + draw(gap)
    return out


@settings(max_examples=300, deadline=None)
@given(entry_lists())
def test_coalesce_preserves_byte_mapping(entries: list[Entry]) -> None:
    merged = coalesce(entries)
    assert expand(merged) == expand(entries)
    assert len(merged) <= len(entries)
    for (ps, pd, pn), (s, d, _n) in zip(merged, merged[1:], strict=False):
        assert not (ps + pn == s and pd + pn == d), "left a mergeable pair"


@settings(max_examples=200, deadline=None)
@given(entry_lists(), st.integers(min_value=1, max_value=7))
def test_split_batches_preserves_order_and_bounds(entries: list[Entry], k: int) -> None:
    batches = split_batches(entries, k)
    assert [e for b in batches for e in b] == entries
    assert all(1 <= len(b) <= k for b in batches)
    assert len(batches) == -(-len(entries) // k)


def test_split_batches_rejects_bad_size() -> None:
    with pytest.raises(ValueError):
        split_batches([(1, 1, 1)], 0)
    assert split_batches([(1, 1, 1)] * 2049) == [[(1, 1, 1)] * 1024] * 2 + [[(1, 1, 1)]]


# ---------------------------------------------------------------------------------------------
# In-process data plane


@pytest.fixture
def pair() -> Iterator[tuple[InProcessDataPlane, InProcessDataPlane, np.ndarray, np.ndarray]]:
    """A sender with a 64 KiB random source and a receiver with a 64 KiB zeroed destination.
    A write to a frozen session waits up to 60 s: held in flight until the test unfreezes it."""
    src = np.random.default_rng(0).integers(0, 256, 64 << 10, dtype=np.uint8)
    dst = np.zeros(64 << 10, dtype=np.uint8)
    a, b = InProcessDataPlane(timeout_s=60.0), InProcessDataPlane(timeout_s=60.0)
    a.register_memory(src.ctypes.data, src.nbytes)
    b.register_memory(dst.ctypes.data, dst.nbytes)
    try:
        yield a, b, src, dst
    finally:
        a.close()
        b.close()


def test_inprocess_is_a_dataplane(pair: tuple) -> None:
    a, b, _, _ = pair
    assert isinstance(a, DataPlane) and isinstance(b, DataPlane)
    assert a.session != b.session


def test_inprocess_bytes_land_exactly(pair: tuple) -> None:
    a, b, src, dst = pair
    block = 1024
    perm = np.random.default_rng(1).permutation(32)
    entries = [
        (src.ctypes.data + i * block, dst.ctypes.data + int(p) * block, block)
        for i, p in enumerate(perm)
    ]
    a.submit("x", b.session, entries)
    [c] = collect(a, 1)
    assert c == Completion("x", True, "", 32 * block)
    expected = np.zeros_like(dst)
    for i, p in enumerate(perm):
        expected[p * block : (p + 1) * block] = src[i * block : (i + 1) * block]
    assert np.array_equal(dst, expected)
    st_ = a.stats()
    assert (st_["submitted"], st_["completed"], st_["failed"]) == (1, 1, 0)
    assert (st_["bytes"], st_["entries"], st_["batches"]) == (32 * block, 32, 1)


def test_inprocess_out_of_bounds_fails_cleanly(pair: tuple) -> None:
    a, b, src, dst = pair
    ok_entry = (src.ctypes.data, dst.ctypes.data, 16)
    beyond = (src.ctypes.data, dst.ctypes.data + dst.nbytes - 8, 16)
    a.submit(1, b.session, [ok_entry, beyond])
    [c] = collect(a, 1)
    assert not c.ok and "outside the memory registered" in c.reason and b.session in c.reason
    assert not dst.any(), "a rejected transfer must not write anything"
    a.submit(2, b.session, [(src.ctypes.data + src.nbytes - 8, dst.ctypes.data, 16)])
    [c] = collect(a, 1)
    assert not c.ok and "local source range" in c.reason
    a.submit(3, "inproc://nobody", [ok_entry])
    [c] = collect(a, 1)
    assert not c.ok and "unknown session" in c.reason
    assert a.stats()["failed"] == 3


def test_inprocess_fail_injection_and_delay(pair: tuple) -> None:
    a, b, src, dst = pair
    entry = [(src.ctypes.data, dst.ctypes.data, 100)]
    a.fail_next(2)
    for i in range(3):
        a.submit(i, b.session, entry)
    got = collect(a, 3)
    assert [c.xfer_id for c in got] == [0, 1, 2]
    assert [c.ok for c in got] == [False, False, True]
    assert "injected" in got[0].reason
    a.delay(1.0)
    t0 = time.monotonic()
    a.submit("slow", b.session, entry)
    # timing: submit never waits for the (1 s delayed) transfer; it takes microseconds
    assert time.monotonic() - t0 < 0.5
    [c] = collect(a, 1)
    assert c.ok and time.monotonic() - t0 >= 0.9  # the delay was applied


def test_inprocess_frozen_session_does_not_delay_others(pair: tuple) -> None:
    a, b, src, dst = pair
    dst2 = np.zeros(1024, dtype=np.uint8)
    c2 = InProcessDataPlane(timeout_s=5.0)
    c2.register_memory(dst2.ctypes.data, dst2.nbytes)
    try:
        a.freeze(c2.session)
        a.submit("to-frozen", c2.session, [(src.ctypes.data, dst2.ctypes.data, 1024)])
        wait_until(lambda: a.stats()["queued"] == 0, "the frozen write taken by its sender")
        a.submit("to-healthy", b.session, [(src.ctypes.data, dst.ctypes.data, 1024)])
        # the frozen write is held (a's timeout is 60 s): the healthy one, not queued behind
        # it, completes first
        [c] = collect(a, 1, timeout=30)
        assert c.xfer_id == "to-healthy" and c.ok
        assert not dst2.any() and a.poll() == []
        a.unfreeze(c2.session)
        [c] = collect(a, 1)
        assert c.xfer_id == "to-frozen" and c.ok
        assert np.array_equal(dst2, src[:1024])
    finally:
        c2.close()


def test_inprocess_frozen_session_times_out(pair: tuple) -> None:
    a, b, src, dst = pair
    fast = InProcessDataPlane(timeout_s=0.2)
    fast.register_memory(src.ctypes.data, src.nbytes)
    try:
        fast.freeze(b.session)
        t0 = time.monotonic()
        fast.submit("t", b.session, [(src.ctypes.data, dst.ctypes.data, 8)])
        [c] = collect(fast, 1)
        # timing: the write fails at its 0.2 s timeout, never before; the upper bound (50x)
        # only says that it fails at all
        assert not c.ok and "timeout" in c.reason and 0.15 < time.monotonic() - t0 < 10.0
    finally:
        fast.unfreeze(b.session)
        fast.close()


def test_a_write_queued_past_its_deadline_fails_unsent(pair: tuple) -> None:
    """The lease argument bounds a write's life from the core's submission: a transfer the
    sender reaches after ``within_s`` fails without a byte sent (not in doubt), one within
    its time goes out as usual."""
    a, b, src, dst = pair
    a.freeze(b.session)
    a.submit("first", b.session, [(src.ctypes.data, dst.ctypes.data, 8)])
    a.submit("late", b.session, [(src.ctypes.data, dst.ctypes.data + 64, 8)], within_s=0.05)
    a.submit("patient", b.session, [(src.ctypes.data, dst.ctypes.data + 128, 8)], within_s=30)
    # "first" holds the sender while the session is frozen (up to a's 60 s timeout); the
    # sleep lets "late"'s 0.05 s pass (4x), "patient"'s 30 s stay far
    time.sleep(0.2)
    a.unfreeze(b.session)
    got = {c.xfer_id: c for c in collect(a, 3)}
    assert got["first"].ok and got["patient"].ok, got
    late = got["late"]
    assert not late.ok and not late.in_doubt and "deadline" in late.reason, late
    assert not dst[64:72].any() and np.array_equal(dst[128:136], src[:8])


def test_a_write_past_its_deadline_at_submission_fails_at_once(pair: tuple) -> None:
    a, b, src, dst = pair
    a.submit("gone", b.session, [(src.ctypes.data, dst.ctypes.data, 8)], within_s=-0.01)
    [c] = collect(a, 1)
    assert not c.ok and not c.in_doubt and "nothing was sent" in c.reason
    assert not dst[:8].any()


def test_inprocess_fifo_per_session_and_fileno(pair: tuple) -> None:
    a, b, src, dst = pair
    r, _, _ = select.select([a.fileno()], [], [], 0)
    assert r == []
    for i in range(200):
        a.submit(i, b.session, [(src.ctypes.data + i, dst.ctypes.data + i, 1)])
    got = collect(a, 200)
    assert [c.xfer_id for c in got] == list(range(200))
    r, _, _ = select.select([a.fileno()], [], [], 0)
    assert r == [], "poll() must drain the fd"
    assert np.array_equal(dst[:200], src[:200])


def test_inprocess_close_fails_pending(pair: tuple) -> None:
    a, b, src, dst = pair
    a.freeze(b.session)
    try:
        for i in range(5):
            a.submit(i, b.session, [(src.ctypes.data, dst.ctypes.data, 8)])
        wait_until(lambda: a.stats()["queued"] == 4, "the first write waiting on the frozen peer")
        t0 = time.monotonic()
        a.close()
        # timing: close wakes the write waiting on the frozen session (up to 60 s) at once,
        # rather than waiting out its 5 s join timeout
        assert time.monotonic() - t0 < 2.5
        got = a.poll()
        assert sorted(c.xfer_id for c in got) == list(range(5))
        assert all(not c.ok and "closed" in c.reason for c in got)
        a.submit("late", b.session, [(src.ctypes.data, dst.ctypes.data, 8)])
        assert a.poll() == [Completion("late", False, "closed", 8)]
        assert not dst.any()
    finally:
        a.unfreeze(b.session)


def test_inprocess_bad_entries_raise(pair: tuple) -> None:
    a, b, src, dst = pair
    bad: list[object] = [
        [(0, dst.ctypes.data, 1)],
        [(src.ctypes.data, dst.ctypes.data, 0)],
        [(src.ctypes.data, dst.ctypes.data, -4)],
        [(src.ctypes.data, dst.ctypes.data)],
        [(src.ctypes.data, "x", 1)],
        [(float(src.ctypes.data), dst.ctypes.data, 1)],
        [None],
        42,
    ]
    for entries in bad:
        with pytest.raises(ValueError):
            a.submit("bad", b.session, entries)  # type: ignore[arg-type]
    a.submit("empty", b.session, [])
    assert collect(a, 1) == [Completion("empty", True, "", 0)]
    numpy_ints = [(np.int64(src.ctypes.data), np.uint64(dst.ctypes.data), np.int32(8))]
    a.submit("numpy", b.session, numpy_ints)  # type: ignore[arg-type]
    assert collect(a, 1) == [Completion("numpy", True, "", 8)]
    assert np.array_equal(dst[:8], src[:8])


def test_inprocess_connect_and_threaded_submit(pair: tuple) -> None:
    a, b, src, dst = pair
    a.connect(b.session)
    a.connect(b.session)
    a.connect("inproc://ghost")
    deadline = time.monotonic() + 30
    while (a.is_connected(b.session) is None or a.is_connected("inproc://ghost") is None) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.01)
    assert a.is_connected(b.session) is True
    assert a.is_connected("inproc://ghost") is False

    def many(tag: str) -> None:
        for i in range(100):
            a.submit((tag, i), b.session, [(src.ctypes.data, dst.ctypes.data, 4)])

    threads = [threading.Thread(target=many, args=(t,)) for t in "abcd"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = collect(a, 400)
    assert all(c.ok for c in got)
    for tag in "abcd":  # each thread's submits stay in its order
        mine: list[Hashable] = [c.xfer_id for c in got if c.xfer_id[0] == tag]  # type: ignore[index]
        assert mine == [(tag, i) for i in range(100)]


# ---------------------------------------------------------------------------------------------
# Mooncake data plane (two OS processes over loopback)

try:
    import mooncake.engine  # noqa: F401

    HAVE_MOONCAKE = True
except ImportError as exc:  # pragma: no cover - CI has it
    HAVE_MOONCAKE = False
    MOONCAKE_ERROR = repr(exc)

_skip_without_mooncake = pytest.mark.skipif(
    not HAVE_MOONCAKE,
    reason="mooncake not importable (pip install mooncake-transfer-engine-non-cuda; "
    "apt-get install libibverbs1)" + ("" if HAVE_MOONCAKE else f": {MOONCAKE_ERROR}"),
)


def needs_mooncake(fn: Callable[..., None]) -> Callable[..., None]:
    """Mark a multi-process Mooncake test: slow, and skipped when mooncake cannot be imported."""
    return pytest.mark.slow(_skip_without_mooncake(fn))


class Peer:
    """A dp_peer.py subprocess: a Mooncake engine with a registered buffer in another process."""

    def __init__(self, size: int = 16 << 20, split: bool = False, host: str = "127.0.0.1",
                 wrap: Callable[[list[str]], list[str]] = list) -> None:
        args = wrap([sys.executable, str(HERE / "dp_peer.py"), "--size", str(size),
                     "--host", host])
        env = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"))
        self.proc = subprocess.Popen(
            args + (["--split"] if split else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.kill()
            raise RuntimeError("dp_peer.py exited before printing its session")
        info = json.loads(line)
        self.session: str = info["session"]
        self.addr: int = info["addr"]
        self.size: int = info["size"]

    def ask(self, command: str) -> str:
        """Send one command line and return the peer's one-line answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def sha(self, offset: int, length: int) -> str:
        """sha256 of the peer's buffer slice."""
        return self.ask(f"sha {offset} {length}")

    def kill(self) -> None:
        """Kill the process and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def freeze_process(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until the kernel reports it stopped (delivery is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        states = {
            stat.read_text().rsplit(")", 1)[1].split()[0]
            for stat in Path(f"/proc/{pid}/task").glob("*/stat")
        }
        if states <= {"T", "t"}:  # every thread stopped
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop")


@pytest.fixture(scope="module", params=["spin", "poll"])
def mc_sender(request: pytest.FixtureRequest) -> Iterator[tuple[MooncakeDataPlane, np.ndarray]]:
    """A Mooncake data plane (each wait mode) with a registered 16 MiB random source buffer."""
    if not HAVE_MOONCAKE:
        pytest.skip("mooncake not importable")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    plane = MooncakeDataPlane("127.0.0.1", wait=request.param)
    src = np.random.default_rng(2).integers(0, 256, 16 << 20, dtype=np.uint8)
    plane.register_memory(src.ctypes.data, src.nbytes)
    try:
        yield plane, src
    finally:
        plane.close()


@pytest.fixture(scope="module")
def mc_peer(mc_sender: tuple) -> Iterator[Peer]:
    """A live peer process shared by the Mooncake tests (killed at the end)."""
    peer = Peer()
    try:
        yield peer
    finally:
        peer.kill()


def sha(a: np.ndarray) -> str:
    """sha256 of an array's bytes."""
    return hashlib.sha256(a.tobytes()).hexdigest()


@needs_mooncake
@pytest.mark.parametrize("kw", [{"window_span_s": -0.001}, {"window_span_s": float("nan")},
                                {"window_span_after_s": -1.0}])
def test_mooncake_refuses_a_window_span_that_is_not_a_duration(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="window_span_s and window_span_after_s must be >= 0"):
        MooncakeDataPlane("127.0.0.1", **kw)


@needs_mooncake
def test_mooncake_real_bytes_between_processes(mc_sender: tuple, mc_peer: Peer) -> None:
    plane, src = mc_sender
    mc_peer.ask("zero")
    plane.connect(mc_peer.session)
    block, nblocks = 64 << 10, 64
    perm = np.random.default_rng(3).permutation(nblocks)
    entries = [
        (src.ctypes.data + i * block, mc_peer.addr + int(p) * block, block)
        for i, p in enumerate(perm)
    ]
    plane.submit("blocks", mc_peer.session, entries)
    [c] = collect(plane, 1, timeout=30)
    assert c == Completion("blocks", True, "", nblocks * block)
    assert plane.is_connected(mc_peer.session) is True
    expected = np.zeros(nblocks * block, dtype=np.uint8)
    for i, p in enumerate(perm):
        expected[p * block : (p + 1) * block] = src[i * block : (i + 1) * block]
    assert mc_peer.sha(0, nblocks * block) == sha(expected)


@needs_mooncake
def test_mooncake_more_than_2048_entries(mc_sender: tuple, mc_peer: Peer) -> None:
    plane, src = mc_sender
    mc_peer.ask("zero")
    n, length = 3000, 1024
    entries = [
        (src.ctypes.data + i * length, mc_peer.addr + 2 * i * length, length) for i in range(n)
    ]
    before = plane.stats()
    plane.submit("many", mc_peer.session, entries)
    [c] = collect(plane, 1, timeout=30)
    assert c.ok, c.reason
    after = plane.stats()
    assert after["entries_sent"] - before["entries_sent"] == n
    if plane.wait == "spin":  # poll mode keeps <= 1024 entries in flight instead of batching
        assert after["batches"] - before["batches"] == 3
    expected = np.zeros(2 * n * length, dtype=np.uint8)
    for i in range(n):
        expected[2 * i * length : (2 * i + 1) * length] = src[i * length : (i + 1) * length]
    assert mc_peer.sha(0, 2 * n * length) == sha(expected)


@needs_mooncake
def test_mooncake_submit_does_not_block(mc_sender: tuple) -> None:
    """Writes to a frozen peer are held inside Mooncake (until its 30 s timeout): submitting
    more, big or small, still returns at once; resumed, the peer takes every one, in order."""
    plane, src = mc_sender
    peer = Peer(size=src.nbytes)
    try:
        plane.connect(peer.session)
        plane.submit("warm", peer.session, [(src.ctypes.data, peer.addr, 64)])
        assert all(c.ok for c in collect(plane, 1))
        freeze_process(peer.proc.pid)
        big = [(src.ctypes.data, peer.addr, src.nbytes)]
        small = [(src.ctypes.data, peer.addr, 4096)]
        worst = 0.0
        for i in range(4):
            t0 = time.perf_counter()
            plane.submit(("big", i), peer.session, big)
            t1 = time.perf_counter()
            plane.submit(("small", i), peer.session, small)  # queued behind a held transfer
            worst = max(worst, t1 - t0, time.perf_counter() - t1)
        assert plane.poll() == []  # every write is held: none was waited for
        os.kill(peer.proc.pid, signal.SIGCONT)
        got = collect(plane, 8)
        assert all(c.ok for c in got), got
        assert [c.xfer_id for c in got] == [(k, i) for i in range(4) for k in ("big", "small")]
        # timing: a submit takes microseconds; blocking would mean waiting for the held write
        assert worst < 1.0, f"submit took {worst * 1e3:.1f} ms"
    finally:
        peer.kill()


@needs_mooncake
def test_mooncake_dead_peer_fails_fast(mc_sender: tuple) -> None:
    plane, src = mc_sender
    peer = Peer(size=1 << 20)
    try:
        plane.connect(peer.session)
        plane.submit("alive", peer.session, [(src.ctypes.data, peer.addr, 4096)])
        [c] = collect(plane, 1, timeout=30)
        assert c.ok, c.reason
        peer.kill()
        t0 = time.monotonic()
        plane.submit("dead", peer.session, [(src.ctypes.data, peer.addr, 1 << 20)])
        [c] = collect(plane, 1, timeout=20)
        elapsed = time.monotonic() - t0
        assert not c.ok and "returned -1" in c.reason and peer.session in c.reason
        # timing: a dead peer is reported at once (refused connection), not after Mooncake's
        # 30 s transfer timeout
        assert elapsed < 10, f"dead peer took {elapsed:.1f}s to report"
    finally:
        peer.kill()


@needs_mooncake
def test_mooncake_connect_to_closed_port_fails(mc_sender: tuple) -> None:
    plane, src = mc_sender
    import socket

    with socket.socket() as s:  # a port that nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ghost = f"127.0.0.1:{port}"
    plane.connect(ghost)
    plane.submit("ghost", ghost, [(src.ctypes.data, 1 << 20, 16)])
    [c] = collect(plane, 1, timeout=20)
    assert not c.ok and ghost in c.reason
    assert plane.is_connected(ghost) is False


@needs_mooncake
def test_mooncake_entry_across_two_remote_registrations(mc_sender: tuple) -> None:
    plane, src = mc_sender
    peer = Peer(size=1 << 20, split=True)
    try:
        half = peer.size // 2
        block = 4096
        # Contiguous on both sides across the peer's two registrations: coalescing would merge.
        entries = [
            (src.ctypes.data + k * block, peer.addr + half - 2 * block + k * block, block)
            for k in range(4)
        ]
        before = plane.stats()["uncoalesced_retries"]
        plane.submit("span", peer.session, entries)
        [c] = collect(plane, 1, timeout=30)
        assert c.ok, c.reason
        assert plane.stats()["uncoalesced_retries"] - before == 1
        assert peer.sha(half - 2 * block, 4 * block) == sha(src[: 4 * block])
        plane.hint_remote_regions(peer.session, [(peer.addr, half), (peer.addr + half, half)])
        plane.submit("span-hinted", peer.session, entries)
        [c] = collect(plane, 1, timeout=30)
        assert c.ok, c.reason
        assert plane.stats()["uncoalesced_retries"] - before == 1
    finally:
        peer.kill()


@needs_mooncake
def test_mooncake_close_reports_every_transfer(mc_sender: tuple, mc_peer: Peer) -> None:
    sender, src = mc_sender
    plane = MooncakeDataPlane("127.0.0.1", wait=sender.wait)
    # spin mode sends one 4 MiB write at a time: with 200 queued, some are still queued at the
    # close however fast the link or however late this thread runs again (those fail at once)
    n = 200 if plane.wait == "spin" else 20
    try:
        plane.register_memory(src.ctypes.data, src.nbytes)
        for i in range(n):
            plane.submit(i, mc_peer.session, [(src.ctypes.data, mc_peer.addr, 4 << 20)])
        time.sleep(0.01)
    finally:
        plane.close()
    got = plane.poll()
    assert sorted(c.xfer_id for c in got) == list(range(n))
    assert all(c.ok or "closed" in c.reason for c in got), got
    if plane.wait == "spin":  # poll mode hands all 20 to Mooncake at once: they finish ok
        assert any("closed" in c.reason for c in got)
    plane.submit("late", mc_peer.session, [(src.ctypes.data, mc_peer.addr, 16)])
    assert plane.poll() == [Completion("late", False, "closed", 16)]


@needs_mooncake
def test_mooncake_write_queued_behind_a_frozen_peer_fails_unsent(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Poll mode with a one-entry window: the second write waits behind the first, which a
    frozen peer holds until its timeout; by then the second's deadline has passed, so it never
    reaches Mooncake (a clean failure), while the first is in doubt. Poll mode only: spin
    mode's queue is the base plane's, tested in-process."""
    src = np.random.default_rng(4).integers(0, 256, 1 << 16, dtype=np.uint8)
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "30")  # the plane sets 5; restored after the test
    plane = MooncakeDataPlane("127.0.0.1", timeout_s=1.0, wait="poll", max_batch_entries=1)
    frozen = Peer(size=1 << 20)
    try:
        plane.register_memory(src.ctypes.data, src.nbytes)
        plane.connect(frozen.session)
        plane.submit("warm", frozen.session, [(src.ctypes.data, frozen.addr, 64)])
        assert all(c.ok for c in collect(plane, 1))
        freeze_process(frozen.proc.pid)
        plane.submit("stuck", frozen.session, [(src.ctypes.data, frozen.addr, 4096)])
        plane.submit("queued", frozen.session, [(src.ctypes.data, frozen.addr + 8192, 4096)],
                     within_s=0.3)
        got = {c.xfer_id: c for c in collect(plane, 2, timeout=30)}
        assert not got["stuck"].ok and got["stuck"].in_doubt, got
        queued = got["queued"]
        assert not queued.ok and not queued.in_doubt and "nothing was sent" in queued.reason
    finally:
        frozen.kill()
        plane.close()


@needs_mooncake
def test_mooncake_frozen_peer_stalls_only_its_own_queue(
    mc_sender: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    sender, src = mc_sender
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "30")  # the plane sets 5; restored after the test
    timeout = 5.0 if sender.wait == "spin" else 3.0  # Mooncake's own minimum is 5 s
    plane = MooncakeDataPlane("127.0.0.1", timeout_s=timeout, wait=sender.wait)
    frozen, healthy = Peer(size=1 << 20), Peer(size=1 << 20)
    try:
        plane.register_memory(src.ctypes.data, src.nbytes)
        for peer in (frozen, healthy):
            plane.connect(peer.session)
            plane.submit(("warm", peer.session), peer.session, [(src.ctypes.data, peer.addr, 64)])
        assert all(c.ok for c in collect(plane, 2))
        freeze_process(frozen.proc.pid)  # alive socket, no answers
        t0 = time.monotonic()
        plane.submit("stuck", frozen.session, [(src.ctypes.data, frozen.addr, 1 << 20)])
        time.sleep(0.1)  # "stuck" reaches Mooncake (if it did not yet, the test still holds)
        t1 = time.monotonic()
        plane.submit("fine", healthy.session, [(src.ctypes.data, healthy.addr, 1 << 20)])
        [c] = collect(plane, 1, timeout=30)
        fine_s = time.monotonic() - t1
        # not queued behind the frozen peer: it completes before "stuck"'s timeout
        assert c.xfer_id == "fine" and c.ok, c
        assert fine_s < timeout - 0.5, f"healthy write took {fine_s:.2f}s"  # timing: as above
        [c] = collect(plane, 1, timeout=30)
        stuck_s = time.monotonic() - t0
        assert c.xfer_id == "stuck" and not c.ok and frozen.session in c.reason, c
        assert stuck_s >= timeout - 0.2, f"reported after {stuck_s:.2f}s, before the deadline: {c}"
        if sender.wait == "poll":
            assert "timeout" in c.reason
    finally:
        frozen.kill()
        healthy.kill()
        plane.close()
