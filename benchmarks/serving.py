"""Serving benchmark: one vLLM server vs lw P/D vs vLLM's MooncakeConnector P/D, side by side.

For each tiny model (today's 2-layer Llama and a deep one) and each shape (input tokens,
concurrency), it starts, in turn and fresh, on this machine: a single ``vllm serve`` (core 0),
lw P/D (``LocalCluster`` from ``lw demo``: P and D pinned to one core each, lw's proxy) with
``push_mode`` ``auto`` (``lw``, the default), ``progressive`` (``lw-progressive``) and
``last_chunk`` (``lw-last``), and vLLM's in-tree MooncakeConnector P/D (same engines and cores,
Mooncake over TCP, the minimal proxy in ``benchmarks/_peer``); every process of an engine is
bound to its core (``--float-frontends``: only the workers, vLLM's default; ``--p-threads
other-core``: then every thread of P's worker but the forward's on D's core, lw's and the peer's
alike). Against each it runs ``vllm bench serve`` on the same prompts of fresh random words (a
ShareGPT-format file: vLLM's ``random`` dataset makes token-id runs; ``--num-warmups 0``: a
warm-up re-sends the first measured prompt, which then hits the prefix cache), 32 output tokens,
and prints one table per model and shape (TTFT, time to token 2 = TTFT + the first inter-token
latency, end-to-end latency, from ``--save-detailed``'s per-request lists) plus
``ttft_p50_ratio_vs_peer`` and ``throughput_ratio_vs_peer`` (lw / MooncakeConnector).

vLLM's NIXL connectors (issue 60) are peers too, on the same engines, cores, model, link and
client: ``peer-nixl`` is ``NixlConnector`` (D pulls; P first with ``max_tokens`` 1, then P's
``kv_transfer_params`` to D, as vLLM's toy proxy does) and ``peer-nixl-push`` is
``NixlPushConnector`` (P writes into blocks D allocated; D and P together, P's engine id, host,
port and TP size preset in D's params), both through ``benchmarks/_peer/nixl_proxy.py`` with KV
in host memory (``kv_buffer_device`` cpu) and UCX over TCP only on the link's interface
(``UCX_TLS=tcp``, ``UCX_NET_DEVICES``: P the root side's veth, D the namespace side's, ``lo``
without a link), so that UCX cannot skip the capped veth through shared memory; ratio lines
``..._vs_peer_nixl`` and ``..._vs_peer_nixl_push``. Every peer answers one greedy request like
the single server (``lw.lab.oracle``) before it is timed, or is reported as an output mismatch
and not timed; each set-up prints how many of its engines' threads are off the core they were
pinned to, after start and after its runs (vLLM's NIXL worker moves a thread to the last core
itself: ``rsv_cores_for_kv``).

Where a user looks (issue 59): ``lw-off`` is ``lw`` with ``first_token_from_p`` false (D samples
the first token itself after the KV landed); ``single-proxy`` is the single server behind ``lw
proxy --sidecar`` with no prefill server, whose TTFT minus the single server's is the proxy's hop;
``single-stream`` is the single server while a plain TCP stream crosses the row's link from its
core at the rate a push overlapping the prefill must move the prompt's KV
(``benchmarks/_stream.py``): the physical floor of any such push on this machine, and
``ttft_p50_ratio_vs_stream_floor`` is lw's distance to it. A second table per shape gives each
set-up's TTFT and time to token 2 over the single server's (same repeat), P's prefill time beside
the single server's and, from the ``first_token`` events of lw's timelines, "P sampled -> D
received" (p50 / max; n/a where the workers record no such event) and the share of requests whose
first token reached the client (the proxy's relay of it) before D's last DONE
(``token1_before_last_done_<setup>``, with issue 59's >= 90 % verdict at kv_over_prefill 1.0);
``token2_minus_off_ttft_ms_<setup>`` is each set-up's time to token 2 minus ``lw-off``'s TTFT of
the same repeat, against issue 59's +5 ms.

``lw-nixl`` (issue 60) is ``lw`` with ``data_plane`` ``nixl``: lw's connector moving the KV with
NIXL, under the NIXL peers' UCX settings; ``..._nixl_vs_mooncake`` is its ratio to ``lw``.

``--link`` puts every P/D set-up's D in its own network namespace behind a veth pair
(``benchmarks/_link.py``) whose P -> D direction is capped with tbf; P, the proxies and the
client stay in the root namespace, and each set-up crosses a link made the same way. Values:
``none`` (loopback, the default), ``uncapped`` (veth, no tbf), factors of ``kv_over_prefill`` =
(KV bytes of one prompt / link goodput) / (the single server's prefill time of that prompt), and
``auto`` = ``uncapped,0.5,1.0,2.0``. The prefill time is the single server's TTFT p50 with
``max_tokens`` 1 over a few prompts of the shape's length, measured again before every repeat
(``--no-recalibrate``: once); the goodput wanted is ``KV bytes x 8 / (factor x prefill time)``
bit/s, and the tbf rate is scaled (the first time a row is set in a repeat) until a TCP transfer
through the shaped veth achieves it within 1 %; every setting reports the goodput and the
``kv_over_prefill`` achieved against its repeat's prefill time. With ``--link`` each set-up is
started once per repeat (``--repeats``, order rotated per repeat) and runs every link row and
shape on fresh prompts, each run after two unmeasured prompts of its own (``--row-warmups``:
every set-up meets a row's link in its steady state, as lw's auto push must learn a link that
the benchmark changes every few seconds); the ratios are medians of the per-repeat ratios, with
their min-max spread. Needs root and iproute2.

``.venv/bin/python benchmarks/serving.py [--quick] [--link auto]`` from the repository root.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._client import after_lw_run, prefill_time, run_bench  # noqa: E402
from benchmarks._first_token import add_token2  # noqa: E402
from benchmarks._link import Link, missing_requirements  # noqa: E402
from benchmarks._pin import CORES, P_THREADS, off_core, pin  # noqa: E402
from benchmarks._plan import (  # noqa: E402
    BOTH_EXTRA,
    GOODPUT_TOLERANCE,
    LABELS,
    NO_LINK,
    OUTPUT_TOKENS,
    P_EXTRA,
    PEERS,
    PROXY_ARGS,
    PUSH_MODES,
    SETUPS,
    Bench,
    LinkInfo,
    LinkRow,
    Shape,
    kv_bytes,
    make_prompts,
    parse_link,
    shapes,
)
from benchmarks._report import print_table  # noqa: E402
from benchmarks._stream import ByteStream  # noqa: E402
from lw.lab.oracle import DRIFT, TOP_K, compare  # noqa: E402
from lw.lab.vllm_demo import (  # noqa: E402
    LocalCluster,
    Server,
    complete,
    free_port,
    make_prompt,
    wait_ready,
)

PEER_DIR = Path(__file__).resolve().parent / "_peer"


def lw_config_keys() -> set[str]:
    """The ``kv_connector_extra_config`` keys lw's connector knows in this checkout (an
    unknown key fails the engine)."""
    from lw.vllm_adapter.config import LwConfig

    return {f.name for f in fields(LwConfig)}


def push_mode_supported() -> bool:
    """Whether lw's connector knows ``push_mode`` yet."""
    return "push_mode" in lw_config_keys()


# ------------------------------------------------------------------------------------ setups
@dataclass
class Running:
    """A started setup: its servers (stopped in reverse order) and the URL clients use."""

    name: str
    servers: dict[str, Server] = field(default_factory=dict)
    url: str = ""
    cluster: LocalCluster | None = None
    stream_link: Link | None = None  # single-stream: the link its byte stream crosses

    def stop(self) -> None:
        """Stop every process group this setup started."""
        if self.cluster is not None:
            self.cluster.stop()
        for s in reversed(list(self.servers.values())):
            s.stop()


@dataclass(frozen=True)
class Placement:
    """Where a set-up's servers run: engine args for every engine, and the link D sits behind
    (``None``: everything on loopback)."""

    engine_args: tuple[str, ...] = ()
    link: Link | None = None

    def cluster(self, model: Path, logs: Path, **kw: Any) -> LocalCluster:
        """A ``LocalCluster`` placed so: P and the proxy on the root side of the veth (the
        address D reaches; D calls lw's metaserver at the proxy's address), D in the namespace."""
        hosts: dict[str, str] = {}
        netns: dict[str, str] = {}
        if self.link is not None:
            hosts = {"prefill": self.link.root_addr, "proxy": self.link.root_addr,
                     "decode": self.link.ns_addr}
            netns = {"decode": self.link.ns}
        return LocalCluster(model=model, workdir=logs, reference=False, hosts=hosts,
                            netns=netns, engine_args=list(self.engine_args), **kw)


def _peer_env(server: Server) -> None:
    """Put the CPU shim (``benchmarks/_peer/sitecustomize.py``) on a non-lw server's path."""
    old = server.env.get("PYTHONPATH", "")
    server.env["PYTHONPATH"] = str(PEER_DIR) + (os.pathsep + old if old else "")


def start_single(model: Path, logs: Path, timeout: float, place: Placement) -> Running:
    """One plain ``vllm serve`` (no connector) on core 0, on loopback (it has no link)."""
    factory = Placement(place.engine_args).cluster(model, logs)
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


def _start_lw(setup: str, model: Path, logs: Path, timeout: float,
              place: Placement) -> Running:
    """lw P/D as ``lw demo`` starts it (without the reference engine), with ``push_mode``
    and the set-up's extras (those this checkout's connector knows); on NIXL, UCX as the NIXL
    peers get it (``ucx_env``)."""
    known = lw_config_keys()
    extra = {"push_mode": PUSH_MODES[setup]} if "push_mode" in known else {}
    extra |= {k: v for k, v in BOTH_EXTRA.get(setup, {}).items() if k in known}
    plane = str(extra.pop("data_plane", "mooncake"))
    ucx = {n: ucx_env(place.link, n) for n in ("prefill", "decode")} if plane == "nixl" else {}
    cluster = place.cluster(model, logs, p_extra=dict(extra, **P_EXTRA.get(setup, {})),
                            d_extra=dict(extra), data_plane=plane, server_env=ucx,
                            proxy_args=list(PROXY_ARGS.get(setup, ())))
    cluster.start(timeout=timeout)  # stops what it started if it fails
    return Running(setup, dict(cluster.servers), cluster.url("proxy"), cluster)


def start_single_proxy(model: Path, logs: Path, timeout: float, place: Placement) -> Running:
    """The single server behind ``lw proxy --sidecar`` with no prefill server: the proxy relays
    each request to it, which computes the prompt itself (lw.proxy.sidecar), so the proxy's
    hop is this set-up's TTFT minus the single server's. The allowlist entry is a documentation
    address no request names: the sidecar's flags need one."""
    run = start_single(model, logs, timeout, place)
    run.name = "single-proxy"
    port = free_port()
    control = next(p for p in iter(free_port, None) if p != port)
    env = dict(os.environ, PYTHONUNBUFFERED="1", LW_CLUSTER_KEY="hex:" + os.urandom(32).hex())
    proxy = Server("proxy", [sys.executable, "-m", "lw.proxy.server", "--sidecar",
                             "--decode", run.url, "--allow-prefiller", "192.0.2.1:9",
                             "--host", "127.0.0.1", "--port", str(port),
                             "--control-host", "127.0.0.1", "--control-port", str(control),
                             "--timeout", "120", "--log-level", "warning"],
                   env, f"http://127.0.0.1:{port}", logs / "proxy.log")
    _start_proxy(run, proxy)
    run.url = proxy.url
    return run


def start_single_stream(model: Path, logs: Path, timeout: float, place: Placement) -> Running:
    """The single server (loopback, core 0); each row's run streams bytes across the row's
    link beside it (``stream_rate_bps``)."""
    run = start_single(model, logs, timeout, place)
    run.name, run.stream_link = "single-stream", place.link
    return run


def stream_rate_bps(info: LinkInfo) -> float:
    """The rate at which a push that overlaps the prefill moves a prompt's KV while the prefill
    runs: all of it within the prefill where the link carries it in that time, else what the
    link carries in it (``kv_over_prefill`` > 1)."""
    factor = info.achieved()[-1] if info.achieved() else 0.0
    return info.kv_bytes * 8 / info.prefill_s / max(1.0, factor)


def _start_proxy(run: Running, proxy: Server) -> None:
    """Start a set-up's proxy as one of its servers; a proxy that does not come up stops them
    all."""
    try:
        run.servers["proxy"] = proxy
        proxy.start()
        wait_ready([proxy], 90.0)
    except BaseException:
        run.stop()
        raise


def mooncake_kv_config(role: str, engine_id: str) -> dict[str, Any]:
    """``--kv-transfer-config`` for vLLM's in-tree MooncakeConnector over TCP."""
    return {"kv_connector": "MooncakeConnector", "kv_role": role, "engine_id": engine_id,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}


def start_peer(model: Path, logs: Path, timeout: float, place: Placement) -> Running:
    """vLLM's MooncakeConnector P (core 0) and D (core 1) plus the minimal peer proxy; D pulls
    from P's bootstrap server at P's address (the root side of the link, if any)."""
    factory = place.cluster(model, logs)
    logs.mkdir(parents=True, exist_ok=True)
    p = factory._engine("prefill", 0, mooncake_kv_config("kv_producer", "peer-prefill"))
    d = factory._engine("decode", 1, mooncake_kv_config("kv_consumer", "peer-decode"))
    bootstrap_port = free_port()
    for s in (p, d):
        _peer_env(s)
        s.env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(bootstrap_port)
    port = free_port()
    host = factory.host("proxy")
    proxy = Server("proxy", [sys.executable, str(PEER_DIR / "mooncake_proxy.py"),
                             "--prefill", p.url, "--decode", d.url,
                             "--bootstrap", f"http://{factory.host('prefill')}:{bootstrap_port}",
                             "--host", host, "--port", str(port)],
                   dict(os.environ, PYTHONUNBUFFERED="1"), f"http://{host}:{port}",
                   logs / "proxy.log")
    return _start_pair("peer", p, d, proxy, timeout)


def _start_pair(name: str, p: Server, d: Server, proxy: Server, timeout: float) -> Running:
    """Start a peer's P and D, wait until both answer, then its proxy; stop what started if
    anything fails."""
    run = Running(name, {"prefill": p, "decode": d}, proxy.url)
    try:
        p.start()
        d.start()
        wait_ready([p, d], timeout)
    except BaseException:
        run.stop()
        raise
    _start_proxy(run, proxy)
    return run


def nixl_kv_config(role: str, engine_id: str, push: bool) -> dict[str, Any]:
    """``--kv-transfer-config`` for vLLM's NixlConnector (D pulls) or NixlPushConnector (P
    writes), KV registered where it lives: host memory (``kv_buffer_device`` cpu)."""
    return {"kv_connector": "NixlPushConnector" if push else "NixlConnector",
            "kv_role": role, "engine_id": engine_id, "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {}}


def ucx_env(link: Link | None, name: str) -> dict[str, str]:
    """UCX's settings for a NIXL engine: TCP only (shared memory or CMA would skip the capped
    veth), on the link's interface as seen from where the engine runs (P: the root side's
    veth, D: the namespace side's; both ``lo`` without a link)."""
    dev = "lo" if link is None else link.ns_dev if name == "decode" else link.root_dev
    return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev}


def start_peer_nixl(push: bool, model: Path, logs: Path, timeout: float,
                    place: Placement) -> Running:
    """vLLM's NixlConnector (``push`` false) or NixlPushConnector P (core 0) and D (core 1)
    plus the minimal NIXL proxy; each engine's NIXL side channel listens on its own address
    (the link's sides, if any), and UCX runs over TCP on the link's interface."""
    setup = "peer-nixl-push" if push else "peer-nixl"
    factory = place.cluster(model, logs)
    logs.mkdir(parents=True, exist_ok=True)
    p_engine = f"{setup}-prefill"
    p = factory._engine("prefill", 0, nixl_kv_config("kv_producer", p_engine, push))
    d = factory._engine("decode", 1, nixl_kv_config("kv_consumer", f"{setup}-decode", push))
    side = {"prefill": free_port(), "decode": free_port(factory.netns.get("decode"))}
    for name, s in (("prefill", p), ("decode", d)):
        _peer_env(s)
        s.env.update(ucx_env(place.link, name), VLLM_NIXL_SIDE_CHANNEL_HOST=factory.host(name),
                     VLLM_NIXL_SIDE_CHANNEL_PORT=str(side[name]))
    port = free_port()
    host = factory.host("proxy")
    argv = [sys.executable, str(PEER_DIR / "nixl_proxy.py"), "--mode", "push" if push else "pull",
            "--prefill", p.url, "--decode", d.url, "--host", host, "--port", str(port)]
    if push:  # D registers its blocks with P: P's coordinates go in D's params
        argv += ["--p-engine-id", p_engine, "--p-host", factory.host("prefill"),
                 "--p-port", str(side["prefill"]), "--p-tp-size", "1"]
    proxy = Server("proxy", argv, dict(os.environ, PYTHONUNBUFFERED="1"),
                   f"http://{host}:{port}", logs / "proxy.log")
    return _start_pair(setup, p, d, proxy, timeout)


STARTERS: dict[str, Callable[[Path, Path, float, Placement], Running]] = {
    "single": start_single, "single-proxy": start_single_proxy, "peer": start_peer,
    "peer-nixl": functools.partial(start_peer_nixl, False),
    "peer-nixl-push": functools.partial(start_peer_nixl, True),
    "single-stream": start_single_stream,
    # every lw set-up starts alike, with its own push_mode, proxy args and P extras (_plan.py)
    **{setup: functools.partial(_start_lw, setup) for setup in PUSH_MODES}}


def warm_up(run: Running, n: int = 2) -> None:
    """A few requests through the front URL (first-forward and first-contact costs)."""
    for i in range(n):
        r = complete(run.url, make_prompt(200, seed=-100 - i), max_tokens=4, timeout=180.0)
        if r.error:
            tails = "\n".join(f"--- {k}\n{s.tail(15)}" for k, s in run.servers.items())
            raise RuntimeError(f"{run.name} warm-up failed: {r.error}\n{tails}")


CHECK_PROMPT = make_prompt(300, seed=-300)
"""The output check's prompt: about 10 blocks, no prefix shared with a measured or warm-up one."""
CHECK_TOKENS = 16


def check_request(url: str) -> Any:
    """One greedy request of the output check (tokens and top logprobs, for the oracle)."""
    return complete(url, CHECK_PROMPT, max_tokens=CHECK_TOKENS, stream=False, timeout=180.0,
                    logprobs=TOP_K)


def check_output(bench: Bench, run: Running) -> str:
    """The output check of a peer: one greedy request through it must answer what the single
    server did (``lw.lab.oracle``: the same tokens, or a near tie at the first divergence);
    RuntimeError otherwise. Returns the verdict."""
    if bench.reference is None:
        raise RuntimeError("output check: no single-server answer to compare with")
    got = check_request(run.url)
    verdict = compare(bench.reference, got, drift=DRIFT["llama"])
    if not verdict.same:
        raise RuntimeError(f"output check: {verdict}; single {bench.reference.text!r}, "
                           f"{run.name} {got.text!r}")
    return str(verdict)


def warm_row(bench: Bench, run: Running, rep: int, row: LinkRow, shape: Shape) -> None:
    """``bench.row_warmups`` prompts of the shape's length, not measured, before a row's run:
    each set-up meets the row's link in its steady state (lw's ``push_mode`` auto learns a
    link from its own writes, and a row follows a faster or slower one within seconds, not
    as a deployment's link changes). Fresh prompts of their own: a warm-up that repeated a
    measured prompt would give that prompt a prefix-cache hit."""
    if not bench.row_warmups:
        return
    prompts = make_prompts(bench.model, Shape(shape.input_len, 1, bench.row_warmups),
                           f"{bench.seed}-warm-r{rep}-{row.key}")
    for p in prompts:
        r = complete(run.url, p, max_tokens=2, stream=False, timeout=300.0)
        if r.error:
            raise RuntimeError(f"warm-up request failed: {r.error}")

def measure(bench: Bench, run: Running, setup: str, rep: int, row: LinkRow, shape: Shape,
            logs: Path) -> None:
    """One ``vllm bench serve`` run (after the row's warm-ups); stored under (shape, row,
    setup)."""
    label = f"{bench.model_name} {LABELS[setup]} {shape.key} {row.key} rep {rep}"
    key = (shape.key, "-" if setup in NO_LINK else row.key, setup)
    try:
        warm_row(bench, run, rep, row, shape)
    except RuntimeError as exc:
        print(f"[{label}] FAILED: {exc}", flush=True)
        bench.failures += 1
        bench.results.setdefault(key, []).append({"error": "warm-up failed", "rep": rep})
        return
    t1, wall1 = time.monotonic(), time.time()
    stream = None
    if run.stream_link is not None:
        rate = stream_rate_bps(bench.links[(row.key, shape.input_len)])
        stream = ByteStream.start(run.stream_link, rate, CORES["single"], CORES["decode"])
    try:
        res = run_bench(run.url, bench.model, bench.dataset(rep, row, shape), shape,
                        logs / f"{shape.key}-{row.key.replace('=', '')}-r{rep}.json",
                        bench.bench_timeout)
    except RuntimeError as exc:
        print(f"[{label}] FAILED: {exc}", flush=True)
        bench.failures += 1
        bench.results.setdefault(key, []).append({"error": "bench failed", "rep": rep})
        return
    finally:
        if stream is not None:
            got = stream.stop()
            print(f"  [{label}] byte stream: {rate / 1e6:.0f} Mbit/s wanted, {got / 1e6:.0f} "
                  "delivered", flush=True)
    res["rep"] = rep
    add_token2(res)
    bench.results.setdefault(key, []).append(res)
    bench.failures += bool(res.get("failed"))
    t2 = res["median_token2_ms"]
    print(f"[{label}] TTFT p50 {res['median_ttft_ms']:.0f} ms, token 2 p50 "
          f"{'-' if t2 is None else format(t2, '.0f')} ms, "
          f"{res['output_throughput']:.1f} tok/s, failed {res.get('failed', 0)} "
          f"({time.monotonic() - t1:.0f}s)", flush=True)
    if setup in PUSH_MODES and run.cluster is not None:
        after_lw_run(run.cluster, f"{shape.key} {row.key}", res, wall1)


def set_link(link: Link, bench: Bench, row: LinkRow, shape: Shape) -> None:
    """Cap ``link`` for this row and prompt length, measure the goodput and print it.

    ``kv_over_prefill`` is defined by the goodput (module docstring), and TCP through tbf
    delivers about 4 % less than the tbf rate: the first time a row is set after its target
    changed (each repeat's calibration), its tbf rate is scaled until the goodput is within
    ``GOODPUT_TOLERANCE`` of the target (two corrections at most); later set-ups of the same
    repeat reuse that rate and only measure."""
    info = bench.links[(row.key, shape.input_len)]
    link.set_rate(info.rate_bps)
    good = link.goodput(seconds=1.0 if info.rate_bps else 0.5)
    target = info.target_bps
    for _ in range(2 if target and not info.rate_fitted else 0):
        if abs(good * 8 / target - 1.0) <= GOODPUT_TOLERANCE:
            break
        assert info.rate_bps is not None
        print(f"  link {row.key} {shape.key}: tbf {info.rate_bps / 1e6:.1f} Mbit/s gave "
              f"{good * 8 / 1e6:.1f} Mbit/s of {target / 1e6:.1f} wanted; scaling", flush=True)
        info.rate_bps *= target / (good * 8)
        link.set_rate(info.rate_bps)
        good = link.goodput(seconds=1.0)
    info.rate_fitted = True
    info.goodputs_bps.append(good * 8)
    info.goodput_prefills_s.append(info.prefill_s)
    cap = "uncapped" if info.rate_bps is None else f"tbf {info.rate_bps / 1e6:.1f} Mbit/s"
    achieved = (f", kv_over_prefill achieved {info.achieved()[-1]:.2f}"
                if info.prefill_s else "")
    print(f"  link {row.key} {shape.key}: {cap}; TCP goodput {good * 8 / 1e6:.1f} Mbit/s"
          f"{achieved}", flush=True)


@contextlib.contextmanager
def placed(row_group: str, engine_args: tuple[str, ...]) -> Iterator[Placement]:
    """A placement for a group of link rows: loopback, or a fresh link (removed afterwards)."""
    if row_group == "none":
        yield Placement(engine_args)
        return
    with Link.create() as link:
        print(f"  link: {link.describe()}", flush=True)
        yield Placement(engine_args, link)


def veth_tx_bytes(link: Link | None) -> int:
    """Bytes the root side's veth has sent towards D's namespace so far (0 without a link)."""
    if link is None:
        return 0
    return int(Path(f"/sys/class/net/{link.root_dev}/statistics/tx_bytes").read_text())


def _record_failed(bench: Bench, setup: str, rep: int, rows: list[LinkRow], why: str) -> None:
    """Count a set-up that was not timed, with ``why`` in each of its table rows."""
    bench.failures += 1
    for sh in bench.plan:
        for row in (r for r in rows if sh.runs_on(r)):
            key = (sh.key, "-" if setup in NO_LINK else row.key, setup)
            bench.results.setdefault(key, []).append({"error": why, "rep": rep})


def _affinity_line(run: Running, p_threads: str) -> str:
    """Whether every engine thread is still on the core ``pin`` gave it, per engine."""
    off = off_core(run, p_threads)
    cells = [f"{n} {len(t)} off its core"
             + (f" ({', '.join(_thread_name(x) for x in t[:8])})" if t else "")
             for n, t in off.items()]
    return "threads: " + ("; ".join(cells) if cells else "no engine")


def _thread_name(tid: int) -> str:
    """``tid:comm:cores`` of a thread, for the affinity line (``tid`` alone once it ended)."""
    try:
        comm = Path(f"/proc/{tid}/comm").read_text().strip()
        cores = ",".join(map(str, sorted(os.sched_getaffinity(tid))))
    except OSError:
        return str(tid)
    return f"{tid}:{comm}:{cores}"


def run_setup(bench: Bench, setup: str, rep: int, group: str, rows: list[LinkRow],
              args: argparse.Namespace, engine_args: tuple[str, ...]) -> None:
    """Start one set-up (D behind a fresh link unless ``group`` is ``none``), run each shape
    and link row on it, stop it."""
    logs = bench.work / f"{bench.model.name}-{setup}-r{rep}-{group}"
    t0 = time.monotonic()
    name = f"{bench.model_name} {LABELS[setup]} rep {rep} ({group})"
    print(f"[{name}] starting ...", flush=True)
    # a set-up without P/D crosses no link: no veth to make for it
    with placed("none" if setup in NO_LINK else group, engine_args) as place:
        try:
            run = STARTERS[setup](bench.model, logs, args.start_timeout, place)
        except RuntimeError as exc:
            print(f"[{name}] FAILED to start: {exc}", flush=True)
            _record_failed(bench, setup, rep, rows, "did not start")
            return
        try:
            moved = ""
            p_threads = ("forward-core" if setup == "peer" and args.peer_on_forward_core
                         else args.p_threads)
            if not args.float_frontends:
                print(f"[{name}] {_affinity_line(run, p_threads)} before pinning", flush=True)
                pin(run, p_threads)
            warm_up(run)
            if not args.float_frontends:  # again: threads that started with the first requests
                n = pin(run, p_threads)
                moved = f"; {n} P worker thread(s) on D's core" if n else ""
            print(f"[{name}] ready in {time.monotonic() - t0:.0f}s{moved}", flush=True)
            if not args.float_frontends:
                print(f"[{name}] {_affinity_line(run, p_threads)} after start", flush=True)
            if setup in PEERS:
                try:
                    verdict = check_output(bench, run)
                except RuntimeError as exc:
                    print(f"[{name}] FAILED, not timed: {exc}", flush=True)
                    _record_failed(bench, setup, rep, rows, "output mismatch")
                    return
                print(f"[{name}] output check against the single server: {verdict}", flush=True)
            for sh in bench.plan:
                for row in (r for r in rows if sh.runs_on(r)):
                    if place.link is not None:
                        set_link(place.link, bench, row, sh)
                    sent = veth_tx_bytes(place.link)
                    measure(bench, run, setup, rep, row, sh, logs)
                    if place.link is not None and setup not in NO_LINK:
                        sent = veth_tx_bytes(place.link) - sent
                        kv = kv_bytes(bench.model, sh.input_len) * (sh.prompts + bench.row_warmups)
                        print(f"  [{name} {sh.key} {row.key}] veth P->D {sent / 1e6:.1f} MB for "
                              f"{sh.prompts + bench.row_warmups} prompts' KV of {kv / 1e6:.1f} MB "
                              f"({sent / kv:.2f}x)", flush=True)
            if not args.float_frontends:
                print(f"[{name}] {_affinity_line(run, p_threads)} after its runs", flush=True)
        except RuntimeError as exc:
            print(f"[{name}] FAILED: {exc}", flush=True)
            bench.failures += 1
        finally:
            run.stop()


def calibrate(bench: Bench, args: argparse.Namespace, engine_args: tuple[str, ...],
              rep: int = 0) -> None:
    """Start the single server; measure its prefill time per prompt length (if a link row has
    a factor) and, in repeat 0, run its benchmark (if ``single`` is a set-up); aim every
    factor row of ``bench.links`` at that prefill time."""
    # Every row's physical limit needs the single server's prefill time and TPOT in the same
    # repeat, whatever --setups says (issue 39): it is started and measured each calibration.
    need_prefill = True
    run_single = True
    prefill: dict[int, float] = {}
    if need_prefill or run_single:
        logs = bench.work / f"{bench.model.name}-single" / f"r{rep}"
        t0 = time.monotonic()
        print(f"[{bench.model_name} {LABELS['single']} rep {rep}] starting ...", flush=True)
        try:
            run = start_single(bench.model, logs, args.start_timeout, Placement(engine_args))
        except RuntimeError as exc:
            if need_prefill:
                raise RuntimeError(f"single server (prefill time) did not start: {exc}") from exc
            print(f"[{bench.model_name} single] FAILED to start: {exc}", flush=True)
            bench.failures += 1
            for sh in bench.plan:
                bench.results.setdefault((sh.key, "-", "single"), []).append(
                    {"error": "did not start"})
            run = None
        if run is not None:
            try:
                if not args.float_frontends:
                    pin(run)
                warm_up(run)
                print(f"[{bench.model_name} single] ready in {time.monotonic() - t0:.0f}s",
                      flush=True)
                bench.reference = check_request(run.url)  # the peers' output check
                if bench.reference.error:
                    raise RuntimeError(f"single server: output check request failed: "
                                       f"{bench.reference.error}")
                if need_prefill:
                    for n in sorted({sh.input_len for sh in bench.plan}):
                        prefill[n] = prefill_time(run.url, bench.model, n, seed=bench.seed)
                        print(f"  prefill time, {n} tokens (single server, TTFT p50, "
                              f"max_tokens 1): {prefill[n] * 1e3:.0f} ms", flush=True)
                for n, t in prefill.items():
                    bench.prefills[(rep, n)] = t
                if run_single:
                    for sh in bench.plan:
                        measure(bench, run, "single", rep, bench.rows[0], sh, logs)
            finally:
                run.stop()
    for sh in bench.plan:
        for row in bench.rows:
            info = bench.links.setdefault((row.key, sh.input_len), LinkInfo())
            info.kv_bytes = kv_bytes(bench.model, sh.input_len)
            if row.kind == "factor":
                info.retarget(row.factor, prefill[sh.input_len])
            elif sh.input_len in prefill:
                info.prefill_s = prefill[sh.input_len]
    for row in bench.rows:
        for n in sorted({sh.input_len for sh in bench.plan}):
            info = bench.links[(row.key, n)]
            if row.kind == "factor":
                print(f"  {row.key}, {n} tokens: KV {info.kv_bytes / 1e6:.1f} MB per prompt / "
                      f"({row.factor} x {info.prefill_s * 1e3:.0f} ms) -> goodput "
                      f"{info.target_bps / 1e6:.1f} Mbit/s wanted",  # type: ignore[operator]
                      flush=True)


def run_model(bench: Bench, args: argparse.Namespace, engine_args: tuple[str, ...]) -> None:
    """Every set-up, repeat and link row on one model."""
    pd = [s for s in SETUPS if s in args.setups and s != "single"]
    groups = [g for g in ("none", "veth")
              if any((r.kind == "none") == (g == "none") for r in bench.rows)]
    for rep in range(args.repeats):
        if rep == 0 or args.recalibrate:
            # The shared machine's speed drifts (a prefill of 646 and of 861 ms within one
            # hour): a factor holds for the prefill time of its own repeat.
            calibrate(bench, args, engine_args, rep)
        order = pd[rep % len(pd):] + pd[:rep % len(pd)] if pd else []
        for setup in order:
            for group in groups:
                rows = [r for r in bench.rows if (r.kind == "none") == (group == "none")]
                if setup in NO_LINK:  # once per repeat, on the single server's prompts
                    if bench.rows[0] not in rows:
                        continue
                    rows = [bench.rows[0]]
                if rep % 2:
                    rows.reverse()  # what ran first in one repeat runs last in the next
                run_setup(bench, setup, rep, group, rows, args, engine_args)


def main(argv: Sequence[str] | None = None) -> int:
    """Run every setup on every model and shape; exit 1 if any run failed."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="fewer prompts per shape (with --link: 1,024-token prompts only)")
    ap.add_argument("--link", type=parse_link, default=[LinkRow("none")],
                    help="none (loopback, default), uncapped, auto (= uncapped,0.5,1.0,2.0) or "
                         "kv_over_prefill factors, comma separated; anything but none needs "
                         "root and iproute2")
    ap.add_argument("--layers", type=int, nargs="+", default=None,
                    help="decoder layers of each tiny model (default: 2 32; with --link: 32)")
    ap.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    ap.add_argument("--repeats", type=int, default=None,
                    help="start each P/D set-up this many times, order rotated (default 1; "
                         "with --link 2)")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (same for every setup)")
    ap.add_argument("--row-warmups", type=int, default=None, metavar="N",
                    help="unmeasured prompts of the shape's length before each run of a set-up "
                         "on a link row (default 2 with --link, else 0)")
    ap.add_argument("--no-recalibrate", dest="recalibrate", action="store_false",
                    help="measure the single server's prefill time once, not before every "
                         "repeat (a factor row's rate then stays the first repeat's)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per shape (override)")
    ap.add_argument("--shapes", nargs="+", default=None, metavar="NAME",
                    help="run only these shapes of the plan, e.g. in1024-c4")
    ap.add_argument("--float-frontends", action="store_true",
                    help="leave each engine's API server and EngineCore unbound (vLLM's "
                         "default; only the workers are pinned), as in the first runs")
    ap.add_argument("--p-threads", choices=P_THREADS, default="forward-core",
                    help="where every thread of each P worker but the forward pass's runs "
                         "(its transfer threads, lw's and the peer's alike): on the forward's "
                         "core (default) or on the other core, D's, as on a host whose "
                         "transfer threads have cores of their own")
    ap.add_argument("--peer-on-forward-core", action="store_true",
                    help="with --p-threads other-core, leave the peer's threads on its "
                         "forward's core: moved to D's core, its sender thread busy-waits "
                         "there inside batch_transfer_sync_write and its transfers make no "
                         "progress for 30 s on this kind of machine (docs/benchmarks.md)")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="models, datasets, results, logs (default: a temporary folder, kept)")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="server start, s")
    ap.add_argument("--bench-timeout", type=float, default=900.0, help="one bench run, s")
    args = ap.parse_args(list(argv) if argv is not None else None)
    if args.float_frontends and args.p_threads != "forward-core":
        ap.error("--p-threads other-core places threads: it needs the engines pinned "
                 "(drop --float-frontends)")
    link_mode = any(r.veth for r in args.link)
    if link_mode:
        why = missing_requirements()
        if why:
            print(f"serving.py --link: {why}; use --link none for loopback", file=sys.stderr)
            return 2
    if args.layers is None:
        args.layers = [32] if link_mode else [2, 32]
    if args.repeats is None:
        args.repeats = 2 if link_mode else 1
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    for sig in (signal.SIGTERM, signal.SIGHUP):  # finally blocks stop servers and links
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"]
                                            if os.environ.get("PYTHONPATH") else "")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="lw-serving-"))
    work.mkdir(parents=True, exist_ok=True)
    from lw.lab.tiny_model import make_tiny_model

    plan = shapes(args.quick, link_mode)
    if args.shapes:
        known = {s.key: s for s in shapes(False, link_mode) + shapes(True, link_mode)}
        unknown = [n for n in args.shapes if n not in known]
        if unknown:
            ap.error(f"unknown shape(s) {', '.join(unknown)}; choose from "
                     f"{', '.join(sorted(known))}")
        plan = [s for s in plan if s.key in args.shapes] or [known[n] for n in args.shapes]
    if args.row_warmups is not None and args.row_warmups < 0:
        ap.error(f"--row-warmups must be >= 0, got {args.row_warmups}")
    if args.prompts:
        plan = [dataclasses.replace(s, prompts=args.prompts) for s in plan]
    longest = max(s.input_len for s in plan) + OUTPUT_TOKENS
    engine_args: tuple[str, ...] = ()
    model_kw: dict[str, Any] = {}
    if longest > 2048:  # LocalCluster's --max-model-len and the tiny model's positions
        engine_args = ("--max-model-len", str(longest + 64))
        model_kw["max_positions"] = 1 << (longest + 64 - 1).bit_length()
    t_all = time.monotonic()
    pm = "" if push_mode_supported() else (
        " (lw's config has no push_mode yet: both lw set-ups run its one mode)")
    if "lw-off" in args.setups and "first_token_from_p" not in lw_config_keys():
        pm += " (lw's config has no first_token_from_p: lw-off runs as lw)"
    warm = args.row_warmups if args.row_warmups is not None else 2 if link_mode else 0
    print(f"serving benchmark: setups {', '.join(args.setups)}{pm}; link rows "
          f"{', '.join(r.key for r in args.link)}; repeats {args.repeats}; {warm} unmeasured "
          f"prompt(s) before each run; P's side threads on the {args.p_threads}"
          f"{' (the peer on its forward-core)' if args.peer_on_forward_core else ''}; work dir "
          f"{work}", flush=True)
    benches: list[Bench] = []
    failures = 0
    try:
        for layers in args.layers:
            suffix = f"-{model_kw['max_positions']}pos" if model_kw else ""
            model = make_tiny_model(work / f"tiny-{layers}l{suffix}", num_layers=layers,
                                    **model_kw)
            bench = Bench(f"llama {layers} layers", model, work, plan, list(args.link),
                          args.seed, args.bench_timeout,
                          row_warmups=warm)
            benches.append(bench)
            try:
                run_model(bench, args, engine_args)
            except RuntimeError as exc:
                print(f"[{bench.model_name}] FAILED: {exc}", flush=True)
                bench.failures += 1
    finally:
        for bench in benches:
            failures += bench.failures
            for sh in bench.plan:
                for row in (r for r in bench.rows if sh.runs_on(r)):
                    print_table(bench, sh, row, link_mode)
        print(f"\ntotal time {time.monotonic() - t_all:.0f}s; results and logs in {work}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
