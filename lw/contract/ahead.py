"""Admission ahead of D's parameters (the proxy's ``--start-mode admit-ahead``): the types of
the three messages it adds to the contract, and their checks.

- proxy -> P (:class:`AheadParams`, the ``kv_transfer_params`` of a prefill sent to P together
  with the client's request to D): admit this request now, but schedule it only once D's params
  are known; fetch them from ``lw_ahead_url`` with ``lw_ahead_grant``. Signed by the proxy for
  the role "prefill-ahead" (never valid as a prefill's or a decode's signature).
- P -> proxy (:class:`AheadFetch`, a signed control call, lw.contract.auth): the digest of the
  prompt P tokenized for this request; the proxy answers once D has allocated its blocks. The
  same call with ``refused`` says P's core refused the bind (compute-ahead: it had dropped the
  request): the proxy then starts that prefill D first.
- proxy -> P (:class:`AheadAnswer`): ``go`` with the :class:`~lw.contract.params.PrefillParams`
  a D-first prefill would carry (signed for "prefill", checked again by P), or ``fallback``
  (D's prompt differs, D did not call in time, the request ended): P leaves the request waiting
  for the proxy to cancel it, and the proxy starts the prefill in today's order if one is due.

With ``--start-mode admit-ahead`` P computes nothing before D's blocks exist: what moves
ahead is P's admission (HTTP, the engine's queue), never its compute. With ``compute-ahead``
the params say ``lw_ahead_compute``: P computes at once into its own blocks and its core
(``PrefillEndpoint.add_ahead``) sends nothing until the fetched params bind it (``bind``);
a ``fallback`` answer drops what it computed (docs/protocol.md, "Computing ahead").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec

from lw.contract.params import (
    ContractError,
    Digest,
    Id,
    Sig,
    Url,
    _check,
    _convert,
    _where,
    sign_params,
)

__all__ = ["AHEAD_ROLE", "HELD_KEY", "AheadAnswer", "AheadFetch", "AheadParams", "ahead_answer",
           "ahead_fetch", "ahead_params", "ahead_url", "decode_ahead_params", "is_ahead_request",
           "sign_ahead_params"]

AHEAD_ROLE = "prefill-ahead"
"""The role the proxy signs :class:`AheadParams` for."""
HELD_KEY = "lw_ahead_held"
"""P -> proxy, in a finished prefill's ``kv_transfer_params``: it was computed ahead and P holds
its KV for the bind (a P that did not compute it ahead, e.g. of another release, says nothing,
and the proxy starts that prefill D first)."""
URL_FIELD = "lw_ahead_url"
Grant = Annotated[str, msgspec.Meta(min_length=16, max_length=128)]


class AheadParams(msgspec.Struct, forbid_unknown_fields=True):
    """proxy -> P: admit now; fetch D's params from ``lw_ahead_url`` before computing."""

    do_remote_decode: bool
    transfer_id: Id
    lw_ahead_url: Url
    lw_ahead_grant: Grant
    lw_contract: int
    lw_sig: Sig
    do_remote_prefill: bool = False
    lw_ahead_compute: bool = False  # compute now, write once bound (compute-ahead)


class AheadFetch(msgspec.Struct, forbid_unknown_fields=True):
    """P -> proxy: D's params for ``transfer_id``, for the prompt whose digest P computed; or,
    with ``refused``, that P refused the bind of the params it was handed (it had dropped the
    request first, past ``ahead_wait_s``): D was claimed by no one, the proxy starts the
    prefill D first."""

    transfer_id: Id
    grant: Grant
    prompt_digest: Digest
    refused: Annotated[str, msgspec.Meta(max_length=1000)] = ""


class AheadAnswer(msgspec.Struct, forbid_unknown_fields=True):
    """proxy -> P: ``go`` with the (signed) params of the prefill, or ``fallback`` and why."""

    status: Literal["go", "fallback"]
    kv_transfer_params: dict[str, Any] | None = None
    detail: Annotated[str, msgspec.Meta(max_length=1000)] = ""


def is_ahead_request(params: Any) -> bool:
    """Whether a prefill request's params ask for admission ahead of D's (any shape: one that
    says so and is malformed must be refused, not taken for another kind)."""
    return isinstance(params, Mapping) and URL_FIELD in params


def ahead_url(metaserver_url: str) -> str:
    """Where P fetches D's params: the control plane's ``/v1/ahead`` beside the metaserver (the
    proxy builds it so; P fetches from no other URL when its metaservers are listed)."""
    return metaserver_url.rsplit("/", 1)[0] + "/ahead"


def ahead_params(url: str, transfer_id: str, grant: str, compute: bool = False
                 ) -> dict[str, Any]:
    """The (unsigned) params the proxy gives P for an ahead admission (``compute``: P computes
    at once, compute-ahead)."""
    out = {"do_remote_decode": True, "transfer_id": transfer_id, URL_FIELD: url,
           "lw_ahead_grant": grant}
    if compute:
        out["lw_ahead_compute"] = True
    return out


def sign_ahead_params(key: bytes | None, url: str, transfer_id: str, grant: str,
                      compute: bool = False) -> dict[str, Any]:
    """:func:`ahead_params` signed for :data:`AHEAD_ROLE`."""
    return sign_params(key, AHEAD_ROLE, ahead_params(url, transfer_id, grant, compute))


def decode_ahead_params(key: bytes | None, params: Any) -> AheadParams:
    """P: the proxy's signed ahead params, or ContractError naming the field."""
    if isinstance(params, Mapping):
        _check(key, AHEAD_ROLE, params)
    out: AheadParams = _convert(params, AheadParams)
    if not out.do_remote_decode or out.do_remote_prefill:
        raise ContractError("kv_transfer_params.do_remote_decode",
                            "a prefill engine takes do_remote_decode=true, "
                            "do_remote_prefill=false")
    return out


def ahead_fetch(raw: bytes) -> AheadFetch:
    """The proxy: an ahead fetch's body, or ContractError naming the field."""
    try:
        return msgspec.json.decode(raw, type=AheadFetch)
    except msgspec.ValidationError as exc:
        what, at = _where(exc)
        raise ContractError(at.lstrip(".") or "body", what) from None
    except msgspec.DecodeError as exc:
        raise ContractError("body", f"not JSON: {exc}") from None


def ahead_answer(data: Any) -> AheadAnswer:
    """P: the proxy's answer to a fetch (decoded JSON), or ContractError naming the field."""
    try:
        return msgspec.convert(data, AheadAnswer)
    except msgspec.ValidationError as exc:
        what, at = _where(exc)
        raise ContractError("answer" + at, what) from None

