"""Running ``lw hostile``: its arguments, starting the cluster, the sidecar and the canary,
sending each case and measuring what moved, and the lines that follow the table."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lw.lab.hostile.cases import Case, build_cases
from lw.lab.hostile.probes import (
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
from lw.lab.hostile.table import (
    FRAMED,
    Row,
    deltas_between,
    exit_status,
    format_row,
    header,
    summarize,
    summary_line,
    unmet,
)


def sidecar_argv(decode: str, prefill: str, port: int, control: int) -> list[str]:
    """``lw proxy --sidecar`` in front of ``decode`` on loopback ``port`` (control plane on
    ``control``), its allowlist only ``prefill``'s ``host:port`` (the end-to-end test's)."""
    return [sys.executable, "-m", "lw.proxy.server", "--sidecar", "--decode", decode,
            "--allow-prefiller", prefill.split("://", 1)[-1], "--host", "127.0.0.1",
            "--port", str(port), "--control-host", "127.0.0.1", "--control-port", str(control),
            "--timeout", "120", "--log-level", "warning"]


def start_sidecar(cluster: Any, logs: Path, timeout: float = 60.0) -> tuple[Any, str]:
    """Start the sidecar in front of the cluster's D (its cluster key in LW_CLUSTER_KEY) and
    wait until it answers; the Server and its control URL."""
    from lw.lab.local_cluster import Server, free_port, wait_ready

    port = free_port()
    control = next(p for p in iter(free_port, None) if p != port)
    env = dict(os.environ, PYTHONUNBUFFERED="1", LW_CLUSTER_KEY=cluster.cluster_key)
    side = Server("sidecar", sidecar_argv(cluster.url("decode"), cluster.url("prefill"), port,
                                          control),
                  env, f"http://127.0.0.1:{port}", logs / "sidecar.log")
    side.start()
    try:
        wait_ready([side], timeout)
    except BaseException:
        side.stop()
        raise
    return side, f"http://127.0.0.1:{control}"


def run_case(ctx: Context, case: Case, seed: int) -> Row:
    """Send one case and measure what moved; then check health and an honest request. A case
    sent straight to an engine or to the sidecar is framed by plain requests on both engines
    (the counters of earlier work reported before it, its own after it). The RSS and CPU are
    the sidecar's for a case sent to it, the proxy's otherwise."""
    framed = case.target in FRAMED
    if framed:
        settle(ctx)
    before = snapshot(ctx)
    side = case.target == "sidecar"
    pid = ctx.sidecar_pid if side else ctx.proxy_pid
    cpu0 = cpu_s(pid)
    engine_pid = {"decode": ctx.decode_pid, "prefill": ctx.prefill_pid}.get(case.target, 0)
    with RssSampler(pid) as rss, RssSampler(engine_pid) as engine_rss:
        rss_before, engine_before = rss.peak, engine_rss.peak
        got = case.send(ctx)
    cpu = cpu_s(pid) - cpu0
    answer, probes = got if isinstance(got, tuple) else (got, "")
    if framed:
        settle(ctx)
    else:
        time.sleep(0.5)  # the engines' stats of the last step
    after = snapshot(ctx)
    row = Row(case.key, case.name, case.target, case.sent, answer,
              deltas_between(before, after, probes, "sidecar" if side else "proxy"),
              rss_before_kb=rss_before, rss_after_kb=rss_kb(pid), rss_peak_kb=rss.peak,
              cpu_s=cpu, expect=case.expect, expect_param=case.param, expect_moved=case.moved)
    if engine_pid:
        row.engine_rss_mb = max(0.0, (engine_rss.peak - engine_before) / 1024)
    row.healthy, why = healthy(ctx)
    row.honest_ok, why2 = honest(ctx, seed)
    row.detail = "; ".join(w for w in (why, why2) if w)
    return row


def main(argv: Sequence[str] | None = None) -> int:
    """Run the hostile-input table; exit 0 iff nothing acted on a hostile field, nothing
    failed, no block leaked and the proxy's RSS (the sidecar's, in its cases) grew by less than
    20 MB in every case."""
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
    from lw.lab.local_cluster import in_workdir

    return in_workdir(args, "lw-hostile-", _run)


def _run(args: argparse.Namespace) -> int:
    from lw.lab.demo_client import MODEL_NAME, blocks_in_use, wait_blocks_released
    from lw.lab.local_cluster import LocalCluster
    from lw.lab.tiny_model import make_tiny_model

    print("lw hostile: hostile inputs against a P/D cluster of real vLLM engines (tiny model, "
          "CPU)", flush=True)
    model = make_tiny_model(args.workdir / "tiny-llama")
    canary = Canary()
    canary.start()
    cluster = LocalCluster(model=model, workdir=args.workdir / "logs", reference=False)
    sidecar = None
    t0 = time.monotonic()
    try:
        cluster.start(timeout=args.timeout)
        sidecar, sidecar_control = start_sidecar(cluster, args.workdir / "logs")
        procs = {n: cluster.servers[n].proc for n in ("proxy", "decode", "prefill")}
        procs["sidecar"] = sidecar.proc
        pids = {n: p.pid if p is not None else 0 for n, p in procs.items()}
        ctx = Context(public=cluster.url("proxy"), control=cluster.control_url,
                      decode=cluster.url("decode"), prefill=cluster.url("prefill"),
                      canary=canary, proxy_pid=pids["proxy"], model=MODEL_NAME,
                      decode_kv_port=cluster.kv_ports["decode"], logs=args.workdir / "logs",
                      decode_pid=pids["decode"], prefill_pid=pids["prefill"],
                      sidecar=sidecar.url, sidecar_control=sidecar_control,
                      sidecar_pid=pids["sidecar"])
        print(f"cluster    up in {time.monotonic() - t0:.0f} s: proxy {ctx.public} (control "
              f"{ctx.control}), D {ctx.decode}, P {ctx.prefill}, canary {canary.url}",
              flush=True)
        print(f"sidecar    {ctx.sidecar} (control {ctx.sidecar_control}) in front of D, "
              f"allowing only P", flush=True)
        # the proxy's and the sidecar's first request paths are allocated
        for seed, (url, who) in enumerate(((ctx.public, "proxy"), (ctx.sidecar, "sidecar"))):
            warm, why = honest(ctx, seed=seed, url=url)
            if not warm:
                print(f"honest request through the {who} before the cases failed: {why}",
                      file=sys.stderr)
        settle(ctx)
        start = snapshot(ctx)
        rss_start, side_start = rss_kb(ctx.proxy_pid), rss_kb(ctx.sidecar_pid)
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
            for miss in unmet(r):
                print(f"unmet      {r.key}: {miss}")
        settle(ctx)
        end = snapshot(ctx)
        p_pushes = sum(round(end["p"].get(k, 0) - start["p"].get(k, 0))
                       for k in ("lw_requests_done_total", "lw_requests_failed_total"))
        by = {w: round(end[w].get("prefills", 0) - start[w].get("prefills", 0))
              for w in ("proxy", "sidecar")}
        late = max(0, p_pushes - by["proxy"] - by["sidecar"])
        print(f"run        P finished or failed {p_pushes} pushes; the proxy started "
              f"{by['proxy']} prefills, the sidecar {by['sidecar']}"
              f"{' (P PUSHED FOR SOMETHING NEITHER STARTED)' if late else ''}")
        print(f"run        canary: {canary.count()} connections, requests "
              f"{canary.requests[:5] or 'none'}")
        live = wait_live_zero(ctx.decode)
        leaked = wait_blocks_released([ctx.decode], timeout=30.0)
        print(f"blocks     D: {leaked} held after the run, lw_live_requests={live:.0f}; P: "
              f"{blocks_in_use(ctx.prefill)} held")
        print(f"proxy RSS  {rss_start / 1024:.1f} MB before the cases, "
              f"{rss_kb(ctx.proxy_pid) / 1024:.1f} MB after")
        print(f"sidecar RSS {side_start / 1024:.1f} MB before the cases, "
              f"{rss_kb(ctx.sidecar_pid) / 1024:.1f} MB after")
        summary = summarize(rows, leaked, late)
        print(summary_line(summary), flush=True)
        return exit_status(summary)
    finally:
        if sidecar is not None:
            sidecar.stop()
        cluster.stop()
        canary.stop()
