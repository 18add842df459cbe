"""Exploration of the world: exhaustive BFS with state hashing, random walks, fair drain, replay.

The exhaustive search applies a sound partial-order reduction by default (lw/sim/reduce.py:
persistent singleton sets with the cycle proviso established by the acyclicity check, which is
then always on); ``explore(..., reduce=False)`` explores every interleaving.

States are stored as pickles whose shared immutable parts (declarations, dispatch tables,
configs, senders, layouts, messages) are kept by reference (lw/sim/clone.py), so a clone is a
``loads`` of a ~1 KB string (measured faster than ``copy.deepcopy``, see docs/benchmarks.md).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from lw.sim.properties import Violation
from lw.sim.reduce import (
    ARRIVE,
    faults_exhausted,
    inert_candidates,
    inert_detections,
    key_if,
    key_without_network,
)
from lw.sim.world import FAULT_ACTIONS, Action, World, WorldConfig


@dataclass
class Counterexample:
    """A violation and the actions that lead to it from the initial state."""

    violation: Violation
    actions: list[Action]


@dataclass
class Result:
    """What an exploration found and how much work it did."""

    cfg: WorldConfig
    mode: str
    states: int = 0
    transitions: int = 0
    terminal: int = 0
    max_depth: int = 0
    seconds: float = 0.0
    complete: bool = False  # exhaustive: the whole reachable space was explored
    walks: int = 0
    counterexample: Counterexample | None = None
    seen: set[str] = field(default_factory=set)  # "sometimes" flags observed
    stopped_by: str = ""
    acyclic: bool | None = None  # exhaustive with check_cycles: the state graph has no cycle
    reduced: int = 0  # states expanded through a persistent singleton (lw/sim/reduce.py)
    # keep_going: the first counterexample of each violated property
    violations: dict[str, Counterexample] = field(default_factory=dict)

    @property
    def states_per_s(self) -> float:
        """Distinct states (exhaustive) or steps (random) per second."""
        n = self.states if self.mode == "exhaustive" else self.transitions
        return n / self.seconds if self.seconds > 0 else 0.0

    def vacuity(self) -> Violation | None:
        """A 'sometimes' property that never happened (only meaningful without a violation)."""
        if self.counterexample is not None:
            return None
        if self.mode == "exhaustive" and not self.complete:
            return None
        if "done" not in self.seen:
            return Violation("sometimes-done", "no request ever reached DONE on both sides: "
                                               "the model is vacuous")
        if self.cfg.faults and set(self.cfg.fault_kinds) == {"stall"}:
            # a slow peer must fire no timer: the vacuity to rule out is a stall never judged
            if "stall" not in self.seen:
                return Violation("sometimes-deadline", "faults were stalls but no peer ever "
                                                       "stalled: the fault model is vacuous")
        elif self.cfg.faults and "deadline" not in self.seen:
            return Violation("sometimes-deadline", "faults were on but no deadline or lease "
                                                   "ever fired: the fault model is vacuous")
        return None


def explore(cfg: WorldConfig, max_states: int | None = None,
            max_seconds: float | None = None,
            on_state: Callable[[World], None] | None = None,
            edges: list[tuple[int, int]] | None = None, check_cycles: bool = False,
            reduce: bool = True, keep_going: bool = False, exact: bool = False,
            inert: bool = True) -> Result:
    """Breadth-first search of every reachable state; the first violation has a shortest trace
    (of the reduced graph; ``shorten`` then drops steps a reduction forced in).

    ``on_state`` is called with every new distinct state (tests use it to compare models);
    ``edges`` collects every transition as (state, successor) indices; ``check_cycles`` uses
    them to prove that every run ends (no cycle), which makes the terminal checks liveness.
    ``reduce`` applies the partial-order reduction of lw/sim/reduce.py (then the cycle check is
    always on: it establishes the reduction's cycle proviso). ``keep_going`` records the first
    violation of each property (``Result.violations``) and explores on, past violating states.
    ``exact`` deduplicates on the whole pickled world instead of its key (tests of the key).
    ``inert=False`` keeps only the arrival reduction (no inert deliveries or detections).
    """
    if reduce and cfg.d_restarts:
        # The arguments of lw/sim/reduce.py assume a dead endpoint stays dead: with D restarts
        # an arrival or a delivery to a dead D does not commute with its restart.
        reduce = False
    if reduce:
        check_cycles = True  # the cycle proviso (C3) of the reduction: see lw/sim/reduce.py
    if check_cycles and edges is None:
        edges = []
    t0 = time.perf_counter()
    res = Result(cfg, "exhaustive")
    w0 = World(cfg)
    cloner = w0.cloner()
    blob0 = cloner.dumps(w0)
    visited: dict[object, int] = {blob0 if exact else fingerprint(w0): 0}
    if on_state is not None:
        on_state(w0)
    parent: list[int] = [-1]
    via: list[Action | None] = [None]
    frontier: deque[tuple[int, int, bytes]] = deque([(0, 0, blob0)])
    loads = cloner.loads

    def trace(idx: int) -> list[Action]:
        out: list[Action] = []
        while idx > 0:
            a = via[idx]
            assert a is not None
            out.append(a)
            idx = parent[idx]
        out.reverse()
        return out

    def found(v: Violation, actions: list[Action]) -> bool:
        """Record a violation; True when the search must stop."""
        ce = Counterexample(v, actions)
        if res.counterexample is None:
            res.counterexample = ce
        res.violations.setdefault(v.prop, ce)
        return not keep_going

    def step(idx: int, depth: int, w2: World, a: Action) -> bool | None:
        """Apply ``a`` to ``w2`` (a copy of state ``idx``) and file the successor: None when
        the search must stop, False after a violation (keep_going), else True."""
        res.transitions += 1
        try:
            w2.apply(a)
        except Violation as v:
            return None if found(v, [*trace(idx), a]) else False
        if w2.flags:
            res.seen |= w2.flags
        if exact:
            b2 = cloner.dumps(w2)
            h: object = b2
        else:
            b2 = b""
            h = fingerprint(w2)
        seen_at = visited.get(h)
        if seen_at is not None:
            if edges is not None:
                edges.append((idx, seen_at))
            return True
        new = len(parent)
        visited[h] = new
        parent.append(idx)
        via.append(a)
        if edges is not None:
            edges.append((idx, new))
        frontier.append((new, depth + 1, b2 or cloner.dumps(w2)))
        if on_state is not None:
            on_state(w2)
        if depth + 1 > res.max_depth:
            res.max_depth = depth + 1
        return True

    def reduced_expand(w: World, blob: bytes, idx: int, depth: int, acts: list[Action],
                       ) -> tuple[list[Action], bool]:
        """Try the candidates for a persistent singleton (lw/sim/reduce.py) in a state where no
        fault can happen any more; each tried one is an ordinary successor. Returns the actions
        still to expand (none once a candidate proved inert) and whether to stop."""
        cands = inert_candidates(w, acts)
        base_net = key_without_network(w) if cands else ()
        for a in cands:
            w2 = loads(blob)
            ok = step(idx, depth, w2, a)
            if ok is None:
                return [], True
            acts = [b for b in acts if b != a]
            if ok and key_without_network(w2) == base_net:
                res.reduced += 1
                return [], False
        for a, mark in inert_detections(w, acts):
            base = key_if(w, mark)
            w2 = loads(blob)
            ok = step(idx, depth, w2, a)
            if ok is None:
                return [], True
            acts = [b for b in acts if b != a]
            if ok and w2.key() == base:
                res.reduced += 1
                return [], False
        return acts, False

    stop = False
    while frontier and not stop:
        idx, depth, blob = frontier.popleft()
        w = loads(blob)
        acts = w.enabled()
        if not acts:
            res.terminal += 1
            try:
                w.check_terminal()
            except Violation as v:
                stop = found(v, trace(idx))
            continue
        if reduce and ARRIVE in acts and w.design.d_first:
            acts = [ARRIVE]  # a persistent singleton in every state (lw/sim/reduce.py)
            res.reduced += 1
        elif reduce and inert and faults_exhausted(w):
            acts, stop = reduced_expand(w, blob, idx, depth, acts)
        for n, a in enumerate(acts):
            if stop:
                break
            w2 = w if n == len(acts) - 1 else loads(blob)
            stop = step(idx, depth, w2, a) is None
        if stop:
            break
        if max_states is not None and len(parent) >= max_states:
            res.stopped_by = f"state limit {max_states}"
            break
        if max_seconds is not None and (len(parent) & 63) == 0:
            if time.perf_counter() - t0 > max_seconds:
                res.stopped_by = f"time limit {max_seconds:g} s"
                break
    res.states = len(parent)
    res.complete = not stop and not res.stopped_by and (keep_going
                                                         or res.counterexample is None)
    if check_cycles and res.complete and edges is not None:
        res.acyclic = acyclic(len(parent), edges)
        if not res.acyclic:
            found(Violation("request-ends", "the state graph has a cycle: some run can go on "
                            "for ever without every request finishing (livelock)"), [])
    if reduce and res.counterexample is not None and res.counterexample.actions:
        res.counterexample = shorten(cfg, res.counterexample)
    res.seconds = time.perf_counter() - t0
    if res.counterexample is None:
        v = res.vacuity()
        if v is not None:
            res.counterexample = Counterexample(v, [])
    return res


def fingerprint(w: World) -> int:
    """64-bit fingerprint of a state's key, by hashing its text: ``hash`` of the key tuple itself
    collides systematically, since ``hash(-1) == hash(-2)`` in CPython (so ``hash(-1.0) ==
    hash(-2.0)``), and relative times of -1 s and -2 s are common (1 s retries). Found by the
    reduction comparison tests: two states differing only in such a time were merged."""
    return hash(repr(w.key()))


def shorten(cfg: WorldConfig, ce: Counterexample) -> Counterexample:
    """Drop steps a reduction forced into a trace (e.g. an early arrival) while the rest still
    replays to a violation of the same property: a shortest trace of the reduced graph need not
    be one of the full graph."""
    best = ce
    changed = True
    while changed:
        changed = False
        for i in range(len(best.actions) - 1, -1, -1):
            cand = best.actions[:i] + best.actions[i + 1:]
            try:
                _w, _run, _texts, v = replay(cfg, cand, record=False)
            except ValueError:  # a step is no longer enabled
                continue
            if v is not None and v.prop == best.violation.prop:
                best = Counterexample(v, cand)
                changed = True
                break
    return best


def acyclic(n: int, edges: list[tuple[int, int]]) -> bool:
    """Whether the transition graph has no cycle (Kahn's algorithm); then every maximal run
    ends in a state where nothing is enabled, and checking those states is liveness."""
    indeg = [0] * n
    succ: list[list[int]] = [[] for _ in range(n)]
    for a, b in edges:
        succ[a].append(b)
        indeg[b] += 1
    ready = [i for i in range(n) if indeg[i] == 0]
    seen = 0
    while ready:
        i = ready.pop()
        seen += 1
        for j in succ[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.append(j)
    return seen == n


def drain(w: World, max_steps: int = 20_000, done: list[Action] | None = None) -> list[Action]:
    """Fair drain: no more faults, deliver/complete everything, clock only when nothing else.

    Applies actions to ``w`` in place (first enabled each time, so it is deterministic),
    appending them to ``done``; raises Violation ("request-ends" for a drain that never ends).
    """
    w.draining = True
    done = [] if done is None else done
    for _ in range(max_steps):
        acts = w.enabled()
        if not acts:
            w.check_terminal()
            return done
        a = acts[0]
        done.append(a)
        w.apply(a)
    raise Violation("request-ends", f"fair drain did not reach a quiescent state in {max_steps} "
                                    "steps (livelock)", w.summary())


def random_walks(cfg: WorldConfig, seconds: float, seed: int = 0, max_depth: int = 300,
                 fault_rate: float = 0.1) -> Result:
    """Random walks (faults with probability ``fault_rate`` per step) each ended by a fair drain."""
    rng = random.Random(seed)
    t0 = time.perf_counter()
    res = Result(cfg, "random")
    seen_states: set[int] = set()
    while time.perf_counter() - t0 < seconds:
        w = World(cfg)
        path: list[Action] = []
        res.walks += 1
        try:
            for _ in range(max_depth):
                acts = w.enabled()
                if not acts:
                    break
                faults = [a for a in acts if a[0] in FAULT_ACTIONS]
                normal = [a for a in acts if a[0] not in FAULT_ACTIONS]
                if faults and (not normal or rng.random() < fault_rate):
                    a = rng.choice(faults)
                else:
                    a = rng.choice(normal)
                path.append(a)
                w.apply(a)
                res.transitions += 1
                res.seen |= w.flags
                seen_states.add(fingerprint(w))
                res.max_depth = max(res.max_depth, len(path))
            w.draining = True
            while True:
                acts = w.enabled()
                if not acts:
                    res.terminal += 1
                    w.check_terminal()
                    break
                path.append(acts[0])
                w.apply(acts[0])
                res.transitions += 1
                res.seen |= w.flags
                if len(path) > max_depth + 20_000:
                    raise Violation("request-ends", "fair drain did not end (livelock)",
                                    w.summary())
        except Violation as v:
            small, sv = shrink(cfg, path, v.prop)
            res.counterexample = Counterexample(sv or v, small if sv else path)
            break
    res.states = len(seen_states)
    res.seconds = time.perf_counter() - t0
    if res.counterexample is None:
        v = res.vacuity()
        if v is not None:
            res.counterexample = Counterexample(v, [])
    return res


def replay(cfg: WorldConfig, actions: list[Action], record: bool = True,
           drain_after: bool = False, strict: bool = True,
           ) -> tuple[World, list[Action], list[str], Violation | None]:
    """Re-run ``actions`` from the initial state: (world, actions run, their texts, violation).

    A disabled action raises ValueError (``strict``) or is skipped. With ``drain_after`` a fair
    drain follows (its actions are appended). Without a violation on the way, a final state
    where nothing is enabled is checked as terminal (that is how deadlocks and leaks show).
    """
    w = World(cfg)
    w.recording = record
    texts: list[str] = []
    run: list[Action] = []
    try:
        for a in actions:
            if a not in w.enabled():
                if strict:
                    raise ValueError(f"action {a!r} is not enabled after {len(run)} step(s)")
                continue
            texts.append(w.describe(a))
            run.append(a)
            w.apply(a)
        if drain_after:
            w.draining = True
            for _ in range(20_000):
                acts = w.enabled()
                if not acts:
                    break
                texts.append(w.describe(acts[0]) + "  (fair drain)")
                run.append(acts[0])
                w.apply(acts[0])
        if not w.enabled():
            w.check_terminal()
    except Violation as v:
        return w, run, texts, v
    return w, run, texts, None


def shrink(cfg: WorldConfig, actions: list[Action], prop: str, budget: int = 3000,
           ) -> tuple[list[Action], Violation | None]:
    """Delta-debug a failing walk: drop chunks of actions while the lenient replay (with a fair
    drain) still violates ``prop``. Returns the actions that reach it and the violation."""

    def run(acts: list[Action]) -> tuple[list[Action], Violation | None]:
        _w, done, _t, v = replay(cfg, acts, record=False, drain_after=True, strict=False)
        return done, (v if v is not None and v.prop == prop else None)

    best, v = run(actions)
    if v is None:
        return list(actions), None
    tries = 0
    chunk = max(1, len(best) // 2)
    while chunk >= 1 and tries < budget:
        i = 0
        progressed = False
        while i < len(best) and tries < budget:
            cand = best[:i] + best[i + chunk:]
            tries += 1
            done, cv = run(cand)
            if cv is not None and len(done) < len(best):
                best, v = done, cv
                progressed = True
            else:
                i += chunk
        if not progressed:
            chunk //= 2
    return best, v
