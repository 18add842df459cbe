"""The proxy tokenizes a completions prompt once, for both engines (``lw proxy --tokenizer``):
D and P are handed token ids, so neither API server tokenizes it on the request's path.

Trusted only after it agreed with a decode server's own ``POST /tokenize`` on the first
``VERIFY_PROMPTS`` prompts it sees (those go to the engines as text meanwhile); one that
disagrees is switched off for good, with an error naming the first differing token. A prompt
whose tokens depend on more than the text (``echo``, ``suffix``, truncation, offsets,
embeddings), a chat request, another model's, or a longer one than ``TEXT_LIMIT`` goes as text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

import httpx

__all__ = ["TEXT_LIMIT", "VERIFY_PROMPTS", "ProxyTokenizer", "eligible_prompts", "load_encoder"]

log = logging.getLogger("lw.proxy")

TEXT_LIMIT = 64 * 1024
"""Characters of prompt text tokenized on the proxy's event loop per request (about a
millisecond for a fast tokenizer); a longer prompt goes to the engines as text."""
VERIFY_PROMPTS = 2
"""Client prompts the tokenizer must agree on with a decode server's ``/tokenize`` before it is
used (the first check adds ``PROBE``)."""
PROBE = ("lw's tokenizer check: Hello, world!  naïve café — 東京 🙂\n\ttabs,   spaces, "
         "<s> </s> <unk> 3.14e-6 ===>  end")
"""Text whose tokens differ where tokenizers differ: accents, CJK, an emoji, runs of white
space, special tokens' spellings, numbers."""
MAX_CHECK_ERRORS = 5
"""Checks that got no answer (a decode server down, an old vLLM) before it is given up."""

Encoder = Callable[[str, bool], list[int]]
"""(text, add_special_tokens) -> token ids, as the engines' tokenizer makes them."""

# Fields with which the engine's tokens are not the text's alone (or the text is needed again).
_TEXT_FIELDS = ("echo", "suffix", "prompt_embeds", "truncate_prompt_tokens", "truncation_side",
                "return_token_offsets")


def load_encoder(source: str) -> Encoder:
    """The encoder of ``source`` (a model directory or a Hugging Face name), loaded as vLLM's
    API server loads it (``transformers.AutoTokenizer``); ValueError saying why it cannot."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # lw's proxy runs without vLLM; this option needs transformers
        raise ValueError(f"--tokenizer needs the 'transformers' package: {exc}") from exc
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except Exception as exc:  # any loader failure: the option is wrong, say so at start
        raise ValueError(f"--tokenizer {source!r} cannot be loaded: "
                         f"{type(exc).__name__}: {str(exc)[:300]}") from exc

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        return list(tok.encode(text, add_special_tokens=add_special_tokens))

    return encode


def eligible_prompts(body: dict[str, Any]) -> tuple[list[str], bool] | None:
    """A completions body's prompt texts and ``add_special_tokens``, where its tokens are the
    texts' alone and short enough to tokenize here; None where it goes to the engines as is."""
    prompt = body.get("prompt")
    texts = [prompt] if isinstance(prompt, str) else prompt
    if (not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts)
            or sum(len(t) for t in texts) > TEXT_LIMIT):
        return None
    if any(body.get(k) not in (None, False) for k in _TEXT_FIELDS):
        return None
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        return None  # vLLM answers it 400; let it
    return texts, special


class ProxyTokenizer:
    """One model's tokenizer in the proxy: checked against a decode server, then used."""

    def __init__(self, source: str, encode: Encoder) -> None:
        self.source = source
        self.encode = encode
        self.status: Literal["verifying", "on", "off"] = "verifying"
        self.model: str | None = None  # the served model it was checked for
        self.agreed = 0
        self.check_errors = 0
        self.checking = False  # one check at a time
        self.tokenized = 0  # client prompts sent as token ids

    def metrics(self) -> dict[str, Any]:
        """Its state, for the proxy's ``/metrics-json``."""
        return {"tokenizer": self.source, "tokenizer_status": self.status,
                "tokenizer_model": self.model, "prompts_tokenized": self.tokenized}

    def apply(self, api_is_completions: bool, body: dict[str, Any]) -> dict[str, Any] | None:
        """``body`` with its prompt as token ids, once the tokenizer is trusted for its model;
        None where it goes as text (and then, while checking, :meth:`wants_check` may say so)."""
        if self.status != "on" or not api_is_completions or body.get("model") != self.model:
            return None
        got = eligible_prompts(body)
        if got is None:
            return None
        texts, special = got
        try:
            ids = [self.encode(t, special) for t in texts]
        except Exception as exc:  # the engine tokenizes it then, and answers for it
            log.warning("--tokenizer %s failed on a prompt (%s: %s); it goes as text",
                        self.source, type(exc).__name__, str(exc)[:200])
            return None
        out = dict(body)
        out["prompt"] = ids[0] if isinstance(body["prompt"], str) else ids
        self.tokenized += 1
        return out

    def wants_check(self, api_is_completions: bool, body: dict[str, Any]) -> str | None:
        """The prompt text to check against a decode server now (the caller must then run
        :meth:`check`), or None."""
        if self.status != "verifying" or self.checking or not api_is_completions:
            return None
        if self.model is not None and body.get("model") != self.model:
            return None
        got = eligible_prompts(body)
        if got is None or not got[1]:
            return None
        self.checking = True  # until check() ends: the caller runs it next
        return got[0][0]

    async def check(self, client: httpx.AsyncClient, decode_url: str, model: str,
                    text: str, timeout: httpx.Timeout) -> None:
        """Compare this tokenizer's ids for ``text`` with the decode server's ``/tokenize``."""
        try:
            for t in ((PROBE, text) if self.agreed == 0 else (text,)):
                ours = self.encode(t, True)
                theirs, why = await _engine_tokens(client, decode_url, model, t, timeout)
                if theirs is None:
                    self._no_answer(decode_url, why)
                    return
                if theirs != ours:
                    self._disagrees(decode_url, model, t, ours, theirs)
                    return
            self.model = model
            self.agreed += 1
            if self.agreed >= VERIFY_PROMPTS:
                self.status = "on"
                log.info("--tokenizer %s agreed with %s/tokenize on %d prompts of model %s: "
                         "completions prompts go to the engines as token ids", self.source,
                         decode_url, self.agreed, model)
        finally:
            self.checking = False

    def _no_answer(self, url: str, why: str) -> None:
        self.check_errors += 1
        if self.check_errors >= MAX_CHECK_ERRORS and self.status == "verifying":
            self.status = "off"
            log.warning("--tokenizer %s: %d checks against %s/tokenize got no answer (last: %s);"
                        " prompts go to the engines as text", self.source, self.check_errors,
                        url, why)

    def _disagrees(self, url: str, model: str, text: str, ours: list[int],
                   theirs: list[Any]) -> None:
        self.status = "off"
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
                  min(len(ours), len(theirs)))
        mine = ours[at] if at < len(ours) else "(end)"
        engine = theirs[at] if at < len(theirs) else "(end)"
        log.error("--tokenizer %s disagrees with %s/tokenize (model %s) on a prompt of %d "
                  "characters: first difference at token %d (proxy %s, engine %s; %d tokens "
                  "against %d). It is not used: prompts go to the engines as text", self.source,
                  url, model, len(text), at, mine, engine, len(ours), len(theirs))


async def _engine_tokens(client: httpx.AsyncClient, url: str, model: str, text: str,
                         timeout: httpx.Timeout) -> tuple[list[Any] | None, str]:
    """The decode server's token ids for ``text`` (None, and why, where it gave none)."""
    try:
        r = await client.post(url + "/tokenize", timeout=timeout,
                              json={"model": model, "prompt": text, "add_special_tokens": True})
        tokens = r.json().get("tokens") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if not isinstance(tokens, list):
        return None, f"HTTP {r.status_code}: {r.text[:200]!r}"
    return tokens, ""
