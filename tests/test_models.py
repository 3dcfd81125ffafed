"""Tiny local models and the HF loaders: offline loading, round trips, clear errors."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from pipelinerl.config import load_config
from pipelinerl.models.hf import (
    ModelPathError,
    check_engine_model,
    encode_prompt,
    load_model,
    load_tokenizer,
    save_model,
)
from pipelinerl.models.tiny import (
    PRESETS,
    build_char_tokenizer,
    build_tiny_model,
    init_tiny_model,
)
from pipelinerl.models.warmstart import encode_demo
from pipelinerl.rl.packing import pack
from pipelinerl.rl.scores import score_tokens
from pipelinerl.roles.launch import launch
from pipelinerl.tasks.arithmetic import ALPHABET, ChainArithmeticTask
from pipelinerl.types import Sample

torch.set_num_threads(1)

from tiny_models import ARCHS, VOCAB, tiny_hf_model  # noqa: E402


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
    assert cfg.max_position_embeddings == 1024  # long generations (examples/long_chains.yaml) run to ~700
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


def bos_tokenizer(out_dir: Path, template: str = "<s> $A") -> PreTrainedTokenizerBase:
    """A Llama-style tokenizer built locally: its post-processor puts <s> before every text
    (`template`), one word per token; saved and loaded back as the roles load it."""
    words = ["<unk>", "<s>", "</s>", "hello", "world", "<|user|>", *ALPHABET]
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="removed")
    backend.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        additional_special_tokens=["<|user|>"],
    ).save_pretrained(str(out_dir))
    return load_tokenizer(out_dir)


def test_encode_prompt_starts_with_bos_where_the_tokenizer_puts_one(tmp_path: Path) -> None:
    tok = bos_tokenizer(tmp_path / "llama")
    assert encode_prompt(tok, "hello world") == [1, 3, 4]
    # A chat template's output already starts with BOS: not a second one.
    assert encode_prompt(tok, "<s><|user|> hello") == [1, 5, 3]
    # A post-processor that also appends EOS: a prompt continues, so no EOS.
    eos_too = bos_tokenizer(tmp_path / "eos", template="<s> $A </s>")
    assert encode_prompt(eos_too, "hello") == [1, 3]
    # The char tokenizer (and Qwen's) put nothing before a text: one id per character.
    char = build_char_tokenizer(ALPHABET, tmp_path / "char")
    assert encode_prompt(char, "12+7=") == char.encode("12+7=", add_special_tokens=False)
    assert len(encode_prompt(char, "12+7=")) == 5


def test_warm_start_demonstrations_see_the_prompt_as_the_actor_encodes_it(tmp_path: Path) -> None:
    tok = bos_tokenizer(tmp_path)
    task, rng = ChainArithmeticTask(), random.Random(0)
    problem = task.sample_problem(random.Random(0))
    ids, labels = encode_demo(task, tok, rng, step_error_prob=0.0)
    prompt = encode_prompt(tok, problem.prompt)
    assert ids[: len(prompt)] == prompt and ids[0] == tok.bos_token_id
    assert labels[: len(prompt)] == [-100] * len(prompt) and labels[len(prompt)] != -100


@pytest.mark.parametrize(("arch", "overrides"), [("qwen3", {}), ("mistral", {"sliding_window": 16})])
def test_trainer_packs_qwen3_and_mistral_with_block_diagonal_attention(
    arch: str, overrides: dict, tmp_path: Path
) -> None:
    """The trainer's HF model (load_model) on a packed row gives each sequence the log-probs
    it has alone: position ids restart and no sequence attends to another (Mistral: a window
    shorter than the row, longer than each sequence)."""
    tiny_hf_model(arch, seed=3, **overrides).save_pretrained(tmp_path)
    model = load_model(tmp_path)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for p, c in [(5, 7), (3, 9), (8, 4)]:
        ids = torch.randint(0, VOCAB, (p + c,), generator=gen).tolist()
        samples.append(Sample(ids[:p], ids[p:], [0.0] * c, [0] * c, 0.0, False, "length"))
    (batch,) = pack(samples, [0.0] * 3, max_tokens_per_row=64)
    assert batch.num_sequences == 3
    with torch.no_grad():
        packed = score_tokens(model, batch).logprobs
        for i, s in enumerate(samples):
            ids = torch.tensor([s.prompt_ids + s.token_ids])
            alone = model(ids).logits[0, len(s.prompt_ids) - 1 : -1].log_softmax(-1)
            expected = alone.gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(packed[batch.seq_idx == i], expected, atol=1e-5, rtol=0)


def test_engine_model_check_refuses_at_start(tmp_path: Path) -> None:
    for arch in ARCHS:
        tiny_hf_model(arch).config.save_pretrained(tmp_path / arch)
        check_engine_model(tmp_path / arch, "torch", max_seq_len=64)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    for backend in ("torch", "vllm"):
        with pytest.raises(ModelPathError, match="'gpt2'.*supported.*llama.*mistral.*qwen2.*qwen3"):
            check_engine_model(gpt2, backend, max_seq_len=64)
    tiny_hf_model("mistral", sliding_window=32).config.save_pretrained(tmp_path / "window")
    with pytest.raises(ValueError, match="sliding_window=32.*64 positions"):
        check_engine_model(tmp_path / "window", "torch", max_seq_len=64)
    check_engine_model(tmp_path / "window", "vllm", max_seq_len=64)  # vLLM slides itself


def test_launch_refuses_an_unsupported_family_before_any_role_starts(tmp_path: Path) -> None:
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    cfg = load_config(None, [f"output_dir={tmp_path}", f"model.path={model}"])
    with pytest.raises(SystemExit, match="model_type 'gpt2'.*supported.*llama.*mistral.*qwen2.*qwen3"):
        launch(cfg)
    assert not cfg.run_dir.exists()  # refused before the run directory (or any role)


def test_a_saved_char_tokenizer_keeps_spaces_and_newlines_beside_a_qwen2_model(tmp_path: Path) -> None:
    # transformers picks Qwen2Tokenizer from a qwen2 config.json, whose pre-tokenizer dropped
    # every space and newline of a char tokenizer; load_tokenizer loads it as saved.
    tokenizer = build_char_tokenizer("ab \n", tmp_path / "tok")
    model_dir = build_tiny_model(tmp_path / "model", tokenizer)
    loaded = load_tokenizer(model_dir)
    text = "a b\nba"
    assert loaded.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
    assert loaded.decode(loaded.encode(text, add_special_tokens=False)) == text
