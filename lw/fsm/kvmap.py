"""Who writes which bytes of a block: the head mapping between a P and a D tensor-parallel layout.

Pure functions of the two :class:`KVFormat` s exchanged in the claim. Three questions:

* which D ranks a P rank writes into (:func:`targets_of`) and which P ranks a D rank waits for
  (:func:`expected_senders`) -- the *sender plan*;
* whether a (P, D) pair of formats can be mapped at all (:func:`pair_problem`), refused at the
  claim with a message that names both;
* the byte runs inside one block that carry the heads both hold (:func:`block_segments`).

Heads of a TP rank follow vLLM: with ``H >= tp`` rank ``r`` holds ``H/tp`` consecutive heads; with
``H < tp`` the heads are replicated and rank ``r`` holds head ``r * H // tp``. MLA's latent vector
is one head replicated on every rank. When several P ranks hold a head a D rank needs (replication,
MLA) exactly one of them writes it: ``candidates[d_rank % len(candidates)]``, which spreads the
senders of different D ranks over the P ranks.
"""

from __future__ import annotations

from lw.fsm.messages import KVFormat, heads_of, tp_problem

__all__ = [
    "LayoutMismatch",
    "Segment",
    "block_segments",
    "describe",
    "expected_senders",
    "heads_of",
    "make_format",
    "pair_problem",
    "targets_of",
    "tp_problem",
]

Segment = tuple[int, int, int]
"""(byte offset in the source block, byte offset in the destination block, length)."""


class LayoutMismatch(ValueError):
    """Two KV layouts cannot exchange blocks; the message names both."""


def make_format(*, tp_rank: int, tp_size: int, total_heads: int, block_tokens: int,
                dtype: str, order: str = "HND", mla: bool = False) -> KVFormat:
    """The format of one TP rank's KV cache."""
    if mla:
        total_heads = 1
    lo, hi = heads_of(tp_rank, tp_size, total_heads, mla)
    return KVFormat(dtype=dtype, block_tokens=block_tokens, order=order,  # type: ignore[arg-type]
                    total_heads=total_heads, head_lo=lo, head_hi=hi, tp_rank=tp_rank,
                    tp_size=tp_size, mla=mla)


def _holders(head: int, tp: int, total_heads: int, mla: bool) -> range:
    """The TP ranks (of ``tp``) that hold ``head``: consecutive, as :func:`heads_of` splits."""
    if mla:
        return range(tp)
    if total_heads >= tp:
        r = head // (total_heads // tp)
        return range(r, r + 1)
    # replicated: rank r holds head r * H // tp, so head h is held by r in [h*tp/H, (h+1)*tp/H)
    return range(-(-head * tp // total_heads), -(-(head + 1) * tp // total_heads))


def _writer(head: int, d_rank: int, p_tp: int, total_heads: int, mla: bool) -> int:
    """The one P rank that writes ``head`` into D rank ``d_rank``."""
    cands = _holders(head, p_tp, total_heads, mla)
    return cands[d_rank % len(cands)]


def expected_senders(d_fmt: KVFormat, p_tp: int) -> frozenset[int]:
    """P TP ranks that write into the D rank of ``d_fmt`` (each sends one DONE per request)."""
    return frozenset(_writer(h, d_fmt.tp_rank, p_tp, d_fmt.total_heads, d_fmt.mla)
                     for h in range(d_fmt.head_lo, d_fmt.head_hi))


def targets_of(p_fmt: KVFormat, d_tp: int) -> tuple[int, ...]:
    """D TP ranks the P rank of ``p_fmt`` writes into (may be empty: MLA with P TP > D TP)."""
    out = []
    for j in range(d_tp):
        lo, hi = heads_of(j, d_tp, p_fmt.total_heads, p_fmt.mla)
        if any(_writer(h, j, p_fmt.tp_size, p_fmt.total_heads, p_fmt.mla) == p_fmt.tp_rank
               for h in range(lo, hi)):
            out.append(j)
    return tuple(out)


def describe(fmt: KVFormat) -> str:
    """One line naming a format (for errors that must name both sides)."""
    kind = "MLA latent" if fmt.mla else f"heads {fmt.head_lo}..{fmt.head_hi - 1}/{fmt.total_heads}"
    return (f"[TP {fmt.tp_rank}/{fmt.tp_size}, {kind}, {fmt.dtype}, {fmt.block_tokens} tokens "
            f"per block, {fmt.order}]")


def pair_problem(p_fmt: KVFormat, d_fmt: KVFormat) -> str:
    """"" if P's blocks can be written into D's at the format level, else why not (both named)."""
    why = ""
    if p_fmt.mla != d_fmt.mla:
        why = "one side is MLA and the other is not"
    elif p_fmt.total_heads != d_fmt.total_heads:
        why = "different numbers of KV heads"
    elif p_fmt.dtype != d_fmt.dtype:
        why = "different dtypes"
    elif p_fmt.block_tokens != d_fmt.block_tokens:
        why = "different block sizes"
    elif p_fmt.order != d_fmt.order and (p_fmt.head_hi - p_fmt.head_lo > 1
                                         or d_fmt.head_hi - d_fmt.head_lo > 1):
        why = "different in-block orders (HND vs NHD)"
    elif max(p_fmt.head_lo, d_fmt.head_lo) >= min(p_fmt.head_hi, d_fmt.head_hi):
        why = "no KV head in common"
    elif p_fmt.tp_rank not in expected_senders(d_fmt, p_fmt.tp_size):
        why = "this P rank is not the one that writes these heads to this D rank"
    if why:
        return f"prefill {describe(p_fmt)} cannot write into decode {describe(d_fmt)}: {why}"
    return ""


def block_segments(p_fmt: KVFormat, p_block_len: int, d_fmt: KVFormat,
                   d_block_len: int) -> tuple[Segment, ...]:
    """Byte runs of one P block that land in one D block (raises :class:`LayoutMismatch`)."""
    problem = pair_problem(p_fmt, d_fmt)
    if problem:
        raise LayoutMismatch(problem)
    n_p = p_fmt.head_hi - p_fmt.head_lo
    n_d = d_fmt.head_hi - d_fmt.head_lo
    if p_block_len % n_p or d_block_len % n_d or p_block_len // n_p != d_block_len // n_d:
        raise LayoutMismatch(
            f"prefill {describe(p_fmt)} has {p_block_len} bytes per block for {n_p} head(s), "
            f"decode {describe(d_fmt)} has {d_block_len} bytes for {n_d}: head sizes differ")
    unit = p_block_len // n_p  # bytes of one head in one block
    lo = max(p_fmt.head_lo, d_fmt.head_lo)
    n = min(p_fmt.head_hi, d_fmt.head_hi) - lo
    src0, dst0 = lo - p_fmt.head_lo, lo - d_fmt.head_lo
    if p_fmt.order == "HND" or (n_p == 1 and n_d == 1):
        return ((src0 * unit, dst0 * unit, n * unit),)
    tokens = p_fmt.block_tokens
    if unit % tokens:
        raise LayoutMismatch(f"{unit} bytes per head do not split into {tokens} tokens "
                             f"(prefill {describe(p_fmt)})")
    elem = unit // tokens  # one head of one token
    if n == n_p == n_d:
        return ((0, 0, p_block_len),)
    return tuple(((t * n_p + src0) * elem, (t * n_d + dst0) * elem, n * elem)
                 for t in range(tokens))
