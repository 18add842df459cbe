"""How a connector setting is declared: the sections of the supported keys, the
``experimental`` object and the derived settings, and the field of each kind that
:class:`~lw.vllm_adapter.config.LwConfig` declares its settings with (their metadata generate
docs/deployment.md's tables and drive the refusals of moved keys)."""

from __future__ import annotations

from dataclasses import field
from typing import Any

__all__ = ["DERIVED", "EXPERIMENTAL", "FAILOVER", "LIVENESS", "PLACEMENT", "SECTIONS", "SECURITY",
           "TRANSFER", "PREFIX", "derived_setting", "experimental_setting", "setting"]

PLACEMENT, TRANSFER, LIVENESS, FAILOVER, SECURITY = (
    "placement", "transfer", "liveness", "failover", "security")
SECTIONS = {
    PLACEMENT: "where this engine listens and what its peers look like",
    TRANSFER: "how the KV moves",
    LIVENESS: "deadlines and heartbeats (the derived settings follow from them)",
    FAILOVER: "prefilling again after a lost P (D)",
    SECURITY: "who is let in",
}
"""The sections of the supported keys, each with what it is about (docs/deployment.md)."""
EXPERIMENTAL = "experimental"
DERIVED = "derived"
PREFIX = "kv_connector_extra_config."
"""How an error names a key: its place in the kv_transfer_config."""


def setting(section: str, default: Any, side: str, doc: str, shown: str | None = None,
            secret: bool = False) -> Any:
    """A supported ``kv_connector_extra_config`` key of ``section``: its default, which side
    reads it (``P``, ``D`` or ``both``), what it means, the default as documented when that is
    not the value, and whether it is a secret (kept out of the repr and of error messages)."""
    return field(default=default, repr=not secret,
                 metadata={"section": section, "side": side, "doc": doc, "shown": shown,
                           "secret": secret})


def experimental_setting(default: Any, side: str, doc: str, why: str,
                         shown: str | None = None) -> Any:
    """A key of the ``experimental`` object: unsupported, with ``why`` it is not a key of its
    own (a benchmark's or a test's knob whose default is right for a deployment)."""
    return field(default=default, metadata={"section": EXPERIMENTAL, "side": side, "doc": doc,
                                            "shown": shown, "secret": False, "why": why})


def derived_setting(default: Any, source: str, rule: str) -> Any:
    """A setting lw derives from the keys ``source`` (comma-separated; "": fixed), with its
    value at the defaults and the ``rule``; given as a key, it is refused naming ``source``."""
    return field(default=default, metadata={"section": DERIVED, "from": source, "doc": rule})
