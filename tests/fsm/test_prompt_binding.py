"""A claim names the prompt its sender computed (protocol 5): D accepts it only for the prompt
it allocated the blocks for, so KV of another prompt (a chat template or tokenizer that differs
between P and D, a forged call) is refused before a byte is written."""

from __future__ import annotations

from lw.fsm import PrefillRequest

from .harness import D_ADDR
from .test_endpoints import compute_all, make_pair

MINE = "0123456789abcdef0123456789abcdef"
OTHER = "fedcba9876543210fedcba9876543210"


def run(d_prompt: str, p_prompt: str) -> tuple[str | None, list, str]:
    pair = make_pair()
    pair.absorb("d", pair.d.add_request("r1", (5, 6, 7), 1, pair.now, prompt=d_prompt))
    req = PrefillRequest("r1", D_ADDR, (1, 2, 3), (5, 6, 7), 1, prompt=p_prompt)
    pair.absorb(0, pair.ps[0].add_request(req, pair.now))
    compute_all(pair)
    pair.deliver_all()
    writes = list(pair.writes)
    pair.complete_writes()
    pair.deliver_all()
    reasons = " ".join(f.reason for f in pair.finished)
    return pair.ps[0].state_of("r1"), writes, reasons


def test_a_claim_for_the_same_prompt_is_accepted() -> None:
    state, writes, _ = run(MINE, MINE)
    assert state == "DONE" and writes


def test_a_claim_for_another_prompt_is_refused_before_any_write() -> None:
    state, writes, reasons = run(MINE, OTHER)
    assert state == "FAILED" and writes == []
    assert "computed prompt fedcba98" in reasons and "blocks are for prompt 01234567" in reasons


def test_a_claim_that_names_no_prompt_is_refused_where_d_bound_one() -> None:
    state, writes, reasons = run(MINE, "")
    assert state == "FAILED" and writes == [] and "(unnamed)" in reasons


def test_unbound_requests_are_as_before() -> None:
    """The checker's world and older drivers bind no prompt: nothing changes for them."""
    assert run("", "")[0] == "DONE" and run("", OTHER)[0] == "DONE"
