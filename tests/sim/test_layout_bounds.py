"""P never writes past the end of D's block pool, nor with a layout of another size (issue 12, 7).

Sampled mutants of P's layout check (``Layouts.check``) survived every test: nothing gave P a
D layout that registers fewer blocks or another number of layers than P expects. These tests
pin the boundary on the endpoint itself, run the checker on a misconfigured D (its layout
registers fewer blocks or more layers than its pool and model), and show that the world's
``layout-match`` property catches a P that accepts such a layout.
"""

from __future__ import annotations

import pytest

from lw.fsm import PrefillEndpoint, PrefillRequest, Send, WriteLayer
from lw.fsm.lifecycles import FAILED
from lw.fsm.prefill_layouts import Layouts, Segments
from lw.sim.config import WorldConfig
from lw.sim.explorer import explore
from lw.transport.wire import KVLayout, LayerLayout, MetaReply, Sender

D = Sender("D", 0, 1, "d0")


def _layout(blocks: int, layers: int) -> KVLayout:
    return KVLayout("D", 1, "d0-te:1", [LayerLayout(0x1000 * (k + 1), 64, 64, blocks)
                                        for k in range(layers)])


def _accept(remote: tuple[int, ...], blocks: int, layers: int) -> tuple[PrefillEndpoint, list]:
    p = PrefillEndpoint(Sender("P", 0, 1, "p0"), 2)
    p.add_request(PrefillRequest("r0", "d0", tuple(range(len(remote))), remote), 0.0)
    p.layer_computed(0, ["r0"], 0.0)
    out = p.on_message(MetaReply(2, "r0", "accepted", D, _layout(blocks, layers)), 0.1)
    return p, out


def test_the_last_block_of_d_is_written() -> None:
    p, out = _accept((3,), blocks=4, layers=2)
    writes = [e for e in out if isinstance(e, WriteLayer)]
    assert [w.remote_blocks for w in writes] == [(3,)]
    assert p.state_of("r0") != FAILED


@pytest.mark.parametrize("remote", [(4,), (0, 4), (5,)])
def test_a_block_past_the_end_of_d_fails_the_request(remote: tuple[int, ...]) -> None:
    p, out = _accept(remote, blocks=4, layers=2)
    assert not [e for e in out if isinstance(e, WriteLayer)]
    assert p.state_of("r0") == FAILED
    failed = [e.msg for e in out if isinstance(e, Send)]
    assert failed and "outside decoder's 4 blocks" in failed[0].reason


@pytest.mark.parametrize("layers", [1, 3])
def test_a_layout_of_another_number_of_layers_fails_the_request(layers: int) -> None:
    p, out = _accept((0,), blocks=4, layers=layers)
    assert not [e for e in out if isinstance(e, WriteLayer)]
    assert p.state_of("r0") == FAILED


MISCONFIGURED = [
    dict(dp=1, requests=2, layers=1, d_blocks=2, p_blocks=2, d_layout_blocks=1),
    dict(dp=1, requests=1, layers=1, d_layout_layers=2),
]


@pytest.mark.parametrize("kw", MISCONFIGURED)
def test_a_misconfigured_d_fails_requests_cleanly(kw: dict) -> None:
    """Every safety property holds (no write outside D's layout); requests may fail."""
    res = explore(WorldConfig(**kw), check_cycles=True)
    ce = res.counterexample
    assert ce is None or ce.violation.prop.startswith("sometimes"), ce.violation.headline()
    assert res.complete


@pytest.mark.parametrize("kw", MISCONFIGURED)
def test_layout_match_catches_a_p_that_accepts_any_layout(kw: dict,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutants: P's layout check returns "" (the block bound or the layer count dropped)."""
    real = Layouts.check

    def lax(self: Layouts, addr: str, layout: KVLayout, remote_blocks: tuple[int, ...]
            ) -> tuple[Segments | None, str]:
        segs, problem = real(self, addr, layout, remote_blocks)
        return (segs if segs is not None else (None,) * self.num_layers), ""

    monkeypatch.setattr(Layouts, "check", lax)
    res = explore(WorldConfig(**kw))
    ce = res.counterexample
    assert ce is not None and ce.violation.prop == "layout-match", ce and ce.violation.headline()
