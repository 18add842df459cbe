"""The deterministic world the checker explores, around the real ``lw.fsm`` endpoints.

A P node of ``dp`` DP ranks x ``tp`` workers (one :class:`PrefillEndpoint` per worker) steps
through ``layers`` layers in lock step, a D node of ``d_dp`` engines x ``d_tp`` TP workers (one
:class:`DecodeEndpoint` per worker; the workers of an engine share its scheduler's finite block
pool) receives the KV along the sender plan of :mod:`lw.fsm.kvmap` (heads, MLA, prefix-cache
hits on D), a proxy routes requests, the side channel is a multiset of
messages, each P worker has a FIFO data plane (writes may fail "in doubt": their bytes may still
land for a while), and a virtual clock drives the timers the endpoints arm. Actions are tuples;
:meth:`World.enabled` lists them, :meth:`World.apply` performs one and checks the safety
properties, raising :class:`~lw.sim.properties.Violation`. No I/O.

The world is composed of parts that share one declared state (:class:`~lw.sim.state.WorldState`)
and call each other through the references their constructors take: the effects' ports
(:mod:`lw.sim.ports`), the proxy and side channel (:mod:`lw.sim.proxy`), P's scheduler and
forward pass (:mod:`lw.sim.pnode`), the data plane (:mod:`lw.sim.datapath`), D's scheduler
(:mod:`lw.sim.dnode`), faults (:mod:`lw.sim.faults`), failover (:mod:`lw.sim.failover`), the
clock (:mod:`lw.sim.clock`), D's memory (:mod:`lw.sim.kvbytes`), the properties
(:mod:`lw.sim.checks`) and descriptions (:mod:`lw.sim.describe`). This module makes them,
lists the enabled actions, dispatches each to the part that performs it, and keys states.
"""

from __future__ import annotations

from typing import ClassVar

from lw.fsm import DecodeEndpoint, PrefillEndpoint, PrefillRequest, ProtocolError
from lw.fsm.messages import KVFormat, KVLayout, LayerLayout, Sender
from lw.sim.checks import Checks
from lw.sim.clock import Clock
from lw.sim.clone import Cloner
from lw.sim.config import (  # noqa: F401  (re-exported for the explorer and tests)
    FAULT_ACTIONS,
    FAULT_KINDS,
    Action,
    WorldConfig,
)
from lw.sim.datapath import DataPath
from lw.sim.describe import Describe
from lw.sim.dnode import DNode
from lw.sim.failover import Failover
from lw.sim.faults import Faults
from lw.sim.kvbytes import KVBytes
from lw.sim.network import MESSAGE_TYPES, Network
from lw.sim.pnode import PNode
from lw.sim.ports import Ports
from lw.sim.properties import Violation
from lw.sim.proxy import Proxy
from lw.sim.request import Req
from lw.sim.state import WorldState

# Which part performs each kind of action (its method ``do_<kind>``).
HANDLERS: dict[str, str] = {
    **dict.fromkeys(("arrive", "alloc", "start", "deliver", "fallback"), "proxy"),
    **dict.fromkeys(("schedule", "layer", "hook", "barrier", "sample"), "p_node"),
    "complete": "data",
    "decode": "d_node",
    **dict.fromkeys(("drop", "dup", "fail_write", "crash_p", "crash_d", "restart_d", "p_lost",
                     "d_lost", "abort_d", "abort_p", "forge", "corrupt", "stall", "fence_fail"),
                    "faults"),
    **dict.fromkeys(("crash_rank", "rank_lost", "reprefill"), "failover"),
    **dict.fromkeys(("idle", "wto", "zexp", "timer"), "clock"),
    "zland": "kv",
    "fenced": "data",
}


class World:
    """One state of the simulated cluster, with the parts that act on it; mutated in place by
    :meth:`apply`. A subclass may put its own part classes (and state class) in place of these,
    and add action kinds to :attr:`handlers`."""

    # Slots: a copy makes its parts anew (World.__reduce__), so making them must be cheap.
    __slots__ = ("s", "cfg", "design", "kv", "ports", "p_node", "data", "d_node", "clock",
                 "proxy", "failover", "faults", "describer", "checks")

    state_type: ClassVar[type[WorldState]] = WorldState
    proxy_type: ClassVar[type[Proxy]] = Proxy
    faults_type: ClassVar[type[Faults]] = Faults
    clock_type: ClassVar[type[Clock]] = Clock
    handlers: ClassVar[dict[str, str]] = HANDLERS

    def __init__(self, cfg: WorldConfig) -> None:
        self._compose(self.state_type(cfg))

    @classmethod
    def around(cls, s: WorldState) -> World:
        """A world of this class around the state ``s`` (a copy's unpickled state)."""
        w: World = cls.__new__(cls)
        w._compose(s)
        return w

    def _compose(self, s: WorldState) -> None:
        """Make the parts around the state ``s`` (a new world, or a copy's unpickled state)."""
        self.s = s
        self.cfg = s.cfg
        self.design = s.design
        self.kv = KVBytes(s)
        self.ports = Ports(s, self.kv)
        self.p_node = PNode(s, self.ports)
        self.data = DataPath(s, self.ports, self.kv)
        self.d_node = DNode(s, self.kv)
        self.clock = self.clock_type(s, self.ports, self.kv, self.p_node)
        self.proxy = self.proxy_type(s, self.ports, self.p_node)
        self.failover = Failover(s, self.ports, self.clock, self.proxy)
        self.faults = self.faults_type(s, self.ports, self.clock, self.kv, self.d_node,
                                       self.failover)
        self.describer = Describe(s)
        self.checks = Checks(s, self.p_node, self.describer)
        self.ports.connect(self.p_node, self.d_node, self.failover, self.data)

    # ------------------------------------------------------------------ identity and copies
    def __reduce__(self) -> tuple:
        # A copy carries the state alone: the parts hold nothing else and are made anew
        # around it (cheaper than pickling a dozen objects of references).
        return (_around, (type(self), self.s))

    def key(self) -> tuple:
        """Canonical hashable state (endpoint snapshots + world state, times relative to now)."""
        s = self.s
        now = s.now
        budget = s.cfg.progress_budget()
        tp, d_tp = s.tp, s.d_tp
        return (
            s.arrived, s.phase, tuple(s.hooks_done), s.p_alive, tuple(s.d_alive),
            tuple(s.p_lost_seen), tuple(sorted(s.d_lost_seen)), s.faults_used,
            tuple(sorted(s.dead_ranks)), tuple(sorted(s.rank_lost_seen)),
            tuple(sorted((k, round(at - now, 6)) for k, at in s.timers.items())),
            s.net.snapshot(),
            tuple(tuple((w[0], w[1], w[4], round(w[5] - now, 6), w[6]) for w in f)
                  for f in s.fifo),
            tuple(map(tuple, s.p_pool)), tuple(map(tuple, s.d_pool)),
            tuple(map(tuple, s.p_queue)), tuple(map(tuple, s.d_queue)),
            tuple(map(tuple, s.p_batch)), tuple(map(tuple, s.p_free_pending)),
            tuple(map(tuple, s.p_running)),
            tuple(sorted((z[0], z[1], z[2], z[3], round(z[5] - now, 6), z[6])
                         for z in s.zombies)),
            tuple(sorted((*f[:4], round(f[4] - now, 6)) for f in s.fences)),
            tuple(q.key(now, budget) for q in s.reqs),
            tuple(ep.snapshot() if s.rank_alive(w // tp) else None
                  for w, ep in enumerate(s.p)) if s.p_alive else None,
            tuple(ep.snapshot() if s.d_alive[v // d_tp] else None
                  for v, ep in enumerate(s.d)),
            tuple(s.d_inc), s.restarts, tuple(map(tuple, s.unpolled)),
            # PrefillEndpoint.snapshot() names the cached D layouts but not their incarnation,
            # which decides whether P asks again after a D restart: added here.
            tuple(tuple(sorted((a, lay.incarnation, lay.layers[0].base_addr)
                               for a, lay in ep.cached_layouts().items()))
                  for ep in s.p) if s.cfg.d_restarts else None,
            tuple(s.lane), tuple(tuple((d, m.req_id) for d, m in h) for h in s.held),
            self.kv.memory_key(),
        )

    def cloner(self) -> Cloner:
        """A fast copier for this world and its descendants (immutable parts by reference)."""
        p_shared = PrefillEndpoint.IMMUTABLE
        d_shared = DecodeEndpoint.IMMUTABLE
        shared: dict[type, tuple[str, ...]] = {
            self.state_type: ("cfg", "design", "store", "plan", "quirks"),
            PrefillEndpoint: p_shared,
            DecodeEndpoint: d_shared,
            Network: ("msgs",),
        }
        shared[self.design.prefill] = p_shared  # a design's defect subclass, if any
        shared[self.design.decode] = d_shared
        by_ref = (Sender, KVLayout, LayerLayout, KVFormat, PrefillRequest, *MESSAGE_TYPES)
        return Cloner(self.s.store, shared, by_ref)

    # ------------------------------------------------------------------ what others read
    @property
    def p(self) -> list[PrefillEndpoint]:
        """The P workers' endpoints."""
        return self.s.p

    @property
    def d(self) -> list[DecodeEndpoint]:
        """The D workers' endpoints."""
        return self.s.d

    @property
    def reqs(self) -> list[Req]:
        """The world's requests."""
        return self.s.reqs

    @property
    def now(self) -> float:
        """The virtual clock."""
        return self.s.now

    @property
    def tp(self) -> int:
        """P workers per DP rank."""
        return self.s.tp

    @property
    def d_tp(self) -> int:
        """D workers per D engine."""
        return self.s.d_tp

    @property
    def d_alive(self) -> list[bool]:
        """Per D engine, whether it lives."""
        return self.s.d_alive

    @property
    def d_inc(self) -> list[int]:
        """Per D engine, its incarnation."""
        return self.s.d_inc

    @property
    def faults_used(self) -> int:
        """Faults injected so far."""
        return self.s.faults_used

    @property
    def flags(self) -> set[str]:
        """What happened in the last action (for the "sometimes" properties)."""
        return self.s.flags

    @property
    def draining(self) -> bool:
        """Fair drain: no more faults, the clock only when nothing else can move."""
        return self.s.draining

    @draining.setter
    def draining(self, on: bool) -> None:
        self.s.draining = on

    @property
    def recording(self) -> bool:
        """Whether trace events are recorded (``s.events``)."""
        return self.s.recording

    @recording.setter
    def recording(self, on: bool) -> None:
        self.s.recording = on

    def rank_alive(self, rank: int) -> bool:
        """Whether P DP rank ``rank`` lives (and the P engine)."""
        return self.s.rank_alive(rank)

    def p_engine(self, rank: int) -> str:
        """The engine id of P DP rank ``rank``."""
        return self.s.p_engine(rank)

    def faults_on(self) -> bool:
        """Whether fault actions and free clock advances are enabled now."""
        return self.s.faults_on()

    def describe(self, a: Action) -> str:
        """Human text of an action, in the current state (before it is applied)."""
        return self.describer.describe(a)

    def summary(self) -> list[str]:
        """A few lines describing the state (for stuck-state reports)."""
        return self.describer.summary()

    def check_safety(self) -> None:
        """The 'always' properties on this state; raises Violation."""
        self.checks.check_safety()

    def check_terminal(self) -> None:
        """The 'eventually' properties at a state where no action is enabled."""
        self.checks.check_terminal()

    # ------------------------------------------------------------------ actions
    def enabled(self) -> list[Action]:
        """Every action enabled in this state, in a deterministic order."""
        s = self.s
        cfg = s.cfg
        acts: list[Action] = []
        if s.arrived < cfg.requests:
            acts.append(("arrive",))
        for d in range(cfg.d_dp):
            if (s.d_alive[d] and s.d_queue[d]
                    and s.d_pool[d].count(None) >= cfg.blocks_per_request):
                acts.append(("alloc", d))
        if s.design.d_first and s.p_alive and s.first_live_rank() is not None:
            for q in s.reqs:
                if q.d_blocks is not None and not q.started and q.p_stage == "none":
                    acts.append(("start", q.idx))
        if s.p_alive:
            if s.phase is None:
                if self.p_node.can_step():
                    acts.append(("schedule",))
            else:
                blocked = self.p_node.blocked_hooks()
                if cfg.atomic_layers:
                    if not blocked:
                        acts.append(("layer",))
                else:
                    acts += [("hook", w) for w in range(len(s.p))
                             if not s.hooks_done[w] and w not in blocked]
                    if all(s.hooks_done):
                        acts.append(("barrier",))
        for key in s.net.keys():
            acts.append(("deliver", key))
        for w, fifo in enumerate(s.fifo):
            if fifo:
                acts.append(("complete", w))
                if cfg.unordered_writes:  # any write in flight may complete next
                    acts += [("complete", w, j) for j in range(1, len(fifo))]
        for q in s.reqs:
            if q.d_stage == "decoding":
                acts.append(("decode", q.idx))
        if cfg.first_token_from_p and s.p_alive:
            acts += self.p_node.sample_actions()
        if not s.p_alive and cfg.p_loss_detection:
            acts += [("p_lost", v) for v in range(len(s.d))
                     if s.d_alive[v // s.d_tp] and not s.p_lost_seen[v]]
        if s.p_alive:
            acts += [("d_lost", w, d) for w in range(len(s.p)) for d in range(cfg.d_dp)
                     if not s.d_alive[d] and (w, d) not in s.d_lost_seen
                     and s.rank_alive(w // s.tp)]
        if s.dead_ranks:
            acts += self.failover.rank_lost_actions()
        if cfg.retry_prefill:
            acts += self.failover.reprefill_actions()
        if s.design.ahead:
            acts += self.proxy.fallback_actions()
        if s.restarts < cfg.d_restarts and not s.draining:
            acts += [("restart_d", d) for d in range(cfg.d_dp) if not s.d_alive[d]]
        faults = s.faults_on()
        if faults and s.faults_used < cfg.max_faults:
            acts += self.faults.fault_actions()
        if (faults and cfg.delays) or not acts:
            acts += self.clock.due_timers()
            if faults and cfg.delays and cfg.abstract_time:
                acts += self.clock.idle(acts)
        # Late bytes land at any moment, independent of the clock: even a timely clock moves
        # while they are pending (so leases expire before they land).
        return acts + self.kv.zland_actions() + self.data.fenced_actions()

    def apply(self, a: Action) -> None:
        """Perform one enabled action, then check the safety properties (raises Violation)."""
        s = self.s
        s.flags = set()
        kind = a[0]
        if kind in FAULT_ACTIONS:
            s.faults_used += 1
        handler = getattr(getattr(self, self.handlers[kind]), "do_" + kind)
        try:
            handler(*a[1:])
        except ProtocolError as exc:
            raise Violation("core-protocol-error", str(exc)) from exc
        except (AssertionError, LookupError, TypeError, ValueError) as exc:
            raise Violation("core-protocol-error", f"{_where_raised(exc)} raised "
                                                   f"{type(exc).__name__}: {exc}") from exc
        self.checks.check_safety()


def _around(cls: type[World], s: WorldState) -> World:
    """A world of class ``cls`` around the state ``s`` (unpickling a copy)."""
    return cls.around(s)


def _where_raised(exc: BaseException) -> str:
    """Where an exception was raised, as "file:line (function)" relative to the lw package."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return "?"
    code = tb.tb_frame.f_code
    path = code.co_filename
    k = path.rfind("/lw/")
    return f"{path[k + 1:] if k >= 0 else path}:{tb.tb_lineno} ({code.co_name})"
