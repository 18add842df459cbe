"""The checker world's own notion of which KV heads live where, written apart from
:mod:`lw.fsm.kvmap` (which the core uses to build its byte runs): a write is checked against this
model, not against kvmap's own output, so a wrong offset in kvmap is a finding, not an agreement.

vLLM's rule: with ``H >= tp`` heads, rank ``r`` holds the ``H / tp`` heads from ``r * H / tp``;
with fewer heads than ranks each head is replicated and rank ``r`` holds head ``r * H // tp``;
MLA's latent vector is one head every rank holds. In the world a block holds a rank's heads one
after another, ``head_bytes`` each (one token per block).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["held", "write_problem"]


def held(rank: int, tp: int, heads: int, mla: bool) -> range:
    """The global KV heads TP rank ``rank`` of ``tp`` holds."""
    if mla:
        return range(1)
    if heads >= tp:
        per = heads // tp
        return range(rank * per, (rank + 1) * per)
    h = rank * heads // tp
    return range(h, h + 1)


def write_problem(p_rank: int, tp: int, d_rank: int, d_tp: int, heads: int, mla: bool,
                  runs: Sequence[tuple[int, int, int]] | None, p_block: int, d_block: int,
                  head_bytes: int) -> str:
    """"" if the byte runs of a write from P rank ``p_rank`` into D rank ``d_rank`` carry whole
    heads that both hold, each into that head's own slot of D's block and at most once; else
    what is wrong. ``runs`` None: the whole block, as it is."""
    ph, dh = held(p_rank, tp, heads, mla), held(d_rank, d_tp, heads, mla)
    if runs is None:
        if p_block != d_block or ph != dh:
            return (f"the whole block is copied, but P holds heads {_name(ph)} in {p_block} "
                    f"bytes and D heads {_name(dh)} in {d_block}")
        return ""
    seen: set[int] = set()
    for src, dst, n in runs:
        if n <= 0 or src % head_bytes or dst % head_bytes or n % head_bytes:
            return f"byte run {(src, dst, n)} is not whole heads of {head_bytes} bytes"
        for k in range(n // head_bytes):
            hp = ph.start + src // head_bytes + k
            hd = dh.start + dst // head_bytes + k
            if hp not in ph:
                return f"byte run {(src, dst, n)} reads past P's heads {_name(ph)}"
            if hd not in dh:
                return f"byte run {(src, dst, n)} writes past D's heads {_name(dh)}"
            if hp != hd:
                return (f"byte run {(src, dst, n)} puts P's head {hp} into the slot of D's "
                        f"head {hd}")
            if hd in seen:
                return f"head {hd} is written twice"
            seen.add(hd)
    return ""


def _name(r: range) -> str:
    return f"{r.start}..{r.stop - 1}" if len(r) > 1 else str(r.start)
