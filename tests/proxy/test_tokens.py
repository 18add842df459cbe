"""The proxy's tokenizer (``lw proxy --tokenizer``, lw.proxy.tokens): which prompts it may
tokenize, the check against a decode server's ``/tokenize`` that must pass before it is used, its
refusal to be used after a disagreement or without answers, and the body D then gets through
the real proxy app."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from lw.proxy.server import build_apps, main  # noqa: E402
from lw.proxy.tokens import (  # noqa: E402
    MAX_CHECK_ERRORS,
    PROBE,
    TEXT_LIMIT,
    VERIFY_PROMPTS,
    ProxyTokenizer,
    eligible_prompts,
    load_encoder,
)

D = "http://d.test"
TIMEOUT = httpx.Timeout(2.0)


def encode(text: str, special: bool) -> list[int]:
    """A stand-in tokenizer: one id per character, 1 (BOS) first with special tokens."""
    return ([1] if special else []) + [ord(c) for c in text]


def engine(tokenize: Any = encode, seen: list[dict[str, Any]] | None = None,
           status: int = 200) -> httpx.AsyncClient:
    """A client whose decode server answers ``/tokenize`` with ``tokenize``'s ids."""
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/tokenize"
        body = json.loads(request.content)
        if seen is not None:
            seen.append(body)
        if status != 200:
            return httpx.Response(status, json={"error": "no"})
        return httpx.Response(200, json={"tokens": tokenize(body["prompt"],
                                                            body["add_special_tokens"])})
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def checked(tok: ProxyTokenizer, client: httpx.AsyncClient, body: dict[str, Any]) -> None:
    """Run the check ``body`` asks for, as the proxy does beside the request."""
    text = tok.wants_check(True, body)
    if text is not None:
        asyncio.run(tok.check(client, D, body["model"], text, TIMEOUT))


def trusted(model: str = "m") -> ProxyTokenizer:
    tok = ProxyTokenizer("fake", encode)
    client = engine()
    for i in range(VERIFY_PROMPTS):
        checked(tok, client, {"model": model, "prompt": f"prompt {i}"})
    assert tok.status == "on"
    return tok


# ---------------------------------------------------------------------------------------------
# What may be tokenized


@pytest.mark.parametrize("body", [
    {"prompt": "hi"}, {"prompt": ["a", "b"]}, {"prompt": "hi", "add_special_tokens": False},
    {"prompt": "hi", "echo": False, "suffix": None},
])
def test_eligible_prompts_take_text_whose_tokens_are_the_texts(body: dict[str, Any]) -> None:
    got = eligible_prompts(body)
    assert got is not None
    assert got[0] == ([body["prompt"]] if isinstance(body["prompt"], str) else body["prompt"])
    assert got[1] == body.get("add_special_tokens", True)


@pytest.mark.parametrize("body", [
    {"prompt": [1, 2, 3]}, {"prompt": [[1, 2]]}, {"prompt": ["a", 3]}, {"prompt": []},
    {"prompt": None}, {}, {"prompt": "hi", "echo": True}, {"prompt": "hi", "suffix": "x"},
    {"prompt": "hi", "truncate_prompt_tokens": 8}, {"prompt": "hi", "truncation_side": "left"},
    {"prompt": "hi", "prompt_embeds": "AAAA"}, {"prompt": "hi", "return_token_offsets": True},
    {"prompt": "hi", "add_special_tokens": "yes"}, {"prompt": "x" * (TEXT_LIMIT + 1)},
    {"prompt": ["x" * (TEXT_LIMIT // 2), "y" * (TEXT_LIMIT // 2 + 1)]},
])
def test_eligible_prompts_leave_the_rest_to_the_engine(body: dict[str, Any]) -> None:
    assert eligible_prompts(body) is None


# ---------------------------------------------------------------------------------------------
# The check before use


def test_used_only_after_agreeing_on_the_probe_and_the_first_prompts() -> None:
    tok = ProxyTokenizer("fake", encode)
    seen: list[dict[str, Any]] = []
    client = engine(seen=seen)
    body = {"model": "m", "prompt": "hello"}
    for i in range(VERIFY_PROMPTS):
        assert tok.apply(True, body) is None  # as text while checking
        checked(tok, client, {"model": "m", "prompt": f"prompt {i}"})
    assert tok.status == "on" and tok.model == "m"
    # the first check also asks for the probe; every check asks with special tokens, for m
    assert [b["prompt"] for b in seen] == [PROBE, "prompt 0", *[f"prompt {i}" for i in
                                                                 range(1, VERIFY_PROMPTS)]]
    assert all(b["model"] == "m" and b["add_special_tokens"] is True for b in seen)
    out = tok.apply(True, body)
    assert out == {"model": "m", "prompt": encode("hello", True)}
    assert body == {"model": "m", "prompt": "hello"}  # the client's body is not changed
    assert tok.metrics()["prompts_tokenized"] == 1


def test_a_prompt_list_becomes_a_list_of_token_id_lists_and_special_tokens_are_honoured() -> None:
    tok = trusted()
    out = tok.apply(True, {"model": "m", "prompt": ["ab", "c"], "add_special_tokens": False})
    assert out is not None and out["prompt"] == [[97, 98], [99]]


def test_not_used_for_chat_another_model_or_an_ineligible_body() -> None:
    tok = trusted("m")
    assert tok.apply(False, {"model": "m", "prompt": "hi"}) is None
    assert tok.apply(True, {"model": "other", "prompt": "hi"}) is None
    assert tok.apply(True, {"model": "m", "prompt": "hi", "echo": True}) is None


def test_one_check_at_a_time_and_none_for_another_model_once_one_agreed() -> None:
    tok = ProxyTokenizer("fake", encode)
    assert tok.wants_check(True, {"model": "m", "prompt": "a"}) == "a"
    assert tok.wants_check(True, {"model": "m", "prompt": "b"}) is None  # one in flight
    asyncio.run(tok.check(engine(), D, "m", "a", TIMEOUT))
    assert tok.agreed == 1 and not tok.checking
    assert tok.wants_check(True, {"model": "other", "prompt": "b"}) is None
    assert tok.wants_check(False, {"model": "m", "prompt": "b"}) is None
    assert tok.wants_check(True, {"model": "m", "prompt": "b", "add_special_tokens": False}) \
        is None  # the check compares with special tokens


def test_a_disagreement_turns_it_off_for_good_and_names_the_first_differing_token(
        caplog: pytest.LogCaptureFixture) -> None:
    def other(text: str, special: bool) -> list[int]:
        ids = encode(text, special)
        return ids[:5] + [0] + ids[6:] if text != PROBE else ids

    tok = ProxyTokenizer("fake", encode)
    with caplog.at_level(logging.ERROR, logger="lw.proxy"):
        checked(tok, engine(other), {"model": "m", "prompt": "abcdefgh"})
    assert tok.status == "off"
    msg = caplog.records[-1].getMessage()
    assert "disagrees with http://d.test/tokenize" in msg and "token 5" in msg
    assert "proxy 101, engine 0" in msg and "as text" in msg
    for _ in range(3):  # never checked again, never used
        assert tok.wants_check(True, {"model": "m", "prompt": "x"}) is None
        assert tok.apply(True, {"model": "m", "prompt": "x"}) is None


def test_a_shorter_answer_is_a_disagreement_at_its_end(caplog: pytest.LogCaptureFixture) -> None:
    tok = ProxyTokenizer("fake", encode)
    with caplog.at_level(logging.ERROR, logger="lw.proxy"):
        checked(tok, engine(lambda t, s: encode(t, s)[:-1]), {"model": "m", "prompt": "ab"})
    assert tok.status == "off"
    assert "engine (end)" in caplog.records[-1].getMessage()


def test_a_decode_server_that_does_not_answer_leaves_it_unused_then_off(
        caplog: pytest.LogCaptureFixture) -> None:
    tok = ProxyTokenizer("fake", encode)
    client = engine(status=404)
    with caplog.at_level(logging.WARNING, logger="lw.proxy"):
        for i in range(MAX_CHECK_ERRORS):
            assert tok.status == "verifying"
            checked(tok, client, {"model": "m", "prompt": f"p{i}"})
    assert tok.status == "off" and tok.agreed == 0
    assert "got no answer" in caplog.records[-1].getMessage()
    assert "HTTP 404" in caplog.records[-1].getMessage()


def test_a_tokenizer_that_raises_sends_the_prompt_as_text() -> None:
    tok = trusted()
    tok.encode = lambda text, special: 1 / 0  # type: ignore[assignment,return-value]
    assert tok.apply(True, {"model": "m", "prompt": "hi"}) is None


# ---------------------------------------------------------------------------------------------
# Loading, and the proxy's option


def _tokenizer_dir(tmp: Path) -> Path:
    from lw.lab.tiny_model import _tokenizer_config, _tokenizer_json, _vocab

    (tmp / "tokenizer.json").write_text(_tokenizer_json(_vocab(512)))
    (tmp / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config()))
    return tmp


def test_load_encoder_reads_a_model_directory_as_vllm_does(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    enc = load_encoder(str(_tokenizer_dir(tmp_path)))
    with_bos, without = enc("the cat", True), enc("the cat", False)
    assert without and with_bos[-len(without):] == without


def test_load_encoder_names_a_path_it_cannot_load(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=r"--tokenizer .*nowhere.* cannot be loaded"):
        load_encoder(str(tmp_path / "nowhere"))


def test_the_proxy_refuses_to_start_with_a_tokenizer_it_cannot_load(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    with pytest.raises(SystemExit) as exc:
        main(["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2",
              "--insecure-trusted-network", "--tokenizer", str(tmp_path / "nowhere")])
    assert exc.value.code == 2
    assert "cannot be loaded" in capsys.readouterr().err


def test_through_the_proxy_d_gets_token_ids_once_the_check_passed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The real proxy app: the first prompts reach D as text while D's /tokenize is asked,
    later ones as token ids; the client's answer is D's."""
    got: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": encode(body["prompt"], True)})
        assert request.url.path == "/v1/completions"
        got.append(body["prompt"])  # D answers it alone: no metaserver call
        return httpx.Response(200, json={"id": "c", "object": "text_completion", "choices": [
            {"index": 0, "text": "ok", "finish_reason": "length"}]})

    apps = build_apps(["http://p.test"], ["http://d.test"], metaserver_url="http://x/m",
                      cluster_key=b"k" * 32, tokenizer=ProxyTokenizer("fake", encode))
    monkeypatch.setattr(apps.state, "client",
                        httpx.AsyncClient(transport=httpx.MockTransport(handler)))

    async def run() -> list[int]:
        codes = []
        transport = httpx.ASGITransport(app=apps.public)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
            for i in range(VERIFY_PROMPTS + 2):
                r = await c.post("/v1/completions", json={"model": "m", "prompt": f"p{i}",
                                                           "max_tokens": 1})
                codes.append(r.status_code)
                assert r.json()["choices"][0]["text"] == "ok"
                await asyncio.gather(*apps.state.tasks)  # the check beside it
        await apps.state.aclose()
        return codes

    assert asyncio.run(run()) == [200] * (VERIFY_PROMPTS + 2)
    assert got[:VERIFY_PROMPTS] == [f"p{i}" for i in range(VERIFY_PROMPTS)]
    assert got[VERIFY_PROMPTS:] == [encode(f"p{i}", True)
                                    for i in range(VERIFY_PROMPTS, VERIFY_PROMPTS + 2)]
    metrics = apps.state.metrics()
    assert metrics["tokenizer_status"] == "on" and metrics["prompts_tokenized"] == 2

