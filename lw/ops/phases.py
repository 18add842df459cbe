"""Where the time of a P/D request goes: phases from lw's own lifecycle events on P and D,
plus the proxy's view (client request, metaserver call, first token) when it is given.

Pure functions of a :class:`~lw.ops.client.Snapshot` taken with timelines (``lw status``'s
query) and the proxy's ``GET /lw/timeline`` events. Every time is put on the wall clock.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from lw.ops.client import Snapshot

# proxy events: transfer id (or sub-transfer id) -> event name -> wall time
ProxyEvents = Mapping[str, Mapping[str, float]]

# (phase name, from milestone, to milestone); milestones below
PHASES: tuple[tuple[str, str, str], ...] = (
    # the proxy's own part (signing D's params, the POST leaving), then D's: its HTTP server,
    # EngineCore, the scheduler's step that allocates the blocks
    ("client -> D POSTed (proxy)", "received", "d_sent"),
    ("D POSTed -> D allocated", "d_sent", "allocated"),
    ("D allocated -> metaserver called", "allocated", "meta_posted"),
    # the proxy's own part (a sub-transfer's checks, the POST leaving), then P's: its HTTP
    # server, EngineCore, the scheduler's next step and, since P's core admits a request when
    # its push starts, the chunks push_mode auto or last_chunk computes before that
    ("metaserver -> prefill POSTed (proxy)", "meta_posted", "p_sent"),
    ("prefill POSTed -> P admitted (push starts)", "p_sent", "admitted"),
    ("P admitted -> first layer computed", "admitted", "first_computed"),
    ("prefill compute (first -> last layer)", "first_computed", "last_computed"),
    ("transfer tail (last layer computed -> written)", "last_computed", "last_written"),
    ("last layer written -> D has every DONE", "last_written", "all_done"),
    ("D has every DONE -> first token at the proxy", "all_done", "first_token"),
)

# Token 1's own path when D streams P's sampled token (issue 59): where it spends the time that
# decides whether the client holds it before the KV has landed.
TOKEN_PHASES: tuple[tuple[str, str, str], ...] = (
    ("P's last layer computed -> P sent token 1", "last_computed", "token_sent"),
    ("P sent token 1 -> D's core took it", "token_sent", "token_taken"),
    ("D's core took it -> first token at the proxy", "token_taken", "first_token"),
)

FIRST_TOKEN_EVENT = "first_token"
"""The timeline event P records about its sampled token and D about taking it (lw.fsm
.prefill_first_token, lw.fsm.decode_first_token); its detail says which (held, sent, taken,
refused)."""
P_SENT = re.compile(r"^token -?\d+ to ")
"""P's detail when it sent the token: ``token 17 to tcp://... (epoch 1)`` (not ``token 17: held
until D accepts``, nor ``refused: ...``)."""
D_TAKEN = re.compile(r"^token -?\d+ of epoch \d+ from P ")
"""D's detail when its core took the token: ``token 17 of epoch 1 from P prefill`` (not ``...:
the epoch was given up``, nor ``refused: ...``)."""


@dataclass
class Milestones:
    """One sub-transfer's milestones (wall clock seconds); missing ones stay absent."""

    times: dict[str, float] = field(default_factory=dict)

    def earliest(self, name: str, t: float) -> None:
        """Keep the earliest ``t`` for ``name`` (several P workers: the first one)."""
        if name not in self.times or t < self.times[name]:
            self.times[name] = t

    def latest(self, name: str, t: float) -> None:
        """Keep the latest ``t`` for ``name`` (several P workers: the last one)."""
        if name not in self.times or t > self.times[name]:
            self.times[name] = t


def milestones(snap: Snapshot, proxy: ProxyEvents | None = None) -> dict[str, Milestones]:
    """Per sub-transfer id: its milestones from every worker's timeline and the proxy."""
    out: dict[str, Milestones] = {}
    renamed: dict[str, str] = {}  # a prefill computed ahead: its id before the bind -> D's
    for r in snap.replies:
        shift = r.wall - r.now
        for e in r.timeline:
            t = e.t + shift
            if e.event == "renamed":
                renamed[e.req_ids[0]] = str(e.detail)
                continue
            if e.event == "layer_computed":
                for rid in e.req_ids:
                    m = out.setdefault(rid, Milestones())
                    m.earliest("first_computed", t)
                    m.latest("last_computed", t)
                continue
            rid = e.req_ids[0]
            m = out.setdefault(rid, Milestones())
            if e.event == "allocated":
                m.earliest("allocated", t)
            elif e.event == "admitted":
                m.earliest("admitted", t)
            elif e.event == "layer_sent":
                m.latest("last_written", t)
            elif e.event == "all_done":
                m.latest("all_done", t)
            elif e.event == "ack" and e.dst == "DONE":
                m.latest("done_acked", t)
            elif e.event == FIRST_TOKEN_EVENT and P_SENT.match(str(e.detail)):
                m.earliest("token_sent", t)
            elif e.event == FIRST_TOKEN_EVENT and D_TAKEN.match(str(e.detail)):
                m.earliest("token_taken", t)
    for old, new in renamed.items():  # its ahead part's milestones are the request's
        before = out.pop(old, None)
        if before is not None:
            m = out.setdefault(new, Milestones())
            for name, t in before.times.items():
                m.times.setdefault(name, t)
    for key, events in (proxy or {}).items():
        # proxy events of a whole transfer apply to each of its sub-transfers
        subs = [rid for rid in out if rid == key or rid.startswith(key + "@")] or [key]
        for rid in subs:
            m = out.setdefault(rid, Milestones())
            for name, t in events.items():
                m.earliest(name, t)
    return out


def phase_means(ms: Mapping[str, Milestones],
                phases: Sequence[tuple[str, str, str]] = PHASES
                ) -> list[tuple[str, float, int]]:
    """(phase, mean seconds, requests that had both ends) for every phase of ``phases``."""
    rows = []
    for name, a, b in phases:
        xs = [m.times[b] - m.times[a] for m in ms.values() if a in m.times and b in m.times]
        rows.append((name, sum(xs) / len(xs) if xs else float("nan"), len(xs)))
    return rows


def format_phases(rows: list[tuple[str, float, int]], title: str = "") -> str:
    """The phase table as text (means in ms)."""
    lines = [title] if title else []
    lines.append(f"  {'phase':<48} {'mean ms':>9} {'n':>5}")
    total = 0.0
    for name, mean, n in rows:
        if n:
            total += mean
        lines.append(f"  {name:<48} {mean * 1e3 if n else float('nan'):>9.1f} {n:>5}")
    lines.append(f"  {'sum of the means':<48} {total * 1e3:>9.1f}")
    return "\n".join(lines)
