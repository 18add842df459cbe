"""The hostile cases as data: what each one sends, where (the proxy's public or control port,
the sidecar's port, or straight to D's or P's vLLM port), which HTTP statuses it expects back,
and what else it expects (the ``param`` an error names, how much a counter moves)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from lw.contract.ahead import ahead_params
from lw.contract.params import CONTRACT_VERSION, decoder_params, prefill_params
from lw.lab.hostile.client import post, post_stream
from lw.lab.hostile.probes import Context, health_probes
from lw.lab.hostile.table import MB, MESSAGE_CHARS, Answer, clip


@dataclass(frozen=True)
class Case:
    """One hostile input: where it goes, what it is (short) and how to send it."""

    key: str
    name: str
    target: str  # a TARGETS key
    sent: str
    send: Callable[[Context], Answer | tuple[Answer, str]]
    expect: tuple[int, ...] = ()
    param: str = ""  # the ``param`` the error answer must name
    moved: tuple[tuple[str, int], ...] = ()  # (Deltas field, how much it must move)


# ------------------------------------------------------------------------------ the bodies
def _digest(token_ids: Sequence[int]) -> str:
    from lw.contract.params import prompt_digest

    return prompt_digest(token_ids)


def ssrf_params(canary_url: str) -> dict[str, Any]:
    """Transfer parameters that would make D call the canary as its metaserver (the issue's
    body: no grant, no signature)."""
    params = decoder_params(f"{canary_url}/steal", "evil-1", "")
    for k in ("metaserver_grant", "do_remote_decode"):
        params.pop(k)
    return params


def ssrf_body(model: str, canary_url: str, in_xargs: bool = False) -> dict[str, Any]:
    """The SSRF body (top-level ``kv_transfer_params``, or inside ``vllm_xargs``)."""
    body: dict[str, Any] = {"model": model, "prompt": "hello there friend", "max_tokens": 4,
                            "stream": None}
    if in_xargs:
        body["vllm_xargs"] = {"kv_transfer_params": ssrf_params(canary_url)}
    else:
        body["kv_transfer_params"] = ssrf_params(canary_url)
    return body


def forged_decode_params(canary_url: str) -> dict[str, Any]:
    """Every field of the proxy's params to D, pointing at the canary, with a made-up
    signature."""
    return {**decoder_params(f"{canary_url}/v1/metaserver", "evil-6b", "g" * 32),
            "lw_contract": CONTRACT_VERSION, "lw_sig": "0" * 64}


def forged_prefill_params(token_ids: Sequence[int], host: str, port: int,
                          block_size: int = 32) -> dict[str, Any]:
    """Params shaped as the proxy's to P (D's fields: engine, host, port, blocks for the whole
    prompt, its digest), unsigned: P must push nothing to ``host:port``."""
    blocks = -(-len(token_ids) // block_size)
    kv = {"remote_engine_id": "decode", "remote_host": host, "remote_port": port,
          "remote_block_ids": list(range(1, blocks + 1)), "remote_first_block": 0,
          "remote_dp_rank": 0, "remote_tp_size": 1, "lw_geometry": "guessed",
          "lw_params_version": CONTRACT_VERSION, "lw_prompt_digest": _digest(token_ids)}
    return {**prefill_params(kv, "evil-7@x"), "lw_contract": CONTRACT_VERSION, "lw_sig": "0" * 64}


def forged_ahead_params(canary_url: str) -> dict[str, Any]:
    """Params shaped as the proxy's to a prefill computed ahead (``--start-mode
    compute-ahead``), P's fetch of D's params aimed at the canary, with a made-up signature: P
    must not call it."""
    return {**ahead_params(f"{canary_url}/v1/ahead", "evil-7c", "g" * 32, compute=True),
            "lw_contract": CONTRACT_VERSION, "lw_sig": "0" * 64}


AHEAD_FETCH = {"transfer_id": "evil-12e", "grant": "g" * 32, "prompt_digest": "0" * 64}
"""A fetch of D's params (what P sends the control port's ``/v1/ahead``) for a made-up transfer."""


def metaserver_body(canary_url: str) -> dict[str, Any]:
    """A metaserver call asking for a prefill written to the canary."""
    ids = [1, 2, 3, 4]
    return {"transfer_id": "evil-12", "sub_transfer_id": "evil-12@cmpl-x",
            "prompt_token_ids": ids, "grant": "g" * 32,
            "kv_transfer_params": {"remote_engine_id": "decode", "remote_host": "127.0.0.1",
                                   "remote_port": int(canary_url.rsplit(":", 1)[1]),
                                   "remote_block_ids": [1], "remote_tp_size": 1,
                                   "lw_geometry": "g", "lw_params_version": CONTRACT_VERSION,
                                   "lw_prompt_digest": _digest(ids)}}


def escaped_name_body(model: str, canary_url: str) -> bytes:
    """The SSRF body with the field's name spelt with a JSON escape (``param\\u0073``): the
    same key once parsed, not the same bytes."""
    head = json.dumps({"model": model, "prompt": "hello there friend", "max_tokens": 4})
    return (head[:-1] + ', "kv_transfer_param\\u0073": ' + json.dumps(ssrf_params(canary_url))
            + "}").encode()


def duplicate_key_body(model: str, canary_url: str) -> bytes:
    """The SSRF params, then the same key again as null (parsers differ on which one wins)."""
    head = json.dumps({"model": model, "prompt": "hello there friend", "max_tokens": 4})
    return (head[:-1] + ', "kv_transfer_params": ' + json.dumps(ssrf_params(canary_url))
            + ', "kv_transfer_params": null}').encode()


# ------------------------------------------------------------------------------ the cases
def health_flood(ctx: Context, n: int = 200, workers: int = 16,
                 time_limit: float = 60.0) -> tuple[Answer, str]:
    """``n`` GET /health on the public port, ``workers`` at a time, bounded in time; the
    answer (the worst status) and how often each backend was probed meanwhile."""
    import httpx

    d0, p0 = health_probes(ctx.logs)
    deadline = time.monotonic() + time_limit
    statuses: list[int | None] = []
    t0 = time.monotonic()

    def one(_: int) -> int | None:
        if time.monotonic() > deadline:
            return None
        try:
            return httpx.get(ctx.public + "/health", timeout=10.0).status_code
        except httpx.HTTPError:
            return None

    with ThreadPoolExecutor(workers) as pool:
        statuses = list(pool.map(one, range(n)))
    took = time.monotonic() - t0
    time.sleep(0.3)  # the engines' access log lines
    d1, p1 = health_probes(ctx.logs)
    counts: dict[str, int] = {}
    for s in statuses:
        counts[str(s)] = counts.get(str(s), 0) + 1
    worst = max((s for s in statuses if s is not None), default=None)
    if None in statuses:
        worst = None if worst is None or worst < 500 else worst
    msg = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) + f" in {took:.1f} s"
    if d1 == d0 == 0 and p1 == p0 == 0 and d0 == 0:
        probes = "backend probes not visible (no access log)"
    else:
        probes = f"backend probes D {d1 - d0} P {p1 - p0} (cache 1 s)"
    return Answer(worst, clip(msg, MESSAGE_CHARS)), probes


PREFILLER = "x-prefiller-host-port"
"""The header llm-d's scheduler names the prefill server in (lw.proxy.sidecar)."""


def sidecar_cases(ctx: Context) -> list[Case]:
    """Cases sent to ``lw proxy --sidecar`` in front of D, whose allowlist admits only P: a
    client's transfer fields, prefill servers named by the header (malformed, or not allowed:
    the canary), a passthrough path, a body over the size bound."""
    m, canary, port = ctx.model, ctx.canary.url, ctx.canary.port
    comp = "/v1/completions"
    plain = {"model": m, "prompt": "hello there friend", "max_tokens": 4}
    x_str = {**plain, "vllm_xargs": {"kv_transfer_params": "x"}}
    tokenize = {"model": m, "prompt": "hello there friend",
                "kv_transfer_params": ssrf_params(canary)}

    def named(value: str) -> Callable[[Context], Answer]:
        return lambda c: post(c.sidecar + comp, plain, {PREFILLER: value}, c.timeout)

    no_canary = (("canary", 0),)
    return [
        Case("s1", "vllm_xargs params a string", "sidecar", 'vllm_xargs.kv_transfer_params="x"',
             lambda c: post(c.sidecar + comp, x_str, timeout=c.timeout), (400,),
             param="vllm_xargs.kv_transfer_params"),
        Case("s2", "SSRF kv_transfer_params", "sidecar",
             "stream=null, kv_transfer_params={ssrf}",
             lambda c: post(c.sidecar + comp, ssrf_body(m, canary), timeout=c.timeout),
             (200, 400), moved=no_canary),
        Case("s3", "prefiller with empty user part", "sidecar",
             f"{PREFILLER}: @127.0.0.1:{port}", named(f"@127.0.0.1:{port}"), (400,),
             moved=no_canary),
        Case("s4", "prefiller with user :pw@", "sidecar", f"{PREFILLER}: :pw@127.0.0.1:{port}",
             named(f":pw@127.0.0.1:{port}"), (400,), moved=no_canary),
        Case("s5", "prefiller not allowed (canary)", "sidecar",
             f"{PREFILLER}: 127.0.0.1:{port}", named(f"127.0.0.1:{port}"), (403,),
             moved=no_canary),
        Case("s6", "passthrough with params", "sidecar",
             "POST /tokenize, kv_transfer_params={ssrf}",
             lambda c: post(c.sidecar + "/tokenize", tokenize, timeout=c.timeout),
             (200, 400, 404, 422), moved=(("dropped", 1),)),
        Case("s7", "200 MB body, Content-Length", "sidecar", "CL 200 MB, streamed 1 MB chunks",
             lambda c: post_stream(c.sidecar + comp, 200 * MB, declare=True), (413,)),
    ]


def _tokens(url: str, prompt: str) -> list[int]:
    from lw.lab.demo_client import tokenize

    return tokenize(url, prompt)


def build_cases(ctx: Context) -> list[Case]:
    """The table's cases, in the order they run."""
    m, canary = ctx.model, ctx.canary.url
    comp = "/v1/completions"
    meta = ctx.control + "/v1/metaserver"
    ahead = ctx.control + "/v1/ahead"
    x_str = {"model": m, "prompt": "hello there friend", "max_tokens": 4,
             "vllm_xargs": {"kv_transfer_params": "x"}}
    fresh = f"{time.time():.3f}"
    bogus = {"x-lw-signature": "ab" * 32, "x-lw-timestamp": fresh, "x-lw-nonce": "n" * 16}
    deep = b'{"model":"' + m.encode() + b'","prompt":"hi","max_tokens":1,"x":' + \
        b"[" * 100_000 + b"]" * 100_000 + b"}"
    deep100 = b'{"model":"' + m.encode() + b'","prompt":"hi","max_tokens":1,"x":' + \
        b"[" * 100 + b"]" * 100 + b"}"

    def forged_p(host_port: Callable[[Context], tuple[str, int]]) -> Callable[[Context], Answer]:
        def send(c: Context) -> Answer:
            prompt = "hello there friend, the word is water"
            ids = _tokens(c.prefill, prompt)
            host, port = host_port(c)
            return post(c.prefill + comp, {"model": m, "prompt": ids, "max_tokens": 1,
                                           "kv_transfer_params": forged_prefill_params(
                                               ids, host, port)}, timeout=c.timeout)
        return send

    def with_params(server: Callable[[Context], str], params: dict[str, Any], max_tokens: int
                    ) -> Callable[[Context], Answer]:
        """A completion sent straight to an engine, with forged transfer params."""
        body = {"model": m, "prompt": "hello there friend", "max_tokens": max_tokens,
                "kv_transfer_params": params}
        return lambda c: post(server(c) + comp, body, timeout=c.timeout)

    def signed_now(c: Context) -> Answer:  # a fresh timestamp when sent, a made-up MAC
        hdrs = dict(bogus, **{"x-lw-timestamp": f"{time.time():.3f}"})
        return post(meta, metaserver_body(canary), hdrs, c.timeout)

    def big_meta(declare: bool, url: str = meta) -> Callable[[Context], Answer]:
        def send(c: Context) -> Answer:
            hdrs = dict(bogus, **{"x-lw-timestamp": f"{time.time():.3f}"})
            return post_stream(url, 50 * MB, declare=declare, headers=hdrs)
        return send

    def fetch_now(c: Context) -> Answer:  # a fetch of D's params with a made-up MAC
        hdrs = dict(bogus, **{"x-lw-timestamp": f"{time.time():.3f}"})
        return post(ahead, AHEAD_FETCH, hdrs, c.timeout)

    return [
        Case("1", "SSRF kv_transfer_params", "public", "kv_transfer_params.metaserver=canary",
             lambda c: post(c.public + comp, ssrf_body(m, canary), timeout=c.timeout),
             (200, 400)),
        Case("1b", "kv_transfer_params not an object", "public", 'kv_transfer_params="x"',
             lambda c: post(c.public + comp, {"model": m, "prompt": "hi", "max_tokens": 2,
                                              "kv_transfer_params": "x"}, timeout=c.timeout),
             (400,)),
        Case("2", "SSRF in vllm_xargs", "public", "vllm_xargs.kv_transfer_params={ssrf}",
             lambda c: post(c.public + comp, ssrf_body(m, canary, True), timeout=c.timeout),
             (200, 400)),
        Case("3", "vllm_xargs params a string", "public", 'vllm_xargs.kv_transfer_params="x"',
             lambda c: post(c.public + comp, x_str, timeout=c.timeout), (400,)),
        Case("4", "vllm_xargs params a string", "decode", 'vllm_xargs.kv_transfer_params="x"',
             lambda c: post(c.decode + comp, x_str, timeout=c.timeout), (200, 400)),
        Case("5", "vllm_xargs params a string", "prefill", 'vllm_xargs.kv_transfer_params="x"',
             lambda c: post(c.prefill + comp, x_str, timeout=c.timeout), (200, 400)),
        Case("6", "SSRF params, unsigned", "decode", "kv_transfer_params.metaserver=canary",
             lambda c: post(c.decode + comp, ssrf_body(m, canary), timeout=c.timeout),
             (200, 400)),
        Case("6b", "forged D params, zero signature", "decode",
             "all DecodeParams fields, lw_sig=0*64",
             with_params(lambda c: c.decode, forged_decode_params(canary), 4), (200, 400)),
        Case("6d", "SSRF, field name JSON-escaped", "decode",
             'kv_transfer_param\\u0073={ssrf}',
             lambda c: post(c.decode + comp, escaped_name_body(m, canary), timeout=c.timeout),
             (200, 400)),
        Case("6e", "SSRF, duplicate key (then null)", "decode",
             "kv_transfer_params={ssrf}, kv_transfer_params=null",
             lambda c: post(c.decode + comp, duplicate_key_body(m, canary), timeout=c.timeout),
             (200, 400)),
        Case("6c", "SSRF in vllm_xargs", "decode", "vllm_xargs.kv_transfer_params={ssrf}",
             lambda c: post(c.decode + comp, ssrf_body(m, canary, True), timeout=c.timeout),
             (200, 400)),
        Case("7", "forged prefill params -> D", "prefill",
             "do_remote_decode, D's host:kv port, unsigned",
             forged_p(lambda c: ("127.0.0.1", c.decode_kv_port)), (200, 400)),
        Case("7b", "forged prefill params -> canary", "prefill",
             "do_remote_decode, canary host:port, unsigned",
             forged_p(lambda c: ("127.0.0.1", c.canary.port)), (200, 400)),
        Case("7c", "forged ahead params -> canary", "prefill",
             "lw_ahead_url=canary, compute, made-up signature",
             with_params(lambda c: c.prefill, forged_ahead_params(canary), 1), (200, 400)),
        Case("8", "200 MB body, Content-Length", "public", "CL 200 MB, streamed 1 MB chunks",
             lambda c: post_stream(c.public + comp, 200 * MB, declare=True), (413,)),
        Case("9", "200 MB body, chunked", "public", "no CL, chunked, 1 MB chunks",
             lambda c: post_stream(c.public + comp, 200 * MB, declare=False), (413,)),
        Case("8d", "200 MB body, Content-Length", "decode", "CL 200 MB, streamed 1 MB chunks",
             lambda c: post_stream(c.decode + comp, 200 * MB, declare=True), (413,)),
        Case("10", "JSON nested 100000 deep", "public", "[[[...]]] x100000 in a field",
             lambda c: post(c.public + comp, deep, timeout=c.timeout), (400,)),
        Case("10b", "JSON nested 100 deep", "public", "[[[...]]] x100 in a field",
             lambda c: post(c.public + comp, deep100, timeout=c.timeout), (400,)),
        Case("10c", "JSON nested 100000 deep", "decode", "[[[...]]] x100000 in a field",
             lambda c: post(c.decode + comp, deep, timeout=c.timeout), (400,)),
        Case("11", "not JSON", "public", "{this is not json",
             lambda c: post(c.public + comp, b"{this is not json", timeout=c.timeout), (400,)),
        Case("12a", "metaserver call, unsigned", "control", "no x-lw-* headers",
             lambda c: post(meta, metaserver_body(canary), timeout=c.timeout), (401,)),
        Case("12b", "metaserver, non-ASCII signature", "control",
             "x-lw-signature: e-acute x32 (UTF-8)",
             lambda c: post(meta, metaserver_body(canary),
                            [(b"x-lw-signature", "\u00e9".encode() * 32),
                             (b"x-lw-timestamp", f"{time.time():.3f}".encode()),
                             (b"x-lw-nonce", b"n" * 16)], c.timeout), (401,)),
        Case("12c", "metaserver, nan timestamp", "control", "x-lw-timestamp: nan",
             lambda c: post(meta, metaserver_body(canary),
                            dict(bogus, **{"x-lw-timestamp": "nan"}), c.timeout), (401,)),
        Case("12d", "metaserver, made-up MAC", "control", "well-formed headers, wrong MAC",
             signed_now, (401,)),
        Case("13", "50 MB metaserver call, CL", "control", "CL 50 MB, bogus well-formed sig",
             big_meta(True), (401, 413)),
        Case("13b", "50 MB metaserver call, chunked", "control", "no CL, bogus well-formed sig",
             big_meta(False), (401, 413)),
        Case("12e", "ahead fetch, unsigned", "control", "POST /v1/ahead, no x-lw-* headers",
             lambda c: post(ahead, AHEAD_FETCH, timeout=c.timeout), (401,)),
        Case("12f", "ahead fetch, made-up MAC", "control", "well-formed headers, wrong MAC",
             fetch_now, (401,)),
        Case("13c", "50 MB ahead fetch, CL", "control", "CL 50 MB, bogus well-formed sig",
             big_meta(True, ahead), (401, 413)),
        *sidecar_cases(ctx),
        Case("14", "/health flood", "public", "200 x GET /health, 16 at a time",
             health_flood, (200,)),
    ]
