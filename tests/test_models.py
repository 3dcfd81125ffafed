"""Tiny local models and the HF loaders: offline loading, round trips, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from pipelinerl.models.hf import ModelPathError, load_model, load_tokenizer, save_model
from pipelinerl.models.tiny import (
    PRESETS,
    build_char_tokenizer,
    build_tiny_model,
    init_tiny_model,
)
from pipelinerl.tasks.arithmetic import ALPHABET

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    tokenizer = build_char_tokenizer(ALPHABET, out)
    return build_tiny_model(out, tokenizer, preset="tiny", seed=0)


def test_char_tokenizer_round_trip(tmp_path: Path) -> None:
    build_char_tokenizer(ALPHABET, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    text = "12+7-5+3=12+7=19,19-5=14,14+3=17;A=17"
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one token per character, no special tokens added
    assert tok.encode(text, add_special_tokens=True) == tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == 4 + len(ALPHABET)
    assert tok.encode("1x") == [tok.convert_tokens_to_ids("1"), tok.unk_token_id]
    # Prompt and completion encode independently: the engine concatenates them.
    assert tok.encode("12+7=") + tok.encode("19") == tok.encode("12+7=19")


def test_char_tokenizer_rejects_bad_alphabet(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="alphabet"):
        build_char_tokenizer("", tmp_path)


def test_tiny_model_loads_offline(tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), local_files_only=True)
    n_params = sum(p.numel() for p in model.parameters())
    assert 0.6e6 < n_params < 1.5e6
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.tie_word_embeddings
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (128, 4, 4)
    assert cfg.num_key_value_heads == 2 and cfg.intermediate_size == 384
    assert cfg.max_position_embeddings == 256
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(str(tiny_dir), local_files_only=True)
    assert cfg.vocab_size == len(tok) and cfg.eos_token_id == tok.eos_token_id


def test_small_preset_size(tmp_path: Path) -> None:
    tok = build_char_tokenizer(ALPHABET, tmp_path)
    n_params = sum(p.numel() for p in init_tiny_model(tok, "small").parameters())
    assert 8e6 < n_params < 12e6
    with pytest.raises(ValueError, match="huge.*small.*tiny"):
        init_tiny_model(tok, "huge")
    assert set(PRESETS) == {"tiny", "small"}


def test_init_is_seeded_and_leaves_global_rng(tmp_path: Path) -> None:
    tok = build_char_tokenizer(ALPHABET, tmp_path)
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    a = init_tiny_model(tok, seed=5)
    assert torch.equal(torch.rand(1), expected)  # the caller's RNG stream is untouched
    b = init_tiny_model(tok, seed=5)
    c = init_tiny_model(tok, seed=6)
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_load_and_save_round_trip(tiny_dir: Path, tmp_path: Path) -> None:
    model = load_model(tiny_dir)
    tok = load_tokenizer(tiny_dir)
    assert not model.training and next(model.parameters()).dtype == torch.float32
    ids = torch.tensor([tok.encode("12+7=")])
    logits = model(input_ids=ids).logits
    out = save_model(model, tok, tmp_path / "copy")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    again = load_model(out, dtype=torch.bfloat16)
    assert next(again.parameters()).dtype == torch.bfloat16
    torch.testing.assert_close(load_model(out)(input_ids=ids).logits, logits)


def test_load_llama(tmp_path: Path) -> None:
    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(tmp_path))
    assert type(load_model(tmp_path)).__name__ == "LlamaForCausalLM"


def test_tokenizer_without_pad_gets_eos(tmp_path: Path) -> None:
    tok = build_char_tokenizer(ALPHABET, tmp_path)
    tok.pad_token = None
    tok.save_pretrained(str(tmp_path))
    assert load_tokenizer(tmp_path).pad_token == "<eos>"


def test_bad_model_paths(tmp_path: Path, tiny_dir: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ModelPathError, match=f"{missing}.*does not exist"):
        load_model(missing)
    with pytest.raises(ModelPathError, match="does not exist"):
        load_tokenizer(missing)

    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(ModelPathError, match="not a directory"):
        load_model(a_file)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelPathError, match=f"{empty}.*no config.json"):
        load_model(empty)
    with pytest.raises(ModelPathError, match=f"tokenizer from.*{empty}"):
        load_tokenizer(empty)

    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ModelPathError, match="unsupported model_type 'bert'.*qwen2"):
        load_model(bert)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelPathError, match="not a valid JSON"):
        load_model(broken)

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(ModelPathError, match=f"weights from.*{no_weights}"):
        load_model(no_weights)
