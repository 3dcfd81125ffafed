"""Tiny random Hugging Face models shared by the decoder and engine tests."""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from pipelinerl.types import Group, Sample

VOCAB = 50
ARCHS = ("qwen2", "llama", "qwen3", "mistral")


def tiny_hf_model(arch: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A tiny random HF model with weights large enough that its distributions are peaked.
    qwen2: tied embeddings, q/k/v bias, GQA; llama: untied, GQA, non-default rope_theta;
    qwen3: tied, per-head q/k RMSNorm, head_dim != hidden/heads; mistral: untied,
    head_dim != hidden/heads, a sliding window longer than any test sequence.
    `overrides` go to the config."""
    common: dict[str, Any] = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=256,
    )
    if arch == "qwen2":
        model: torch.nn.Module = Qwen2ForCausalLM(Qwen2Config(**{"tie_word_embeddings": True, **common, **overrides}))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**{"tie_word_embeddings": False, "rope_theta": 50000.0, **common, **overrides}))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**{"tie_word_embeddings": True, "head_dim": 24, **common, **overrides}))
    elif arch == "mistral":
        model = MistralForCausalLM(
            MistralConfig(**{"tie_word_embeddings": False, "head_dim": 24, "sliding_window": 128, **common, **overrides})
        )
    else:
        raise ValueError(f"unknown arch {arch!r}; known: {ARCHS}")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


def reference_truncation(x: torch.Tensor, targets: torch.Tensor,
                         truncation: tuple[int, float] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-autograd reference of the trainer's truncation: `x` with the tokens outside the
    kept set (the sampled token always kept) at -inf, and the mask of those dropped tokens
    (asserted non-empty when truncating, so a test cannot pass with nothing cut)."""
    from pipelinerl.engine.sampling import truncation_threshold

    dropped = torch.zeros_like(x, dtype=torch.bool)
    if truncation:
        keep = x >= truncation_threshold(x.detach(), *truncation)
        dropped = ~keep.scatter(-1, targets[:, None], True)
        x = x.masked_fill(dropped, float("-inf"))
        assert dropped.any()
    return x, dropped


def smollm2_layout(num_hidden_layers: int = 2, seed: int = 0) -> torch.nn.Module:
    """A tiny random model of SmolLM2-135M's layout: Llama, tied embeddings, grouped-query
    attention with 3 query heads per key/value head (9:3 there), SiLU MLP, RMSNorm."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=96, num_hidden_layers=num_hidden_layers, num_attention_heads=3,
        num_key_value_heads=1, intermediate_size=128, vocab_size=512, tie_word_embeddings=True,
        max_position_embeddings=512))


def random_groups(n_groups: int, rng: random.Random) -> list[Group]:
    """Groups of 8 samples of random tokens (vocabulary 512): prompts of 20, completions of
    5-40, half rewarded: a training step's input for tiny_models' layouts."""
    groups = []
    for g in range(n_groups):
        samples = []
        for i in range(8):
            n = rng.randint(5, 40)
            samples.append(Sample(prompt_ids=[rng.randrange(512) for _ in range(20)],
                                  token_ids=[rng.randrange(512) for _ in range(n)],
                                  logprobs=[-1.0] * n, versions=[0] * n, reward=float(i % 2),
                                  success=bool(i % 2), finish_reason="stop", group_id=f"g{g}",
                                  actor_id=0))
        groups.append(Group(f"g{g}", "p", samples, actor_id=0))
    return groups


def tiny_smollm2(out: Path) -> Path:
    """SmolLM2-135M-Instruct's tokenizer, chat template and stop tokens over a random Llama of
    its vocabulary, 2 layers of width 64 (3.2M parameters, nearly all the embedding): for
    end-to-end runs that check an example's wiring (its environment, template, roles and
    records) rather than what the real model does, which tests/test_real_model.py checks."""
    from pipelinerl.models.sources import prepare

    real = prepare("smollm2")
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        if (real / name).exists():
            shutil.copy(real / name, out / name)
    config = LlamaConfig.from_pretrained(real)
    config.update({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32})
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out
