"""What the vLLM demo, the end-to-end tests and the benchmarks send to an OpenAI server and
read back: prompts the tiny model's tokenizer knows, completions with their timings and
logprobs, and the servers' Prometheus metrics."""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MODEL_NAME", "Result", "blocks_in_use", "complete", "make_prompt", "metrics",
           "tokenize", "wait_blocks_released"]

MODEL_NAME = "tiny"
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


def tokenize(base_url: str, prompt: str) -> list[int]:
    """The prompt's token ids, from a server's /tokenize."""
    import httpx

    r = httpx.post(base_url + "/tokenize", json={"model": MODEL_NAME, "prompt": prompt},
                   timeout=30.0)
    r.raise_for_status()
    return [int(t) for t in r.json()["tokens"]]


@dataclass
class Result:
    """One completion: text, time to first token, total time, error (if any); with
    ``complete(logprobs=k)`` also the generated tokens and each position's top-k logprobs."""

    text: str = ""
    ttft_s: float | None = None
    # when the second generated token arrived (streamed only): a chunk's logprobs tokens count
    # each, a chunk without them one (vLLM streams one token per chunk by default)
    token2_s: float | None = None
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

    def add_token_ids(self, ids: Sequence[int] | None) -> None:
        """Append the ``token_ids`` of a choice (``return_token_ids``) when no logprobs named
        them, in the logprobs' form ("token_id:<id>", as the output oracle compares)."""
        if ids and not self.top_logprobs:
            self.tokens += [f"token_id:{int(t)}" for t in ids]


def complete(base_url: str, prompt: str | list[int], max_tokens: int = 16, stream: bool = True,
             timeout: float = 120.0, extra: dict[str, Any] | None = None,
             logprobs: int | None = None, headers: dict[str, str] | None = None,
             token_ids: bool = False) -> Result:
    """Greedy /v1/completions; TTFT is measured on the first streamed text. ``logprobs=k``:
    the result carries the tokens (as token ids) and each position's top-k logprobs;
    ``token_ids``: the tokens only (vLLM's ``return_token_ids``: a request that asks for no
    logprobs takes P's first token under lw); ``headers`` go with the request (e.g. a routing
    sidecar's prefill target)."""
    import httpx

    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "stream": stream}
    if logprobs is not None:
        body |= {"logprobs": logprobs, "return_tokens_as_token_ids": True}
    elif token_ids:
        body["return_token_ids"] = True
    body |= extra or {}
    res = Result()
    t0 = time.perf_counter()
    try:
        with httpx.Client(timeout=timeout, headers=headers) as client:
            if not stream:
                r = client.post(base_url + "/v1/completions", json=body)
                res.total_s = time.perf_counter() - t0
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {r.text[:300]}"
                    return res
                choice = r.json()["choices"][0]
                res.text, res.finish_reason = choice["text"], choice.get("finish_reason")
                res.add_logprobs(choice.get("logprobs"))
                res.add_token_ids(choice.get("token_ids"))
                res.ttft_s = res.total_s
                return res
            with client.stream("POST", base_url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}"
                    return res
                tokens = 0
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
                        lp = choice.get("logprobs") or {}
                        tokens += (len(lp.get("tokens") or ())
                                   or len(choice.get("token_ids") or ()) or 1)
                        if tokens >= 2 and res.token2_s is None:
                            res.token2_s = time.perf_counter() - t0
                        if choice.get("text"):
                            if res.ttft_s is None:
                                res.ttft_s = time.perf_counter() - t0
                            res.text += choice["text"]
                        res.add_logprobs(choice.get("logprobs"))
                        res.add_token_ids(choice.get("token_ids"))
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
