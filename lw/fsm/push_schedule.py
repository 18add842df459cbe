"""When a prompt computed in chunks starts its push (``push_mode`` "auto"): as late as the link
allows, so that P's forward does not pay for writes that a fast link would finish anyway.

Writing during a chunk costs P's host CPU (the data plane, the kernel's TCP) and so slows that
chunk's forward; it is worth it only where the prompt's KV cannot cross the link during the
compute that is left. The push of a request therefore starts at the first chunk after which the
remaining compute would no longer cover the whole transfer (with ``margin``); from then on every
chunk's complete blocks go as it computes them. The prompt's last chunk always pushes.

The remaining compute is not the tokens left times one rate: each token attends to every token
before it, so a prompt's later chunks cost more per token than its first (on the 2-core testbed a
4,096-token prompt's last chunk took about twice its average). The estimate has a part per token
and a part per (token, earlier token) pair, and the tokens left after position ``k`` of a prompt
of ``n`` tokens hold ``(n - k) * (n + k) / 2`` pairs.

To the endpoint a late start is a request whose first announced chunk completes the blocks of
several engine chunks, which is what an engine with larger chunks announces: the lifecycle, and
what the checker proves of it (``lw check --chunks``: the first chunk may hold more blocks than
the others), are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_MARGIN", "PUSH_MODES", "WAIT_SHARE", "WAIT_WIRE_S",
           "PushEstimate", "attended_pairs", "compute_left", "last_layer_waits_for_token",
           "push_starts_now", "writes_wait_for_forward"]

PUSH_MODES = ("auto", "progressive", "last_chunk")
"""When a prompt computed in chunks starts its push: as the link needs it, at its first chunk,
or at its last."""

DEFAULT_MARGIN = 1.0
"""Start once the transfer needs all of the compute left after this chunk. Both rates are
measured while P pushes (its forward slowed by the push, the link shared with the forward's
CPU), so they already hold what a margin would cover; and on a host where writing costs the
forward CPU, a push started a chunk early costs more than a few milliseconds of tail (on the
2-core testbed, 1.25 started 1,024-token prompts a chunk early on an uncapped link and their TTFT
rose ~10 %). ``push_start_margin`` > 1 starts earlier, where writes cost the forward nothing."""


WAIT_SHARE = 0.5
"""A push held to its forward's end is one whose whole transfer takes at most this share of
that forward on the wire: the link then waits for the CPU, not the CPU for the link."""
WAIT_WIRE_S = 0.010
"""... and at most this long on the wire: token 2 waits for the whole transfer after the
forward, while token 1 gains only what writing during it cost the forward. Measured on the
2-core testbed, uncapped: a 128-token prompt's push (~5 ms on the wire) held to the forward's
end took 16 ms off token 1 and 17 off token 2; a 1,024-token prompt's (~44 ms) took 3-10 ms off
token 1 and added 33-45 to token 2 (docs/benchmarks.md)."""


@dataclass(frozen=True)
class PushEstimate:
    """What P measured: seconds its forward takes per prompt token and per pair of a token and
    one it attends to, and seconds the link to a decode host takes per KV block (every layer of
    it); None where nothing was measured yet."""

    compute_s_per_token: float | None = None
    wire_s_per_block: float | None = None
    compute_s_per_pair: float = 0.0


def attended_pairs(start: int, end: int) -> int:
    """Pairs of a token in positions ``start``..``end``-1 and a token at or before it: the
    attention work of computing those positions (the same sum the workers time a step by)."""
    if not 0 <= start <= end:
        raise ValueError(f"need 0 <= start <= end, got {start}, {end}")
    return (end - start) * (start + end + 1) // 2


def compute_left(est: PushEstimate, computed: int, total: int) -> float | None:
    """Seconds of forward for positions ``computed``..``total``-1 (None: not measured yet)."""
    if est.compute_s_per_token is None:
        return None
    return ((total - computed) * est.compute_s_per_token
            + attended_pairs(computed, total) * est.compute_s_per_pair)


def push_starts_now(*, blocks_to_send: int, tokens_after_chunk: int, est: PushEstimate,
                    margin: float = DEFAULT_MARGIN, mode: str = "auto",
                    tokens_computed: int = 0) -> bool:
    """Whether a request not yet pushed starts its push with the chunk this step computes.

    ``blocks_to_send``: the prompt's blocks D takes from P (all chunks); ``tokens_after_chunk``:
    prompt tokens still to compute once this chunk is done (0: the last chunk);
    ``tokens_computed``: prompt tokens computed once this chunk is done. Under "auto", without
    an estimate of either rate the push starts now: on a link never measured, starting early
    costs at most the forward time its writes take, starting late can leave the whole transfer
    after the last layer (and the early writes measure the link as well).
    """
    if mode not in PUSH_MODES:
        raise ValueError(f"push mode must be one of {', '.join(PUSH_MODES)}, got {mode!r}")
    if tokens_after_chunk <= 0 or mode == "progressive":
        return True
    if mode == "last_chunk":
        return False
    if blocks_to_send <= 0:
        return True
    if margin <= 0:
        raise ValueError(f"margin must be > 0, got {margin}")
    left = compute_left(est, tokens_computed, tokens_computed + tokens_after_chunk)
    if left is None or est.wire_s_per_block is None:
        return True
    return blocks_to_send * est.wire_s_per_block * margin >= left


def writes_wait_for_forward(*, blocks_to_send: int, tokens: int, pairs: int,
                            est: PushEstimate, shares_core: bool) -> bool:
    """Whether a push that starts with the prompt's last chunk (a forward of ``tokens`` tokens
    attending ``pairs`` pairs) writes once that forward is done rather than layer by layer,
    where P's first token goes to D. Where lw's threads can run only on the forward's CPUs
    (``shares_core``), every write during the forward delays token 1 by its CPU while the KV
    lands little later. Only a short transfer (on the wire within ``WAIT_SHARE`` of the
    forward and within ``WAIT_WIRE_S``, both measured); never unmeasured, and never where the
    threads have a core of their own (writing during the forward costs it nothing there)."""
    if not shares_core or blocks_to_send <= 0 or est.wire_s_per_block is None:
        return False
    if est.compute_s_per_token is None or tokens <= 0:
        return False
    compute = tokens * est.compute_s_per_token + pairs * est.compute_s_per_pair
    return blocks_to_send * est.wire_s_per_block <= min(compute * WAIT_SHARE, WAIT_WIRE_S)


def last_layer_waits_for_token(*, blocks_to_send: int, share: float, est: PushEstimate,
                               sample_s: float | None) -> bool:
    """Whether the writes of a prompt's last forward hook (``share`` of the bytes of its
    ``blocks_to_send`` blocks: the last layer, or every layer of a push that waited for the
    forward) wait until P's worker has handed D the token it sampled, ``sample_s`` after that
    hook (measured on earlier prompts). Where those bytes would still be on the wire when the
    token leaves, the token would queue behind them on the link (one FIFO): it goes first, and
    the bytes lose at most the sampling time, if the link had nothing else to carry meanwhile;
    D, which needs both to compute token 2, waits for the later either way. Never unmeasured."""
    if blocks_to_send <= 0 or share <= 0 or est.wire_s_per_block is None or sample_s is None:
        return False
    return blocks_to_send * est.wire_s_per_block * share > sample_s
