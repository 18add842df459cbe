"""Which block ids each side hands its core (lw.fsm.block_choice), against a token-level oracle
written apart from it: token t of the prompt lives in block t // block_size of each side's
table, D receives every block holding a token it misses and no other, each into the D block
holding the same tokens, and P hands a block on in the first chunk after which all its tokens
are computed. Slips a driver could make (front-trimmed or shifted lists, a block handed on
before its last token is computed) are planted and must be caught by the same check."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lw.fsm import DecodeEndpoint, PrefillEndpoint, PrefillRequest
from lw.fsm.block_choice import Push, PushCursor, blocks_to_push, blocks_to_receive
from lw.fsm.prefill_request import blocks_complete

from .harness import D_ADDR, Pair, d_layout, d_sender, p_sender

ChooseD = Callable[[Sequence[int], int, int, int], tuple[int, tuple[int, ...]]]
ChooseP = Callable[[Sequence[int], int, int, int, int, int], tuple[int, ...]]


def oracle(p_table: Sequence[int], d_table: Sequence[int], prompt: int, cached: int, bs: int,
           ends: Sequence[int]) -> list[list[tuple[int, int]]]:
    """Per chunk (ending after ``ends[i]`` tokens): the (P block, D block) pairs whose KV it
    completes, from tokens alone. A block is complete once its last prompt token is computed."""
    last_token: dict[int, int] = {}  # block index -> its last token in the prompt
    for t in range(prompt):
        last_token[t // bs] = t
    out: list[list[tuple[int, int]]] = []
    done: set[int] = set()
    for end in ends:
        chunk = []
        for t in range(cached, prompt):  # only the tokens D misses travel
            b = t // bs
            if b not in done and last_token[b] < end:
                done.add(b)
                chunk.append((p_table[b], d_table[b]))
        out.append(chunk)
    return out


def problem(p_table: Sequence[int], d_table: Sequence[int], prompt: int, cached: int, bs: int,
            ends: Sequence[int], choose_d: ChooseD = blocks_to_receive,
            choose_p: ChooseP = blocks_to_push) -> str:
    """What the choice functions get wrong against the oracle ("" if nothing)."""
    first, remote = choose_d(d_table, prompt, cached, bs)
    pushed = 0
    for i, (end, want) in enumerate(zip(ends, oracle(p_table, d_table, prompt, cached, bs, ends),
                                        strict=True)):
        allocated = p_table[:-(-end // bs)]  # vLLM allocates P's blocks as chunks need them
        local = choose_p(allocated, prompt, end, first, pushed, bs)
        got = list(zip(local, remote[pushed:pushed + len(local)], strict=False))
        if got != want or len(local) > len(remote) - pushed:
            return f"chunk {i} (to token {end}): P->D pairs {got}, the tokens say {want}"
        pushed += len(local)
    if pushed != len(remote):
        return f"D registered {len(remote)} blocks, P filled {pushed}"
    cached_ids = set(d_table[:cached // bs])
    if cached_ids & set(remote):
        return f"D would receive into its cached blocks {sorted(cached_ids & set(remote))}"
    return ""


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[int], list[int], int, int, int, list[int]]:
    bs = draw(st.integers(1, 16))
    prompt = draw(st.integers(1, 300))
    n = -(-prompt // bs)
    cached = bs * draw(st.integers(0, (prompt - 1) // bs))  # D's hit: whole blocks, < prompt
    # distinct, unordered block ids per side (vLLM's pool hands out any free block)
    ids = st.lists(st.integers(0, 10_000), min_size=n, max_size=n, unique=True)
    p_table, d_table = draw(ids), draw(ids)
    # P's chunk ends: increasing, the last one the whole prompt (P's own prefix hit and the
    # step's token budget put them anywhere, not only on block boundaries)
    cuts = draw(st.lists(st.integers(1, prompt), max_size=6, unique=True))
    return p_table, d_table, prompt, cached, bs, sorted({*cuts, prompt})


@given(cases())
def test_each_missing_token_goes_from_ps_block_to_ds_block_in_the_chunk_completing_it(
        case: tuple[list[int], list[int], int, int, int, list[int]]) -> None:
    assert problem(*case) == ""


def test_a_hand_worked_prefix_hit() -> None:
    """100 tokens in blocks of 16 (7 blocks, the last holding 4), D holds the first 64."""
    d_table = [50, 51, 52, 53, 10, 11, 12]
    p_table = [7, 6, 5, 4, 3, 2, 1]
    assert blocks_to_receive(d_table, 100, 64, 16) == (4, (10, 11, 12))
    # chunks of 54, 10 and 36 tokens: block 3 (tokens 48..63) is complete only after the second
    assert blocks_to_push(p_table[:4], 100, 54, 4, 0, 16) == ()  # 4 blocks allocated
    assert blocks_to_push(p_table[:4], 100, 64, 4, 0, 16) == ()
    assert blocks_to_push(p_table[:5], 100, 80, 4, 0, 16) == (3,)
    assert blocks_to_push(p_table, 100, 100, 4, 1, 16) == (2, 1)
    assert problem(p_table, d_table, 100, 64, 16, [54, 64, 80, 100]) == ""


@pytest.mark.parametrize(("args", "fragment"), [
    (([1, 2], 100, 64, 16), "block table of 2"),
    (([1] * 7, 100, 60, 16), "not whole blocks"),
])
def test_d_refuses_what_it_cannot_slice(args: tuple, fragment: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=fragment):
        blocks_to_receive(*args)


@pytest.mark.parametrize(("args", "fragment"), [
    (([1] * 7, 100, -1, 0, 0, 16), "tokens done"),
    (([1] * 7, 0, 0, 0, 0, 16), "tokens done"),
    (([1] * 7, 100, 50, 0, 0, 0), "tokens done"),  # block size 0: refused, not divided by
    (([1] * 7, 100, 50, 5, 3, 16), "D holds 5 and P pushed 3"),
    (([1] * 3, 100, 64, 0, 0, 16), "block table of 3"),
])
def test_p_refuses_what_it_cannot_slice(args: tuple, fragment: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=fragment):
        blocks_to_push(*args)


# --------------------------------------------------------------------- planted slips are caught
def _d_front_trim(table: Sequence[int], prompt: int, cached: int, bs: int
                  ) -> tuple[int, tuple[int, ...]]:
    """vllm #48633 C3's class: the first n blocks of the table, not the last n."""
    first, remote = blocks_to_receive(table, prompt, cached, bs)
    return first, tuple(table[:len(remote)])


def _d_shifted(table: Sequence[int], prompt: int, cached: int, bs: int
               ) -> tuple[int, tuple[int, ...]]:
    """One block early after a hit: D's last cached block in, its last block out."""
    first, remote = blocks_to_receive(table, prompt, cached, bs)
    return first, tuple(table[max(0, first - 1):max(0, first - 1) + len(remote)])


def _p_ignores_the_hit(table: Sequence[int], prompt: int, done: int, first: int, pushed: int,
                       bs: int) -> tuple[int, ...]:
    """P's blocks counted from the prompt's start, not from D's hit (the same class on P)."""
    return tuple(table[pushed:max(pushed, blocks_complete(done, prompt, bs) - first)])


def _p_partial_block_early(table: Sequence[int], prompt: int, done: int, first: int,
                           pushed: int, bs: int) -> tuple[int, ...]:
    """A block handed on while its last tokens are still to be computed (ceil, not floor)."""
    lo, hi = first + pushed, max(first + pushed, min(-(-done // bs), len(table)))
    return tuple(table[lo:hi])


HIT = ([7, 6, 5, 4, 3, 2, 1], [50, 51, 52, 53, 10, 11, 12], 100, 64, 16, [54, 80, 100])
UNALIGNED = ([7, 6, 5, 4, 3, 2, 1], [50, 51, 52, 53, 10, 11, 12], 100, 0, 16, [54, 100])


@pytest.mark.parametrize(("which", "plant", "case"), [
    ("d", _d_front_trim, HIT), ("d", _d_shifted, HIT),
    ("p", _p_ignores_the_hit, HIT), ("p", _p_partial_block_early, UNALIGNED),
])
def test_planted_slips_are_caught(which: str, plant: Callable[..., object],
                                  case: tuple) -> None:  # type: ignore[type-arg]
    kw = {"choose_d": plant} if which == "d" else {"choose_p": plant}
    assert problem(*case, **kw) != ""  # type: ignore[arg-type]
    assert problem(*case) == ""


# ------------------------------------------------ P's push cursor, judged by the cores themselves
@st.composite
def pushes(draw: st.DrawFn) -> tuple[list[int], list[int], int, int, int, list[int], list[bool]]:
    bs = draw(st.integers(1, 16))
    prompt = draw(st.integers(1, 64 * bs))
    n = -(-prompt // bs)
    cached = bs * draw(st.integers(0, (prompt - 1) // bs))
    ids = st.lists(st.integers(0, 63), min_size=n, max_size=n, unique=True)  # D's pool: 64
    cuts = draw(st.lists(st.integers(1, prompt), max_size=5, unique=True))
    ends = sorted({*cuts, prompt})
    # push_mode's verdict per chunk: whether a push not started yet starts with it
    early = draw(st.lists(st.booleans(), min_size=len(ends), max_size=len(ends)))
    return draw(ids), draw(ids), prompt, cached, bs, ends, early


@given(pushes())
def test_the_push_cursor_announces_what_the_cores_accept_and_the_tokens_say(
        case: tuple[list[int], list[int], int, int, int, list[int], list[bool]]) -> None:
    """Each push is fed to a real PrefillEndpoint writing into a real DecodeEndpoint: no chunk
    is refused, D receives the request, and every write carries (P block, D block) pairs the
    token oracle pairs, each once, in a chunk that had computed them."""
    p_table, d_table, prompt, cached, bs, ends, early = case
    first, remote = blocks_to_receive(d_table, prompt, cached, bs)
    L = 2
    pair = Pair([PrefillEndpoint(p_sender(0), L)], DecodeEndpoint(d_sender(), d_layout(L)))
    pair.absorb("d", pair.d.add_request("r", remote, 1, pair.now))
    cursor = PushCursor(first)
    want = oracle(p_table, d_table, prompt, cached, bs, ends)
    written: list[tuple[int, int]] = []
    may: list[tuple[int, int]] = []  # pairs whose tokens are computed so far
    for end, go, chunk_want in zip(ends, early, want, strict=True):
        may += chunk_want
        push = cursor.chunk(p_table[:-(-end // bs)], prompt, end, bs, lambda go=go: go)
        if push is None:
            continue
        p = pair.ps[0]
        if push.first:
            req = PrefillRequest("r", D_ADDR, push.local, remote, 1, final=push.final)
            pair.absorb(0, p.add_request(req, pair.now))
        else:
            pair.absorb(0, p.add_chunk("r", push.local, push.final, pair.now))
        pair.deliver_all()
        if not push.local:
            continue  # a first push with no block reports no layer (the worker's rule, too)
        for layer in range(L):
            pair.absorb(0, p.layer_computed(layer, ["r"], pair.now))
        for _, w in pair.writes:
            pairs = list(zip(w.local_blocks, w.remote_blocks, strict=True))
            assert set(pairs) <= set(may), (pairs, may)  # never ahead of the tokens
            if w.layer == 0:
                written += pairs
        pair.complete_writes()
        pair.deliver_all()
    assert pair.ps[0].counters.get("bad_chunks", 0) == 0
    assert cursor.final and written == [x for chunk in want for x in chunk]
    assert [type(e).__name__ for e in pair.recv] == ["RecvDone"]


def test_every_block_held_by_d_or_pushed_already_leaves_nothing_to_push() -> None:
    assert blocks_to_push([1] * 7, 100, 100, 3, 4, 16) == ()


def test_a_stopped_push_pushes_nothing_more_and_only_a_started_one_needs_stopping() -> None:
    c = PushCursor(0)
    assert c.stop() is False  # nothing pushed yet: the workers do not hold it
    assert c.chunk([1, 2, 3], 48, 16, 16, lambda: True) == Push((1,), True, False)
    assert c.chunk([1, 2, 3], 48, 20, 16, lambda: True) is None  # completes no block
    assert c.stop() and not c.stop()
    assert c.chunk([1, 2, 3], 48, 48, 16, lambda: True) is None
    late = PushCursor(1)
    assert late.chunk([1, 2], 48, 32, 16, lambda: False) is None  # push_mode: not yet
    assert late.chunk([1, 2, 3], 48, 48, 16, lambda: False) == Push((2, 3), True, True)
    assert not late.stop()  # over: nothing to abort
