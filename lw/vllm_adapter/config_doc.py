"""docs/deployment.md's tables of the connector's keys, generated from
:class:`~lw.vllm_adapter.config.LwConfig`'s declarations (``lw diagrams`` writes them, ``lw
diagrams --check`` fails when they are stale)."""

from __future__ import annotations

from dataclasses import Field
from typing import Any

from lw.vllm_adapter.config import DERIVED, EXPERIMENTAL, SECTIONS, fields_of

__all__ = ["key_table", "shown_default"]


def shown_default(f: Field[Any]) -> str:
    """A key's default as the docs show it (its ``shown`` text, else the value)."""
    shown = f.metadata.get("shown")
    if shown is not None:
        return str(shown)
    v = f.default
    return (str(v).lower() if isinstance(v, bool) else f'`"{v}"`' if isinstance(v, str)
            else format(v, "g") if isinstance(v, float) else str(v))


def _sources(keys: str) -> str:
    """The keys a setting derives from, as code ("fixed" for none)."""
    return ", ".join(f"`{k.strip()}`" for k in keys.split(",")) if keys else "fixed"


def key_table() -> str:
    """The markdown tables of every key, by section, the ``experimental`` object's keys and the
    derived settings (docs/deployment.md, by `lw diagrams`)."""
    out: list[str] = []
    for section, about in SECTIONS.items():
        out += [f"**{section}**: {about}", "", "| key | default | side | meaning |",
                "|---|---|---|---|"]
        out += [f"| `{f.name}` | {shown_default(f)} | {f.metadata['side']} | "
                f"{f.metadata['doc']} |" for f in fields_of(section)]
        out.append("")
    out += [f"**{EXPERIMENTAL}**: one object, e.g. `\"{EXPERIMENTAL}\": {{\"layer_batch_ms\": 5}}`"
            " (it counts as one key). **Unsupported**: knobs of benchmarks and tests, whose "
            "defaults are right for the demo and for a GPU deployment; they may change or go "
            "without notice. Given at the top level, each is refused naming its place here; an "
            "unknown key inside is refused too.", "",
            "| key | default | side | meaning | why not a supported key |", "|---|---|---|---|---|"]
    out += [f"| `{f.name}` | {shown_default(f)} | {f.metadata['side']} | {f.metadata['doc']} | "
            f"{f.metadata['why']} |" for f in fields_of(EXPERIMENTAL)]
    out += ["", f"**{DERIVED}**: not keys. Each follows from the keys above; given anyway, at "
            "the top level or in `experimental`, it is refused at start naming what it derives "
            "from. `lw config --explain` prints each one's value.", "",
            "| setting | from | at the defaults | rule |", "|---|---|---|---|"]
    out += [f"| `{f.name}` | {_sources(f.metadata['from'])} | {shown_default(f)} | "
            f"{f.metadata['doc']} |" for f in fields_of(DERIVED)]
    return "\n".join(out) + "\n"
