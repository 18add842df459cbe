"""``lw status`` output: the live table, one request's history, Mermaid timelines, Chrome traces.

Pure functions of a :class:`~lw.ops.client.Snapshot`. Times of timeline entries are on each
worker's monotonic clock; ``wall`` and ``now`` of its reply place them on the wall clock, so the
events of P and D workers merge into one history.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import msgspec

from lw import seqdiagram
from lw.contract.transfer_ids import is_sub_transfer_of
from lw.fsm.messages import FirstTokenStatus, RequestStatus, StatusReply
from lw.fsm.status import status_line
from lw.ops.client import Snapshot

__all__ = ["chrome_trace", "first_token_lines", "history", "mermaid_timeline", "table",
           "to_json"]

# A timeline row: (wall time, worker label, participant id, entry)
_Event = tuple[float, str, str, Any]


def worker_label(r: StatusReply) -> str:
    """``P engine rank N`` / ``D engine rank N``."""
    return f"{'P' if r.role == 'prefill' else 'D'} {r.worker.engine_id} rank {r.worker.rank}"


def _secs(x: float) -> str:
    return f"{x:.1f}s" if x >= 0 else f"-{-x:.1f}s"


def _p_progress(snap: Snapshot) -> dict[str, list[str]]:
    """Per request: what its P senders say about their progress (to annotate D's rows)."""
    out: dict[str, list[str]] = {}
    for r in snap.replies:
        if r.role != "prefill":
            continue
        for row in r.requests:
            out.setdefault(row.req_id, []).append(
                f"P rank {r.worker.rank}: {row.layers_done} of {row.layers_total} layers written")
    return out


def table(snap: Snapshot, width: int = 160) -> str:
    """The live-request table, one row per (worker, request), then who did not answer."""
    head = ("SIDE", "WORKER", "REQUEST", "STATE", "IN STATE", "DEADLINE", "BLOCKS", "WAITING FOR")
    rows: list[tuple[str, ...]] = []
    progress = _p_progress(snap)
    quarantines: list[str] = []
    for r in snap.replies:
        side = "P" if r.role == "prefill" else "D"
        who = f"{r.worker.engine_id}/{r.worker.rank}"
        for q in sorted(r.requests, key=lambda q: -q.in_state_s):
            what = q.waiting_for
            if side == "D" and q.req_id in progress and not q.quarantined:
                what += "; " + "; ".join(progress[q.req_id])
            state = q.state + (" (stuck)" if q.stuck else "")
            rows.append((side, who, q.req_id, state, _secs(q.in_state_s),
                         ("lease " if q.quarantined else "") + _secs(q.deadline_in_s),
                         str(q.blocks), what))
            if q.quarantined:
                quarantines.append(f"{who} {q.req_id}: {q.blocks} blocks, lease ends in "
                                   f"{_secs(q.deadline_in_s)}")
    widths = [max(len(head[i]), *(len(x[i]) for x in rows)) if rows else len(head[i])
              for i in range(len(head) - 1)]
    fixed = sum(widths) + 2 * len(widths)
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=False)) + "  " + head[-1]]
    for x in rows:
        what = x[-1]
        if width and len(what) > max(40, width - fixed):
            what = what[: max(40, width - fixed) - 1] + "\u2026"
        lines.append("  ".join(c.ljust(w) for c, w in zip(x, widths, strict=False))
                     + "  " + what)
    live = sum(len(r.requests) for r in snap.replies)
    lines.append(f"{live} live request(s) on {len(snap.replies)} worker(s)"
                 + (f"; {len(quarantines)} quarantine(s)" if quarantines else ""))
    lines += [f"  quarantine {q}" for q in quarantines]
    for addr, why in snap.silent.items():
        lines.append(f"  no status from {addr}: {why}")
    if any(r.truncated for r in snap.replies):
        lines.append("  (some workers left rows out to fit one message)")
    lines += first_token_lines(snap)
    return "\n".join(lines)


_FT_COUNTS = (("first_token_from_p", "from P"), ("last_token_recomputed", "last token recomputed"),
              ("ended_at_first_token", "ended at token 1"),
              ("first_token_discarded", "discarded"),
              ("first_token_waits_expired", "waits expired"))


def _ft_line(who: str, ft: FirstTokenStatus) -> str:
    if ft.role == "prefill":
        mode = "on: sends each pushed request's sampled token to D" if ft.on else \
            f"off ({ft.why_off}): D samples token 1 itself"
        return f"  {who}: {mode}"
    mode = "on" if ft.on else f"off ({ft.why_off})"
    counts = ", ".join(f"{label} {getattr(ft, key)}" for key, label in _FT_COUNTS)
    fb = ", ".join(f"{r} {n}" for r, n in sorted(ft.fallbacks.items())) or "none"
    return f"  {who}: {mode}; {counts}; fallbacks: {fb}"


def first_token_lines(snap: Snapshot) -> list[str]:
    """Per engine (and data-parallel scheduler) that answered: whether the first token from P
    is on, or why not, and D's counts since the engine started. Its workers relay the same
    figures, each as of the last step it saw: the highest are the newest."""
    best: dict[tuple[str, str, int], FirstTokenStatus] = {}
    engines: dict[tuple[str, str], None] = {}
    for r in snap.replies:
        engines[(r.role, r.worker.engine_id)] = None
        ft = r.first_token
        if ft is None:
            continue
        key = (r.role, r.worker.engine_id, ft.dp_rank)
        old = best.get(key)
        if old is None or _ft_total(ft) > _ft_total(old):
            best[key] = ft
    if not engines:
        return []
    lines = ["first token from P:"]
    for role, engine in engines:
        side = "P" if role == "prefill" else "D"
        mine = sorted((k[2], ft) for k, ft in best.items() if k[:2] == (role, engine))
        if not mine:
            lines.append(f"  {side} {engine}: not reported yet (its scheduler has not stepped "
                         f"since the engine started)")
        for dp, ft in mine:
            lines.append(_ft_line(f"{side} {engine}" + (f" dp {dp}" if len(mine) > 1 or dp
                                                        else ""), ft))
    return lines


def _ft_total(ft: FirstTokenStatus) -> int:
    return sum(getattr(ft, key) for key, _ in _FT_COUNTS) + sum(ft.fallbacks.values())


def status_lines(snap: Snapshot) -> Iterator[str]:
    """Every live request as the one-line form the stuck alarm logs."""
    for r in snap.replies:
        for q in r.requests:
            yield status_line(r.role, r.worker, q)


def _about(rid: str, req_id: str) -> bool:
    """Whether ``rid`` is the request asked about, or a sub-transfer of that transfer id (what
    a proxy's client sees as ``x-request-id``)."""
    return rid == req_id or is_sub_transfer_of(rid, req_id)


def _events(snap: Snapshot, req_id: str) -> list[_Event]:
    out: list[_Event] = []
    for i, r in enumerate(snap.replies):
        shift = r.wall - r.now
        pid = f"{'P' if r.role == 'prefill' else 'D'}{i}"
        for e in r.timeline:
            if not req_id or any(_about(x, req_id) for x in e.req_ids):
                out.append((e.t + shift, worker_label(r), pid, e))
    out.sort(key=lambda x: x[0])
    return out


def history(snap: Snapshot, req_id: str) -> str:
    """One request (or a proxy's transfer: its sub-transfers) across every worker: its
    current rows, why it failed where it did, then every remembered event."""
    lines = [f"request {req_id}"]
    now_rows: list[tuple[StatusReply, RequestStatus]] = [
        (r, q) for r in snap.replies for q in r.requests if _about(q.req_id, req_id)]
    lines += [f"  now: {status_line(r.role, r.worker, q)}" for r, q in now_rows]
    if not now_rows:
        lines.append("  not live on any worker that answered")
    evs = _events(snap, req_id)
    # D's failures have kinds (its metrics' labels), sent beside the words; P's are its words
    lines += [f"  failed on {who}" + (f" ({e.failure})" if e.failure is not None else "")
              + f": {e.detail}" for _t, who, _pid, e in evs if e.event == "fail" and e.detail]
    t0 = evs[0][0] if evs else 0.0
    for t, who, _pid, e in evs:
        move = f"{e.src} -> {e.dst}" if e.dst and e.dst != e.src else e.src or ""
        lines.append(f"  +{(t - t0) * 1000:9.1f} ms  {who:<24} {e.event:<16} {move}"
                     + (f"  ({e.detail})" if e.detail else ""))
    if not evs:
        lines.append("  no timeline entries (not seen, forgotten, or timelines are off)")
    for addr, why in snap.silent.items():
        lines.append(f"  no status from {addr}: {why}")
    return "\n".join(lines)


_LAYER_EVENTS = ("layer_computed", "layer_written", "layer_sent")


def _collapse(evs: list[_Event]) -> list[tuple[float, str, Any, str]]:
    """(t, pid, first entry, text): runs of one worker's per-layer events become one row
    ("layer_computed x4 (0..3), layer_written x4 (0..3), now LAYER_3_SENT")."""
    out: list[tuple[float, str, Any, str]] = []
    run: list[_Event] = []

    def flush() -> None:
        if not run:
            return
        parts = []
        for kind in _LAYER_EVENTS:
            xs = [e for _t, _w, _p, e in run if e.event == kind]
            if not xs:
                continue
            if kind == "layer_sent":
                parts.append(f"now {xs[-1].dst}")
            else:
                lo, hi = xs[0].detail, xs[-1].detail
                parts.append(f"{kind} x{len(xs)} ({lo}..{hi})" if len(xs) > 1
                             else f"{kind} ({lo})")
        t, _w, pid, e = run[0]
        out.append((t, pid, e, ", ".join(parts)))
        run.clear()

    for ev in evs:
        t, _who, pid, e = ev
        if e.event in _LAYER_EVENTS and (not run or run[0][2] == pid):
            run.append(ev)
            continue
        flush()
        if e.event in _LAYER_EVENTS:
            run.append(ev)
            continue
        moved = (f" {e.src} -> {e.dst}" if e.src else f" -> {e.dst}") \
            if e.dst and e.dst != e.src else ""
        out.append((t, pid, e, f"{e.event}{moved}" + (f" ({e.detail})" if e.detail else "")))
    flush()
    return out


def _sender_pid(snap: Snapshot, detail: str, default: str) -> str:
    """The participant of ``P <engine> rank <r>`` named in a D event's detail."""
    for i, r in enumerate(snap.replies):
        if r.role == "prefill" and detail == f"P {r.worker.engine_id} rank {r.worker.rank}":
            return f"P{i}"
    return default


def mermaid_timeline(snap: Snapshot, req_id: str) -> str:
    """One request across P and D as a Mermaid sequence diagram (the counterexamples' renderer):
    a note per state change or milestone, an arrow where a message caused an event."""
    evs = _events(snap, req_id)
    if not evs:
        return f"%% no timeline entries for {req_id}"
    pids: dict[str, str] = {}
    for _t, who, pid, _e in evs:
        pids.setdefault(pid, who)
    first_p = next((p for p in pids if p.startswith("P")), None)
    first_d = next((p for p in pids if p.startswith("D")), None)
    out = seqdiagram.header(list(pids.items()))
    t0 = evs[0][0]
    for t, pid, e, what in _collapse(evs):
        ms = f"+{(t - t0) * 1000:.1f}ms"
        text = f"{ms} {what}"
        if pid.startswith("D") and e.event in ("claim", "sender_done") and e.detail:
            src = _sender_pid(snap, e.detail, first_p or pid)
            label = "MetaRequest" if e.event == "claim" else "DoneSending"
            out.append(seqdiagram.arrow(src, pid, f"{ms} {label}"))
        elif (pid.startswith("P") and first_d and e.event in ("meta_accepted", "ack")
              and e.dst != e.src):
            label = "MetaReply accepted" if e.event == "meta_accepted" else "Ack"
            out.append(seqdiagram.arrow(first_d, pid, f"{ms} {label}", dashed=True))
        out.append(seqdiagram.note(pid, text))
    return "\n".join(out)


def chrome_trace(snap: Snapshot) -> dict[str, Any]:
    """Chrome trace-event JSON (Perfetto, chrome://tracing): per worker a process, per request a
    thread, a span per declared state it was in, instants for milestones."""
    events: list[dict[str, Any]] = []
    tids: dict[str, int] = {}
    for pid, r in enumerate(snap.replies, start=1):
        shift = r.wall - r.now
        events.append({"ph": "M", "name": "process_name", "pid": pid,
                       "args": {"name": worker_label(r)}})
        open_span: dict[str, tuple[str, float]] = {}
        for e in r.timeline:
            ts = (e.t + shift) * 1e6
            for rid in e.req_ids:
                tid = tids.setdefault(rid, len(tids) + 1)
                if e.event in ("admitted", "allocated"):
                    open_span[rid] = (e.dst, ts)
                    events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                                   "args": {"name": rid}})
                elif e.dst and e.dst != e.src and rid in open_span:
                    state, t0 = open_span[rid]
                    events.append({"ph": "X", "name": state, "cat": r.role, "pid": pid,
                                   "tid": tid, "ts": t0, "dur": max(ts - t0, 0.0),
                                   "args": {"exit": e.event, "detail": e.detail}})
                    open_span[rid] = (e.dst, ts)
                if e.event not in ("admitted", "allocated") and (e.dst == e.src or not e.dst):
                    events.append({"ph": "i", "s": "t", "name": e.event, "cat": r.role,
                                   "pid": pid, "tid": tid, "ts": ts,
                                   "args": {"detail": e.detail}})
        end = r.wall * 1e6
        for rid, (state, t0) in open_span.items():
            if state in ("DONE", "FAILED"):
                events.append({"ph": "i", "s": "t", "name": state, "cat": r.role, "pid": pid,
                               "tid": tids[rid], "ts": t0})
            else:  # still in this state when the worker answered
                events.append({"ph": "X", "name": state, "cat": r.role, "pid": pid,
                               "tid": tids[rid], "ts": t0, "dur": max(end - t0, 0.0),
                               "args": {"open": True}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def to_json(snap: Snapshot) -> str:
    """The snapshot as JSON for scripts (replies as sent, plus who did not answer)."""
    return json.dumps({"asked_at": snap.asked_at,
                       "workers": [msgspec.to_builtins(r) for r in snap.replies],
                       "silent": snap.silent}, indent=1)
