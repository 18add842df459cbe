"""The serving benchmark's clients: ``vllm bench serve`` against a set-up, the single server's
prefill time, and what lw's timelines say after a run (phases, P's prefill, the first-token
hop). Moved out of ``serving.py`` to keep that file readable; no servers are started here."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks._first_token import (
    before_done_refusals,
    before_done_share,
    first_token_hops,
    hop_summary,
    p_prefill_s,
    token1_before_done,
)
from benchmarks._plan import OUTPUT_TOKENS, Shape, make_prompts
from lw.lab.vllm_demo import MODEL_NAME, LocalCluster, complete


def after_lw_run(cluster: LocalCluster, label: str, result: dict[str, Any],
                 since: float) -> None:
    """After each lw P/D run: where each request's time went, from lw's lifecycle events on P
    and D (``lw status`` timelines) and the proxy's milestones, as mean per phase; P's prefill
    time, the "P sampled -> D received" hop of each request and whether its first token reached
    the client before D's last DONE into ``result``."""
    import httpx

    from lw.ops.client import MAX_TIMELINE, query
    from lw.ops.phases import TOKEN_PHASES, format_phases, milestones, phase_means

    snap = query(cluster.status_workers(), cluster.cluster_key, timeline=MAX_TIMELINE,
                 timeout_s=10)
    try:
        proxy = httpx.get(cluster.control_url + "/lw/timeline", timeout=10).json()
    except httpx.HTTPError as exc:
        print(f"  (no proxy timeline: {exc})")
        proxy = {}
    ms = milestones(snap, proxy)
    done = {k: m for k, m in ms.items() if "first_token" in m.times and "all_done" in m.times
            and m.times.get("received", 0.0) >= since}  # this run's requests only
    print(format_phases(phase_means(done), f"lw phases, {label}: mean over "
                        f"{len(done)} request(s) ({len(snap.silent)} worker(s) silent)"),
          flush=True)
    result["lw_phases_ms"] = {name: round(mean * 1e3, 1) for name, mean, n in
                              phase_means(done) if n}
    token_rows = phase_means(done, TOKEN_PHASES)
    if any(n for _name, _mean, n in token_rows):  # P's token streamed (not lw-off)
        print(format_phases(token_rows, "  token 1's path (P's sampled token), mean"),
              flush=True)
        result["token_phases_ms"] = {name: round(mean * 1e3, 1) for name, mean, n in
                                     token_rows if n}
    pre = p_prefill_s(m.times for m in done.values())
    result["p_prefill_ms"] = statistics.median(pre) * 1e3 if pre else None
    hops = [h * 1e3 for h in first_token_hops(snap.replies, since)]
    result["first_token_hop_ms"] = hops
    print(f"  P sampled -> D received (first_token events), p50 / max ms: {hop_summary(hops)} "
          f"over {len(hops)} request(s)", flush=True)
    before = result["token1_before_done"] = token1_before_done(snap.replies, proxy, since)
    why = before_done_refusals(before)
    print(f"  token 1 before D's last DONE (the proxy's first token vs D's all_done): "
          f"{before_done_share(before)}{f'; not judged: {why}' if why else ''}", flush=True)


def prefill_time(url: str, model: Path, input_len: int, n: int = 5, seed: int = 0) -> float:
    """The server's prefill time for ``input_len``-token prompts: TTFT p50 (s) with
    ``max_tokens`` 1 (the whole response) over ``n`` fresh prompts, sent one at a time after
    one not counted (the first prompt of a length is slower)."""
    prompts = make_prompts(model, Shape(input_len, 1, n + 1), f"calibrate-{seed}")
    ttfts = []
    for p in prompts:
        # not streamed: a random model's one token can be empty text (no streamed chunk)
        r = complete(url, p, max_tokens=1, stream=False, timeout=300.0)
        if r.error:
            raise RuntimeError(f"prefill-time request failed: {r.error}")
        ttfts.append(r.total_s)
    return statistics.median(ttfts[1:])


def run_bench(url: str, model: Path, dataset: Path, shape: Shape, out: Path,
              timeout: float) -> dict[str, Any]:
    """Run ``vllm bench serve`` against ``url``; its saved JSON result with the per-request
    lists (``--save-detailed``: ttfts, itls, errors; RuntimeError if none)."""
    argv = ["bench", "serve", "--backend", "vllm", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", MODEL_NAME, "--tokenizer", str(model),
            "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
            "--disable-shuffle", "--sharegpt-output-len", str(OUTPUT_TOKENS), "--ignore-eos",
            "--num-prompts", str(shape.prompts), "--max-concurrency", str(shape.concurrency),
            "--request-rate", "inf", "--temperature", "0", "--num-warmups", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", str(out.parent),
            "--result-filename", out.name,
            "--disable-tqdm"]
    # vllm bench serve's ShareGPT loader drops prompts over 1,024 tokens (and prompt + output
    # over 2,048) without a flag to change it; our prompts are exactly shape.input_len long.
    code = ("import sys\nfrom lw.vllm_adapter.serve import install_version_shim\n"
            "install_version_shim()\n"
            "import vllm.benchmarks.datasets.datasets as ds\n"
            "_valid = ds.is_valid_sequence\n"
            "ds.is_valid_sequence = lambda p, o, **kw: _valid(\n"
            "    p, o, **{**kw, 'max_prompt_len': 1 << 20, 'max_total_len': 1 << 20})\n"
            "from vllm.entrypoints.cli.main import main\n"
            "sys.argv = ['vllm', *sys.argv[1:]]\nmain()\n")
    log = out.with_suffix(".log")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", code, *argv], stdout=f,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            os.killpg(proc.pid, 9)
            proc.wait(5)
            raise RuntimeError(f"vllm bench serve timed out after {timeout:.0f}s; log {log}"
                               ) from exc
        except BaseException:  # Ctrl-C, SIGTERM: the client is in its own session
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            raise
    if rc != 0 or not out.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"vllm bench serve exited {rc}:\n{tail}")
    return json.loads(out.read_text())
