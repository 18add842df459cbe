"""End-to-end tests of the D-first proxy against fake prefill and decode servers (no vLLM).

Every server (proxy, fake P, fake D) is a uvicorn server on a free loopback port in its own thread.
The fake D behaves like a decode node with an lw connector: it posts to the proxy's metaserver,
waits until the fake P has served the prefill for that transfer, then answers. Prompt keywords
steer the fakes: ``hang`` (P never answers), ``fail`` (P answers 500), ``slowfail`` (P fails after
0.3 s), ``early`` (D streams one chunk before waiting for the prefill), ``nowait`` (D does not wait
for the prefill), ``dhang`` (D never answers), ``twice`` (D posts to the metaserver twice),
``local`` (D computes the prompt itself: no post), ``<D name>down`` / ``<D name>postdown`` /
``<D name>middown`` (that decode server answers 500 at once / after posting to the metaserver /
dies after streaming its first token), ``slowpost`` (D posts 0.5 s after receiving
the request), ``extra`` (D posts one sub-transfer more than the request allows), ``alien`` (D
also posts a sub-transfer id of another transfer). D signs its calls with the cluster key.
Like vLLM, the fake D makes one sub-request per prompt of a ``prompt`` list and per ``n``
(sub-transfer ``<id>@<k>``) and posts one character code per "token"; the fake P reads its
keywords back from those ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import httpx  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, Response, StreamingResponse  # noqa: E402

from lw.contract.auth import signed_call  # noqa: E402
from lw.contract.params import (  # noqa: E402
    CONTRACT_VERSION,
    decode_params_for_decoder,
    decode_params_for_prefiller,
    prompt_digest,
)
from lw.contract.worker_addrs import PREFILL_WORKERS_KEY  # noqa: E402
from lw.proxy.server import (  # noqa: E402
    build_apps,
    build_decode_body,
    build_prefill_body,
    main,
    normalize_url,
    validate_request,
)

TOKENS = [" t0", " t1", " t2"]
KEY = b"proxy-test-cluster-key-0123456789"
D_PARAMS = {"remote_host": "127.0.0.1", "remote_port": 5555, "remote_block_ids": [3, 4],
            "remote_dp_rank": 0, "remote_tp_size": 2, "remote_engine_id": "d",
            "lw_geometry": "g", "lw_params_version": CONTRACT_VERSION, "remote_first_block": 0}


def d_params(ids: list[int], **kw: Any) -> dict[str, Any]:
    """A decode engine's params of a metaserver call for the prompt ``ids``."""
    return {**D_PARAMS, "lw_prompt_digest": prompt_digest(ids), **kw}


def unsigned(params: dict[str, Any], role: str, key: bytes | None = KEY) -> dict[str, Any]:
    """``params`` without the proxy's version and signature, once they are checked."""
    check = decode_params_for_decoder if role == "decode" else decode_params_for_prefiller
    check(key, params)
    return {k: v for k, v in params.items() if k not in ("lw_sig", "lw_contract")}


# ---------------------------------------------------------------------------------------------
# Fakes


@dataclass
class World:
    """What the fake servers saw, shared across their threads."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    events: list[tuple[str, str, str]] = field(default_factory=list)
    bodies: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    headers: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    prefill_done: set[str] = field(default_factory=set)
    meta_replies: dict[str, list[tuple[int, dict[str, Any]]]] = field(default_factory=dict)
    release: threading.Event = field(default_factory=threading.Event)
    key: bytes | None = None  # the cluster key the fake D signs its metaserver calls with

    def record(self, kind: str, server: str, tid: str) -> None:
        with self.lock:
            self.events.append((kind, server, tid))

    def has(self, kind: str, server: str | None = None, tid: str | None = None) -> bool:
        with self.lock:
            return any(k == kind and server in (None, s) and tid in (None, t)
                       for k, s, t in self.events)

    def servers(self, kind: str) -> list[str]:
        with self.lock:
            return [s for k, s, _ in self.events if k == kind]

    def tids(self, kind: str) -> list[str]:
        with self.lock:
            return [t for k, _, t in self.events if k == kind]


def wait_for(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``pred`` until true; fail the test after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached in time")


def _prompt(body: dict[str, Any]) -> str:
    if "prompt" in body:
        prompt = body["prompt"]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return "".join(chr(t) for t in prompt)  # the fake D's "token ids"
        return " ".join(prompt) if isinstance(prompt, list) else str(prompt)
    return " ".join(str(m.get("content", "")) for m in body.get("messages", []))


def _sub_prompts(body: dict[str, Any]) -> list[str]:
    """The prompts of the vLLM requests D makes of ``body`` (one per list item and per n)."""
    prompt = body.get("prompt")
    texts = list(prompt) if isinstance(prompt, list) else [_prompt(body)]
    return [t for t in texts for _ in range(int(body.get("n", 1)))]


async def _poll_until(request: Request, cond: Callable[[], bool], deadline_s: float) -> str:
    """Wait for ``cond``: 'ok', 'disconnected' or 'deadline'."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if cond():
            return "ok"
        if await request.is_disconnected():
            return "disconnected"
        await asyncio.sleep(0.01)
    return "deadline"


def fake_prefill(name: str, world: World) -> FastAPI:
    """A prefill server: records the request, marks the transfer's KV as sent, answers."""
    app = FastAPI()

    async def serve(request: Request) -> Response:
        body = await request.json()
        tid = body["kv_transfer_params"]["transfer_id"]
        with world.lock:
            world.bodies[("p", tid)] = body
            world.headers[("p", tid)] = dict(request.headers)
        world.record("p_request", name, tid)
        prompt = _prompt(body)
        if "slowfail" in prompt:
            await asyncio.sleep(0.3)
            world.record("p_failed", name, tid)
            return JSONResponse({"error": "slow boom"}, 500)
        if "fail" in prompt:
            world.record("p_failed", name, tid)
            return JSONResponse({"error": "boom"}, 500)
        if "hang" in prompt and "dhang" not in prompt:
            outcome = await _poll_until(request, world.release.is_set, 30)
            if outcome == "disconnected":
                world.record("p_cancelled", name, tid)
                return Response(status_code=499)
        with world.lock:
            world.prefill_done.add(tid)
        world.record("p_done", name, tid)
        workers: Any = [f"tcp://127.0.0.1:{6000 + int(name[1:])}"]
        if "badworkers" in prompt:
            workers = ["tcp://127.0.0.1:99999", "not an address", 7, "tcp://h:1;rm -rf"]
        return JSONResponse({"id": "cmpl-" + tid, "choices": [{"index": 0, "text": "x"}],
                             "kv_transfer_params": {PREFILL_WORKERS_KEY: workers}})

    app.post("/v1/completions")(serve)
    app.post("/v1/chat/completions")(serve)
    app.get("/health")(lambda: world.record("health", name, "") or {"ok": True})
    return app


def fake_decode(name: str, world: World, deadline_s: float = 5.0) -> FastAPI:
    """A decode server: calls the metaserver, waits for the prefill, then answers or streams."""
    app = FastAPI()

    async def serve(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            if isinstance(body, dict) and "kv_transfer_params" not in body and _prompt(body):
                return alone(body)  # no P/D (a sidecar with no prefill server named)
            params = body["kv_transfer_params"]
        except (ValueError, TypeError, KeyError) as exc:  # what the proxy relays unrouted
            world.record("d_relayed", name, "")
            return JSONResponse({"error": {"message": f"fake vLLM refuses: {exc!r}",
                                           "type": "BadRequestError", "param": None,
                                           "code": 400}}, 400)
        tid = params["transfer_id"]
        with world.lock:
            world.bodies[("d", tid)] = body
            world.headers[("d", tid)] = dict(request.headers)
        world.record("d_request", name, tid)
        prompt = _prompt(body)
        if f"{name}down" in prompt:  # this decode server fails before doing anything
            world.record("d_failed", name, tid)
            return JSONResponse({"error": {"message": "engine dead"}}, 500)
        if "dhang" in prompt:
            if await _poll_until(request, world.release.is_set, 30) == "disconnected":
                world.record("d_cancelled", name, tid)
            return Response(status_code=499)
        subs = {f"{tid}@{k}": text for k, text in enumerate(_sub_prompts(body))}
        if "local" in prompt:
            subs = {}
        if "slowpost" in prompt:  # leaves an attacker time to post first
            world.record("d_allocated", name, tid)
            await asyncio.sleep(0.5)
        if "extra" in prompt:  # one sub-transfer more than n x prompts allows
            subs[f"{tid}@{len(subs)}"] = "extra"
        if "alien" in prompt:  # a sub-transfer id that is not of this transfer
            subs["f" * 32 + "@0"] = "alien"
        async with httpx.AsyncClient(timeout=5) as client:
            for sub, text in subs.items():
                ids = [ord(ch) for ch in text]
                msg = {"transfer_id": tid, "sub_transfer_id": sub, "prompt_token_ids": ids,
                       "kv_transfer_params": d_params(ids, remote_engine_id=name),
                       "grant": params["metaserver_grant"]}
                for _ in range(2 if "twice" in prompt else 1):
                    content, headers = signed_call(world.key, msg)
                    r = await client.post(params["metaserver"], content=content,
                                          headers=headers)
                    with world.lock:
                        world.meta_replies.setdefault(sub, []).append((r.status_code, r.json()))

        if f"{name}postdown" in prompt:  # fails after asking for the prefill
            world.record("d_failed", name, tid)
            return JSONResponse({"error": {"message": "engine died"}}, 500)

        def prefilled() -> bool:
            with world.lock:
                return "nowait" in prompt or all(sub in world.prefill_done for sub in subs
                                                 if world.meta_replies[sub][-1][0] == 202)

        if not body.get("stream"):
            outcome = await _poll_until(request, prefilled, deadline_s)
            if outcome == "disconnected":
                world.record("d_cancelled", name, tid)
                return Response(status_code=499)
            if outcome == "deadline":
                world.record("d_deadline", name, tid)
                return JSONResponse({"error": "prefill never arrived"}, 500)
            world.record("d_done", name, tid)
            return JSONResponse({"id": "cmpl-" + tid, "server": name,
                                 "choices": [{"index": 0, "text": "".join(TOKENS)}]})

        async def events() -> AsyncIterator[bytes]:
            try:
                if "early" in prompt:
                    yield b'data: {"choices": [{"index": 0, "text": ""}]}\n\n'
                end = time.monotonic() + deadline_s
                while not prefilled():
                    if time.monotonic() > end:
                        world.record("d_deadline", name, tid)
                        yield b'data: {"error": {"message": "prefill never arrived"}}\n\n'
                        return
                    await asyncio.sleep(0.01)
                for tok in TOKENS:
                    chunk = {"id": "cmpl-" + tid, "choices": [{"index": 0, "text": tok}]}
                    yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
                    await asyncio.sleep(0.01)
                    if f"{name}middown" in prompt:  # dies after the first token went out
                        world.record("d_failed", name, tid)
                        raise RuntimeError("decode engine died mid-stream")
                yield b"data: [DONE]\n\n"
                world.record("d_done", name, tid)
            except (asyncio.CancelledError, GeneratorExit):
                world.record("d_cancelled", name, tid)
                raise

        return StreamingResponse(events(), media_type="text/event-stream")

    def alone(body: dict[str, Any]) -> Response:
        """The prompt computed here, as a vLLM server without P/D answers it."""
        world.record("d_alone", name, _prompt(body))
        if not body.get("stream"):
            return JSONResponse({"id": "cmpl-alone", "server": name,
                                 "choices": [{"index": 0, "text": "".join(TOKENS)}]})
        chunks = [b"data: " + json.dumps({"choices": [{"index": 0, "text": tok}]}).encode()
                  + b"\n\n" for tok in TOKENS]
        return StreamingResponse(iter([*chunks, b"data: [DONE]\n\n"]),
                                 media_type="text/event-stream")

    async def tokenize(request: Request) -> JSONResponse:
        body = await request.json()
        return JSONResponse({"tokens": [ord(ch) for ch in body["prompt"]], "server": name,
                             "query": request.url.query})

    app.post("/v1/completions")(serve)
    app.post("/v1/chat/completions")(serve)
    app.get("/health")(lambda: world.record("health", name, "") or {"ok": True})
    app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "tiny", "server": name}]})
    app.get("/metrics")(lambda: Response(f"fake_vllm_up{{server=\"{name}\"}} 1\n",
                                         media_type="text/plain"))
    app.post("/tokenize")(tokenize)
    return app


class ServerThread:
    """A uvicorn server for ``app`` on a free loopback port, run in a daemon thread."""

    def __init__(self, app: Any, also: tuple[ServerThread, Any] | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        if app is None:  # only a port, for ``also`` (known before its app is built)
            return
        # ``also``: a second app served by the same event loop (the proxy's control plane
        # shares the public app's state, HTTP client and tasks, as in ``lw proxy``).
        self.pairs = [(app, self.sock)] + ([(also[1], also[0].sock)] if also else [])
        self.servers = [uvicorn.Server(uvicorn.Config(a, log_level="warning",
                                                      timeout_graceful_shutdown=1,
                                                      lifespan="on")) for a, _ in self.pairs]
        self.server = self.servers[0]
        self.others = [also[0]] if also else []
        self.thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        await asyncio.gather(*(srv.serve(sockets=[sock])
                               for srv, (_, sock) in zip(self.servers, self.pairs, strict=True)))

    def start(self) -> ServerThread:
        self.thread.start()
        wait_for(lambda: all(s.started for s in self.servers), timeout=10)
        return self

    def stop(self) -> None:
        for s in self.servers:
            s.should_exit = True
        self.thread.join(timeout=5)
        for t in [self, *self.others]:
            t.sock.close()


def closed_port_url() -> str:
    """A loopback URL nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@dataclass
class Cluster:
    """Proxy + fakes, and what the fakes saw."""

    url: str
    control: str  # the control plane's base URL
    world: World
    prefill_urls: list[str]
    decode_urls: list[str]
    servers: list[ServerThread]

    def metrics(self) -> dict[str, Any]:
        return httpx.get(self.control + "/metrics-json", timeout=5).json()


@contextlib.contextmanager
def cluster(n_prefill: int = 1, n_decode: int = 1, *, prefill_urls: list[str] | None = None,
            decode_urls: list[str] | None = None, d_deadline_s: float = 5.0,
            dead_decodes: int = 0, **proxy_kwargs: Any) -> Iterator[Cluster]:
    """Start fakes (unless URLs are given) and a proxy in front of them; ``dead_decodes``
    addresses nobody listens on go first in the decode list."""
    world = World()
    servers: list[ServerThread] = []
    try:
        if prefill_urls is None:
            ps = [ServerThread(fake_prefill(f"p{i}", world)).start() for i in range(n_prefill)]
            servers += ps
            prefill_urls = [s.url for s in ps]
        if decode_urls is None:
            ds = [ServerThread(fake_decode(f"d{i}", world, d_deadline_s)).start()
                  for i in range(n_decode)]
            servers += ds
            decode_urls = [s.url for s in ds]
        decode_urls = [closed_port_url() for _ in range(dead_decodes)] + decode_urls
        proxy_kwargs.setdefault("timeout_s", 10.0)
        # the fakes here are D-first P and D servers (tests/proxy/test_ahead.py's P goes ahead)
        proxy_kwargs.setdefault("start_mode", "d-first")
        proxy_kwargs.setdefault("cluster_key", KEY)
        world.key = proxy_kwargs["cluster_key"]
        control = ServerThread(None)
        apps = build_apps(prefill_urls, decode_urls,
                          metaserver_url=control.url + "/v1/metaserver", **proxy_kwargs)
        proxy = ServerThread(apps.public, also=(control, apps.control)).start()
        servers.append(proxy)
        yield Cluster(proxy.url, control.url, world, prefill_urls, decode_urls, servers)
    finally:
        world.release.set()
        for s in servers:
            for srv in s.servers:
                srv.should_exit = True
        for s in servers:
            s.stop()


def completion(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 8, **extra}


def request_error(r: httpx.Response, stream: bool) -> dict[str, Any]:
    """The error a failed request reports: its JSON body, or (a stream whose head was already
    sent when the failure came) the stream's final SSE event."""
    if not stream or r.status_code != 200:
        assert r.status_code == 502, r.text
        return dict(r.json()["error"])
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    last = json.loads(events[-1])
    assert "error" in last, r.text
    return dict(last["error"])


def lw_detail(err: dict[str, Any]) -> dict[str, str]:
    """lw's details at the end of a proxy error's message (``[lw proxy: stage=..., ...]``), the
    rest of the body being vLLM's shape."""
    assert set(err) == {"message", "type", "param", "code"}, err
    tail = err["message"].rsplit("[lw proxy: ", 1)[1].rstrip("]")
    return dict(part.split("=", 1) for part in tail.split(", "))


def sse_text(raw: str) -> str:
    """Concatenated ``text`` of the SSE events in ``raw``."""
    out = []
    for line in raw.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[len("data: "):])
            for choice in event.get("choices", []):
                out.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(out)


# ---------------------------------------------------------------------------------------------
# Pure helpers


def test_build_prefill_body_token_ids_one_token_no_stream_merged_params() -> None:
    body = {"model": "m", "prompt": ["hi", "yo"], "max_tokens": 50, "stream": True, "n": 3,
            "min_tokens": 3, "stream_options": {"include_usage": True}, "temperature": 1,
            "cache_salt": "s"}
    out = build_prefill_body(body, {**d_params([5, 6, 7]), "do_remote_prefill": True}, "tid@1",
                             [5, 6, 7], key=KEY)
    out["kv_transfer_params"] = unsigned(out["kv_transfer_params"], "prefill")
    # the sampling fields that decide token 1 go to P (min_tokens capped at P's one token)
    assert out == {"model": "m", "prompt": [5, 6, 7], "max_tokens": 1, "n": 1, "stream": False,
                   "cache_salt": "s", "temperature": 1, "min_tokens": 1,
                   "kv_transfer_params": {**d_params([5, 6, 7]), "do_remote_decode": True,
                                          "do_remote_prefill": False, "transfer_id": "tid@1"}}
    assert body["max_tokens"] == 50 and body["stream"] is True  # input untouched
    chat = build_prefill_body({"model": "m", "messages": [], "max_completion_tokens": 9}, {}, "t",
                              [1])
    assert chat["prompt"] == [1] and "messages" not in chat and "max_completion_tokens" not in chat


def test_build_decode_body_sets_proxy_params() -> None:
    out = build_decode_body({"model": "m", "prompt": "p"}, "rid", "http://x/v1/metaserver",
                            "g" * 32, KEY)
    assert unsigned(out["kv_transfer_params"], "decode") == {
        "do_remote_prefill": True, "do_remote_decode": False,
        "metaserver": "http://x/v1/metaserver", "transfer_id": "rid",
        "metaserver_grant": "g" * 32}


def test_normalize_url() -> None:
    assert normalize_url("127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert normalize_url("http://h:1/v1/") == "http://h:1"
    assert normalize_url(" https://h:1/ ") == "https://h:1"


@pytest.mark.parametrize(
    "api,body,fragment",
    [
        ("/v1/completions", [1, 2], "JSON object"),
        ("/v1/completions", {"model": 3, "prompt": "x"}, "'model'"),
        ("/v1/completions", {"model": "m"}, "'prompt'"),
        ("/v1/completions", {"model": "m", "prompt": 3}, "'prompt'"),
        ("/v1/chat/completions", {"model": "m", "prompt": "x"}, "'messages'"),
        ("/v1/completions", {"model": "m", "prompt": "x", "stream": "yes"}, "'stream'"),
    ],
)
def test_validate_request_rejects(api: str, body: Any, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        validate_request(api, body)


def test_main_rejects_wildcard_control_host_without_metaserver_url(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--prefill", "h:1", "--decode", "h:2", "--control-host", "0.0.0.0",
              "--insecure-trusted-network"])
    assert "--metaserver-url" in capsys.readouterr().err


def test_main_keeps_the_control_plane_off_the_public_port(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--prefill", "h:1", "--decode", "h:2", "--port", "8000", "--control-port", "8000",
              "--insecure-trusted-network"])
    assert "own address or port" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# End to end


def test_non_stream_flow() -> None:
    with cluster() as c:
        r = httpx.post(c.url + "/v1/completions", json=completion("hello world"), timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "".join(TOKENS)
        rid = r.headers["x-request-id"]
        w = c.world
        d_body, p_body = w.bodies[("d", rid)], w.bodies[("p", rid + "@0")]
        grant = d_body["kv_transfer_params"]["metaserver_grant"]
        assert unsigned(d_body["kv_transfer_params"], "decode") == {
            "do_remote_prefill": True, "do_remote_decode": False,
            "metaserver": c.control + "/v1/metaserver", "transfer_id": rid,
            "metaserver_grant": grant}
        assert len(grant) == 32 and grant not in r.text and grant not in str(r.headers)
        assert w.headers[("d", rid)]["x-request-id"] == rid
        assert w.headers[("p", rid + "@0")]["x-request-id"] == rid
        assert p_body["max_tokens"] == 1 and p_body["stream"] is False and p_body["n"] == 1
        assert p_body["prompt"] == [ord(ch) for ch in "hello world"]
        assert unsigned(p_body["kv_transfer_params"], "prefill") == {
                                                **d_params(p_body["prompt"]),
                                                "remote_engine_id": "d0",
                                                "do_remote_decode": True,
                                                "do_remote_prefill": False,
                                                "transfer_id": rid + "@0"}
        [(status, reply)] = w.meta_replies[rid + "@0"]
        assert status == 202
        assert reply["status"] == "ok" and reply["prefill_url"] == c.prefill_urls[0]
        m = c.metrics()
        assert m["requests"] == 1 and m["errors"] == 0 and m["in_flight"] == 0
        assert m["decode"][0]["requests"] == 1 and m["decode"][0]["in_flight"] == 0
        assert m["prefill"][0]["requests"] == 1 and m["metaserver_calls"] == 1
        assert m["prefills"] == 1


def test_stream_flow_passes_sse_through() -> None:
    with cluster() as c:
        body = completion("hello", stream=True, min_tokens=2,
                          stream_options={"include_usage": True})
        with httpx.stream("POST", c.url + "/v1/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            raw = r.read().decode()
            rid = r.headers["x-request-id"]
        assert sse_text(raw) == "".join(TOKENS)
        assert raw.rstrip().endswith("data: [DONE]")
        p_body = c.world.bodies[("p", rid + "@0")]
        assert p_body["max_tokens"] == 1 and p_body["stream"] is False
        # P computes one token: min_tokens capped at it (for token 1 the stop ids are masked)
        assert p_body["min_tokens"] == 1 and "stream_options" not in p_body
        d_body = c.world.bodies[("d", rid)]
        assert d_body["stream"] is True and d_body["min_tokens"] == 2
        assert c.world.has("d_done", tid=rid)
        seen = httpx.get(c.control + "/lw/timeline", timeout=5).json()
        whole, sub = seen[rid], seen[rid + "@0"]
        assert list(whole) == ["received", "d_sent", "first_token", "end"]
        assert sorted(whole.values()) == list(whole.values())
        assert set(sub) == {"meta_posted", "p_sent", "p_done"}
        assert whole["d_sent"] <= sub["meta_posted"] <= sub["p_sent"] <= sub["p_done"]


def test_chat_stream_flow() -> None:
    with cluster() as c:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}],
                "max_completion_tokens": 5, "stream": True}
        with httpx.stream("POST", c.url + "/v1/chat/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            raw = r.read().decode()
            rid = r.headers["x-request-id"]
        assert sse_text(raw) == "".join(TOKENS)
        p_body = c.world.bodies[("p", rid + "@0")]
        assert p_body["max_tokens"] == 1 and "max_completion_tokens" not in p_body
        assert p_body["prompt"] == [ord(ch) for ch in "hello"] and "messages" not in p_body


def test_client_kv_transfer_params_are_replaced() -> None:
    with cluster() as c:
        body = completion("hello", kv_transfer_params={"do_remote_prefill": False, "x": 1})
        r = httpx.post(c.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 200
        params = c.world.bodies[("d", r.headers["x-request-id"])]["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and "x" not in params


def test_least_loaded_decode_and_prefill() -> None:
    with cluster(n_prefill=2, n_decode=2) as c:
        w = c.world
        results: dict[str, Any] = {}

        def busy() -> None:
            results["busy"] = httpx.post(c.url + "/v1/completions", json=completion("hang"),
                                         timeout=20)

        t = threading.Thread(target=busy)
        t.start()
        wait_for(lambda: len(w.servers("p_request")) == 1)
        busy_d, busy_p = w.servers("d_request")[0], w.servers("p_request")[0]
        m = c.metrics()
        assert sum(d["in_flight"] for d in m["decode"]) == 1
        assert sum(p["in_flight"] for p in m["prefill"]) == 1
        for _ in range(3):
            r = httpx.post(c.url + "/v1/completions", json=completion("ok"), timeout=10)
            assert r.status_code == 200
        assert w.servers("d_request")[1:] == [d for d in ["d0", "d1"] if d != busy_d] * 3
        assert w.servers("p_request")[1:] == [p for p in ["p0", "p1"] if p != busy_p] * 3
        w.release.set()
        t.join(10)
        assert results["busy"].status_code == 200
        wait_for(lambda: c.metrics()["in_flight"] == 0)


def test_decode_unreachable_gives_502_quickly() -> None:
    dead = closed_port_url()
    with cluster(decode_urls=[dead]) as c:
        t0 = time.monotonic()
        r = httpx.post(c.url + "/v1/completions", json=completion("hello"), timeout=10)
        assert time.monotonic() - t0 < 3
        assert r.status_code == 502
        err = r.json()["error"]
        # the client learns the server's role and place, never its URL (that is logged)
        assert lw_detail(err)["stage"] == "decode" and lw_detail(err)["server"] == "decode#0"
        assert dead not in r.text and "unreachable" in err["message"]
        m = c.metrics()
        assert m["errors"] == 1 and m["decode"][0]["errors"] == 1 and m["in_flight"] == 0


def test_decode_timeout_gives_504_and_cancels_decode() -> None:
    with cluster(timeout_s=0.5) as c:
        t0 = time.monotonic()
        r = httpx.post(c.url + "/v1/completions", json=completion("dhang"), timeout=10)
        assert time.monotonic() - t0 < 3
        assert r.status_code == 504
        assert r.json()["error"]["type"] == "GatewayTimeoutError"
        assert r.json()["error"]["code"] == 504
        wait_for(lambda: c.world.has("d_cancelled"))


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_failure_reaches_client_and_cancels_decode(stream: bool) -> None:
    with cluster() as c:
        r = httpx.post(c.url + "/v1/completions", json=completion("fail", stream=stream),
                       timeout=10)
        err = request_error(r, stream)
        assert lw_detail(err) | {"request": ""} == {"stage": "prefill", "request": "",
                                                    "server": "prefill#0"}
        assert "HTTP 500" in err["message"] and c.prefill_urls[0] not in r.text
        wait_for(lambda: c.world.has("d_cancelled"))
        assert not c.world.has("d_deadline")
        m = c.metrics()
        assert m["prefill_failures"] == 1 and m["prefill"][0]["errors"] == 1
        assert m["in_flight"] == 0


def test_prefill_unreachable_gives_502() -> None:
    dead = closed_port_url()
    with cluster(prefill_urls=[dead]) as c:
        t0 = time.monotonic()
        r = httpx.post(c.url + "/v1/completions", json=completion("hello"), timeout=10)
        assert time.monotonic() - t0 < 3
        assert r.status_code == 502
        err = r.json()["error"]
        assert lw_detail(err)["stage"] == "prefill" and lw_detail(err)["server"] == "prefill#0"
        assert dead not in r.text


def test_stream_headers_come_before_the_prefill_completes() -> None:
    # P holds the prefill ("hang"), so D has no token to send: the head must not wait for it.
    with cluster() as c:
        body = completion("hang", stream=True)
        t0 = time.monotonic()
        with httpx.stream("POST", c.url + "/v1/completions", json=body,
                          timeout=httpx.Timeout(10.0, read=3.0)) as r:
            head_s = time.monotonic() - t0
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["x-request-id"]
            assert not c.world.has("p_done") and not c.world.has("d_done")
            c.world.release.set()
            raw = r.read().decode()
        assert head_s < 2.0
        assert sse_text(raw) == "".join(TOKENS)
        assert raw.rstrip().endswith("data: [DONE]")


def test_prefill_failure_after_stream_head_is_an_sse_error_and_cancels_decode() -> None:
    # P fails after 0.3 s: the head is out by then, D has sent no byte of its answer.
    with cluster() as c:
        body = completion("slowfail", stream=True)
        with httpx.stream("POST", c.url + "/v1/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            assert not c.world.has("p_failed")
            raw = r.read().decode()
        err = json.loads(raw.strip().splitlines()[-1][len("data: "):])["error"]
        assert lw_detail(err) | {"request": ""} == {"stage": "prefill", "request": "",
                                                    "server": "prefill#0"}
        assert "HTTP 500" in err["message"]
        wait_for(lambda: c.world.has("d_cancelled"))
        assert not c.world.has("d_deadline") and not c.world.has("d_done")
        wait_for(lambda: c.metrics()["in_flight"] == 0)
        m = c.metrics()
        assert m["prefill_failures"] == 1 and m["errors"] == 1


def test_late_prefill_failure_after_stream_started_is_ignored() -> None:
    with cluster() as c:
        body = completion("early nowait slowfail", stream=True)
        with httpx.stream("POST", c.url + "/v1/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            raw = r.read().decode()
        assert sse_text(raw) == "".join(TOKENS)
        wait_for(lambda: c.metrics()["prefill_failures"] == 1)


def test_client_disconnect_mid_stream_cancels_decode_and_prefill() -> None:
    with cluster() as c:
        body = completion("early hang", stream=True)
        with httpx.stream("POST", c.url + "/v1/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            chunks = r.iter_bytes()  # keep a reference: dropping the iterator closes the stream
            assert next(chunks).startswith(b"data: ")
            wait_for(lambda: c.world.has("p_request"))
            assert not c.world.has("d_cancelled") and not c.world.has("p_cancelled")
        # leaving the block closed the connection mid-stream
        wait_for(lambda: c.world.has("d_cancelled"))
        wait_for(lambda: c.world.has("p_cancelled"))
        assert not c.world.has("d_done") and not c.world.has("p_done")
        wait_for(lambda: c.metrics()["in_flight"] == 0)
        m = c.metrics()
        assert m["client_disconnects"] == 1
        assert m["decode"][0]["in_flight"] == 0 and m["prefill"][0]["in_flight"] == 0


def test_client_disconnect_non_stream_cancels_decode_and_prefill() -> None:
    with cluster() as c:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(c.url + "/v1/completions", json=completion("hang"), timeout=0.5)
        wait_for(lambda: c.world.has("d_cancelled"))
        wait_for(lambda: c.world.has("p_cancelled"))
        wait_for(lambda: c.metrics()["in_flight"] == 0)
        assert c.metrics()["client_disconnects"] == 1


def test_metaserver_is_idempotent_per_transfer() -> None:
    with cluster() as c:
        r = httpx.post(c.url + "/v1/completions", json=completion("twice"), timeout=10)
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        replies = c.world.meta_replies[rid + "@0"]
        assert [s for s, _ in replies] == [202, 202]
        assert replies[0][1]["prefill_url"] == replies[1][1]["prefill_url"]
        assert "already" in replies[1][1]["detail"]
        assert c.world.tids("p_request") == [rid + "@0"]


def signed_post(url: str, body: Any, key: bytes | None = KEY) -> httpx.Response:
    """POST ``body`` the way D's connector does: signed with ``key``."""
    content, headers = signed_call(key, body)
    return httpx.post(url, content=content, headers=headers, timeout=10)


def test_metaserver_rejects_unknown_and_malformed() -> None:
    with cluster() as c:
        url = c.control + "/v1/metaserver"
        ok = {"transfer_id": "nope", "sub_transfer_id": "nope@0", "prompt_token_ids": [1, 2],
              "kv_transfer_params": d_params([1, 2])}
        r = signed_post(url, ok)
        assert r.status_code == 404 and r.json()["status"] == "error"
        content, headers = signed_call(KEY, "x")
        r = httpx.post(url, content=b"{not json", headers=headers)
        assert r.status_code == 401, "the signature covers the body"
        r = httpx.post(url, content=b"{not json",
                       headers=signed_call(KEY, None)[1] | {"x-lw-signature": "0"})
        assert r.status_code == 401
        for bad, fragment in [
            ({"transfer_id": None}, "transfer_id"),
            ({"sub_transfer_id": None}, "sub_transfer_id"),
            ({"sub_transfer_id": "x" * 257}, "sub_transfer_id"),
            ({"prompt_token_ids": None}, "prompt_token_ids"),
            ({"prompt_token_ids": []}, "prompt_token_ids"),
            ({"prompt_token_ids": [1, "2"]}, "prompt_token_ids"),
            ({"prompt_token_ids": [1, 3]}, "lw_prompt_digest"),  # blocks for another prompt
            ({"kv_transfer_params": [1]}, "kv_transfer_params"),
            ({"kv_transfer_params": None}, "kv_transfer_params"),
            ({"kv_transfer_params": {**d_params([1, 2]), "lw_params_version": 2}},
             "lw_params_version"),
            ({"kv_transfer_params": {**d_params([1, 2]), "remote_port": 0}}, "remote_port"),
            ({"kv_transfer_params": {**d_params([1, 2]), "remote_block_ids": [-1]}},
             "remote_block_ids"),
            ({"kv_transfer_params": {**d_params([1, 2]), "evil": 1}}, "evil"),
            ({"surprise": 1}, "surprise"),
        ]:
            r = signed_post(url, {**ok, **bad})
            assert r.status_code == 400 and fragment in r.json()["detail"], bad


def test_one_prefill_per_sub_transfer_for_n_and_prompt_lists() -> None:
    with cluster(n_prefill=2) as c:
        body = completion(["first", "second"], n=2)
        r = httpx.post(c.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        subs = [f"{rid}@{k}" for k in range(4)]
        assert sorted(c.world.tids("p_request")) == subs
        for sub, text in zip(subs, ["first", "first", "second", "second"], strict=True):
            p_body = c.world.bodies[("p", sub)]
            assert p_body["prompt"] == [ord(ch) for ch in text] and p_body["n"] == 1
            assert p_body["kv_transfer_params"]["transfer_id"] == sub
        # Fewest outstanding first: which server gets each depends on which prefills are done.
        picked = c.world.servers("p_request")
        assert len(picked) == 4 and set(picked) <= {"p0", "p1"}
        m = c.metrics()
        assert m["prefills"] == 4 and m["metaserver_calls"] == 4 and m["in_flight"] == 0
        assert sum(p["in_flight"] for p in m["prefill"]) == 0


@pytest.mark.parametrize("stream", [False, True])
def test_one_failed_sub_prefill_fails_the_request(stream: bool) -> None:
    with cluster() as c:
        body = completion(["fine", "fail"], stream=stream)
        r = httpx.post(c.url + "/v1/completions", json=body, timeout=10)
        err = request_error(r, stream)
        assert lw_detail(err) | {"request": ""} == {"stage": "prefill", "request": "",
                                                    "server": "prefill#0"}
        wait_for(lambda: c.world.has("d_cancelled"))
        wait_for(lambda: c.metrics()["in_flight"] == 0)
        assert c.metrics()["prefill_failures"] == 1


def test_client_disconnect_cancels_every_sub_prefill() -> None:
    with cluster() as c:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(c.url + "/v1/completions", json=completion(["hang", "hang"], n=2),
                       timeout=0.5)
        wait_for(lambda: len(c.world.tids("p_cancelled")) == 4)
        wait_for(lambda: c.metrics()["in_flight"] == 0)
        assert c.metrics()["prefill"][0]["in_flight"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_request_d_computes_itself_needs_no_prefill(stream: bool) -> None:
    with cluster() as c:
        r = httpx.post(c.url + "/v1/completions", json=completion("local", stream=stream),
                       timeout=10)
        assert r.status_code == 200
        assert (sse_text(r.text) if stream else r.json()["choices"][0]["text"]) == "".join(
            TOKENS)
        assert not c.world.has("p_request")
        m = c.metrics()
        assert m["in_flight"] == 0 and m["prefills"] == 0 and m["metaserver_calls"] == 0
        assert m["decode"][0]["in_flight"] == 0 and m["errors"] == 0


def test_the_control_plane_names_the_workers_seen_in_traffic() -> None:
    """D's workers from its signed metaserver calls (rank-0 port + TP rank), P's from its
    prefill responses; malformed addresses are ignored; the public port does not tell."""
    with cluster(n_prefill=2) as c:
        assert httpx.get(c.control + "/lw/workers", timeout=5).json() == {
            "prefill": [], "decode": []}
        for prompt in ("one", "two", "badworkers"):
            r = httpx.post(c.url + "/v1/completions", json=completion(prompt), timeout=10)
            assert r.status_code == 200, r.text
        seen = httpx.get(c.control + "/lw/workers", timeout=5).json()
        assert sorted(seen["prefill"]) == ["tcp://127.0.0.1:6000", "tcp://127.0.0.1:6001"]
        assert seen["decode"] == ["tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556"]
        assert httpx.get(c.url + "/lw/workers", timeout=5).status_code == 404


def test_health_reports_reachability() -> None:
    with cluster() as c:
        r = httpx.get(c.url + "/health", timeout=10)
        assert r.status_code == 200 and r.content == b""  # as vLLM: no server URLs
        r = httpx.get(c.control + "/lw/health", timeout=10)
        assert r.status_code == 200
        h = r.json()
        assert h["status"] == "ok"
        assert [p["reachable"] for p in h["prefill"] + h["decode"]] == [True, True]
    dead = closed_port_url()
    with cluster(decode_urls=[dead]) as c:
        assert httpx.get(c.url + "/health", timeout=10).status_code == 503
        h = httpx.get(c.control + "/lw/health", timeout=10).json()
        assert h["status"] == "degraded"
        assert h["prefill"][0]["reachable"] is True
        assert h["decode"][0] == {**h["decode"][0], "url": dead, "reachable": False}
        assert "error" in h["decode"][0]


def test_models_passthrough() -> None:
    with cluster() as c:
        r = httpx.get(c.url + "/v1/models", timeout=10)
        assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
    with cluster(decode_urls=[closed_port_url()]) as c:
        r = httpx.get(c.url + "/v1/models", timeout=10)
        assert r.status_code == 502 and "error" in r.json()


@pytest.mark.parametrize(
    "path,content",
    [
        ("/v1/completions", json.dumps({"model": "m"}).encode()),
        ("/v1/completions", json.dumps({"model": "m", "prompt": ""}).encode()),
        ("/v1/chat/completions", json.dumps({"model": "m"}).encode()),
        ("/v1/chat/completions", json.dumps({"model": "m", "messages": []}).encode()),
    ],
)
def test_unroutable_input_gets_vllms_own_answer(path: str, content: bytes) -> None:
    """The proxy does not invent errors for bodies it cannot route: D's vLLM answers them."""
    with cluster() as c:
        r = httpx.post(c.url + path, content=content,
                       headers={"content-type": "application/json"}, timeout=10)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["message"].startswith("fake vLLM refuses") and err["type"] == "BadRequestError"
        assert c.world.has("d_relayed") and not c.world.has("d_request")
        m = c.metrics()
        assert m["bad_requests"] == 1 and m["requests"] == 0


EVIL = {"do_remote_prefill": True, "transfer_id": "evil-1",
        "metaserver": "http://127.0.0.1:9/steal"}


@pytest.mark.parametrize("extra", [
    {"stream": None, "kv_transfer_params": EVIL},  # unroutable: relayed to D alone
    {"stream": None, "vllm_xargs": {"kv_transfer_params": EVIL}},
    {"stream": None, "kv_transfer_params": EVIL, "vllm_xargs": {"kv_transfer_params": EVIL}},
    {"kv_transfer_params": EVIL},  # routed: the proxy's own params, signed
    {"vllm_xargs": {"kv_transfer_params": EVIL, "keep": "me"}},
])
def test_a_clients_transfer_params_never_reach_the_decode_server(extra: dict[str, Any]) -> None:
    """The issue's SSRF: a body lw cannot route (``"stream": null``) with the client's own
    ``kv_transfer_params`` went to D raw, and D called the client's URL. On every path the
    client's params are dropped (and counted) before anything is sent."""
    with cluster() as c:
        body = {"model": "m", "prompt": "hello there friend", "max_tokens": 4, **extra}
        r = httpx.post(c.url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 200, r.text
        m = c.metrics()
        assert m["client_transfer_params_dropped"] == 1, m
        with c.world.lock:
            sent = list(c.world.bodies.items())
        for (_role, _tid), got in sent:
            assert "evil" not in json.dumps(got) and "steal" not in json.dumps(got)
        if extra.get("stream", False) is None:
            assert c.world.has("d_alone") and m["relayed_unroutable"] == 1
        if "keep" in json.dumps(extra):
            (d_body,) = [b for (role, _), b in sent if role == "d"]
            assert d_body["vllm_xargs"] == {"keep": "me"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra,field", [
    ({"kv_transfer_params": "x"}, "kv_transfer_params"),
    ({"kv_transfer_params": [1]}, "kv_transfer_params"),
    ({"kv_transfer_params": 7}, "kv_transfer_params"),
    ({"vllm_xargs": {"kv_transfer_params": "x"}}, "vllm_xargs.kv_transfer_params"),
    ({"vllm_xargs": {"kv_transfer_params": ["x"]}}, "vllm_xargs.kv_transfer_params"),
    ({"vllm_xargs": "x"}, "vllm_xargs"),
    ({"stream": None, "vllm_xargs": {"kv_transfer_params": "x"}},
     "vllm_xargs.kv_transfer_params"),
])
def test_a_transfer_field_of_a_wrong_type_is_a_400_naming_it(path: str, extra: dict[str, Any],
                                                             field: str) -> None:
    """Where vLLM would pass a non-object to the connector (an empty 500 before), the proxy
    answers 400 in vLLM's shape with ``param`` naming the field; nothing is sent to D."""
    with cluster() as c:
        body = {"model": "m", "prompt": "p", "messages": [{"role": "user", "content": "p"}],
                **extra}
        r = httpx.post(c.url + path, json=body, timeout=10)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"], err
        assert err["type"] == "BadRequestError"
        assert not c.world.has("d_relayed") and not c.world.has("d_request")
        assert c.metrics()["client_transfer_params_refused"] == 1


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("content,fragment,kind", [
    (b"{not json", "'json_invalid'", "Bad Request"),
    (b'"just a string"', "'model_attributes_type'", "Bad Request"),
    (b"[1, 2]", "'model_attributes_type'", "Bad Request"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON", "BadRequestError"),
    (b'{"prompt": ' + b"[" * 80 + b"]" * 80 + b"}", "deeper than", "BadRequestError"),
    (b"\xff\xfe{}", "'json_invalid'", "Bad Request"),
])
def test_what_is_not_a_json_object_is_refused_by_the_proxy_never_relayed(
        path: str, content: bytes, fragment: str, kind: str) -> None:
    """Bytes that are not a JSON object never go anywhere: a parser more lenient than the
    proxy's must not see what the proxy could not screen (400 in vLLM's shape; where vLLM
    refuses the body too, vLLM's very answer: tests/proxy/test_vllm_error_shape.py)."""
    with cluster() as c:
        r = httpx.post(c.url + path, content=content,
                       headers={"content-type": "application/json"}, timeout=10)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert fragment in err["message"] and err["type"] == kind, err
        assert not c.world.has("d_relayed") and not c.world.has("d_request")
        assert c.metrics()["bad_requests"] == 1


def test_a_body_without_model_is_served_with_the_decode_servers_model() -> None:
    with cluster() as c:
        r = httpx.post(c.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2},
                       timeout=10)
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        assert c.world.bodies[("d", rid)]["model"] == "tiny"
        assert c.world.bodies[("p", rid + "@0")]["model"] == "tiny"


def test_proxy_errors_have_vllms_shape() -> None:
    from lw.proxy.state import error_body, error_type

    assert [error_type(s) for s in (400, 404, 500, 502, 503, 504)] == [
        "BadRequestError", "NotFoundError", "InternalServerError", "BadGatewayError",
        "ServiceUnavailableError", "GatewayTimeoutError"]
    body = error_body("P failed", 502, stage="prefill", server="http://p", request_id="r")
    assert body == {"error": {"message": "P failed [lw proxy: stage=prefill, server=http://p, "
                                         "request=r]", "type": "BadGatewayError",
                              "param": None, "code": 502}}


def test_proxy_timeline_keeps_first_times_and_is_bounded() -> None:
    from lw.proxy.timeline import ProxyTimeline

    tl = ProxyTimeline(capacity=2)
    tl.mark("a", "received", 1.0)
    tl.mark("a", "received", 2.0)  # the first time wins (retries, duplicates)
    tl.mark("b", "received", 3.0)
    tl.mark("c", "received", 4.0)
    assert tl.snapshot() == {"b": {"received": 3.0}, "c": {"received": 4.0}}


# ---------------------------------------------------------------------------------------------
# The control plane as an attacker sees it (issue: nothing gets in where it does not belong)


@pytest.mark.parametrize("method,path", [("POST", "/v1/metaserver"), ("GET", "/lw/timeline"),
                                         ("GET", "/metrics-json"), ("GET", "/lw/health")])
def test_public_port_serves_no_control_endpoint(method: str, path: str) -> None:
    with cluster() as c:
        r = httpx.request(method, c.url + path, json={}, timeout=10)
        assert r.status_code == 404, (path, r.text)
        assert httpx.request(method, c.control + path, json={}, timeout=10).status_code != 404


def _victim(c: Cluster, prompt: str = "victim slowpost") -> tuple[threading.Thread, list[Any],
                                                                    str]:
    """Start a client request whose D posts late; return it, its result box and transfer id."""
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(httpx.post(
        c.url + "/v1/completions", json=completion(prompt), timeout=10)), daemon=True)
    t.start()
    wait_for(lambda: c.world.has("d_allocated"))
    [(_, _, tid)] = [e for e in c.world.events if e[0] == "d_allocated"]
    return t, box, tid


def _forged(tid: str, sub: str | None = None, grant: str = "0" * 32) -> dict[str, Any]:
    """A metaserver body aimed at another request's transfer, at blocks the attacker names."""
    return {"transfer_id": tid, "sub_transfer_id": sub or tid + "@0",
            "prompt_token_ids": [ord(ch) for ch in "evil tokens"],
            "kv_transfer_params": d_params([ord(ch) for ch in "evil tokens"],
                                           remote_block_ids=[0, 1, 2, 3]),
            "grant": grant}


def _victim_unharmed(c: Cluster, t: threading.Thread, box: list[Any], tid: str) -> None:
    """The victim got its own answer, and P prefilled only D's own call, with D's blocks."""
    t.join(10)
    [r] = box
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "".join(TOKENS)
    assert c.world.tids("p_request") == [tid + "@0"]
    p_body = c.world.bodies[("p", tid + "@0")]
    assert p_body["prompt"] == [ord(ch) for ch in "victim slowpost"]
    assert p_body["kv_transfer_params"]["remote_block_ids"] == D_PARAMS["remote_block_ids"]


def test_unsigned_forged_and_grantless_calls_racing_d_are_refused() -> None:
    with cluster() as c:
        t, box, tid = _victim(c)
        url = c.control + "/v1/metaserver"
        unsigned = httpx.post(url, json=_forged(tid), timeout=10)
        assert unsigned.status_code == 401 and "unsigned" in unsigned.json()["detail"]
        forged = signed_post(url, _forged(tid), key=b"an-attackers-own-key-0123456789")
        assert forged.status_code == 401 and "bad signature" in forged.json()["detail"]
        # A cluster member's key, but not the grant the proxy gave the victim's D.
        grantless = signed_post(url, _forged(tid))
        assert grantless.status_code == 403 and "grant" in grantless.json()["detail"]
        _victim_unharmed(c, t, box, tid)
        m = c.metrics()
        assert m["metaserver_refused"] == 3 and m["prefills"] == 1


def test_replayed_and_stale_calls_are_refused() -> None:
    with cluster() as c:
        t, box, tid = _victim(c)
        d_params = c.world.bodies[("d", tid)]["kv_transfer_params"]
        # A copy of a valid call (what a sniffer of the control network would resend): the
        # body is D's, so only the first is accepted.
        body = _forged(tid, grant=d_params["metaserver_grant"])
        content, headers = signed_call(KEY, body)
        url = c.control + "/v1/metaserver"
        first = httpx.post(url, content=content, headers=headers, timeout=10)
        assert first.status_code == 202
        again = httpx.post(url, content=content, headers=headers, timeout=10)
        assert again.status_code == 401 and "replayed" in again.json()["detail"]
        old_content, old = signed_call(KEY, body, now=time.time() - 120)
        stale = httpx.post(url, content=old_content, headers=old, timeout=10)
        assert stale.status_code == 401 and "stale" in stale.json()["detail"]
        t.join(10)
        assert c.metrics()["metaserver_refused"] == 2 and c.metrics()["prefills"] == 1


def test_calls_beyond_the_request_or_for_another_transfer_are_refused() -> None:
    with cluster() as c:
        r = httpx.post(c.url + "/v1/completions", json=completion("extra alien"), timeout=10)
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        assert c.world.meta_replies[rid + "@0"][0][0] == 202
        [(status, reply)] = c.world.meta_replies[rid + "@1"]
        assert status == 403 and "allows" in reply["detail"]
        [(status, reply)] = c.world.meta_replies["f" * 32 + "@0"]
        assert status == 403 and "not a sub-transfer" in reply["detail"]
        assert c.world.tids("p_request") == [rid + "@0"]
        # n=2 x 2 prompts allows four.
        r = httpx.post(c.url + "/v1/completions", json=completion(["a", "b"], n=2), timeout=10)
        assert r.status_code == 200 and len(c.world.tids("p_request")) == 5


def test_a_grant_is_bound_to_its_transfer() -> None:
    with cluster() as c:
        t, box, tid = _victim(c)
        other = httpx.post(c.url + "/v1/completions", json=completion("other"), timeout=10)
        assert other.status_code == 200
        other_grant = c.world.bodies[("d", other.headers["x-request-id"])][
            "kv_transfer_params"]["metaserver_grant"]
        r = signed_post(c.control + "/v1/metaserver", _forged(tid, grant=other_grant))
        assert r.status_code == 403
        t.join(10)
        assert c.world.tids("p_request").count(tid + "@0") == 1


def test_no_cluster_key_needs_an_explicit_trusted_network(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LW_CLUSTER_KEY", raising=False)
    with pytest.raises(ValueError, match="insecure-trusted-network"):
        build_apps(["http://p"], ["http://d"], metaserver_url="http://c/v1/metaserver",
                   cluster_key=None)
    with pytest.raises(SystemExit):
        main(["--prefill", "h:1", "--decode", "h:2"])
    assert "--insecure-trusted-network" in capsys.readouterr().err
    # Trusted network: unsigned calls pass, the grant is still required.
    with cluster(cluster_key=None, insecure_trusted_network=True) as c:
        t, box, tid = _victim(c)
        r = httpx.post(c.control + "/v1/metaserver", json=_forged(tid), timeout=10)
        assert r.status_code == 403
        _victim_unharmed(c, t, box, tid)
