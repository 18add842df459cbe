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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lw.fsm import (
    ArmTimer,
    CancelTimer,
    DecodeConfig,
    DecodeEndpoint,
    Effect,
    PrefillConfig,
    PrefillEndpoint,
    PrefillRequest,
    ProtocolError,
    Quarantine,
    RecvDone,
    RecvFailed,
    Send,
    SendFinished,
    WriteLayer,
    check_lease,
)
from lw.fsm.kvmap import expected_senders, make_format, targets_of, tp_problem
from lw.fsm.lifecycles import AWAIT_DECODER_META, DONE, FAILED, META_READY, layer_sent
from lw.fsm.messages import KVFormat
from lw.sim.clone import Cloner, Store
from lw.sim.network import MESSAGE_TYPES, MsgKey, Network, describe_key
from lw.sim.properties import Violation
from lw.sim.variants import DESIGNS, Design
from lw.transport.wire import (
    KVLayout,
    LayerLayout,
    MetaReply,
    Sender,
    decode,
    encode,
)

Action = tuple  # ("kind", *args): hashable, replayable
Owner = tuple[str, int]  # ("p", P worker) or ("d", D worker)
# A write in flight: (req index, layer, local blocks, remote blocks, D worker, deadline)
Write = tuple[int, int, tuple[int, ...], tuple[int, ...], int, float]
HEAD_BYTES = 4096  # bytes of one KV head in one block (layouts only; no bytes are moved)

FAULT_KINDS = ("drop", "dup", "write", "crash", "abort")
FAULT_ACTIONS = frozenset({"drop", "dup", "fail_write", "crash_p", "crash_d", "abort_d",
                           "abort_p"})


@dataclass(frozen=True)
class WorldConfig:
    """Bounds and switches of one world (everything the explorer's verdict depends on)."""

    design: str = "d-first"
    dp: int = 2  # P DP ranks
    tp: int = 1  # P workers per DP rank (TP); each writes the D TP ranks kvmap.targets_of says
    requests: int = 2
    layers: int = 2
    d_dp: int = 1  # D engines; request i goes to D engine i mod d_dp, P rank i mod dp
    d_tp: int = 1  # D TP workers per D engine (one scheduler, one block pool, shared block ids)
    d_blocks: int = 1  # blocks per D engine
    p_blocks: int = 1  # blocks per P rank
    blocks_per_request: int = 1
    mla: bool = False  # latent KV (one head replicated on every rank): one writer per D worker
    heads: int = 0  # the model's KV heads; 0: lcm(tp, d_tp) (MLA: the one latent head)
    # Per request index: how many of its first blocks D already holds in its prefix cache (not
    # written by P; missing entries 0). blocks_per_request is a full hit: nothing to transfer.
    prefix_hits: tuple[int, ...] = ()
    faults: bool = False
    fault_kinds: tuple[str, ...] = FAULT_KINDS
    max_faults: int = 1
    retries: int = 2  # meta_attempts and ack_attempts of P (small keeps the space finite)
    atomic_layers: bool = True  # the lock-step layer of all ranks as one action (sound reduction)
    wire: bool = True  # every delivered message crosses the real byte encoding
    # After a P crash its in-flight writes may still land (until transfer_timeout_s after the
    # crash), as bytes of a write that failed "in doubt" may (see zombies in World).
    crash_zombies: bool = True
    # D calls peer_lost when it learns that the P engine died (core finding 2 in
    # docs/checker.md); off: D relies on its deadline and lease alone.
    p_loss_detection: bool = True
    meta_retry_s: float = 1.0
    ack_retry_s: float = 1.0
    p_timeout_s: float = 30.0
    d_timeout_s: float = 60.0
    lease_s: float = 90.0
    transfer_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.design not in DESIGNS:
            raise ValueError(f"unknown design {self.design!r}; one of {', '.join(DESIGNS)}")
        for name in ("dp", "tp", "requests", "layers", "d_dp", "d_tp", "blocks_per_request",
                     "retries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("d_blocks", "p_blocks"):
            if getattr(self, name) < self.blocks_per_request:
                raise ValueError(f"{name} must be >= blocks_per_request")
        if self.max_faults < 0:
            raise ValueError("max_faults must be >= 0")
        bad = set(self.fault_kinds) - set(FAULT_KINDS)
        if bad:
            raise ValueError(f"unknown fault kinds {sorted(bad)}; known: {', '.join(FAULT_KINDS)}")
        if self.heads < 0:
            raise ValueError(f"heads must be >= 0, got {self.heads}")
        for side, n in (("P", self.tp), ("D", self.d_tp)):
            problem = tp_problem(n, self.kv_heads(), self.mla)
            if problem:
                raise ValueError(f"{side} TP {n}: {problem}")
        if len(self.prefix_hits) > self.requests:
            raise ValueError(f"{len(self.prefix_hits)} prefix hits given for "
                             f"{self.requests} requests")
        for h in self.prefix_hits:
            if not 0 <= h <= self.blocks_per_request:
                raise ValueError(f"a prefix hit must be 0..blocks_per_request="
                                 f"{self.blocks_per_request} blocks, got {h}")

    def kv_heads(self) -> int:
        """The model's KV heads in this world (MLA: one latent head)."""
        if self.mla:
            return 1
        return self.heads or math.lcm(self.tp, self.d_tp)

    def hit(self, idx: int) -> int:
        """Blocks of request ``idx`` that D already holds in its prefix cache."""
        return self.prefix_hits[idx] if idx < len(self.prefix_hits) else 0

    def prefill_config(self) -> PrefillConfig:
        """The P endpoints' deadlines and retry budgets in this world."""
        return PrefillConfig(meta_retry_s=self.meta_retry_s, meta_attempts=self.retries,
                             ack_retry_s=self.ack_retry_s, ack_attempts=self.retries,
                             request_timeout_s=self.p_timeout_s)

    def decode_config(self) -> DecodeConfig:
        """The D endpoints' deadline and lease in this world."""
        return DecodeConfig(prefill_timeout_s=self.d_timeout_s, lease_s=self.lease_s)

    def bounds(self) -> str:
        """One line with the bounds, for reports."""
        faults = (f"faults {','.join(self.fault_kinds)} (at most {self.max_faults}) + arbitrary "
                  "delays" if self.faults else "no faults")
        tp = f" x TP {self.tp}" if self.tp > 1 else ""
        d_tp = f" x TP {self.d_tp}" if self.d_tp > 1 else ""
        extra = ""
        if self.mla:
            extra += "MLA, "
        elif self.heads or self.tp > 1 or self.d_tp > 1:
            extra += f"{self.kv_heads()} KV head(s), "
        if any(self.prefix_hits):
            extra += f"D prefix hits {list(self.prefix_hits)} block(s), "
        return (f"P DP ranks {self.dp}{tp}, requests {self.requests}, layers {self.layers}, "
                f"D ranks {self.d_dp}{d_tp} x {self.d_blocks} block(s), P {self.p_blocks} "
                f"block(s)/rank, {self.blocks_per_request} block(s)/request, {extra}{faults}")


@dataclass(frozen=True)
class Plan:
    """Who writes what (from lw.fsm.kvmap): per TP rank formats, targets and expected senders."""

    p_fmts: tuple[KVFormat, ...]  # per P TP rank
    d_fmts: tuple[KVFormat, ...]  # per D TP rank
    targets: tuple[tuple[int, ...], ...]  # per P TP rank: the D TP ranks it writes into
    senders: tuple[frozenset[int], ...]  # per D TP rank: the P TP ranks that write into it

    @classmethod
    def of(cls, cfg: WorldConfig) -> Plan:
        """The sender plan of a world's P and D TP layouts."""
        def fmt(rank: int, size: int) -> KVFormat:
            return make_format(tp_rank=rank, tp_size=size, total_heads=cfg.kv_heads(),
                               block_tokens=1, dtype="bytes", mla=cfg.mla)

        p_fmts = tuple(fmt(t, cfg.tp) for t in range(cfg.tp))
        d_fmts = tuple(fmt(j, cfg.d_tp) for j in range(cfg.d_tp))
        return cls(p_fmts, d_fmts, tuple(targets_of(f, cfg.d_tp) for f in p_fmts),
                   tuple(expected_senders(f, cfg.tp) for f in d_fmts))


class Req:
    """The world's view of one request (what the schedulers and the client know)."""

    __slots__ = ("idx", "rid", "p_rank", "d_rank", "hit", "d_stage", "p_stage", "d_blocks",
                 "p_blocks", "started", "p_added", "landed", "send_reports", "send_ok",
                 "recv_reports", "recv_ok", "accepted", "quarantined", "p_freed", "t_alloc",
                 "t_padd", "t_dfail")

    def __init__(self, idx: int, p_rank: int, d_rank: int, tp: int, d_tp: int = 1,
                 hit: int = 0) -> None:
        self.idx = idx
        self.rid = f"r{idx}"
        self.p_rank = p_rank
        self.d_rank = d_rank  # the D engine
        self.hit = hit  # first blocks D serves from its prefix cache (never written by P)
        # D: new, waiting (for blocks), allocated, decoding, done, failed, aborted, lost
        self.d_stage = "new"
        # P: none, queued, scheduled, finished (SendFinished, free pending), released, aborted, lost
        self.p_stage = "none"
        self.d_blocks: tuple[int, ...] | None = None
        self.p_blocks: tuple[int, ...] | None = None
        self.started = False  # the proxy handed it to P
        self.p_added = False  # PrefillEndpoint.add_request was called
        # (P worker, D worker, layer) writes that landed in D
        self.landed: frozenset[tuple[int, int, int]] = frozenset()
        self.send_reports: tuple[int, ...] = (0,) * tp  # SendFinished per TP worker
        self.send_ok: tuple[bool, ...] = (False,) * tp
        self.recv_reports: tuple[int, ...] = (0,) * d_tp  # RecvDone/RecvFailed per D TP worker
        self.recv_ok: tuple[bool, ...] = (False,) * d_tp  # RecvDone per D TP worker
        # (P worker, D worker) pairs where P got MetaReply "accepted"
        self.accepted: frozenset[tuple[int, int]] = frozenset()
        self.quarantined = False
        self.p_freed = False
        self.t_alloc: float | None = None
        self.t_padd: float | None = None
        self.t_dfail: float | None = None

    def key(self, now: float) -> tuple:
        """Hashable content (times relative to ``now``)."""

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - now, 6)

        return (self.d_stage, self.p_stage, self.d_blocks, self.p_blocks, self.started,
                self.p_added, self.landed, self.send_reports, self.send_ok, self.recv_reports,
                self.recv_ok, self.accepted, self.quarantined, self.p_freed, rel(self.t_alloc),
                rel(self.t_padd), rel(self.t_dfail))

    def d_final(self) -> bool:
        """D side has nothing more to do for this request."""
        return self.d_stage in ("done", "failed", "aborted", "lost")

    def loads(self) -> bool:
        """D needs KV from P (not a full prefix-cache hit)."""
        return self.d_blocks is None or self.hit < len(self.d_blocks)

    @property
    def d_remote(self) -> tuple[int, ...]:
        """D blocks P writes into (after the prefix-cache hit)."""
        return (self.d_blocks or ())[self.hit:]

    @property
    def d_cached(self) -> tuple[int, ...]:
        """D blocks served from D's prefix cache: P must never write them."""
        return (self.d_blocks or ())[:self.hit]

    @property
    def p_local(self) -> tuple[int, ...]:
        """P blocks whose KV goes to D (those of the tokens D does not hold)."""
        return (self.p_blocks or ())[self.hit:]


def d_addr(v: int) -> str:
    """Side-channel address of D worker ``v`` (engine v // d_tp, TP rank v % d_tp)."""
    return f"d{v}"


def p_addr(i: int) -> str:
    """Side-channel address of P rank ``i``."""
    return f"p{i}"


class World:
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
        self.p = [PrefillEndpoint(Sender("P", w, 1, p_addr(w)), cfg.layers, pcfg,
                                  local=_p_layout(cfg, w, self.plan.p_fmts[w % cfg.tp]))
                  for w in range(nw)]
        self.d = [DecodeEndpoint(Sender("D", v, 1, d_addr(v)),
                                 _layout(cfg, v, self.plan.d_fmts[v % cfg.d_tp]), dcfg)
                  for v in range(ndw)]
        self.p_alive = True
        self.d_alive = [True] * cfg.d_dp  # per D engine (a dead TP worker takes its engine)
        self.p_lost_seen = [False] * ndw  # D worker v called peer_lost for P
        self.d_lost_seen: set[tuple[int, int]] = set()  # (P worker, D engine) peer_lost called
        self.fifo: list[list[Write]] = [[] for _ in range(nw)]  # per P worker
        # Writes that failed "in doubt" (or were in flight at a P crash): their bytes may still
        # land in D's blocks until the deadline. (P worker, req, layer, D worker, remote, deadline)
        self.zombies: list[tuple[int, int, int, int, tuple[int, ...], float]] = []
        self.p_pool: list[list[int | None]] = [[None] * cfg.p_blocks for _ in range(cfg.dp)]
        self.d_pool: list[list[int | None]] = [[None] * cfg.d_blocks for _ in range(cfg.d_dp)]
        self.p_queue: list[list[int]] = [[] for _ in range(cfg.dp)]
        self.d_queue: list[list[int]] = [[] for _ in range(cfg.d_dp)]
        self.p_batch: list[list[int]] = [[] for _ in range(cfg.dp)]
        self.p_free_pending: list[list[int]] = [[] for _ in range(cfg.dp)]
        self.phase: int | None = None  # next layer of the step in progress
        self.hooks_done = [False] * nw  # per worker, current layer (non-atomic mode)
        self.collectives = [0] * nw  # collective calls made per worker
        self.steps = 0
        self.reqs = [Req(i, i % cfg.dp, i % cfg.d_dp, cfg.tp, cfg.d_tp, cfg.hit(i))
                     for i in range(cfg.requests)]
        self.arrived = 0
        self.faults_used = 0
        self.draining = False  # fair drain: no more faults, clock only when nothing else
        self.flags: set[str] = set()  # what happened in the last action (for "sometimes")
        self.free_why: dict[tuple[str, int, int], str] = {}  # (pool, rank, block): last free
        self.recording = False
        self.events: list[tuple] = []  # (kind, ...) for trace diagrams, when recording

    # ------------------------------------------------------------------ identity and copies
    def key(self) -> tuple:
        """Canonical hashable state (endpoint snapshots + world state, times relative to now)."""
        now = self.now
        return (
            self.arrived, self.phase, tuple(self.hooks_done), self.p_alive, tuple(self.d_alive),
            tuple(self.p_lost_seen), tuple(sorted(self.d_lost_seen)), self.faults_used,
            tuple(sorted((k, round(at - now, 6)) for k, at in self.timers.items())),
            self.net.snapshot(),
            tuple(tuple((w[0], w[1], w[4], round(w[5] - now, 6)) for w in f) for f in self.fifo),
            tuple(map(tuple, self.p_pool)), tuple(map(tuple, self.d_pool)),
            tuple(map(tuple, self.p_queue)), tuple(map(tuple, self.d_queue)),
            tuple(map(tuple, self.p_batch)), tuple(map(tuple, self.p_free_pending)),
            tuple(sorted((z[0], z[1], z[2], z[3], round(z[5] - now, 6)) for z in self.zombies)),
            tuple(q.key(now) for q in self.reqs),
            tuple(ep.snapshot() for ep in self.p) if self.p_alive else None,
            tuple(ep.snapshot() if self.d_alive[v // self.d_tp] else None
                  for v, ep in enumerate(self.d)),
        )

    def cloner(self) -> Cloner:
        """A fast copier for this world and its descendants (immutable parts by reference)."""
        shared = {
            World: ("cfg", "design", "store", "plan"),
            PrefillEndpoint: ("declaration", "_table", "config", "me", "local", "fmt"),
            DecodeEndpoint: ("declaration", "_table", "config", "me", "layout"),
            Network: ("msgs",),
        }
        by_ref = (Sender, KVLayout, LayerLayout, KVFormat, PrefillRequest, *MESSAGE_TYPES)
        return Cloner(self.store, shared, by_ref)

    # ------------------------------------------------------------------ queries
    def faults_on(self) -> bool:
        """Whether fault actions and free clock advances are enabled now."""
        return self.cfg.faults and not self.draining

    def blocked_hooks(self) -> dict[int, list[str]]:
        """P workers whose layer hook cannot return now (only in a design whose hook waits)."""
        out: dict[int, list[str]] = {}
        if not self.design.hook_waits_for_meta or self.phase is None or not self.p_alive:
            return out
        for w in range(len(self.p)):
            if self.hooks_done[w]:
                continue
            waiting = [self.reqs[r].rid for r in self.p_batch[w // self.tp]
                       if not self._meta_ready(w, r)]
            if waiting:
                out[w] = waiting
        return out

    def workers_of(self, rank: int) -> range:
        """The P workers (TP ranks) of DP rank ``rank``."""
        return range(rank * self.tp, (rank + 1) * self.tp)

    def d_workers_of(self, d: int) -> range:
        """The D workers (TP ranks) of D engine ``d``."""
        return range(d * self.d_tp, (d + 1) * self.d_tp)

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

    def _meta_ready(self, w: int, r: int) -> bool:
        st = self.p[w].state_of(self.reqs[r].rid)
        return st is not None and st != AWAIT_DECODER_META

    def _schedulable(self, i: int) -> bool:
        return bool(self.p_queue[i]) and (
            self.p_pool[i].count(None) >= self.cfg.blocks_per_request)

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
        if self.design.d_first and self.p_alive:
            for q in self.reqs:
                if q.d_blocks is not None and not q.started and q.p_stage == "none":
                    acts.append(("start", q.idx))
        if self.p_alive:
            if self.phase is None:
                if any(self._schedulable(i) for i in range(cfg.dp)):
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
        for q in self.reqs:
            if q.d_stage == "decoding":
                acts.append(("decode", q.idx))
        if not self.p_alive and cfg.p_loss_detection:
            acts += [("p_lost", v) for v in range(len(self.d))
                     if self.d_alive[v // self.d_tp] and not self.p_lost_seen[v]]
        if self.p_alive:
            acts += [("d_lost", w, d) for w in range(len(self.p)) for d in range(cfg.d_dp)
                     if not self.d_alive[d] and (w, d) not in self.d_lost_seen]
        faults = self.faults_on()
        if faults and self.faults_used < cfg.max_faults:
            acts += self._fault_actions()
        if faults or not acts:
            acts += self._due_timers()
        return acts

    def _fault_actions(self) -> list[Action]:
        kinds = self.cfg.fault_kinds
        acts: list[Action] = []
        if "drop" in kinds:
            acts += [("drop", k) for k in self.net.keys()]
        if "dup" in kinds:
            acts += [("dup", k) for k in self.net.keys()]
        if "write" in kinds:
            acts += [("fail_write", w, doubt) for w, f in enumerate(self.fifo) if f
                     for doubt in (False, True)]
        if "crash" in kinds:
            if self.p_alive:
                acts.append(("crash_p",))
            acts += [("crash_d", d) for d in range(self.cfg.d_dp) if self.d_alive[d]]
        if "abort" in kinds:
            for q in self.reqs:
                if self._d_abortable(q):
                    acts.append(("abort_d", q.idx))
                if self._p_abortable(q):
                    acts.append(("abort_p", q.idx))
        return acts

    def _d_abortable(self, q: Req) -> bool:
        if q.d_stage in ("waiting", "decoding"):
            return True
        if q.d_stage == "allocated" and self.d_alive[q.d_rank]:
            for v in self.d_workers_of(q.d_rank):
                st = self.d[v].state_of(q.rid)
                if st is not None and st not in (DONE, FAILED):
                    return True
        return False

    def _p_abortable(self, q: Req) -> bool:
        if not self.p_alive or self.phase is not None:
            return False  # the scheduler handles aborts between steps
        if q.p_stage == "queued":
            return True
        if q.p_added and q.p_stage == "scheduled":
            for w in self.workers_of(q.p_rank):
                st = self.p[w].state_of(q.rid)
                if st is not None and st not in (DONE, FAILED):
                    return True
        return False

    def _due_timers(self) -> list[Action]:
        due: list[tuple[float, Action]] = [(at, ("timer", owner, key))
                                           for (owner, key), at in self.timers.items()]
        due += [(f[0][5], ("wto", i)) for i, f in enumerate(self.fifo) if f]
        due += [(z[5], ("zexp", z[0], z[1], z[2], z[3])) for z in self.zombies]
        if not due:
            return []
        first = min(at for at, _ in due)
        return [a for at, a in due if at == first]

    # ------------------------------------------------------------------ description
    def describe(self, a: Action) -> str:
        """Human text of an action, in the current state (before it is applied)."""
        kind = a[0]
        if kind == "arrive":
            q = self.reqs[self.arrived]
            if self.design.d_first:
                return f"client sends {q.rid}; proxy asks {self.dname(q.d_rank)} to allocate first"
            return (f"client sends {q.rid}; proxy starts it on P DP rank {q.p_rank} and "
                    f"{self.dname(q.d_rank)}")
        if kind == "alloc":
            q = self.reqs[self.d_queue[a[1]][0]]
            free = [b for b, o in enumerate(self.d_pool[a[1]]) if o is None]
            blocks = free[:self.cfg.blocks_per_request]
            hit = ""
            if q.hit:
                hit = (" (full prefix-cache hit: nothing to load)" if q.hit == len(blocks)
                       else f" ({blocks[:q.hit]} from its prefix cache)")
            return f"{self.dname(a[1])} allocates block(s) {blocks} for {q.rid}{hit}"
        if kind == "start":
            q = self.reqs[a[1]]
            return f"proxy starts the prefill of {q.rid} on P DP rank {q.p_rank}"
        if kind == "schedule":
            return f"P step {self.steps + 1} scheduled on every DP rank"
        if kind in ("layer", "hook"):
            ranks = range(self.cfg.dp) if kind == "layer" else [a[1] // self.tp]
            parts = [f"rank {i} " + (",".join(self.reqs[r].rid for r in self.p_batch[i])
                                     or "dummy") for i in ranks]
            what = "all workers" if kind == "layer" else self.wname(a[1])
            return f"P layer {self.phase} on {what} ({'; '.join(parts)})"
        if kind == "barrier":
            return f"P ranks pass the layer-{self.phase} collective"
        if kind in ("deliver", "drop", "dup"):
            key = a[1]
            verb = {"deliver": "deliver", "drop": "network DROPS",
                    "dup": "network DUPLICATES"}[kind]
            return f"{verb} {describe_key(key)} {_who(key[1])} -> {_who(key[0])}"
        if kind == "zexp":
            z = next(z for z in self.zombies if z[:4] == a[1:])
            return (f"t={z[5]:g}: the in-doubt bytes of {self.reqs[z[1]].rid} layer {z[2]} from "
                    f"P{z[0]} can no longer land in D{z[3]}")
        if kind in ("complete", "fail_write", "wto"):
            w = self.fifo[a[1]][0]
            how = {"complete": "lands in", "fail_write": "FAILS (injected) towards",
                   "wto": "times out (in doubt) towards"}[kind]
            if kind == "fail_write" and a[2]:
                how = "FAILS IN DOUBT (bytes may still land) towards"
            if kind == "complete" and not self.d_alive[w[4] // self.d_tp]:
                how = "fails (peer dead) towards"
            return (f"{self.wname(a[1])}: write of {self.reqs[w[0]].rid} layer {w[1]} {how} "
                    f"D{w[4]} block(s) {list(w[3])}")
        if kind == "decode":
            q = self.reqs[a[1]]
            blocks = list(q.d_blocks or ())
            return f"{self.dname(q.d_rank)} finishes decoding {q.rid} and frees block(s) {blocks}"
        if kind == "timer":
            (ok, oi), (tk, rid) = a[1], a[2]
            return f"t={self.timers[(a[1], a[2])]:g}: {ok.upper()}{oi} timer {tk}({rid}) fires"
        if kind == "p_lost":
            return f"{self.dwname(a[1])} detects that the P engine is gone (peer_lost)"
        if kind == "d_lost":
            return f"{self.wname(a[1])} detects that {self.dname(a[2])} is gone (peer_lost)"
        if kind == "crash_p":
            return "P engine CRASHES (all DP ranks: they share collectives)"
        if kind == "crash_d":
            return f"{self.dname(a[1])} CRASHES" + (" (all its TP workers)" if self.d_tp > 1
                                                    else "")
        if kind == "abort_d":
            return f"client aborts {self.reqs[a[1]].rid} on D"
        if kind == "abort_p":
            return f"client aborts {self.reqs[a[1]].rid} on P"
        return repr(a)

    def summary(self) -> list[str]:
        """A few lines describing the state (for stuck-state reports)."""
        lines = [f"t={self.now:g}; P step phase: "
                 f"{'idle' if self.phase is None else f'layer {self.phase}'}; P alive "
                 f"{self.p_alive}; D alive {self.d_alive}"]
        for q in self.reqs:
            pst = ",".join(str(self.p[w].state_of(q.rid)) for w in self.workers_of(q.p_rank)
                           ) if self.p_alive else "-"
            dst = ",".join(str(self.d[v].state_of(q.rid)) for v in self.d_workers_of(q.d_rank)
                           ) if self.d_alive[q.d_rank] else "-"
            lines.append(f"{q.rid}: D {q.d_stage} ({dst}), P {q.p_stage} ({pst})")
        lines.append(f"in flight: {len(self.net)} message(s), "
                     f"{sum(len(f) for f in self.fifo)} write(s); timers {len(self.timers)}")
        return lines

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
        if not q.loads():
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
        q.started = True
        q.p_stage = "queued"
        self.p_queue[q.p_rank].append(r)
        self._arrow("Proxy", f"P{q.p_rank * self.tp}", f"prefill {q.rid}")

    def _do_schedule(self) -> None:
        bpr = self.cfg.blocks_per_request
        for i in range(self.cfg.dp):
            pool = self.p_pool[i]
            while self.p_queue[i] and pool.count(None) >= bpr:
                r = self.p_queue[i].pop(0)
                q = self.reqs[r]
                blocks = tuple([b for b, o in enumerate(pool) if o is None][:bpr])
                for b in blocks:
                    pool[b] = r
                q.p_blocks = blocks
                q.p_stage = "scheduled"
                self.p_batch[i].append(r)
                if self.design.d_first or q.d_blocks is not None:
                    self._p_add(q)
        self.phase = 0
        self.hooks_done = [False] * len(self.p)
        batches = "; ".join(f"P{i}: " + (",".join(self.reqs[r].rid for r in b) or "dummy")
                            for i, b in enumerate(self.p_batch))
        self._note(self._all_p(), f"step {self.steps + 1}: {batches}")

    def _p_add(self, q: Req) -> None:
        assert q.p_blocks is not None and q.d_blocks is not None
        q.p_added = True
        q.t_padd = self.now
        plan = self.plan
        base = q.d_rank * self.d_tp
        for w in self.workers_of(q.p_rank):
            # The D workers this TP rank writes into (none: MLA's idle ranks, a full prefix hit)
            js = plan.targets[w % self.tp] if q.loads() else ()
            n = len(plan.senders[js[0]]) if js else 1
            req = self.store.intern(PrefillRequest(
                q.rid, tuple(d_addr(base + j) for j in js), q.p_local, q.d_remote, n))
            self._effects(("p", w), self.p[w].add_request(req, self.now))

    def _all_p(self) -> str:
        return "P0" if len(self.p) == 1 else f"P0,P{len(self.p) - 1}"

    def _do_layer(self) -> None:
        for w in range(len(self.p)):
            self._do_hook(w, note=False)
        self._note(self._all_p(), f"layer {self.phase} computed on every rank; collective")
        self._do_barrier()

    def _do_hook(self, w: int, note: bool = True) -> None:
        k = self.phase
        assert k is not None
        rids = [self.reqs[r].rid for r in self.p_batch[w // self.tp]]
        effects = self.p[w].layer_computed(k, rids, self.now)
        for e in effects:
            if not isinstance(e, WriteLayer):
                raise Violation("forward-never-waits",
                                f"layer hook of {self.wname(w)} returned {type(e).__name__}, "
                                "not only writes to enqueue")
        self.collectives[w] += 1
        self.hooks_done[w] = True
        if note:
            self._note(f"P{w}", f"layer {k} hook ({','.join(rids) or 'dummy'})")
        self._effects(("p", w), effects)

    def _do_barrier(self) -> None:
        k = self.phase
        assert k is not None
        live = set(self.collectives)
        if len(live) != 1:
            raise Violation("forward-never-waits",
                            f"DP ranks made different numbers of collective calls: "
                            f"{self.collectives}")
        if k + 1 < self.cfg.layers:
            self.phase = k + 1
            self.hooks_done = [False] * len(self.p)
            return
        # end of the step: the scheduler calls request_finished for every prefilled request
        self.phase = None
        self.hooks_done = [False] * len(self.p)
        self.steps += 1
        for i in range(self.cfg.dp):
            for r in self.p_batch[i]:
                if self.design.free_on_request_finished:
                    self._free_p(i, r, "request_finished said free now")
            self.p_batch[i] = []
            for r in self.p_free_pending[i]:
                self._free_p(i, r, "finished_sending")
            self.p_free_pending[i] = []

    def _free_p(self, i: int, r: int, why: str) -> None:
        q = self.reqs[r]
        if q.p_freed:
            if self.design.free_on_request_finished:
                return  # this scheduler already freed them at request_finished
            raise Violation("double-free", f"P rank {i} frees the blocks of {q.rid} twice")
        pool = self.p_pool[i]
        for b in q.p_blocks or ():
            if pool[b] != r:
                raise Violation("double-free",
                                f"P rank {i} frees block {b} of {q.rid} but it is owned by "
                                f"{_owner(pool[b])}")
            pool[b] = None
            self.free_why[("P", i, b)] = f"{why}, step {self.steps}"
        q.p_freed = True
        if q.p_stage == "finished":
            q.p_stage = "released"
        self._note(f"P{i}", f"scheduler frees block(s) {list(q.p_blocks or ())} of {q.rid} "
                            f"({why})")

    def _do_deliver(self, key: MsgKey) -> None:
        msg = self.net.take(key)
        dest, src = key[0], key[1]
        if self.cfg.wire and decode(encode(msg)) != msg:
            raise Violation("core-protocol-error", f"{describe_key(key)} does not survive the "
                                                   "wire encoding")
        idx = int(dest[1:])
        self._arrow(_who(src), _who(dest), describe_key(key))
        if dest[0] == "p":
            if not self.p_alive:
                return
            if isinstance(msg, MetaReply) and msg.status == "accepted":
                q = self.reqs[int(msg.req_id[1:])]
                q.accepted = q.accepted | {(idx, int(src[1:]))}
            self._effects(("p", idx), self.p[idx].on_message(msg, self.now))
        else:
            if not self.d_alive[idx // self.d_tp]:
                return
            self._effects(("d", idx), self.d[idx].on_message(msg, self.now))

    def _do_drop(self, key: MsgKey) -> None:
        self.net.take(key)
        self._note(_who(key[1]), f"network drops {describe_key(key)}")

    def _do_dup(self, key: MsgKey) -> None:
        self.net.duplicate(key)
        self._note(_who(key[1]), f"network duplicates {describe_key(key)}")

    def _do_complete(self, i: int) -> None:
        r, layer, _local, remote, v, _deadline = self.fifo[i].pop(0)
        q = self.reqs[r]
        if self.d_alive[v // self.d_tp]:
            q.landed = q.landed | {(i, v, layer)}
            self._arrow(f"P{i}", f"D{v}", f"KV {q.rid} layer {layer} -> block(s) {list(remote)}",
                        dashed=True)
            self._effects(("p", i), self.p[i].transfer_done(q.rid, layer, True, "", self.now))
        else:
            self._effects(("p", i), self.p[i].transfer_done(q.rid, layer, False, "peer gone",
                                                            self.now))

    def _do_fail_write(self, i: int, in_doubt: bool) -> None:
        r, layer, _l, remote, d, _dl = self.fifo[i].pop(0)
        q = self.reqs[r]
        self._note(f"P{i}", f"write of {q.rid} layer {layer} fails"
                   + (" in doubt (bytes may still land)" if in_doubt else ""))
        if in_doubt:
            self._zombie(i, r, layer, d, remote)
        self._effects(("p", i), self.p[i].transfer_done(q.rid, layer, False, "injected",
                                                        self.now, in_doubt))

    def _do_wto(self, i: int) -> None:
        r, layer, _l, remote, d, deadline = self.fifo[i].pop(0)
        self._tick(deadline)
        q = self.reqs[r]
        self._note(f"P{i}", f"t={deadline:g}: write of {q.rid} layer {layer} times out (in "
                            "doubt)")
        self._zombie(i, r, layer, d, remote)
        self._effects(("p", i), self.p[i].transfer_done(q.rid, layer, False, "transfer timeout",
                                                        self.now, True))

    def _zombie(self, i: int, r: int, layer: int, v: int, remote: tuple[int, ...]) -> None:
        """Bytes of a failed write that may still land in D's blocks for transfer_timeout_s."""
        if self.d_alive[v // self.d_tp]:
            self.zombies.append((i, r, layer, v, remote, self.now + self.cfg.transfer_timeout_s))

    def _do_zexp(self, i: int, r: int, layer: int, v: int) -> None:
        z = next(z for z in self.zombies if z[:4] == (i, r, layer, v))
        self.zombies.remove(z)
        self._tick(z[5])

    def _do_timer(self, owner: Owner, key: tuple[str, str]) -> None:
        at = self.timers.pop((owner, key))
        self._tick(at)
        kind, idx = owner
        self._note(f"{kind.upper()}{idx}", f"t={at:g}: timer {key[0]}({key[1]}) fires")
        if not self.cfg.faults:
            raise Violation("no-deadline-without-faults",
                            f"{kind.upper()}{idx}'s timer {key[0]}({key[1]}) fired at t={at:g} "
                            "in a run without faults")
        before = self._deadline_count()
        if kind == "p":
            self._effects(owner, self.p[idx].on_timer(key, self.now))
        else:
            self._effects(owner, self.d[idx].on_timer(key, self.now))
        if self._deadline_count() > before:
            self.flags.add("deadline")

    def _tick(self, at: float) -> None:
        if at < self.now:
            raise AssertionError(f"clock would go back from {self.now} to {at}")
        self.now = at

    def _deadline_count(self) -> int:
        n = sum(ep.counters["deadlines"] for ep in self.p)
        return n + sum(ep.counters["deadlines"] + ep.counters["leases_expired"] for ep in self.d)

    def _do_decode(self, r: int) -> None:
        q = self.reqs[r]
        self._free_d(q, "decode finished")
        q.d_stage = "done"

    def _free_d(self, q: Req, why: str) -> None:
        d = q.d_rank
        pool = self.d_pool[d]
        for b in q.d_blocks or ():
            if pool[b] != q.idx:
                raise Violation("double-free", f"{self.dname(d)} frees block {b} of {q.rid} but "
                                               f"it is owned by {_owner(pool[b])}")
            pool[b] = None
            self.free_why[("D", d, b)] = why
        self._note(self.dpart(d), f"frees block(s) {list(q.d_blocks or ())} of {q.rid} ({why})")

    def _do_crash_p(self) -> None:
        self.p_alive = False
        if self.cfg.crash_zombies:  # bytes already handed to the transport may still land
            for w, fifo in enumerate(self.fifo):
                for r, layer, _l, remote, d, _dl in fifo:
                    self._zombie(w, r, layer, d, remote)
        self.fifo = [[] for _ in self.p]  # the processes are gone: no new writes
        self.timers = {k: v for k, v in self.timers.items() if k[0][0] != "p"}
        self.net.drop_to([p_addr(w) for w in range(len(self.p))])
        self.phase = None
        self.p_queue = [[] for _ in range(self.cfg.dp)]
        self.p_batch = [[] for _ in range(self.cfg.dp)]
        self.p_free_pending = [[] for _ in range(self.cfg.dp)]
        for q in self.reqs:
            if q.p_stage in ("queued", "scheduled", "finished"):
                q.p_stage = "lost"
        self._note("P0", "P engine crashes")

    def _do_crash_d(self, d: int) -> None:
        self.d_alive[d] = False
        dead = self.d_workers_of(d)
        self.timers = {k: t for k, t in self.timers.items()
                       if not (k[0][0] == "d" and k[0][1] in dead)}
        self.net.drop_to([d_addr(v) for v in dead])
        self.zombies = [z for z in self.zombies if z[3] not in dead]
        self.d_queue[d] = []
        for q in self.reqs:
            if q.d_rank == d and not q.d_final():
                q.d_stage = "lost"
        self._note(self.dpart(d), "crashes")

    def _do_p_lost(self, v: int) -> None:
        self.p_lost_seen[v] = True
        self._effects(("d", v), self.d[v].peer_lost("P", "P engine crashed", self.now))

    def _do_d_lost(self, i: int, d: int) -> None:
        self.d_lost_seen.add((i, d))
        for v in self.d_workers_of(d):
            self._effects(("p", i), self.p[i].peer_lost(d_addr(v), "D crashed", self.now))

    def _do_abort_d(self, r: int) -> None:
        q = self.reqs[r]
        d = q.d_rank
        self._note(self.dpart(d), f"client aborts {q.rid}")
        if q.d_stage == "waiting":
            self.d_queue[d].remove(r)
            q.d_stage = "aborted"
        elif q.d_stage == "decoding":
            self._free_d(q, "decode aborted")
            q.d_stage = "done"
        else:  # the scheduler's abort reaches every TP worker of the engine
            for v in self.d_workers_of(d):
                self._effects(("d", v), self.d[v].abort(q.rid, "client gone", self.now))

    def _do_abort_p(self, r: int) -> None:
        q = self.reqs[r]
        i = q.p_rank
        self._note(f"P{i * self.tp}", f"client aborts {q.rid}")
        if q.p_stage == "queued":
            self.p_queue[i].remove(r)
            q.p_stage = "aborted"
        else:
            for w in self.workers_of(i):
                self._effects(("p", w), self.p[w].abort(q.rid, "client gone", self.now))

    # ------------------------------------------------------------------ effects
    def _effects(self, owner: Owner, effects: list[Effect]) -> None:
        kind, idx = owner
        me = p_addr(idx) if kind == "p" else d_addr(idx)
        for e in effects:
            if isinstance(e, Send):
                self.net.add(me, e.dest, e.msg)
            elif isinstance(e, WriteLayer):
                self._on_write(idx, e)
            elif isinstance(e, ArmTimer):
                if self.design.timers:
                    self.timers[(owner, e.key)] = e.at
            elif isinstance(e, CancelTimer):
                self.timers.pop((owner, e.key), None)
            elif isinstance(e, SendFinished):
                self._on_send_finished(idx, e)
            elif isinstance(e, RecvDone):
                self._on_recv_done(idx, e)
            elif isinstance(e, RecvFailed):
                self._on_recv_failed(idx, e)
            elif isinstance(e, Quarantine):
                q = self.reqs[int(e.req_id[1:])]
                if tuple(e.block_ids) != q.d_remote:
                    raise Violation("double-free", f"D{idx} quarantines blocks "
                                                   f"{list(e.block_ids)} for {q.rid}, which "
                                                   f"receives into {list(q.d_remote)}")
                q.quarantined = True
                q.t_dfail = self.now
                self._note(f"D{idx}", f"{e.req_id} FAILED, block(s) {list(e.block_ids)} "
                                      f"quarantined")
            else:  # pragma: no cover - the Effect union is closed
                raise AssertionError(f"unknown effect {e!r}")

    def _on_write(self, i: int, e: WriteLayer) -> None:
        q = self.reqs[int(e.req_id[1:])]
        v = _d_worker_of(e.layout)
        if (i, v) not in q.accepted:
            raise Violation("write-before-accept",
                            f"{self.wname(i)} submits a write of {q.rid} layer {e.layer} before "
                            f"{self.dwname(v)} accepted it as a sender")
        if v // self.d_tp != q.d_rank or i not in self.writers(q, v):
            raise Violation("write-before-accept", f"{self.wname(i)} writes {q.rid} layer "
                                                   f"{e.layer} into "
                                          f"{self.dwname(v)}, which the sender plan does not "
                                          "say it feeds")
        cached = sorted(set(e.remote_blocks) & set(q.d_cached))
        if cached:
            raise Violation("cached-block-written",
                            f"{self.wname(i)} writes {q.rid} layer {e.layer} into D block(s) "
                            f"{cached}, which D serves from its prefix cache")
        if e.local_blocks != q.p_local or e.remote_blocks != q.d_remote:
            raise Violation("use-after-free",
                            f"{self.wname(i)} writes {q.rid} from/to blocks other than its own")
        self.fifo[i].append((q.idx, e.layer, e.local_blocks, e.remote_blocks, v,
                             self.now + self.cfg.transfer_timeout_s))
        to = f" to D{v}" if self.d_tp > 1 else ""
        self._note(f"P{i}", f"write of {q.rid} layer {e.layer}{to} submitted (in flight)")

    def _on_send_finished(self, i: int, e: SendFinished) -> None:
        q = self.reqs[int(e.req_id[1:])]
        t = i % self.tp
        reports = list(q.send_reports)
        reports[t] += 1
        q.send_reports = tuple(reports)
        if reports[t] > 1:
            raise Violation("reported-twice", f"{self.wname(i)} reports {q.rid} finished twice")
        oks = list(q.send_ok)
        oks[t] = e.ok
        q.send_ok = tuple(oks)
        bound = self.cfg.p_timeout_s + self.cfg.transfer_timeout_s
        if self.design.timers and q.t_padd is not None and self.now - q.t_padd > bound + 1e-9:
            raise Violation("request-ends", f"{self.wname(i)} released {q.rid} "
                                            f"{self.now - q.t_padd:g} s after it started, beyond "
                                            f"request timeout + transfer timeout = {bound:g} s")
        self._note(f"P{i}", f"SendFinished({q.rid}, {'ok' if e.ok else 'failed'})")
        for w in self.fifo[i]:
            if w[0] == q.idx:
                raise Violation("use-after-free",
                                f"{self.wname(i)} released {q.rid} (SendFinished) while its "
                                f"layer {w[1]} write is still in flight")
        if min(reports) == 0:
            return  # the scheduler frees only when every TP worker reported finished_sending
        i = q.p_rank
        if q.p_stage == "scheduled":
            q.p_stage = "finished"
        if q.p_freed:
            q.p_stage = "released"
        elif self.phase is None and q.idx not in self.p_batch[i]:
            self._free_p(i, q.idx, "finished_sending")
        else:  # vLLM frees between steps (and never under the step that computes the request)
            self.p_free_pending[i].append(q.idx)

    def _recv_report(self, v: int, q: Req, ok: bool) -> None:
        """Count one D worker's RecvDone/RecvFailed for ``q`` (each reports exactly once)."""
        j = v % self.d_tp
        reports = list(q.recv_reports)
        reports[j] += 1
        q.recv_reports = tuple(reports)
        if reports[j] > 1 or not q.loads():
            raise Violation("reported-twice", f"D{v} reports {q.rid} finished "
                                              + ("twice" if q.loads() else
                                                 "but it had nothing to load"))
        if ok:
            oks = list(q.recv_ok)
            oks[j] = True
            q.recv_ok = tuple(oks)

    def _missing_kv(self, q: Req, v: int) -> tuple[list[tuple[int, int]], list[int]]:
        """(P worker, layer) writes of the sender plan not landed in D worker ``v``; and the
        layers of ``q`` still in flight towards it."""
        want = {(w, k) for w in self.writers(q, v) for k in range(self.cfg.layers)}
        missing = sorted(want - {(w, k) for w, x, k in q.landed if x == v})
        inflight = [w[1] for f in self.fifo for w in f if w[0] == q.idx and w[4] == v]
        return missing, inflight

    def _on_recv_done(self, v: int, e: RecvDone) -> None:
        q = self.reqs[int(e.req_id[1:])]
        self._recv_report(v, q, True)
        self._check_d_bound(v, q, self.cfg.d_timeout_s)
        missing, inflight = self._missing_kv(q, v)
        if missing or inflight:
            raise Violation("partial-kv",
                            f"D{v} reports {q.rid} done but layer writes {missing} have not "
                            f"landed (in flight: {inflight})")
        if self.d_tp > 1:
            self._note(f"D{v}", f"RecvDone({q.rid}): all its layers landed")
        self._d_settle(q)

    def _d_settle(self, q: Req) -> None:
        """The engine's scheduler: a request is finished receiving once every TP worker reported
        (vLLM aggregates finished_recving); DONE only if every worker was DONE."""
        if min(q.recv_reports) == 0:
            return
        if not all(q.recv_ok):
            self._free_d(q, "failed_recving")
            q.d_stage = "failed"
            q.quarantined = False
            return
        for v in self.d_workers_of(q.d_rank):
            missing, inflight = self._missing_kv(q, v)
            if missing or inflight:
                raise Violation("partial-kv",
                                f"{self.dname(q.d_rank)} decodes {q.rid} but layer writes "
                                f"{missing} have not landed in D{v} (in flight: {inflight})")
        q.d_stage = "decoding"
        self.flags.add("done")
        if self.d_tp == 1:
            self._note(self.dpart(q.d_rank), f"RecvDone({q.rid}): all layers landed; decoding")
        else:
            self._note(self.dpart(q.d_rank), f"{q.rid}: every TP worker is DONE; decoding")

    def _check_d_bound(self, v: int, q: Req, bound: float) -> None:
        if self.design.timers and q.t_alloc is not None and self.now - q.t_alloc > bound + 1e-9:
            raise Violation("request-ends", f"D{v} finished {q.rid} {self.now - q.t_alloc:g} s "
                                            f"after allocation, beyond its bound of {bound:g} s")

    def _on_recv_failed(self, v: int, e: RecvFailed) -> None:
        q = self.reqs[int(e.req_id[1:])]
        self._recv_report(v, q, False)
        if tuple(e.block_ids) != q.d_remote:
            raise Violation("double-free", f"D{v} releases blocks {list(e.block_ids)} for "
                                           f"{q.rid}, which receives into {list(q.d_remote)}")
        self._check_d_bound(v, q, self.cfg.d_timeout_s + self.cfg.lease_s)
        self._note(f"D{v}", f"RecvFailed({q.rid}): {e.reason[:60]}")
        self._d_settle(q)

    # ------------------------------------------------------------------ properties
    def check_safety(self) -> None:
        """The 'always' properties on this state; raises Violation."""
        L = self.cfg.layers
        tp, d_tp = self.tp, self.d_tp
        for z in self.zombies:
            self._check_owned(z[0] // tp, z[1], (), z[3] // d_tp, z[4],
                              f"in-doubt bytes of its layer {z[2]} write from P worker {z[0]} "
                              f"may land until t={z[5]:g}")
        for i, fifo in enumerate(self.fifo):
            for w in fifo:
                self._check_owned(i // tp, w[0], w[2], w[4] // d_tp, w[3],
                                  f"its layer {w[1]} write from P worker {i} is in flight")
        if not self.p_alive:
            return
        more = {AWAIT_DECODER_META, META_READY, *(layer_sent(k) for k in range(L - 1))}
        for i, ep in enumerate(self.p):
            for rid in ep.live_requests():
                st = ep.state_of(rid)
                if st in more or ep.inflight_writes(rid):
                    q = self.reqs[int(rid[1:])]
                    d_side = st != AWAIT_DECODER_META and st in more
                    self._check_owned(i // tp, q.idx, q.p_blocks or (), q.d_rank,
                                      q.d_blocks if d_side else (),
                                      f"it is {st} on {self.wname(i)} with "
                                      f"{ep.inflight_writes(rid)} write(s) in flight")

    def _check_owned(self, i: int, r: int, local: tuple[int, ...], d: int,
                     remote: tuple[int, ...] | None, why: str) -> None:
        rid = self.reqs[r].rid
        if self.p_alive:
            pool = self.p_pool[i]
            for b in local:
                if pool[b] != r:
                    how = self.free_why.get(("P", i, b), "?")
                    raise Violation("use-after-free",
                                    f"P rank {i} block {b} was freed ({how}) while {rid} may "
                                    f"still read it ({why}); it is now {_owner(pool[b])}")
        if remote and self.d_alive[d]:
            pool = self.d_pool[d]
            for b in remote:
                if pool[b] != r:
                    how = self.free_why.get(("D", d, b), "?")
                    raise Violation("use-after-free",
                                    f"{self.dname(d)} block {b} was freed ({how}) while {rid} may "
                                    f"still write into it ({why}); it is now {_owner(pool[b])}")

    def check_terminal(self) -> None:
        """The 'eventually' properties at a state where no action is enabled."""
        from lw.sim.properties import explain_stuck

        stuck = [q for q in self.reqs if not self._finished_both(q)]
        if stuck:
            names = ", ".join(q.rid for q in stuck)
            raise Violation("deadlock", f"no action is enabled but {names} never finished",
                            explain_stuck(self))
        for q in self.reqs:
            once = (1 if q.loads() else 0,) * self.d_tp  # a full prefix hit has nothing to load
            if self.d_alive[q.d_rank] and q.d_blocks is not None and q.recv_reports != once:
                raise Violation("request-ends", f"{q.rid} was reported {list(q.recv_reports)} "
                                                f"times by the workers of {self.dname(q.d_rank)}")
            if self.p_alive and q.p_added and any(n != 1 for n in q.send_reports):
                raise Violation("request-ends", f"{q.rid} was reported {q.send_reports} times "
                                                f"by the workers of P DP rank {q.p_rank}")
            if not self.cfg.faults and not ((all(q.recv_ok) or not q.loads()) and all(q.send_ok)
                                            and q.d_stage == "done"):
                raise Violation("request-ends", f"{q.rid} did not complete although there "
                                                "were no faults", self.summary())
        if self.p_alive:
            for i, pool in enumerate(self.p_pool):
                if any(o is not None for o in pool):
                    raise Violation("blocks-return", f"P rank {i} still holds blocks {pool}")
            for i, ep in enumerate(self.p):
                if ep.live_requests():
                    raise Violation("blocks-return",
                                    f"{self.wname(i)} still holds {ep.live_requests()}")
        for d, pool in enumerate(self.d_pool):
            if not self.d_alive[d]:
                continue
            if any(o is not None for o in pool):
                raise Violation("blocks-return", f"{self.dname(d)} still holds blocks {pool}")
            for v in self.d_workers_of(d):
                if self.d[v].live_requests():
                    raise Violation("blocks-return",
                                    f"D{v} still holds {self.d[v].live_requests()}")

    def _finished_both(self, q: Req) -> bool:
        d_ok = q.d_final() or not self.d_alive[q.d_rank]
        if not self.p_alive:
            return d_ok
        if q.p_stage in ("released", "aborted", "lost"):
            p_ok = True
        elif q.p_stage == "none":
            p_ok = not (self.design.d_first and q.d_blocks is not None)
        else:
            p_ok = False
        return d_ok and p_ok


def _layout(cfg: WorldConfig, v: int, fmt: KVFormat) -> KVLayout:
    """D worker ``v``'s KV layout: one block of HEAD_BYTES per head it holds, per layer."""
    n = HEAD_BYTES * (fmt.head_hi - fmt.head_lo)
    layers = [LayerLayout(0x1000_0000 + k * 0x100_0000, n, n, cfg.d_blocks)
              for k in range(cfg.layers)]
    return KVLayout("D", 1, f"d{v}-te:15000", layers, fmt)


def _p_layout(cfg: WorldConfig, w: int, fmt: KVFormat) -> KVLayout:
    """P worker ``w``'s own KV layout (its format is what its MetaRequests carry)."""
    n = HEAD_BYTES * (fmt.head_hi - fmt.head_lo)
    layers = [LayerLayout(0x2000_0000 + k * 0x100_0000, n, n, cfg.p_blocks)
              for k in range(cfg.layers)]
    return KVLayout("P", 1, f"p{w}-te:16000", layers, fmt)


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


def _d_worker_of(layout: KVLayout) -> int:
    """The D worker a WriteLayer goes to, from its layout's transfer-engine session."""
    return int(layout.te_session.split("-", 1)[0][1:])


def _who(addr: str) -> str:
    return addr[0].upper() + addr[1:]


def _owner(o: int | None) -> str:
    return "free" if o is None else f"owned by r{o}"
