"""Which block ids of a request's block table each side hands to its core: D the blocks it
registers and names to P after its own prefix hit, P the blocks each prefill chunk completes.

These are the slices where a front-trimmed or shifted block list would put the right KV into
the wrong blocks (vllm #48633's class); drivers call them instead of slicing tables themselves.
Index arithmetic over a prompt's blocks is :mod:`lw.fsm.prefill_request`'s (``received_blocks``,
``blocks_complete``); this module applies it to a block table.
"""

from __future__ import annotations

from collections.abc import Sequence

from lw.fsm.prefill_request import blocks_complete, received_blocks

__all__ = ["blocks_to_push", "blocks_to_receive"]


def blocks_to_receive(table: Sequence[int], prompt_tokens: int, cached_tokens: int,
                      block_size: int) -> tuple[int, tuple[int, ...]]:
    """D: (how many of the prompt's first blocks D holds itself, the ids of the blocks P writes)
    from D's block table for the prompt, after D's own prefix hit of ``cached_tokens`` (whole
    blocks). Raises ValueError if the inputs are impossible or the table is too short."""
    span = received_blocks(prompt_tokens, cached_tokens, block_size)
    if len(table) < span.stop:
        raise ValueError(f"a block table of {len(table)} blocks for a prompt of "
                         f"{prompt_tokens} tokens ({span.stop} blocks of {block_size})")
    return span.start, tuple(table[span.start:span.stop])


def blocks_to_push(table: Sequence[int], prompt_tokens: int, tokens_done: int,
                   first_block: int, pushed: int, block_size: int) -> tuple[int, ...]:
    """P: the ids of its blocks a chunk hands to its core, once ``tokens_done`` of the prompt
    are computed (all of them, or more: the whole prompt): those complete now, not held by D
    (the first ``first_block``) and not among the ``pushed`` handed on by earlier chunks. They
    pair in order with D's received blocks after the first ``pushed``. Raises ValueError on
    impossible inputs or a short table."""
    total = -(-prompt_tokens // block_size) if prompt_tokens > 0 and block_size > 0 else 0
    if total == 0 or tokens_done < 0:
        raise ValueError(f"{tokens_done} tokens done of a prompt of {prompt_tokens} "
                         f"(block size {block_size})")
    if first_block < 0 or pushed < 0 or first_block + pushed > total:
        raise ValueError(f"D holds {first_block} and P pushed {pushed} of the prompt's "
                         f"{total} blocks")
    complete = blocks_complete(tokens_done, prompt_tokens, block_size)
    # vLLM allocates P's blocks chunk by chunk: the table may end before D's hit does
    if len(table) < complete:
        raise ValueError(f"a block table of {len(table)} blocks, {complete} are complete "
                         f"after {tokens_done} of {prompt_tokens} tokens")
    return tuple(table[first_block + pushed:complete])
