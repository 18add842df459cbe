"""lw's Prometheus metrics on a registry of a test's own (vLLM's passes its metric classes)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def lw_prom(engines: dict[int, list[str]]) -> tuple[Any, Any]:
    """(LwPromMetrics for ``engines`` labelled by "engine", the registry it writes to)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from lw.vllm_adapter.metrics import LwPromMetrics

    reg = CollectorRegistry()

    def bind(cls: type) -> type:
        class Bound(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *a: object, multiprocess_mode: str = "", **kw: object) -> None:
                super().__init__(*a, registry=reg, **kw)  # type: ignore[arg-type]
        return Bound

    prom = LwPromMetrics(SimpleNamespace(kv_transfer_config=None),
                         {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)},
                         ["engine"], engines)
    return prom, reg
