"""trainer.compute_dtype=bfloat16: the step computes on bf16 copies of the float32 masters,
each cast once a step (pipelinerl.rl.compute), against the float32 step as reference."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from launch_counts import Kernels
from tiny_models import random_groups, smollm2_layout
from torch.utils._python_dispatch import TorchDispatchMode

from pipelinerl.config import ConfigError, load_config
from pipelinerl.rl.attention import set_packed_attention
from pipelinerl.rl.compute import compute_weights, computing
from pipelinerl.rl.step import rl_step
from pipelinerl.roles.trainer import make_optimizer

torch.set_num_threads(1)


class WeightCasts(TorchDispatchMode):
    """Casts and copies whose source is one of `params`' storage (a weight cast per use under
    autocast; the in-place refresh of a compute copy)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__()
        self.pointers = {p.data_ptr() for p in params}
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name.split("::")[-1]
        source = args[0] if name == "_to_copy" else args[1] if name == "copy_" else None
        if isinstance(source, torch.Tensor) and source.data_ptr() in self.pointers:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _setup(*overrides: str) -> tuple[Any, torch.nn.Module, torch.optim.Optimizer]:
    cfg = load_config(overrides=["model.path=unused", "trainer.batch_size=16",
                                 "actor.group_size=8", "trainer.max_tokens_per_row=256",
                                 *overrides])
    model = smollm2_layout(2).train()
    set_packed_attention(model, cfg.trainer)
    return cfg, model, make_optimizer(model, cfg.trainer)


def _scored_logprobs(metrics: dict[str, Any]) -> torch.Tensor:
    return torch.tensor([lp for s in metrics["scored"] for lp in s.logprobs])


def test_bf16_compute_weights_track_the_float32_step_within_bf16_rounding() -> None:
    """Same weights, same groups: the log-probs of the bf16 step differ from the float32 step's
    by bf16 rounding (mean 3e-3 nats a token here, the same order as autocast's), the loss and
    gradient norm agree to ~0.5%, and two steps move the weights alike."""
    runs = {}
    for name, extra in (("fp32", []), ("autocast", ["trainer.precision=bfloat16"]),
                        ("bf16", ["trainer.compute_dtype=bfloat16"])):
        cfg, model, optimizer = _setup(*extra)
        rng = random.Random(0)
        steps = [rl_step(model, optimizer, random_groups(2, rng), cfg, 0, keep_groups=2)
                 for _ in range(2)]
        runs[name] = (steps, model)
    (ref, ref_model), (bf16, bf16_model) = runs["fp32"], runs["bf16"]
    gap = (_scored_logprobs(bf16[0]) - _scored_logprobs(ref[0])).abs()
    autocast_gap = (_scored_logprobs(runs["autocast"][0][0]) - _scored_logprobs(ref[0])).abs()
    assert 0 < gap.mean() < 0.01 and gap.max() < 0.05, (gap.mean(), gap.max())
    assert gap.mean() < 3 * autocast_gap.mean()
    for a, b in zip(ref, bf16):
        assert b["loss"] == pytest.approx(a["loss"], rel=0.02, abs=1e-3)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=0.02)
    # The model holds its float32 masters between steps; they moved as the float32 step's did:
    # AdamW moves each weight by about lr a step whatever its gradient's size, so a tiny
    # gradient whose sign bf16 flipped moves it the other way: at most 2 lr a step apart.
    lr = load_config(overrides=["model.path=unused"]).trainer.lr
    moved = 0.0
    for (name, p), q in zip(bf16_model.named_parameters(), ref_model.parameters()):
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
        assert (p - q).abs().max() <= 2 * 2 * lr * 1.05, name
        moved += (p - q).abs().mean().item()
    assert moved / len(list(ref_model.parameters())) < 0.5 * lr


def test_a_step_casts_each_weight_once_and_far_fewer_tensors_than_autocast() -> None:
    """The bf16 step casts each parameter once (the in-place refresh of its copy: the same
    tensors every step), and a refresh gives each master rounded to bf16, after a write into
    the masters outside the step too (a checkpoint load). Autocast caches its weight casts
    within the step as well (at most one per weight), but casts activations and their
    gradients around every norm, rotary embedding and attention: 2x the bf16 step's casts."""
    casts, weight_casts = {}, {}
    for name, extra in (("bf16", ["trainer.compute_dtype=bfloat16"]),
                        ("autocast", ["trainer.precision=bfloat16"])):
        cfg, model, optimizer = _setup(*extra)
        params = list(model.parameters())
        rng = random.Random(0)
        rl_step(model, optimizer, random_groups(2, rng), cfg, 0)  # the bf16 copies are made
        with WeightCasts(params) as weights_cast, Kernels() as kernels:
            rl_step(model, optimizer, random_groups(2, rng), cfg, 0)
        casts[name] = kernels.counts["_to_copy"] + kernels.counts["copy_"]
        weight_casts[name] = weights_cast.count
        if name == "bf16":
            bf16_model, copies = model, [c for _, c in compute_weights(model, torch.bfloat16).pairs]
    assert weight_casts["bf16"] == len(params) and 0 < weight_casts["autocast"] <= len(params)
    assert casts["bf16"] < casts["autocast"] / 2, casts
    weights = compute_weights(bf16_model, torch.bfloat16)
    assert all(a is b for a, (_, b) in zip(copies, weights.pairs))  # refreshed in place
    with torch.no_grad():
        next(bf16_model.parameters()).mul_(0.5)  # e.g. load_state_dict's copy_
    weights.refresh()
    for master, copy in weights.pairs:
        assert copy.dtype == torch.bfloat16 and torch.equal(copy, master.to(torch.bfloat16))


def test_gradients_add_up_over_micro_batches_in_float32() -> None:
    """Rows of 64 tokens: several micro-batches, each copy's bf16 gradient added into its
    master's float32 gradient and dropped; the sum matches the float32 step's gradient."""
    grads = {}
    for name, extra in (("fp32", []), ("bf16", ["trainer.compute_dtype=bfloat16"])):
        cfg, model, _ = _setup("trainer.max_tokens_per_row=64", *extra)
        rl_step(model, torch.optim.SGD(model.parameters(), lr=0.0), random_groups(2, random.Random(1)),
                cfg, 0)
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
    weights = compute_weights(model, torch.bfloat16)
    assert all(copy.grad is None for _, copy in weights.pairs)
    cosine = torch.nn.functional.cosine_similarity(grads["fp32"], grads["bf16"], dim=0)
    assert cosine > 0.999, cosine


def test_compute_dtype_is_refused_where_it_cannot_run() -> None:
    for overrides, match in ((["trainer.precision=bfloat16"], "trainer.precision must be float32"),
                             (["trainer.num_procs=2"], "one trainer process")):
        with pytest.raises((ConfigError, ValueError), match=match):
            load_config(overrides=["model.path=unused", "trainer.compute_dtype=bfloat16",
                                   *overrides])
    wrapped = torch.nn.parallel.DistributedDataParallel.__new__(
        torch.nn.parallel.DistributedDataParallel)
    with pytest.raises(ValueError, match="DDP's gradient hooks"):
        computing(wrapped, "bfloat16")
