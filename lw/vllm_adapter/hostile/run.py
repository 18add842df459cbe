"""Running ``lw hostile``: its arguments, starting the cluster and the canary, sending each case
and measuring what moved, and the lines that follow the table."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from lw.vllm_adapter.hostile.cases import Case, build_cases
from lw.vllm_adapter.hostile.probes import (
    Canary,
    Context,
    RssSampler,
    cpu_s,
    healthy,
    honest,
    rss_kb,
    settle,
    snapshot,
    wait_live_zero,
)
from lw.vllm_adapter.hostile.table import (
    Row,
    deltas_between,
    exit_status,
    format_row,
    header,
    summarize,
    summary_line,
)


def run_case(ctx: Context, case: Case, seed: int) -> Row:
    """Send one case and measure what moved; then check health and an honest request. A case
    sent straight to an engine is framed by plain requests on both engines (the counters of
    earlier work reported before it, its own after it)."""
    direct = case.target in ("decode", "prefill")
    if direct:
        settle(ctx)
    before = snapshot(ctx)
    cpu0 = cpu_s(ctx.proxy_pid)
    engine_pid = {"decode": ctx.decode_pid, "prefill": ctx.prefill_pid}.get(case.target, 0)
    with RssSampler(ctx.proxy_pid) as rss, RssSampler(engine_pid) as engine_rss:
        rss_before, engine_before = rss.peak, engine_rss.peak
        got = case.send(ctx)
    cpu = cpu_s(ctx.proxy_pid) - cpu0
    answer, probes = got if isinstance(got, tuple) else (got, "")
    if direct:
        settle(ctx)
    else:
        time.sleep(0.5)  # the engines' stats of the last step
    after = snapshot(ctx)
    row = Row(case.key, case.name, case.target, case.sent, answer,
              deltas_between(before, after, probes), rss_before_kb=rss_before,
              rss_after_kb=rss_kb(ctx.proxy_pid), rss_peak_kb=rss.peak, cpu_s=cpu,
              expect=case.expect)
    if engine_pid:
        row.engine_rss_mb = max(0.0, (engine_rss.peak - engine_before) / 1024)
    row.healthy, why = healthy(ctx)
    row.honest_ok, why2 = honest(ctx, seed)
    row.detail = "; ".join(w for w in (why, why2) if w)
    return row


def main(argv: Sequence[str] | None = None) -> int:
    """Run the hostile-input table; exit 0 iff nothing acted on a hostile field, nothing
    failed, no block leaked and the proxy's RSS grew by less than 20 MB in every case."""
    # the package's docstring describes the command (it is imported before this module)
    doc = sys.modules[__name__.rpartition(".")[0]].__doc__
    ap = argparse.ArgumentParser(prog="lw hostile", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=None,
                    help="model and server logs (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    ap.add_argument("--timeout", type=float, default=360.0, help="server start timeout, s")
    ap.add_argument("--budget", type=float, default=900.0,
                    help="the cases' time budget, s: cases not started by then are skipped")
    ap.add_argument("--only", default="", metavar="KEYS",
                    help="run only these cases (comma-separated keys, e.g. 1,8,12a)")
    args = ap.parse_args(list(argv) if argv is not None else None)
    from lw.vllm_adapter.local_cluster import in_workdir

    return in_workdir(args, "lw-hostile-", _run)


def _run(args: argparse.Namespace) -> int:
    from lw.vllm_adapter.demo_client import MODEL_NAME, blocks_in_use, wait_blocks_released
    from lw.vllm_adapter.local_cluster import LocalCluster
    from lw.vllm_adapter.tiny_model import make_tiny_model

    print("lw hostile: hostile inputs against a P/D cluster of real vLLM engines (tiny model, "
          "CPU)", flush=True)
    model = make_tiny_model(args.workdir / "tiny-llama")
    canary = Canary()
    canary.start()
    cluster = LocalCluster(model=model, workdir=args.workdir / "logs", reference=False)
    t0 = time.monotonic()
    try:
        cluster.start(timeout=args.timeout)
        procs = {n: cluster.servers[n].proc for n in ("proxy", "decode", "prefill")}
        pids = {n: p.pid if p is not None else 0 for n, p in procs.items()}
        ctx = Context(public=cluster.url("proxy"), control=cluster.control_url,
                      decode=cluster.url("decode"), prefill=cluster.url("prefill"),
                      canary=canary, proxy_pid=pids["proxy"], model=MODEL_NAME,
                      decode_kv_port=cluster.kv_ports["decode"], logs=args.workdir / "logs",
                      decode_pid=pids["decode"], prefill_pid=pids["prefill"])
        print(f"cluster    up in {time.monotonic() - t0:.0f} s: proxy {ctx.public} (control "
              f"{ctx.control}), D {ctx.decode}, P {ctx.prefill}, canary {canary.url}",
              flush=True)
        warm, why = honest(ctx, seed=0)  # the proxy's first request path is allocated
        if not warm:
            print(f"honest request before the cases failed: {why}", file=sys.stderr)
        settle(ctx)
        start = snapshot(ctx)
        rss_start = rss_kb(ctx.proxy_pid)
        only = {k.strip() for k in args.only.split(",") if k.strip()}
        cases = [c for c in build_cases(ctx) if not only or c.key in only]
        print()
        print(header())
        rows: list[Row] = []
        deadline = time.monotonic() + args.budget
        for i, case in enumerate(cases):
            if time.monotonic() > deadline:
                print(f"{case.key:>3} {case.name}: skipped (--budget {args.budget:.0f} s "
                      "spent)")
                continue
            row = run_case(ctx, case, seed=100 + i)
            rows.append(row)
            print(format_row(row), flush=True)
        print()
        for r in rows:
            if r.detail:
                print(f"detail     {r.key}: {r.detail}")
        settle(ctx)
        end = snapshot(ctx)
        p_pushes = sum(round(end["p"].get(k, 0) - start["p"].get(k, 0))
                       for k in ("lw_requests_done_total", "lw_requests_failed_total"))
        started = round(end["proxy"].get("prefills", 0) - start["proxy"].get("prefills", 0))
        late = max(0, p_pushes - started)
        print(f"run        P finished or failed {p_pushes} pushes; the proxy started {started} "
              f"prefills{' (P PUSHED FOR SOMETHING THE PROXY NEVER STARTED)' if late else ''}")
        print(f"run        canary: {canary.count()} connections, requests "
              f"{canary.requests[:5] or 'none'}")
        live = wait_live_zero(ctx.decode)
        leaked = wait_blocks_released([ctx.decode], timeout=30.0)
        print(f"blocks     D: {leaked} held after the run, lw_live_requests={live:.0f}; P: "
              f"{blocks_in_use(ctx.prefill)} held")
        print(f"proxy RSS  {rss_start / 1024:.1f} MB before the cases, "
              f"{rss_kb(ctx.proxy_pid) / 1024:.1f} MB after")
        summary = summarize(rows, leaked, late)
        print(summary_line(summary), flush=True)
        return exit_status(summary)
    finally:
        cluster.stop()
        canary.stop()
