"""Trace validation: is a recorded run a behaviour of the checked world?

Per request (the world cannot take a whole run's dozens of requests), the recorded timeline of
each worker is projected on that request and the world of one request in the run's shape (its
TP sizes, layers, blocks, chunks, deadlines, retry budgets) is searched, best first, for a
behaviour whose endpoints record the same events in the same order per worker. The world runs
the same endpoints with their timelines on, so "the world's action that produces an event" is
the action after which the endpoint recorded it. Unobserved steps (deliveries, drops, timers,
write completions of other workers, crashes) are filled in freely; a worker absent from the
trace (dead, frozen when asked) is unobserved. Faults are bounded; a search that runs out of
states or time, or whose fault budget binds, says ``undecided``, never a verdict.
"""

from __future__ import annotations

import dataclasses
import heapq
import re
import time
from dataclasses import dataclass, field
from typing import Any

from lw.contract.tracefile import Entry, Trace, WorkerTrace, joined, load, renames
from lw.fsm.decode_request import DecodeConfig
from lw.fsm.prefill_request import PrefillConfig
from lw.fsm.timeline import Timeline
from lw.sim.explorer import fingerprint
from lw.sim.properties import Violation
from lw.sim.validate_world import (  # noqa: F401  (re-exported: the validation world's API)
    ValidationConfig,
    ValidationWorld,
    failover_run,
    world_config,
)
from lw.sim.world import World

# Fault budgets tried in turn. One large budget: the search takes the successors with the fewest
# faults first, so a behaviour with few faults is still found first, and smaller budgets tried
# before it only repeated the same states. A rejection stands only where the budget did not bind.
BUDGETS = (16,)
MAX_BUDGET = BUDGETS[-1]
# The header's core settings, checked against the cores' declarations; the fields named here are
# the ones world_config reads without a default, so a trace must give them.
SETTINGS = {"prefill": (PrefillConfig, ("meta_retry_s", "meta_attempts", "ack_retry_s",
                                        "ack_attempts", "request_timeout_s")),
            "decode": (DecodeConfig, ("prefill_timeout_s", "lease_s"))}


def load_trace(path: str) -> Trace:
    """Read the ``lw-trace`` at ``path``, its core settings checked (TraceFormatError)."""
    return load(path, SETTINGS)


@dataclass(frozen=True)
class Obs:
    """One observation to explain: the worker it was recorded on and the entry."""

    worker: str
    entry: Entry


@dataclass
class RequestVerdict:
    """Outcome for one request: ``valid``, ``rejected`` or ``undecided`` (budget ran out)."""

    req: str
    outcome: str
    events: int  # recorded events of this request
    states: int = 0
    budget: int = 0  # the fault budget searched (faults<=N in reports)
    first: Obs | None = None  # the first recorded event no behaviour explains (rejected)
    allowed: list[str] = field(default_factory=list)  # what the model recorded there instead
    why: str = ""
    d_seen: bool = False  # some D process recorded events of the request


# World endpoint -> trace endpoint: ("P", world P worker: DP rank * P TP + TP rank) or
# ("D", TP rank, world incarnation)
Slot = tuple


def _reason(text: str) -> str:
    """The class of a failure reason: its first two words that name no one (``deadline of``,
    ``KV checksum``, ``decoder lost:``, ``decoder had``). Words with a digit or an address in
    them name engines, addresses and durations, which differ between the world and a run."""
    return " ".join([w for w in text.split() if "://" not in w
                     and not any(c.isdigit() for c in w)][:2])


# Events whose detail names a P engine, a claim epoch or P's TP rank: these must agree, the
# world's engine names (P, or P0, P1, ... with failover) read as the run's engines they stand
# for. Without it an accepted DONE of the wrong engine or epoch would pass as any DONE.
_NAMED = frozenset({"routed", "claim", "sender_done", "retry", "fence", "stale_epoch"})
_ENGINE = re.compile(r"(?:\bto P |^P |prefill engine |prefill sender \(')([^\s',)]+)")
_NUMBER = re.compile(r"\b(epoch|rank|current) (\d+)")


def _named(detail: str, names: dict[str, str] | None = None, tp: int = 0) -> tuple:
    """The engines and the numbered words (epoch, current, rank) a detail names; with ``names``
    a world's detail, its engines translated and its P worker numbers made TP ranks."""
    engines = _ENGINE.findall(detail)
    if names is not None:
        engines = [names.get(e, f"{e} (no engine of the run)") for e in engines]
    nums = [(k, int(n) % tp if k == "rank" and tp else int(n)) for k, n in
            _NUMBER.findall(detail)]
    return engines, nums


def _same(obs: Entry, ev: tuple, names: dict[str, str] | None = None, tp: int = 1) -> bool:
    """Whether the world's timeline entry ``ev`` records the observed event ``obs`` (``names``:
    the world's P engine names -> the run's, ``tp``: P's TP size)."""
    _t, _req, event, src, dst, detail = ev
    if (event, src, dst) != (obs.event, obs.src, obs.dst):
        return False
    d = str(detail)
    if event == "fail":  # why a request failed is the core's own text: its class must agree
        return _reason(d) == _reason(obs.detail)
    if event in _NAMED:
        return _named(obs.detail) == _named(d, names or {}, tp)
    # numbers (layers, chunks) must agree; other texts (addresses, counts) are the driver's
    return not (d.isdigit() and obs.detail.isdigit()) or d == obs.detail


def _show(ev: tuple, names: dict[str, str] | None = None, tp: int = 0) -> str:
    """A world's timeline entry in one line, in the run's names where ``names`` gives them."""
    _t, _req, event, src, dst, detail = ev
    d = str(detail)
    if names is not None and event in _NAMED:
        d = _ENGINE.sub(lambda m: m.group(0)[:m.start(1) - m.start(0)]
                        + names.get(m.group(1), m.group(1)), d)
        d = _NUMBER.sub(lambda m: f"{m.group(1)} " + (str(int(m.group(2)) % tp)
                                                      if m.group(1) == "rank" and tp
                                                      else m.group(2)), d)
    return f"{event} {src}->{dst}" + (f" ({d})" if d != "" else "")


def show(e: Entry) -> str:
    """An observed entry in one line."""
    return f"{e.event} {e.src}->{e.dst}" + (f" ({e.detail})" if e.detail else "")


FINAL = ("DONE", "FAILED")


def _live(entries: list[Entry]) -> list[Entry]:
    """P's entries of one request without the batch milestones after it ended: the runtime's
    layer hook records its whole batch, a request that already failed included, where the
    world's endpoint records only the requests it still holds (see ``_Search._advance``)."""
    out: list[Entry] = []
    ended = False
    for e in entries:
        if ended and e.event == "layer_computed":
            continue
        ended = ended or e.dst in FINAL
        out.append(e)
    return out


def _p_engines(trace: Trace, per: dict[int, list[Entry]]) -> list[str]:
    """The P engines of one request's attempts, first attempt first: as D's routing notices
    (by epoch) and claims name them, then any other P engine that recorded the request."""
    d_entries = sorted((e for n, es in per.items() if trace.workers[n].role == "decode"
                        for e in es), key=lambda e: e.t)
    routed = sorted((int(m.group(1)), e.t, m.group(2)) for e in d_entries
                    if e.event == "routed" and (m := _ROUTED.match(e.detail)))
    order: dict[str, None] = {}
    for _epoch, _t, eng in routed:
        order.setdefault(eng, None)
    for e in d_entries:
        if e.event in ("claim", "sender_done"):
            for eng in _ENGINE.findall(e.detail):
                order.setdefault(eng, None)
    firsts = sorted((es[0].t, trace.workers[n].engine) for n, es in per.items()
                    if trace.workers[n].role == "prefill")
    for _t, eng in firsts:
        order.setdefault(eng, None)
    return list(order)


_ROUTED = re.compile(r"^epoch (\d+) to P (\S+)$")


class _Projection:
    """One request's observations, per world endpoint (absent: unobserved). P engines are the
    world's DP ranks in the order of the request's attempts (one, unless the run fails over)."""

    def __init__(self, trace: Trace, rid: str, d_before: int = 0) -> None:
        """``d_before``: D processes of the request's engine that died before its first
        recorded D process (they left no event of it)."""
        self.rid = rid
        per: dict[int, list[Entry]] = {}
        for n, w in enumerate(trace.workers):
            # The first token moves no KV state and the world does not model it (yet): its
            # entries are not projected; the core's tests check it (tests/fsm/test_first_token).
            got = [e for e in w.entries if rid in e.reqs and e.event != "first_token"]
            if got:
                per[n] = got
        self.problem = ""
        self.engines = _p_engines(trace, per)
        d_engines = {trace.workers[n].engine for n in per if trace.workers[n].role == "decode"}
        if (len(self.engines) > 1 and not failover_run(trace)) or len(d_engines) > 1:
            self.problem = (f"recorded on {len(self.engines)} P and {len(d_engines)} D engines; "
                            "the world of one request has one D engine, and one P engine "
                            "unless the run has a prefill retry budget")
        self.obs: dict[Slot, list[Obs]] = {}
        d_eng = next(iter(d_engines), None)
        tp = int(trace.shape["prefill_tp"])
        # Which slots the trace observes: every live worker of the request's engines (a worker
        # with no event of this request must record none), incarnations in order of first event.
        d_incs: dict[int, list[WorkerTrace]] = {}
        for n, w in enumerate(trace.workers):
            if w.role == "prefill" and w.engine in self.engines:
                slot = ("P", self.engines.index(w.engine) * tp + w.rank)
                if slot in self.obs:
                    self.problem = (f"P engine {w.engine} rank {w.rank} recorded by two "
                                    "processes; P restarts are not modelled")
                self.obs[slot] = [Obs(w.name, e) for e in _live(per.get(n, []))]
            elif w.role == "decode" and w.engine == d_eng and n in per:
                d_incs.setdefault(w.rank, []).append(w)
        # per TP rank (each worker of a D process may carry its own incarnation number)
        inc_of: dict[tuple[int, int], int] = {}
        for rank, ws in d_incs.items():
            firsts = sorted((min(e.t for e in per[trace.workers.index(w)]), w.incarnation)
                            for w in ws)
            inc_of.update({(rank, inc): k + 1 + d_before
                           for k, (_t, inc) in enumerate(firsts)})
        self.d_incarnations = max(inc_of.values(), default=0)
        for n, w in enumerate(trace.workers):
            if w.role == "decode" and w.engine == d_eng and (w.rank, w.incarnation) in inc_of:
                slot = ("D", w.rank, inc_of[(w.rank, w.incarnation)])
                self.obs[slot] = [Obs(w.name, e) for e in per.get(n, [])]
        self.slots = sorted(self.obs)
        self.total = sum(len(v) for v in self.obs.values())


def request_ids(trace: Trace) -> list[str]:
    """Every request id the trace mentions, in order of first mention."""
    seen: dict[str, None] = {}
    for w in trace.workers:
        for e in w.entries:
            for r in e.reqs:
                seen.setdefault(r, None)
    return list(seen)


class _Search:
    """Best-first search of one request's world for a behaviour recording its observations."""

    def __init__(self, proj: _Projection, cfg: ValidationConfig, max_states: int,
                 deadline: float) -> None:
        self.proj = proj
        self.cfg = cfg
        self.max_states = max_states
        self.deadline = deadline
        self.visited: set[tuple[int, tuple[int, ...]]] = set()
        self.best = -1  # most observations explained by one behaviour so far
        self.best_pos: tuple[int, ...] = ()
        self.allowed: dict[tuple[Slot, int], set[str]] = {}  # what the world recorded instead
        self.bound = False  # some behaviour used the whole fault budget
        self.exhausted = ""
        self.names: dict[str, str] = {}  # the world's P engine names -> the run's

    def _slot(self, w: World, side: str, i: int) -> Slot:
        return ("P", i) if side == "p" else ("D", i, w.d_inc[i // w.d_tp])

    def _advance(self, w: World, pos: list[int]) -> bool:
        """Match what the endpoints recorded in the last action; False on a mismatch."""
        index = {s: k for k, s in enumerate(self.proj.slots)}
        ok = True
        for side, eps in (("p", w.p), ("d", w.d)):
            for i, ep in enumerate(eps):
                ring = ep.timeline.ring
                if not ring:
                    continue
                evs = list(ring)
                ring.clear()
                ep.timeline.durations.clear()
                slot = self._slot(w, side, i)
                k = index.get(slot)
                if k is None or not ok:
                    continue  # unobserved endpoint (dead or never asked)
                want = self.proj.obs[slot]
                ended = slot[0] == "P" and any(o.entry.dst in FINAL for o in want[:pos[k]])
                for ev in evs:
                    if ended and ev[2] == "layer_computed":
                        continue  # not projected after the request ended (_live)
                    if pos[k] < len(want) and _same(want[pos[k]].entry, ev, self.names,
                                                    w.tp):
                        pos[k] += 1
                        continue
                    self.allowed.setdefault((slot, pos[k]), set()).add(
                        _show(ev, self.names, w.tp))
                    ok = False
                    break
        return ok

    def _silenced(self, w: World, pos: list[int]) -> bool:
        """Whether an endpoint with recorded events still to explain can record no more (its
        process crashed or was replaced): no behaviour from here explains them."""
        for k, slot in enumerate(self.proj.slots):
            if pos[k] == len(self.proj.obs[slot]):
                continue
            if slot[0] == "P":
                if not w.rank_alive(slot[1] // w.tp):
                    return True
            elif w.d_inc[0] > slot[2] or (w.d_inc[0] == slot[2] and not w.d_alive[0]):
                return True
        return False

    def _silences(self, w: World, a: tuple, pos: tuple[int, ...]) -> bool:
        """Whether crash action ``a`` kills an endpoint with recorded events still to explain
        (what :meth:`_silenced` would cut after it; skipped before it is paid for)."""
        kind = a[0]
        if kind not in ("crash_p", "crash_rank", "crash_d"):
            return False
        for k, slot in enumerate(self.proj.slots):
            if pos[k] == len(self.proj.obs[slot]):
                continue
            if slot[0] == "P" and (kind == "crash_p" or (
                    kind == "crash_rank" and slot[1] // w.tp == a[1])):
                return True
            if slot[0] == "D" and kind == "crash_d" and slot[2] == w.d_inc[0]:
                return True
        return False

    def run(self) -> bool | None:
        """True: a behaviour found; False: none within the budget; None: out of states/time."""
        w0 = ValidationWorld(self.cfg)
        self.names = {w0.p_engine(k): e for k, e in enumerate(self.proj.engines[:self.cfg.dp])}
        cloner = w0.cloner()
        cloner.table.pop(Timeline, None)  # keep the timelines: they are the observations
        pos0 = [0] * len(self.proj.slots)
        if not self._advance(w0, pos0):
            return False
        # Two best-first orders take turns over one set of states: fewest faults first (every
        # behaviour with k faults before one with k + 1), and most explained first. Either alone
        # got lost somewhere: the first in the faultless space of a request whose P died
        # unobserved (24 s, kill-prefill-rank row), the second in the subtree of an early
        # needless fault (24 s for a mix-row request the first explains in 0.1 s). Ties of the
        # second go to the newest state (depth first), not to the fewest faults: a fenced
        # failover request waits for its one fault (the rank's crash) behind 28,000 faultless
        # states that explain no more (P's retries of an unobserved rank before D's deadline):
        # 52 s that way, 0.4 s (346 states) depth first.
        blob0 = cloner.dumps(w0)
        heaps: tuple[list, list] = ([(0, -sum(pos0), 0.0, 0, blob0, tuple(pos0))],
                                    [(-sum(pos0), 0, 0.0, 0, blob0, tuple(pos0))])
        expanded: set[int] = set()
        want = [len(self.proj.obs[s]) for s in self.proj.slots]
        popped = 0
        while heaps[0] or heaps[1]:
            popped += 1
            heap = heaps[popped & 1] or heaps[1 - (popped & 1)]
            _a, _b, _t, n, blob, pos = heapq.heappop(heap)
            if n in expanded:
                continue  # the other order took it first
            expanded.add(n)
            done = sum(pos)
            if done > self.best:
                self.best, self.best_pos = done, pos
            if list(pos) == want:
                return True
            if len(self.visited) >= self.max_states:
                self.exhausted = f"state budget {self.max_states}"
                return None
            if (popped & 63) == 0 and time.monotonic() > self.deadline:
                self.exhausted = "time budget"
                return None
            w = cloner.loads(blob)
            if w.faults_used >= self.cfg.max_faults and (
                    self.cfg.fault_kinds or self.cfg.suspect):
                self.bound = True
            for a in w.enabled():
                if self._silences(w, a, pos):
                    continue
                w2 = cloner.loads(blob)
                try:
                    w2.apply(a)
                except Violation:
                    continue  # the checked properties exclude these behaviours
                p2 = list(pos)
                if not self._advance(w2, p2) or self._silenced(w2, p2):
                    continue
                key = (fingerprint(w2), tuple(p2))
                if key in self.visited:
                    continue
                self.visited.add(key)
                b2, n2, t2 = cloner.dumps(w2), len(self.visited), tuple(p2)
                heapq.heappush(heaps[0], (w2.faults_used, -sum(p2), w2.now, n2, b2, t2))
                heapq.heappush(heaps[1], (-sum(p2), -n2, 0, n2, b2, t2))
        return False


def validate_request(trace: Trace, rid: str, max_states: int = 200_000,
                     seconds: float = 30.0) -> RequestVerdict:
    """Search the world of request ``rid`` for a behaviour that records its observations. In a
    run with crashes, a request whose P declared its decoder lost where no behaviour explains it
    is searched once more with one D process before its recorded ones that died (a D restart
    the request did not see, but its P did)."""
    deadline = time.monotonic() + seconds
    first = _validate_once(trace, rid, max_states, deadline, 0)
    complete = (first.outcome == "rejected"
                or first.why == f"no behaviour within {MAX_BUDGET} faults")
    # Only where the first event left unexplained is P declaring its decoder lost: a second
    # search costs as much as the first again (120 s for a planted failover defect otherwise).
    late = (first.first is not None and first.first.entry.event == "fail"
            and _reason(first.first.entry.detail) == "decoder lost:")
    if not complete or not late or "crash" not in trace.faults or not first.d_seen:
        return first  # valid, out of time or states, or not a D death P noticed late
    again = _validate_once(trace, rid, max_states, deadline, 1)
    if again.outcome == "valid":
        again.states += first.states
        return again
    return first


def _validate_once(trace: Trace, rid: str, max_states: int, deadline: float,
                   d_before: int) -> RequestVerdict:
    proj = _Projection(trace, rid, d_before)
    v = RequestVerdict(rid, "valid", proj.total)
    v.d_seen = proj.d_incarnations > 0
    if proj.problem:
        v.outcome, v.why = "undecided", proj.problem
        return v
    if proj.total == 0:
        return v
    # With no D event recorded, the request's D may have died (no timeline) and a restart the
    # trace does not show answered it "unknown"; with events, each recorded incarnation of its
    # D engine is one (and each that died before them, ``d_before``).
    restarts = (proj.d_incarnations - 1 if proj.d_incarnations
                else 1 if "crash" in trace.faults else 0)
    last: _Search | None = None
    for budget in BUDGETS:
        cfg = world_config(trace, budget, restarts, len(proj.engines), rid)
        s = _Search(proj, cfg, max_states, deadline)
        found = s.run()
        v.states += len(s.visited)
        v.budget = budget
        last = s
        if found:
            return v
        if found is None:
            v.outcome, v.why = "undecided", s.exhausted
            break
        if not s.bound:
            v.outcome = "rejected"
            break
    else:
        v.outcome, v.why = "undecided", f"no behaviour within {MAX_BUDGET} faults"
    assert last is not None
    if v.outcome == "rejected" or last.best >= 0:
        _first_unexplained(v, proj, last)
    return v


def _first_unexplained(v: RequestVerdict, proj: _Projection, s: _Search) -> None:
    """Name the earliest recorded event the best behaviour could not go on with."""
    pos = s.best_pos or tuple(0 for _ in proj.slots)
    cands = [(proj.obs[slot][pos[k]].entry.t, slot, k) for k, slot in enumerate(proj.slots)
             if pos[k] < len(proj.obs[slot])]
    if not cands:
        return
    _t, slot, k = min(cands)
    v.first = proj.obs[slot][pos[k]]
    v.allowed = sorted(s.allowed.get((slot, pos[k]), set()))


def validate(trace: Trace, max_states: int = 200_000, seconds: float = 30.0,
             only: list[str] | None = None) -> list[RequestVerdict]:
    """Validate every request of ``trace`` (or those in ``only``); a request computed ahead
    under another id first is validated once, under D's (tracefile.joined)."""
    names = renames(trace.workers)
    trace = dataclasses.replace(trace, workers=joined(trace.workers))
    known = request_ids(trace)
    ids = [names.get(rid, rid) for rid in only] if only else known
    missing = [rid for rid in ids if rid not in known]
    if missing:  # else it would read "valid (0 events)": nothing recorded is nothing refuted
        raise ValueError(f"no request {', '.join(map(repr, missing))} in the trace (it records "
                         f"{len(known)} request(s))")
    return [validate_request(trace, rid, max_states, seconds) for rid in ids]


def verdict_line(v: RequestVerdict) -> str:
    """One line per request for reports."""
    head = f"{v.req}: {v.outcome} ({v.events} events, {v.states} states, faults<={v.budget})"
    if v.first is not None and v.outcome != "valid":
        e = v.first.entry
        head += (f"; first unexplained: {v.first.worker} line {e.line} t={e.t:.6f} {show(e)}"
                 f"; the model allowed there: {', '.join(v.allowed) or 'no event of this worker'}")
    return head + (f" [{v.why}]" if v.why else "")


def summary(verdicts: list[RequestVerdict]) -> dict[str, Any]:
    """Counts per outcome."""
    out = {"valid": 0, "rejected": 0, "undecided": 0}
    for v in verdicts:
        out[v.outcome] += 1
    return out
