"""One builder of the core's configurations (PrefillConfig, DecodeConfig) from a driver's own.

The vLLM connector's config, the synthetic cluster's and the checker's world each call a core
setting by the core's name (``request_timeout_s``, ``lease_s``, ``kv_checksum``, ...): this takes
every setting the core declares from them by that name, so no driver lists the fields again and
a setting the core gains reaches each driver that names it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

from lw.fsm.decode_request import DecodeConfig
from lw.fsm.prefill_request import PrefillConfig

__all__ = ["core_config"]

C = TypeVar("C", PrefillConfig, DecodeConfig)


def core_config(kind: type[C], settings: Mapping[str, Any], **computed: Any) -> C:
    """``kind`` built from a driver's ``settings`` (e.g. ``vars(cfg)``): every field of ``kind``
    they name, by that name, the others at the core's defaults. ``computed`` adds or replaces
    values the driver derives rather than names (the checker's one retry budget, the synthetic
    cluster's lease); a name ``kind`` does not declare there is an error, not ignored."""
    names = {f.name for f in fields(kind)}
    unknown = computed.keys() - names
    if unknown:
        raise TypeError(f"{kind.__name__} has no setting {', '.join(sorted(unknown))}")
    return kind(**{**{k: v for k, v in settings.items() if k in names}, **computed})
