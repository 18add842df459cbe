"""D's background caller of the proxy's metaserver: asks for a prefill (or, after a lost P, a
re-prefill) without blocking vLLM; each call is signed with the cluster key
(lw.contract.auth). Where the proxy says it sent a prefill (the P engine id and
side channel, once it knows them) is kept for the core's ``prefill_routed``."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Any

from lw.contract.auth import signed_call
from lw.transport.osthread import name_os_thread
from lw.transport.sidechannel import parse_cluster_key
from lw.vllm_adapter.config import LwConfig
from lw.vllm_adapter.connector_meta import Route, log

__all__ = ["MetaserverPoster"]


class MetaserverPoster:
    """D: one background thread POSTing prefill requests to the proxy's metaserver."""

    def __init__(self, cfg: LwConfig) -> None:
        self.cfg = cfg
        self._key = parse_cluster_key(cfg.cluster_key or None)
        self._q: queue.Queue[tuple[str, str, str, dict[str, Any]] | None] = queue.Queue()
        self._cancelled: set[str] = set()
        self._failures: deque[tuple[str, str, str]] = deque()
        self._routes: deque[Route] = deque()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="lw-metaserver", daemon=True)
        self._thread.start()

    def post(self, rid: str, tid: str, url: str, body: dict[str, Any]) -> None:
        """Queue one call: POST ``body`` to ``url`` for request ``rid`` (transfer ``tid``)."""
        self._q.put((rid, tid, url, body))

    def cancel(self, rid: str) -> None:
        """Skip a queued call for a request that ended."""
        with self._lock:
            self._cancelled.add(rid)

    def take_failures(self) -> list[tuple[str, str, str]]:
        """(req id, transfer id, reason) of calls that failed for good."""
        out = []
        while self._failures:
            out.append(self._failures.popleft())
        return out

    def take_routes(self) -> list[Route]:
        """Where the proxy sent the prefills it started since the last call."""
        out = []
        while self._routes:
            out.append(self._routes.popleft())
        return out

    def close(self) -> None:
        """Stop after the call in progress."""
        self._q.put(None)

    def _run(self) -> None:
        name_os_thread()
        import httpx

        with httpx.Client(timeout=self.cfg.metaserver_timeout_s) as client:
            while True:
                item = self._q.get()
                if item is None:
                    return
                rid, tid, url, body = item
                with self._lock:
                    if rid in self._cancelled:
                        self._cancelled.discard(rid)
                        continue
                reason, answer = self._call(client, url, body)
                route = route_of(rid, tid, body, answer)
                if route is not None:
                    self._routes.append(route)
                if reason:
                    log.error("lw: prefill request for %s (transfer %s) failed: %s", rid, tid,
                              reason)
                    self._failures.append((rid, tid, f"metaserver: {reason}"))

    def _call(self, client: Any, url: str, body: dict[str, Any]) -> tuple[str, Any]:
        """("", the proxy's JSON answer) on success, else (why, None)."""
        reason = ""
        for attempt in range(self.cfg.metaserver_attempts):
            if attempt:
                time.sleep(min(2.0, 0.2 * 2 ** attempt))
            content, headers = signed_call(self._key, body)  # a fresh nonce per attempt
            try:
                resp = client.post(url, content=content, headers=headers)
            except Exception as exc:  # noqa: BLE001 - any transport error: retry, then report
                reason = f"POST {url}: {type(exc).__name__}: {exc}"
                continue
            if resp.status_code < 300:
                try:
                    return "", resp.json()
                except ValueError:
                    return "", None
            reason = f"POST {url} answered {resp.status_code}: {resp.text[:300]}"
            if resp.status_code < 500:
                # 4xx: unknown transfer, stale epoch or bad body; retrying changes nothing
                return reason, None
        return reason, None


def route_of(rid: str, tid: str, body: dict[str, Any], answer: Any) -> Route | None:
    """The P a metaserver answer says it sent this call's prefill attempt to (None when the
    answer names none: the proxy has not yet learned that server's engine id)."""
    if not isinstance(answer, dict):
        return None
    engine, addr = answer.get("prefill_engine_id"), answer.get("prefill_worker")
    epoch = answer.get("epoch", body.get("epoch", 0))
    if (not isinstance(engine, str) or not engine or not isinstance(addr, str)
            or not addr.startswith("tcp://") or not isinstance(epoch, int)
            or isinstance(epoch, bool) or epoch != body.get("epoch", 0)):
        return None
    return Route(tid, rid, engine, addr, epoch)
