"""Processes of a local P/D cluster: vLLM servers (prefill, decode, a reference engine) with
lw's connector, and lw's proxy, started, health-checked and stopped together (``lw demo
--engine vllm``, the end-to-end tests, the serving benchmark)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lw.contract.worker_addrs import worker_addrs
from lw.lab.demo_client import MODEL_NAME, make_prompt

__all__ = ["BLOCK_SIZE", "MAX_BATCHED_TOKENS", "LocalCluster", "Server", "free_port",
           "free_port_range", "kv_transfer_config", "wait_ready"]

BLOCK_SIZE = 32
MAX_BATCHED_TOKENS = 256  # prompts longer than this are prefilled in chunks

def in_workdir(args: Any, prefix: str, run: Callable[[Any], int]) -> int:
    """``run(args)`` with ``args.workdir`` set (a temporary folder, removed after unless
    ``args.keep``, when none was given); offline model loading (HF_HUB_OFFLINE)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tmp = None
    if args.workdir is None:
        tmp = tempfile.mkdtemp(prefix=prefix)
        args.workdir = Path(tmp)
    try:
        return run(args)
    finally:
        if tmp is not None and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


ADMISSION = "lw.vllm_adapter.admission.TransferParamsGuard"
"""The ASGI middleware P's and D's API servers mount (``vllm serve --middleware``)."""


def free_port(netns: str | None = None) -> int:
    """A TCP port free on loopback right now; with ``netns`` (an ``ip netns`` name), free in
    that network namespace too (a server started there binds it)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if netns is None or subprocess.run(
                ["ip", "netns", "exec", netns, sys.executable, "-c",
                 f"import socket; socket.socket().bind(('0.0.0.0', {port}))"],
                capture_output=True).returncode == 0:
            return port
    raise RuntimeError(f"no port free both here and in network namespace {netns}")


def free_port_range(n: int, lo: int = 20000, hi: int = 29000) -> int:
    """The first of ``n`` consecutive loopback ports free right now."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(lo, hi - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports in {lo}..{hi}")


# ------------------------------------------------------------------------------------ servers
class Server:
    """One child process in its own process group (so it and its children can be killed
    together), and by default its own session."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], url: str,
                 log_path: Path, health: str = "/health", own_session: bool = True) -> None:
        self.name = name
        # A session of its own is an autogroup of its own: the kernel shares a core between
        # autogroups first, and after each request vLLM's workers busy-poll for 1 s. The
        # demo's engines, proxy and client in their own sessions gave the next request's
        # proxy and D server the CPU ~0.9 s late (P/D TTFT x16-20 the single engine's); in
        # the caller's session x1.24-1.48 (docs/benchmarks.md, "vLLM end to end").
        self.own_session = own_session
        self.argv = argv
        self.env = env
        self.url = url
        self.log_path = log_path
        self.health = health
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """Spawn (non-blocking)."""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=self.own_session,
                                         process_group=None if self.own_session else 0)

    @property
    def alive(self) -> bool:
        """The top process has not exited."""
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        """Health endpoint answers 200."""
        import httpx

        try:
            return httpx.get(self.url + self.health, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def tail(self, lines: int = 30) -> str:
        """The end of the server's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the server's whole process group."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM the group, then SIGKILL what is left."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)  # children (engine core) of an exited parent too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)


def wait_ready(servers: Sequence[Server], timeout: float) -> None:
    """Wait until every server is healthy; RuntimeError with its log if one dies or times out."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for s in list(pending):
            if not s.alive:
                raise RuntimeError(f"{s.name} exited with {s.proc.returncode if s.proc else '?'}"
                                   f":\n{s.tail()}")
            if s.ready():
                pending.remove(s)
        if pending:
            if time.monotonic() > deadline:
                names = ", ".join(s.name for s in pending)
                raise RuntimeError(f"{names} not healthy after {timeout:.0f}s:\n"
                                   f"{pending[0].tail()}")
            time.sleep(0.5)


def kv_transfer_config(role: str, kv_port: int, engine_id: str,
                       extra: dict[str, Any] | None = None,
                       policy: str = "fail") -> dict[str, Any]:
    """The --kv-transfer-config for lw's connector."""
    return {"kv_connector": "LwConnector", "kv_connector_module_path": "lw.vllm_adapter",
            "kv_role": role, "kv_port": kv_port, "engine_id": engine_id,
            "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"host": "127.0.0.1", **(extra or {})}}


def is_lw_connector(kv: dict[str, Any] | None) -> bool:
    """Whether ``kv`` (a --kv-transfer-config) runs lw's connector, alone or in MultiConnector."""
    if kv is None:
        return False
    if kv.get("kv_connector") == "MultiConnector":
        return any(is_lw_connector(c) for c in
                   kv.get("kv_connector_extra_config", {}).get("connectors", ()))
    return kv.get("kv_connector") == "LwConnector"


def lw_data_plane(kv: dict[str, Any] | None) -> str | None:
    """The ``data_plane`` lw's connector in ``kv`` runs (alone or in MultiConnector; its
    default ``mooncake`` when unnamed), None when ``kv`` runs no lw connector."""
    if not is_lw_connector(kv):
        return None
    assert kv is not None
    if kv.get("kv_connector") == "MultiConnector":
        return next(p for c in kv["kv_connector_extra_config"]["connectors"]
                    if (p := lw_data_plane(c)) is not None)
    return str(kv.get("kv_connector_extra_config", {}).get("data_plane", "mooncake"))


def in_netns(ns: str, fn: Callable[[], Any]) -> Any:
    """``fn()`` run by a thread inside network namespace ``ns`` (an ``ip netns`` name; needs
    root): what an address or interface is there."""
    from lw.lab.synthetic.netns import enter

    out: list[Any] = []
    err: list[BaseException] = []

    def body() -> None:
        try:
            enter(ns)
            out.append(fn())
        except BaseException as exc:  # re-raised in the caller
            err.append(exc)

    t = threading.Thread(target=body, name="lw-in-netns", daemon=True)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


def in_multi_connector(kv: dict[str, Any]) -> dict[str, Any]:
    """``kv`` (lw's config) as the only connector inside vLLM's MultiConnector. The engine id
    stays outside: vLLM 0.32 passes it to each child's config itself, and a child that also
    names one fails to start ("got multiple values for keyword argument 'engine_id'")."""
    inner = {k: v for k, v in kv.items() if k != "engine_id"}
    return {"kv_connector": "MultiConnector", "kv_role": kv["kv_role"],
            "engine_id": kv["engine_id"],
            "kv_load_failure_policy": kv.get("kv_load_failure_policy", "fail"),
            "kv_connector_extra_config": {"connectors": [inner]}}


@dataclass
class LocalCluster:
    """Reference engine (optional) + prefill + decode ``vllm serve`` + the proxy, on loopback."""

    model: Path
    workdir: Path
    reference: bool = True
    p_extra: dict[str, Any] = field(default_factory=dict)
    d_extra: dict[str, Any] = field(default_factory=dict)
    policy: str = "fail"
    p_tp: int = 1  # prefill tensor-parallel size
    d_tp: int = 1
    p_dp: int = 1  # prefill data-parallel size (dense models: independent engines)
    d_dp: int = 1
    engine_args: list[str] = field(default_factory=list)  # extra `vllm serve` args, every engine
    servers: dict[str, Server] = field(default_factory=dict)
    kv_ports: dict[str, int] = field(default_factory=dict)  # first side-channel port per side
    # server name -> address it binds and advertises (VLLM_HOST_IP, lw's host); default loopback
    hosts: dict[str, str] = field(default_factory=dict)
    netns: dict[str, str] = field(default_factory=dict)  # server name -> `ip netns` it runs in
    # Shared by P, D and the proxy through LW_CLUSTER_KEY (off the command line): it
    # authenticates the side channel and D's metaserver calls; `lw status` needs it too.
    cluster_key: str = field(default_factory=lambda: "hex:" + os.urandom(32).hex())
    control_url: str = ""  # the proxy's control plane (metaserver, /lw/timeline, /metrics-json)
    # vLLM's --otlp-traces-endpoint for every engine (OTLP/HTTP; spans exported within 0.2 s)
    otlp_endpoint: str | None = None
    multi_connector: bool = False  # lw inside vLLM's MultiConnector on P and D
    proxy_args: list[str] = field(default_factory=list)  # extra `lw proxy` args (--start-mode)
    # prefill servers behind the proxy: "prefill", then "prefill2", ... (each its own engine id,
    # side-channel ports and core 0): prefill failover needs a second one to fail over to
    prefill_servers: int = 1
    # server name -> environment of that server only (a test fault aimed at one prefill server)
    server_env: dict[str, dict[str, str]] = field(default_factory=dict)
    # every server in a session of its own (Server.own_session); the demo keeps them in its own
    own_sessions: bool = True
    # lw's data plane on P and D (``data_plane`` of their extra config): "mooncake" or "nixl"
    # (then UCX over TCP on each engine's own interface unless the environment sets UCX_*)
    data_plane: str = "mooncake"
    # a reference engine of the same model that its owner started (``reference_engine`` of
    # another cluster) and stops: this cluster waits for it and uses it, never stops it
    # (test modules share one, an engine start less each); it stands in for ``reference``
    shared_reference: Server | None = None

    @property
    def prefill_names(self) -> list[str]:
        """The names of the prefill servers, in the order the proxy is given them."""
        return ["prefill"] + [f"prefill{i}" for i in range(2, self.prefill_servers + 1)]

    def host(self, name: str) -> str:
        """The address server ``name`` binds and advertises."""
        return self.hosts.get(name, "127.0.0.1")

    def ucx_env(self, name: str) -> dict[str, str]:
        """UCX's settings for server ``name``'s NIXL plane, as the synthetic cluster's workers
        get them (:func:`lw.lab.synthetic.workers.ucx_env`): TCP, on the interface holding its
        address, looked up in the network namespace it runs in."""
        from lw.lab.synthetic.workers import ucx_env

        host, ns = self.host(name), self.netns.get(name)
        if ns is None:
            return ucx_env(host)
        return in_netns(ns, lambda: ucx_env(host))

    def reference_engine(self) -> Server:
        """The single engine outputs are compared with (no connector, core 0), not started."""
        return self._engine("reference", 0, None)

    def _engine(self, name: str, first_core: int, kv: dict[str, Any] | None, tp: int = 1,
                dp: int = 1) -> Server:
        port = free_port(self.netns.get(name))
        host = self.host(name)
        env = dict(os.environ)
        # One core per worker, round robin from ``first_core`` (vLLM needs an explicit binding
        # for more than one worker: "Not enough allowed NUMA nodes" otherwise).
        cores = "|".join(str((first_core + i) % 2) for i in range(tp * dp))
        env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_CPU_OMP_THREADS_BIND=cores, PYTHONUNBUFFERED="1",
                   # the whole engine (API server, EngineCore) on its workers' cores
                   LW_CPU_AFFINITY=",".join(sorted(set(cores.split("|")))),
                   VLLM_HOST_IP=host, TOKENIZERS_PARALLELISM="false",
                   LW_CLUSTER_KEY=self.cluster_key)
        if lw_data_plane(kv) == "nixl":
            env.update(self.ucx_env(name))
        env.update(self.server_env.get(name, {}))
        if self.p_tp * self.p_dp * self.prefill_servers + self.d_tp * self.d_dp > 2:
            # More workers than cores: an idle worker's OpenMP threads must sleep, not spin on
            # the core a busy worker needs (D waiting for KV starved P's TP ranks otherwise).
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        argv = [sys.executable, "-m", "lw.vllm_adapter.serve", str(self.model),
                "--host", host, "--port", str(port), "--served-model-name", MODEL_NAME,
                "--dtype", "bfloat16", "--enforce-eager", "--block-size", str(BLOCK_SIZE),
                "--max-model-len", "2048", "--max-num-batched-tokens", str(MAX_BATCHED_TOKENS),
                "--max-num-seqs", "16", "--seed", "0"]
        if tp > 1:
            argv += ["--tensor-parallel-size", str(tp)]
        if dp > 1:  # its RPC port is fixed by default: two DP servers on one host would clash
            argv += ["--data-parallel-size", str(dp), "--data-parallel-rpc-port",
                     str(free_port())]
        argv += self.engine_args
        if self.otlp_endpoint:
            argv += ["--otlp-traces-endpoint", self.otlp_endpoint]
            env.update(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf",
                       OTEL_BSP_SCHEDULE_DELAY="200")
        if kv is not None:
            argv += ["--kv-transfer-config", json.dumps(kv)]
        if is_lw_connector(kv):
            # the admission guard answers bad transfer params 400 before the engine sees them
            # (lw's only: it refuses every other connector's params, vLLM's own included)
            argv += ["--middleware", ADMISSION]
        if name in self.netns:
            argv = ["ip", "netns", "exec", self.netns[name], *argv]
        return Server(name, argv, env, f"http://{host}:{port}",
                      self.workdir / f"{name}.log", own_session=self.own_sessions)

    def start(self, timeout: float = 240.0) -> None:
        """Start every server (engines in parallel) and wait until all are healthy."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        kv_d = free_port_range(max(4, self.d_tp * self.d_dp))
        self.kv_ports = {"decode": kv_d}
        # Each side is told the other's TP: D counts its senders with it, P checks D's.
        d_extra = {"peer_tp_size": self.p_tp, "host": self.host("decode"),
                   "data_plane": self.data_plane, **self.d_extra}
        if self.shared_reference is not None:
            self.servers["reference"] = self.shared_reference
        elif self.reference:
            self.servers["reference"] = self.reference_engine()
        for name in self.prefill_names:
            kv_p = self.kv_ports[name] = free_port_range(max(4, self.p_tp * self.p_dp))
            p_extra = {"peer_tp_size": self.d_tp, "host": self.host(name),
                       "data_plane": self.data_plane, **self.p_extra}
            kv_pc = kv_transfer_config("kv_producer", kv_p, name, p_extra)
            if self.multi_connector:
                kv_pc = in_multi_connector(kv_pc)
            self.servers[name] = self._engine(name, 0, kv_pc, self.p_tp, self.p_dp)
        kv_dc = kv_transfer_config("kv_consumer", kv_d, "decode", d_extra, self.policy)
        if self.multi_connector:
            kv_dc = in_multi_connector(kv_dc)
        self.servers["decode"] = self._engine("decode", 1, kv_dc, self.d_tp, self.d_dp)
        engines = list(self.servers.values())
        for s in engines:
            if s is not self.shared_reference:
                s.start()
        try:
            wait_ready(engines, timeout)
            self.warm_up(timeout)
            self.start_proxy()
        except BaseException:
            self.stop()
            raise

    def warm_up(self, timeout: float) -> None:
        """One plain completion on each engine (no transfer): a TP engine's first forward on a
        busy CPU can take longer than a transfer deadline (lazy imports, shared-memory setup)."""
        import httpx

        def one(server: Server) -> None:
            body = {"model": MODEL_NAME, "prompt": make_prompt(12, seed=-1), "max_tokens": 1}
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=timeout)
            if r.status_code != 200:
                raise RuntimeError(f"{server.name} warm-up answered {r.status_code}: "
                                   f"{r.text[:300]}\n{server.tail()}")

        # Not the reference: without lw's connector nothing asks for AMX permission, and a
        # one-token prompt is what kills vllm-cpu's worker with SIGILL on AMX machines.
        engines = [self.servers[n] for n in (*self.prefill_names, "decode")]
        with ThreadPoolExecutor(len(engines)) as pool:
            list(pool.map(one, engines))

    def start_proxy(self, timeout: float = 60.0) -> None:
        """(Re)start the proxy in front of the prefill and decode servers."""
        old = self.servers.pop("proxy", None)
        if old is not None:
            old.stop()
        port = free_port()
        control = next(p for p in iter(free_port, None) if p != port)
        env = dict(os.environ, PYTHONUNBUFFERED="1", LW_CLUSTER_KEY=self.cluster_key)
        # D calls the metaserver on the proxy's control port at the proxy's address: one D
        # can reach
        host = self.host("proxy")
        prefills = [a for n in self.prefill_names for a in ("--prefill", self.servers[n].url)]
        argv = [sys.executable, "-m", "lw.proxy.server", *prefills,
                "--decode", self.servers["decode"].url,
                "--host", host, "--port", str(port), "--control-host", host,
                "--control-port", str(control), "--timeout", "120", "--log-level", "warning",
                *self.proxy_args]
        proxy = Server("proxy", argv, env, f"http://{host}:{port}",
                       self.workdir / "proxy.log", own_session=self.own_sessions)
        proxy.start()
        self.servers["proxy"] = proxy
        self.control_url = f"http://{host}:{control}"
        wait_ready([proxy], timeout)

    def status_workers(self) -> list[str]:
        """Side-channel addresses of every P and D worker (what ``lw status --workers`` takes)."""
        out = []
        sides = [(name, self.p_tp * self.p_dp) for name in self.prefill_names]
        for name, n in [*sides, ("decode", self.d_tp * self.d_dp)]:
            out += worker_addrs(self.host(name), self.kv_ports[name], n)  # consecutive ports
        return out

    def url(self, name: str) -> str:
        """Base URL of a server."""
        return self.servers[name].url

    def stop(self) -> None:
        """Stop everything this cluster started (proxy first)."""
        for name in ("proxy", "decode", *self.prefill_names, "reference"):
            s = self.servers.get(name)
            if s is not None and s is not self.shared_reference:
                s.stop()

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
