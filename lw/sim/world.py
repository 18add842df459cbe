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

from lw.fsm import (
    ArmTimer,
    CancelTimer,
    DecodeEndpoint,
    Effect,
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
from lw.fsm.lifecycles import AWAIT_DECODER_META
from lw.fsm.messages import KVFormat
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
from lw.sim.faults import Faults
from lw.sim.kvbytes import KVBytes, Memory
from lw.sim.network import MESSAGE_TYPES, MsgKey, Network, describe_key
from lw.sim.properties import Violation
from lw.sim.request import Req
from lw.sim.variants import DESIGNS, Design
from lw.transport.wire import (
    DoneSending,
    KVLayout,
    LayerLayout,
    MetaReply,
    MetaRequest,
    Sender,
    decode,
    encode,
)

# Abstract time: the world may idle before these (P's engine busy or slow to start, schedule or
# compute a layer; in the fine-grained model only before the first hook of a layer, so that both
# models reach the same states); message and transfer delays are covered by timers firing while
# they are in flight, and by writes timing out.
SLOW = frozenset({"start", "schedule", "layer"})


class World(Faults, Clock, Checks, KVBytes):
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
        self.p = [p_cls(Sender("P", w, 1, p_addr(w)), cfg.layers, pcfg,
                        local=_p_layout(cfg, w, self.plan.p_fmts[w % cfg.tp]))
                  for w in range(nw)]
        self.d_inc = [1] * cfg.d_dp  # incarnation per D engine (a restart starts a new one)
        self.d = [self._new_decode(v, 1) for v in range(ndw)]
        self.restarts = 0
        self.p_alive = True
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
            tuple(sorted((k, round(at - now, 6)) for k, at in self.timers.items())),
            self.net.snapshot(),
            tuple(tuple((w[0], w[1], w[4], round(w[5] - now, 6), w[6]) for w in f)
                  for f in self.fifo),
            tuple(map(tuple, self.p_pool)), tuple(map(tuple, self.d_pool)),
            tuple(map(tuple, self.p_queue)), tuple(map(tuple, self.d_queue)),
            tuple(map(tuple, self.p_batch)), tuple(map(tuple, self.p_free_pending)),
            tuple(map(tuple, self.p_running)),
            tuple(sorted((z[0], z[1], z[2], z[3], round(z[5] - now, 6)) for z in self.zombies)),
            tuple(q.key(now, budget) for q in self.reqs),
            tuple(ep.snapshot() for ep in self.p) if self.p_alive else None,
            tuple(ep.snapshot() if self.d_alive[v // self.d_tp] else None
                  for v, ep in enumerate(self.d)),
            tuple(self.d_inc), self.restarts, tuple(map(tuple, self.unpolled)),
            # PrefillEndpoint.snapshot() names the cached D layouts but not their incarnation,
            # which decides whether P asks again after a D restart: added here.
            tuple(tuple(sorted((a, lay.incarnation, lay.layers[0].base_addr)
                               for a, lay in ep._layouts.items()))
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

    def _meta_ready(self, w: int, r: int) -> bool:
        st = self.p[w].state_of(self.reqs[r].rid)
        return st is not None and st != AWAIT_DECODER_META

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
                if any(self._schedulable(i) or self.p_running[i] for i in range(cfg.dp)):
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
                     if not self.d_alive[d] and (w, d) not in self.d_lost_seen]
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
            parts = [f"rank {i} " + (",".join(self._in_step(r) for r in self.p_batch[i])
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
        if kind == "zland":
            z = next(z for z in self.zombies if z[:4] == a[1:])
            return (f"LATE: the in-doubt bytes of {self.reqs[z[1]].rid} "
                    f"{self.what(z[1], z[2])} from P{z[0]} land in D{z[3]} block(s) "
                    f"{list(z[4])}")
        if kind == "zexp":
            z = next(z for z in self.zombies if z[:4] == a[1:])
            return (f"t={z[5]:g}: the in-doubt bytes of {self.reqs[z[1]].rid} "
                    f"{self.what(z[1], z[2])} from P{z[0]} can no longer land in D{z[3]}")
        if kind in ("complete", "fail_write", "wto"):
            j = (a[2] if len(a) > 2 else 0) if kind == "complete" else (
                a[3] if len(a) > 3 else 0)
            w = self.fifo[a[1]][j]
            how = {"complete": "lands in", "fail_write": "FAILS (injected) towards",
                   "wto": "times out (in doubt) towards"}[kind]
            if kind == "fail_write" and a[2]:
                how = "FAILS IN DOUBT (bytes may still land) towards"
            if kind == "complete" and not self.d_alive[w[4] // self.d_tp]:
                how = "fails (peer dead) towards"
            elif kind == "complete" and w[6] != self.d_inc[w[4] // self.d_tp]:
                how = "fails (peer restarted since) towards"
            return (f"{self.wname(a[1])}: write of {self.reqs[w[0]].rid} {self.what(w[0], w[1])} "
                    f"{how} D{w[4]} block(s) {list(w[3])}")
        if kind == "decode":
            q = self.reqs[a[1]]
            blocks = list(q.d_blocks or ())
            return f"{self.dname(q.d_rank)} finishes decoding {q.rid} and frees block(s) {blocks}"
        if kind == "timer":
            (ok, oi), (tk, rid) = a[1], a[2]
            return f"t={self.timers[(a[1], a[2])]:g}: {ok.upper()}{oi} timer {tk}({rid}) fires"
        if kind == "idle":
            return "time passes, to just before the next deadline"
        if kind == "restart_d":
            return (f"{self.dname(a[1])} restarts (incarnation {self.d_inc[a[1]] + 1}, a new "
                    "process with its memory registered anew)")
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
        q.started = True
        q.p_stage = "queued"
        self.p_queue[q.p_rank].append(r)
        self._arrow("Proxy", f"P{q.p_rank * self.tp}", f"prefill {q.rid}")

    def _do_schedule(self) -> None:
        if "poll-on-step" in self.quirks:  # the step polls the completions of its writes
            for w, done in enumerate(self.unpolled):
                self.unpolled[w] = []
                for r, seq, ok in done:
                    self._effects(("p", w), self.p[w].transfer_done(
                        self.reqs[r].rid, seq, ok, "" if ok else "peer gone", self.now))
        bpr = self.cfg.blocks_per_request
        for i in range(self.cfg.dp):
            # vLLM schedules its running requests first: each computes its next chunk, which
            # completes the next of its blocks (announced to every worker of the rank).
            running, self.p_running[i] = self.p_running[i], []
            for r in running:
                self.p_batch[i].append(r)
                self._next_chunk(self.reqs[r])
            pool = self.p_pool[i]
            while self.p_queue[i] and pool.count(None) >= bpr:
                r = self.p_queue[i].pop(0)
                q = self.reqs[r]
                blocks = tuple([b for b, o in enumerate(pool) if o is None][:bpr])
                for b in blocks:
                    pool[b] = r
                q.p_blocks = blocks  # all of them at once (vLLM allocates chunk by chunk)
                q.p_stage = "scheduled"
                q.chunk = 1
                self.p_batch[i].append(r)
                if self.design.d_first or q.d_blocks is not None:
                    self._p_add(q)
        self.phase = 0
        self.hooks_done = [False] * len(self.p)
        batches = "; ".join(f"P{i}: " + (",".join(self._in_step(r) for r in b) or "dummy")
                            for i, b in enumerate(self.p_batch))
        self._note(self._all_p(), f"step {self.steps + 1}: {batches}")

    def _next_chunk(self, q: Req) -> None:
        """The step now starting computes chunk ``q.chunk`` of ``q``: announce its blocks to
        every P worker of its rank (a chunk completing no block is not announced)."""
        c = q.chunk
        q.chunk += 1
        if not q.p_added or not q.announced(c):
            return
        local = self._p_sent(q)[q.span(c)]
        for w in self.workers_of(q.p_rank):
            self._effects(("p", w), self.p[w].add_chunk(q.rid, local, not q.more_chunks(),
                                                        self.now))

    def _p_sent(self, q: Req) -> tuple[int, ...]:
        """The P blocks whose KV goes to D's ``d_remote``, block for block."""
        if "front-trim" in self.quirks:  # vllm #48633 C3: align by trimming the front
            return (q.p_blocks or ())[:len(q.d_remote)]
        return q.p_local

    def _p_add(self, q: Req) -> None:
        assert q.p_blocks is not None and q.d_blocks is not None
        # Before any layer of the prefill is computed: at its first step (D first), or while
        # that step waits for D's metadata in the layer-0 hook (P first).
        assert q.chunk == 1, q.chunk
        q.p_added = True
        q.t_padd = self.now
        plan = self.plan
        base = q.d_rank * self.d_tp
        for w in self.workers_of(q.p_rank):
            # The D workers this TP rank writes into (none: MLA's idle ranks, a full prefix hit)
            js = plan.targets[w % self.tp] if q.loads() else ()
            n = len(plan.senders[js[0]]) if js else 1
            local = self._p_sent(q)[q.span(0)]  # the blocks its first chunk completes
            req = self.store.intern(PrefillRequest(
                q.rid, tuple(d_addr(base + j) for j in js), local, q.d_remote, n,
                final=not q.more_chunks()))
            self._effects(("p", w), self.p[w].add_request(req, self.now))

    def _in_step(self, r: int) -> str:
        """A request of the step in progress, with its chunk when prefills take several."""
        q = self.reqs[r]
        return q.rid if self.cfg.chunks == 1 else f"{q.rid} chunk {q.chunk - 1}"

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
        i = w // self.tp
        batch = self.p_batch[i]
        reqs = self.reqs
        # the requests whose chunk in this step is announced to the core (a first chunk that
        # completes no block is not: its layers are not reported for the request)
        rids = [reqs[r].rid for r in batch if reqs[r].announced(reqs[r].chunk - 1)]
        pool = self.p_pool[i]
        for r in batch:  # the forward pass writes the request's KV into its own blocks
            stolen = [b for b in reqs[r].p_blocks or () if pool[b] != r]
            if stolen:
                how = self.free_why.get(("P", i, stolen[0]), "?")
                raise Violation("use-after-free",
                                f"{self.wname(w)} computes layer {k} of {reqs[r].rid} into "
                                f"P block(s) {stolen}, freed ({how}) and now "
                                f"{_owner(pool[stolen[0]])}")
        if "shared-layer-slot" in self.quirks:
            L = self.cfg.layers
            for x in self.fifo[w]:  # a write of this chunk's other layer reads the slot
                q = reqs[x[0]]
                if x[0] in batch and q.chunk_of(x[1], L) == q.chunk - 1 and x[1] % L != k:
                    raise Violation("use-after-free",
                                    f"{self.wname(w)} computes layer {k} of "
                                    f"{reqs[x[0]].rid} into the physical KV slot its "
                                    f"{self.what(x[0], x[1])} write is still reading")
        try:
            effects = self.p[w].layer_computed(k, rids, self.now)
        except RuntimeError as exc:
            raise Violation("forward-never-waits",
                            f"layer hook of {self.wname(w)} raised {type(exc).__name__}: {exc}; "
                            "the worker dies inside the forward pass (its DP peers would wait "
                            "in the collective for ever)") from exc
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
        # end of the step: a request with chunks left stays running; the scheduler calls
        # request_finished for every request whose prefill completed
        self.phase = None
        self.hooks_done = [False] * len(self.p)
        self.steps += 1
        for i in range(self.cfg.dp):
            running = self.p_running[i]
            for r in self.p_batch[i]:
                if self.reqs[r].more_chunks():
                    running.append(r)
                elif self.design.free_on_request_finished:
                    self._free_p(i, r, "request_finished said free now")
            self.p_batch[i] = []
            # vLLM frees a request's blocks only once it is finished: one that P's workers
            # reported finished sending (failed) while it still computes waits for its end
            pending = self.p_free_pending[i]
            self.p_free_pending[i] = [r for r in pending if r in running]
            for r in pending:
                if r not in running:
                    self._free_p(i, r, "finished_sending")

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
                if self.cfg.kv_checksum and isinstance(msg, DoneSending):
                    effects = self.d[idx].on_message(msg, self.now, self._kv_sums(idx, msg))
                else:
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

    def _do_complete(self, i: int, j: int = 0) -> None:
        r, seq, _local, remote, v, _deadline, inc = self.fifo[i].pop(j)
        q = self.reqs[r]
        e = v // self.d_tp
        ok = self.d_alive[e] and inc == self.d_inc[e]
        if ok:
            layer = seq % self.cfg.layers
            q.landed = q.landed | {(i, v, layer, b) for b in remote}
            self._land(i, r, layer, v, remote)
            self._arrow(f"P{i}", f"D{v}", f"KV {q.rid} {self.what(r, seq)} -> block(s) "
                                          f"{list(remote)}", dashed=True)
        if "poll-on-step" in self.quirks:  # noticed only when P's engine steps next
            self.unpolled[i].append((r, seq, ok))
            return
        self._effects(("p", i), self.p[i].transfer_done(q.rid, seq, ok, "" if ok else
                                                        "peer gone", self.now))

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

    # ------------------------------------------------------------------ effects
    def _effects(self, owner: Owner, effects: list[Effect]) -> None:
        kind, idx = owner
        me = p_addr(idx) if kind == "p" else d_addr(idx)
        for e in effects:
            if isinstance(e, Send):
                if kind == "p" and "serial-handshake" in self.quirks and isinstance(
                        e.msg, MetaRequest) and e.msg.want_layout:
                    self._handshake(idx, e.dest, e.msg)
                elif kind == "p" and self.cfg.kv_checksum and isinstance(e.msg, DoneSending):
                    self.net.add(me, e.dest, self._with_checksums(idx, e.msg))
                else:
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

    def _on_write(self, i: int, e: WriteLayer) -> None:
        q = self.reqs[int(e.req_id[1:])]
        v = _d_worker_of(e.layout)
        what = self.what(q.idx, e.seq)
        if (i, v) not in q.accepted:
            raise Violation("write-before-accept",
                            f"{self.wname(i)} submits a write of {q.rid} {what} before "
                            f"{self.dwname(v)} accepted it as a sender")
        if v // self.d_tp != q.d_rank or i not in self.writers(q, v):
            raise Violation("write-before-accept", f"{self.wname(i)} writes {q.rid} {what} into "
                                                   f"{self.dwname(v)}, which the sender plan "
                                                   "does not say it feeds")
        cached = sorted(set(e.remote_blocks) & set(q.d_cached))
        if cached:
            raise Violation("cached-block-written",
                            f"{self.wname(i)} writes {q.rid} {what} into D block(s) "
                            f"{cached}, which D serves from its prefix cache")
        self._check_placement(i, q, e)
        self._check_layout(i, q, v, e)
        if "staging-queue" in self.quirks and self.fifo[i]:
            raise Violation("p-memory-bounded",
                            f"{self.wname(i)} stages a copy of {q.rid} {what} while "
                            f"{len(self.fifo[i])} staged layer(s) still wait to be sent: the "
                            "queue of copies grows with every layer D is slower than compute")
        self.fifo[i].append((q.idx, e.seq, e.local_blocks, e.remote_blocks, v,
                             self.now + self.cfg.transfer_timeout_s, e.layout.incarnation))
        to = f" to D{v}" if self.d_tp > 1 else ""
        self._note(f"P{i}", f"write of {q.rid} {what}{to} submitted (in flight)")

    def _check_placement(self, i: int, q: Req, e: WriteLayer) -> None:
        """Property kv-placement: write ``seq`` (chunk * L + layer, the chunks counted as the
        core announces them) carries exactly that chunk's P blocks (those of the tokens D
        misses that it completes) and the D blocks that hold those tokens, block for block,
        and only once the forward pass computed that chunk's layer."""
        L = self.cfg.layers
        c, k = q.chunk_of(e.seq, L), e.seq % L
        who = f"{self.wname(i)} writes {q.rid} {self.what(q.idx, e.seq)}"
        if k != e.layer or not 0 <= c < len(q.sizes):
            raise Violation("kv-placement", f"{who} as layer {e.layer}: its prefill computes "
                                            f"{len(q.sizes)} chunk(s) of {L} layer(s)")
        span = q.span(c)
        local, remote = q.p_local[span], q.d_remote[span]
        if e.local_blocks != local or e.remote_blocks != remote:
            whose = "the tokens D misses" if len(q.sizes) == 1 else (
                f"the tokens D misses that chunk {c} completes")
            raise Violation("kv-placement",
                            f"{who} from P block(s) {list(e.local_blocks)} into D block(s) "
                            f"{list(e.remote_blocks)}; {whose} are in P block(s) {list(local)} "
                            f"and go to D block(s) {list(remote)}")
        now = q.chunk - 1  # the chunk P computes (or last computed)
        if c > now or (c == now and q.idx in self.p_batch[q.p_rank] and (
                self.phase is None or k > self.phase)):
            raise Violation("kv-placement", f"{who} before the forward pass computed it")

    def _check_layout(self, i: int, q: Req, v: int, e: WriteLayer) -> None:
        """Property layout-match: a write is addressed with its D worker's current layout (or
        with an earlier incarnation's, which fails), inside D's pool, with P's layer count and
        byte runs that fit both blocks."""
        cur = self.d[v].layout
        lay = e.layout
        who = f"{self.wname(i)}'s write of {q.rid} {self.what(q.idx, e.seq)} into {self.dwname(v)}"
        if lay.incarnation == cur.incarnation and lay != cur:
            raise Violation("layout-match", f"{who} uses a layout that is not D's own (the "
                                            "addresses of an earlier incarnation)")
        if len(lay.layers) != self.cfg.layers:
            raise Violation("layout-match", f"{who} uses a layout of {len(lay.layers)} layers; "
                                            f"P computes {self.cfg.layers}")
        n = min(self.cfg.d_blocks, cur.layers[min(e.layer, len(cur.layers) - 1)].num_blocks)
        past = [b for b in e.remote_blocks if not 0 <= b < n]
        if past:
            raise Violation("layout-match", f"{who} targets block(s) {past}, past the end of "
                                            f"D's {n} registered block(s)")
        mine = self.p[i].local
        if e.segments is not None and mine is not None:
            src, dst = mine.layers[e.layer].block_len, lay.layers[e.layer].block_len
            bad = [s for s in e.segments if s[0] + s[2] > src or s[1] + s[2] > dst]
            if bad:
                raise Violation("layout-match", f"{who} has byte runs {bad} outside the blocks "
                                                f"({src} bytes on P, {dst} on D)")

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
                                f"{self.what(w[0], w[1])} write is still in flight")
        if min(reports) == 0:
            return  # the scheduler frees only when every TP worker reported finished_sending
        i = q.p_rank
        if q.p_stage == "scheduled":
            q.p_stage = "finished"
        if q.p_freed:
            q.p_stage = "released"
        elif self.phase is None and q.idx not in self.p_batch[i] and (
                q.idx not in self.p_running[i]):
            self._free_p(i, q.idx, "finished_sending")
        else:  # vLLM frees between steps, and never a request it still computes (this step's
            # or one with chunks left: a send that failed early waits for the prefill's end)
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

    def _missing_kv(self, q: Req, v: int) -> tuple[list[tuple[int, int, int]], list[str]]:
        """(P worker, layer, D block) of the sender plan no write landed in D worker ``v``:
        every layer of every block it receives, whichever chunk wrote it; and the writes of
        ``q`` still in flight towards it."""
        want = {(w, k, b) for w in self.writers(q, v) for k in range(self.cfg.layers)
                for b in q.d_remote}
        missing = sorted(want - {(w, k, b) for w, x, k, b in q.landed if x == v})
        inflight = [self.what(w[0], w[1]) for f in self.fifo for w in f
                    if w[0] == q.idx and w[4] == v]
        return missing, inflight

    def _on_recv_done(self, v: int, e: RecvDone) -> None:
        q = self.reqs[int(e.req_id[1:])]
        self._recv_report(v, q, True)
        self._check_d_bound(v, q, self.cfg.d_timeout_s)
        missing, inflight = self._missing_kv(q, v)
        if missing or inflight:
            raise Violation("partial-kv",
                            f"D{v} reports {q.rid} done but no write landed for (P worker, "
                            f"layer, D block) {missing} (in flight: {inflight})")
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
                                f"{self.dname(q.d_rank)} decodes {q.rid} but no write landed "
                                f"in D{v} for (P worker, layer, D block) {missing} (in flight: "
                                f"{inflight})")
        self._check_fenced(q)
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
