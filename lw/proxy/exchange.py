"""One client exchange of the D-first proxy: the D request relayed to the client, the prefills
the metaserver starts, client disconnects and failures (contract: lw.proxy.server)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import uuid
from collections.abc import Callable
from typing import Any

import httpx
from fastapi.responses import Response

from lw.contract.worker_addrs import PREFILL_ENGINE_KEY, PREFILL_WORKERS_KEY
from lw.proxy.bodies import describe_exc, quote_body
from lw.proxy.explain import (
    ERROR_EVENT,
    MAX_ERROR_EVENT,
    Failure,
    ask,
    error_code,
    explain,
    split_error_event,
)
from lw.proxy.state import (
    COMPLETIONS,
    Backend,
    ProxyState,
    Receive,
    Scope,
    Send,
    SubPrefill,
    Transfer,
    build_decode_body,
    error_body,
    log,
    prefill_answer_params,
)

__all__ = ["Exchange", "run_prefill"]


# ---------------------------------------------------------------------------------------------
# Prefill (started by the metaserver)


async def run_prefill(state: ProxyState, tr: Transfer, sub: SubPrefill, body: dict[str, Any],
                      post: asyncio.Future[tuple[int, bytes]] | None = None,
                      api: str = COMPLETIONS) -> None:
    """POST one sub-transfer's prefill request; record success or failure on ``tr`` (unless a
    re-prefill replaced this attempt, or D may still replace it: see ``_left_to_decode``).
    ``post``: the request is already on its way (an ahead prefill's POST to ``api``)."""
    backend = sub.backend
    url = backend.url + api
    headers = {**tr.headers, "X-Request-Id": tr.request_id}
    backend.in_flight += 1
    backend.requests += 1
    status = 502
    lost = True  # P did not answer, or answered 5xx: it may be gone (not: it refused the body)
    state.timeline.mark(sub.sub_id, "p_sent")
    try:
        try:
            code, content = await asyncio.wait_for(
                post or _post_bounded(state, url, body, headers), state.limits.prefill_total_s)
            state.timeline.mark(sub.sub_id, "p_done")
        except (TimeoutError, httpx.TimeoutException) as exc:
            status = 504
            why = describe_exc(exc) if str(exc) else (
                f"no whole answer within {state.limits.prefill_total_s:g} s")
            error = f"prefill server {backend.url} timed out on {api}: {why}"
        except (httpx.HTTPError, AnswerTooLarge) as exc:
            error = f"prefill server {backend.url} failed on {api}: {describe_exc(exc)}"
        else:
            if 200 <= code < 300:
                sub.state = "done"
                backend.answered()
                params = prefill_answer_params(content)
                state.workers.learn("prefill", params.get(PREFILL_WORKERS_KEY))
                backend.learn_engine(params.get(PREFILL_ENGINE_KEY),
                                     params.get(PREFILL_WORKERS_KEY))
                return
            lost = code >= 500
            error = (f"prefill server {backend.url} returned HTTP {code} on "
                     f"{api}: {quote_body(content)}")
        if status != 504:  # refused, dropped or 5xx: route new prefills elsewhere a while
            backend.failed(asyncio.get_running_loop().time())
        backend.errors += 1
        state.counters["prefill_failures"] += 1
        sub.state = "failed"
        if _left_to_decode(state, tr, sub, lost, error):
            return
        if tr.prefill_error is None:
            tr.prefill_error = error
            tr.prefill_error_status = status
            tr.prefill_error_server = backend.url
        tr.prefill_failed.set()
        log.warning("request %s (sub-transfer %s): %s", tr.request_id, sub.sub_id, error)
    except asyncio.CancelledError:
        sub.state = "cancelled"
        raise
    finally:
        backend.in_flight -= 1


def _left_to_decode(state: ProxyState, tr: Transfer, sub: SubPrefill, lost: bool,
                    error: str) -> bool:
    """Whether a failed attempt's outcome is not the request's: a re-prefill replaced it, or
    its P may be gone and D may still ask for another (its retry budget; D's core finds the lost
    P and either re-prefills or fails the request itself, per kv_load_failure_policy)."""
    if tr.prefills.get(sub.sub_id) is not sub:
        log.info("request %s (sub-transfer %s): superseded attempt (epoch %d) failed: %s",
                 tr.request_id, sub.sub_id, sub.epoch, error)
        return True
    if lost and sub.epoch < sub.budget:
        state.counters["prefill_failures_left_to_decode"] += 1
        log.warning("request %s (sub-transfer %s): %s; left to the decode engine (epoch %d of "
                    "a retry budget of %d)", tr.request_id, sub.sub_id, error, sub.epoch,
                    sub.budget)
        return True
    return False


class AnswerTooLarge(ValueError):
    """P's answer passed ``limits.max_prefill_answer_bytes`` (one token and lw's params are a
    few hundred bytes): the rest is not read."""


async def _post_bounded(state: ProxyState, url: str, body: dict[str, Any],
                        headers: dict[str, str]) -> tuple[int, bytes]:
    """POST to P; its status and answer, read up to the bound (decoded bytes: a compressed
    answer cannot unpack past it)."""
    limit = state.limits.max_prefill_answer_bytes
    async with state.client.stream("POST", url, json=body, headers=headers) as resp:
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.aiter_bytes():
            size += len(chunk)
            if size > limit:
                raise AnswerTooLarge(f"answer larger than {limit} bytes")
            chunks.append(chunk)
        return resp.status_code, b"".join(chunks)


def _cancel_prefills(tr: Transfer) -> None:
    """Cancel every prefill request of ``tr`` still running (closes their connections)."""
    if tr.ahead is not None:
        tr.ahead.cancel("the request ended")
    for sub in tr.prefills.values():
        if sub.task is not None and not sub.task.done():
            sub.task.cancel()


# ---------------------------------------------------------------------------------------------
# One client exchange


async def _wait_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (the request body has already been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class Exchange(Response):
    """ASGI response that runs one client request against D until it ends.

    Three things race: the D request (``_run``), the client disconnecting, and the prefill failing
    before D's answer has started. The first decides; the others are cancelled.
    """

    def __init__(self, state: ProxyState, tr: Transfer,
                 after_d_sent: Callable[[Transfer], None] | None = None) -> None:
        super().__init__()
        self.state = state
        self.tr = tr
        # run once the first D request is on its way (admit-ahead starts P's then: D's
        # admission is the one on the critical path)
        self._after_d_sent = after_d_sent
        self.started = False  # response start sent to the client
        self.relayed = False  # a byte of D's answer was sent to the client
        self.ok = False  # D's answer was relayed completely
        self._upstream: httpx.Response | None = None
        self._swapped = asyncio.Event()  # the request moved to another D (see _failover)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        run = asyncio.ensure_future(self._run(send))
        disconnect = asyncio.ensure_future(_wait_disconnect(receive))
        # the current attempt's prefill failure ends the request
        prefill_failed = asyncio.ensure_future(self.tr.prefill_failed.wait())
        swapped = asyncio.ensure_future(self._swapped.wait())
        waiting: set[asyncio.Future[Any]] = {run, disconnect, prefill_failed, swapped}
        try:
            while True:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if run in done:
                    run.result()
                    break
                if disconnect in done:
                    state.counters["client_disconnects"] += 1
                    log.info("request %s: client disconnected; cancelling", self.tr.request_id)
                    await _cancel_and_wait(run)
                    break
                if swapped in done:  # set before an old prefill could end anything
                    # failed over to another D: only the new attempt's prefills matter
                    self._swapped.clear()
                    for f in (swapped, prefill_failed):
                        waiting.discard(f)
                        f.cancel()
                    prefill_failed = asyncio.ensure_future(self.tr.prefill_failed.wait())
                    swapped = asyncio.ensure_future(self._swapped.wait())
                    waiting |= {prefill_failed, swapped}
                    continue
                if prefill_failed in done:
                    waiting.discard(prefill_failed)
                    tr = self.tr
                    if not self.relayed:  # headers may be out; then the error goes in-band
                        await _cancel_and_wait(run)
                        await self._error(send, tr.prefill_error_status,
                                          tr.prefill_error or "prefill failed", stage="prefill",
                                          server=tr.prefill_error_server)
                        break
        finally:
            for task in (run, disconnect, prefill_failed, swapped):
                task.cancel()
            self._finish()

    def _finish(self) -> None:
        """Release the transfer: counters, transfer table, and the prefill unless D succeeded."""
        tr = self.tr
        tr.decode.in_flight -= 1
        self.state.transfers.pop(tr.request_id, None)
        # (D answered without calling the metaserver, e.g. a prefix hit computed locally)
        if tr.ahead is not None:
            tr.ahead.cancel("the request ended before D asked for its prefill")
        if not self.ok:
            _cancel_prefills(tr)

    async def _start(self, send: Send, status: int, content_type: str) -> None:
        """Send the response head to the client (once: an attempt after a failover does not)."""
        if self.started:
            return
        self.started = True
        headers = [(b"content-type", content_type.encode("latin-1")),
                   (b"x-request-id", self.tr.request_id.encode())]
        if self.tr.stream and status == 200:
            headers.append((b"cache-control", b"no-cache"))
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _error(self, send: Send, status: int, message: str, *, stage: str,
                     server: str | None, log_kind: str | None = None) -> None:
        """Report an error to the client: a JSON response, or a final SSE event mid-stream."""
        state = self.state
        state.counters["errors"] += 1
        # the client learns the server's role and place; its URL goes to the log
        state.refusals.note(log_kind or f"upstream_{stage}", "answered %d: %s", status, message,
                            req_id=self.tr.request_id)
        body = error_body(state.public(message), status, stage=stage, server=state.label(server),
                          request_id=self.tr.request_id)
        data = json.dumps(body).encode()
        if not self.started:
            await self._start(send, status, "application/json")
            await send({"type": "http.response.body", "body": data})
        else:
            event = b"data: " + data + b"\n\n" if self.tr.stream else b""
            await send({"type": "http.response.body", "body": event})

    async def _run(self, send: Send) -> None:
        """Send the request to D and relay its answer; a D that fails before any byte of its
        answer reached the client is replaced by another (at most ``decode_failovers``); other
        failures become client errors."""
        tried = [self.tr.decode]
        while True:
            failure = await self._attempt(send)
            if failure is None:
                return
            nxt = None
            if len(tried) <= self.state.decode_failovers:
                with contextlib.suppress(ValueError):
                    nxt = self.state.pick(self.state.decodes, exclude=tried)
            if nxt is None:
                more = (f" (tried {len(tried)} decode servers: "
                        f"{', '.join(b.url for b in tried)})") if len(tried) > 1 else ""
                await self._error(send, failure.status, failure.message + more,
                                  stage=failure.stage, server=failure.server,
                                  log_kind=failure.log_kind)
                return
            log.warning("request %s: %s; moving it to decode server %s", self.tr.request_id,
                        failure.message, nxt.url)
            self._failover(nxt)
            tried.append(nxt)

    def _failover(self, nxt: Backend) -> None:
        """Start the request afresh on decode server ``nxt``: a new transfer (id, grant), the
        old one's prefills cancelled and its late metaserver calls unknown."""
        old, state = self.tr, self.state
        old.decode.in_flight -= 1
        state.transfers.pop(old.request_id, None)
        _cancel_prefills(old)
        tr = dataclasses.replace(old, request_id=uuid.uuid4().hex, decode=nxt,
                                 grant=secrets.token_hex(16), prefills={},
                                 prefill_error=None, prefill_error_status=502,
                                 prefill_error_server=None,
                                 prefill_failed=asyncio.Event(), decode_workers={},
                                 ahead=None)
        nxt.in_flight += 1
        nxt.requests += 1
        state.transfers[tr.request_id] = tr
        state.counters["decode_failovers"] += 1
        state.timeline.mark(tr.request_id, "received")
        self.tr = tr
        self._swapped.set()

    async def _attempt(self, send: Send) -> Failure | None:
        """One try on the transfer's D. None when it ended (relayed, or an error reported);
        the failure when D failed before any byte reached the client: refused or dropped
        connection, a 5xx answer or a stream's 5xx error event (another D may take the
        request)."""
        tr, state = self.tr, self.state
        server = tr.decode.url
        now = asyncio.get_running_loop().time
        try:
            body = tr.body if tr.local else build_decode_body(
                tr.body, tr.request_id, tr.metaserver, tr.grant, state.verifier.key)
            headers = {**tr.headers, "X-Request-Id": tr.request_id}
            request = state.client.build_request("POST", server + tr.api, json=body,
                                                 headers=headers)
            state.timeline.mark(tr.request_id, "d_sent")
            if self._after_d_sent is None:
                resp = await state.client.send(request, stream=True)
            else:
                resp = await self._send_then(request)
            self._upstream = resp
            if resp.status_code != 200:
                data = await resp.aread()
                if resp.status_code >= 500:
                    return await self._failed(f"decode server {server} returned HTTP "
                                              f"{resp.status_code} on {tr.api}: {quote_body(data)}")
                tr.decode.answered()
                await self._upstream_status(send, resp, data)
                return None
            tr.decode.answered()
            content_type = resp.headers.get("content-type", "application/json")
            if not tr.stream:
                data = await resp.aread()
                tr.answering = True
                state.timeline.mark(tr.request_id, "first_token")
                await self._start(send, 200, content_type)
                self.relayed = True
                await send({"type": "http.response.body", "body": data})
            else:
                # D accepted the request: the client gets its headers now, not with the first
                # token (which waits for the whole P/D round trip); later errors go in-band.
                await self._start(send, 200, content_type)
                failed = await self._relay_stream(send, resp)
                if failed is not None:
                    if not self.relayed:
                        return failed
                    await self._error(send, failed.status, failed.message, stage=failed.stage,
                                      server=failed.server, log_kind=failed.log_kind)
                    return None
                await send({"type": "http.response.body", "body": b""})
            self.ok = True
            state.timeline.mark(tr.request_id, "end")
        except (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ConnectTimeout) as exc:
            tr.decode.errors += 1
            tr.decode.failed(now())
            what = "unreachable" if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout) \
                else "failed"
            message = f"decode server {server} {what} on {tr.api}: {describe_exc(exc)}"
            if not self.relayed:
                return Failure(502, message, server=server)
            await self._error(send, 502, message, stage="decode", server=server)
        except httpx.TimeoutException as exc:
            tr.decode.errors += 1
            await self._error(send, 504, f"decode server {server} timed out on {tr.api}: "
                              f"{describe_exc(exc)}", stage="decode", server=server)
        except httpx.HTTPError as exc:
            tr.decode.errors += 1
            await self._error(send, 502, f"decode server {server} failed on {tr.api}: "
                              f"{describe_exc(exc)}", stage="decode", server=server)
        except (asyncio.CancelledError, OSError):
            raise
        except Exception as exc:  # a bug here must still answer the client
            log.exception("request %s: proxy failure", tr.request_id)
            with contextlib.suppress(Exception):  # in-band if the head is already out
                await self._error(send, 500, f"proxy failure: {describe_exc(exc)}", stage="proxy",
                                  server=None)
        finally:
            if self._upstream is not None:
                await self._upstream.aclose()
                self._upstream = None
        return None

    async def _send_then(self, request: httpx.Request) -> httpx.Response:
        """Send D's request, then (once it is on its way) run ``after_d_sent``."""
        then, self._after_d_sent = self._after_d_sent, None
        sending = asyncio.ensure_future(self.state.client.send(request, stream=True))
        try:
            await asyncio.sleep(0)  # the send writes D's request before it first waits
        except asyncio.CancelledError:
            await _cancel_and_wait(sending)
            if sending.done() and not sending.cancelled() and sending.exception() is None:
                await sending.result().aclose()
            raise
        if then is not None:
            then(self.tr)
        return await sending

    async def _relay_stream(self, send: Send, resp: httpx.Response) -> Failure | None:
        """Relay D's stream to the client; the failure when D ends it with a 5xx error event
        (vLLM's in-band error: the client gets the proxy's, which says why)."""
        held = b""  # an error event not yet whole: judged once it is
        async for chunk in resp.aiter_bytes():
            if not chunk:
                continue
            if not held and ERROR_EVENT not in chunk and chunk.endswith(b"\n"):
                await self._relay(send, chunk)  # the usual chunk: whole events, no error
                continue
            head, event, rest = split_error_event(held + chunk)
            await self._relay(send, head)
            if event is None:
                held = rest if len(rest) <= MAX_ERROR_EVENT else b""
                if not held:
                    await self._relay(send, rest)
                continue
            held = b""
            code = error_code(event)
            if code is None or code < 500:
                await self._relay(send, event + rest)
                continue
            tr = self.tr
            return await self._failed(f"decode server {tr.decode.url} ended the stream of "
                                      f"{tr.api} with an error: {quote_body(event.strip())}")
        await self._relay(send, held)
        return None

    async def _relay(self, send: Send, data: bytes) -> None:
        """Send bytes of D's answer to the client (a stream's head is out)."""
        if not data:
            return
        if not self.relayed:
            self.tr.answering = True
            self.state.timeline.mark(self.tr.request_id, "first_token")
        self.relayed = True
        await send({"type": "http.response.body", "body": data, "more_body": True})

    async def _failed(self, what: str) -> Failure:
        """D answered this try with a 5xx (``what``): ask its workers why. A failed KV
        transfer is not D's failure (it is not avoided for it); anything else is."""
        tr = self.tr
        why = await ask(self.state, tr)
        if why.transfer:
            tr.decode.answered()
        else:
            tr.decode.errors += 1
            tr.decode.failed(asyncio.get_running_loop().time())
        return explain(self.state, tr, why, what)

    async def _upstream_status(self, send: Send, resp: httpx.Response, data: bytes) -> None:
        """Relay a non-200 answer of D: 4xx unchanged (in-band if the stream's head is out),
        anything else as 502."""
        tr = self.tr
        if 400 <= resp.status_code < 500:
            if self.started:  # a later attempt of a stream whose head is out: in-band
                await self._error(send, resp.status_code, f"decode server {tr.decode.url} "
                                  f"returned HTTP {resp.status_code} on {tr.api}: "
                                  f"{quote_body(data)}", stage="decode", server=tr.decode.url)
                return
            self.state.counters["errors"] += 1
            await self._start(send, resp.status_code,
                              resp.headers.get("content-type", "application/json"))
            await send({"type": "http.response.body", "body": data})
            return
        tr.decode.errors += 1
        await self._error(send, 502, f"decode server {tr.decode.url} returned HTTP "
                          f"{resp.status_code} on {tr.api}: {quote_body(data)}", stage="decode",
                          server=tr.decode.url)


async def _cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` and wait until it has finished its cleanup."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
