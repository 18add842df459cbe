"""``lw demo --engine vllm``: a local P/D cluster on a tiny model, checked against one engine.

It makes the tiny random model, starts a reference ``vllm serve`` (no connector), a prefill and a
decode server (lw's connector, Mooncake over TCP, or NIXL with ``--data-plane nixl``) and the
D-first proxy, sends prompts of several lengths (one block .. long enough for chunked prefill)
to both, prints the outputs side by side with time-to-first-token and transfer figures, checks
that no KV block is left held on either server, shuts everything down and ends with
``summary done=<n> failed=<n> leaked_blocks=<n> mismatched=<n>`` (exit 0 iff all done, none
leaked, none mismatched). Before the measured prompts each side answers warm-up prompts (one,
or one per DP rank) that share no prefix block with them: they are left out of every figure and
count (a failed one adds ``warmup_failed=<n>`` and fails the run), and TTFT is reported as
median and range per side. "Same" is :mod:`lw.lab.oracle`'s: the same greedy tokens, or a
near tie of the reference's at the first divergence (``tie@i``); D verifies lw's KV checksums
(``kv_checksum``) of every block P wrote, and a request whose bytes differ fails.

``--shared-prefix`` sends prompts that share long prefixes, some repeated, so that the decode
server's prefix cache hits (partly, and fully: a short tail D computes itself); the summary adds
``prefix_hit_blocks=<n>`` and the run also fails unless the bytes P wrote equal the blocks D did
not hold (predicted from the prompts' token ids), times the block bytes of every layer.

``--validate`` asks every P and D worker for its lifecycle timeline before the servers stop,
writes the run as an ``lw-trace`` (each request in the shape its cores saw:
:mod:`lw.lab.trace_export`) and checks it with ``lw validate`` against the checked
model; it prints the verdict and ``traces validated=<n> rejected=<n> undecided=<n>``, and a
trace that is not valid (its first unexplained event named) fails the run.

The process management (:mod:`lw.lab.local_cluster`) and the client
(:mod:`lw.lab.demo_client`) are also what the end-to-end tests and the benchmarks use;
their names are re-exported here, as are the report's (:mod:`lw.lab.vllm_report`).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from lw.lab.demo_client import (
    MODEL_NAME,
    Result,
    blocks_in_use,
    complete,
    make_prompt,
    metrics,
    tokenize,
    wait_blocks_released,
)
from lw.lab.local_cluster import (
    BLOCK_SIZE,
    MAX_BATCHED_TOKENS,
    LocalCluster,
    Server,
    free_port,
    free_port_range,
    in_workdir,
    kv_transfer_config,
    wait_ready,
)
from lw.lab.oracle import DRIFT, TOP_K
from lw.lab.vllm_report import (
    block_layer_bytes,
    predict_prefix_hits,
    progress,
    report,
    report_chunks,
    report_prefix,
    report_warmup,
    start_line,
    token2_summary,
    ttft_summary,
)
from lw.proxy.state import DEFAULT_START_MODE, START_MODES
from lw.vllm_adapter.config import LwConfig

_LEASE_S = float(next(f.default for f in fields(LwConfig) if f.name == "lease_s"))
"""D's default lease: how long a failed request's blocks may stay quarantined."""

__all__ = ["BLOCK_SIZE", "MAX_BATCHED_TOKENS", "MODEL_NAME", "LocalCluster", "Result", "Server",
           "block_layer_bytes", "blocks_in_use", "complete", "free_port", "free_port_range",
           "kv_transfer_config", "main", "make_prompt", "metrics", "predict_prefix_hits",
           "shared_prefix_prompts", "token2_summary", "tokenize", "ttft_summary",
           "wait_blocks_released", "wait_ready", "warmup_prompts"]

VLLM_PLANES = ("mooncake", "nixl")
"""lw's data planes between vLLM engines (``inprocess`` needs P and D in one process)."""
PROMPT_LENGTHS = (12, 90, 300, 700)  # words ~ tokens: 1 block, 3, 10, 22 (chunked)
# --long-prompts: 4 to 7 chunks of MAX_BATCHED_TOKENS each (progressive push shows here)
LONG_PROMPT_LENGTHS = (1100, 1300, 1500, 1800)
# (prefix, suffix words, suffix seed): cold, partial hit, full hit (a repeat), ... in turn.
_SHARED = ((0, 40, 1), (0, 40, 2), (0, 40, 1), (1, 70, 3), (1, 70, 4), (0, 40, 2), (1, 70, 3),
           (0, 100, 5))
_PREFIX_WORDS = (160, 224)  # 5 and 7 blocks of 32 tokens
# ~10 blocks, two prefill chunks: a warm-up also takes the first transfer and chunked prefill
WARMUP_WORDS = 300
# The tiny model's tokenizer gives one token per word: prompts differing in their first words
# differ in their first block, so no later block can be a prefix-cache hit either.
_APART_WORDS = 4


def shared_prefix_prompts(n: int) -> list[str]:
    """``n`` prompts sharing two long prefixes, several repeated word for word."""
    prefixes = [make_prompt(w, seed=1000 + i) for i, w in enumerate(_PREFIX_WORDS)]
    out = []
    for i in range(n):
        pre, words, seed = _SHARED[i % len(_SHARED)]
        out.append(prefixes[pre] + " " + make_prompt(words, seed=2000 + seed))
    return out


def warmup_prompts(prompts: Sequence[str], count: int) -> list[str]:
    """``count`` warm-up prompts sharing no prefix block with ``prompts`` (nor each other)."""
    taken = {tuple(p.split()[:_APART_WORDS]) for p in prompts}
    out: list[str] = []
    seed = 1_000_000  # the measured prompts' seeds are far below
    while len(out) < count:
        cand = make_prompt(WARMUP_WORDS, seed=seed)
        seed += 1
        head = tuple(cand.split()[:_APART_WORDS])
        if head not in taken:
            taken.add(head)
            out.append(cand)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; exit 0 iff every request is done, none leaked blocks, none mismatched."""
    ap = argparse.ArgumentParser(prog="lw demo --engine vllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8, help="number of prompts (default 8)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="model and server logs (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    ap.add_argument("--timeout", type=float, default=300.0, help="server start timeout, s")
    ap.add_argument("--shared-prefix", action="store_true",
                    help="prompts sharing long prefixes, repeated: D's prefix cache hits; "
                         "check that only the blocks D did not hold move")
    ap.add_argument("--long-prompts", action="store_true",
                    help="prompts of 4 to 7 prefill chunks: P pushes each chunk's blocks while "
                         "it computes (push_mode progressive: on loopback, auto would wait for "
                         "the last chunk); the summary's early_chunk_blocks must be > 0")
    ap.add_argument("--prefill-tp", type=int, default=1, help="prefill tensor-parallel size")
    ap.add_argument("--decode-tp", type=int, default=1, help="decode tensor-parallel size")
    ap.add_argument("--prefill-dp", type=int, default=1, help="prefill data-parallel size")
    ap.add_argument("--decode-dp", type=int, default=1, help="decode data-parallel size")
    ap.add_argument("--model-kind", choices=("llama", "mla"), default="llama",
                    help="tiny random Llama, or DeepSeek-V2-style MLA (latent KV)")
    ap.add_argument("--start-mode", choices=START_MODES, default=DEFAULT_START_MODE,
                    help=f"the proxy's start mode (lw proxy --start-mode; default "
                         f"{DEFAULT_START_MODE}): compute-ahead has P compute a prompt before "
                         f"D's params came, d-first once D allocated")
    ap.add_argument("--validate", action="store_true",
                    help="validate the run's trace (every worker's timeline) against the "
                         "checked model (lw validate)")
    ap.add_argument("--data-plane", choices=VLLM_PLANES, default="mooncake",
                    help="lw's data plane on P and D: mooncake (Mooncake over TCP) or nixl "
                         "(NIXL's UCX backend, TCP unless UCX_TLS is set; lease-only: D's "
                         "fence off)")
    ap.add_argument("--timelines-out", type=Path, default=None, metavar="DIR",
                    help="keep the run's lw-trace file here (vllm.jsonl; default with "
                         "--validate: the work folder)")
    args = ap.parse_args(list(argv) if argv is not None else None)
    if args.requests < 1:
        ap.error("--requests must be >= 1")
    for flag in ("prefill_tp", "decode_tp", "prefill_dp", "decode_dp"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.data_plane == "nixl":
        from lw.transport.dataplane.nixl import nixl_missing

        why = nixl_missing()
        if why:
            print(f"lw demo: the NIXL data plane is unavailable: {why}; or use "
                  "--data-plane mooncake", file=sys.stderr)
            return 2
    return in_workdir(args, "lw-demo-", _run)


def plane_label(plane: str) -> str:
    """How the header names lw's data plane (a lease-only plane says D's fence is off)."""
    if plane == "nixl":
        return "NIXL over UCX (lease-only: D's fence off)"
    return "Mooncake over TCP"


def _run(args: argparse.Namespace) -> int:
    from lw.lab.tiny_model import make_tiny_model

    n = args.requests
    kind = "prompts sharing prefixes" if args.shared_prefix else "prompts"
    shape = (f"P TP {args.prefill_tp} DP {args.prefill_dp} -> D TP {args.decode_tp} "
             f"DP {args.decode_dp}")
    # Prefill failover (D TP 1 only): a request whose transfer was lost or went bad is
    # prefilled again once, on any prefill server (the proxy prefers one it has not tried)
    failover = ({"retry_prefill": 1, "retry_prefill_avoid": "none"} if args.decode_tp == 1
                else {})
    retry = ", prefill failover 1 retry" if failover else ""
    print(f"lw demo: {n} {kind}, vLLM on CPU, tiny random {args.model_kind} model, {shape}, "
          f"{plane_label(args.data_plane)}{retry}, start mode {args.start_mode}")
    model = make_tiny_model(args.workdir / f"tiny-{args.model_kind}", kind=args.model_kind)
    print(f"model      {model}")
    if args.shared_prefix:
        prompts = shared_prefix_prompts(n)
    elif args.long_prompts:
        prompts = [make_prompt(LONG_PROMPT_LENGTHS[i % len(LONG_PROMPT_LENGTHS)], seed=i)
                   for i in range(n)]
    else:
        prompts = [make_prompt(PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)], seed=i)
                   for i in range(n)]
    # D verifies the CRC-32C of every block P wrote: a P/D output is judged on the same KV
    checksum = {"kv_checksum": True}
    push = {"push_mode": "progressive"} if args.long_prompts else {}
    cluster = LocalCluster(model=model, workdir=args.workdir / "logs", p_tp=args.prefill_tp,
                           d_tp=args.decode_tp, p_dp=args.prefill_dp, d_dp=args.decode_dp,
                           p_extra={**checksum, **push}, d_extra={**checksum, **failover},
                           proxy_args=["--start-mode", args.start_mode],
                           data_plane=args.data_plane,
                           # one job: its servers in the demo's session (Server.own_session)
                           own_sessions=False)
    t0 = time.monotonic()
    print("starting   reference engine, prefill and decode servers (vllm serve), proxy ...",
          flush=True)
    failed_start = ""
    try:
        cluster.start(timeout=args.timeout)
    except RuntimeError as exc:
        failed_start = str(exc)
    if failed_start:
        print(f"error: {failed_start}", file=sys.stderr)
        print(f"summary done=0 failed={n} leaked_blocks=0 mismatched=0")
        return 1
    try:
        print(f"started    in {time.monotonic() - t0:.0f}s; logs in {cluster.workdir}")
        for name in ("reference", "prefill", "decode", "proxy"):
            print(f"  {name:<10} {cluster.url(name)}")
        # A fresh engine's first requests pay one-time set-up (seconds on CPU), as does the
        # first transfer: one warm-up per DP rank that may serve, on each side, left out of
        # every figure. Their prompts share no block with the measured ones, so neither prefix
        # cache holds anything a measured prompt could hit.
        warm = warmup_prompts(prompts, max(args.prefill_dp, args.decode_dp))
        pre_p, pre_d = metrics(cluster.url("prefill")), metrics(cluster.url("decode"))
        warm_ref = [complete(cluster.url("reference"), w, args.max_tokens, logprobs=TOP_K)
                    for w in warm]
        warm_pd = [complete(cluster.url("proxy"), w, args.max_tokens, token_ids=True)
                   for w in warm]
        warm_failed = report_warmup(warm_ref, warm_pd)
        # the measured figures start once P's and D's metrics hold every warm-up
        before, before_d = _settled_metrics(cluster, pre_p, pre_d, len(warm))
        ref: list[Result] = []
        for i, p in enumerate(prompts):
            # with logprobs: the oracle (lw.lab.oracle) allows a near tie
            ref.append(complete(cluster.url("reference"), p, args.max_tokens, logprobs=TOP_K))
            progress("single engine", i + 1, n)
        token_ids = ([tokenize(cluster.url("reference"), p) for p in prompts]
                     if args.shared_prefix else [])
        pd: list[Result] = []
        for i, p in enumerate(prompts):
            # no logprobs: they would take vLLM's own first-token path (lw.vllm_adapter.
            # first_token), and the oracle needs only the reference's
            pd.append(complete(cluster.url("proxy"), p, args.max_tokens, token_ids=True))
            progress("P/D via proxy", i + 1, n)
        import httpx

        try:
            # A failed request's blocks may stay quarantined until D's lease ends (by design,
            # lest late bytes land in them): a leak is a block held after that, not before.
            failed_any = warm_failed or any(r.error for r in pd)
            leaked = wait_blocks_released(
                [cluster.url("prefill"), cluster.url("decode")],
                timeout=_LEASE_S + 10.0 if failed_any else 10.0)
            after_p, after_d = _settled_metrics(cluster, before, before_d, n)
            starts = start_line(httpx.get(cluster.control_url + "/metrics-json",
                                           timeout=10).json())
        except (OSError, httpx.HTTPError) as exc:  # a server died after the requests
            return _server_gone(cluster, pd, exc)
        trace = _write_trace(cluster, args) if args.validate or args.timelines_out else None
    finally:
        cluster.stop()
    checks = [functools.partial(report_chunks, before, after_p, args.long_prompts)]
    if args.shared_prefix:
        checks.append(functools.partial(report_prefix, model, token_ids, before, after_p,
                                        before_d, after_d))
    print(starts)
    status = report(prompts, ref, pd, leaked, before, after_p, after_d, checks,
                     DRIFT[args.model_kind], before_d=before_d, warmups=len(warm),
                     warmup_failed=warm_failed)
    if args.validate:
        # after the servers stopped: the search has the CPU to itself
        status = max(status, _validate(trace))
    return status


def _server_gone(cluster: LocalCluster, pd: Sequence[Result], exc: BaseException) -> int:
    """A server stopped answering after the requests went out: say which, where its log is,
    and what is known (no leak count: the dead server's blocks cannot be read)."""
    import httpx

    for name in ("prefill", "decode"):
        try:
            httpx.get(cluster.url(name) + "/health", timeout=5.0)
        except httpx.HTTPError:
            print(f"error: the {name} server stopped answering after the requests "
                  f"({type(exc).__name__}: {exc}); its log: "
                  f"{cluster.servers[name].log_path} (kept with --keep or --workdir)",
                  file=sys.stderr)
    done = sum(1 for r in pd if not r.error and r.finish_reason is not None)
    print(f"summary done={done} failed={len(pd) - done} leaked_blocks=unknown mismatched=unknown "
          "server_died=1")
    return 1


def _write_trace(cluster: LocalCluster, args: argparse.Namespace) -> tuple[str, list[str]]:
    """Every worker's timeline as an lw-trace file (while the servers run): its path ("" when
    no worker answered) and what is wrong with the requests' shapes, if anything."""
    from lw.lab.trace_export import write_cluster_trace

    folder = args.timelines_out or args.workdir
    folder.mkdir(parents=True, exist_ok=True)
    path = str(folder / "vllm.jsonl")
    try:
        answered, silent, problems = write_cluster_trace(cluster, path)
    except (OSError, ValueError) as exc:  # the run's report still comes; the trace fails it
        return "", [f"trace not written: {exc}"]
    print(f"trace      {answered} workers' timelines in {path}"
          + (f"; silent: {', '.join(silent)}" if silent else ""))
    if not answered:
        problems = ["no worker answered: nothing to validate", *problems]
    return (path if answered else ""), problems


def _validate(trace: tuple[str, list[str]] | None) -> int:
    """``lw validate`` on the run's trace: its verdict and the count line; 1 unless valid (a
    request whose shape P and D disagree on is a rejection too)."""
    from lw.lab.trace_export import validate_trace

    path, problems = trace or ("", ["no trace was written"])
    ok = rejected = False
    if path:
        ok, line, bad = validate_trace(path)
        for b in bad:
            print(f"  trace vllm: {b}")
        print(f"  trace vllm: {line}")
        rejected = line.startswith("REJECTED")
    for p in problems:
        print(f"  trace vllm: REJECTED: {p}")
    if problems:
        ok, rejected = False, True
    print(f"traces validated={int(ok)} rejected={int(rejected)} "
          f"undecided={int(not ok and not rejected)}", flush=True)
    return 0 if ok else 1


def _settled_metrics(cluster: LocalCluster, before_p: dict[str, float],
                     before_d: dict[str, float], n: int,
                     timeout: float = 30.0) -> tuple[dict[str, float], dict[str, float]]:
    """P's and D's /metrics once D accounted for every request (stats arrive on vLLM's log
    interval, not with the response): received or computed locally, and P done as often."""
    deadline = time.monotonic() + timeout
    while True:
        after_p, after_d = metrics(cluster.url("prefill")), metrics(cluster.url("decode"))

        def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
            return after.get(key, 0.0) - before.get(key, 0.0)

        d_done = delta(after_d, before_d, "lw_requests_done_total")
        d_failed = delta(after_d, before_d, "lw_requests_failed_total")
        tails = delta(after_d, before_d, "lw_local_tails_total")
        p_done = delta(after_p, before_p, "lw_requests_done_total")
        if (d_done + d_failed + tails >= n and p_done >= d_done) or time.monotonic() > deadline:
            return after_p, after_d
        time.sleep(0.5)


if __name__ == "__main__":
    raise SystemExit(main())
