"""``transport_cpus``: which CPUs lw's transport threads get, whatever core vLLM pinned the
worker's thread to; refusals of bad lists."""

from __future__ import annotations

import os
import threading

import pytest

from lw.vllm_adapter.config import ConfigError, LwConfig
from lw.vllm_adapter.placement import parse_cpus, transport_threads


def test_cpu_lists() -> None:
    assert parse_cpus("inherit") is None
    assert parse_cpus("all") >= os.sched_getaffinity(0)  # every online CPU
    assert parse_cpus(" 0, 2-3 ") == frozenset({0, 2, 3})
    for bad in ("", "x", "3-1", "-1", "0,,1", "1-"):
        with pytest.raises(ValueError):
            parse_cpus(bad)


def _affinity_of_a_thread_started_now() -> set[int]:
    seen: list[set[int]] = []
    t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
    t.start()
    t.join()
    return seen[0]


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs")
def test_threads_started_inside_get_the_cpus_and_the_caller_keeps_its_own() -> None:
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("this process may use one CPU only")
    pinned = {min(allowed)}  # as vLLM pins a CPU worker's thread
    result: dict[str, set[int]] = {}

    def worker() -> None:
        os.sched_setaffinity(0, pinned)
        result["inherited"] = _affinity_of_a_thread_started_now()
        with transport_threads(frozenset(allowed)):
            result["inside"] = _affinity_of_a_thread_started_now()
        result["after"] = os.sched_getaffinity(0)
        with transport_threads(None):
            result["inherit"] = _affinity_of_a_thread_started_now()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert result == {"inherited": pinned, "inside": allowed, "after": pinned,
                      "inherit": pinned}


def test_a_cpu_set_the_process_cannot_use_leaves_the_placement_alone(
        caplog: pytest.LogCaptureFixture) -> None:
    before = os.sched_getaffinity(0)
    with transport_threads(frozenset({100_000})):
        assert os.sched_getaffinity(0) == before
    assert "not usable here" in caplog.text


def _build(extra: dict[str, object]) -> LwConfig:
    return LwConfig.build(role="kv_producer", engine_id="e", kv_port=14579, tp_size=1,
                          pp_size=1, dp_size=1, dp_rank=0, load_failure_policy="fail",
                          extra={"host": "127.0.0.1", **extra})


def test_the_connector_takes_a_list_and_refuses_a_bad_one() -> None:
    assert _build({}).transport_cpus == "all"
    assert _build({"transport_cpus": "0,1"}).transport_cpus == "0,1"
    with pytest.raises(ConfigError, match="transport_cpus.*not a CPU list"):
        _build({"transport_cpus": "0-x"})
