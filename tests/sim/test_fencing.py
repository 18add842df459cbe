"""Fencing (issue 11): late bytes of a superseded claim are never taken as valid KV.

With ``late_writes`` the bytes of an in-doubt write may land at any later moment, past D's
lease, into a block another request holds by then; ``stale-kv`` is the property. These tests show
the model reaches that landing (the property is not vacuous), that lw's data-plane fence keeps it
out, that without the fence lw's checksums turn a landing before the DONE into a failed request,
and that nothing changes for worlds without the switch.
"""

from __future__ import annotations

from dataclasses import replace

from lw.sim.config import WorldConfig
from lw.sim.explorer import explore, replay
from lw.sim.variants import DESIGNS
from lw.sim.world import World

LATE = DESIGNS["lease-only-fence"].config_overrides()


def test_without_checksums_or_fence_a_late_write_is_decoded_as_another_request_kv() -> None:
    res = explore(WorldConfig(design="d-first", **{**LATE, "kv_checksum": False,
                                                   "fence_data": False}),
                  max_seconds=60)
    ce = res.counterexample
    assert ce is not None and ce.violation.prop == "stale-kv"
    assert "bytes of r0" in ce.violation.message
    assert any(a[0] == "zland" for a in ce.actions)


def test_the_fence_keeps_late_writes_out_without_checksums() -> None:
    res = explore(WorldConfig(design="d-first", **{**LATE, "kv_checksum": False}),
                  max_seconds=60)
    assert res.counterexample is None and res.complete
    assert "deadline" in res.seen  # leases ended (and fences were asked for)


def test_with_checksums_the_same_late_write_fails_the_request_it_reached() -> None:
    cfg = WorldConfig(design="lease-only-fence", **LATE)
    ce = explore(cfg, max_seconds=60).counterexample
    assert ce is not None
    # The same events against lw's own D without its fence: the DONE after the late landing
    # is refused (with the fence, the landing is not reachable at all).
    # The shortest landing comes after r1's DONE, while it decodes, where no checksum can see
    # it; the same landing just before that DONE is what the checksums are for.
    acts = list(ce.actions)
    assert acts[-1][0] == "zland" and acts[-2][0] == "deliver" and "DoneSending" in acts[-2][1]
    acts[-2], acts[-1] = acts[-1], acts[-2]
    w, _run, _texts, v = replay(replace(cfg, design="d-first", fence_data=False), acts,
                                record=False)
    assert v is None
    assert w.d[0].counters["checksum_mismatches"] == 1
    r1 = w.reqs[1]
    # Failed on D, its blocks quarantined until P confirms it stopped (a refused DONE does not
    # say so); the late bytes are the fault that touched it.
    assert w.d[0].state_of(r1.rid) == "FAILED" and r1.rid in w.d[0].quarantined()
    assert r1.touched


def test_bounded_in_doubt_bytes_have_no_late_landing_action() -> None:
    w = World(WorldConfig(design="d-first", dp=1, requests=1, layers=1, faults=True,
                          fault_kinds=("write",)))
    cloner = w.cloner()
    seen: set[str] = set()
    frontier = [w]
    for _ in range(12):  # walk a few levels: in-doubt failures happen, no zland ever offered
        nxt = []
        for x in frontier[:40]:
            for a in x.enabled():
                seen.add(a[0])
                y = cloner.clone(x)
                y.apply(a)
                nxt.append(y)
        frontier = nxt
    assert "fail_write" in seen and "zland" not in seen
    assert w.kv.memory_key() is None  # nothing tracked: the state key is unchanged
