"""The serving benchmark's first-token figures (issue 59, "measured where users look"): time to
token 2 from ``vllm bench serve``'s per-request results, P's prefill time and the "P sampled ->
D received" hop from lw's timelines. Pure functions; no servers, no clients."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lw.fsm.messages import StatusReply
from lw.ops.phases import D_TAKEN, FIRST_TOKEN_EVENT, P_SENT

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


# ------------------------------------------------------------- token 1 before D's last DONE
ALL_DONE_EVENT = "all_done"
"""D core's event when it accepted the last DONE its request expects (lw.fsm.decode
``_sender_done``; each accepted DONE is ``sender_done``): the KV has landed."""
CLOCK_TOLERANCE_S = 0.001
"""How far the proxy's and D's times of one request may contradict causality before the
request is refused as a clock mismatch: a worker's (monotonic, wall) pair is read a few
microseconds apart, and nothing else separates the two clocks on one host."""
BEFORE_DONE_KEYS = ("before", "after", "no_first_token", "no_done", "clock")


def token1_before_done(replies: Iterable[StatusReply], proxy: Mapping[str, Mapping[str, float]],
                       since: float = 0.0) -> dict[str, Any]:
    """Per request the proxy received at or after ``since`` (wall time): whether its first
    token reached the client before D had the request's last DONE (issue 59: "token 1 reaches
    the client before D's last DONE"). Counts under ``BEFORE_DONE_KEYS`` and, per judged
    request, ``lead_ms``: D's last DONE minus the first token's relay (positive: before).

    What is compared, and why it is sound. The client (``vllm bench serve``) keeps no request
    id: the proxy names each transfer itself (uuid4, not the client's ``x-request-id``), and
    the saved result has only ``start_times`` in prompt order (``time.perf_counter``), so at
    concurrency > 1 a client request cannot be paired with a transfer with certainty. The
    point compared is therefore the proxy's ``first_token`` milestone: the first body bytes of
    D's answer written to the client (lw.proxy.exchange ``_relay``), which the client reads
    one loopback hop later. The proxy's milestones are ``time.time()`` (wall clock, read when
    the event happens: lw.proxy.timeline). A worker's timeline times are its
    ``time.monotonic()``; its status reply carries ``now`` (that clock) and ``wall``
    (``time.time()``) read together, so ``t + wall - now`` puts an event on the wall clock.
    In this benchmark every process shares one host (D's network namespace is not a time
    namespace), hence one wall clock and one monotonic clock; the mapping is off only by a
    step or slew of the wall clock between the event and the reply (seconds later). Each
    request is also checked against causality, which bounds that error both ways: D allocates
    after the proxy POSTed to it (D's ``allocated`` >= the proxy's ``d_sent``), and D streams
    P's token after its core took it (the proxy's ``first_token`` >= D's taking
    ``first_token``). A request that breaks either by more than ``CLOCK_TOLERANCE_S`` is
    refused (``clock``), not judged.

    D's last DONE: the latest ``all_done`` over D's workers (one per D worker under TP) and
    over the transfer's sub-transfers (``tid@n``: a re-prefill's epoch). Refused, not judged:
    a request without the proxy's ``first_token`` (it failed; or a D failover's abandoned
    try) and one without any ``all_done`` (D never had every DONE: a failed transfer, or a
    timeline that lost it, see ``truncated``, the D replies that left entries out)."""
    allocated: dict[str, float] = {}
    taken: dict[str, float] = {}
    done: dict[str, float] = {}
    truncated = 0
    for r in replies:
        if r.role != "decode":
            continue
        truncated += bool(r.truncated)
        shift = r.wall - r.now
        for e in r.timeline:
            if not e.req_ids:
                continue
            t, rid = e.t + shift, e.req_ids[0]
            if e.event == "allocated":
                allocated[rid] = min(t, allocated.get(rid, t))
            elif e.event == FIRST_TOKEN_EVENT and D_TAKEN.match(str(e.detail)):
                taken[rid] = min(t, taken.get(rid, t))
            elif e.event == ALL_DONE_EVENT:
                done[rid] = max(t, done.get(rid, t))

    def of(side: dict[str, float], tid: str, pick: Any) -> float | None:
        xs = [t for rid, t in side.items() if rid == tid or rid.startswith(tid + "@")]
        return pick(xs) if xs else None

    out: dict[str, Any] = dict.fromkeys(BEFORE_DONE_KEYS, 0)
    out["lead_ms"] = []
    out["truncated"] = truncated
    for tid, ev in proxy.items():
        if "@" in tid or ev.get("received", -math.inf) < since:
            continue  # a sub-transfer's milestones, or an earlier run's request
        relay = ev.get(FIRST_TOKEN_EVENT)
        last = of(done, tid, max)
        if relay is None:
            out["no_first_token"] += 1
            continue
        if last is None:
            out["no_done"] += 1
            continue
        alloc, took, posted = of(allocated, tid, min), of(taken, tid, min), ev.get("d_sent")
        if ((alloc is not None and posted is not None and alloc < posted - CLOCK_TOLERANCE_S)
                or (took is not None and relay < took - CLOCK_TOLERANCE_S)):
            out["clock"] += 1
            continue
        out["before" if relay < last else "after"] += 1
        out["lead_ms"].append((last - relay) * 1e3)
    return out


def merge_before_done(counts: Iterable[Mapping[str, Any] | None]) -> dict[str, Any]:
    """The counts of several runs together (None: a run without them)."""
    out: dict[str, Any] = dict.fromkeys(BEFORE_DONE_KEYS, 0)
    out["lead_ms"] = []
    out["truncated"] = 0
    for c in counts:
        if not c:
            continue
        for k in (*BEFORE_DONE_KEYS, "truncated"):
            out[k] += int(c.get(k, 0))
        out["lead_ms"] += list(c.get("lead_ms") or ())
    return out


def before_done_share(c: Mapping[str, Any] | None) -> str:
    """``6/6 (100 %)``: requests whose first token reached the client before D's last DONE,
    of those judged; ``n/a`` when none was."""
    judged = int(c["before"]) + int(c["after"]) if c else 0
    if not c or not judged:
        return "n/a"
    return f"{c['before']}/{judged} ({100 * c['before'] / judged:.0f} %)"


def before_done_refusals(c: Mapping[str, Any] | None) -> str:
    """What was not judged and why, e.g. ``1 without D's all_done, 1 clock mismatch``; empty
    when every request was judged."""
    if not c:
        return ""
    parts = [f"{c[k]} {what}" for k, what in (
        ("no_first_token", "without the proxy's first token"),
        ("no_done", "without D's all_done"),
        ("clock", "clock mismatch")) if c.get(k)]
    if c.get("truncated") and c.get("no_done"):
        parts.append(f"{c['truncated']} D timeline(s) truncated")
    return ", ".join(parts)
