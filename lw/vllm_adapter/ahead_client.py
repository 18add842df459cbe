"""P's background fetcher of D's params for requests admitted ahead of them (the proxy's
``--start-mode admit-ahead``, lw.contract.ahead): one signed long poll per request, in threads
of its own, so that vLLM's scheduler only ever looks at an answer that is already there."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lw.contract.ahead import ahead_answer
from lw.contract.auth import signed_call
from lw.contract.params import ContractError
from lw.transport.sidechannel import parse_cluster_key
from lw.vllm_adapter.config import LwConfig
from lw.vllm_adapter.connector_meta import log

__all__ = ["AheadFetcher", "MAX_FETCHES"]

MAX_FETCHES = 16
"""Fetches in flight at once (the proxy holds at most its ``--ahead-limit`` per P waiting)."""


class AheadFetcher:
    """P: asks the proxy for D's params of each request admitted ahead; answers kept per
    request as ("go", params), ("fallback", why) or ("error", why)."""

    def __init__(self, cfg: LwConfig) -> None:
        self._key = parse_cluster_key(cfg.cluster_key or None)
        self._timeout = cfg.metaserver_timeout_s
        self._pool = ThreadPoolExecutor(MAX_FETCHES, thread_name_prefix="lw-ahead")
        self._answers: dict[str, tuple[str, Any]] = {}
        self._wanted: set[str] = set()
        self._lock = threading.Lock()
        self._client: Any = None

    def fetch(self, rid: str, url: str, body: dict[str, Any],
              then: Callable[[tuple[str, Any]], None] | None = None) -> None:
        """Start asking ``url`` for request ``rid``'s params (``body``: an AheadFetch);
        ``then`` gets the answer instead of :meth:`take`, on the fetch's thread, as it came."""
        with self._lock:
            self._wanted.add(rid)
        self._pool.submit(self._run, rid, url, body, then)

    def take(self, rid: str) -> tuple[str, Any] | None:
        """The answer for ``rid`` once there is one (then forgotten), else None."""
        with self._lock:
            return self._answers.pop(rid, None)

    def forget(self, rid: str) -> None:
        """``rid`` ended: drop its answer, now or when it comes."""
        with self._lock:
            self._wanted.discard(rid)
            self._answers.pop(rid, None)

    def close(self) -> None:
        """Stop taking fetches (those in flight end at their timeout)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, rid: str, url: str, body: dict[str, Any],
             then: Callable[[tuple[str, Any]], None] | None) -> None:
        answer = self._call(url, body)
        with self._lock:
            if rid not in self._wanted:
                return
            self._wanted.discard(rid)
            if then is None:
                self._answers[rid] = answer
                return
        try:
            then(answer)
        except Exception:  # noqa: BLE001 - a bug of ours; the request fails at its deadline
            log.exception("lw: request %s: acting on its params as they came failed", rid)

    def _call(self, url: str, body: dict[str, Any]) -> tuple[str, Any]:
        import httpx

        with self._lock:
            if self._client is None:
                self._client = httpx.Client(timeout=self._timeout)
            client = self._client
        content, headers = signed_call(self._key, body)
        try:
            resp = client.post(url, content=content, headers=headers)
        except Exception as exc:  # noqa: BLE001 - any transport error is this request's answer
            return "error", f"POST {url}: {type(exc).__name__}: {exc}"
        try:
            ans = ahead_answer(resp.json())
        except (ValueError, ContractError) as exc:
            return "error", f"POST {url} answered {resp.status_code}: {str(exc)[:300]}"
        if resp.status_code != 200 or ans.status != "go":
            return "fallback", f"{ans.detail or ans.status} (HTTP {resp.status_code})"
        return "go", ans.kv_transfer_params
