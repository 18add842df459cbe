"""A side channel's connection to each peer tells a process that lives (however slow: stopped,
starved) from one that is gone, without a connection of its own; and the core's verdict on a
silence reads what it shows."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from lw.fsm.silence import (
    ALIVE,
    GONE,
    PENDING,
    UNKNOWN,
    Silence,
    fixed_budget_loses,
    silence_loses,
)
from lw.transport.sidechannel import SideChannel
from lw.transport.wire import PROTOCOL_VERSION, Heartbeat, Sender

# A peer process with a side channel of its own, which prints its address and serves until
# killed (its loop answers nothing: only the kernel and ZMQ's I/O thread act for it).
_PEER = """
import sys, time
from lw.lab.synthetic import netns
from lw.transport.sidechannel import SideChannel
if len(sys.argv) > 1:  # behind a partition: inside the decoder's namespace
    netns.enter(sys.argv[1])
side = SideChannel(*sys.argv[2:3])
print(side.addr, flush=True)
while True:
    side.poll(100)
"""


def _until(side: SideChannel, dest: str, want: str, within: float = 10.0) -> str:
    t0 = time.monotonic()
    shown = side.link_evidence(dest)
    while shown != want and time.monotonic() - t0 < within:
        side.poll(50)
        shown = side.link_evidence(dest)
    return shown


def _peer(*where: str) -> tuple[subprocess.Popen[str], str]:
    """A peer process; ``where``: the namespace it enters and the address it binds there."""
    proc = subprocess.Popen([sys.executable, "-c", _PEER, *where], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def _hello(side: SideChannel, dest: str) -> None:
    assert side.send(dest, Heartbeat(PROTOCOL_VERSION, Sender("P", 0, 1, side.addr)))


@pytest.fixture
def side() -> SideChannel:
    s = SideChannel(host_timeout_s=2.0)  # a host that stops answering: down within 2 s
    yield s
    s.close()


def test_a_peer_never_sent_to_is_unknown(side: SideChannel) -> None:
    assert side.link_evidence("tcp://127.0.0.1:1") == UNKNOWN


def test_a_stopped_peer_stays_alive_and_a_killed_one_is_gone(side: SideChannel) -> None:
    proc, addr = _peer()
    try:
        _hello(side, addr)
        assert _until(side, addr, ALIVE) == ALIVE
        proc.send_signal(signal.SIGSTOP)  # frozen: its kernel still answers for it, past
        deadline = time.monotonic() + 4.0  # the host timeout, with what was sent unread
        while time.monotonic() < deadline:
            _hello(side, addr)
            side.poll(50)
            assert side.link_evidence(addr) == ALIVE
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()
        assert _until(side, addr, GONE) == GONE  # reset, then refused: no process there
    finally:
        proc.kill()
        proc.wait()


def _netns_missing() -> str:
    from lw.lab.synthetic.netns import unavailable

    return unavailable()


@pytest.mark.skipif(bool(_netns_missing()), reason=f"no network namespaces: {_netns_missing()}")
@pytest.mark.parametrize("busy", [False, True], ids=["idle", "sending"])
def test_a_host_cut_off_is_gone_within_the_host_timeout(side: SideChannel, busy: bool) -> None:
    """The peer behind a veth pair whose link is cut: no reset, no refusal, only silence. The
    kernel gives the connection up (keepalive while idle, TCP_MAXRT while data is unacked)."""
    from lw.lab.synthetic.netns import Partition

    with Partition() as net:
        proc, addr = _peer(net.name, net.ns_ip)
        try:
            _hello(side, addr)
            assert _until(side, addr, ALIVE) == ALIVE
            net.partition()
            t0 = time.monotonic()
            shown = side.link_evidence(addr)
            while shown != GONE and time.monotonic() - t0 < 10.0:
                if busy:
                    _hello(side, addr)
                side.poll(50)
                shown = side.link_evidence(addr)
            assert shown == GONE
            # 2 s of host timeout, answer_s, and a keepalive probe's second of slack
            assert time.monotonic() - t0 < 2.0 + side.links.answer_s + 1.5
        finally:
            proc.kill()
            proc.wait()


def test_a_port_nobody_holds_is_gone_once_the_answer_time_passed(side: SideChannel) -> None:
    proc, addr = _peer()
    proc.kill()
    proc.wait()
    _hello(side, addr)
    assert side.link_evidence(addr) == PENDING  # connecting: not yet an answer
    assert _until(side, addr, GONE) == GONE


def test_closing_a_side_channel_with_connections_followed_does_not_hang() -> None:
    proc, addr = _peer()
    try:
        s = SideChannel()
        _hello(s, addr)
        _until(s, addr, ALIVE)
        s.forget_peer(addr)
        assert s.link_evidence(addr) == UNKNOWN
        _hello(s, addr)
        t0 = time.monotonic()
        s.close()
        assert time.monotonic() - t0 < 2.0
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(("quiet", "process", "lw_loses", "fixed_loses"), [
    (1.0, GONE, False, False),  # within the budget: waited for, whatever shows
    (3.0, ALIVE, False, True),  # slow, not dead: kept (a fixed budget loses it)
    (3.0, PENDING, False, True),  # the connection's answer is waited for
    (3.0, GONE, True, True),
    (3.0, UNKNOWN, True, True),  # nothing to go on: the budget decides, as before
    (31.0, ALIVE, True, True),  # past the cap: a wedged process is found too
])
def test_the_verdict_on_a_silence(quiet: float, process: str, lw_loses: bool,
                                  fixed_loses: bool) -> None:
    s = Silence(quiet, budget_s=1.5, cap_s=30.0, process=process)
    verdicts: list[Callable[[Silence], bool]] = [silence_loses, fixed_budget_loses]
    assert [v(s) for v in verdicts] == [lw_loses, fixed_loses]


def test_unknown_evidence_is_refused() -> None:
    with pytest.raises(ValueError, match="process evidence"):
        Silence(1.0, 1.0, 2.0, "maybe")


def test_a_connection_made_before_its_monitor_is_never_reported() -> None:
    """Why the side channel follows a DEALER before it connects."""
    import zmq

    from lw.transport.links import Links

    proc, addr = _peer()
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(addr)
        time.sleep(0.3)  # connected by now
        links = Links(answer_s=0.2)
        links.watch(addr, dealer)
        time.sleep(0.5)
        assert links.evidence(addr) == GONE  # a live peer read as gone
        links.unwatch(addr)
        dealer.close(0)
    finally:
        ctx.term()
        proc.kill()
        proc.wait()


def test_the_side_channel_follows_each_dealer_before_it_connects(
        side: SideChannel, monkeypatch: pytest.MonkeyPatch) -> None:
    import zmq

    seen: list[bytes] = []
    watch = side.links.watch

    def spy(dest: str, dealer: zmq.Socket) -> zmq.Socket:
        seen.append(dealer.getsockopt(zmq.LAST_ENDPOINT))  # empty until connect() was called
        return watch(dest, dealer)

    monkeypatch.setattr(side.links, "watch", spy)
    proc, addr = _peer()
    try:
        _hello(side, addr)
        assert seen == [b""]
        assert _until(side, addr, ALIVE) == ALIVE
    finally:
        proc.kill()
        proc.wait()


def test_every_fresh_connection_to_a_live_peer_shows_alive(side: SideChannel) -> None:
    """The monitor is attached before the DEALER connects: a connection made before it would
    never be reported, and a live peer would read as gone (seen: a live D lost on a loaded
    2-core run, 'our connection to it is down')."""
    proc, addr = _peer()
    try:
        shown = []
        for _ in range(20):
            side.forget_peer(addr)
            _hello(side, addr)
            time.sleep(0.05)  # the connection completes before anyone looks
            shown.append(_until(side, addr, ALIVE, within=2.0))
        assert shown == [ALIVE] * 20
    finally:
        proc.kill()
        proc.wait()
