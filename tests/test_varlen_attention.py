"""The trainer's varlen flash-attention path (`trainer.packed_attention=per_sequence` on CUDA),
checked on the CPU through a fake `varlen_attn`: the CPU has no flash kernel, so the fake
stands in for it (one causal SDPA per sequence of the flattened batch) and records what the
gate hands it. The real kernel runs in benchmarks/gpu.py checks 4 and 7."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tiny_models import random_groups, smollm2_layout

from pipelinerl.config import load_config
from pipelinerl.rl import attention
from pipelinerl.rl.packing import pack, pad
from pipelinerl.rl.scores import score_tokens
from pipelinerl.rl.step import arithmetic, rl_step
from pipelinerl.roles.trainer import make_optimizer

torch.set_num_threads(1)


class FakeVarlen:
    """varlen_attn's contract on flattened (T, H, D) tensors, computed per sequence by SDPA;
    records each call's dtypes, head counts and keywords."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                 cu_k: torch.Tensor, max_q: int, max_k: int, *, scale: float | None = None,
                 **kwargs: Any) -> torch.Tensor:
        self.calls.append({"dtypes": (q.dtype, k.dtype, v.dtype),
                           "heads": (q.shape[1], k.shape[1], v.shape[1]), "kwargs": kwargs})
        if q.dtype != k.dtype or k.dtype != v.dtype:  # as the flash kernel refuses
            raise RuntimeError(f"varlen_attn: mixed dtypes {q.dtype}, {k.dtype}, {v.dtype}")
        if k.shape[1] != q.shape[1] and not kwargs.get("enable_gqa"):
            raise RuntimeError("varlen_attn: fewer key/value heads without enable_gqa")
        bounds = cu_q.tolist()
        out = [F.scaled_dot_product_attention(
            *(t[s:e].transpose(0, 1) for t in (q, k, v)), scale=scale, is_causal=True,
            enable_gqa=bool(kwargs.get("enable_gqa"))).transpose(0, 1)
            for s, e in zip(bounds, bounds[1:])]
        return torch.cat(out)


@pytest.fixture
def fake_varlen(monkeypatch: pytest.MonkeyPatch) -> FakeVarlen:
    fake = FakeVarlen()
    monkeypatch.setattr(attention, "varlen_attn", fake)
    monkeypatch.setattr(attention, "VARLEN_DEVICES", ("cpu",))
    return fake


@pytest.mark.parametrize("takes_gqa", [True, False], ids=["gqa_keyword", "torch_before_2_12"])
def test_rl_step_under_bfloat16_takes_the_varlen_path_with_one_dtype_fake_kernel_on_cpu(
        fake_varlen: FakeVarlen, monkeypatch: pytest.MonkeyPatch, takes_gqa: bool) -> None:
    """Under `trainer.precision=bfloat16` the weights stay float32: the rotary embedding hands
    q and k in float32, v in bf16. Every layer of every forward must still reach the kernel,
    with q, k and v in bf16, and grouped-query k/v uncopied where torch takes enable_gqa."""
    monkeypatch.setattr(attention, "_TAKES_GQA", takes_gqa)
    layers = 2
    cfg = load_config(overrides=["model.path=unused", "trainer.batch_size=16",
                                 "actor.group_size=8", "trainer.precision=bfloat16"])
    model = smollm2_layout(layers).train()
    attention.set_packed_attention(model, cfg.trainer)
    optimizer = make_optimizer(model, cfg.trainer)
    metrics = rl_step(model, optimizer, random_groups(2, random.Random(0)), cfg, 0)
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    assert fake_varlen.calls and len(fake_varlen.calls) % layers == 0
    heads = model.config.num_attention_heads
    kv_heads = heads if not takes_gqa else model.config.num_key_value_heads
    for call in fake_varlen.calls:
        assert call["dtypes"] == (torch.bfloat16,) * 3
        assert call["heads"] == (heads, kv_heads, kv_heads)
        assert bool(call["kwargs"].get("enable_gqa")) == takes_gqa


def test_varlen_log_probs_under_bfloat16_match_one_sequence_at_a_time_fake_kernel_on_cpu(
        fake_varlen: FakeVarlen) -> None:
    """Packed rows through the varlen path give each sequence's own log-probs (scored unpacked,
    with transformers' sdpa) within bf16 noise."""
    samples = [s for g in random_groups(2, random.Random(1)) for s in g.samples]
    adv = [0.0] * len(samples)
    model = smollm2_layout(2).eval()
    with torch.no_grad(), arithmetic("bfloat16", torch.device("cpu")):
        want = torch.cat([score_tokens(model, b).logprobs for b in pad(samples, adv, 1)])
        attention.use_per_sequence_attention(model)
        batches = pack(samples, adv, 512)
        got = torch.cat([score_tokens(model, b).logprobs for b in batches])
        order = torch.cat([b.seq_idx for b in batches]).argsort(stable=True)
    assert fake_varlen.calls
    gap = (got[order] - want).abs()
    assert float(gap.mean()) < 0.02 and float(gap.max()) < 0.2, (gap.mean(), gap.max())


def test_without_autocast_float32_stays_on_sdpa_per_sequence(fake_varlen: FakeVarlen) -> None:
    """fp32 has no flash kernel: the gate sends it to one SDPA per sequence."""
    model = smollm2_layout(1).eval()
    attention.use_per_sequence_attention(model)
    samples = [s for g in random_groups(1, random.Random(2)) for s in g.samples]
    with torch.no_grad():
        score_tokens(model, pack(samples, [0.0] * len(samples), 512)[0]).logprobs
    assert not fake_varlen.calls
