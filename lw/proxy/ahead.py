"""Admission ahead of D (``--start-mode admit-ahead``): the proxy sends a request's prefill to P
together with its request to D; P admits it and keeps it waiting, holding no blocks, until it
fetches D's params here (lw.contract.ahead), which the proxy hands over once D's metaserver call
arrives. P's admission (HTTP, its engine's queue) then overlaps D's instead of following it.
With ``compute-ahead`` P also computes at once, into its own blocks, and writes once the
fetched params bind it (its POST may end before D's call: P holds the KV until then).

Decided here: whether a request goes ahead (one sub-transfer, a free slot on its P), and whether
D's call binds the waiting P (P still waiting, the same prompt digest, in time) or falls back to
today's order (the ahead request is cancelled, the prefill started as in D-first mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from typing import Any

from lw.contract.ahead import AheadFetch, ahead_url, sign_ahead_params
from lw.contract.sampling import p_sampling_fields
from lw.proxy.backend import AHEAD_MISSES
from lw.proxy.exchange import _post_bounded, run_prefill
from lw.proxy.state import (
    PREFILL_KEPT,
    START_MODES,
    AheadPrefill,
    ProxyState,
    SubPrefill,
    Transfer,
    ahead_fallback,
    log,
)

__all__ = ["START_MODES", "bind", "build_ahead_body", "fetch", "start"]

# What P gets of the client's request: only the fields that decide the prompt's tokens (P must
# tokenize it as D does; a field missed here makes P's digest differ, and the proxy falls back
# to D first), PREFILL_KEPT, and the sampling fields that decide token 1 (P samples it for D:
# lw.contract.sampling), as a D-first prefill has. Output and structured-output fields change
# nothing in either, and none of the client's other fields reach P's engine.
AHEAD_KEPT = ("model", "prompt", "messages", "add_special_tokens", "truncate_prompt_tokens",
              "truncation_side", "chat_template", "chat_template_kwargs",
              "add_generation_prompt", "continue_final_message", "documents",
              "reasoning_effort", "tools", "tool_choice", "media_io_kwargs",
              "mm_processor_kwargs", *PREFILL_KEPT)


def build_ahead_body(tr: Transfer, url: str, grant: str, key: bytes | None,
                     compute: bool = False) -> dict[str, Any]:
    """The body P gets ahead: the client's prompt and what decides its tokens (AHEAD_KEPT: P
    tokenizes it as D does), one token, not streamed, and the signed ahead params
    (``compute``: P computes at once)."""
    out = {k: v for k, v in tr.body.items() if k in AHEAD_KEPT}
    out.update(p_sampling_fields(tr.body))
    out.update(max_tokens=1, n=1, stream=False)
    out["kv_transfer_params"] = sign_ahead_params(key, url, tr.request_id, grant, compute)
    return out


def start(state: ProxyState, tr: Transfer) -> None:
    """Send ``tr``'s prefill to P now, if it can go ahead: one sub-transfer (D makes one call
    whose prompt P can match), a prefill server of lw's, a free ahead slot on it, a P with
    fewer than ``ahead_p_busy`` prefills queued or computing, and a D not backlogged (fewer
    than ``ahead_d_backlog`` requests it has not allocated for)."""
    if tr.local or tr.allowance != 1:
        return
    backend = tr.prefill_target or state.pick(state.prefills)
    if not backend.ahead_on(asyncio.get_running_loop().time()):
        state.counters["ahead_skipped_p_off"] += 1
        return
    if backend.ahead_waiting >= state.ahead_limit:
        state.counters["ahead_skipped_full"] += 1
        return
    if backend.load >= state.ahead_p_busy:
        # P is busy: going ahead gains nothing (it would wait in P's queue) and would put it
        # before requests that came first and went D first (measured: a higher TTFT p50 at
        # concurrency 16)
        state.counters["ahead_skipped_p_busy"] += 1
        return
    backlog = sum(1 for t in state.transfers.values()
                  if t is not tr and t.decode is tr.decode and t.unallocated())
    if backlog >= state.ahead_d_backlog:
        state.counters["ahead_skipped_d_backlog"] += 1
        return
    a = AheadPrefill(backend, compute=state.start_mode == "compute-ahead")
    a.answer = asyncio.get_running_loop().create_future()
    body = build_ahead_body(tr, ahead_url(state.metaserver_url), a.grant, state.verifier.key,
                            a.compute)
    headers = {**tr.headers, "X-Request-Id": tr.request_id}
    backend.ahead_waiting += 1
    a.task = asyncio.ensure_future(_post_bounded(state, backend.url + tr.api, body, headers))
    a.task.add_done_callback(lambda t: _ended_unbound(state, tr, a, t))
    tr.ahead = a
    state.counters["ahead_started"] += 1
    state.timeline.mark(tr.request_id, "p_ahead_sent")


def _ended_unbound(state: ProxyState, tr: Transfer, a: AheadPrefill,
                   task: asyncio.Task[tuple[int, bytes]]) -> None:
    """P's ahead POST ended before D's call bound it: P failed, refused the params (a P
    without admit-ahead, or of another release), or computed it without waiting. A P computing
    ahead ends it with its token and holds the KV for the bind: that is no fallback."""
    if a.state != "waiting" or a.usable():
        return
    a.release("fallback")
    a.resolve(ahead_fallback("P's ahead request ended"))
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        a.backend.failed(asyncio.get_running_loop().time())
        why = f"{type(exc).__name__}: {exc}"
    else:
        code, content = task.result()
        why = f"answered HTTP {code} before D's params: {content[:200]!r}"
    state.counters["ahead_unbound"] += 1
    log.warning("request %s: ahead prefill on %s %s; D's call will start it D first",
                tr.request_id, a.backend.url, why)
    _missed(state, a, why)


def _refused_request(task: asyncio.Task[tuple[int, bytes]]) -> bool:
    """P's ahead POST ended 4xx: a refusal of this request, not a fault of P's (a client
    sending such requests must not switch going ahead off for everyone)."""
    if not task.done() or task.cancelled() or task.exception() is not None:
        return False
    return 400 <= task.result()[0] < 500


def _missed(state: ProxyState, a: AheadPrefill, why: str) -> None:
    """``a`` was not usable for a reason of P's (unless P refused the request, 4xx): after
    AHEAD_MISSES in a row its P's prefills start D first for a while, longer each time (a P
    that cannot reach the control port, or of a release without compute-ahead, would
    otherwise cost every request the same)."""
    if a.task is not None and _refused_request(a.task):
        return
    backend = a.backend
    off = backend.ahead_missed(asyncio.get_running_loop().time())
    if off:
        state.counters["ahead_switched_off"] += 1
        log.warning("prefill server %s: %d ahead prefills in a row not usable (the last: %s); "
                    "its prefills start D first for %g s. Check that it reaches the proxy's "
                    "control port (%s) and runs this release of lw", backend.url, AHEAD_MISSES,
                    why, off, state.metaserver_url)


def bind(state: ProxyState, tr: Transfer, msg: dict[str, Any], body: dict[str, Any]
         ) -> SubPrefill | None:
    """D's first call for ``tr``'s sub-transfer: the ahead prefill becomes it (None: there is
    none waiting; start it D first). ``body`` is the D-first prefill body the call makes."""
    a = tr.ahead
    if a is None or a.state != "waiting" or not a.usable():
        return None
    a.release("bound")
    sub = SubPrefill(msg["sub_transfer_id"], a.backend, budget=msg.get("retry_prefill", 0),
                     body=body)
    a.sub = sub
    sub.task = state.spawn(_run_bound(state, tr, sub, a, msg["kv_transfer_params"]
                                      ["lw_prompt_digest"]))
    return sub


async def _run_bound(state: ProxyState, tr: Transfer, sub: SubPrefill, a: AheadPrefill,
                     digest: str) -> None:
    """Hand D's params to the waiting P if it tokenized the same prompt; else cancel it and
    start the prefill D first on the same server (the one D was told of)."""
    assert a.task is not None
    try:
        await _fetched(a, state.limits.ahead_wait_s)
    except asyncio.CancelledError:  # the request ended meanwhile: P must not wait on
        a.resolve(ahead_fallback("the request ended"))
        a.task.cancel()
        raise
    if a.digest == digest and a.usable() and a.answer is not None and not a.answer.done():
        a.resolve({"status": "go", "kv_transfer_params": sub.body["kv_transfer_params"]})
        state.counters["ahead_bound"] += 1
        a.backend.ahead_used()
        await run_prefill(state, tr, sub, sub.body, post=a.task, api=tr.api)
        return
    late_d = a.digest == digest and a.usable()  # P fetched in time; D came after its wait
    why = ("P did not ask for D's params in time" if a.digest is None else
           "P's ahead request ended" if not a.usable() else
           "P tokenized another prompt than D" if a.digest != digest else
           "P's fetch had been answered (its wait ran out before D's call)")
    a.resolve(ahead_fallback(why))
    a.task.cancel()
    state.counters["ahead_fallbacks"] += 1
    log.warning("request %s: ahead prefill on %s not used (%s); started D first",
                tr.request_id, a.backend.url, why)
    if not late_d:  # (a D too late for P's wait is no fault of P's)
        _missed(state, a, why)
    await run_prefill(state, tr, sub, sub.body)


async def _fetched(a: AheadPrefill, wait_s: float) -> None:
    """Wait until P fetched D's params, its ahead POST ended unusable (P failed, or computed the
    prompt plainly: no fetch will come, and D need not wait for one), or ``wait_s`` passed."""
    assert a.task is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    if not a.task.done():
        waiter = asyncio.ensure_future(a.fetched.wait())
        try:
            await asyncio.wait((waiter, a.task), timeout=wait_s,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if a.fetched.is_set() or not a.usable():
            return
    # P's POST ended holding the KV (compute-ahead): its fetch is still to come
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(a.fetched.wait(), max(0.0, deadline - loop.time()))


async def fetch(state: ProxyState, call: AheadFetch) -> tuple[int, dict[str, Any]]:
    """P's fetch of D's params: (status, answer), once D's call bound the request, or a
    fallback when it does not within ``limits.ahead_wait_s`` (the ahead request is cancelled).
    A call that says P refused the bind restarts the prefill D first (:func:`_refused`)."""
    tr = state.transfers.get(call.transfer_id)
    a = tr.ahead if tr is not None else None
    if tr is None or a is None or a.answer is None:
        return 404, ahead_fallback("unknown transfer (ended, or not sent ahead)")
    if not hmac.compare_digest(call.grant.encode(), a.grant.encode()):
        return 403, ahead_fallback("not this transfer's ahead grant")
    if call.refused:
        return _refused(state, tr, a, call.refused)
    a.digest = call.prompt_digest
    a.fetched.set()
    try:
        return 200, await asyncio.wait_for(asyncio.shield(a.answer), state.limits.ahead_wait_s)
    except TimeoutError:
        why = f"no decode engine's call within {state.limits.ahead_wait_s:g} s"
        if a.state == "waiting":
            a.cancel(why)
            state.counters["ahead_expired"] += 1
        a.resolve(ahead_fallback(why))  # (bound meanwhile: _run_bound sees it answered)
        return 200, a.answer.result()


def _refused(state: ProxyState, tr: Transfer, a: AheadPrefill, why: str
             ) -> tuple[int, dict[str, Any]]:
    """P's core refused the bind of the params it was handed: it had dropped the request (past
    its ``ahead_wait_s``) and claimed no decoder, so D's blocks are untouched and the prefill
    starts again D first on the same server, once (the checker's compute-ahead world does the
    same; without this D waited for its prefill deadline)."""
    sub = a.sub
    if a.state != "bound" or sub is None or a.answer is None or not a.answer.done():
        return 409, ahead_fallback("no params were handed for this transfer")
    if a.restarted:
        return 200, ahead_fallback("started D first already")
    a.restarted = True
    state.counters["ahead_refused_binds"] += 1
    log.warning("request %s: P %s refused the bind of its ahead prefill (%s); started D first",
                tr.request_id, a.backend.url, why[:200])
    sub.task = state.spawn(run_prefill(state, tr, sub, sub.body))
    return 200, ahead_fallback("started D first")
