"""Whose each millisecond of a request's path is, lw's or vLLM's, from time stamps in every
process: the proxy's POSTs, D's admission and metaserver call, P's admission and first step,
then token 1's way to the client: P's (its step's end, D's worker taking it, D's engine core
and API server putting it out, the proxy's relay) or, where D samples it, D's from its last DONE
(the report, vLLM's next step, the output path, the relay).

Starts lw P/D as ``lw demo`` does (P on core 0, D on core 1, loopback, lw's proxy) with
``benchmarks/_steptrace`` on PYTHONPATH, sends ``--requests`` prompts one at a time (greedy,
streamed, 4 output tokens each; the first two unmeasured), and prints per step the median and
min-max over the requests, next to D's decode step (TPOT) measured on the same streams.
docs/benchmarks.md ("Whose each millisecond ...") holds the figures.

``PYTHONPATH=$PWD HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/d_step_trace.py [--requests 14]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHIM = ROOT / "benchmarks" / "_steptrace"

# (label, from milestone, to milestone, whose time it is). The first rows are the request's
# way to P: D first, P's POST follows D's allocation and metaserver call; computing ahead it
# leaves with D's, and those rows overlap (printed so).
FRONT: tuple[tuple[str, str, str, str], ...] = (
    # (from "sent" to "p_received" is left out: it is mostly this driver's own client stack,
    # which vllm bench serve's does not share; the phase tables of serving.py start there too)
    ("lw's proxy read the request -> POST to D left", "p_received", "p_d_sent", "lw"),
    ("proxy's POST -> D's scheduler has it", "p_d_sent", "s_new", "vLLM"),
    ("D's scheduler has it -> D allocated", "s_new", "d_alloc", "vLLM"),
    ("D allocated -> its metaserver thread calls", "d_alloc", "d_call", "lw"),
    ("the call (signed, HTTP) -> the proxy checked it", "d_call", "meta", "lw"),
    ("metaserver call -> the proxy's POST to P left", "meta", "p_post", "lw"),
    ("proxy's POST to P -> P's scheduler has it", "p_post", "p_new", "vLLM"),
    ("P's scheduler has it -> P's first step starts", "p_new", "p_step", "vLLM"),
)
"""The request's way to P's first step (both paths of token 1)."""
D_PATH: tuple[tuple[str, str, str, str], ...] = (
    ("P's first step starts -> D's last DONE", "p_step", "done", "P/D"),
    ("last DONE -> D's worker reports it", "done", "w_recv", "lw"),
    ("report -> D's scheduler learns it", "w_recv", "s_update", "vLLM"),
    ("learns it -> schedules the request", "s_update", "s_sched", "vLLM"),
    ("scheduled -> D's worker step starts", "s_sched", "w_bind", "vLLM"),
    ("step start -> its end (the forward)", "w_bind", "w_end", "vLLM"),
    ("step end -> D's engine core has the output", "w_end", "e_out", "vLLM"),
    ("-> D's API server processed it", "e_out", "a_out", "vLLM"),
    ("-> D's API server sent the first bytes", "a_out", "a_send", "vLLM"),
    ("-> lw's proxy relays them", "a_send", "p_first", "lw"),
    ("lw's proxy -> first token at the client", "p_first", "tok0", "lw"),
)
"""Token 1 sampled by D after the KV landed (``first_token_from_p`` off, or a fallback)."""
TOKEN_PATH: tuple[tuple[str, str, str, str], ...] = (
    ("P's first step starts -> its last step ends (token 1)", "p_step", "p_end", "P"),
    ("P's step end -> its runner hands token 1 to lw", "p_end", "p_sampled", "vLLM"),
    ("-> D's worker took token 1", "p_sampled", "ft", "lw"),
    ("D took it -> D's engine core has the output", "ft", "e_out", "lw/vLLM"),
    ("-> D's API server processed it", "e_out", "a_out", "vLLM"),
    ("-> D's API server sent the first bytes", "a_out", "a_send", "vLLM"),
    ("-> lw's proxy relays them", "a_send", "p_first", "lw"),
    ("lw's proxy -> first token at the client", "p_first", "tok0", "lw"),
)
"""Token 1 sampled by P and streamed by D as it arrives (issue 59, the default)."""
STEPS = FRONT + D_PATH + TOKEN_PATH
REQUIRED = ("sent", "p_received", "p_d_sent", "s_new", "a_out", "a_send", "p_first", "tok0",
            "tok1", "tok2", "tok3")
"""Milestones every measured request has; P's may be missing (P TP > 1, say)."""
D_REQUIRED = ("done", "w_recv", "s_update", "s_sched", "w_bind", "w_end")
"""Those of D's own token 1 (a request without ``ft``)."""


@dataclass(frozen=True)
class Event:
    """One line of the step trace."""

    t: float
    pid: int
    name: str
    ident: str


def read_events(lines: Iterable[str]) -> list[Event]:
    """Parse step-trace lines (``<t> <pid> <event> [<id>]``), sorted by time."""
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        out.append(Event(float(parts[0]), int(parts[1]), parts[2],
                         parts[3] if len(parts) > 3 else ""))
    return sorted(out, key=lambda e: e.t)


def milestones(events: Sequence[Event]) -> list[dict[str, float]]:
    """Per request (the driver's ``sent`` events; requests run one at a time), the time of each
    milestone of ``STEPS``: each is the first of its kind after the one before it, on the
    process it belongs to (D's worker: the one that reported a RecvDone; its scheduler: the one
    that learnt a receive finished; P's: those that reported a SendFinished, or took a new
    request, and are not D's). A request without one of ``REQUIRED`` is left out."""
    d_worker = {e.pid for e in events if e.name == "report_RecvDone"}
    d_sched = {e.pid for e in events if e.name == "s_update_recv"}
    p_worker = {e.pid for e in events if e.name == "report_SendFinished"} - d_worker
    p_sched = {e.pid for e in events if e.name == "s_new"} - d_sched
    sent = [e for e in events if e.name == "sent"]
    rows = []
    for i, s in enumerate(sent):
        end = sent[i + 1].t if i + 1 < len(sent) else float("inf")
        window = [e for e in events if s.t <= e.t < end]

        def first(name: str, after: float | None, pids: set[int] | None = None,
                  window: list[Event] = window) -> float | None:
            if after is None:
                return None
            return next((e.t for e in window if e.name == name and e.t >= after
                         and (pids is None or e.pid in pids)), None)

        m: dict[str, float | None] = {"sent": s.t}
        m["p_received"] = first("p_received", s.t)
        m["p_d_sent"] = first("p_d_sent", s.t)
        m["s_new"] = first("s_new", s.t, d_sched)
        m["d_alloc"] = first("s_alloc", m["s_new"], d_sched)
        m["d_call"] = first("d_meta_call", m["d_alloc"], d_sched)
        m["meta"] = first("p_meta_posted", m["d_alloc"])
        posts = [t for t in (first("p_p_sent", s.t), first("p_p_ahead_sent", s.t)) if t]
        m["p_post"] = min(posts) if posts else None
        m["p_new"] = first("s_new", m["p_post"], p_sched)
        m["p_step"] = first("w_bind", m["p_new"], p_worker)
        d_rid = next((e.ident for e in window if e.name == "s_new" and e.pid in d_sched), "")
        m["ft"] = first("report_FirstTokenTaken", m["p_step"] or s.t, d_worker)
        if m["ft"] is not None:  # token 1 is P's: D streams it as it arrives
            # P's step that sampled it: its worker's last step end before D took it
            m["p_end"] = max((e.t for e in window if e.name == "w_results"
                              and e.pid in p_worker and e.t <= m["ft"]), default=None)
            m["p_sampled"] = first("w_sampled", m["p_end"], p_worker)
            if m["p_sampled"] is not None and m["p_sampled"] > m["ft"]:
                m["p_sampled"] = None  # the hand-over of a later step (the scheduler's copy went)
            m["e_out"] = first("e_out", m["ft"], d_sched)
        else:
            m["done"] = first("report_RecvDone", s.t, d_worker)
            # the report is queued before its line is written: the worker may log first
            m["w_recv"] = first("w_recv", None if m["done"] is None else m["done"] - 0.005,
                                d_worker)
            m["s_update"] = first("s_update_recv", m["w_recv"], d_sched)
            m["s_sched"] = first("s_sched", m["s_update"], d_sched)
            m["w_bind"] = first("w_bind", m["s_sched"], d_worker)
            m["w_end"] = first("w_results", m["w_bind"], d_worker)
            m["e_out"] = first("e_out", m["w_end"], d_sched)
        # D's API server: P's logs its own answer (max_tokens 1) too, so match D's request id
        m["a_out"] = next((e.t for e in window if e.name == "a_out" and e.ident == d_rid
                           and m["e_out"] is not None and e.t >= m["e_out"]), None)
        # the send carries no request id: the first of the API server that processed it
        d_api = {e.pid for e in window if e.name == "a_out" and e.t == m["a_out"]}
        m["a_send"] = first("a_send", m["a_out"], d_api)
        m["p_first"] = first("p_first_token", m["a_send"])
        # the proxy's main thread: time waiting for a CPU from P's answer to the relay
        p_done = first("p_p_done", s.t)
        before = _waited(window, "p_sched_p_done", p_done)
        after = _waited(window, "p_sched_first_token", m["p_first"])
        # (P's answer may follow the relay when token 1 is P's: nothing to say then)
        if before is not None and after is not None and p_done < m["p_first"]:
            m["proxy_wait"] = (after - before) / 1e9
        for k in range(4):
            m[f"tok{k}"] = first(f"tok{k}", s.t)
        needed = REQUIRED if m["ft"] is not None else REQUIRED + D_REQUIRED
        if all(m.get(k) is not None for k in needed):
            rows.append({k: v for k, v in m.items() if v is not None})
    return rows


def _waited(window: Sequence[Event], name: str, t: float | None) -> int | None:
    """The time waited for a CPU (ns) in the schedstat line ``name`` logged with the milestone
    at ``t``; None without one."""
    if t is None:
        return None
    return next((int(e.ident.split("/")[1]) for e in window
                 if e.name == name and e.ident and abs(e.t - t) < 0.001), None)


def _stats(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.2f} ({min(xs):.2f}-{max(xs):.2f})"


def _table(rows: list[dict[str, float]], steps: Sequence[tuple[str, str, str, str]]
           ) -> list[str]:
    """One line per step of ``steps``: its median (min-max) over the rows that have both ends."""
    lines = []
    for label, a, b, whose in steps:
        xs = [(r[b] - r[a]) * 1e3 for r in rows if a in r and b in r]
        shown = ("-" if not xs else "overlapped (negative)" if statistics.median(xs) < 0
                 else _stats(xs) + ("" if len(xs) == len(rows) else f" [{len(xs)}]"))
        lines.append(f"  {label:<52} {whose:<7} {shown}")
    return lines


def report(rows: list[dict[str, float]]) -> str:
    """The table: per step, the median (min-max) in ms, the request's way to P and then token
    1's path, P's (streamed by D as it arrives) or D's (after the KV landed), each over the
    requests that took it; then D's TPOT and the sums."""
    if not rows:
        return "no complete request in the trace"
    from_p = [r for r in rows if "ft" in r]
    from_d = [r for r in rows if "ft" not in r]
    lines = [f"{len(rows)} requests; ms, median (min-max)",
             f"  {'step':<52} {'whose':<7} {'ms':>7}", *_table(rows, FRONT)]
    if from_p:
        lines += [f"  token 1 from P ({len(from_p)} requests)", *_table(from_p, TOKEN_PATH)]
    if from_d:
        lines += [f"  token 1 from D after the KV ({len(from_d)} requests)",
                  *_table(from_d, D_PATH)]
    waits = [r["proxy_wait"] * 1e3 for r in rows if "proxy_wait" in r]
    if waits:
        lines.append(f"  {'lw proxy waited for a CPU, its P answer -> relay':<60} "
                     f"{_stats(waits)}; over 10 ms in {sum(w > 10 for w in waits)}"
                     f" of {len(waits)}")
    ttft = [(r["tok0"] - r["p_received"]) * 1e3 for r in rows]
    lines.append(f"  {'the proxy read the request -> first token at the client':<60} "
                 f"{_stats(ttft)}")
    if from_p:
        # from the hand-over where the shim saw it (the sampling is vLLM's), else the step end
        after = [(r["tok0"] - r.get("p_sampled", r["p_end"])) * 1e3 for r in from_p
                 if "p_end" in r]
        lw_part = [((r["e_out"] - r.get("p_sampled", r["p_end"])) + (r["tok0"] - r["a_send"]))
                   * 1e3 for r in from_p if "p_end" in r]
        if after:
            lines += [f"  {'P: token 1 sampled -> first token at the client':<60} "
                      f"{_stats(after)}",
                      f"  {'   of which lw (P to D, into the engine, relay)':<60} "
                      f"{_stats(lw_part)}"]
    if from_d:
        after = [(r["tok0"] - r["done"]) * 1e3 for r in from_d]
        lw_part = [((r["w_recv"] - r["done"]) + (r["tok0"] - r["a_send"])) * 1e3
                   for r in from_d]
        lines += [f"  {'D: last DONE -> first token at the client':<60} {_stats(after)}",
                  f"  {'   of which lw (report, proxy, relay)':<60} {_stats(lw_part)}"]
    tpot = [(r["tok3"] - r["tok1"]) * 1e3 / 2 for r in rows]
    lines.append(f"  {'D: decode step (TPOT, tokens 1-3)':<60} {_stats(tpot)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import httpx

    from benchmarks._plan import Shape, make_prompts
    from lw.lab.demo_client import MODEL_NAME
    from lw.lab.local_cluster import LocalCluster
    from lw.lab.tiny_model import make_tiny_model

    work = args.workdir or Path(tempfile.mkdtemp(prefix="lw-steptrace-"))
    work.mkdir(parents=True, exist_ok=True)
    trace = work / "steptrace.log"
    trace.unlink(missing_ok=True)
    os.environ["LW_STEPTRACE"] = str(trace)  # the cluster's processes inherit both
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(SHIM), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    model = make_tiny_model(work / "tiny-32l", num_layers=32)
    proxy_args = ["--start-mode", args.start_mode]
    cluster = LocalCluster(model=model, workdir=work / "logs", reference=False,
                           proxy_args=proxy_args)
    prompts = make_prompts(model, Shape(args.tokens, 1, args.requests + 2), "steptrace")

    def mark(name: str, i: int) -> None:
        with open(trace, "a") as f:
            f.write(f"{time.monotonic():.6f} {os.getpid()} {name} {i}\n")

    cluster.start(timeout=300)
    try:
        with httpx.Client(timeout=120) as client:
            for i, prompt in enumerate(prompts):
                body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4,
                        "temperature": 0.0, "ignore_eos": True, "stream": True}
                k = 0
                mark("sent", i)
                with client.stream("POST", cluster.url("proxy") + "/v1/completions",
                                   json=body) as r:
                    for line in r.iter_lines():
                        data = line[5:].strip() if line.startswith("data:") else "[DONE]"
                        if data == "[DONE]":
                            continue
                        if any(c.get("text") for c in json.loads(data).get("choices", ())):
                            mark(f"tok{k}", i)
                            k += 1
                time.sleep(0.2)  # D idle again: each request meets the same engine state
    finally:
        cluster.stop()
    rows = milestones(read_events(trace.read_text().splitlines()))[2:]  # 2 warm-ups
    print(f"lw P/D, {args.tokens}-token prompts, start mode {args.start_mode}; trace {trace}")
    print(report(rows))
    return 0 if rows else 1


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=14, help="measured requests")
    ap.add_argument("--tokens", type=int, default=1024, help="prompt length")
    ap.add_argument("--start-mode", default="d-first",
                    choices=("d-first", "admit-ahead", "compute-ahead"))
    ap.add_argument("--workdir", type=Path, default=None)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
