"""The NIXL data plane between two processes over loopback TCP (UCX_TLS=tcp): bytes land
exactly, every transfer is reported once, failures are bounded and say why, bad input is
refused, submit never blocks. Skipped where NIXL is not installed (pip install '.[nixl]')."""

from __future__ import annotations

import hashlib
import json
import math
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from lw.transport.dataplane import Completion, DataPlane, Entry
from lw.transport.dataplane.nixl import nixl_missing

pytestmark = pytest.mark.skipif(bool(nixl_missing()), reason=nixl_missing() or "")

HERE = Path(__file__).resolve().parent
UCX_ENV = {"UCX_TLS": "tcp"}  # loopback TCP, as across hosts (not shared memory)


def collect(plane: DataPlane, n: int, timeout: float = 30.0) -> list[Completion]:
    """Wait on fileno until ``n`` completions arrived (AssertionError after ``timeout``)."""
    out: list[Completion] = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"only {len(out)} of {n} completions after {timeout}s: {out}")
        select.select([plane.fileno()], [], [], remaining)
        out.extend(plane.poll())
    return out


def sha(a: np.ndarray) -> str:
    """sha256 of an array's bytes."""
    return hashlib.sha256(a.tobytes()).hexdigest()


class Peer:
    """A dp_peer.py subprocess (``--plane nixl``): a NIXL agent with a registered buffer in
    another process."""

    def __init__(self, size: int = 16 << 20, split: bool = False,
                 host: str = "127.0.0.1", wrap: Callable[[list[str]], list[str]] = list,
                 env: dict[str, str] | None = None) -> None:
        args = wrap([sys.executable, str(HERE / "dp_peer.py"), "--plane", "nixl",
                     "--size", str(size), "--host", host] + (["--split"] if split else []))
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True,
                                     env={**os.environ, **UCX_ENV, **(env or {})})
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
        """Send one command line and return the one-line answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def sha(self, offset: int, length: int) -> str:
        """sha256 of the peer's buffer slice."""
        return self.ask(f"sha {offset} {length}")

    def kill(self) -> None:
        """Kill the process (resuming it first if frozen) and reap it."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)


def freeze(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it is stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = {stat.read_text().rsplit(")", 1)[1].split()[0]
                  for stat in Path(f"/proc/{pid}/task").glob("*/stat")}
        if states <= {"T", "t"}:
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop")


def make_plane(**kw: object) -> DataPlane:
    """A NixlDataPlane on loopback over UCX's TCP transport."""
    from lw.transport.dataplane.nixl import NixlDataPlane

    return NixlDataPlane("127.0.0.1", env=UCX_ENV, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def src() -> np.ndarray:
    """16 MiB of random source bytes."""
    return np.random.default_rng(2).integers(0, 256, 16 << 20, dtype=np.uint8)


@pytest.fixture(scope="module")
def sender(src: np.ndarray) -> Iterator[DataPlane]:
    """One plane with ``src`` registered, shared by the tests (UCX_TLS restored after)."""
    saved = os.environ.get("UCX_TLS")
    plane = make_plane()
    plane.register_memory(src.ctypes.data, src.nbytes)
    try:
        yield plane
    finally:
        plane.close()
        if saved is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = saved


@pytest.fixture(scope="module")
def peer(sender: DataPlane) -> Iterator[Peer]:
    """A live peer process shared by the tests."""
    p = Peer()
    try:
        yield p
    finally:
        p.kill()


def scattered(src: np.ndarray, dst: int, block: int, n: int, seed: int) -> tuple[list[Entry],
                                                                                  np.ndarray]:
    """``n`` blocks of ``src`` to permuted places at ``dst``, and the bytes expected there."""
    perm = np.random.default_rng(seed).permutation(n)
    entries = [(src.ctypes.data + i * block, dst + int(p) * block, block)
               for i, p in enumerate(perm)]
    expected = np.empty(n * block, dtype=np.uint8)
    expected.reshape(n, block)[perm] = src[: n * block].reshape(n, block)
    return entries, expected


def test_a_nixl_plane_is_a_dataplane_and_its_session_names_its_listener(
        sender: DataPlane) -> None:
    from lw.transport.dataplane.nixl import parse_session

    assert isinstance(sender, DataPlane)
    name, host, port = parse_session(sender.session)
    assert host == "127.0.0.1" and port == sender.listen_port  # type: ignore[attr-defined]
    assert name == sender.agent.name  # type: ignore[attr-defined]
    assert sender.can_fence is False  # type: ignore[attr-defined]  # lease-only


def test_scattered_bytes_land_exactly(sender: DataPlane, peer: Peer, src: np.ndarray) -> None:
    peer.ask("zero")
    sender.connect(peer.session)
    entries, expected = scattered(src, peer.addr, 16 << 10, 1024, seed=3)  # 16 MiB
    sender.submit("blocks", peer.session, entries)
    [c] = collect(sender, 1)
    assert c == Completion("blocks", True, "", src.nbytes)
    assert sender.is_connected(peer.session) is True  # type: ignore[attr-defined]
    assert peer.sha(0, src.nbytes) == sha(expected)


def test_many_transfers_each_reported_once_in_order(
        sender: DataPlane, peer: Peer, src: np.ndarray) -> None:
    """32 layers of 64 scattered 4 KiB blocks, submitted back to back, plus one of 3,000
    entries (more than one request's worth): every id once, in submission order, bytes exact."""
    peer.ask("zero")
    block, per_layer, layers = 4096, 64, 32
    entries, expected = scattered(src, peer.addr, block, per_layer * layers, seed=4)
    before = sender.stats()
    for k in range(layers):
        sender.submit(("layer", k), peer.session, entries[k * per_layer:(k + 1) * per_layer])
    many = [(src.ctypes.data + i * 1024, peer.addr + (8 << 20) + 2 * i * 1024, 1024)
            for i in range(3000)]
    sender.submit("many", peer.session, many)
    got = collect(sender, layers + 1)
    assert [c.xfer_id for c in got] == [("layer", k) for k in range(layers)] + ["many"]
    assert all(c.ok for c in got), [c for c in got if not c.ok]
    time.sleep(0.05)
    assert sender.poll() == []  # nothing reported twice
    after = sender.stats()
    assert after["pending"] == 0 and after["completed"] - before["completed"] == layers + 1
    assert after["batches"] - before["batches"] >= 3  # 3,000 entries: >= 3 requests of 1,024
    assert peer.sha(0, block * per_layer * layers) == sha(expected)
    want = np.zeros(2 * 3000 * 1024, dtype=np.uint8)
    want.reshape(3000, 2048)[:, :1024] = src[: 3000 * 1024].reshape(3000, 1024)
    assert peer.sha(8 << 20, want.nbytes) == sha(want)


def test_bad_input_is_refused_with_a_clear_error(
        sender: DataPlane, peer: Peer, src: np.ndarray) -> None:
    s = src.ctypes.data
    for bad in ([(s, peer.addr, 0)], [(s, peer.addr, -4)], [(0, peer.addr, 16)], [(s, 16)]):
        with pytest.raises(ValueError, match="entry 0"):
            sender.submit("bad", peer.session, bad)
    for session in ("127.0.0.1:1234", "name@host", "a@b:99999", ""):
        with pytest.raises(ValueError, match="not a NIXL session"):
            sender.submit("bad", session, [(s, peer.addr, 16)])
    with pytest.raises(ValueError, match="addr > 0 and length > 0"):
        sender.register_memory(s, 0)
    sender.submit("local", peer.session, [(s - 4096, peer.addr, 4096)])  # not registered here
    sender.submit("remote", peer.session, [(s, 4096, 4096)])  # not registered at the peer
    sender.submit("past", peer.session, [(s, peer.addr + peer.size - 16, 32)])  # runs off it
    got = {c.xfer_id: c for c in collect(sender, 3)}
    assert "outside memory registered with register_memory" in got["local"].reason
    for key in ("remote", "past"):
        assert "nixl refused the write" in got[key].reason and "NOT_FOUND" in got[key].reason
    assert not any(c.ok or c.in_doubt for c in got.values()), got  # nothing was sent


def test_unknown_sessions_fail_in_bounded_time(sender: DataPlane, src: np.ndarray) -> None:
    """No listener at the port: refused at once; a listener that is not NIXL (or an agent of
    another name): no metadata within the connect timeout. Neither is in doubt."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        ghost = f"lw-ghost@127.0.0.1:{s.getsockname()[1]}"
    with socket.create_server(("127.0.0.1", 0)) as mute:
        wrong = f"lw-nobody@127.0.0.1:{mute.getsockname()[1]}"
        sender.connect_timeout_s = 0.5  # type: ignore[attr-defined]
        try:
            t0 = time.monotonic()
            sender.submit("ghost", ghost, [(src.ctypes.data, 1 << 20, 16)])
            sender.submit("wrong", wrong, [(src.ctypes.data, 1 << 20, 16)])
            got = {c.xfer_id: (c, time.monotonic() - t0) for c in collect(sender, 2)}
        finally:
            sender.connect_timeout_s = 5.0  # type: ignore[attr-defined]
    c, dt = got["ghost"]
    assert not c.ok and not c.in_doubt and "no NIXL agent listens" in c.reason, c
    assert dt < 2, f"{dt:.2f}s"  # timing: a refused connection is immediate
    c, dt = got["wrong"]
    assert not c.ok and not c.in_doubt and "no NIXL metadata of agent lw-nobody" in c.reason, c
    assert "the listener answered" in c.reason, c
    assert dt < 3, f"{dt:.2f}s"  # timing: the 0.5 s connect timeout, not a hang
    assert sender.is_connected(ghost) is False  # type: ignore[attr-defined]


def test_entry_across_two_remote_registrations(sender: DataPlane, src: np.ndarray) -> None:
    p = Peer(size=1 << 20, split=True)
    try:
        half, block = p.size // 2, 4096
        entries = [(src.ctypes.data + k * block, p.addr + half - 2 * block + k * block, block)
                   for k in range(4)]  # contiguous on both sides across the two registrations
        before = sender.stats()["uncoalesced_retries"]
        sender.submit("span", p.session, entries)
        [c] = collect(sender, 1)
        assert c.ok, c.reason
        assert sender.stats()["uncoalesced_retries"] - before == 1
        assert p.sha(half - 2 * block, 4 * block) == sha(src[: 4 * block])
        sender.hint_remote_regions(p.session, [(p.addr, half), (p.addr + half, half)])  # type: ignore[attr-defined]
        sender.submit("hinted", p.session, entries)
        [c] = collect(sender, 1)
        assert c.ok and sender.stats()["uncoalesced_retries"] - before == 1, c
    finally:
        p.kill()


def test_dead_peer_fails_fast_with_its_session(sender: DataPlane, src: np.ndarray) -> None:
    p = Peer(size=1 << 20)
    try:
        sender.submit("alive", p.session, [(src.ctypes.data, p.addr, 4096)])
        [c] = collect(sender, 1)
        assert c.ok, c.reason
        p.kill()
        t0 = time.monotonic()
        sender.submit("dead", p.session, [(src.ctypes.data, p.addr, 1 << 20)])
        [c] = collect(sender, 1, timeout=20)
        assert not c.ok and p.session in c.reason, c
        assert time.monotonic() - t0 < 5  # timing: a reset connection, not a timeout
    finally:
        p.kill()


def test_submit_never_blocks_and_a_frozen_peer_stalls_only_its_queue(src: np.ndarray) -> None:
    """A frozen peer holds writes inside UCX: submitting more returns at once; a healthy
    peer's writes go on meanwhile; the held write fails at the plane's timeout, in doubt; one
    queued behind it past its deadline fails unsent; resumed, the peer takes new writes."""
    plane = make_plane(timeout_s=1.5, max_batch_entries=1)
    frozen, healthy = Peer(size=src.nbytes), Peer(size=1 << 20)
    try:
        plane.register_memory(src.ctypes.data, src.nbytes)
        for p in (frozen, healthy):
            plane.submit(("warm", p.session), p.session, [(src.ctypes.data, p.addr, 64)])
        assert all(c.ok for c in collect(plane, 2))
        freeze(frozen.proc.pid)
        worst = 0.0
        t0 = time.monotonic()
        for i in range(3):  # 16 MiB each: far more than the sockets' buffers hold
            t = time.perf_counter()
            plane.submit(("big", i), frozen.session, [(src.ctypes.data, frozen.addr, src.nbytes)],
                         within_s=0.5 if i else math.inf)
            worst = max(worst, time.perf_counter() - t)
        assert worst < 0.05, f"submit took {worst * 1e3:.1f} ms"  # timing: no wait on the peer
        assert plane.poll() == []
        t1 = time.monotonic()
        plane.submit("fine", healthy.session, [(src.ctypes.data, healthy.addr, 1 << 20)])
        [c] = collect(plane, 1)
        assert c.xfer_id == "fine" and c.ok and time.monotonic() - t1 < 1.0, c
        got = collect(plane, 3)
        stuck = got[0]
        assert stuck.xfer_id == ("big", 0) and not stuck.ok and stuck.in_doubt, stuck
        assert "timeout" in stuck.reason and time.monotonic() - t0 >= 1.4
        for c in got[1:]:  # queued behind it (one entry in flight) until past their deadline
            assert not c.ok and not c.in_doubt and "nothing was sent" in c.reason, c
        os.kill(frozen.proc.pid, signal.SIGCONT)
        plane.submit("after", frozen.session, [(src.ctypes.data, frozen.addr, 4096)])
        [c] = collect(plane, 1)
        assert c.xfer_id == "after" and c.ok, c
    finally:
        frozen.kill()
        healthy.kill()
        plane.close()


def test_close_reports_every_transfer(src: np.ndarray, peer: Peer) -> None:
    plane = make_plane()
    try:
        plane.register_memory(src.ctypes.data, src.nbytes)
        for i in range(20):
            plane.submit(i, peer.session, [(src.ctypes.data, peer.addr, 4 << 20)])
    finally:
        plane.close()
    got = plane.poll()
    assert sorted(c.xfer_id for c in got) == list(range(20))
    assert all(c.ok or c.reason.startswith("closed") for c in got), got
    plane.submit("late", peer.session, [(src.ctypes.data, peer.addr, 16)])
    assert plane.poll() == [Completion("late", False, "closed", 16)]


@pytest.mark.slow
def test_a_completed_write_has_landed_behind_a_capped_link() -> None:
    """What lw's DONE rests on, as for Mooncake (test_landed_at_completion.py): a write NIXL
    reported complete is in the receiver's memory, also behind a 200 Mbit/s tbf cap where the
    sender's socket buffers could still hold megabytes. The peer's UCX is held to the veth
    (UCX_NET_DEVICES). This process's UCX listed its devices before the veth existed and binds
    another interface's address: the namespace's default route brings the replies back."""
    from benchmarks._link import Link, missing_requirements
    from lw.transport.dataplane.nixl import NixlDataPlane

    if missing_requirements():
        pytest.skip(f"link: {missing_requirements()}")
    size, step = 8 << 20, 1 << 20
    with Link.create(200e6) as link:
        subprocess.run(["ip", "-n", link.ns, "route", "replace", "default", "via",
                        link.root_addr], check=True)
        p = Peer(size, host=link.ns_addr, wrap=link.wrap, env={"UCX_NET_DEVICES": link.ns_dev})
        plane = NixlDataPlane(link.root_addr, env=UCX_ENV)
        try:
            data = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
            plane.register_memory(data.ctypes.data, size)
            tx = Path(f"/sys/class/net/{link.root_dev}/statistics/tx_bytes")
            sent_before = int(tx.read_text())
            t0 = time.monotonic()
            plane.submit(1, p.session, [(data.ctypes.data + o, p.addr + o, step)
                                        for o in range(0, size, step)])
            [c] = collect(plane, 1)
            assert c.ok, c.reason
            assert int(tx.read_text()) - sent_before >= size  # through the capped veth
            assert time.monotonic() - t0 > 0.8 * size * 8 / 200e6  # timing: at the cap's rate
            # asked at once: the last megabyte would still be on the wire (40 ms of it)
            assert p.sha(size - step, step) == sha(data[-step:])
            assert p.sha(0, size) == sha(data)
        finally:
            plane.close()
            p.kill()


@pytest.mark.parametrize("kw", [{"window_span_s": -0.001}, {"window_span_s": float("nan")},
                                {"window_span_after_s": -1.0}])
def test_a_window_span_that_is_not_a_duration_is_refused(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="window_span_s and window_span_after_s must be >= 0"):
        make_plane(**kw)


def lands_32_layers(plane: DataPlane, peer: Peer, src: np.ndarray, seed: int) -> None:
    """32 layers of 64 scattered 4 KiB blocks through ``plane`` (``src`` registered): each
    reported once, in submission order, the bytes exact at ``peer``."""
    peer.ask("zero")
    block, per_layer, layers = 4096, 64, 32
    entries, expected = scattered(src, peer.addr, block, per_layer * layers, seed=seed)
    for k in range(layers):
        plane.submit(("layer", k), peer.session, entries[k * per_layer:(k + 1) * per_layer])
    got = collect(plane, layers)
    assert [c.xfer_id for c in got] == [("layer", k) for k in range(layers)]
    assert all(c.ok for c in got), [c for c in got if not c.ok]
    assert peer.sha(0, block * per_layer * layers) == sha(expected)


def test_a_span_that_always_binds_still_lands_every_byte_in_order(
        peer: Peer, src: np.ndarray) -> None:
    """The sender's window held to a millisecond of the link from the first rate sample on
    (issue 59's bound on what queues ahead of P's token; off by default on NIXL): 32 layers of
    scattered blocks still land exactly, each reported once, in submission order."""
    plane = make_plane(window_span_s=0.001, window_span_after_s=0.0)
    plane.register_memory(src.ctypes.data, src.nbytes)
    try:
        lands_32_layers(plane, peer, src, seed=7)
    finally:
        plane.close()


def test_a_writer_without_a_progress_thread_lands_every_byte_and_after_idling(
        peer: Peer, src: np.ndarray) -> None:
    """A plane without UCX's progress thread (its sender's polls progress UCX; measured for P,
    not used: see the module docstring): 32 layers land exactly, in order, and a write after
    an idle spell still completes."""
    plane = make_plane(progress_thread=False)
    plane.register_memory(src.ctypes.data, src.nbytes)
    try:
        lands_32_layers(plane, peer, src, seed=9)
        time.sleep(1.5)  # nothing progresses UCX meanwhile
        tail = (src.ctypes.data, peer.addr + (8 << 20), 1 << 20)
        plane.submit("after-idle", peer.session, [tail])
        [c] = collect(plane, 1, timeout=10.0)
        assert c.ok, c.reason
        assert peer.sha(8 << 20, 1 << 20) == sha(src[: 1 << 20])
    finally:
        plane.close()
