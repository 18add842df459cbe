"""Measuring the cluster while ``lw hostile`` runs: the canary listener, the processes' RSS and
CPU, the engines', proxy's and sidecar's counters, /health, the access logs and the honest
request."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from lw.lab.hostile.client import post
from lw.lab.hostile.table import MB, clip


# ------------------------------------------------------------------------------ the canary
class Canary:
    """An HTTP listener on loopback that records every connection and request (and answers
    418), so that any call a hostile parameter makes is seen."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.connections = 0
        self.requests: list[tuple[str, str, int]] = []  # (method, path, body bytes)
        canary = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 5  # a peer that is not HTTP holds no thread for long

            def _any(self) -> None:
                n = 0
                try:
                    n = min(int(self.headers.get("content-length") or 0), MB)
                    self.rfile.read(n)
                except (ValueError, OSError):
                    pass
                with canary.lock:
                    canary.requests.append((self.command, self.path, n))
                body = b'{"error": {"message": "canary: nothing should call here"}}'
                self.send_response(418)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _any

            def log_message(self, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def verify_request(self, request: Any, client_address: Any) -> bool:
                with canary.lock:
                    canary.connections += 1
                return True

        self.server = Server(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> None:
        """Listen (in a thread)."""
        self.thread.start()

    def count(self) -> int:
        """Connections accepted so far."""
        with self.lock:
            return self.connections

    def stop(self) -> None:
        """Stop listening."""
        self.server.shutdown()
        self.server.server_close()


# ------------------------------------------------------------------------------ RSS and CPU
def rss_kb(pid: int) -> int:
    """A process's resident set (VmRSS), KiB; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def cpu_s(pid: int) -> float:
    """A process's CPU time so far (user + system, all threads), seconds; 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


class RssSampler:
    """The peak of a process's RSS while a case runs (sampled every 10 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss_kb(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while self.pid and not self._stop.wait(0.01):
            self.peak = max(self.peak, rss_kb(self.pid))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)
        self.peak = max(self.peak, rss_kb(self.pid))


# ------------------------------------------------------------------------------ the cluster
@dataclass
class Context:
    """Where the cluster listens, and what the cases need to know of it."""

    public: str
    control: str
    decode: str
    prefill: str
    canary: Canary
    proxy_pid: int
    model: str
    decode_kv_port: int
    logs: Path
    decode_pid: int = 0  # the engines' API server processes
    prefill_pid: int = 0
    timeout: float = 60.0
    # ``lw proxy --sidecar`` in front of D (allowlist: only P): its port, control port, process
    sidecar: str = ""
    sidecar_control: str = ""
    sidecar_pid: int = 0


# ------------------------------------------------------------------------------ readings
def proxy_counters(control: str) -> dict[str, Any]:
    """The proxy's (or the sidecar's) control ``/metrics-json``; {} if it does not answer."""
    import httpx

    try:
        return dict(httpx.get(control + "/metrics-json", timeout=10.0).json())
    except (httpx.HTTPError, ValueError, TypeError):
        return {}


def _metrics(url: str) -> dict[str, float]:
    import httpx

    from lw.lab.demo_client import metrics

    try:
        return metrics(url)
    except httpx.HTTPError:
        return {}


def snapshot(ctx: Context) -> dict[str, Any]:
    """Engine metrics, the proxy's and the sidecar's counters and the canary's count, now."""
    return {"d": _metrics(ctx.decode), "p": _metrics(ctx.prefill),
            "proxy": proxy_counters(ctx.control),
            "sidecar": proxy_counters(ctx.sidecar_control) if ctx.sidecar_control else {},
            "canary": ctx.canary.count()}


def healthy(ctx: Context) -> tuple[bool, str]:
    """Whether D, P, the proxy and the sidecar (if any) answer /health with 200 (and which did
    not)."""
    import httpx

    bad = []
    servers = [("D", ctx.decode), ("P", ctx.prefill), ("proxy", ctx.public)]
    if ctx.sidecar:
        servers.append(("sidecar", ctx.sidecar))
    for name, url in servers:
        try:
            code = httpx.get(url + "/health", timeout=10.0).status_code
        except httpx.HTTPError as exc:
            code = type(exc).__name__
        if code != 200:
            bad.append(f"{name} /health {code}")
    return not bad, "; ".join(bad)


def flush(ctx: Context) -> None:
    """One plain one-token request on each engine (no transfer parameters): a step that
    reports the connectors' counters of what came before."""
    from lw.lab.demo_client import make_prompt

    body = {"model": ctx.model, "prompt": make_prompt(8, seed=-2), "max_tokens": 1}
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda u: post(u + "/v1/completions", body, timeout=ctx.timeout),
                      (ctx.decode, ctx.prefill)))


def settle(ctx: Context) -> None:
    """Let the engines report what they did so far: a pause (P's acknowledgements arrive after
    D's answer), a plain step on each, a pause (the stats reach /metrics)."""
    time.sleep(0.5)
    flush(ctx)
    time.sleep(0.5)


def honest(ctx: Context, seed: int, url: str = "") -> tuple[bool, str]:
    """An honest request through the proxy (or ``url``: the sidecar) succeeds."""
    from lw.lab.demo_client import complete, make_prompt

    r = complete(url or ctx.public, make_prompt(12, seed=seed), max_tokens=2, stream=False,
                 timeout=ctx.timeout)
    ok = not r.error and r.finish_reason is not None
    return ok, "" if ok else f"honest: {clip(r.error, 80)}"


def health_probes(logs: Path) -> tuple[int, int]:
    """``GET /health`` lines in D's and P's logs (vLLM's access log)."""
    out = []
    for name in ("decode", "prefill"):
        try:
            out.append((logs / f"{name}.log").read_text(errors="replace").count(
                '"GET /health'))
        except OSError:
            out.append(0)
    return out[0], out[1]


def _live(url: str) -> float:
    return _metrics(url).get("lw_live_requests", 0.0)


def wait_live_zero(url: str, timeout: float = 30.0) -> float:
    """D's lw_live_requests once it is 0 or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        live = _live(url)
        if live == 0 or time.monotonic() > deadline:
            return live
        time.sleep(0.5)
