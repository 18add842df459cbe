"""Benchmark of the model checker, in one run: explorer speed, reductions, time to find bugs.

Measures (side by side, same process): the partial-order reduction (lw/sim/reduce.py) on and
off on the faulted bounds (states, transitions, states/s, seconds, and the ratios), states/s of
the exhaustive explorer on lw's protocol without and with faults, time and trace length to find
the p-first deadlock and the eager-free use-after-free, and the cost of cloning a world (pickle
by reference with and without the slot/timeline savings, vs ``copy.deepcopy``). The last lines
are ``key: value``.

    .venv/bin/python benchmarks/checker.py [--quick] [--budget SECONDS]
"""

from __future__ import annotations

import argparse
import copy
import time

from lw.fsm.timeline import Timeline
from lw.sim.clone import SLOT_RECORDS
from lw.sim.explorer import Result, explore
from lw.sim.world import World, WorldConfig


def _timed(cfg: WorldConfig, max_seconds: float | None = None, reduce: bool = True) -> Result:
    return explore(cfg, max_seconds=max_seconds, reduce=reduce)


def _row(name: str, r: Result) -> str:
    done = "complete" if r.complete else f"PARTIAL ({r.stopped_by})"
    return (f"  {name:>9}: {r.states:>9,} states {r.transitions:>9,} transitions "
            f"{r.seconds:7.1f} s {r.states_per_s:7,.0f} states/s  {done}"
            + (f", {r.reduced:,} states expanded by one persistent action" if r.reduced else ""))


def reductions(cfg: WorldConfig, budget: float) -> tuple[Result, Result]:
    """The same bounds explored without and with the reduction (each within ``budget`` s)."""
    full = _timed(cfg, budget, reduce=False)
    red = _timed(cfg, budget, reduce=True)
    for r in (full, red):
        assert r.counterexample is None, r.counterexample
    print(f"{cfg.bounds()}:")
    print(_row("no POR", full))
    print(_row("POR", red))
    if full.complete and red.complete:
        print(f"  ratio: {full.states / red.states:.2f}x fewer states, "
              f"{full.transitions / red.transitions:.2f}x fewer transitions, "
              f"{full.seconds / red.seconds:.2f}x faster")
    else:
        print(f"  in the same time: {red.states:,} vs {full.states:,} states"
              + ("; only the reduced run completes" if red.complete else ""))
    return full, red


def clone_costs(n: int = 2000) -> tuple[float, float, float]:
    """Microseconds per clone of a mid-run world: (pickle by reference, the same without the
    slot-record and timeline savings, copy.deepcopy), all keeping the same parts shared."""
    w = World(WorldConfig(dp=2, requests=2, layers=2, d_blocks=2, faults=True))
    for _ in range(10):
        w.apply(w.enabled()[0])
    cloner = w.cloner()
    plain = w.cloner()
    for cls in (*SLOT_RECORDS, Timeline):
        del plain.table[cls]
    t0 = time.perf_counter()
    for _ in range(n):
        plain.clone(w)
    t1 = time.perf_counter()
    for _ in range(n):
        cloner.clone(w)
    pickled = (time.perf_counter() - t1) / n * 1e6
    unsaved = (t1 - t0) / n * 1e6
    # deepcopy sharing the same immutable parts (a memo pre-seeded with them): a fair baseline
    store = w.s.store
    shared: list[object] = [store, w.cfg, w.design, *store.objs, *store.msgs.values()]
    for ep in [*w.p, *w.d]:
        shared += [getattr(ep, name) for name in ep.IMMUTABLE]
    memo0 = {id(o): o for o in shared}
    m = max(1, n // 4)
    t0 = time.perf_counter()
    for _ in range(m):
        copy.deepcopy(w, dict(memo0))
    deep = (time.perf_counter() - t0) / m * 1e6
    return pickled, unsaved, deep


def main() -> int:
    """Run every measurement and print a table, then ``key: value`` lines."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller fault bounds")
    ap.add_argument("--budget", type=float, default=60.0,
                    help="seconds per explorer run on the issue-12 bound (default 60)")
    args = ap.parse_args()
    rows: list[tuple[str, str]] = []

    print("partial-order reduction, off and on (lw/sim/reduce.py):")
    small = reductions(WorldConfig(design="d-first", dp=1, requests=1, layers=1, faults=True),
                       args.budget)
    big_cfg = WorldConfig(design="d-first", dp=2, requests=2, layers=2, faults=True)
    big = reductions(big_cfg, args.budget) if not args.quick else None

    nofault = _timed(WorldConfig(design="d-first", dp=2, requests=3, layers=2, d_blocks=2,
                                 p_blocks=2))
    assert nofault.counterexample is None and nofault.complete
    print(f"d-first no faults dp2 r3 L2 (D 2 blocks): {nofault.states} states in "
          f"{nofault.seconds:.2f} s")
    done_when = _timed(WorldConfig(design="d-first", dp=2, requests=2, layers=2))
    assert done_when.counterexample is None and done_when.complete
    fcfg = WorldConfig(design="d-first", dp=1, requests=1, layers=1 if args.quick else 2,
                       faults=True)
    faults = _timed(fcfg)
    assert faults.counterexample is None and faults.complete
    print(f"d-first faults {fcfg.bounds()}: {faults.states} states in {faults.seconds:.2f} s")

    found = {}
    for name, cfg in (
        ("p_first_deadlock", WorldConfig(design="p-first", dp=2, requests=2, layers=2)),
        ("eager_free_use_after_free", WorldConfig(design="eager-free", dp=2, requests=2,
                                                  layers=2)),
    ):
        res = _timed(cfg)
        ce = res.counterexample
        assert ce is not None, name
        found[name] = (res.seconds, len(ce.actions), ce.violation.prop, res.states)
        print(f"{name}: {ce.violation.prop} after {res.states} states, {res.seconds * 1e3:.1f} ms, "
              f"trace of {len(ce.actions)} steps")

    pickled, unsaved, deep = clone_costs()
    print(f"clone of a mid-run world: pickle by reference {pickled:.0f} us (without the slot and "
          f"timeline savings {unsaved:.0f} us, {unsaved / pickled:.2f}x), "
          f"copy.deepcopy {deep:.0f} us ({deep / pickled:.1f}x)")

    for tag, pair in (("por_small", small), ("por_issue12", big)):
        if pair is None:
            continue
        full, red = pair
        rows += [(f"{tag}_states_before", str(full.states)),
                 (f"{tag}_states_after", str(red.states)),
                 (f"{tag}_complete_before", str(full.complete)),
                 (f"{tag}_complete_after", str(red.complete)),
                 (f"{tag}_states_per_s_before", f"{full.states_per_s:.0f}"),
                 (f"{tag}_states_per_s_after", f"{red.states_per_s:.0f}"),
                 (f"{tag}_seconds_before", f"{full.seconds:.1f}"),
                 (f"{tag}_seconds_after", f"{red.seconds:.1f}"),
                 (f"{tag}_state_ratio", f"{full.states / red.states:.2f}"
                  if full.complete and red.complete else "n/a (partial)")]
    rows += [
        ("done_when_states", str(done_when.states)),
        ("done_when_seconds", f"{done_when.seconds:.3f}"),
        ("nofault_states", str(nofault.states)),
        ("nofault_states_per_s", f"{nofault.states_per_s:.0f}"),
        ("faults_states", str(faults.states)),
        ("faults_states_per_s", f"{faults.states_per_s:.0f}"),
    ]
    for name, (secs, steps, prop, states) in found.items():
        rows += [(f"{name}_ms", f"{secs * 1e3:.1f}"), (f"{name}_trace_steps", str(steps)),
                 (f"{name}_property", prop), (f"{name}_states", str(states))]
    rows += [("clone_pickle_us", f"{pickled:.0f}"), ("clone_unsaved_us", f"{unsaved:.0f}"),
             ("clone_deepcopy_us", f"{deep:.0f}"), ("clone_speedup", f"{deep / pickled:.1f}")]
    for k, v in rows:
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
