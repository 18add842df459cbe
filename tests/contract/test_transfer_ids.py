"""Transfer ids per vLLM request (lw.contract.transfer_ids), by what D, P and the proxy
need of them rather than by their spelling: every vLLM request of a proxy transfer gets its own
core request id, within the core's limit; the proxy takes D's call as a sub-transfer of its own
transfer and of no other. Holds for short ids and for the hashed form of long ones."""

from __future__ import annotations

import uuid

from hypothesis import example, given
from hypothesis import strategies as st

from lw.contract.transfer_ids import MAX_TRANSFER_ID, is_sub_transfer_of, sub_transfer_id

# The proxy's transfer ids are uuid4 hex; a client or another proxy may send longer ones (the
# metaserver takes up to 256 characters), never with "@" (lw's separator).
transfer_ids = st.one_of(st.uuids().map(lambda u: u.hex),
                         st.text("abcdef0123456789-_.", min_size=1, max_size=MAX_TRANSFER_ID))
# vLLM's request ids: "cmpl-<X-Request-Id>-<prompt>-<random>", "<n>_" before n > 1 children
request_ids = st.text(st.characters(codec="utf-8", exclude_characters="\0"), min_size=1,
                      max_size=300)
LONG = "a" * 250


@given(transfer_ids, st.lists(request_ids, min_size=2, max_size=4, unique=True))
@example(LONG, ["0_cmpl-x-0-ab", "1_cmpl-x-0-ab"])
@example("t", ["r" * 300, "r" * 299 + "s"])
def test_each_vllm_request_of_a_transfer_gets_its_own_bounded_id(tid: str, rids: list[str]
                                                                 ) -> None:
    subs = [sub_transfer_id(tid, r) for r in rids]
    assert len(set(subs)) == len(rids)  # one core request per vLLM request
    assert all(0 < len(s) <= MAX_TRANSFER_ID for s in subs)
    assert subs == [sub_transfer_id(tid, r) for r in rids]  # D and a retry agree
    assert all(is_sub_transfer_of(s, tid) for s in subs)  # the proxy takes D's call


@given(transfer_ids, transfer_ids, request_ids)
@example(LONG, "b" + LONG[1:], "r" * 300)
@example(uuid.UUID(int=1).hex, uuid.UUID(int=2).hex, "r" * 300)
def test_the_proxy_refuses_a_sub_transfer_of_another_transfer(a: str, b: str, rid: str
                                                              ) -> None:
    # The hashed form keeps a transfer id's first CUT characters, so ids that agree on those
    # (or one of which is the other's cut) are told apart by the grant alone; the proxy's own
    # ids (uuid4 hex, 32 characters) never do.
    cut = MAX_TRANSFER_ID - 33
    if a[:cut] == b[:cut] or a == b[:cut] or b == a[:cut]:
        return
    assert not is_sub_transfer_of(sub_transfer_id(a, rid), b)
