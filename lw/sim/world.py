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

The parts live in mixins: P's scheduler and forward pass (:mod:`lw.sim.pnode`), the data plane
(:mod:`lw.sim.datapath`), D's reports (:mod:`lw.sim.dnode`), faults, clock, D's memory
(:mod:`lw.sim.kvbytes`), the properties (:mod:`lw.sim.checks`) and descriptions
(:mod:`lw.sim.describe`); this module holds the state, the enabled actions, their dispatch and
the routing of the endpoints' effects.
"""

from __future__ import annotations

from lw.fsm import (
    DecodeEndpoint,
    Effect,
    PrefillEndpoint,
    PrefillRequest,
    ProtocolError,
    Quarantine,
    RecvDone,
    RecvFailed,
    Reprefill,
    SendFinished,
    WriteLayer,
    check_lease,
)
from lw.fsm.effects import SumPlan, Sums, TimerKey
from lw.fsm.interpreter import Report, perform
from lw.fsm.messages import (
    KVFormat,
    KVLayout,
    LayerLayout,
    Message,
    MetaReply,
    MetaRequest,
    Sender,
)
from lw.sim.checks import Checks
from lw.sim.clock import Clock
from lw.sim.clone import Cloner, Store
from lw.sim.config import (  # noqa: F401  (re-exported for the explorer and tests)
    FAULT_ACTIONS,
    FAULT_KINDS,
    HEAD_BYTES,
    Action,
    Owner,
    Plan,
    WorldConfig,
    Write,
    _layout,
    _owner,
    _p_layout,
    _who,
    d_addr,
    p_addr,
)
from lw.sim.datapath import DataPath
from lw.sim.describe import Describe
from lw.sim.dnode import DNode
from lw.sim.failover import Failover
from lw.sim.faults import Faults
from lw.sim.kvbytes import KVBytes, Memory
from lw.sim.network import MESSAGE_TYPES, MsgKey, Network, describe_key
from lw.sim.pnode import PNode
from lw.sim.properties import Violation
from lw.sim.request import Req
from lw.sim.variants import DESIGNS, Design
from lw.transport.wire import decode, encode

# Abstract time: the world may idle before these (P's engine busy or slow to start, schedule or
# compute a layer; in the fine-grained model only before the first hook of a layer, so that both
# models reach the same states); message and transfer delays are covered by timers firing while
# they are in flight, and by writes timing out.
SLOW = frozenset({"start", "schedule", "layer"})


class World(PNode, DataPath, DNode, Describe, Faults, Failover, Clock, Checks, KVBytes):
    """One state of the simulated cluster; mutated in place by :meth:`apply`."""

    def __init__(self, cfg: WorldConfig) -> None:
        self.cfg = cfg
        self.design: Design = DESIGNS[cfg.design]
        pcfg, dcfg = cfg.prefill_config(), cfg.decode_config()
        check_lease(dcfg, pcfg.request_timeout_s, cfg.transfer_timeout_s)
        self.store = Store()
        self.now = 0.0
        self.timers: dict[tuple[Owner, tuple[str, str]], float] = {}
        self.net = Network(self.store.msgs)
        self.tp = cfg.tp
        self.d_tp = cfg.d_tp
        self.plan = Plan.of(cfg)
        nw = cfg.dp * cfg.tp  # P workers: worker w is DP rank w // tp, TP rank w % tp
        ndw = cfg.d_dp * cfg.d_tp  # D workers: worker v is engine v // d_tp, TP rank v % d_tp
        self.quirks = self.design.quirks
        p_cls = self.design.prefill
        self.p = [p_cls(Sender(self.p_engine(w // cfg.tp), w, 1, p_addr(w)), cfg.layers, pcfg,
                        local=_p_layout(cfg, w, self.plan.p_fmts[w % cfg.tp]))
                  for w in range(nw)]
        self.d_inc = [1] * cfg.d_dp  # incarnation per D engine (a restart starts a new one)
        self.d = [self._new_decode(v, 1) for v in range(ndw)]
        self.restarts = 0
        self.p_alive = True
        self.dead_ranks: frozenset[int] = frozenset()  # P DP ranks that died (rank-crash)
        self.rank_lost_seen: frozenset[tuple[int, int]] = frozenset()  # (D worker, rank)
        self.d_alive = [True] * cfg.d_dp  # per D engine (a dead TP worker takes its engine)
        self.p_lost_seen = [False] * ndw  # D worker v called peer_lost for P
        self.d_lost_seen: set[tuple[int, int]] = set()  # (P worker, D engine) peer_lost called
        self.fifo: list[list[Write]] = [[] for _ in range(nw)]  # per P worker
        # Writes that failed "in doubt" (or were in flight at a P crash): their bytes may still
        # land in D's blocks until the deadline. (P worker, req, seq, D worker, remote, deadline)
        self.zombies: list[tuple[int, int, int, int, tuple[int, ...], float]] = []
        self.d_mem: Memory = {}  # whose bytes D's blocks hold (kv_checksum, late_writes)
        self.p_pool: list[list[int | None]] = [[None] * cfg.p_blocks for _ in range(cfg.dp)]
        self.d_pool: list[list[int | None]] = [[None] * cfg.d_blocks for _ in range(cfg.d_dp)]
        self.p_queue: list[list[int]] = [[] for _ in range(cfg.dp)]
        self.d_queue: list[list[int]] = [[] for _ in range(cfg.d_dp)]
        self.p_batch: list[list[int]] = [[] for _ in range(cfg.dp)]
        # Between steps: per DP rank, the requests whose prefill has chunks left to compute
        # (vLLM's running requests; the next step schedules them first, with their blocks).
        self.p_running: list[list[int]] = [[] for _ in range(cfg.dp)]
        self.p_free_pending: list[list[int]] = [[] for _ in range(cfg.dp)]
        self.phase: int | None = None  # next layer of the step in progress
        self.hooks_done = [False] * nw  # per worker, current layer (non-atomic mode)
        self.collectives = [0] * nw  # collective calls made per worker
        self.steps = 0
        self.reqs = [Req(i, i % cfg.dp, i % cfg.d_dp, cfg.tp, cfg.d_tp, cfg.hit(i),
                         cfg.chunk_sizes(cfg.blocks_per_request - cfg.hit(i)))
                     for i in range(cfg.requests)]
        self.arrived = 0
        self.faults_used = 0
        self.draining = False  # fair drain: no more faults, clock only when nothing else
        self.flags: set[str] = set()  # what happened in the last action (for "sometimes")
        self.free_why: dict[tuple[str, int, int], str] = {}  # (pool, rank, block): last free
        self.recording = False
        self.events: list[tuple] = []  # (kind, ...) for trace diagrams, when recording
        # quirk poll-on-step: completions P has not polled yet, per worker (req, seq, ok)
        self.unpolled: list[list[tuple[int, int, bool]]] = [[] for _ in range(nw)]
        # quirk serial-handshake: per P worker, the D address of the first contact in flight
        # and the MetaRequests held behind it (dest, message)
        self.lane: list[str | None] = [None] * nw
        self.held: list[list[tuple[str, MetaRequest]]] = [[] for _ in range(nw)]

    def _new_decode(self, v: int, incarnation: int) -> DecodeEndpoint:
        """D worker ``v`` of the given incarnation (a fresh process: nothing remembered)."""
        cfg = self.cfg
        return self.design.decode(Sender("D", v, incarnation, d_addr(v)),
                                  _layout(cfg, v, self.plan.d_fmts[v % cfg.d_tp], incarnation),
                                  cfg.decode_config())

    # ------------------------------------------------------------------ identity and copies
    def key(self) -> tuple:
        """Canonical hashable state (endpoint snapshots + world state, times relative to now)."""
        now = self.now
        budget = self.cfg.progress_budget()
        return (
            self.arrived, self.phase, tuple(self.hooks_done), self.p_alive, tuple(self.d_alive),
            tuple(self.p_lost_seen), tuple(sorted(self.d_lost_seen)), self.faults_used,
            tuple(sorted(self.dead_ranks)), tuple(sorted(self.rank_lost_seen)),
            tuple(sorted((k, round(at - now, 6)) for k, at in self.timers.items())),
            self.net.snapshot(),
            tuple(tuple((w[0], w[1], w[4], round(w[5] - now, 6), w[6]) for w in f)
                  for f in self.fifo),
            tuple(map(tuple, self.p_pool)), tuple(map(tuple, self.d_pool)),
            tuple(map(tuple, self.p_queue)), tuple(map(tuple, self.d_queue)),
            tuple(map(tuple, self.p_batch)), tuple(map(tuple, self.p_free_pending)),
            tuple(map(tuple, self.p_running)),
            tuple(sorted((z[0], z[1], z[2], z[3], round(z[5] - now, 6), z[6])
                         for z in self.zombies)),
            tuple(q.key(now, budget) for q in self.reqs),
            tuple(ep.snapshot() if self.rank_alive(w // self.tp) else None
                  for w, ep in enumerate(self.p)) if self.p_alive else None,
            tuple(ep.snapshot() if self.d_alive[v // self.d_tp] else None
                  for v, ep in enumerate(self.d)),
            tuple(self.d_inc), self.restarts, tuple(map(tuple, self.unpolled)),
            # PrefillEndpoint.snapshot() names the cached D layouts but not their incarnation,
            # which decides whether P asks again after a D restart: added here.
            tuple(tuple(sorted((a, lay.incarnation, lay.layers[0].base_addr)
                               for a, lay in ep.cached_layouts().items()))
                  for ep in self.p) if self.cfg.d_restarts else None,
            tuple(self.lane), tuple(tuple((d, m.req_id) for d, m in h) for h in self.held),
            self._memory_key(),
        )

    def cloner(self) -> Cloner:
        """A fast copier for this world and its descendants (immutable parts by reference)."""
        p_shared = ("declaration", "_table", "config", "me", "local", "fmt")
        d_shared = ("declaration", "_table", "config", "me", "layout")
        shared: dict[type, tuple[str, ...]] = {
            World: ("cfg", "design", "store", "plan", "quirks"),
            PrefillEndpoint: p_shared,
            DecodeEndpoint: d_shared,
            Network: ("msgs",),
        }
        shared[self.design.prefill] = p_shared  # a design's defect subclass, if any
        shared[self.design.decode] = d_shared
        by_ref = (Sender, KVLayout, LayerLayout, KVFormat, PrefillRequest, *MESSAGE_TYPES)
        return Cloner(self.store, shared, by_ref)

    # ------------------------------------------------------------------ queries
    def faults_on(self) -> bool:
        """Whether fault actions and free clock advances are enabled now."""
        return self.cfg.faults and not self.draining

    def workers_of(self, rank: int) -> range:
        """The P workers (TP ranks) of DP rank ``rank``."""
        return range(rank * self.tp, (rank + 1) * self.tp)

    def d_workers_of(self, d: int) -> range:
        """The D workers (TP ranks) of D engine ``d``."""
        return range(d * self.d_tp, (d + 1) * self.d_tp)

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

    def writers(self, q: Req, v: int) -> list[int]:
        """The P workers that write request ``q`` into D worker ``v`` (the sender plan)."""
        if not q.loads():
            return []
        ranks = self.plan.senders[v % self.d_tp]
        return [w for w in self.workers_of(q.p_rank) if w % self.tp in ranks]

    def _slow_for(self, acts: list[Action], rid: str) -> bool:
        """Whether P's engine could be slow before one of these actions of request ``rid``
        (the proxy starting it, P scheduling it, computing a layer of it)."""
        q = self.req_of(rid)
        if q is None:
            return False
        for a in acts:
            if a[0] not in SLOW and not (a[0] == "hook" and not any(self.hooks_done)):
                continue
            if a[0] == "start" and a[1] == q.idx:
                return True
            if a[0] == "schedule" and (q.idx in self.p_queue[q.p_rank]
                                       or q.idx in self.p_running[q.p_rank]):
                return True
            if a[0] in ("layer", "hook") and q.idx in self.p_batch[q.p_rank]:
                return True
        return False

    def enabled(self) -> list[Action]:
        """Every action enabled in this state, in a deterministic order."""
        cfg = self.cfg
        acts: list[Action] = []
        if self.arrived < cfg.requests:
            acts.append(("arrive",))
        for d in range(cfg.d_dp):
            if (self.d_alive[d] and self.d_queue[d]
                    and self.d_pool[d].count(None) >= cfg.blocks_per_request):
                acts.append(("alloc", d))
        if self.design.d_first and self.p_alive and self._first_live_rank() is not None:
            for q in self.reqs:
                if q.d_blocks is not None and not q.started and q.p_stage == "none":
                    acts.append(("start", q.idx))
        if self.p_alive:
            if self.phase is None:
                if any(self.rank_alive(i) and (self._schedulable(i) or self.p_running[i])
                       for i in range(cfg.dp)):
                    acts.append(("schedule",))
            else:
                blocked = self.blocked_hooks()
                if cfg.atomic_layers:
                    if not blocked:
                        acts.append(("layer",))
                else:
                    acts += [("hook", w) for w in range(len(self.p))
                             if not self.hooks_done[w] and w not in blocked]
                    if all(self.hooks_done):
                        acts.append(("barrier",))
        for key in self.net.keys():
            acts.append(("deliver", key))
        for w, fifo in enumerate(self.fifo):
            if fifo:
                acts.append(("complete", w))
                if cfg.unordered_writes:  # any write in flight may complete next
                    acts += [("complete", w, j) for j in range(1, len(fifo))]
        for q in self.reqs:
            if q.d_stage == "decoding":
                acts.append(("decode", q.idx))
        if not self.p_alive and cfg.p_loss_detection:
            acts += [("p_lost", v) for v in range(len(self.d))
                     if self.d_alive[v // self.d_tp] and not self.p_lost_seen[v]]
        if self.p_alive:
            acts += [("d_lost", w, d) for w in range(len(self.p)) for d in range(cfg.d_dp)
                     if not self.d_alive[d] and (w, d) not in self.d_lost_seen
                     and self.rank_alive(w // self.tp)]
        if self.dead_ranks:
            acts += self._rank_lost_actions()
        if cfg.retry_prefill:
            acts += self._reprefill_actions()
        if self.restarts < cfg.d_restarts and not self.draining:
            acts += [("restart_d", d) for d in range(cfg.d_dp) if not self.d_alive[d]]
        faults = self.faults_on()
        if faults and self.faults_used < cfg.max_faults:
            acts += self._fault_actions()
        if (faults and cfg.delays) or not acts:
            acts += self._due_timers()
            if faults and cfg.delays and cfg.abstract_time:
                acts += self._idle(acts)
        # Late bytes land at any moment, independent of the clock: even a timely clock moves
        # while they are pending (so leases expire before they land).
        return acts + self._zland_actions()

    # ------------------------------------------------------------------ apply
    def apply(self, a: Action) -> None:
        """Perform one enabled action, then check the safety properties (raises Violation)."""
        self.flags = set()
        kind = a[0]
        if kind in FAULT_ACTIONS:
            self.faults_used += 1
        handler = getattr(self, "_do_" + kind)
        try:
            handler(*a[1:])
        except ProtocolError as exc:
            raise Violation("core-protocol-error", str(exc)) from exc
        except (AssertionError, LookupError, TypeError, ValueError) as exc:
            raise Violation("core-protocol-error", f"{_where_raised(exc)} raised "
                                                   f"{type(exc).__name__}: {exc}") from exc
        self.check_safety()

    def _note(self, where: str, text: str) -> None:
        if self.recording:
            self.events.append(("note", where, text))

    def _arrow(self, src: str, dst: str, text: str, dashed: bool = False) -> None:
        if self.recording:
            self.events.append(("arrow", src, dst, text, dashed))

    def _do_arrive(self) -> None:
        q = self.reqs[self.arrived]
        self.arrived += 1
        d = q.d_rank
        if self.d_alive[d]:
            self.d_queue[d].append(q.idx)
            q.d_stage = "waiting"
            self._arrow("Proxy", self.dpart(d), f"allocate {q.rid}")
        else:
            q.d_stage = "lost"
            q.touched = True
        if not self.design.d_first:
            if self.p_alive:
                self.p_queue[q.p_rank].append(q.idx)
                q.p_stage = "queued"
                q.started = True
                self._arrow("Proxy", f"P{q.p_rank * self.tp}", f"prefill {q.rid}")
            else:
                q.p_stage = "lost"

    def _do_alloc(self, d: int) -> None:
        r = self.d_queue[d].pop(0)
        q = self.reqs[r]
        pool = self.d_pool[d]
        blocks = tuple([b for b, o in enumerate(pool) if o is None][:self.cfg.blocks_per_request])
        for b in blocks:
            pool[b] = r
        q.d_blocks = blocks
        q.d_stage = "allocated"
        q.t_alloc = self.now
        q.d_inc = self.d_inc[d]
        if not q.loads() and "full-hit-waits" in self.quirks:
            # vLLM #56640: the full hit is still registered as a request to load.
            self._note(self.dpart(d), f"{q.rid} gets block(s) {list(blocks)}: full prefix-cache "
                                      "hit, but registered as loading")
            for v in self.d_workers_of(d):
                self._effects(("d", v), self.d[v].add_request(
                    q.rid, blocks, self.plan.senders[v % self.d_tp], self.now))
        elif not q.loads():
            # Every block is in D's prefix cache: nothing to load, D decodes at once (the
            # stranded request of vLLM #56640 waited here for a transfer that never comes).
            q.d_stage = "decoding"
            self.flags.add("done")
            self._note(self.dpart(d), f"{q.rid} gets block(s) {list(blocks)}: full prefix-cache "
                                      "hit, decoding")
        else:
            cached = f", {list(q.d_cached)} cached" if q.hit else ""
            self._note(self.dpart(d), f"{q.rid} gets block(s) {list(blocks)}{cached}")
            for v in self.d_workers_of(d):
                self._effects(("d", v), self.d[v].add_request(
                    q.rid, q.d_remote, self.plan.senders[v % self.d_tp], self.now))
        if not self.design.d_first and q.p_stage == "scheduled" and not q.p_added:
            self._p_add(q)

    def _do_start(self, r: int) -> None:
        q = self.reqs[r]
        if not self.rank_alive(q.p_rank):  # the proxy routes to a live P
            live = self._first_live_rank()
            assert live is not None
            q.p_rank = live
        q.started = True
        q.p_stage = "queued"
        self.p_queue[q.p_rank].append(r)
        self._arrow("Proxy", f"P{q.p_rank * self.tp}", f"prefill {q.rid}")
        self._route(q)

    def _do_deliver(self, key: MsgKey) -> None:
        msg = self.net.take(key)
        dest, src = key[0], key[1]
        if self.cfg.wire and decode(encode(msg)) != msg:
            raise Violation("core-protocol-error", f"{describe_key(key)} does not survive the "
                                                   "wire encoding")
        idx = int(dest[1:])
        self._arrow(_who(src), _who(dest), describe_key(key))
        if dest[0] == "p":
            if not self.rank_alive(idx // self.tp):
                return
            if isinstance(msg, MetaReply):
                q = self.req_of(msg.req_id)
                if q is not None and msg.status == "accepted":
                    q.accepted = q.accepted | {(idx, int(src[1:]))}
                if self.lane[idx] == src:  # serial-handshake: the first contact is answered
                    self._next_handshake(idx)
            self._effects(("p", idx), self.p[idx].on_message(msg, self.now))
        else:
            e = idx // self.d_tp
            if not self.d_alive[e]:
                return
            try:
                effects = self.d[idx].on_message(msg, self.now)
            except ProtocolError:
                q = self.req_of(msg.req_id)
                if q is None or q.d_inc == self.d_inc[e] or self.d[idx].state_of(q.rid):
                    raise
                # A message about a request of an earlier incarnation of this D: the new
                # process does not know it and the runtime drops what the core refuses.
                self._note(f"D{idx}", f"{msg.req_id} is unknown to this incarnation: dropped")
                return
            self._effects(("d", idx), effects)

    def req_of(self, rid: str) -> Req | None:
        """The world's request with this id, if it is one (a defect may send other ids)."""
        if rid[:1] == "r" and rid[1:].isdigit() and int(rid[1:]) < len(self.reqs):
            return self.reqs[int(rid[1:])]
        return None

    # ------------------------------------------------------------------ effects
    def _effects(self, owner: Owner, effects: list[Effect]) -> None:
        perform(effects, _WorldPorts(self, owner))  # the runtime's interpreter, the world's ports

    def _quarantine(self, idx: int, e: Quarantine) -> None:
        q = self.reqs[int(e.req_id[1:])]
        if tuple(e.block_ids) != q.d_remote:
            raise Violation("double-free", f"D{idx} quarantines blocks "
                                           f"{list(e.block_ids)} for {q.rid}, which "
                                           f"receives into {list(q.d_remote)}")
        q.quarantined = True
        q.t_dfail = self.now
        self._note(f"D{idx}", f"{e.req_id} FAILED, block(s) {list(e.block_ids)} quarantined")

    def _handshake(self, w: int, dest: str, msg: MetaRequest) -> None:
        """Quirk serial-handshake: one first contact in flight per P worker; others wait."""
        if self.lane[w] in (None, dest):
            self.lane[w] = dest
            self.net.add(p_addr(w), dest, msg)
        elif all(h != (dest, msg) for h in self.held[w]):
            self.held[w].append((dest, msg))
            self._note(f"P{w}", f"first contact with {_who(dest)} for {msg.req_id} waits behind "
                                f"the one with {_who(self.lane[w] or '')}")

    def _next_handshake(self, w: int) -> None:
        self.lane[w] = None
        held, self.held[w] = self.held[w], []
        for dest, msg in held:
            self._handshake(w, dest, msg)


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


class _WorldPorts:
    """The world's ports for :func:`lw.fsm.interpreter.perform`, for one endpoint (``owner``):
    messages into the network multiset, writes into the P worker's FIFO data plane, timers
    into the world's clock, reports into its bookkeeping and property checks, sums over the
    memory the world keeps (lw.sim.kvbytes), the endpoint for their answers."""

    __slots__ = ("idx", "kind", "me", "world")

    def __init__(self, world: World, owner: Owner) -> None:
        self.world = world
        self.kind, self.idx = owner
        self.me = p_addr(self.idx) if self.kind == "p" else d_addr(self.idx)

    def send(self, dest: str, msg: Message) -> None:
        w = self.world
        if self.kind == "p" and "serial-handshake" in w.quirks and isinstance(
                msg, MetaRequest) and msg.want_layout:
            w._handshake(self.idx, dest, msg)
        else:
            w.net.add(self.me, dest, msg)

    def write(self, writes: list[WriteLayer]) -> list[list[Effect]]:
        for e in writes:
            self.world._on_write(self.idx, e)
        return []  # the world's data plane fails writes later, as actions

    def arm(self, key: TimerKey, at: float) -> None:
        if self.world.design.timers:
            self.world.timers[((self.kind, self.idx), key)] = at

    def cancel(self, key: TimerKey) -> None:
        self.world.timers.pop(((self.kind, self.idx), key), None)

    def report(self, e: Report) -> None:
        w = self.world
        if isinstance(e, SendFinished):
            w._on_send_finished(self.idx, e)
        elif isinstance(e, RecvDone):
            w._on_recv_done(self.idx, e)
        elif isinstance(e, RecvFailed):
            w._on_recv_failed(self.idx, e)
        elif isinstance(e, Reprefill):
            w._on_reprefill(self.idx, e)
        else:
            w._quarantine(self.idx, e)

    def sum_blocks(self, layout: KVLayout, plan: SumPlan) -> list[list[int]]:
        return self.world._block_sums(self.idx, plan, len(layout.layers))

    def kept_sums(self, req_id: str, target: str, layers: int) -> list[list[int]]:
        return self.world._kept_sums(req_id, layers)

    def answer(self, sums: Sums) -> list[Effect]:
        w = self.world
        ep = w.p[self.idx] if self.kind == "p" else w.d[self.idx]
        return ep.on_sums(sums, w.now)
