"""Hypothesis stateful tests: random requests, deliveries, steps, faults and clock advances.

Every step applies one enabled world action (which checks the safety properties), an invariant
re-checks them, and teardown runs a fair drain and the liveness properties (docs/design.md
section 4).
"""

from __future__ import annotations

import pytest
from hypothesis import Phase
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from lw.sim.explorer import drain
from lw.sim.properties import Violation
from lw.sim.variants import DESIGNS
from lw.sim.world import Action, World, WorldConfig

from .profiles import sim_settings

PROXY = frozenset({"arrive", "alloc", "start", "fallback"})
P_STEP = frozenset({"schedule", "layer", "hook", "barrier"})
DATA = frozenset({"complete", "decode", "zland"})
CLOCK = frozenset({"timer", "wto", "zexp", "idle"})
DETECT = frozenset({"p_lost", "d_lost", "restart_d"})
NORMAL = PROXY | P_STEP | DATA | CLOCK | DETECT | {"deliver"}
DROP = frozenset({"drop"})
DUP = frozenset({"dup"})
FAIL_WRITE = frozenset({"fail_write"})
ABORT = frozenset({"abort_d", "abort_p"})
CRASH = frozenset({"crash_p", "crash_d"})
NO_SHRINK = tuple(p for p in Phase if p is not Phase.shrink)


@st.composite
def worlds(draw: st.DrawFn, design: str) -> WorldConfig:
    """A small world of any valid shape: P TP x D TP (several P senders per D rank, one P sender
    writing several D ranks), MLA, D prefix-cache hits (none to full), chunked prefill, a data
    plane completing writes in or out of order, with or without faults. Every field shrinks
    towards the plain shape (tp=d_tp=1, no MLA, no hits, one chunk, writes in order)."""
    # computing ahead: P TP 1 (each P worker would decide its own bind)
    tp = 1 if DESIGNS[design].ahead else draw(st.integers(1, 2), label="tp")
    d_tp = draw(st.integers(1, 2), label="d_tp")
    mla = draw(st.booleans(), label="mla")
    requests = draw(st.integers(1, 3), label="requests")
    bpr = draw(st.integers(1, 2), label="blocks_per_request")
    # Chunked prefill: up to one chunk more than blocks (the first chunk may complete none);
    # a prefix hit must leave a block to every later chunk (or be a full hit).
    chunks = draw(st.integers(1, bpr + 1), label="chunks")
    fits = [h for h in range(bpr + 1) if bpr - h >= chunks - 1 or h == bpr]
    hits = draw(st.lists(st.sampled_from(fits), max_size=requests), label="prefix_hits")
    # Late writes of superseded claims only with checksums: without them lw relies on the lease
    # alone, and the checker shows stale-kv there (lease-only-fence).
    checksum = draw(st.booleans(), label="kv_checksum")
    late = checksum and draw(st.booleans(), label="late_writes")
    return WorldConfig(
        design=design, dp=draw(st.integers(1, 3), label="dp"), tp=tp, d_tp=d_tp, mla=mla,
        requests=requests, layers=draw(st.integers(1, 3), label="layers"), chunks=chunks,
        unordered_writes=draw(st.booleans(), label="unordered_writes"),
        d_dp=draw(st.integers(1, 2), label="d_dp"), blocks_per_request=bpr,
        d_blocks=bpr + draw(st.integers(0, 1), label="extra_d_blocks"),
        p_blocks=bpr + draw(st.integers(0, 1), label="extra_p_blocks"),
        prefix_hits=tuple(hits), faults=draw(st.booleans(), label="faults"),
        max_faults=draw(st.integers(1, 4), label="max_faults"),
        delays=draw(st.booleans(), label="delays"),
        d_restarts=draw(st.integers(0, 1), label="d_restarts"),
        atomic_layers=draw(st.booleans(), label="atomic"),
        kv_checksum=checksum, late_writes=late)


class WorldMachine(RuleBasedStateMachine):
    """Drives one World; rules are grouped by kind so Hypothesis can bias and shrink them."""

    design = "d-first"

    def __init__(self) -> None:
        super().__init__()
        self.world: World | None = None
        self.failed = False

    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        self.world = World(data.draw(worlds(self.design), label="config"))

    def _actions(self, kinds: frozenset[str]) -> list[Action]:
        assert self.world is not None
        return [a for a in self.world.enabled() if a[0] in kinds]

    def _do(self, data: st.DataObject, kinds: frozenset[str]) -> None:
        assert self.world is not None
        a = data.draw(st.sampled_from(self._actions(kinds)), label="action")
        try:
            self.world.apply(a)
        except Violation:
            self.failed = True
            raise

    @precondition(lambda self: bool(self._actions(NORMAL)))
    @rule(data=st.data(), n=st.integers(1, 12))
    def burst(self, data: st.DataObject, n: int) -> None:
        """Several fault-free steps at once (runs get deep while staying shrinkable)."""
        for _ in range(n):
            if not self._actions(NORMAL):
                return
            self._do(data, NORMAL)

    @precondition(lambda self: bool(self._actions(PROXY)))
    @rule(data=st.data())
    def proxy_and_allocation(self, data: st.DataObject) -> None:
        self._do(data, PROXY)

    @precondition(lambda self: bool(self._actions(P_STEP)))
    @rule(data=st.data())
    def prefill_step(self, data: st.DataObject) -> None:
        self._do(data, P_STEP)

    @precondition(lambda self: bool(self._actions(frozenset({"deliver"}))))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        self._do(data, frozenset({"deliver"}))

    @precondition(lambda self: bool(self._actions(DATA)))
    @rule(data=st.data())
    def data_plane_and_decode(self, data: st.DataObject) -> None:
        self._do(data, DATA)

    @precondition(lambda self: bool(self._actions(CLOCK)))
    @rule(data=st.data())
    def advance_clock(self, data: st.DataObject) -> None:
        self._do(data, CLOCK)

    @precondition(lambda self: bool(self._actions(DETECT)))
    @rule(data=st.data())
    def detect_peer_loss(self, data: st.DataObject) -> None:
        self._do(data, DETECT)

    @precondition(lambda self: bool(self._actions(DROP)))
    @rule(data=st.data())
    def drop_message(self, data: st.DataObject) -> None:
        self._do(data, DROP)

    @precondition(lambda self: bool(self._actions(DUP)))
    @rule(data=st.data())
    def duplicate_message(self, data: st.DataObject) -> None:
        self._do(data, DUP)

    @precondition(lambda self: bool(self._actions(FAIL_WRITE)))
    @rule(data=st.data())
    def fail_write(self, data: st.DataObject) -> None:
        self._do(data, FAIL_WRITE)

    @precondition(lambda self: bool(self._actions(ABORT)))
    @rule(data=st.data())
    def client_abort(self, data: st.DataObject) -> None:
        self._do(data, ABORT)

    @precondition(lambda self: bool(self._actions(CRASH)))
    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        self._do(data, CRASH)

    @rule()
    def quiescent(self) -> None:
        """Always valid: where nothing is enabled, the liveness properties must hold now."""
        assert self.world is not None
        if not self.world.enabled():
            self.world.check_terminal()

    @invariant()
    def safety(self) -> None:
        if self.world is not None and not self.failed:
            self.world.check_safety()

    def teardown(self) -> None:
        if self.world is not None and not self.failed:
            drain(self.world)


def test_d_first_random_model() -> None:
    """lw's protocol: every property holds on random runs with and without faults."""
    run_state_machine_as_test(WorldMachine, settings=sim_settings())


class ComputeAheadMachine(WorldMachine):
    """lw's protocol computing ahead: P computes before D allocates, D's allocation binds it."""

    design = "compute-ahead"


def test_compute_ahead_random_model() -> None:
    """Computing ahead: every property holds on random runs with and without faults."""
    run_state_machine_as_test(ComputeAheadMachine, settings=sim_settings())


class EagerFreeMachine(WorldMachine):
    """The seed's eager free: the stateful test must catch it too."""

    design = "eager-free"


def test_stateful_test_catches_eager_free() -> None:
    """A checker that cannot fail proves nothing: the random model finds the use-after-free."""
    with pytest.raises(Violation, match="use-after-free"):
        run_state_machine_as_test(
            EagerFreeMachine,
            # No shrinking: only "is it caught" matters here, and shrinking a long run of a
            # large world alone can take longer than the rest of this file.
            settings=sim_settings().__class__(sim_settings(), max_examples=200,
                                              database=None, print_blob=False,
                                              phases=NO_SHRINK),
        )
