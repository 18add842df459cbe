"""The serving benchmark's first-token figures (issue 59, "measured where users look"): time to
token 2 from ``vllm bench serve``'s per-request results, P's prefill time and the "P sampled ->
D received" hop from lw's timelines. Pure functions; no servers, no clients."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lw.fsm.messages import StatusReply

FIRST_TOKEN_EVENT = "first_token"
"""The timeline event P records about its sampled first token and D about taking it, both under
the request's id (lw.fsm.prefill_first_token, lw.fsm.decode_first_token); its detail says which
(held, sent, taken, refused)."""
P_SENT = re.compile(r"^token -?\d+ to ")
"""P's detail when it sent the token: ``token 17 to tcp://... (epoch 1)`` (not ``token 17: held
until D accepts``, nor ``refused: ...``)."""
D_TAKEN = re.compile(r"^token -?\d+ of epoch \d+ from P ")
"""D's detail when its core took the token: ``token 17 of epoch 1 from P prefill`` (not ``...:
the epoch was given up``, nor ``refused: ...``)."""

DETAILED_KEYS = ("ttfts", "itls", "errors")
"""The per-request lists ``vllm bench serve --save-detailed`` adds that these figures read."""


def percentile(xs: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile of ``xs`` with linear interpolation (numpy's default, as
    ``vllm bench serve`` reports its own); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def token2_ms(res: Mapping[str, Any]) -> list[float]:
    """Per successful request of a ``vllm bench serve --save-detailed`` result, the time to
    its second streamed token in ms: its TTFT plus its first inter-token latency. A failed
    request (an error, or no first token) and one that streamed a single chunk have none."""
    ttfts = res.get("ttfts") or []
    itls = res.get("itls") or []
    errors = res.get("errors") or [""] * len(ttfts)
    out = []
    for ttft, itl, err in zip(ttfts, itls, errors, strict=False):
        if err or not ttft or not itl:
            continue
        out.append((ttft + itl[0]) * 1e3)
    return out


def add_token2(res: dict[str, Any]) -> None:
    """Put the run's time-to-token-2 p50 and p99 (ms) into ``res`` (None without detailed
    results) and drop the generated texts (the report never reads them)."""
    t2 = token2_ms(res)
    res["median_token2_ms"] = percentile(t2, 50)
    res["p99_token2_ms"] = percentile(t2, 99)
    res.pop("generated_texts", None)


def first_token_hops(replies: Iterable[StatusReply], since: float = 0.0) -> list[float]:
    """Per request, seconds from P's ``first_token`` event that sent its sampled token to D's
    that took it, on the wall clock, for requests P sent at or after ``since`` (wall
    time). A request P computed ahead is matched under D's id (P's ``renamed`` event); a
    sub-transfer id (``tid@n``) falls back to its transfer's. Empty when the workers record no
    such event (a checkout before the event existed, or ``first_token_from_p`` off)."""
    sent: dict[str, float] = {}
    taken: dict[str, float] = {}
    renamed: dict[str, str] = {}
    for r in replies:
        shift = r.wall - r.now
        for e in r.timeline:
            if e.event == "renamed" and e.req_ids:
                renamed[e.req_ids[0]] = str(e.detail)
            if e.event != FIRST_TOKEN_EVENT or not e.req_ids:
                continue
            side, done = (sent, P_SENT) if r.role == "prefill" else (taken, D_TAKEN)
            if not done.match(str(e.detail)):
                continue
            t = e.t + shift
            rid = e.req_ids[0]
            side[rid] = min(t, side.get(rid, t))  # several P ranks or D workers: the first
    out = []
    for rid, t_sent in sent.items():
        rid = renamed.get(rid, rid)
        t_taken = taken.get(rid)
        if t_taken is None:
            t_taken = taken.get(rid.split("@", 1)[0])
        if t_taken is not None and t_sent >= since:
            out.append(t_taken - t_sent)
    return out


def p_prefill_s(times: Iterable[Mapping[str, float]]) -> list[float]:
    """Per request, P's prefill time as lw's milestones show it: the proxy's prefill POST
    (``p_sent``) to P's last layer computed (``last_computed``): P's HTTP server, scheduler
    and forward, beside the single server's prompt-only request."""
    return [m["last_computed"] - m["p_sent"] for m in times
            if "p_sent" in m and "last_computed" in m]


def hop_summary(hops_ms: Sequence[float]) -> str:
    """``p50 / max`` of the "P sampled -> D received" hops in ms, or ``n/a`` for none."""
    if not hops_ms:
        return "n/a"
    return f"{percentile(hops_ms, 50):.1f} / {max(hops_ms):.1f}"
