"""The event loop of one worker: runs a sans-I/O endpoint on the side channel and the data plane.

A :class:`WorkerLoop` owns one endpoint (a P rank's :class:`~lw.fsm.PrefillEndpoint` or a D
worker's :class:`~lw.fsm.DecodeEndpoint`), its :class:`~lw.transport.sidechannel.SideChannel`, its
data plane and its timers, all on one thread. Engine threads talk to it only through non-blocking
entry points (:meth:`WorkerLoop.layer_computed`, :meth:`WorkerLoop.call`,
:meth:`WorkerLoop.drain_reports`, :meth:`WorkerLoop.stats`): they append to a queue and, at most
once per loop turn, write one byte to a pipe. Nothing an engine thread calls waits on the network,
on the data plane or on the loop (:mod:`lw.transport.inbox`).

The core's effects are performed by the one interpreter every driver uses
(:func:`lw.fsm.interpreter.perform`) through this loop's ports: ``Send`` goes to the side channel
(answers travel back on the connection the question came in on), ``WriteLayer`` becomes one
data-plane transfer per destination session (:class:`~lw.transport.writepath.WritePath`),
timers go to :class:`~lw.transport.timers.Timers`, reports to the engine. A message from the
network that the core refuses (``ProtocolError``) is counted, dropped and warned about (rate-
limited: :mod:`lw.transport.ratelog`); no message can stop the loop. ``lw status``
queries are answered after the rest of a turn, within a budget (:mod:`lw.transport.statusdesk`);
heartbeat rounds and silent peers are :mod:`lw.transport.peerwatch`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from lw.fsm import (
    DecodeEndpoint,
    Effect,
    PrefillEndpoint,
    ProtocolError,
    Send,
    SendFinished,
    WriteLayer,
)
from lw.fsm.effects import FenceData, KeptSums
from lw.fsm.interpreter import Report, perform
from lw.fsm.lifecycles import DONE, FAILED
from lw.fsm.messages import FirstTokenStatus
from lw.fsm.status import status_line
from lw.transport import statusdesk
from lw.transport.inbox import CALL, FN, LAYER, Inbox
from lw.transport.kvmemory import Entry, KVMemory
from lw.transport.linkmeter import host_of
from lw.transport.loopconfig import LoopConfig
from lw.transport.loopports import LoopPorts
from lw.transport.osthread import name_os_thread
from lw.transport.peerwatch import PeerWatch
from lw.transport.ratelog import RateLog, peer_of
from lw.transport.reports import ReportQueue
from lw.transport.sidechannel import Inbound, SideChannel
from lw.transport.statusreply import status_reply
from lw.transport.timers import Timers
from lw.transport.wire import (
    PROTOCOL_VERSION,
    DoneSending,
    Heartbeat,
    HeartbeatAck,
    LayerLayout,
    MetaReply,
    Sender,
    StatusQuery,
    StatusReply,
)
from lw.transport.writepath import WritePath

__all__ = ["LoopConfig", "WorkerLoop"]

log = logging.getLogger("lw.runtime")


_CALLS = frozenset({"add_request", "add_chunk", "abort", "peer_lost", "prefill_routed",
                    "data_fenced", "add_ahead", "bind", "first_token"})

_DEFAULT_CONFIG = LoopConfig()
"""The settings of a loop given none (tests, benchmarks)."""

_COUNTERS = ("turns", "layer_events", "calls", "messages", "protocol_errors", "core_errors",
    "effect_errors", "call_errors", "timers_fired", "transfers_submitted", "transfers_ok",
    "transfers_failed", "layer_writes", "write_setup_failures", "bytes_ok", "connects",
    "inbox_overflow", "reports", "status_queries", "status_refused", "status_dropped",
    "stuck_requests", "checksums_verified",
    "heartbeats_sent", "peers_lost", "self_stalls", "fences")
"""The loop's monotonic counters (``stats()`` prefixes them ``loop.``)."""


class WorkerLoop:
    """One worker's protocol thread: endpoint + side channel + data plane + timers.

    ``config`` holds the loop's settings (:class:`~lw.transport.loopconfig.LoopConfig`, checked
    when it was built). ``local_layout`` (P only) gives, per layer, where this worker's KV blocks
    live in memory registered with ``data_plane``; ``entries_for`` may replace the address
    computation (a ``WriteLayer`` -> ``[(src, dst, len)]`` function). ``on_report`` is called on
    the loop thread for every report, in addition to queueing it for :meth:`drain_reports`.
    ``fresh_blocks`` (D, ``retry_fresh_blocks``) allocates blocks for a request's next claim
    epoch, on the loop thread (``(req_id, count)`` -> block ids, or None to refuse); without it
    every such question is refused. The loop owns (and closes) its side channel and data plane.
    """

    def __init__(
        self,
        endpoint: PrefillEndpoint | DecodeEndpoint,
        side: SideChannel,
        data_plane: Any | None = None,
        config: LoopConfig = _DEFAULT_CONFIG,
        *,
        local_layout: Sequence[LayerLayout] | None = None,
        entries_for: Callable[[WriteLayer], list[Entry]] | None = None,
        on_report: Callable[[Effect], None] | None = None,
        fresh_blocks: Callable[[str, int], Sequence[int] | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.endpoint = endpoint
        self.is_prefill = isinstance(endpoint, PrefillEndpoint)
        self.role = "prefill" if self.is_prefill else "decode"
        self.side = side
        self.data_plane = data_plane
        self.config = config
        self.memory = KVMemory(local_layout, entries_for)
        self._on_report = on_report
        self._fresh_blocks = fresh_blocks
        self._clock = clock
        self._name = config.name
        local = self.memory.local
        if self.is_prefill and entries_for is None:
            if local is None:
                raise ValueError("a prefill WorkerLoop needs local_layout (or entries_for)")
            if len(local) != endpoint.num_layers:
                raise ValueError(f"local_layout has {len(local)} layers, endpoint has "
                                 f"{endpoint.num_layers}")
        self._num_layers = endpoint.num_layers if self.is_prefill else 0
        if (not self.is_prefill and endpoint.config.fence_data
                and not getattr(data_plane, "can_fence", False)):
            raise ValueError(
                f"{config.name}: DecodeConfig.fence_data needs a data plane that can fence "
                f"inbound transfers (Mooncake over TCP); {type(data_plane).__name__} cannot: "
                "turn fence_data off (then a lease's end frees blocks late bytes may still "
                "reach) or use one that can")
        # loop -> engine
        self.reports = ReportQueue()
        self.timers = Timers()
        # transfers
        self._last_layer_t: dict[str, float] = {}
        self._tails: deque[float] = deque(maxlen=config.tail_samples)
        self._rtts: deque[float] = deque(maxlen=config.tail_samples)
        self._stuck_check_s = config.stuck_check_s
        self._next_stuck_check = 0.0
        # Liveness of the peers our live requests need: a peer silent past its budget (no
        # message at all, heartbeats unanswered) goes to the core's verdict (peer_silent), with
        # what our connection to it shows.
        self.counters: dict[str, int | float] = dict.fromkeys(_COUNTERS, 0)
        self.counters["layer_event_s"] = 0.0
        self.liveness = config.liveness()
        self.peers = PeerWatch(config.name, self.liveness, endpoint, side, self.counters,
                               self.core_error, self._execute_now)
        self.stuck: deque[str] = deque(maxlen=1024)  # stuck-alarm lines, newest last
        # engine -> loop (hooks and calls; wake-ups and the polling policy)
        self.inbox = Inbox(config, self._num_layers, self.counters,
                           getattr(data_plane, "backlog_s", None))
        self.writes = WritePath(self.memory, self.counters)
        self.status_gate = statusdesk.StatusGate(config.status_share, config.status_burst_s,
                                                 config.status_per_route)
        # the engine's first-token mode and counts (its connector's scheduler keeps them; the
        # worker thread sets the latest, checked; status replies carry it)
        self.first_token: FirstTokenStatus | None = None
        self._refusals = RateLog(log, config.name, config.warn_interval_s, clock=self._clock)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.crashed: BaseException | None = None

    # ============================================================ engine-thread entry points
    def start(self) -> WorkerLoop:
        """Start the loop thread (the side channel already listens; peers may send at once)."""
        if self._thread is not None:
            raise RuntimeError("WorkerLoop already started")
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        return self

    @property
    def addr(self) -> str:
        """Side-channel address peers send to (give it to the proxy / put it in requests)."""
        return self.side.addr

    @property
    def me(self) -> Sender:
        """This worker's identity as the endpoint announces it."""
        return self.endpoint.me

    def layer_computed(self, layer: int, req_ids: Iterable[str], t: float | None = None) -> None:
        """Forward hook: ``layer`` is computed for ``req_ids`` (at ``t``, monotonic, if it is
        reported later than computed). O(batch) copy, never waits."""
        self.inbox.layer(layer, req_ids, t)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Future:
        """Run ``endpoint.<method>(*args, now, **kwargs)`` on the loop (add_request, add_chunk,
        abort, peer_lost).

        Returns a Future with the method's effects (or its exception); never waits.
        """
        if method not in _CALLS:
            raise ValueError(f"WorkerLoop.call: {method!r} is not one of {sorted(_CALLS)}")
        fut: Future = Future()
        self.inbox.put((CALL, method, (args, kwargs), fut))
        return fut

    def run(self, fn: Callable[[WorkerLoop], Any]) -> Future:
        """Run ``fn(loop)`` on the loop thread (inspection, tests); its result in a Future."""
        fut: Future = Future()
        self.inbox.put((FN, fn, None, fut))
        return fut

    def wait_reports(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until a report is there to drain (any thread; the engine's
        idle steps use it instead of spinning). True when one is."""
        return self.reports.wait(timeout)

    def drain_reports(self) -> list[Effect]:
        """Reports since the last call: SendFinished, RecvDone, RecvFailed, Quarantine,
        Reprefill, ReleaseBlocks, FirstTokenTaken."""
        return self.reports.drain()

    def stats(self) -> dict[str, Any]:
        """Counters of the loop, the core, the side channel and the data plane, plus the
        transfer tail (last layer's hook -> last write done) and side-channel round trips."""
        out: dict[str, Any] = {f"loop.{k}": v for k, v in self.counters.items()}
        out["loop.inbox"] = len(self.inbox)
        out["loop.timers"] = len(self.timers)
        out["loop.crashed"] = repr(self.crashed) if self.crashed else ""
        out["live_requests"] = len(self.endpoint.live_requests())
        for k, v in dict(self.endpoint.counters).items():
            out[f"core.{k}"] = v
        for k, v in self.side.stats().items():
            out[f"side.{k}"] = v
        if self.data_plane is not None:
            try:
                for k, v in self.data_plane.stats().items():
                    out[f"dp.{k}"] = v
            except Exception:  # a closed plane may refuse; stats are best effort
                pass
        for name, samples in (("tail", self._tails), ("rtt", self._rtts)):
            xs = sorted(samples)
            if xs:
                out[f"{name}_p50_s"] = xs[len(xs) // 2]
                out[f"{name}_p99_s"] = xs[min(len(xs) - 1, int(len(xs) * 0.99))]
                out[f"{name}_max_s"] = xs[-1]
        return out

    def tail_samples(self) -> list[float]:
        """Per request: seconds from the last layer's hook to its last write completing (P)."""
        return list(self._tails)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop thread and close what it owns (waits up to ``timeout``)."""
        self._stopping = True
        self.inbox.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        elif self._thread is None:
            self.inbox.finished = True
            self._close_owned()

    def __enter__(self) -> WorkerLoop:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ============================================================ loop thread
    def _run(self) -> None:
        name_os_thread()
        fds = [self.inbox.pipe.fd]
        dp_fd = -1
        if self.data_plane is not None:
            dp_fd = self.data_plane.fileno()
            fds.append(dp_fd)
        try:
            while not self._stopping:
                self.counters["turns"] += 1
                inbound, ready = self.side.poll(self._timeout_ms(), fds)
                self._turn(inbound, ready, dp_fd)
        except BaseException as exc:  # infrastructure failure (zmq); events never get here
            self.crashed = exc
            log.exception("%s crashed", self._name)
        finally:
            self.inbox.finished = True
            self.inbox.fail_all()
            self._close_owned()

    def _turn(self, inbound: list[Inbound], ready: set[int], dp_fd: int = -1) -> None:
        """One turn's work on what a poll returned; status queries last, after the protocol."""
        self.inbox.turn_started(ready)
        self._drain_inbox()
        queries = self._on_network(inbound)
        if dp_fd in ready:
            self._on_completions()
        self._fire_timers()
        if queries:  # diagnostics last: the protocol's messages and timers go first
            statusdesk.answer(self, queries)

    def _close_owned(self) -> None:
        try:
            self.side.close()
        except Exception:
            log.exception("closing side channel")
        if self.data_plane is not None:
            try:
                self.data_plane.close()
            except Exception:
                log.exception("closing data plane")
        # The wake pipe stays open until the object goes away: an engine thread may still call
        # a hook, and writing to a closed (possibly reused) fd number would hit another file.

    def _timeout_ms(self) -> int:
        cap = self.inbox.poll_cap_ms()
        if self.inbox.items:
            return 0
        due = self.timers.next_at()
        hb = self.liveness
        if hb.on and (due is None or hb.next_round < due):
            due = hb.next_round  # heartbeat rounds keep their pace on an idle loop
        if due is None:
            return cap
        wait = due - self._clock()
        return 0 if wait <= 0 else min(cap, int(wait * 1000) + 1)

    # ------------------------------------------------------------ engine events
    def _drain_inbox(self) -> None:
        inbox = self.inbox.items
        ep = self.endpoint
        layer_effects: list[Effect] = []  # of consecutive layer events: one submit per peer
        while inbox:
            item = inbox.popleft()
            kind = item[0]
            if kind != LAYER and layer_effects:
                self._execute_layer_effects(layer_effects)  # before a call that may need them
                layer_effects = []
            if kind == LAYER:
                _, layer, ids, t = item
                started = time.perf_counter()
                self.counters["layer_events"] += 1
                self.inbox.layer_event(t)
                try:
                    effects = ep.layer_computed(layer, ids, self._clock())
                except Exception as exc:
                    self.core_error("layer_computed", exc)
                    continue
                if layer == self._num_layers - 1:
                    for rid in ids:
                        st = ep.state_of(rid)
                        if st is not None and st != DONE and st != FAILED:
                            self._last_layer_t[rid] = t
                layer_effects += effects
                self.counters["layer_event_s"] += time.perf_counter() - started
            elif kind == CALL:
                _, method, (args, kwargs), fut = item
                self.counters["calls"] += 1
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    effects = getattr(ep, method)(*args, self._clock(), **kwargs)
                except BaseException as exc:
                    self.counters["call_errors"] += 1
                    fut.set_exception(exc)
                    continue
                self._execute(effects, None)
                fut.set_result(effects)
            else:
                _, fn, _, fut = item
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn(self))
                except BaseException as exc:
                    fut.set_exception(exc)
        if layer_effects:
            self._execute_layer_effects(layer_effects)

    def _execute_layer_effects(self, effects: list[Effect]) -> None:
        """The effects of consecutive layer events, performed at once (timed as layer work)."""
        started = time.perf_counter()
        self._execute(effects, None)
        self.counters["layer_event_s"] += time.perf_counter() - started

    def core_error(self, what: str, exc: Exception, ib: Inbound | None = None) -> None:
        """The core raised on ``what``: counted; a refusal warned (rate-limited), else logged."""
        if isinstance(exc, ProtocolError):
            self.counters["protocol_errors"] += 1
            self._refusals.note(what.split(" ", 1)[0], "the core refused %s: %s", what, exc,
                                req_id=exc.req_id, peer=peer_of(ib))  # "timer <key>": "timer"
        else:
            self.counters["core_errors"] += 1
            log.error("%s: %s raised %r", self._name, what, exc, exc_info=exc)

    # ------------------------------------------------------------ network events
    def _on_network(self, inbound: list[Inbound]) -> list[Inbound]:
        """Handle a turn's messages; its status queries are returned, to be answered last."""
        for ib in inbound:
            if not isinstance(ib.msg, StatusQuery):
                self._on_inbound(ib)
        return [ib for ib in inbound if isinstance(ib.msg, StatusQuery)]

    def _on_inbound(self, ib: Inbound) -> None:
        msg = ib.msg
        self.counters["messages"] += 1
        if ib.rtt_s is not None:
            self._rtts.append(ib.rtt_s)
        now = self._clock()
        origin = getattr(msg, "sender", None) or getattr(msg, "responder", None)
        if origin is not None:
            self.peers.heard(origin.addr, now)
        if isinstance(msg, Heartbeat):
            self.side.reply(ib, msg.sender.addr,
                            HeartbeatAck(PROTOCOL_VERSION, self.endpoint.me))
            return
        if isinstance(msg, HeartbeatAck):  # its incarnation may say the peer restarted
            try:
                effects = self.endpoint.peer_answered(msg.responder, now)
            except Exception as exc:
                self.core_error("peer_answered", exc, ib)
                return
            self._execute(effects, ib)
            return
        if isinstance(msg, StatusReply):
            self.counters["protocol_errors"] += 1  # only ``lw status`` asks for these
            return
        try:
            effects = self.endpoint.on_message(msg, now)
        except Exception as exc:  # a message must never stop the loop
            self.core_error(type(msg).__name__, exc, ib)
            return
        if self.is_prefill and isinstance(msg, MetaReply) and msg.status == "accepted":
            self._warm_up(msg)
        self._execute(effects, ib)

    def _warm_up(self, msg: MetaReply) -> None:
        """The side channel proved D alive: open its transfer-engine segment off the hot path."""
        try:
            if self.writes.warm_up(msg.responder.addr, msg.layout, self.data_plane):
                self.counters["connects"] += 1
        except Exception as exc:
            self.counters["effect_errors"] += 1
            log.warning("%s: connect to %s raised %r", self._name, msg.responder.addr, exc)

    def _on_completions(self) -> None:
        assert self.data_plane is not None
        ep = self.endpoint
        try:
            completions = self.data_plane.poll()
        except Exception as exc:  # a broken plane must not stop the loop (timers still run)
            self.counters["effect_errors"] += 1
            log.error("%s: data plane poll raised %r", self._name, exc)
            return
        for c in completions:
            pairs = c.xfer_id
            if not isinstance(pairs, tuple):
                continue  # not ours (a plane shared with something else)
            landed_in = self.writes.completed(c)
            now = self._clock()
            if landed_in and self.liveness.on:
                # progress is a sign of life: D's process took the bytes while its protocol
                # thread may be starved of CPU (liveness by progress, not by chatter alone)
                self.liveness.heard(landed_in, now)
            for rid, seq in pairs:
                try:
                    effects = ep.transfer_done(rid, seq, c.ok, c.reason, now, c.in_doubt)
                except Exception as exc:
                    self.core_error("transfer_done", exc)
                    continue
                if (effects and rid in self._last_layer_t
                        and any(isinstance(e, KeptSums) or (isinstance(e, Send) and isinstance(
                            e.msg, DoneSending)) for e in effects)):
                    # every write is done: the tail after the (last chunk's) last layer
                    self._tails.append(time.monotonic() - self._last_layer_t.pop(rid))
                if effects:
                    self._execute(effects, None)

    def _fire_timers(self) -> None:
        now = self._clock()
        for key in self.timers.due(now):
            self.counters["timers_fired"] += 1
            try:
                effects = self.endpoint.on_timer(key, now)
            except Exception as exc:
                self.core_error(f"timer {key}", exc)
                continue
            self._execute(effects, None)
        self._refusals.tick(now)
        if self.liveness.due(now):
            self._heartbeat(now)
        if self._stuck_check_s > 0 and now >= self._next_stuck_check:
            self._next_stuck_check = now + self._stuck_check_s
            self._check_stuck(now)

    def _heartbeat(self, now: float) -> None:
        """A heartbeat round (:class:`~lw.transport.peerwatch.PeerWatch`)."""
        self.peers.round(now)

    # ------------------------------------------------------------ observability
    def _check_stuck(self, now: float) -> None:
        """Log each request that just spent too long in one state, once, as ``lw status``
        would print it (the core decides what "too long" is)."""
        try:
            rows = self.endpoint.stuck(now)
        except Exception as exc:
            self.core_error("stuck", exc)
            return
        plane = ""
        if rows and self.data_plane is not None and self.role == "prefill":
            # What the worker's data plane holds, beside what the core believes: a core
            # counting writes in flight that the plane has completed or never taken is a
            # different fault from a plane whose writes stall in the transport.
            try:
                st = self.data_plane.stats()
                plane = (f" [data plane: {st.get('submitted', 0)} submitted, "
                         f"{st.get('completed', 0)} completed, {st.get('failed', 0)} failed, "
                         f"{st.get('queued', 0)} queued, {st.get('pending', 0)} pending]")
            except Exception as exc:  # diagnostics only
                plane = f" [data plane stats raised {exc!r}]"
        for row in rows:
            line = status_line(self.role, self.endpoint.me, row) + plane
            log.warning("lw stuck request: %s", line)
            self.stuck.append(line)
            self.counters["stuck_requests"] += 1  # last: observers see the line once counted

    def status_reply(self, req_id: str = "", timeline: int = 0) -> StatusReply:
        """This worker's live requests (or one), its newest timeline entries and counters,
        trimmed to fit one side-channel message. Loop thread only."""
        return status_reply(self.endpoint, self.role, self.counters, self._clock(), req_id,
                            timeline, self.first_token)

    # ------------------------------------------------------------ effects
    def _execute(self, effects: list[Effect], ib: Inbound | None) -> None:
        """Perform effects through the shared interpreter; ``ib``: the message they answer."""
        # Made per call: ports kept on the loop would be a reference cycle, and a loop freed by
        # the cyclic collector may finalize its zmq context before its sockets (term() hangs).
        perform(effects, LoopPorts(self, ib), self._effect_failed)

    def _execute_now(self, effects: list[Effect]) -> None:
        self._execute(effects, None)

    def _effect_failed(self, e: Effect, exc: Exception) -> None:
        self.counters["effect_errors"] += 1
        log.error("%s: effect %r failed: %r", self._name, e, exc, exc_info=exc)

    def now(self) -> float:
        """The loop's clock (seconds, monotonic unless a test gave another)."""
        return self._clock()

    def fresh_blocks(self, req_id: str, count: int) -> Sequence[int] | None:
        """D: ``count`` fresh blocks for ``req_id``'s next claim epoch, or None (refused)."""
        fresh = self._fresh_blocks
        return None if fresh is None else fresh(req_id, count)

    def report(self, e: Report) -> None:
        """Hand a report to the engine (queued, and to ``on_report``); loop thread only."""
        self.counters["reports"] += 1
        if isinstance(e, SendFinished):
            self.memory.forget(e.req_id)
            self._last_layer_t.pop(e.req_id, None)
        self.reports.put(e)
        if self._on_report is not None:
            try:
                self._on_report(e)
            except Exception:
                log.exception("%s: on_report callback raised", self._name)

    def fence(self, e: FenceData) -> None:
        """Fence the data plane from ``e.senders``' hosts on a thread of its own (it waits for
        Mooncake to close what it cut); the core hears the outcome through ``data_fenced``."""
        hosts = sorted({host_of(s.addr) for s in e.senders})
        self.counters["fences"] += 1

        def run() -> None:
            try:
                ok, why = self.data_plane.fence_inbound(hosts, self.config.fence_timeout_s)
            except Exception as exc:  # a fence that raised did not hold
                ok, why = False, f"fence raised {exc!r}"
            if not ok:
                log.warning("%s: data-plane fence of %s for %s (epoch %d) failed: %s",
                            self._name, hosts, e.req_id, e.epoch, why)
            self.call("data_fenced", e.req_id, e.epoch, ok, why)

        threading.Thread(target=run, name=f"{self._name}-fence", daemon=True).start()

    def start_writes(self, writes: list[WriteLayer]) -> list[list[Effect]]:
        """Start ``writes``; the core's effects for those that could not start."""
        out: list[list[Effect]] = []
        now = self._clock()
        for rid, seq, reason in self.writes.submit(writes, self.data_plane, now):
            try:
                out.append(self.endpoint.transfer_done(rid, seq, False, reason, now))
            except Exception as exc:
                self.core_error("transfer_done", exc)
        return out
