"""One builder of a declared configuration (the core's PrefillConfig and DecodeConfig, a worker
loop's LoopConfig) from a driver's own.

The vLLM connector's config, the synthetic cluster's and the checker's world each call a setting
by the name its declaration gives it (``request_timeout_s``, ``lease_s``, ``heartbeat_s``, ...):
this takes every setting a configuration declares from them by that name, so no driver lists the
fields again, a setting declared later reaches each driver that names it, and each value is
checked once, by the declaration it ends in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

__all__ = ["core_config"]

C = TypeVar("C")


def core_config(kind: type[C], settings: Mapping[str, Any], **computed: Any) -> C:
    """``kind`` (a dataclass) built from a driver's ``settings`` (e.g. ``vars(cfg)``): every field
    of ``kind`` they name, by that name, the others at their defaults. ``computed`` adds or
    replaces values the driver derives rather than names (the checker's one retry budget, the
    synthetic cluster's lease); a name ``kind`` does not declare there is an error, not ignored."""
    names = {f.name for f in fields(kind)}
    unknown = computed.keys() - names
    if unknown:
        raise TypeError(f"{kind.__name__} has no setting {', '.join(sorted(unknown))}")
    return kind(**{**{k: v for k, v in settings.items() if k in names}, **computed})
