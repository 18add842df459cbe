"""``lw status`` inside the synthetic cluster: a live table while a fault is active, the
Chrome trace of every request's timeline at the end (``lw demo --status / --trace-out``), and
the workers' timelines as an ``lw-trace`` file for ``lw validate`` (``--validate``)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from lw.contract import tracefile
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


# What each fault of the table can do, in the kinds of faults the checker's world knows: the
# world of lw validate gets these and no others (a run without faults is validated without any).
_KINDS: dict[str, tuple[str, ...]] = {
    "none": (),
    # a killed D's frames still queued in ZMQ reach the new process on the same port: dup
    "kill-decoder": ("crash", "write", "dup"),
    # a frozen D is suspected by its peers' heartbeats while it lives
    "freeze-decoder-before-contact": ("write", "suspect"),
    "freeze-decoder-mid-transfer": ("write", "suspect"),
    "freeze-kill-decoder": ("crash", "write", "dup", "suspect"),
    "kill-prefill-rank": ("crash", "write"),
    "drop-messages": ("drop",),
    "duplicate-messages": ("dup",),
    "garbage-messages": ("drop",),  # a garbled frame is refused by its receiver: lost
    "no-cluster-key": ("drop",),  # an unsigned frame is refused: lost
    "partition-before-contact": ("drop", "write", "suspect"),
    "partition-mid-transfer": ("drop", "write", "suspect"),
    "partition-long": ("drop", "write", "suspect"),
    "lossy-link": ("drop", "write", "suspect"),
    "slow-link": ("drop", "write", "suspect"),
    "mix": ("drop", "dup", "corrupt"),
    "corrupt-write": ("corrupt",),
}


def fault_kinds(cfg: Any) -> tuple[str, ...]:
    """The world's fault kinds that the run of ``cfg`` (a ClusterConfig) may contain."""
    kinds = _KINDS.get(cfg.fault, tracefile.FAULT_KINDS)
    # client aborts; with several decoders the proxy also aborts P's part of a request it
    # moves to another decoder (a P-side abort, as the world's abort_p)
    moves = cfg.decoders > 1 and cfg.fault in ("kill-decoder",)
    return kinds + (("abort",) if cfg.abort_rate > 0 or moves else ())


def write_timelines(addrs: list[str], key: bytes | None, path: str, source: str,
                    cfg: Any) -> int:
    """Write every answering worker's timeline as an ``lw-trace`` file (``cfg``: the run's
    ClusterConfig); the number of workers that answered."""
    workers = tracefile.from_snapshot(query(addrs, key, timeline=MAX_TIMELINE, timeout_s=5.0))
    shape = {"layers": cfg.layers, "prefill_tp": cfg.prefill_tp, "decode_tp": cfg.decode_tp,
             "blocks_per_request": cfg.blocks_per_request, "chunks": cfg.chunks,
             "mla": cfg.mla, "kv_heads": cfg.kv_heads,
             "transfer_timeout_s": cfg.transfer_timeout_s}
    tracefile.dump(path, source, shape, asdict(cfg.prefill_config()),
                   asdict(cfg.decode_config()), workers, fault_kinds(cfg))
    return len(workers)
