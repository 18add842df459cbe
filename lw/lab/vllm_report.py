"""``lw demo --engine vllm``'s figures and report: what the run printed and whether it passed.

The per-request table (the oracle's verdicts), the TTFT and token-2 lines, the transfer and core
figures from the servers' ``/metrics`` deltas, the prefix-hit prediction the ``--shared-prefix``
run is held to, the proxy's start-mode line and the ``summary`` line with its exit status. The
run itself (servers, prompts, requests) is :mod:`lw.lab.vllm_demo`'s.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lw.lab.demo_client import Result
from lw.lab.local_cluster import BLOCK_SIZE
from lw.lab.oracle import compare

__all__ = ["block_layer_bytes", "predict_prefix_hits", "progress", "report", "report_chunks",
           "report_prefix", "report_warmup", "start_line", "token2_summary", "ttft_summary"]


def predict_prefix_hits(token_ids: Sequence[Sequence[int]], block_size: int,
                        local_tail_tokens: int) -> list[tuple[int, bool, int]]:
    """(blocks D holds, computed locally, blocks P sends) per prompt sent in order to one D.

    D's prefix cache keeps every full prompt block (nothing is evicted in the demo's cache);
    vLLM counts a hit up to the prompt minus one token, in whole blocks.
    """
    cached: set[tuple[int, ...]] = set()
    out = []
    for ids in token_ids:
        cap = (len(ids) - 1) // block_size
        held = 0
        while held < cap and tuple(ids[:(held + 1) * block_size]) in cached:
            held += 1
        local = held > 0 and len(ids) - held * block_size <= local_tail_tokens
        sent = 0 if local else -(-len(ids) // block_size) - held
        out.append((held, local, sent))
        for k in range(1, len(ids) // block_size + 1):
            cached.add(tuple(ids[:k * block_size]))
    return out


def block_layer_bytes(model: Path) -> tuple[int, int]:
    """(bytes of one block in one layer, layers) of the tiny model's bf16 KV cache on CPU."""
    cfg = json.loads((model / "config.json").read_text())
    if "kv_lora_rank" in cfg:  # MLA: one latent vector (+ rope part) per token
        width = int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])
        return BLOCK_SIZE * width * 2, int(cfg["num_hidden_layers"])
    heads = int(cfg["num_key_value_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    # vLLM CPU: one plane per layer, (blocks, kv heads, block size, K+V head dims), bf16.
    return heads * BLOCK_SIZE * 2 * head_dim * 2, int(cfg["num_hidden_layers"])


def _bar(done: int, total: int, width: int = 30) -> str:
    filled = width * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def progress(label: str, done: int, total: int) -> None:
    end = "\n" if done == total else ""
    print(f"\r{label:<22} {_bar(done, total)}", end=end, flush=True)


def _ms(x: float | None) -> str:
    return "   -  " if x is None else f"{x * 1000:6.0f}"


def _short(text: str, n: int = 34) -> str:
    text = text.replace("\n", " ").strip()
    return text if len(text) <= n else text[: n - 1] + "…"


def _spread(xs: Sequence[float]) -> str:
    """Median (min-max) of seconds, in ms, padded to one column."""
    ms = sorted(x * 1000 for x in xs)
    med = f"{statistics.median(ms):5.0f} ms"
    return f"{med if len(ms) == 1 else f'{med} ({ms[0]:.0f}-{ms[-1]:.0f})':<22}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def ttft_summary(single: Sequence[float | None], pd: Sequence[float | None],
                 warmups: int) -> list[str]:
    """The TTFT lines: each side's median (min-max) over its measured requests (warm-ups are
    not among them), what each figure includes, and how the medians compare."""
    r = [x for x in single if x is not None]
    d = [x for x in pd if x is not None]
    # a failed request has no TTFT: then say how many each side's figure is over
    over = (f"of {_plural(len(single), 'measured request')} per side"
            if len(r) == len(single) and len(d) == len(pd) else
            f"of the measured requests with a first token (single engine {len(r)} of "
            f"{len(single)}, P/D {len(d)} of {len(pd)})")
    lines = [f"TTFT       median (min-max) {over}, {_plural(warmups, 'warm-up')} per side "
             "excluded"]
    if r:
        lines.append(f"  single engine {_spread(r)} client to first streamed token, one engine")
    if d:
        lines.append(f"  P/D           {_spread(d)} the same plus the proxy hop, D's and P's "
                     "admissions, P's token to D (the KV, where D took no token from P)")
    if not r or not d:
        none = " nor ".join(name for name, xs in (("the single engine", r), ("P/D", d)) if not xs)
        lines.append(f"TTFT       no comparison: no first token from {none}")
        return lines
    lines.append("TTFT       " + _compare(r, d))
    return lines


def _compare(single: Sequence[float], pd: Sequence[float]) -> str:
    """How P/D's median compares with the single engine's, in the numbers' direction."""
    med_r, med_d = statistics.median(single), statistics.median(pd)
    diff = round((med_d - med_r) * 1000)
    if diff == 0:
        return "P/D's median equals the single engine's (to the ms)"
    ratio = f" (x{med_d / med_r:.2f})" if med_r > 0 else ""
    where = "above" if diff > 0 else "below"
    return f"P/D's median is {abs(diff)} ms {where} the single engine's{ratio}"


def token2_summary(single: Sequence[float | None], pd: Sequence[float | None],
                   note: str = "") -> list[str]:
    """The time-to-token-2 lines (client to the second streamed token): each side's median
    (min-max) over the requests that streamed two tokens, and how the medians compare. With
    ``first_token_from_p`` P/D's first token leaves before the KV lands and its second after
    D's first decode step: token 2 shows what the early first token did not hide."""
    r = [x for x in single if x is not None]
    d = [x for x in pd if x is not None]
    lines = [f"token 2    median (min-max), client to the second streamed token, over the "
             f"requests with one (single engine {len(r)} of {len(single)}, P/D {len(d)} of "
             f"{len(pd)})" + (f" {note}" if note else "")]
    if r:
        lines.append(f"  single engine {_spread(r)}".rstrip())
    if d:
        lines.append(f"  P/D           {_spread(d)}".rstrip())
    lines.append("token 2    " + (_compare(r, d) if r and d else "no comparison: no second "
                                  "token from " + ("the single engine" if not r else "P/D")))
    return lines


def start_line(m: dict[str, Any]) -> str:
    """How the proxy started the run's prefills (warm-ups included): ahead of D's params and
    bound, or D first (and why not ahead), from its /metrics-json counters."""
    skipped = {k.removeprefix("ahead_skipped_"): int(v) for k, v in m.items()
               if k.startswith("ahead_skipped_") and v}
    why = ", ".join(f"{k} {v}" for k, v in skipped.items())
    return (f"starts     {m.get('prefills', 0)} prefills: {m.get('ahead_bound', 0)} sent "
            f"ahead and bound, {m.get('ahead_fallbacks', 0) + m.get('ahead_unbound', 0)} "
            f"fallbacks to D first" + (f"; not sent ahead: {why}" if why else ""))


def report_warmup(ref: Sequence[Result], pd: Sequence[Result]) -> int:
    """Print what the warm-up requests took (not measured); return how many failed."""
    def show(res: Sequence[Result]) -> str:
        return ", ".join(r.error[:80] if r.error else "no first token" if r.ttft_s is None
                         else f"{r.ttft_s:.1f} s" for r in res)

    print(f"warm-up    {len(ref)} request{'s' if len(ref) != 1 else ''} per side, not measured; "
          f"first token after: single engine {show(ref)}; P/D {show(pd)}", flush=True)
    return sum(bool(r.error) or r.finish_reason is None for r in (*ref, *pd))


def report_chunks(before_p: dict[str, float], after_p: dict[str, float],
                   required: bool) -> tuple[bool, str]:
    """Blocks P pushed before a prompt's last chunk (progressive push); > 0 when ``required``."""
    early = round(after_p.get("lw_early_chunk_blocks_total", 0)
                  - before_p.get("lw_early_chunk_blocks_total", 0))
    print(f"chunks     P wrote {early} blocks with a chunk before its prompt's last chunk "
          "(progressive push)")
    if required and early <= 0:
        print("chunks     NOT PUSHED EARLY: long prompts sent every block in the last chunk",
              file=sys.stderr)
    return early > 0 or not required, f" early_chunk_blocks={early}"


def report_prefix(model: Path, token_ids: list[list[int]], before_p: dict[str, float],
                   after_p: dict[str, float], before_d: dict[str, float],
                   after_d: dict[str, float]) -> tuple[bool, str]:
    """Prefix-hit figures against the prediction: (all as predicted, summary line addition)."""
    plan = predict_prefix_hits(token_ids, BLOCK_SIZE, BLOCK_SIZE)
    want_hits = sum(held for held, _, _ in plan)
    want_tails = sum(local for _, local, _ in plan)
    want_blocks = sum(sent for _, _, sent in plan)
    block_bytes, layers = block_layer_bytes(model)
    want_bytes = want_blocks * block_bytes * layers
    hits = round(after_d.get("lw_prefix_hit_blocks_total", 0) - before_d.get(
        "lw_prefix_hit_blocks_total", 0))
    tails = round(after_d.get("lw_local_tails_total", 0) - before_d.get(
        "lw_local_tails_total", 0))
    nbytes = round(after_p.get("lw_transfer_bytes_total", 0) - before_p.get(
        "lw_transfer_bytes_total", 0))
    print("prefix     per prompt (tokens: D held blocks, sent blocks): " + ", ".join(
        f"{len(ids)}: {held}{' local' if local else ''}/{sent}"
        for ids, (held, local, sent) in zip(token_ids, plan, strict=True)))
    print(f"prefix     D held {hits} blocks (expected {want_hits}), computed {tails} tails "
          f"itself (expected {want_tails}); P wrote {nbytes} bytes, expected {want_bytes} = "
          f"{want_blocks} blocks D did not hold x {block_bytes} B x {layers} layers")
    ok = hits == want_hits and tails == want_tails and nbytes == want_bytes
    if not ok:
        print("prefix     MISMATCH: the bytes moved are not the blocks D did not hold",
              file=sys.stderr)
    return ok and hits > 0, f" prefix_hit_blocks={hits}"


def report(prompts: Sequence[str | list[int]], ref: list[Result], pd: list[Result], leaked: int,
            before: dict[str, float], after_p: dict[str, float],
            after_d: dict[str, float],
            checks: Sequence[Callable[[], tuple[bool, str]]] = (),
            drift: float | None = None, before_d: dict[str, float] | None = None,
            warmups: int = 0, warmup_failed: int = 0) -> int:
    """The per-request table, TTFT and transfer figures, the checks and the ``summary`` line
    of the measured requests (metrics as deltas from ``before``/``before_d``); exit status."""
    before_d = before_d or {}
    print()
    print(f"{'#':>2} {'words':>5} {'TTFT 1 eng':>10} {'TTFT P/D':>9} {'tok2 1 eng':>10} "
          f"{'tok2 P/D':>9}  {'single engine':<34} {'P/D':<34} same")
    done = failed = mismatched = 0
    notes = []
    for i, (p, r, d) in enumerate(zip(prompts, ref, pd, strict=True)):
        ok = not d.error and d.finish_reason is not None
        # same tokens (and, with ``drift``, distributions), or a near tie of the reference's at
        # the first divergence (lw.lab.oracle)
        verdict = compare(r, d, drift=drift)
        same = ok and verdict.same
        done += ok
        failed += not ok
        mismatched += ok and not same
        right = d.error if d.error else d.text
        size = len(p.split()) if isinstance(p, str) else len(p)
        mark = "yes" if verdict.kind == "equal" else f"tie@{verdict.position}" if same else "NO"
        print(f"{i:>2} {size:>5} {_ms(r.ttft_s):>7} ms {_ms(d.ttft_s):>6} ms "
              f"{_ms(r.token2_s):>7} ms {_ms(d.token2_s):>6} ms  "
              f"{_short(r.text if not r.error else r.error):<34} {_short(right):<34} {mark}")
        if verdict.kind != "equal":
            notes.append(f"{i:>2}: {verdict}")
    for note in notes:  # ties with the reference's margin there; why the others differ
        print(f"oracle     {note}")
    for line in ttft_summary([r.ttft_s for r in ref], [d.ttft_s for d in pd], warmups):
        print(line)
    for line in token2_summary([r.token2_s for r in ref], [d.token2_s for d in pd]):
        print(line)

    def delta(key: str, after: dict[str, float] = after_p,
              since: dict[str, float] = before) -> float:
        return after.get(key, 0.0) - since.get(key, 0.0)

    nbytes, secs = delta("lw_transfer_bytes_total"), delta("lw_transfer_seconds_total")
    writes = delta("lw_transfers_total")
    if done:
        rate = f", {nbytes / secs / 1e6:.0f} MB/s over push time" if secs > 0 else ""
        print(f"transfers  P wrote {nbytes / 2**20:.2f} MiB in {writes:.0f} transfers "
              f"({nbytes / done / 1024:.0f} KiB per request); push time {secs * 1000 / done:.1f} "
              f"ms per request (first layer computed -> DONE acknowledged, later layers' compute "
              f"included){rate}")
        print(f"lw core    P: done={delta('lw_requests_done_total'):.0f} "
              f"failed={delta('lw_requests_failed_total'):.0f} "
              f"deadlines={delta('lw_deadlines_fired_total'):.0f}; D: done="
              f"{delta('lw_requests_done_total', after_d, before_d):.0f} failed="
              f"{delta('lw_requests_failed_total', after_d, before_d):.0f} deadlines="
              f"{delta('lw_deadlines_fired_total', after_d, before_d):.0f}")
        print(f"first tok  D streamed P's token for "
              f"{delta('lw_first_token_from_p_total', after_d, before_d):.0f} requests and "
              f"recomputed the last prompt token for "
              f"{delta('lw_last_token_recomputed_total', after_d, before_d):.0f} (fallbacks: "
              f"{delta('lw_first_token_fallbacks_total', after_d, before_d):.0f}; "
              f"lw_first_token_fallbacks_total on D's /metrics names each reason)")
    print(f"blocks     held after the run: {leaked} (prefill + decode, from vLLM's kv cache usage)")
    prefix_ok, extra = True, ""
    for check in checks:
        ok, text = check()
        prefix_ok, extra = prefix_ok and ok, extra + text
    if warmup_failed:  # not among the measured requests, but a failure all the same
        extra += f" warmup_failed={warmup_failed}"
    print(f"summary done={done} failed={failed} leaked_blocks={leaked} mismatched={mismatched}"
          + extra)
    return 0 if (failed == 0 and leaked == 0 and mismatched == 0 and prefix_ok
                 and not warmup_failed) else 1
