"""What vLLM loads: lw's KV connector (scheduler side, worker side), its config and metrics,
the admission middleware for P's and D's own ports, and the ``vllm serve`` shim.

Load the connector with ``kv_connector_module_path="lw.vllm_adapter"`` and
``kv_connector="LwConnector"``. The connector (and vLLM) are imported on first access, so
importing this package does not import vLLM. The proxy lives in :mod:`lw.proxy`, what P, D and
the proxy speak in :mod:`lw.contract`, demos and test engines in :mod:`lw.lab`.
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
