"""P: whether the proxy's signed params for a prefill (already of their declared type) fit this
engine and prompt: contract version, D's TP, KV geometry, D's blocks for the prompt's length,
the prompt's digest; and the params fetched for a request sent ahead, decoded and checked to be
for that transfer. One check for the scheduler side (every prefill) and P's worker (the params
it fetched for a request computed ahead), so that the two never disagree."""

from __future__ import annotations

from typing import Any

from lw.contract.params import (
    CONTRACT_VERSION,
    ContractError,
    PrefillParams,
    decode_params_for_prefiller,
)
from lw.contract.transfer_ids import is_sub_transfer_of
from lw.fsm.prefill_request import received_blocks

__all__ = ["check_fit", "decode_fetched"]


def decode_fetched(key: bytes | None, params: Any, ahead_id: str) -> PrefillParams:
    """The params P fetched for a request sent ahead under the proxy's ``ahead_id``, decoded
    (signed by the proxy, of the declared type) and for a sub-transfer of it; ContractError
    otherwise."""
    pp = decode_params_for_prefiller(key, params)
    if not is_sub_transfer_of(pp.transfer_id, ahead_id):
        raise ContractError("kv_transfer_params.transfer_id", "not a sub-transfer of the "
                            "transfer sent ahead")
    return pp


def check_fit(pp: PrefillParams, *, peer_tp_size: int, geometry: str, num_prompt_tokens: int,
              prompt: str, block_size: int) -> None:
    """ValueError saying what of ``pp`` does not fit an engine configured for decode TP
    ``peer_tp_size`` (0: any) with KV ``geometry``, for a prompt of ``num_prompt_tokens``
    tokens whose digest is ``prompt``."""
    if pp.lw_params_version != CONTRACT_VERSION:
        raise ValueError(f"kv_transfer_params lw_params_version={pp.lw_params_version!r}, "
                         f"this prefill engine speaks {CONTRACT_VERSION} (is the decode "
                         "engine running lw's connector of this release?)")
    if peer_tp_size and pp.remote_tp_size != peer_tp_size:
        raise ValueError(f"decode TP {pp.remote_tp_size} but this prefill engine was "
                         f"configured for decode TP {peer_tp_size} "
                         "(kv_connector_extra_config.peer_tp_size)")
    if pp.lw_geometry != geometry:
        raise ValueError(f"KV geometry differs: decode has {pp.lw_geometry!r}, prefill has "
                         f"{geometry!r}")
    need = received_blocks(num_prompt_tokens, 0, block_size).stop
    first, blocks = pp.remote_first_block, pp.remote_block_ids
    if first + len(blocks) != need:
        raise ValueError(f"{first}+{len(blocks)} remote blocks for a prompt of "
                         f"{num_prompt_tokens} tokens ({need} blocks)")
    if prompt != pp.lw_prompt_digest:
        # D's blocks are for another prompt: writing this one's KV there is wrong KV
        raise ValueError("the prompt differs from the one the decode engine allocated its "
                         "blocks for (lw_prompt_digest)")
