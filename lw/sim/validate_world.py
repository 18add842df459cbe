"""The world ``lw validate`` searches: the checker's world of one recorded request in the run's
shape, with every endpoint's timeline on, plus what the checker's world leaves out and real runs
were found to do (docs/checker-findings.md, "Trace validation: runs and findings"): bytes
that land wrong, live peers suspected lost, writes that outlive their transfer timeout, and the
proxy's routing notice and D's registration reaching each D worker on its own, possibly after
P's claim.
"""

from __future__ import annotations

from dataclasses import dataclass

from lw.contract.tracefile import Trace
from lw.fsm import DecodeConfig, PrefillConfig
from lw.fsm.lifecycles import AHEAD
from lw.fsm.settings import core_config
from lw.sim.clock import Clock
from lw.sim.config import EPSILON, Action, WorldConfig, d_addr, p_addr
from lw.sim.faults import Faults
from lw.sim.proxy import Proxy
from lw.sim.request import Req
from lw.sim.state import WorldState
from lw.sim.world import World

BIG_RING = 1 << 16


@dataclass(frozen=True)
class ValidationConfig(WorldConfig):
    """The world of one recorded request: P's two retry budgets kept apart (the checker's world
    has one, ``retries``) and every endpoint's timeline on."""

    meta_attempts: int = 2
    ack_attempts: int = 2
    # a live peer may be declared lost (a heartbeat detector suspecting a frozen or cut-off
    # process; the checker's world declares only dead peers lost)
    suspect: bool = False
    retry_prefill_avoid: str = "lost"  # D's DecodeConfig setting of the run (failover)
    # P's progress deadline of the run (PrefillConfig): a request with no progress this long
    # fails before its cap (the checker's own worlds leave it off)
    progress_timeout_s: float = 0.0
    # The blocks each of the request's chunks completes, as the run's P scheduler announced them
    # (a trace's per-request ``chunk_blocks``); () is the checker's own split (chunk_sizes).
    chunk_blocks: tuple[int, ...] = ()
    # D's workers may register the request after P's first claim reaches them (each takes
    # the step's metadata in its own loop); on only where the run's P was answered "unknown",
    # since the deferral multiplies every other request's search by the interleavings.
    late_register: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.chunk_blocks:
            return
        sent = self.blocks_per_request - self.hit(0)
        if self.requests != 1 or len(self.chunk_blocks) != self.chunks or sum(
                self.chunk_blocks) != sent:
            raise ValueError(f"chunk sizes {list(self.chunk_blocks)} do not split one request's "
                             f"{sent} sent blocks in {self.chunks} chunks")

    def chunk_sizes(self, n: int) -> tuple[int, ...]:
        """The run's own split of the request's ``n`` sent blocks when the trace gives one."""
        return self.chunk_blocks or super().chunk_sizes(n)

    def prefill_config(self) -> PrefillConfig:
        """P's settings as the run had them, with a timeline to observe."""
        return core_config(PrefillConfig, vars(self), timeline_entries=BIG_RING)

    def decode_config(self) -> DecodeConfig:
        """D's settings as the run had them, with a timeline to observe."""
        return core_config(DecodeConfig, vars(self), timeline_entries=BIG_RING)


def failover_run(trace: Trace) -> bool:
    """Whether the run had a prefill retry budget: then each P DP rank is an engine of its own
    and a request lost with its rank is prefilled again on another (lw/sim/failover.py)."""
    return int(trace.decode.get("retry_prefill", 0) or 0) > 0


def world_config(trace: Trace, max_faults: int, d_restarts: int,
                 p_engines: int = 1, rid: str = "") -> ValidationConfig:
    """The world of request ``rid`` of ``trace``'s run, in its own shape where the trace gives
    one (else the run's), with the fault kinds the run may have. ``p_engines``: how many P
    engines the request may meet (its first and its failover targets; more than one only in a
    run with a prefill retry budget)."""
    s, p, d = trace.shape, trace.prefill, trace.decode
    kinds = tuple(k for k in trace.faults if k != "suspect")
    retry = int(d.get("retry_prefill", 0) or 0)
    if retry and "crash" in kinds:
        # With failover each P DP rank is a process of its own: a crashed P process is one
        # rank (rank-crash), while its peers live and take over its requests.
        kinds += ("rank-crash",)
    if any(e.event == "fence_failed" and rid in e.reqs for w in trace.workers
           if w.role == "decode" for e in w.entries):
        kinds += ("fence-fail",)  # a data-plane fence of this request's that did not hold
    shape = trace.request_shape(rid)
    bpr = shape.blocks
    # retry_fresh_blocks: D's pool has room for as many more epochs' blocks as the run's D
    # granted this request (its "fresh" milestones): the world grants fresh blocks while
    # enough are free and refuses after, so a request the run's pool refused (and fenced)
    # is explained too, as long as its grants came first
    fresh = bool(d.get("retry_fresh_blocks", False)) and retry > 0
    grants = sum(1 for w in trace.workers if w.role == "decode" for e in w.entries
                 if e.event == "fresh" and rid in e.reqs) if fresh else 0
    late = any(e.event == "meta_unknown" and rid in e.reqs for w in trace.workers
               if w.role == "prefill" for e in w.entries)
    design = "compute-ahead" if computed_ahead(trace, rid) else "d-first"
    return ValidationConfig(
        dp=max(p_engines, 2) if retry else 1, tp=s["prefill_tp"], d_dp=1, d_tp=s["decode_tp"],
        requests=1, layers=s["layers"],
        blocks_per_request=bpr, d_blocks=bpr * (1 + min(grants, retry)), p_blocks=bpr,
        chunks=shape.chunks,
        prefix_hits=(shape.prefix_hit,), chunk_blocks=shape.chunk_blocks, mla=s["mla"],
        heads=0 if s["mla"] else s["kv_heads"], faults=True, fault_kinds=kinds,
        suspect="suspect" in trace.faults,
        max_faults=max_faults, d_restarts=d_restarts, retries=max(p["meta_attempts"],
                                                                  p["ack_attempts"]),
        meta_attempts=p["meta_attempts"], ack_attempts=p["ack_attempts"],
        resend_until_deadline=bool(p.get("resend_until_deadline", False)),
        progress_timeout_s=float(p.get("progress_timeout_s", 0.0)),
        meta_retry_s=p["meta_retry_s"], ack_retry_s=p["ack_retry_s"],
        request_timeout_s=p["request_timeout_s"], prefill_timeout_s=d["prefill_timeout_s"],
        lease_s=d["lease_s"], transfer_timeout_s=float(s.get("transfer_timeout_s", 5.0)),
        kv_checksum=bool(p.get("kv_checksum", False)), retry_prefill=retry,
        retry_prefill_avoid=str(d.get("retry_prefill_avoid", "lost")), retry_fresh_blocks=fresh,
        # runs recorded before issue 40's fence freed blocks at the lease's end
        fence_data=bool(d.get("fence_data", False)), late_register=late,
        design=design,
        ahead_wait_s=float(p.get("ahead_wait_s", 5.0)))


def computed_ahead(trace: Trace, rid: str) -> bool:
    """Whether P admitted request ``rid`` ahead of D's params (its first P event: admitted into
    AHEAD; a trace joined under D's ids, tracefile.joined)."""
    return any(e.event == "admitted" and e.dst == AHEAD and rid in e.reqs
               for w in trace.workers if w.role == "prefill" for e in w.entries)


class ValidationState(WorldState):
    """The checker's state, and the registrations and routing notices in flight."""

    # (D worker, request, P rank, claim epoch). The proxy tells D where it sent a prefill by a
    # message of its own to the D process, whose TP workers each take it in their own loop; P,
    # started at the same moment, may claim first (the D TP 2 flake of issue 20). The checker's
    # world routes in the same action as the start.
    routes: tuple[tuple[int, int, int, int], ...]
    # (D worker, request, blocks). D's scheduler hands the metaserver a request in the same
    # step whose metadata tells its workers; each worker registers it when it next takes
    # metadata, and P's claim may come first (D answers "unknown", P asks again): an MLA run's
    # D worker did so (2026-12-03, finding 11). The checker's world registers in the allocation.
    regs: tuple[tuple[int, int, tuple[int, ...]], ...]

    def __init__(self, cfg: WorldConfig) -> None:
        super().__init__(cfg)
        self.routes = ()
        self.regs = ()

    def registering(self, v: int, r: int) -> bool:
        """Whether D worker ``v`` has yet to register request ``r``."""
        return any(x[0] == v and x[1] == r for x in self.regs)


class _Proxy(Proxy):
    """Registrations and routing notices delivered to each D worker on their own."""

    __slots__ = ()

    s: ValidationState

    def register(self, q: Req, v: int, blocks: tuple[int, ...]) -> None:
        """D worker ``v`` registers ``q`` in an action of its own where the run's P was told
        "unknown" (else in the allocation, as the checker's world does)."""
        if self.s.cfg.late_register:
            self.s.regs += ((v, q.idx, blocks),)
        else:
            super().register(q, v, blocks)

    def do_register(self, v: int, r: int, blocks: tuple[int, ...]) -> None:
        """D worker ``v`` takes the metadata that registers request ``r``."""
        s = self.s
        s.regs = tuple(x for x in s.regs if x[:2] != (v, r))
        super().register(s.reqs[r], v, blocks)

    def route(self, q: Req) -> None:
        """The notices of ``q``'s current attempt leave for each D worker of its engine."""
        s = self.s
        s.routes += tuple((v, q.idx, q.p_rank, q.p_epoch) for v in s.d_workers_of(q.d_rank))

    def do_route(self, v: int, r: int, rank: int, epoch: int) -> None:
        """D worker ``v`` learns where epoch ``epoch`` of request ``r`` was sent."""
        s = self.s
        s.routes = tuple(x for x in s.routes if x != (v, r, rank, epoch))
        self.ports.run(("d", v), s.d[v].prefill_routed(
            s.reqs[r].rid, s.p_engine(rank), p_addr(rank * s.tp), epoch, s.now))


class _Faults(Faults):
    """The checker's faults, bytes that land wrong and live peers suspected lost."""

    __slots__ = ()

    s: ValidationState

    def do_crash_d(self, d: int) -> None:
        """The checker's D crash; the notices were for the dead process."""
        super().do_crash_d(d)
        s = self.s  # a new process never gets them
        s.routes = tuple(x for x in s.routes if x[0] // s.d_tp != d)
        s.regs = tuple(x for x in s.regs if x[0] // s.d_tp != d)

    def fault_actions(self) -> list[Action]:
        """The checker's faults and suspicions."""
        return super().fault_actions() + self._suspicions()

    def _suspicions(self) -> list[Action]:
        s = self.s
        if not getattr(s.cfg, "suspect", False):
            return []
        acts: list[Action] = []
        if s.p_alive:
            acts += [("suspect_d", w, d) for w in range(len(s.p)) for d in range(s.cfg.d_dp)
                     if s.d_alive[d] and (w, d) not in s.d_lost_seen
                     and s.rank_alive(w // s.tp)]
            acts += [("suspect_p", v) for v in range(len(s.d))
                     if s.d_alive[v // s.d_tp] and not s.p_lost_seen[v]]
        return acts

    def do_suspect_d(self, i: int, d: int) -> None:
        """P worker ``i`` declares the live D engine ``d`` lost (missed heartbeats)."""
        s = self.s
        s.faults_used += 1
        s.d_lost_seen.add((i, d))
        for v in s.d_workers_of(d):
            self.ports.run(("p", i), s.p[i].peer_lost(d_addr(v), "D suspected", s.now))

    def do_suspect_p(self, v: int) -> None:
        """D worker ``v`` declares the live P engine lost (missed heartbeats); with failover,
        every P engine (one suspicion of each would be finer, and cost states)."""
        s = self.s
        s.faults_used += 1
        s.p_lost_seen[v] = True
        for i in range(s.cfg.dp) if s.p_engine(0) != "P" else (0,):
            self.ports.run(("d", v), s.d[v].peer_lost(s.p_engine(i), "P suspected", s.now))


class _Clock(Clock):
    """Writes do not bound the clock."""

    __slots__ = ()

    def deadlines(self) -> list[tuple[float, Action]]:
        """The checker's deadlines but write timeouts."""
        # A write may complete after transfer_timeout_s from the core's WriteLayer: the runtime
        # queues writes per destination, and the data plane's own timeout starts when it takes
        # one (slow-link rows: reported ok 5.4 s after a 5 s timeout). The checker's world times
        # out every write at that deadline; here writes do not bound the clock (one may still
        # fail in doubt with the run's write faults).
        return [d for d in super().deadlines() if d[1][0] != "wto"]

    def idle(self, acts: list[Action]) -> list[Action]:
        """The checker's idle, to just before the next deadline, and, while a request's last
        write is in flight, to just before each instant k ack periods earlier than a pending
        deadline (``("idle", at)``): how often the DONE's ack timer fires before that deadline
        depends on where in a period the last write completed."""
        if not super().idle(acts):
            return []
        s = self.s
        first = min(at for at, _ in self.deadlines())
        L = s.cfg.layers
        if not any(seq % L == L - 1 and s.reqs[r].chunk_of(seq, L) == len(s.reqs[r].sizes) - 1
                   for f in s.fifo for r, seq, *_ in f):
            return [("idle",)]  # no write in flight whose completion sends a DONE
        # A lossy-link run sent its DONE 3.01 s into P's 4 s deadline: four of the DONE's 0.2 s
        # ack timers fired, then the deadline (the checker's idle, to just before the deadline
        # only, allows none; issue 20, finding 9). The timer fires at most ack_attempts times.
        r = s.cfg.ack_retry_s
        targets = {round(at - k * r - EPSILON, 9) for at, _ in self.deadlines()
                   for k in range(1, s.cfg.ack_attempts + 1)}
        return [("idle",)] + [("idle", at) for at in sorted(targets)
                              if s.now + EPSILON < at < first - EPSILON]

    def do_landed(self, i: int) -> None:
        """Another request's write landed on each D worker P worker ``i`` may write to now."""
        s = self.s
        for v in range(len(s.d)):
            s.p[i].link_moved(d_addr(v), s.now)

    def do_idle(self, at: float | None = None) -> None:
        """Time passes, to ``at`` (default: just before the next deadline)."""
        if at is None:
            super().do_idle()
            return
        self.s.note("Proxy", f"time passes: t={at:g}")
        self._tick(at)


class ValidationWorld(World):
    """The checker's world plus what runs were found to do that it leaves out: bytes that land
    wrong (``corrupt``), live peers suspected lost (``suspect``), writes that do not bound the
    clock, and registrations and routing notices delivered to each D worker on their own."""

    __slots__ = ()

    s: ValidationState
    state_type = ValidationState
    proxy_type = _Proxy
    faults_type = _Faults
    clock_type = _Clock
    handlers = {**World.handlers, "route": "proxy", "register": "proxy", "suspect_d": "faults",
                "suspect_p": "faults", "landed": "clock"}

    def key(self) -> tuple:
        """The checker's state key, the registrations and notices in flight and, with P's progress
        deadline on, what it reads (relative to now): the checker's snapshot leaves both out,
        and two states that differ only there decide differently when the deadline fires."""
        s = self.s
        if not s.cfg.progress_timeout_s:
            return (super().key(), s.routes, s.regs)
        progress = tuple((tuple(sorted((a, round(t - s.now, 9)) for a, t in landed.items())),
                          tuple(round(at - s.now, 9) for at in marks))
                         for landed, marks in (ep.progress_marks() for ep in s.p))
        return (super().key(), s.routes, s.regs, progress)

    def enabled(self) -> list[Action]:
        """The checker's actions, each D worker's registration and routing notice, P learning
        late of a D crash, and other requests' writes landing on the request's D."""
        s = self.s  # a worker's notice follows its registration (both come in its metadata)
        return (super().enabled() + [("register", *x) for x in s.regs]
                + [("route", *x) for x in s.routes if not s.registering(x[0], x[1])]
                + self._late_d_lost() + self._landed_elsewhere())

    def _landed_elsewhere(self) -> list[Action]:
        # P's progress deadline counts every write that lands on a request's D, the other
        # requests' too (a lossy-link run failed a request at its 20 s cap that its own
        # progress would have failed at 8 s). The one-request world holds no other request:
        # another's write may land just before the deadline timer fires, which then waits on.
        s = self.s
        if not s.cfg.progress_timeout_s or not s.p_alive:
            return []
        due = self.clock.deadlines()
        if not due:
            return []
        first = min(at for at, _ in due)
        if first - s.now > 1.5 * EPSILON:
            return []
        return [("landed", a[1][1]) for at, a in due if at == first and a[0] == "timer"
                and a[1][0] == "p" and a[2][0] == "deadline" and s.rank_alive(a[1][1] // s.tp)]

    def _late_d_lost(self) -> list[Action]:
        # A heartbeat detector declares a D lost some time after its death: in a kill-decoder
        # run P did so 1.7 s after the kill, when the new process at the same address had
        # already allocated requests, and failed them with it. The checker's world lets P learn
        # of a D crash only while D is down.
        s = self.s
        if not s.restarts or not s.p_alive:
            return []
        return [("d_lost", w, d) for w in range(len(s.p)) for d in range(s.cfg.d_dp)
                if s.d_alive[d] and s.d_inc[d] > 1 and (w, d) not in s.d_lost_seen
                and s.rank_alive(w // s.tp)]
