"""The checker world's state, declared once: every field the world's parts share, and the
queries over it that several parts ask (names, topology, which rank lives, the trace record).

The parts of :class:`lw.sim.world.World` (P's engine, the data path, D's engine, faults,
failover, clock, D's memory, the properties, descriptions) each hold this object and read or
write the fields their docstrings name; no part keeps state of its own.
"""

from __future__ import annotations

from lw.fsm import DecodeEndpoint, PrefillEndpoint, check_lease
from lw.fsm.effects import TimerKey
from lw.fsm.messages import MetaRequest, Sender
from lw.sim.clone import Store
from lw.sim.config import Owner, Plan, WorldConfig, Write, _layout, _p_layout, d_addr, p_addr
from lw.sim.network import Network
from lw.sim.request import Req
from lw.sim.variants import DESIGNS, Design

# Bytes of request r written under claim epoch e are tagged r + e * EPOCH_TAG in D's memory.
EPOCH_TAG = 1 << 16

# (D worker, block, layer, head slice) -> the claim whose bytes are there: the request's
# index, plus its claim epoch times EPOCH_TAG (prefill failover)
Memory = dict[tuple[int, int, int, int], int]
# A write that failed "in doubt" (or was in flight at a P crash), whose bytes may still land:
# (P worker, req, seq, D worker, remote blocks, deadline, claim epoch of the attempt)
Zombie = tuple[int, int, int, int, tuple[int, ...], float, int]


class WorldState:
    """One state of the simulated cluster: the endpoints and everything the world keeps
    around them. Mutated in place by the world's parts; copied by :mod:`lw.sim.clone`."""

    # -- the family's immutable parts (kept by reference in copies: World.cloner)
    cfg: WorldConfig
    design: Design
    store: Store  # interned requests and messages
    plan: Plan  # the sender plan (kvmap) and formats
    quirks: frozenset[str]  # the design's world behaviour switches (lw.sim.variants)
    tp: int  # P workers per DP rank
    d_tp: int  # D workers per D engine
    # -- clock and control plane
    now: float
    timers: dict[tuple[Owner, TimerKey], float]  # (owner, timer key) -> deadline
    net: Network  # the side channel: a multiset of messages in flight
    # -- the endpoints: P worker w is DP rank w // tp, TP rank w % tp; D worker v is engine
    # v // d_tp, TP rank v % d_tp
    p: list[PrefillEndpoint]
    d: list[DecodeEndpoint]
    d_inc: list[int]  # incarnation per D engine (a restart starts a new one)
    restarts: int  # D restarts so far
    p_alive: bool  # the P engine (every rank) lives
    dead_ranks: frozenset[int]  # P DP ranks that died alone (rank-crash)
    rank_lost_seen: frozenset[tuple[int, int]]  # (D worker, P rank): peer_lost called
    d_alive: list[bool]  # per D engine (a dead TP worker takes its engine)
    p_lost_seen: list[bool]  # per D worker: peer_lost called for P
    d_lost_seen: set[tuple[int, int]]  # (P worker, D engine): peer_lost called
    # -- the data plane and D's memory
    fifo: list[list[Write]]  # writes in flight, per P worker
    zombies: list[Zombie]  # in-doubt bytes that may still land until their deadline
    # fence_data: fences D workers asked for and the data plane has not completed, as (D
    # worker, request id, epoch, the zombies it cuts: those of its senders to that worker
    # when it was asked (bytes of writes that fail later are not cut, conservatively), the
    # time by which it holds)
    fences: list[tuple[int, str, int, tuple[tuple[int, int, int, int], ...], float]]
    d_mem: Memory  # whose bytes D's blocks hold (kv_checksum, late_writes)
    # -- schedulers: block pools (owner request index or None), queues
    p_pool: list[list[int | None]]  # per P DP rank
    d_pool: list[list[int | None]]  # per D engine
    p_queue: list[list[int]]  # per P DP rank: waiting to be scheduled
    d_queue: list[list[int]]  # per D engine: waiting for blocks
    p_batch: list[list[int]]  # per P DP rank: the requests of the step in progress
    # Between steps: per DP rank, the requests whose prefill has chunks left to compute
    # (vLLM's running requests; the next step schedules them first, with their blocks).
    p_running: list[list[int]]
    p_free_pending: list[list[int]]  # per P DP rank: to free once their prefill ends
    # -- P's lock-step forward pass
    phase: int | None  # next layer of the step in progress
    hooks_done: list[bool]  # per P worker, current layer (non-atomic mode)
    collectives: list[int]  # collective calls made per P worker
    steps: int  # P engine steps completed
    # -- requests and the run
    reqs: list[Req]
    arrived: int  # requests the client has sent
    faults_used: int
    draining: bool  # fair drain: no more faults, clock only when nothing else
    flags: set[str]  # what happened in the last action (for "sometimes" properties)
    free_why: dict[tuple[str, int, int], str]  # (pool, rank, block): why it was last freed
    recording: bool  # record trace events
    events: list[tuple]  # (kind, ...) for trace diagrams, when recording
    # -- design quirks
    unpolled: list[list[tuple[int, int, bool]]]  # poll-on-step: per P worker (req, seq, ok)
    # serial-handshake: per P worker, the D address of the first contact in flight and the
    # MetaRequests held behind it (dest, message)
    lane: list[str | None]
    held: list[list[tuple[str, MetaRequest]]]

    def __init__(self, cfg: WorldConfig) -> None:
        self.cfg = cfg
        self.design = DESIGNS[cfg.design]
        pcfg, dcfg = cfg.prefill_config(), cfg.decode_config()
        check_lease(dcfg, pcfg.request_timeout_s, cfg.transfer_timeout_s)
        self.store = Store()
        self.now = 0.0
        self.timers = {}
        self.net = Network(self.store.msgs)
        self.tp = cfg.tp
        self.d_tp = cfg.d_tp
        self.plan = Plan.of(cfg)
        nw = cfg.dp * cfg.tp
        ndw = cfg.d_dp * cfg.d_tp
        self.quirks = self.design.quirks
        p_cls = self.design.prefill
        self.p = [p_cls(Sender(self.p_engine(w // cfg.tp), w, 1, p_addr(w)), cfg.layers, pcfg,
                        local=_p_layout(cfg, w, self.plan.p_fmts[w % cfg.tp]))
                  for w in range(nw)]
        self.d_inc = [1] * cfg.d_dp
        self.d = [self.new_decode(v, 1) for v in range(ndw)]
        self.restarts = 0
        self.p_alive = True
        self.dead_ranks = frozenset()
        self.rank_lost_seen = frozenset()
        self.d_alive = [True] * cfg.d_dp
        self.p_lost_seen = [False] * ndw
        self.d_lost_seen = set()
        self.fifo = [[] for _ in range(nw)]
        self.zombies = []
        self.fences = []
        self.d_mem = {}
        self.p_pool = [[None] * cfg.p_blocks for _ in range(cfg.dp)]
        self.d_pool = [[None] * cfg.d_blocks for _ in range(cfg.d_dp)]
        self.p_queue = [[] for _ in range(cfg.dp)]
        self.d_queue = [[] for _ in range(cfg.d_dp)]
        self.p_batch = [[] for _ in range(cfg.dp)]
        self.p_running = [[] for _ in range(cfg.dp)]
        self.p_free_pending = [[] for _ in range(cfg.dp)]
        self.phase = None
        self.hooks_done = [False] * nw
        self.collectives = [0] * nw
        self.steps = 0
        self.reqs = [Req(i, i % cfg.dp, i % cfg.d_dp, cfg.tp, cfg.d_tp, cfg.hit(i),
                         cfg.chunk_sizes(cfg.blocks_per_request - cfg.hit(i)))
                     for i in range(cfg.requests)]
        self.arrived = 0
        self.faults_used = 0
        self.draining = False
        self.flags = set()
        self.free_why = {}
        self.recording = False
        self.events = []
        self.unpolled = [[] for _ in range(nw)]
        self.lane = [None] * nw
        self.held = [[] for _ in range(nw)]

    def new_decode(self, v: int, incarnation: int) -> DecodeEndpoint:
        """D worker ``v`` of the given incarnation (a fresh process: nothing remembered)."""
        cfg = self.cfg
        return self.design.decode(Sender("D", v, incarnation, d_addr(v)),
                                  _layout(cfg, v, self.plan.d_fmts[v % cfg.d_tp], incarnation),
                                  cfg.decode_config())

    # ------------------------------------------------------------------ topology
    def faults_on(self) -> bool:
        """Whether fault actions and free clock advances are enabled now."""
        return self.cfg.faults and not self.draining

    def workers_of(self, rank: int) -> range:
        """The P workers (TP ranks) of DP rank ``rank``."""
        return range(rank * self.tp, (rank + 1) * self.tp)

    def d_workers_of(self, d: int) -> range:
        """The D workers (TP ranks) of D engine ``d``."""
        return range(d * self.d_tp, (d + 1) * self.d_tp)

    def writers(self, q: Req, v: int) -> list[int]:
        """The P workers that write request ``q`` into D worker ``v`` (the sender plan)."""
        if not q.loads():
            return []
        ranks = self.plan.senders[v % self.d_tp]
        return [w for w in self.workers_of(q.p_rank) if w % self.tp in ranks]

    def p_engine(self, rank: int) -> str:
        """The engine id of P DP rank ``rank``: one engine for all ranks, unless ranks are
        servers of their own (failover, or one may die alone)."""
        cfg = self.cfg
        return f"P{rank}" if cfg.retry_prefill or "rank-crash" in cfg.fault_kinds else "P"

    def rank_alive(self, rank: int) -> bool:
        """Whether P DP rank ``rank`` lives (and the P engine)."""
        return self.p_alive and rank not in self.dead_ranks

    def first_live_rank(self, avoid: tuple[str, ...] = ()) -> int | None:
        """The lowest live P DP rank whose engine is not in ``avoid``."""
        for i in range(self.cfg.dp):
            if self.rank_alive(i) and self.p_engine(i) not in avoid:
                return i
        return None

    def claim_tag(self, r: int, epoch: int) -> int:
        """The memory tag of request ``r``'s bytes written under claim epoch ``epoch``."""
        return r + epoch * EPOCH_TAG

    def req_of(self, rid: str) -> Req | None:
        """The world's request with this id, if it is one (a defect may send other ids)."""
        if rid[:1] == "r" and rid[1:].isdigit() and int(rid[1:]) < len(self.reqs):
            return self.reqs[int(rid[1:])]
        return None

    def forged_blocks(self, q: Req) -> tuple[int, ...]:
        """Other D blocks of the same size: each of q's blocks moved one along D's pool (into
        another request's blocks, a free one, or q's own in another order)."""
        n = len(self.d_pool[q.d_rank])
        return tuple((b + 1) % n for b in q.d_remote)

    # ------------------------------------------------------------------ names
    def what(self, r: int, seq: int) -> str:
        """Write ``seq`` of request ``r`` in reports: "layer k", or with chunked prefill
        "chunk c layer k" (c the prompt's chunk, counted as P's scheduler does)."""
        L = self.cfg.layers
        if self.cfg.chunks == 1:
            return f"layer {seq}"
        return f"chunk {self.reqs[r].chunk_of(seq, L)} layer {seq % L}"

    def wname(self, w: int) -> str:
        """Human name of P worker ``w``."""
        if self.tp == 1:
            return f"P rank {w}"
        return f"P worker {w} (DP {w // self.tp}, TP {w % self.tp})"

    def dname(self, d: int) -> str:
        """Human name of D engine ``d``."""
        return f"D{d}" if self.d_tp == 1 else f"D engine {d}"

    def dwname(self, v: int) -> str:
        """Human name of D worker ``v``."""
        return f"D{v}" if self.d_tp == 1 else f"D{v} (engine {v // self.d_tp}, TP {v % self.d_tp})"

    def dpart(self, d: int) -> str:
        """The trace participant that stands for D engine ``d`` (its TP rank 0)."""
        return f"D{d * self.d_tp}"

    def in_step(self, r: int) -> str:
        """A request of the step in progress, with its chunk when prefills take several."""
        q = self.reqs[r]
        return q.rid if self.cfg.chunks == 1 else f"{q.rid} chunk {q.chunk - 1}"

    # ------------------------------------------------------------------ the trace record
    def note(self, where: str, text: str) -> None:
        """A note over a participant of the trace diagram (when recording)."""
        if self.recording:
            self.events.append(("note", where, text))

    def arrow(self, src: str, dst: str, text: str, dashed: bool = False) -> None:
        """A message arrow of the trace diagram (when recording)."""
        if self.recording:
            self.events.append(("arrow", src, dst, text, dashed))
