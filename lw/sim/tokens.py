"""First tokens in the checker world (``WorldConfig.first_token_from_p``): which token a
sampler draws for a request, with which sampling spec, so that the properties can tell from a
token alone whose it is.

A token packs the request it was drawn for, the claim epoch of the prefill (or of D's own
decode) that drew it, whether P drew it with other sampling parameters than the client asked
for, and whether D drew it itself (no first token from P, or a recompute). Specs are one per
request: the client's, or P's defaults. Every request asks for the same spec, as requests with
the same sampling parameters (unseeded) do: a spec never tells two requests apart.
"""

from __future__ import annotations

from typing import NamedTuple

CLIENT_SPEC = "t0.7"  # the spec digest every client asks for
OTHER_SPEC = "defaults"  # what a P that was not given the client's parameters samples with


class Origin(NamedTuple):
    """Whom a token was drawn for: request index, claim epoch, sampling spec, by D itself."""

    idx: int
    epoch: int
    spec: str
    by_d: bool


def spec_of(idx: int) -> str:
    """The sampling spec digest the client asked for with request ``idx``."""
    return CLIENT_SPEC


def p_token(idx: int, epoch: int, other_spec: bool = False) -> int:
    """The first token P's prefill of request ``idx`` under claim ``epoch`` samples."""
    return (idx << 8) | (epoch << 2) | (int(other_spec) << 1)


def d_token(idx: int, epoch: int) -> int:
    """The first token D samples itself for request ``idx`` (its own spec) under ``epoch``."""
    return (idx << 8) | (epoch << 2) | 1


def origin(token: int) -> Origin:
    """Whom ``token`` was drawn for (the inverse of :func:`p_token` and :func:`d_token`)."""
    idx = token >> 8
    return Origin(idx, (token >> 2) & 0x3F, OTHER_SPEC if token & 2 else spec_of(idx),
                  bool(token & 1))


def show(token: int) -> str:
    """A token in reports: whose, which epoch, by whom, with which spec."""
    o = origin(token)
    return (f"token {token} ({'D' if o.by_d else 'P'}'s for r{o.idx} epoch {o.epoch}, "
            f"spec {o.spec})")
