"""``lw demo``: run a local P/D cluster, print what happened, end with one ``summary`` line.

``--engine vllm`` (the default) runs real vLLM engines (:mod:`lw.lab.vllm_demo`);
``--engine synthetic`` runs :mod:`lw.lab.synthetic`: P DP-rank processes in lock step over numpy KV
caches, a decoder that verifies every byte, real ZMQ side channels and real Mooncake transfers;
``--prefill-tp`` / ``--decode-tp`` / ``--mla`` give both sides tensor-parallel workers that move
head slices; ``--decoders`` runs several D engines behind a router that moves a dead one's
requests to a live one before their first token.
Exit status 0 iff every request is accounted for, no block leaked and nothing was corrupt.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import TextIO

from lw.lab.synthetic import netem, netns
from lw.lab.synthetic.cluster import run_cluster
from lw.lab.synthetic.config import (
    DATA_PLANES,
    FAULTS,
    FENCED_PLANES,
    LINK_DEADLINES,
    LINK_FAULTS,
    ONE_DECODER_FAULTS,
    PARTITION_FAULTS,
    PROCESS_FAULTS,
    ClusterConfig,
    canonical_fault,
)
from lw.lab.synthetic.result import ClusterResult


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lw demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("synthetic", "vllm"), default="vllm")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--prefill-dp", type=int, default=2, help="P data-parallel ranks")
    p.add_argument("--prefill-tp", type=int, default=1,
                   help="P tensor-parallel workers per DP rank (each holds its KV heads)")
    p.add_argument("--decode-tp", type=int, default=1,
                   help="decoder tensor-parallel workers (one shared block pool)")
    p.add_argument("--retry-prefill", type=int, default=0,
                   help="synthetic: how often D has a request prefilled again on another P "
                        "rank when its rank is lost (retry_prefill; 0: it fails)")
    p.add_argument("--fenced-retry", action="store_true",
                   help="synthetic: a retry whose lost P may still write waits for it in the "
                        "same blocks (FENCING) instead of receiving into fresh blocks "
                        "(retry_fresh_blocks off)")
    p.add_argument("--decoders", type=int, default=1,
                   help="synthetic: D engines, each with --decode-tp workers and its own pool; "
                        "requests go to the least loaded")
    p.add_argument("--decode-tokens", type=int, default=-1,
                   help="synthetic: tokens D streams per request after verifying its KV "
                        "(default: 8 with several decoders, else 0)")
    p.add_argument("--token-ms", type=float, default=5.0,
                   help="synthetic: time between two streamed tokens")
    p.add_argument("--kv-heads", type=int, default=0,
                   help="KV heads of the model (default: the larger TP size)")
    p.add_argument("--mla", action="store_true",
                   help="latent KV (MLA): replicated on every TP rank, one writer per D rank")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--blocks-per-request", type=int, default=4)
    p.add_argument("--chunks", type=int, default=1,
                   help="synthetic: P computes each prompt in this many steps (chunked prefill)")
    p.add_argument("--push-mode", choices=("progressive", "last_chunk"), default="progressive",
                   help="synthetic: write each chunk's blocks as it computes (progressive) or "
                        "every block during the last chunk")
    p.add_argument("--block-kib", type=int, default=64,
                   help="bytes per block per layer (all KV heads), KiB")
    p.add_argument("--decoder-blocks", type=int, default=64, help="the decoder's block pool")
    p.add_argument("--layer-ms", type=float, default=2.0, help="simulated compute per layer")
    p.add_argument("--fault", default="none",
                   help="one of: " + ", ".join(FAULTS) + "; several, comma-separated, for "
                        "those rows of the fault table in that order; or 'all' for the table")
    p.add_argument("--fault-table", action="store_true", help="same as --fault all")
    p.add_argument("--data-plane", choices=DATA_PLANES, default="mooncake",
                   help="mooncake or nixl (engines as processes; NIXL over UCX, TCP unless "
                        "UCX_TLS is set, lease-only: D's fence off), or inprocess (threads)")
    p.add_argument("--cluster-key", default=None,
                   help="shared side-channel key (text or hex:...); default: a random one")
    p.add_argument("--no-auth", action="store_true", help="run the side channels without a key")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="worker logs (default: a temp directory)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--abort-rate", type=float, default=0.0,
                   help="probability that the client aborts a request during its transfer")
    p.add_argument("--kv-checksum", action="store_true",
                   help="P sends per-block CRC-32C with DONE; D verifies before finishing")
    p.add_argument("--status", action="store_true",
                   help="print an lw status table of every worker while the fault is active")
    p.add_argument("--trace-out", default=None, metavar="FILE",
                   help="write every request's timeline on P and D as Chrome trace JSON")
    p.add_argument("--validate", action="store_true",
                   help="validate each run's trace against the checked model (lw validate)")
    p.add_argument("--timelines-out", default=None, metavar="DIR",
                   help="keep each run's lw-trace file here (default with --validate: a temp "
                        "directory, removed)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lw demo``."""
    args_list = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--engine", default="vllm")
    known, _ = pre.parse_known_args(args_list)
    if known.engine == "vllm":
        from lw.lab import vllm_demo  # written by the adapter's owner

        return int(vllm_demo.main(_without_engine(args_list)) or 0)
    ap = _parser()
    args = ap.parse_args(args_list)
    if args.trace_out:  # written after the whole run: a bad folder must not waste it
        folder = os.path.dirname(os.path.abspath(args.trace_out))
        if not os.path.isdir(folder):
            ap.error(f"--trace-out {args.trace_out}: no such directory {folder}")
    # each row: a fault, how many decoders it runs with, and D's prefill retry budget
    rows: list[tuple[str, int, int]]
    if args.fault_table or args.fault == "all":
        faults = list(FAULTS)
        if args.decoders > 1:
            print("lw demo: skipping the rows aimed at a single decoder (freeze, partition, "
                  "link)", file=sys.stderr)
            faults = [f for f in faults if f not in ONE_DECODER_FAULTS]
        if args.data_plane == "inprocess":
            faults = [f for f in faults if f not in PROCESS_FAULTS]
        why = netns.unavailable() if any(f in PARTITION_FAULTS for f in faults) else ""
        if why:
            print(f"lw demo: skipping the partition rows: {why}", file=sys.stderr)
            faults = [f for f in faults if f not in PARTITION_FAULTS]
        why = netem.unavailable() if any(f in LINK_FAULTS for f in faults) else ""
        if why:
            print(f"lw demo: skipping the lossy and slow link rows: {why}", file=sys.stderr)
            faults = [f for f in faults if f not in LINK_FAULTS]
        rows = [(f, args.decoders, args.retry_prefill) for f in faults]
        if args.decoders == 1 and "kill-decoder" in faults:
            # the failover row next to the restart row: two decoders, one killed
            i = rows.index(("kill-decoder", 1, args.retry_prefill))
            rows.insert(i + 1, ("kill-decoder", 2, args.retry_prefill))
        if (not args.retry_prefill and args.decode_tp == 1 and args.prefill_dp > 1
                and "kill-prefill-rank" in faults):
            # the prefill failover row next to the old one: the dead rank's requests again
            i = rows.index(("kill-prefill-rank", args.decoders, 0))
            rows.insert(i + 1, ("kill-prefill-rank", args.decoders, 2))
        if (not args.retry_prefill and args.decode_tp == 1 and args.prefill_dp > 1
                and "corrupt-write" in faults):
            # ... and the bad transfers prefilled again (the fault hits first attempts only)
            i = rows.index(("corrupt-write", args.decoders, 0))
            rows.insert(i + 1, ("corrupt-write", args.decoders, 1))
    else:
        try:  # several faults, comma-separated: those rows of the table, in that order
            rows = [(canonical_fault(f.strip()), args.decoders, args.retry_prefill)
                    for f in args.fault.split(",")]
        except ValueError as exc:
            print(f"lw demo: {exc}", file=sys.stderr)
            return 2
    faults = [f for f, _n, _r in rows]
    if args.data_plane == "mooncake":
        try:
            import mooncake.engine  # noqa: F401
        except ImportError as exc:
            print(f"lw demo: the Mooncake data plane is unavailable ({exc}); install "
                  "mooncake-transfer-engine-non-cuda and libibverbs1, or use "
                  "--data-plane inprocess", file=sys.stderr)
            return 2
    if args.data_plane == "nixl":
        from lw.transport.dataplane.nixl import nixl_missing

        why = nixl_missing()
        if why:
            print(f"lw demo: the NIXL data plane is unavailable: {why}; or use "
                  "--data-plane mooncake or inprocess", file=sys.stderr)
            return 2
    key: bytes | str | None = None
    if not args.no_auth:
        key = args.cluster_key if args.cluster_key else os.urandom(32)
    results = []
    traces = _Traces(args.timelines_out) if args.validate or args.timelines_out else None
    for fault, decoders, retry in rows:
        try:
            cfg = ClusterConfig(
                requests=args.requests,
                prefill_dp=args.prefill_dp,
                prefill_tp=args.prefill_tp,
                decode_tp=args.decode_tp,
                decoders=decoders,
                retry_prefill=retry,
                retry_fresh_blocks=not args.fenced_retry,
                decode_tokens=args.decode_tokens,
                token_ms=args.token_ms,
                kv_heads=args.kv_heads,
                mla=args.mla,
                layers=args.layers,
                blocks_per_request=args.blocks_per_request,
                chunks=args.chunks,
                push_mode=args.push_mode,
                block_bytes=args.block_kib * 1024,
                d_blocks=args.decoder_blocks,
                p_blocks=max(64, args.decoder_blocks),
                layer_ms=args.layer_ms,
                data_plane=args.data_plane,
                fault=fault,
                cluster_key=key,
                seed=args.seed,
                log_dir=args.log_dir,
                # the fault table runs the faults that land wrong bytes the way they are meant
                # to be caught: by the checksums
                kv_checksum=args.kv_checksum or (fault in ("corrupt-write", "mix")
                                                 and len(faults) > 1),
                status=args.status,
                abort_rate=args.abort_rate,
                run_timeout_s=max(180.0, 0.3 * args.requests),  # soak runs are long
                trace_out=args.trace_out,
                timelines_out=traces.path(fault, decoders, retry) if traces else None,
                **(LINK_DEADLINES if fault in LINK_FAULTS else {}),  # type: ignore[arg-type]
            )
        except ValueError as exc:
            print(f"lw demo: {exc}", file=sys.stderr)
            return 2
        results.append(_run_one(cfg, quiet=args.quiet or len(rows) > 1))
        if len(rows) > 1:
            print(_row(results[-1]) if len(results) > 1 else _table_header(cfg) + "\n"
                  + _row(results[-1]), flush=True)
        if args.validate and traces is not None and cfg.timelines_out:
            print(traces.validate(cfg.timelines_out, fault, decoders, retry), flush=True)
    if len(rows) == 1:
        _print_report(results[0], sys.stdout)
        summary = results[0].summary_line()
    else:
        summary = (f"summary done={sum(r.done for r in results)} "
                   f"failed={sum(r.failed for r in results)} "
                   f"leaked_blocks={sum(r.leaked for r in results)} "
                   f"corrupt={sum(r.corrupt for r in results)}")
    print(summary, flush=True)
    if args.validate and traces is not None:
        print(traces.summary(), flush=True)
        traces.close()
        if traces.rejected:
            return 1
    return 0 if all(r.ok for r in results) else 1


class _Traces:
    """Where each row's lw-trace file goes, and the verdicts of ``lw validate`` on them."""

    def __init__(self, keep_dir: str | None) -> None:
        self.own = keep_dir is None
        self.dir = keep_dir or tempfile.mkdtemp(prefix="lw-traces-")
        os.makedirs(self.dir, exist_ok=True)
        self.validated = self.rejected = self.undecided = 0

    def path(self, fault: str, decoders: int, retry: int) -> str:
        """The trace file of one row."""
        return os.path.join(self.dir, f"{fault}-d{decoders}-r{retry}.jsonl")

    def validate(self, path: str, fault: str, decoders: int, retry: int) -> str:
        """Validate one row's trace; its report line."""
        from lw.sim.validate_cli import one_line, run  # the checker's world: only when asked

        name = (f"{fault}" + (f" x{decoders} decoders" if decoders > 1 else "")
                + (f" retry-prefill {retry}" if retry else ""))
        if not os.path.exists(path):
            self.rejected += 1
            return f"  trace {name}: REJECTED: no trace was written (no worker answered)"
        try:
            verdicts = run(path, max_states=200_000, seconds=60.0)
        except ValueError as exc:
            self.rejected += 1
            return f"  trace {name}: REJECTED: {exc}"
        line = one_line(verdicts)
        if line.startswith("valid"):
            self.validated += 1
        elif line.startswith("REJECTED"):
            self.rejected += 1
        else:
            self.undecided += 1
        return f"  trace {name}: {line}"

    def summary(self) -> str:
        """The final count line."""
        return (f"traces validated={self.validated} rejected={self.rejected} "
                f"undecided={self.undecided}")

    def close(self) -> None:
        """Remove the temp directory (kept when the user named one)."""
        if self.own:
            shutil.rmtree(self.dir, ignore_errors=True)


def _without_engine(argv: list[str]) -> list[str]:
    """``argv`` minus ``--engine X`` / ``--engine=X`` (the vLLM demo has its own options)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--engine":
            skip = True
        elif not a.startswith("--engine="):
            out.append(a)
    return out


def _run_one(cfg: ClusterConfig, quiet: bool) -> ClusterResult:
    bar = None if quiet or not sys.stderr.isatty() else _Progress(cfg.requests, sys.stderr)
    try:
        return run_cluster(cfg, progress=bar.update if bar else None,
                           on_status=lambda text: print(text, flush=True))
    finally:
        if bar is not None:
            bar.close()


class _Progress:
    """A one-line progress bar on a terminal."""

    def __init__(self, total: int, out: TextIO) -> None:
        self.total = total
        self.out = out

    def update(self, res: ClusterResult) -> None:
        n = res.accounted
        width = 30
        fill = int(width * n / self.total)
        self.out.write(f"\r  [{'#' * fill}{'.' * (width - fill)}] {n}/{self.total} "
                       f"done={res.done} failed={res.failed}")
        self.out.flush()

    def close(self) -> None:
        self.out.write("\r" + " " * 72 + "\r")
        self.out.flush()


def _ms(x: float) -> str:
    return f"{x * 1000:.1f} ms"


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))]


def _print_report(res: ClusterResult, out: TextIO) -> None:
    cfg = res.config
    mib = cfg.layers * cfg.blocks_per_request * cfg.block_bytes / 2**20
    lines = [
        f"lw demo: synthetic engine, {_plane(cfg.data_plane)}, fault: {cfg.fault}",
        f"  {cfg.requests} requests, {cfg.prefill_dp} P DP ranks in lock step, {cfg.layers} "
        f"layers, {cfg.blocks_per_request} blocks x {cfg.block_bytes // 1024} KiB per layer "
        f"({mib:.1f} MiB per request), decoder pool {cfg.d_blocks} blocks",
        f"  tensor parallel: P TP {cfg.prefill_tp} x D TP {cfg.decode_tp}, "
        + ("MLA latent KV (replicated)" if cfg.mla else f"{cfg.kv_heads} KV heads")
        + ", HND blocks",
        f"  prefill in {len(cfg.chunk_bounds())} chunk(s) per prompt, push mode {cfg.push_mode}",
        *([f"  {cfg.decoders} decoders (least loaded first), {cfg.decode_tokens} tokens per "
           f"request every {cfg.token_ms:g} ms after its KV is verified"]
          if cfg.decoders > 1 or cfg.decode_tokens else []),
        "",
        f"  {'requests done / failed / corrupt':<40} {res.done} / {res.failed} / {res.corrupt}",
        f"  {'bytes moved':<40} {res.bytes_moved / 2**20:.1f} MiB",
        f"  {'throughput':<40} {res.gbps:.3f} GB/s over {res.elapsed_s:.2f} s",
        f"  {'latency p50 / p99 (D alloc -> verified)':<40} "
        f"{_ms(_pct(res.latencies_s, 0.5))} / {_ms(_pct(res.latencies_s, 0.99))}",
        f"  {'transfer tail after last layer p50/p99':<40} "
        f"{_ms(_pct(res.tails_s, 0.5))} / {_ms(_pct(res.tails_s, 0.99))}",
        f"  {'P step: longest / p50 with requests':<40} {_ms(res.max_step_s)} / "
        f"{_ms(_pct(res.busy_steps_s, 0.5))} ({res.steps} steps, ideal "
        f"{cfg.layers * cfg.layer_ms:.1f} ms)",
        f"  {'forward-hook call p50 / p99 / max':<40} "
        f"{_pct(res.hooks_s, 0.5) * 1e6:.0f} / {_pct(res.hooks_s, 0.99) * 1e6:.0f} / "
        f"{res.max_hook_s * 1e6:.0f} us",
        f"  {'blocks held at end: P / D':<40} {res.leaked_p} / {res.leaked_d}",
    ]
    if cfg.trace_out:
        lines.append(f"  {'request timelines (Chrome trace)':<40} {cfg.trace_out}: "
                     f"{res.counters.get('trace_spans', 0)} state spans from "
                     f"{res.counters.get('trace_workers', 0)} workers")
    if res.detect_s:
        lines.append(f"  {'fault -> first request failed':<40} {_ms(res.detect_s)}")
    if res.aborts:
        lines.append(f"  {'client aborts sent':<40} {res.aborts}")
    if cfg.decode_tokens:
        lines.append(f"  {'tokens streamed to the client':<40} {res.tokens}")
    if res.failovers or res.failed_after_first_token:
        lines.append(f"  {'moved to another decoder (no token yet)':<40} {res.failovers}")
        lines.append(f"  {'failed after their first token':<40} "
                     f"{res.failed_after_first_token}")
    if res.client_gone:
        lines.append(f"  {'failed after the client went away':<40} {res.client_gone}")
    if res.reprefills:
        lines += _failover_lines(res)
    if res.rss_kib:
        lines.append(f"  {'RSS start / warm (10 %) / end, MiB':<40} " + ", ".join(
            f"{w} {a / 1024:.0f} / {b / 1024:.0f} / {c / 1024:.0f}"
            for w, (a, b, c) in sorted(res.rss_kib.items())))
    if res.decoder_generations > 1:
        lines.append(f"  {'decoder incarnations':<40} {res.decoder_generations}")
    if res.dead_ranks:
        lines.append(f"  {'P ranks lost':<40} {res.dead_ranks}")
    if res.reasons:
        lines.append("  failure reasons:")
        lines += [f"    {n:>4} x {why}" for why, n in res.reasons.most_common(8)]
    if res.corrupt_details:
        lines.append("  corrupt blocks (what the first wrong block of each holds):")
        lines += [f"    {d}" for d in res.corrupt_details]
    if res.counters:
        lines.append("  counters: " + ", ".join(f"{k}={v}" for k, v in
                                               sorted(res.counters.items())))
    if res.errors:
        lines.append("  ERRORS:")
        lines += [f"    {e}" for e in res.errors]
    if not res.ok:
        lines.append(f"  NOT OK (worker logs in {res.log_dir})")
    print("\n".join(lines), file=out)


def _plane(name: str) -> str:
    """The data plane as the report names it: a lease-only plane says D's fence is off."""
    if name in FENCED_PLANES or name == "inprocess":
        return f"{name} data plane"
    return f"{name} data plane (lease-only: D's fence off)"


def _table_header(cfg: ClusterConfig) -> str:
    """The fault table's title (engine and data plane) and column names."""
    return (f"lw demo: fault table, synthetic engine, {_plane(cfg.data_plane)}\n"
            f"{'fault':<35} {'done/failed':>11} {'corrupt':>7} {'longest P step':>15} "
            f"{'leaked':>6}  {'detect':>7}  {'time':>6}  notes")


def _row(res: ClusterResult) -> str:
    cfg = res.config
    notes = []
    c = res.counters
    for key, label in (("d.side.unauthenticated", "unauthenticated dropped"),
                       ("p.side.wire_errors", "garbage dropped (P)"),
                       ("d.side.wire_errors", "garbage dropped (D)"),
                       ("p.core.stale_messages", "stale (P)"),
                       ("d.core.leases_expired", "leases expired"),
                       ("d.core.fences", "data-plane fences"),
                       ("d.core.fence_failures", "fences that did not hold"),
                       ("link.dropped", "packets dropped by the link")):
        if c.get(key):
            notes.append(f"{c[key]} {label}")
    if cfg.fault in LINK_FAULTS:
        notes.append(_carried(res))
    if res.decoder_generations > 1:
        notes.append(f"decoder restarted ({res.decoder_generations} incarnations)")
    if res.failovers or res.failed_after_first_token:
        notes.append(f"{res.failovers} moved to a live decoder before their first token, "
                     f"{res.failed_after_first_token} failed after it")
    if res.errors:
        notes.append("ERRORS: " + "; ".join(res.errors))
    ok = "ok" if res.ok else "NOT OK"
    detect = f"{res.detect_s:6.2f}s" if res.detect_s else f"{'-':>7}"
    name = cfg.fault + (f", {cfg.decoders} decoders" if cfg.decoders > 1 else "")
    name += f", retry-prefill {cfg.retry_prefill}" if cfg.retry_prefill else ""
    if res.reprefills:
        fresh = c.get("d.core.fresh_blocks", 0)
        notes.append(f"{res.reprefills} prefilled again on a live P rank "
                     f"({res.reprefills_fenced} fenced first, {fresh} into fresh blocks), the "
                     "slowest done "
                     f"{max(res.failover_s, res.failover_fenced_s):.1f}s after the fault")
    return (f"{name:<35} {f'{res.done}/{res.failed}':>11} {res.corrupt:>7} "
            f"{_ms(res.max_step_s):>15} {res.leaked:>6}  {detect}  {res.elapsed_s:5.1f}s  {ok}; "
            + ", ".join(notes))


def _carried(res: ClusterResult) -> str:
    """What a link row's data plane carried: KV in writes that completed, its rate over the
    row, and the bytes that crossed the link (both ways, side channels and retransmissions
    included)."""
    mib = res.bytes_moved / 2**20
    rate = mib / res.elapsed_s if res.elapsed_s > 0 else 0.0
    return (f"{res.config.data_plane} carried {mib:.1f} MiB of KV ({rate:.2f} MiB/s), the link "
            f"{res.counters.get('link.mib', 0)} MiB")


def _failover_lines(res: ClusterResult) -> list[str]:
    """Prefill failover: how many requests D had prefilled again, and how long the slowest
    took from the fault to its outcome, against the heartbeat budget plus one prefill (those
    whose dead rank had written wait for the lease first)."""
    cfg = res.config
    hb = cfg.heartbeat_s * (cfg.heartbeat_misses + 1)  # quiet that long, seen at the next round
    lat = sorted(res.latencies_s)
    one = lat[len(lat) // 2] if lat else 0.0
    fresh = res.counters.get("d.core.fresh_blocks", 0)
    lines = [f"  {'prefilled again on a live P rank':<40} {res.reprefills} ("
             f"{res.reprefills - res.reprefills_fenced} at once, {fresh} of them into fresh "
             f"blocks: the lost attempt had written; {res.reprefills_fenced} fenced first)"]
    if res.reprefills > res.reprefills_fenced:
        lines.append(f"  {'slowest at once, fault -> outcome':<40} {res.failover_s:.2f}s "
                     f"(heartbeat budget {hb:.2f}s + one prefill, the median request "
                     f"{one:.2f}s: {hb + one:.2f}s)")
    if res.reprefills_fenced:
        lease = cfg.decode_config().lease_s
        lines.append(f"  {'slowest fenced, fault -> outcome':<40} "
                     f"{res.failover_fenced_s:.2f}s (+ the lease, {lease:g}s: "
                     f"{hb + one + lease:.2f}s)")
    return lines
