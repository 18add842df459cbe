"""Mermaid sequence diagrams: the one renderer of counterexamples and of request timelines."""

from __future__ import annotations


def clean(text: str) -> str:
    """Text safe inside a Mermaid message or note (no statement separators, comments, arrows)."""
    return (text.replace(";", ",").replace("#", "no.").replace("\n", " ")
            .replace("->", "\u2192"))


def header(participants: list[tuple[str, str]]) -> list[str]:
    """``sequenceDiagram`` and one ``participant ID as LABEL`` line per (id, label)."""
    return ["sequenceDiagram", *(f"    participant {p} as {label}" for p, label in participants)]


def arrow(src: str, dst: str, text: str, dashed: bool = False) -> str:
    """A message from ``src`` to ``dst`` (dashed: an answer)."""
    return f"    {src}{'-->>' if dashed else '->>'}{dst}: {clean(text)}"


def note(where: str, text: str) -> str:
    """A note over one participant, or over ``A,B`` (a span)."""
    return f"    Note over {where}: {clean(text)}"
