"""The control plane's own helpers (lw.proxy.control) without a server: the public /health
answers from a cached probe within its bound and shares one probe among concurrent callers,
and says "degraded" when a backend is. Written to kill the survivors of
``tools/mutation.py --scope security``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from lw.proxy.control import cached_health, health_report
from lw.proxy.limits import Limits


class Client:
    """The proxy's HTTP client, answering each /health with ``status`` after ``delay`` s."""

    def __init__(self, status: int = 200, delay: float = 0.0) -> None:
        self.status, self.delay, self.calls = status, delay, 0

    async def get(self, url: str, timeout: float) -> Any:
        self.calls += 1
        await asyncio.sleep(self.delay)
        return SimpleNamespace(is_success=self.status < 400, status_code=self.status)


def state(client: Client) -> Any:
    """A proxy state with one prefill and one decode server."""
    return SimpleNamespace(client=client, health_timeout=1.0, health_cache=None,
                           health_task=None, limits=Limits(health_cache_s=1.0),
                           prefills=[SimpleNamespace(url="http://p:1")],
                           decodes=[SimpleNamespace(url="http://d:1")])


def test_a_backend_that_answers_an_error_makes_the_report_degraded() -> None:
    ok = asyncio.run(health_report(state(Client(200))))
    assert ok["status"] == "ok" and [r["url"] for r in ok["prefill"] + ok["decode"]] == [
        "http://p:1", "http://d:1"]
    bad = asyncio.run(health_report(state(Client(503))))
    assert bad["status"] == "degraded" and bad["decode"][0]["status_code"] == 503


def test_health_answers_from_the_cache_within_its_bound_and_probes_once() -> None:
    async def go() -> None:
        client = Client(200, delay=0.05)
        s = state(client)
        first, second = await asyncio.gather(cached_health(s), cached_health(s))
        assert first is second and client.calls == 2  # one probe: one call per backend
        assert await cached_health(s) is first and client.calls == 2  # from the cache
        when, report = s.health_cache
        s.health_cache = (when - 1.5, report)  # older than health_cache_s: probed again
        again = await cached_health(s)
        assert again is not first and client.calls == 4

    asyncio.run(go())


def test_an_answered_ahead_fetch_is_not_counted_as_refused() -> None:
    """``ahead_fetches_refused`` counts refusals only: a fetch answered "go" is not one."""
    from tests.proxy.test_ahead import ahead_cluster, post
    from tests.proxy.test_proxy import completion

    with ahead_cluster() as c:
        assert post(c, completion("hello there")).status_code == 200
        m = c.metrics()
        assert (m["ahead_bound"], m["ahead_fetches_refused"]) == (1, 0)
