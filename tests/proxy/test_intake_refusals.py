"""What the proxy reads from a client (lw.proxy.intake, lw.contract.client), without a server:
the nesting bound at its edge, the transfer fields a body loses, and where a refusal points.
Written to kill the survivors of ``tools/mutation.py --scope security``."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest

from lw.contract.client import MAX_JSON_DEPTH, json_depth_exceeds, screen_client_body
from lw.contract.params import ContractError
from lw.proxy.intake import BadJson, _unencodable, decode_json, encode_json, screen


def nested(depth: int, kind: str = "list") -> Any:
    """A JSON value ``depth`` containers deep."""
    v: Any = 1
    for _ in range(depth):
        v = [v] if kind == "list" else {"a": v}
    return v


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_the_nesting_bound_is_64_containers(kind: str) -> None:
    """docs/deployment.md: a body nested deeper than 64 is refused."""
    assert MAX_JSON_DEPTH == 64
    assert not json_depth_exceeds(nested(64, kind))
    assert json_depth_exceeds(nested(65, kind))
    assert json_depth_exceeds(nested(3, kind), limit=2) and not json_depth_exceeds(1, limit=0)


def test_a_body_loses_its_transfer_fields_and_keeps_the_rest() -> None:
    body = {"prompt": "p", "kv_transfer_params": {"do_remote_prefill": True},
            "vllm_xargs": {"kv_transfer_params": None, "other": 1}}
    out, fields = screen_client_body(body)
    assert out == {"prompt": "p", "vllm_xargs": {"other": 1}}
    assert fields.dropped == ("kv_transfer_params", "vllm_xargs.kv_transfer_params")
    assert body["vllm_xargs"] == {"kv_transfer_params": None, "other": 1}  # not changed
    assert screen_client_body({"prompt": "p"}) == ({"prompt": "p"}, screen_client_body({})[1])


@pytest.mark.parametrize(("body", "field"), [
    ({"kv_transfer_params": "x"}, "kv_transfer_params"),
    ({"kv_transfer_params": [1]}, "kv_transfer_params"),
    ({"vllm_xargs": ["kv_transfer_params"]}, "vllm_xargs"),
    ({"vllm_xargs": {"kv_transfer_params": 1}}, "vllm_xargs.kv_transfer_params"),
])
def test_a_transfer_field_of_a_wrong_type_is_refused_naming_it(body: dict[str, Any],
                                                                field: str) -> None:
    with pytest.raises(ContractError) as err:
        screen_client_body(body)
    assert err.value.field == field


def test_a_refusal_names_at_most_200_characters_of_where() -> None:
    key = "k" * 300
    with pytest.raises(BadJson) as err:
        decode_json(b'{"' + key.encode() + b'": NaN}')
    assert err.value.path == key[:200] and err.value.vllm is None
    with pytest.raises(BadJson) as err:
        decode_json(b"")
    assert err.value.path is None and err.value.vllm is not None
    assert decode_json(b'{"a": [1, "x"]}') == {"a": [1, "x"]}


def test_what_json_cannot_carry_is_not_encoded() -> None:
    assert encode_json({"a": "\u00e9"}) == '{"a": "\u00e9"}'.encode()
    for value in (float("nan"), float("inf"), "\ud800"):
        with pytest.raises(ValueError):
            encode_json({"a": value})


class Notes:
    """The proxy's rate-limited refusal log: what was noted, by kind."""

    def __init__(self) -> None:
        self.kinds: list[str] = []

    def note(self, kind: str, *args: Any, **kw: Any) -> None:
        self.kinds.append(kind)


def test_a_dropped_client_field_is_counted_and_logged() -> None:
    state = SimpleNamespace(counters=Counter(), refusals=Notes())
    out = screen(state, {"prompt": "p", "kv_transfer_params": {"x": 1}})  # type: ignore[arg-type]
    assert out == {"prompt": "p"}
    assert state.counters["client_transfer_params_dropped"] == 1
    assert state.refusals.kinds == ["client_transfer_params_dropped"]
    assert screen(state, {"prompt": "p"}) == {"prompt": "p"}  # type: ignore[arg-type]
    assert state.refusals.kinds == ["client_transfer_params_dropped"]  # nothing to say


def test_a_value_json_can_carry_is_reported_as_too_deep() -> None:
    """The last resort of the search for what failed to encode: nothing else was found."""
    assert _unencodable({"a": [1, "x"]}) == ("", "it nests too deep to encode")
