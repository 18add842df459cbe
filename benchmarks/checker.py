"""Benchmark of the model checker, in one run: explorer speed, time to find the known bugs.

Measures (side by side, same process): states/s of the exhaustive explorer on lw's protocol
without and with faults, time and trace length to find the p-first deadlock, the eager-free
use-after-free and core finding 2 (peer_lost), and the cost of cloning a world (pickle by
reference vs ``copy.deepcopy``). The last lines are ``key: value``.

    .venv/bin/python benchmarks/checker.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import time

from lw.sim.explorer import Result, explore
from lw.sim.world import World, WorldConfig


def _timed(cfg: WorldConfig, max_seconds: float | None = None) -> Result:
    return explore(cfg, max_seconds=max_seconds)


def clone_costs(n: int = 2000) -> tuple[float, float]:
    """Microseconds per clone of a mid-run world: (pickle by reference, copy.deepcopy), both
    keeping the same immutable parts shared."""
    w = World(WorldConfig(dp=2, requests=2, layers=2, d_blocks=2, faults=True))
    for _ in range(10):
        w.apply(w.enabled()[0])
    cloner = w.cloner()
    t0 = time.perf_counter()
    for _ in range(n):
        cloner.clone(w)
    pickled = (time.perf_counter() - t0) / n * 1e6
    # deepcopy sharing the same immutable parts (a memo pre-seeded with them): a fair baseline
    shared: list[object] = [w.store, w.cfg, w.design, *w.store.objs, *w.store.msgs.values()]
    for ep in [*w.p, *w.d]:
        shared += [ep.declaration, ep._table, ep.config, ep.me]  # noqa: SLF001
    shared += [d.layout for d in w.d]
    memo0 = {id(o): o for o in shared}
    m = max(1, n // 4)
    t0 = time.perf_counter()
    for _ in range(m):
        copy.deepcopy(w, dict(memo0))
    deep = (time.perf_counter() - t0) / m * 1e6
    return pickled, deep


def main() -> int:
    """Run every measurement and print a table, then ``key: value`` lines."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller fault bounds")
    args = ap.parse_args()
    rows: list[tuple[str, str]] = []

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

    pickled, deep = clone_costs()
    print(f"clone of a mid-run world: pickle by reference {pickled:.0f} us, "
          f"copy.deepcopy {deep:.0f} us ({deep / pickled:.1f}x)")

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
    rows += [("clone_pickle_us", f"{pickled:.0f}"), ("clone_deepcopy_us", f"{deep:.0f}"),
             ("clone_speedup", f"{deep / pickled:.1f}")]
    for k, v in rows:
        print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
