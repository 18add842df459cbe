"""The first token from P in ``lw status``: whether it is on (or why not) and D's counts, from
REAL vLLM schedulers (lw's and vLLM's own) through the step's connector metadata, a real worker
connector and its side channel, to the rendered table; and a snapshot that is not of its declared
type or bounds is refused where it enters the worker (and on the wire)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

pytest.importorskip("vllm")

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from lw.contract.sampling import spec_digest  # noqa: E402
from lw.fsm.messages import MAX_FIRST_TOKEN_REASONS, MAX_TEXT, FirstTokenStatus  # noqa: E402
from lw.ops.client import Snapshot, query  # noqa: E402
from lw.ops.render import first_token_lines, table  # noqa: E402
from lw.transport import wire  # noqa: E402
from lw.transport.wire import PROTOCOL_VERSION, Sender, StatusReply, WireError  # noqa: E402
from lw.vllm_adapter.connector_meta import (  # noqa: E402
    FirstTokenIn,
    LwConnectorMetadata,
    LwWorkerMeta,
)
from lw.vllm_adapter.first_token import checked_status, scheduler_is_lws  # noqa: E402
from lw.vllm_adapter.lw_scheduler import LwSyncScheduler  # noqa: E402

from .test_connector_scheduler import (  # noqa: E402
    BS,
    fake_poster,  # noqa: F401  (autouse fixture: no metaserver thread)
    kv_cache_config,
    make_vllm_config,
    model_dir,  # noqa: F401  (fixture)
)
from .test_first_token_scheduler import Steps, lw_scheduler, request  # noqa: E402
from .test_first_token_worker import Worker  # noqa: E402


@pytest.fixture
def lw_logs() -> Iterator[list[logging.LogRecord]]:
    """What lw's adapter logs (under vLLM's logger, which need not propagate to the root)."""
    got: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = got.append  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.lw")
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield got
    logger.removeHandler(handler)
    logger.setLevel(old)


def vllm_scheduler(model: str, role: str = "kv_consumer", *, cls: Any = Scheduler,
                   name: Any = None, **kw: Any) -> Any:
    """One of vLLM's own schedulers with lw's connector (plain ``vllm serve``; ``name``: what
    ``--scheduler-cls`` said)."""
    vc = make_vllm_config(model, role, **kw)
    vc.scheduler_config.scheduler_cls = name
    return cls(vllm_config=vc, kv_cache_config=kv_cache_config(),
               structured_output_manager=StructuredOutputManager(vc), block_size=BS,
               log_stats=True)


def status_of(s: Any) -> FirstTokenStatus:
    """What the scheduler's first step tells its workers (it has not told them anything yet)."""
    snap = s.schedule().kv_connector_metadata.first_token
    assert snap is not None
    return snap


def rendered(*snaps: FirstTokenStatus, engine: str = "E") -> str:
    """``lw status``'s first-token lines for replies carrying ``snaps``, through the wire."""
    replies = []
    for i, ft in enumerate(snaps):
        r = StatusReply(PROTOCOL_VERSION, Sender(engine, i, 1, f"tcp://h:{i + 1}"), ft.role,
                        0.0, 0.0, first_token=ft)
        replies.append(wire.decode(wire.encode(r)))
    return "\n".join(first_token_lines(Snapshot(replies=replies)))


def starts(records: list[logging.LogRecord], text: str) -> list[str]:
    return [m for r in records if text in (m := r.getMessage())]


# ------------------------------------------------------------------- the mode and its reason
def test_plain_vllm_scheduler_on_d_is_off_says_so_once_and_counts(
        model_dir: str, lw_logs: list[logging.LogRecord]) -> None:  # noqa: F811
    s = vllm_scheduler(model_dir)
    (line,) = starts(lw_logs, "first token from P off")
    assert "vLLM's own, not lw's" in line and "--scheduler-cls" in line
    ft = status_of(s)
    assert (ft.role, ft.on) == ("decode", False) and "vLLM's own, not lw's" in ft.why_off
    # P's token still comes (P sends it): counted, not kept for a scheduler that never asks
    d = Steps(s)
    req = request("r1")
    s.add_request(req)
    d.step()
    ft_in = FirstTokenIn("t1@r1", "r1", 42, spec_digest(req.sampling_params), 0)
    d.step(KVConnectorOutput(kv_connector_worker_meta=LwWorkerMeta(first_tokens=[ft_in])))
    side = s.connector.scheduler_side
    assert side.take_first_tokens() == []
    d.step(KVConnectorOutput(finished_recving={"r1"}))
    ft = d.step().kv_connector_metadata.first_token
    assert ft is not None and ft.last_token_recomputed == 1 and ft.fallbacks == {"off": 1}
    assert d.fallbacks() == {"off": 1} and d.count("last_token_recomputed") == 1  # /metrics
    assert len(starts(lw_logs, "first token from P")) == 1  # once, at start


def test_another_scheduler_class_on_d_is_named(model_dir: str) -> None:  # noqa: F811
    name = "vllm.v1.core.sched.async_scheduler.AsyncScheduler"
    ft = status_of(vllm_scheduler(model_dir, cls=AsyncScheduler, name=name))
    assert not ft.on and f"scheduler is {name}, not lw's" in ft.why_off
    assert f"D E: off (the engine's scheduler is {name}, not lw's" in rendered(ft)


@pytest.mark.parametrize(("kw", "why"), [
    ({"extra": {"first_token_from_p": False}}, "first_token_from_p is false"),
    ({"worker": False}, "--worker-cls lw.vllm_adapter.lw_worker.LwCPUWorker"),
])
def test_lws_scheduler_says_why_it_is_off_once(model_dir: str, kw: dict[str, Any],  # noqa: F811
                                               why: str,
                                               lw_logs: list[logging.LogRecord]) -> None:
    ft = status_of(lw_scheduler(model_dir, **kw))
    assert not ft.on and why in ft.why_off
    (line,) = starts(lw_logs, "first token from P")  # lw's scheduler's, not also the side's
    assert why in line
    assert f"D E: off ({ft.why_off})" in rendered(ft)


def test_lws_scheduler_on_d_is_on_also_as_a_class_or_a_subclass(
        model_dir: str, lw_logs: list[logging.LogRecord]) -> None:  # noqa: F811
    assert status_of(lw_scheduler(model_dir)).on
    (line,) = starts(lw_logs, "first token from P")
    assert "first token from P on" in line

    class Mine(LwSyncScheduler):
        pass

    for name in (Mine, "lw.vllm_adapter.lw_scheduler.LwScheduler"):
        assert scheduler_is_lws(name)
    assert not scheduler_is_lws(None) and not scheduler_is_lws(Scheduler)
    assert not scheduler_is_lws("vllm.v1.core.sched.scheduler.Scheduler")
    assert not scheduler_is_lws("no.such.Module")


@pytest.mark.parametrize(("extra", "on"), [({}, True), ({"first_token_from_p": False}, False)])
def test_p_sends_tokens_without_lws_classes_unless_the_key_is_off(
        model_dir: str, extra: dict[str, Any], on: bool,  # noqa: F811
        lw_logs: list[logging.LogRecord]) -> None:
    ft = status_of(vllm_scheduler(model_dir, "kv_producer", extra=extra))
    assert (ft.role, ft.on) == ("prefill", on)
    (line,) = starts(lw_logs, "first token from P")
    text = rendered(ft)
    if on:
        assert "this prefill engine sends" in line
        assert "P E: on: sends each pushed request's sampled token to D" in text
    else:
        assert "first_token_from_p is false" in line
        assert "P E: off (first_token_from_p is false): D samples token 1 itself" in text


# ------------------------------------------------------------------- counts, end to end
def test_d_counts_reach_lw_status_through_the_worker(model_dir: str) -> None:  # noqa: F811
    s = lw_scheduler(model_dir)
    d = Steps(s)
    r1, r2 = request("r1"), request("r2", start=300, logprobs=2)
    s.add_request(r1)
    s.add_request(r2)
    metas = [d.step().kv_connector_metadata]
    assert metas[0].first_token is not None and metas[0].first_token.on
    metas.append(d.step().kv_connector_metadata)
    assert metas[1].first_token is None  # unchanged: not sent again
    tokens = [FirstTokenIn(f"t1@{r.request_id}", r.request_id, 42,
                           spec_digest(r.sampling_params), 0) for r in (r1, r2)]
    d.step(KVConnectorOutput(kv_connector_worker_meta=LwWorkerMeta(first_tokens=tokens)))
    metas.append(d.step().kv_connector_metadata)
    ft = metas[-1].first_token
    assert ft is not None and (ft.first_token_from_p, ft.fallbacks) == (1, {"logprobs": 1})

    w = Worker(model_dir, "kv_consumer", {})
    try:
        for meta in metas:  # what vLLM hands the worker, step by step
            w.step(meta)
        snap = query([w.side.loop.addr], None, timeout_s=10)
        assert not snap.silent
        (reply,) = snap.replies
        assert reply.first_token == ft
        text = table(snap)
    finally:
        w.close()
    assert ("first token from P:\n  D kv_consumer: on; from P 1, last token recomputed 0, "
            "ended at token 1 0, discarded 0, waits expired 0; fallbacks: logprobs 1") in text


def test_engines_and_dp_schedulers_each_get_their_newest_line() -> None:
    old = FirstTokenStatus("decode", True, first_token_from_p=1)
    new = FirstTokenStatus("decode", True, first_token_from_p=3, fallbacks={"late": 1})
    dp1 = FirstTokenStatus("decode", False, "first_token_from_p is false", dp_rank=1)
    text = rendered(old, new, dp1)
    assert "D E dp 0: on; from P 3," in text and "fallbacks: late 1" in text
    assert "D E dp 1: off (first_token_from_p is false)" in text
    silent = StatusReply(PROTOCOL_VERSION, Sender("F", 0, 1, "tcp://h:9"), "decode", 0.0, 0.0)
    assert "D F: not reported yet" in "\n".join(first_token_lines(Snapshot(replies=[silent])))


# ------------------------------------------------------------------- refusals
BAD = {
    "too many reasons": {"fallbacks": {f"r{i}": 1 for i in range(MAX_FIRST_TOKEN_REASONS + 1)}},
    "a negative count": {"first_token_from_p": -1},
    "a count past int64": {"last_token_recomputed": 1 << 64},
    "a reason that is not a label": {"fallbacks": {"Off Now!": 1}},
    "a reason too long": {"why_off": "x" * (MAX_TEXT + 1)},
    "a count that is not an int": {"first_token_discarded": "3"},
    "a dp rank out of range": {"dp_rank": 1 << 20},
}


@pytest.mark.parametrize("bad", list(BAD.values()), ids=list(BAD))
def test_a_malformed_or_oversized_snapshot_is_refused(bad: dict[str, Any]) -> None:
    snap = FirstTokenStatus("decode", True, **bad)  # made in Python: nothing checked yet
    with pytest.raises(ValueError, match="first-token status refused"):
        checked_status(snap)
    reply = StatusReply(PROTOCOL_VERSION, Sender("D", 0, 1, "tcp://h:1"), "decode", 0.0, 0.0,
                        first_token=snap)
    try:
        raw = msgspec.msgpack.encode(reply)
    except OverflowError:
        return  # past what msgpack carries: nothing a peer could send
    with pytest.raises(WireError):
        wire.decode(raw)


def test_the_worker_keeps_the_last_good_snapshot(model_dir: str,  # noqa: F811
                                                 lw_logs: list[logging.LogRecord]) -> None:
    good = FirstTokenStatus("decode", True, first_token_from_p=2)
    w = Worker(model_dir, "kv_consumer", {})
    try:
        w.step(LwConnectorMetadata(first_token=good))
        for bad in ({"not": "a status"}, FirstTokenStatus("decode", True, first_token_from_p=-2)):
            w.step(LwConnectorMetadata(first_token=bad))  # type: ignore[arg-type]
        assert w.side.loop.first_token == good
        (reply,) = query([w.side.loop.addr], None, timeout_s=10).replies
        assert reply.first_token == good
    finally:
        w.close()
    assert len(starts(lw_logs, "first-token status was refused")) == 1
    assert w.side._ft_refused == 2
