"""P's layer writes on their way through the data plane: grouped into one transfer per D session,
timed from submit to completion, and fed to the link meter that ``push_mode: auto`` reads.

The worker loop (lw.transport.runtime) owns one :class:`WritePath`; the core decides what is
written and what a completion means, this only moves and measures."""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any

from lw.fsm import WriteLayer
from lw.fsm.messages import KVLayout
from lw.transport.dataplane import Completion
from lw.transport.kvmemory import Entry, KVMemory
from lw.transport.linkmeter import LinkMeter, host_of

__all__ = ["WritePath"]

Failure = tuple[str, int, str]
"""A write that could not start: (request id, write seq, why)."""


class WritePath:
    """Submits layer writes (one data-plane transfer per D session and tick) and accounts their
    completions; ``counters`` is the loop's (layer_writes, transfers_*, bytes_ok)."""

    def __init__(self, memory: KVMemory, counters: dict[str, int | float]) -> None:
        self.memory = memory
        self.counters = counters
        # goodput per D host (what push_mode "auto" needs to know when a push must start)
        self.link = LinkMeter()
        # per-transfer write latency (submit -> completion), drained by metrics; keyed by the id
        # of the transfer's pairs tuple, which the data plane keeps alive until it completes
        # -> (when, D host, D worker's side-channel address)
        self._submitted_at: dict[int, tuple[float, str, str]] = {}
        self.latencies: deque[float] = deque(maxlen=4096)
        self._sessions: dict[str, str] = {}  # D side-channel addr -> transfer-engine session
        self._hinted: set[str] = set()  # sessions whose memory regions the plane was told

    def submit(self, writes: list[WriteLayer], dp: Any | None, now: float) -> list[Failure]:
        """Start ``writes`` on data plane ``dp`` (the loop's, which a test or a reconnect may
        swap); the ones that could not start (bad addressing, no data plane, the plane
        refused), for the core's ``transfer_done(..., ok=False)``. ``now`` is the loop's clock,
        the one the writes' ``not_after`` is on."""
        groups: dict[str, tuple[list[tuple[str, int]], list[Entry], str, str]] = {}
        not_after: dict[str, float] = {}
        failed: list[Failure] = []
        memory, counters = self.memory, self.counters
        for w in writes:
            counters["layer_writes"] += 1
            try:
                entries = memory.entries(w)
                if w.checksum:
                    memory.sum_write(w)
            except Exception as exc:  # bad layout or block ids: this write fails, nothing else
                failed.append((w.req_id, w.seq, f"cannot address blocks: {exc}"))
                continue
            session = w.layout.te_session
            g = groups.get(session)
            if g is None:
                g = groups[session] = ([], [], host_of(w.target), w.target)
            g[0].append((w.req_id, w.seq))
            g[1].extend(entries)
            not_after[session] = min(not_after.get(session, math.inf), w.not_after)
        # The link meter sees one batch per host and tick (D's TP ranks are sessions of one
        # host): a busy period starts with the tick's first submit, whatever its session.
        batches: dict[str, tuple[float, int]] = {}
        for session, (pairs, entries, host, target) in groups.items():
            if dp is None:
                failed.extend((r, k, "no data plane") for r, k in pairs)
                continue
            xfer = tuple(pairs)
            try:
                mono = time.monotonic()
                self._submitted_at[id(xfer)] = (mono, host, target)
                # the plane's clock is its own: hand it the time left, not the instant
                dp.submit(xfer, session, entries, not_after[session] - now)
                first, n = batches.get(host, (mono, 0))
                batches[host] = (first, n + 1)
                counters["transfers_submitted"] += 1
            except Exception as exc:
                self._submitted_at.pop(id(xfer), None)
                failed.extend((r, k, f"data plane refused the transfer: {exc}") for r, k in pairs)
        for host, (mono, n) in batches.items():
            self.link.submitted(host, mono, n)  # (completions are polled on the same thread)
        counters["write_setup_failures"] += len(failed)
        return failed

    def warm_up(self, addr: str, layout: KVLayout | None, dp: Any | None) -> bool:
        """D at side-channel ``addr`` accepted a claim (``layout``: if it sent one): open its
        transfer-engine segment now, off the forward pass; True when a connect was started."""
        if layout is not None:
            self._sessions[addr] = layout.te_session
        session = self._sessions.get(addr)
        if session is None or dp is None:
            return False
        if layout is not None and session not in self._hinted:
            hint = getattr(dp, "hint_remote_regions", None)
            if hint is not None:
                # One region per layer: never merge entries across two layers' registrations.
                hint(session, [(lay.base_addr, lay.block_stride * lay.num_blocks)
                               for lay in layout.layers])
            self._hinted.add(session)
        dp.connect(session)
        return True

    def completed(self, c: Completion) -> str:
        """Account one of our transfers' completion (counters, latency, link meter); the
        side-channel address of the D worker a write that succeeded landed in ("" if none):
        its process took the bytes, so it is alive however quiet its protocol thread is."""
        counters = self.counters
        if c.ok:
            counters["transfers_ok"] += 1
            counters["bytes_ok"] += c.nbytes
        else:
            counters["transfers_failed"] += 1
        sub = self._submitted_at.pop(id(c.xfer_id), None)
        if sub is None:
            return ""
        mono = time.monotonic()
        self.link.completed(sub[1], c.nbytes if c.ok else 0, mono)
        if not c.ok:
            return ""
        self.latencies.append(mono - sub[0])
        return sub[2]
