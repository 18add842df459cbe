"""The metaserver's re-prefill call (prefill failover): a decode engine whose core lost the P
of a sub-transfer asks again, with a higher claim epoch and the P engines to avoid; the proxy
starts that prefill on another P and forgets the old attempt (contract: lw.proxy.server,
item 3). Which P each attempt went to goes back in the answer, so that D's core watches it."""

from __future__ import annotations

from typing import Any

from lw.contract.params import prefill_params, sign_params
from lw.proxy.backend import Backend
from lw.proxy.exchange import run_prefill
from lw.proxy.state import ProxyState, SubPrefill, Transfer, log

__all__ = ["MAX_RETRY", "failover_problem", "reprefill", "route_fields"]

MAX_RETRY = 64
"""The largest retry budget (and so claim epoch) a decode engine may declare (the core's)."""


def _small_int(value: Any, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= hi


def failover_problem(msg: dict[str, Any]) -> str:
    """Why a metaserver body's failover fields (``retry_prefill``, ``epoch``, ``avoid``,
    ``reason``) are malformed, or "" if they are well formed (or absent)."""
    if not _small_int(msg.get("retry_prefill", 0), MAX_RETRY):
        return f"'retry_prefill' must be an integer in 0..{MAX_RETRY}"
    if not _small_int(msg.get("epoch", 0), MAX_RETRY):
        return f"'epoch' must be an integer in 0..{MAX_RETRY}"
    avoid = msg.get("avoid", [])
    if (not isinstance(avoid, list) or len(avoid) > MAX_RETRY
            or not all(isinstance(a, str) and 0 < len(a) <= 256 for a in avoid)):
        return f"'avoid' must be a list of at most {MAX_RETRY} engine ids"
    if not isinstance(msg.get("reason", ""), str):
        return "'reason' must be a string"
    return ""


def route_fields(sub: SubPrefill) -> dict[str, Any]:
    """What a metaserver answer says of an attempt: its epoch and, once the proxy learned them
    from that server's responses, its P engine id and TP rank 0 side channel."""
    out: dict[str, Any] = {"epoch": sub.epoch}
    ident = sub.backend.identity()
    if ident is not None:
        out["prefill_engine_id"], out["prefill_worker"] = ident
    return out


def _choose(state: ProxyState, tr: Transfer, sub: SubPrefill, avoid: set[str]) -> Backend:
    """A prefill server for the next attempt: none whose engine D avoids, nor (when D avoids
    any) an earlier attempt's server whose engine the proxy never learned (it may be the lost
    one); among the rest, one this sub-transfer has not tried if there is one, else not the
    last attempt's server if there is one, then the usual pick. ValueError if none is left."""
    cands = list(state.prefills)
    if tr.prefill_target is not None and tr.prefill_target not in cands:
        cands.insert(0, tr.prefill_target)  # sidecar: the server the request named
    banned = {b for b in cands if b.engines.keys() & avoid}
    if avoid:
        banned |= {b for b in (*sub.tried, sub.backend) if not b.engines}
    # With nothing to avoid (retry_prefill_avoid "none") the last attempt's server may still
    # hold that attempt (its abort drains the writes in flight) and would refuse the same
    # transfer id until then: the request would wait for D's deadline. Another server first.
    for prefer in ({*sub.tried, sub.backend}, {sub.backend}, set()):
        if any(b not in banned and b not in prefer for b in cands):
            return state.pick(cands, exclude=banned | prefer)
    raise ValueError("no prefill server left outside the engines to avoid")


def reprefill(state: ProxyState, tr: Transfer, msg: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """Handle a (signed, granted) call with ``epoch`` > 0: (HTTP status, answer)."""
    sub_id, epoch = msg["sub_transfer_id"], msg["epoch"]
    head = {"transfer_id": tr.request_id, "sub_transfer_id": sub_id}
    old = tr.prefills.get(sub_id)
    if old is None:
        return 404, {"status": "error", **head, "detail": "unknown sub-transfer: a re-prefill "
                     "(epoch > 0) names a sub-transfer whose prefill this proxy started"}
    if epoch < old.epoch:
        return 409, {"status": "error", **head, "detail": f"stale epoch {epoch}: the "
                     f"sub-transfer is at epoch {old.epoch}"}
    if epoch == old.epoch:  # a repeated call (D retries after a lost answer): idempotent
        return 202, {"status": "ok", **head, "prefill_url": old.backend.url,
                     "detail": f"prefill already {old.state}", **route_fields(old)}
    if epoch > old.budget:
        return 403, {"status": "error", **head, "detail": f"epoch {epoch} beyond the decode "
                     f"engine's retry budget {old.budget} (its first call's retry_prefill)"}
    avoid = set(msg.get("avoid", []))
    try:
        backend = _choose(state, tr, old, avoid)
    except ValueError:
        return 503, {"status": "error", **head, "detail": "no prefill server left outside "
                     f"the engines to avoid ({', '.join(sorted(avoid)) or 'none'})"}
    if old.task is not None and not old.task.done():
        old.task.cancel()  # closes its connection: P aborts the old attempt; its outcome is moot
    body = dict(old.body)
    params = body.get("kv_transfer_params", {})
    body["kv_transfer_params"] = sign_params(
        state.verifier.key, "prefill", prefill_params(params, params.get("transfer_id", sub_id),
                                                      epoch))
    sub = SubPrefill(sub_id, backend, epoch=epoch, budget=old.budget, body=body,
                     tried=(*old.tried, old.backend))
    tr.prefills[sub_id] = sub
    state.counters["prefills"] += 1
    state.counters["prefill_failovers"] += 1
    state.timeline.mark(sub_id, "reprefill")
    log.warning("request %s (sub-transfer %s): prefill epoch %d moved from %s to %s: %s",
                tr.request_id, sub_id, epoch, old.backend.url, backend.url,
                str(msg.get("reason", ""))[:300])
    sub.task = state.spawn(run_prefill(state, tr, sub, body))
    return 202, {"status": "ok", **head, "prefill_url": backend.url,
                 "detail": f"prefill epoch {epoch} started", **route_fields(sub)}
