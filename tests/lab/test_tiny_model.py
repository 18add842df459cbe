"""Tests of the tiny random Llama generator (files, offline loading, tokenizer, idempotence)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

from lw.lab.tiny_model import main, make_tiny_model  # noqa: E402

FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "generation_config.json"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_files_exist_and_config_is_a_small_llama(model_dir: Path) -> None:
    for name in FILES:
        assert (model_dir / name).is_file(), name
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == cfg["head_dim"] == 64
    assert cfg["num_hidden_layers"] == 2 and cfg["vocab_size"] == 512
    assert sum(f.stat().st_size for f in model_dir.iterdir()) < 10 * 2**20


def test_weights_match_config_and_are_deterministic(model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    w = load_file(model_dir / "model.safetensors")
    assert w["model.embed_tokens.weight"].shape == (512, 256)
    assert w["model.layers.1.self_attn.k_proj.weight"].shape == (256, 256)
    assert "model.layers.2.self_attn.q_proj.weight" not in w
    again = make_tiny_model(tmp_path / "again")
    assert (again / "model.safetensors").read_bytes() == (
        model_dir / "model.safetensors").read_bytes()
    other = make_tiny_model(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (
        model_dir / "model.safetensors").read_bytes()


def test_loads_offline_with_transformers(model_dir: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    assert cfg.model_type == "llama" and cfg.head_dim == 64
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    text = "hello world , the sun is hot ."
    ids = tok.encode(text)
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    assert tok.eos_token == "</s>" and tok.eos_token_id == 2
    chat = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "user : hello assistant :"
    assert tok.unk_token_id in tok.encode("zebra")


def test_idempotent_and_regenerates_on_change(tmp_path: Path) -> None:
    dest = make_tiny_model(tmp_path / "m")
    stamp = {n: os.stat(dest / n).st_mtime_ns for n in FILES}
    assert make_tiny_model(dest) == dest
    assert {n: os.stat(dest / n).st_mtime_ns for n in FILES} == stamp
    make_tiny_model(dest, num_layers=3)
    assert json.loads((dest / "config.json").read_text())["num_hidden_layers"] == 3
    (dest / "tokenizer.json").unlink()
    make_tiny_model(dest, num_layers=3)
    assert (dest / "tokenizer.json").is_file()


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "cli")]) == 0
    assert capsys.readouterr().out.strip() == str((tmp_path / "cli").resolve())
    assert (tmp_path / "cli" / "config.json").is_file()
