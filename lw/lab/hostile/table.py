"""The pure parts of ``lw hostile``: what came back and what moved during a case, the verdict
of a row, what a row expected and did not get, the table's lines, the summary line and the exit
status."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

MB = 1 << 20
MAX_RSS_GROWTH_MB = 20.0
MESSAGE_CHARS = 60
TARGETS = {"public": "proxy public", "control": "proxy control", "decode": "D vLLM port",
           "prefill": "P vLLM port", "sidecar": "sidecar"}
DIRECT = ("decode", "prefill")
"""Targets that are an engine's own port."""
FRAMED = (*DIRECT, "sidecar")
"""Targets whose cases are framed by plain steps on both engines, and during which an engine
*using* transfer parameters means a client's were used: straight to an engine, or through the
sidecar (no sidecar case names a prefill server it allows, so it starts no transfer of its
own)."""

# Engine counters that move only when lw's connector *uses* transfer parameters (plain requests,
# and parameters it refused, leave them alone).
D_USED = ("lw_metaserver_failures_total", "lw_requests_done_total", "lw_requests_failed_total",
          "lw_deadlines_fired_total", "lw_quarantines_total", "lw_prefill_retries_total")
P_USED = ("lw_transfers_total", "lw_transfer_failures_total", "lw_requests_done_total",
          "lw_requests_failed_total", "lw_deadlines_fired_total")
REFUSED = "lw_refused_params_total"
PROXY_COUNTERS = ("client_transfer_params_dropped", "client_transfer_params_refused",
                  "bodies_too_large", "metaserver_refused", "prefills")


@dataclass(frozen=True)
class Answer:
    """What came back: HTTP status (None: no answer), the start of its message, and for a
    streamed body the bytes the client handed to its socket before the answer."""

    status: int | None
    message: str = ""
    sent_bytes: int | None = None
    param: str | None = None  # the error's ``param`` (vLLM's / the proxy's shape)


@dataclass(frozen=True)
class Deltas:
    """What moved during one case."""

    canary: int = 0  # connections the canary accepted
    d_refused: int = 0
    p_refused: int = 0
    d_used: int = 0
    p_used: int = 0
    # the proxy's counters (the sidecar's, for a case sent to the sidecar)
    dropped: int = 0  # client_transfer_params_dropped
    proxy_refused: int = 0  # client_transfer_params_refused
    too_large: int = 0  # bodies_too_large
    meta_refused: int = 0  # metaserver_refused
    prefills: int = 0  # prefills started
    probes: str = ""  # health flood: backend probes seen


@dataclass
class Row:
    """One case's result."""

    key: str
    name: str
    target: str  # a TARGETS key
    sent: str
    answer: Answer
    deltas: Deltas = field(default_factory=Deltas)
    healthy: bool = True  # D, P and the proxy answered /health after the case
    honest_ok: bool | None = None  # an honest request through the proxy after it
    # RSS and CPU of the lw process the case concerns: the sidecar for a case sent to it, the
    # proxy otherwise
    rss_before_kb: int = 0
    rss_after_kb: int = 0
    rss_peak_kb: int = 0
    cpu_s: float = 0.0
    engine_rss_mb: float | None = None  # growth of the engine's API server (cases sent to it)
    expect: tuple[int, ...] = ()
    detail: str = ""  # why unhealthy / honest failure
    expect_param: str = ""  # the ``param`` the answer must name
    expect_moved: tuple[tuple[str, int], ...] = ()  # (Deltas field, how much it must move)

    @property
    def direct(self) -> bool:
        """Sent straight to an engine."""
        return self.target in DIRECT

    @property
    def framed(self) -> bool:
        """An engine's use counters moving during the case count as acting on it (see
        :data:`FRAMED`)."""
        return self.target in FRAMED

    @property
    def lw_process(self) -> str:
        """Whose counters and RSS the row shows: ``sidecar`` or ``proxy``."""
        return "sidecar" if self.target == "sidecar" else "proxy"

    @property
    def rss_growth_mb(self) -> float:
        """Growth of the RSS of the proxy (the sidecar, for a case sent to it) during the case
        (peak or end over before), MB."""
        top = max(self.rss_peak_kb, self.rss_after_kb)
        return max(0.0, (top - self.rss_before_kb) / 1024)


def deltas_between(before: Mapping[str, Any], after: Mapping[str, Any],
                   probes: str = "", counters: str = "proxy") -> Deltas:
    """What moved between two snapshots ``{"d": metrics, "p": metrics, "proxy": counters,
    "sidecar": counters, "canary": int}`` (engine metrics as
    :func:`~lw.lab.demo_client.metrics` reads them); ``counters``: whose counters
    (``proxy`` or ``sidecar``) the row shows."""

    def d(side: str, key: str) -> int:
        a = after.get(side) or {}
        b = before.get(side) or {}
        return round(float(a.get(key, 0) or 0) - float(b.get(key, 0) or 0))

    return Deltas(
        canary=int(after.get("canary", 0)) - int(before.get("canary", 0)),
        d_refused=d("d", REFUSED), p_refused=d("p", REFUSED),
        d_used=sum(max(0, d("d", k)) for k in D_USED),
        p_used=sum(max(0, d("p", k)) for k in P_USED),
        dropped=d(counters, "client_transfer_params_dropped"),
        proxy_refused=d(counters, "client_transfer_params_refused"),
        too_large=d(counters, "bodies_too_large"),
        meta_refused=d(counters, "metaserver_refused"),
        prefills=d(counters, "prefills"), probes=probes)


def acted(row: Row) -> bool:
    """Whether the case's hostile part was acted on: the canary was contacted, a control-port
    call or a sidecar case started a prefill (no sidecar case names a server it allows), or an
    engine used transfer parameters during a case sent to it straight or through the sidecar
    (through the proxy, the engines' work is the proxy's own, signed)."""
    d = row.deltas
    if d.canary > 0:
        return True
    if row.target in ("control", "sidecar") and d.prefills > 0:
        return True
    return row.framed and (d.d_used > 0 or d.p_used > 0)


def is_error(row: Row) -> bool:
    """A 5xx answer, or the cluster stopped serving after the case."""
    status = row.answer.status
    return (status is not None and status >= 500) or not row.healthy or row.honest_ok is False


def outcome(row: Row) -> str:
    """The verdict of a row: ``ACTED ON``, ``ERROR``, ``refused``, ``served`` (harmlessly) or
    ``no answer``."""
    if acted(row):
        return "ACTED ON"
    if is_error(row):
        return "ERROR"
    status = row.answer.status
    if status is None:
        return "no answer"
    if 400 <= status < 500:
        return "refused"
    return "served"


def verdict_text(row: Row) -> str:
    """The verdict with what made it so."""
    kind = outcome(row)
    d = row.deltas
    if kind == "ACTED ON":
        why = []
        if d.canary:
            why.append(f"canary contacted {d.canary}x")
        if row.target in ("control", "sidecar") and d.prefills:
            why.append(f"{d.prefills} prefill(s) started")
        if row.framed and d.d_used:
            why.append(f"D used params ({d.d_used})")
        if row.framed and d.p_used:
            why.append(f"P used params ({d.p_used})")
        return "ACTED ON: " + ", ".join(why)
    if kind == "ERROR":
        status = row.answer.status
        why = [f"HTTP {status}"] if status is not None and status >= 500 else []
        if not row.healthy:
            why.append("health check failed")
        if row.honest_ok is False:
            why.append("honest request failed")
        return "ERROR: " + ", ".join(why) + (f" ({row.detail})" if row.detail else "")
    if kind == "refused":
        return f"refused {row.answer.status}"
    if kind == "no answer":
        return "no answer (connection closed)"
    if d.dropped:
        return f"served; params dropped by {row.lw_process}"
    if d.d_refused or d.p_refused:
        who = "+".join(n for n, v in (("D", d.d_refused), ("P", d.p_refused)) if v)
        return f"served; params refused by {who} connector"
    return "served harmlessly"


LABELS = (("d_refused", "D refused"), ("p_refused", "P refused"), ("d_used", "D used"),
          ("p_used", "P used"), ("dropped", "{who} dropped"), ("proxy_refused", "{who} refused"),
          ("too_large", "{who} 413"), ("meta_refused", "metaserver refused"),
          ("prefills", "prefills"))
"""How :func:`reached_text` names each counting field of :class:`Deltas` (``{who}``: proxy or
sidecar)."""


def _label(name: str, who: str) -> str:
    return dict(LABELS, canary="canary").get(name, name).format(who=who)


def reached_text(d: Deltas, who: str = "proxy") -> str:
    """The counters that moved, compactly (the canary always); ``who``: whose counters the
    proxy's fields are (``proxy`` or ``sidecar``)."""
    parts = [f"canary {d.canary}"]
    for name, label in LABELS:
        value = getattr(d, name)
        if value:
            parts.append(f"{label.format(who=who)} {value:+d}")
    if d.probes:
        parts.append(d.probes)
    return ", ".join(parts)


def unmet(row: Row) -> list[str]:
    """What the row expected besides its status and did not get: the ``param`` its answer
    names, how much counters moved."""
    out = []
    if row.expect_param and row.answer.param != row.expect_param:
        out.append(f"param {row.answer.param or '-'}, expected {row.expect_param}")
    for name, want in row.expect_moved:
        got = getattr(row.deltas, name)
        if got != want:
            out.append(f"{_label(name, row.lw_process)} {got:+d}, expected {want:+d}")
    return out


def clip(text: str, n: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "~"


def answer_param(content: bytes | str) -> str | None:
    """The ``param`` of an error answer in vLLM's / the proxy's shape (``{"error": {"param":
    ...}}``); None if it names none."""
    text = content.decode("utf-8", "replace") if isinstance(content, bytes) else content
    try:
        body = json.loads(text) if text else None
    except ValueError:
        return None
    err = body.get("error") if isinstance(body, dict) else None
    param = err.get("param") if isinstance(err, dict) else None
    return None if param is None else str(param)


def answer_message(status: int | None, content: bytes | str, n: int = MESSAGE_CHARS) -> str:
    """The start of the message an answer carries: vLLM's / the proxy's ``error.message`` (with
    its ``param``), the control plane's ``detail``, or the text; ``(served) ...`` for a 2xx."""
    text = content.decode("utf-8", "replace") if isinstance(content, bytes) else content
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    if status is not None and 200 <= status < 300:
        choice = ""
        if isinstance(body, dict) and isinstance(body.get("choices"), list) and body["choices"]:
            c = body["choices"][0]
            if isinstance(c, dict):
                choice = str(c.get("text") or (c.get("message") or {}).get("content") or "")
        return clip(f"(served) {choice!r}" if choice else "(served)", n)
    msg = ""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            msg = str(err.get("message", ""))
            param = err.get("param")
            if param and str(param) not in msg:
                msg = f"[{param}] {msg}"
        elif isinstance(err, str):
            msg = err
        elif "detail" in body:
            det = body["detail"]
            msg = det if isinstance(det, str) else json.dumps(det)
        elif "message" in body:
            msg = str(body["message"])
    if not msg:
        msg = text
    return clip(msg, n)


def header() -> str:
    """The table's column titles."""
    return (f"{'#':>3} {'case':<30} {'to':<13} {'sent':<46} {'HTTP':>5} "
            f"{'answer (start)':<{MESSAGE_CHARS}} {'verdict':<42} {'honest':<6} "
            f"{'proxy/sidecar RSS MB, CPU':<32} reached")


def format_row(row: Row) -> str:
    """One table line (an expectation the row did not meet is appended, marked ``!``)."""
    reached = reached_text(row.deltas, row.lw_process)
    if row.engine_rss_mb is not None:
        who = "D" if row.target == "decode" else "P"
        reached += f", {who} API server RSS +{row.engine_rss_mb:.1f} MB"
    for miss in unmet(row):
        reached += f"; !{miss}"
    status = "-" if row.answer.status is None else str(row.answer.status)
    if row.expect and row.answer.status not in row.expect:
        status = "!" + status
    honest = {None: "-", True: "ok", False: "FAIL"}[row.honest_ok]
    rss = (f"{row.rss_before_kb / 1024:.1f}->{row.rss_after_kb / 1024:.1f} "
           f"(+{row.rss_growth_mb:.1f}) cpu {row.cpu_s:.2f}s")
    sent = row.sent
    if row.answer.sent_bytes is not None:
        sent = f"{sent} [{row.answer.sent_bytes / MB:.0f} MB out]"
    return (f"{row.key:>3} {clip(row.name, 30):<30} {TARGETS.get(row.target, row.target):<13} "
            f"{clip(sent, 46):<46} {status:>5} {row.answer.message or '-':<{MESSAGE_CHARS}} "
            f"{clip(verdict_text(row), 42):<42} {honest:<6} {rss:<32} "
            f"{reached}")


@dataclass(frozen=True)
class Summary:
    """The figures of the summary line."""

    cases: int
    refused: int
    reached_engine: int
    engine_errors: int
    leaked_blocks: int
    max_rss_growth_mb: float


def summarize(rows: Sequence[Row], leaked_blocks: int, late_uses: int = 0) -> Summary:
    """The summary of a run; ``late_uses``: uses found only over the whole run (P pushes the
    proxy never started)."""
    kinds = [outcome(r) for r in rows]
    return Summary(
        cases=len(rows),
        refused=sum(k in ("refused", "served") for k in kinds),
        reached_engine=sum(k == "ACTED ON" for k in kinds) + (1 if late_uses > 0 else 0),
        engine_errors=sum(is_error(r) for r in rows),
        leaked_blocks=leaked_blocks,
        max_rss_growth_mb=max((r.rss_growth_mb for r in rows), default=0.0))


def summary_line(s: Summary) -> str:
    """The last line of the run."""
    return (f"summary cases={s.cases} refused={s.refused} reached_engine={s.reached_engine} "
            f"engine_errors={s.engine_errors} leaked_blocks={s.leaked_blocks} "
            f"max_rss_growth_mb={s.max_rss_growth_mb:.1f}")


def exit_status(s: Summary) -> int:
    """0 iff nothing acted on a hostile field, nothing failed, nothing leaked and the proxy
    (the sidecar, in its cases) grew by less than :data:`MAX_RSS_GROWTH_MB` in every case."""
    ok = (s.reached_engine == 0 and s.engine_errors == 0 and s.leaked_blocks == 0
          and s.max_rss_growth_mb < MAX_RSS_GROWTH_MB)
    return 0 if ok else 1
