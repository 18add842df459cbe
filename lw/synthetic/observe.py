"""``lw status`` inside the synthetic cluster: a live table while a fault is active, and the
Chrome trace of every request's timeline at the end (``lw demo --status / --trace-out``)."""

from __future__ import annotations

import json

from lw.ops.client import MAX_TIMELINE, query
from lw.ops.render import chrome_trace, table


def status_table(addrs: list[str], key: bytes | None, title: str) -> str:
    """The ``lw status`` table of these workers, under a one-line title."""
    snap = query(addrs, key, timeout_s=1.0)
    return f"--- lw status: {title} ---\n{table(snap, width=0)}\n---"


def write_trace(addrs: list[str], key: bytes | None, path: str) -> tuple[int, int]:
    """Write the workers' timelines as Chrome trace JSON; (workers that answered, spans)."""
    snap = query(addrs, key, timeline=MAX_TIMELINE, timeout_s=5.0)
    trace = chrome_trace(snap)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace, f)
    return len(snap.replies), sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
