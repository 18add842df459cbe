"""The ``kv_transfer_params`` of lw's requests and the metaserver call, as msgspec Structs, with
the proxy's signature over them.

Three flows, one version (:data:`CONTRACT_VERSION`):

- proxy -> D (:class:`DecodeParams`): where to ask for the prefill (the proxy's metaserver), the
  transfer id and the grant of its calls, signed by the proxy with the cluster key;
- D -> proxy (:class:`MetaserverCall`, whose ``kv_transfer_params`` is a :class:`DecoderKV`): the
  blocks D allocated and the digest of the prompt they are for (the HTTP call itself is signed,
  lw.contract.auth);
- proxy -> P (:class:`PrefillParams`): D's :class:`DecoderKV` plus the sub-transfer id and claim
  epoch, signed by the proxy.

D and P act only on parameters that decode into their type *and* carry the proxy's signature, so
parameters a client wrote (a metaserver URL of its choice, another request's blocks) are refused
wherever they arrive: through the proxy, or straight at an engine's port. A signature binds every
field, the role (a decode signature is never a valid prefill signature) and the version.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from array import array
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

import msgspec

__all__ = [
    "CONTRACT_VERSION",
    "ContractError",
    "DecodeParams",
    "DecoderKV",
    "MetaserverCall",
    "PrefillParams",
    "decode_params_for_decoder",
    "decode_params_for_prefiller",
    "is_prefill_request",
    "is_remote_prefill_request",
    "metaserver_call",
    "prefill_params",
    "prompt_digest",
    "sign_params",
]

CONTRACT_VERSION = 4
"""Version of everything here (``lw_contract`` / ``lw_params_version``). 4: D names the seed its
request samples with (``lw_seed``: P samples token 1 for D); 3: the proxy signs the
params it gives D and P, and D's params name the prompt's digest; 2: per-request transfer ids,
P computes D's token ids; 1: the proxy's id and the client's body. P, D and the proxy of
different versions refuse each other, naming both versions."""

SIGNATURE_FIELD = "lw_sig"
VERSION_FIELD = "lw_contract"
MAX_ID = 256
"""Longest transfer id (the core's request id limit, lw.fsm.messages)."""
MAX_URL = 2048
MAX_BLOCKS = 1 << 20
MAX_PROMPT_TOKENS = 1 << 22
_PURPOSE = b"lw-kv-params/3"
"""Domain separation: a side-channel or control-call MAC is never a valid params signature."""

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID)]
Url = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_URL,
                                  pattern=r"^https?://[^\s@/?#]+(/[^\s?#]*)?$")]
Host = Annotated[str, msgspec.Meta(min_length=1, max_length=255,
                                   pattern=r"^[A-Za-z0-9._:\[\]-]+$")]
Port = Annotated[int, msgspec.Meta(gt=0, lt=65536)]
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]
Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Digest = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{32}$")]
Sig = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]


class ContractError(ValueError):
    """Parameters that are not lw's contract; ``field`` names where (``kv_transfer_params``,
    ``kv_transfer_params.remote_port``, ...), for the error a caller reads."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class DecodeParams(msgspec.Struct, forbid_unknown_fields=True):
    """proxy -> D: run this request D first; ask ``metaserver`` for its prefill."""

    do_remote_prefill: bool
    metaserver: Url
    transfer_id: Id
    metaserver_grant: Annotated[str, msgspec.Meta(min_length=16, max_length=128)]
    lw_contract: int
    lw_sig: Sig
    do_remote_decode: bool = False


class DecoderKV(msgspec.Struct, forbid_unknown_fields=True):
    """D -> proxy (in the metaserver call): where P writes, and the prompt that is for."""

    remote_engine_id: Id
    remote_host: Host
    remote_port: Port
    remote_block_ids: Annotated[list[BlockId], msgspec.Meta(min_length=1, max_length=MAX_BLOCKS)]
    remote_tp_size: Annotated[int, msgspec.Meta(ge=1, le=65536)]
    lw_geometry: Annotated[str, msgspec.Meta(max_length=4096)]
    lw_params_version: int
    lw_prompt_digest: Digest
    remote_first_block: Count = 0
    remote_dp_rank: Count = 0
    # the seed D's request samples with (a child of n > 1 has its own, which the client's body
    # P gets does not say): P samples token 1 with it, so that D may continue from P's token
    lw_seed: Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)] | None = None


class PrefillParams(DecoderKV, forbid_unknown_fields=True):
    """proxy -> P: push this sub-transfer's KV to D's blocks, under claim epoch ``lw_epoch``."""

    do_remote_decode: bool = True
    do_remote_prefill: bool = False
    transfer_id: Id = ""
    lw_epoch: Count = 0
    lw_contract: int = 0
    lw_sig: str = ""


class MetaserverCall(msgspec.Struct, forbid_unknown_fields=True):
    """D -> proxy: start (``epoch`` 0) or restart (``epoch`` > 0, avoiding ``avoid``) the
    prefill of one sub-transfer. A first call names the prompt and D's params."""

    transfer_id: Id
    sub_transfer_id: Id
    grant: Annotated[str, msgspec.Meta(max_length=128)] = ""
    prompt_token_ids: Annotated[list[TokenId], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)] = []
    kv_transfer_params: DecoderKV | None = None
    retry_prefill: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    epoch: Count = 0
    avoid: Annotated[list[Annotated[str, msgspec.Meta(max_length=MAX_ID)]],
                     msgspec.Meta(max_length=256)] = []
    reason: Annotated[str, msgspec.Meta(max_length=1000)] = ""


def prompt_digest(token_ids: Sequence[int]) -> str:
    """The digest that binds D's blocks to a prompt (128 bits of BLAKE2b over the ids)."""
    try:
        data = array("q", token_ids).tobytes()
    except (OverflowError, TypeError) as exc:
        raise ContractError("prompt_token_ids", f"not token ids ({exc})") from None
    return hashlib.blake2b(data, digest_size=16, person=b"lw-prompt").hexdigest()


def _mac(key: bytes, role: str, params: Mapping[str, Any]) -> str:
    body = {k: v for k, v in params.items() if k != SIGNATURE_FIELD}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hmac.digest(key, b"\n".join((_PURPOSE, role.encode(), canon.encode())),
                       "sha256").hex()


def sign_params(key: bytes | None, role: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with the contract version and the proxy's signature for ``role`` ("decode"
    or "prefill"); without a key (a trusted network) the signature is all zeros."""
    out = {k: v for k, v in params.items() if k != SIGNATURE_FIELD}
    out[VERSION_FIELD] = CONTRACT_VERSION
    out[SIGNATURE_FIELD] = _mac(key, role, out) if key is not None else "0" * 64
    return out


def _check(key: bytes | None, role: str, params: Mapping[str, Any]) -> None:
    version = params.get(VERSION_FIELD)
    if version != CONTRACT_VERSION:
        raise ContractError(f"kv_transfer_params.{VERSION_FIELD}",
                            f"contract version {version!r}, this engine speaks "
                            f"{CONTRACT_VERSION} (proxy and engines of different lw releases?)")
    if key is None:
        return
    sig = params.get(SIGNATURE_FIELD)
    if not isinstance(sig, str) or not hmac.compare_digest(
            sig.encode("ascii", "replace"), _mac(key, role, params).encode()):
        raise ContractError(f"kv_transfer_params.{SIGNATURE_FIELD}",
                            "not signed by this cluster's proxy (client-written or altered "
                            "transfer parameters are refused)")


def _where(exc: msgspec.ValidationError) -> tuple[str, str]:
    """(what msgspec says is wrong, the path it names: ``.remote_port``, ``[2]``, or "")."""
    # msgspec says "... - at `$.remote_port`"
    what, _, at = str(exc).partition(" - at `$")
    return what, at.rstrip("`")


def _convert(params: Any, typ: type[Any]) -> Any:
    if not isinstance(params, Mapping):
        raise ContractError("kv_transfer_params",
                            f"must be an object, got {type(params).__name__}")
    try:
        return msgspec.convert(dict(params), typ)
    except msgspec.ValidationError as exc:
        what, at = _where(exc)  # the field named as the client wrote it
        raise ContractError("kv_transfer_params" + at.replace("[", ".").replace("]", ""),
                            what) from None


def is_remote_prefill_request(params: Any) -> bool:
    """Whether a request's params ask D to have its prompt prefilled elsewhere (any shape: a
    request that says so and is malformed must be refused, not served as a plain one)."""
    return isinstance(params, Mapping) and params.get("do_remote_prefill") not in (None, False)


def is_prefill_request(params: Any) -> bool:
    """Whether a request's params ask P to push its KV to a decoder (any shape, as above)."""
    return isinstance(params, Mapping) and params.get("do_remote_decode") not in (None, False)


def decode_params_for_decoder(key: bytes | None, params: Any) -> DecodeParams:
    """D: the proxy's signed params of a request, or ContractError naming the field."""
    if isinstance(params, Mapping):
        _check(key, "decode", params)  # first: an unsigned caller learns no field names
    out: DecodeParams = _convert(params, DecodeParams)
    if not out.do_remote_prefill or out.do_remote_decode:
        raise ContractError("kv_transfer_params.do_remote_prefill",
                            "a decode engine takes do_remote_prefill=true, do_remote_decode=false")
    return out


def decode_params_for_prefiller(key: bytes | None, params: Any) -> PrefillParams:
    """P: the proxy's signed params of a prefill, or ContractError naming the field."""
    if isinstance(params, Mapping):
        _check(key, "prefill", params)
    out: PrefillParams = _convert(params, PrefillParams)
    if not out.do_remote_decode or out.do_remote_prefill or not out.transfer_id:
        raise ContractError("kv_transfer_params.do_remote_decode",
                            "a prefill engine takes do_remote_decode=true, "
                            "do_remote_prefill=false and a transfer_id")
    return out


def decoder_params(metaserver: str, transfer_id: str, grant: str) -> dict[str, Any]:
    """The (unsigned) params the proxy gives D for a transfer."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "metaserver": metaserver,
            "transfer_id": transfer_id, "metaserver_grant": grant}


def prefill_params(kv: DecoderKV | Mapping[str, Any], transfer_id: str,
                   epoch: int = 0) -> dict[str, Any]:
    """The (unsigned) params the proxy gives P: D's, for sub-transfer ``transfer_id`` at claim
    epoch ``epoch`` (absent for the first attempt)."""
    out = msgspec.to_builtins(kv) if isinstance(kv, DecoderKV) else dict(kv)
    for k in (SIGNATURE_FIELD, VERSION_FIELD, "lw_epoch"):
        out.pop(k, None)
    if out.get("lw_seed", 0) is None:
        del out["lw_seed"]  # absent, as D posted it
    out.update(do_remote_decode=True, do_remote_prefill=False, transfer_id=transfer_id)
    if epoch:
        out["lw_epoch"] = epoch
    return out


def metaserver_call(raw: bytes) -> MetaserverCall:
    """The proxy: a metaserver call's body, or ContractError naming the field."""
    try:
        call = msgspec.json.decode(raw, type=MetaserverCall)
    except msgspec.ValidationError as exc:
        what, at = _where(exc)
        raise ContractError(at.lstrip(".") or "body", what) from None
    except msgspec.DecodeError as exc:
        raise ContractError("body", f"not JSON: {exc}") from None
    kv = call.kv_transfer_params
    if kv is not None and kv.lw_params_version != CONTRACT_VERSION:
        raise ContractError("kv_transfer_params.lw_params_version",
                            f"version {kv.lw_params_version}, this proxy speaks "
                            f"{CONTRACT_VERSION} (decode engine of another lw release?)")
    if kv is not None and call.prompt_token_ids and \
            prompt_digest(call.prompt_token_ids) != kv.lw_prompt_digest:
        raise ContractError("kv_transfer_params.lw_prompt_digest",
                            "does not match prompt_token_ids")
    return call
