"""Chat templates and stop tokens, with a tokenizer built here the way an instruct model's is
(special tokens, a chat template, a generation config naming two EOS ids; no hub)."""

from __future__ import annotations

import json
import string
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pipelinerl.config import load_config
from pipelinerl.models.hf import load_tokenizer
from pipelinerl.models.prompts import PromptEncoder, prompt_format, stop_token_ids

# Qwen2.5 Instruct's layout of a conversation.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def instruct_tokenizer(out: Path, template: bool = True, arch: str = "qwen2") -> Path:
    """A tiny `arch` model directory whose char-level tokenizer has Qwen's special tokens (and
    chat template), with a generation config whose EOS ids are <|im_end|> and <|endoftext|>."""
    from tiny_models import tiny_hf_model

    from pipelinerl.models.hf import save_model

    chars = sorted(set(string.printable) - set("\r\x0b\x0c"))
    vocab = {t: i for i, t in enumerate([*SPECIAL, *chars])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>")
    if template:
        tokenizer.chat_template = TEMPLATE
    model = tiny_hf_model(arch, vocab_size=len(vocab), max_position_embeddings=1024,
                          eos_token_id=0, bos_token_id=None, pad_token_id=0)
    save_model(model, tokenizer, out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return out


@pytest.fixture(scope="module")
def instruct_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return instruct_tokenizer(tmp_path_factory.mktemp("instruct"))


def test_prompts_go_through_the_chat_template_when_the_tokenizer_has_one(instruct_model: Path) -> None:
    tokenizer = load_tokenizer(instruct_model)
    encode = PromptEncoder(tokenizer, system_prompt="be brief")
    ids = encode("2+3=")
    assert tokenizer.decode(ids) == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n"
                                     "2+3=<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # one id each
    raw = PromptEncoder(tokenizer, chat_template=False)
    assert tokenizer.decode(raw("2+3=")) == "2+3="


def test_every_eos_id_stops_a_completion(instruct_model: Path) -> None:
    tokenizer = load_tokenizer(instruct_model)
    assert stop_token_ids(tokenizer, instruct_model) == (0, 2)  # tokenizer's first
    cfg = load_config(None, [f"model.path={instruct_model}"])
    encode, stops, _ = prompt_format(cfg, instruct_model)
    assert encode.use_template and stops == (0, 2)


def test_a_template_asked_for_but_missing_is_refused(tmp_path: Path) -> None:
    plain = load_tokenizer(instruct_tokenizer(tmp_path / "base", template=False))
    assert not PromptEncoder(plain).use_template  # auto: a base model reads the text as is
    with pytest.raises(ValueError, match="chat_template=true, but the tokenizer has no chat"):
        PromptEncoder(plain, chat_template=True)
    with pytest.raises(ValueError, match="system_prompt is given, but no chat template"):
        PromptEncoder(plain, system_prompt="hi")


def test_launch_refuses_a_missing_template_before_anything_starts(tmp_path: Path) -> None:
    model = instruct_tokenizer(tmp_path / "base", template=False)
    proc = subprocess.run(
        [sys.executable, "-m", "pipelinerl.cli", "train",
         str(Path(__file__).resolve().parent.parent / "examples" / "arithmetic.yaml"),
         f"model.path={model}", f"output_dir={tmp_path / 'runs'}", "task.chat_template=true"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "task.chat_template=true, but the tokenizer has no chat template" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()
