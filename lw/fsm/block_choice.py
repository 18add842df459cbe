"""Which block ids of a request's block table each side hands to its core: D the blocks it
registers and names to P after its own prefix hit, P the blocks each prefill chunk completes
(and, in :class:`PushCursor`, how far a request's push has got on P's scheduler).

These are the slices where a front-trimmed or shifted block list would put the right KV into
the wrong blocks (vllm #48633's class); drivers call them instead of slicing tables themselves.
Index arithmetic over a prompt's blocks is :mod:`lw.fsm.prefill_request`'s (``received_blocks``,
``blocks_complete``); this module applies it to a block table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lw.fsm.prefill_request import blocks_complete, received_blocks

__all__ = ["Push", "PushCursor", "blocks_to_push", "blocks_to_receive"]


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


@dataclass(frozen=True)
class Push:
    """One chunk's push: P's blocks it hands on; ``first``: the request's first push (the
    workers add it to their cores, else they announce a further chunk); ``final``: its last."""

    local: tuple[int, ...]
    first: bool
    final: bool


@dataclass
class PushCursor:
    """How far one request's push has got, for P's scheduler (a process without the cores):
    what a chunk hands on follows the rules :meth:`PrefillEndpoint.add_chunk` enforces (an
    empty chunk is announced only as the first, none after the last or after a stop)."""

    first_block: int  # the prompt's first blocks, which D holds itself (never pushed)
    started: bool = False  # pushed once: the workers' cores hold the request
    pushed: int = 0  # D blocks handed on so far
    final: bool = False  # its last chunk was pushed
    stopped: bool = False  # stopped after its first push (preempted): never pushed again

    def chunk(self, table: Sequence[int], prompt_tokens: int, tokens_done: int,
              block_size: int, start_early: Callable[[], bool]) -> Push | None:
        """A chunk ending after ``tokens_done`` tokens is computed: what it pushes, or None.
        ``start_early``: whether a push not started yet starts with a chunk before the last
        (asked only then). Raises ValueError as :func:`blocks_to_push` does."""
        if self.final or self.stopped:
            return None
        final = tokens_done >= prompt_tokens
        if not final and not self.started and not start_early():
            return None  # a later chunk starts the push
        local = blocks_to_push(table, prompt_tokens, tokens_done, self.first_block,
                               self.pushed, block_size)
        if not local and self.started:
            return None  # completes no block: its layers are not reported for the request
        push = Push(local, not self.started, final)
        self.started, self.pushed, self.final = True, self.pushed + len(local), final
        return push

    def stop(self) -> bool:
        """The request's blocks were freed under its push (vLLM preempted it): whether the
        workers must abort it (they hold it and it is not over); no chunk is pushed after."""
        if not self.started or self.final or self.stopped:
            return False
        self.stopped = True
        return True
