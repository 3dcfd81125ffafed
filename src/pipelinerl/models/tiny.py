"""Tiny local models for CPU runs: a char-level tokenizer and a randomly initialised Qwen2.

Everything is built locally (no hub access) and saved in Hugging Face format, so the rest of
the system loads it exactly like a real checkpoint.

BOS handling: `<bos>` is registered as the tokenizer's bos_token but encode never inserts it
(there is no post-processor), so ``tokenizer.encode(text)`` is exactly one id per character
whatever `add_special_tokens` says. `models.hf.encode_prompt` (how every role encodes prompts)
puts BOS first only where a tokenizer's post-processor does, so models built here are trained
and sampled without BOS; a prompt plus a completion encodes to the concatenation of their
encodings.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from pipelinerl.models.hf import save_model

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


PRESETS: dict[str, Preset] = {
    # ~0.8M parameters: ~2 RL steps/s on one CPU thread (see DESIGN.md).
    "tiny": Preset(128, 4, 4, 2, 384),
    # ~10M parameters: the "medium" CPU setting.
    "small": Preset(384, 6, 6, 2, 1152),
}
MAX_POSITIONS = 1024


def build_char_tokenizer(alphabet: str, out_dir: str | Path) -> PreTrainedTokenizerFast:
    """One token per character of `alphabet` (ids 4..), after `<pad>`=0, `<bos>`=1, `<eos>`=2,
    `<unk>`=3 (characters outside the alphabet). Saved to `out_dir` for offline
    `AutoTokenizer.from_pretrained`."""
    chars = list(dict.fromkeys(alphabet))
    clash = [c for c in chars if c in SPECIAL_TOKENS]
    if not chars or clash:
        raise ValueError(f"alphabet must be non-empty characters, got {alphabet!r}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: len(SPECIAL_TOKENS) + i for i, c in enumerate(chars)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Split every character (newlines included) into its own pre-token.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # join characters back without separators
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=MAX_POSITIONS,
        padding_side="right",
    )
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def tiny_config(tokenizer: PreTrainedTokenizerFast, preset: str = "tiny") -> Qwen2Config:
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; known: {sorted(PRESETS)}")
    p = PRESETS[preset]
    return Qwen2Config(
        vocab_size=len(tokenizer),
        **asdict(p),  # a preset's fields are Qwen2Config's own
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def init_tiny_model(
    tokenizer: PreTrainedTokenizerFast, preset: str = "tiny", seed: int = 0
) -> Qwen2ForCausalLM:
    """A randomly initialised fp32 model, in memory; the same seed gives the same weights."""
    config = tiny_config(tokenizer, preset)
    # A private generator state so building a model does not disturb the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model.float().eval()


def build_tiny_model(
    out_dir: str | Path, tokenizer: PreTrainedTokenizerFast, preset: str = "tiny", seed: int = 0
) -> Path:
    """Write a randomly initialised Qwen2 causal LM (config, safetensors, tokenizer) to
    `out_dir`, loadable offline by `AutoModelForCausalLM.from_pretrained`."""
    return save_model(init_tiny_model(tokenizer, preset, seed), tokenizer, out_dir)
