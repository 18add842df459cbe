"""lw's vLLM integration: the KV connector, the D-first proxy, the ``vllm serve`` shim, the demo.

Load the connector with ``kv_connector_module_path="lw.vllm_adapter"`` and
``kv_connector="LwConnector"``. The connector (and vLLM) are imported on first access, so the
proxy and the tiny-model tool import this package without importing vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LwConnector"]


def __getattr__(name: str) -> Any:
    """Import the connector lazily (it imports vLLM and torch)."""
    if name == "LwConnector":
        from lw.vllm_adapter.connector import LwConnector

        return LwConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
