"""trainer.precision: the arithmetic of the training step's forward and backward."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pipelinerl.config import ConfigError, load_config
from pipelinerl.rl.attention import set_packed_attention
from pipelinerl.rl.step import rl_step
from pipelinerl.trainer import make_optimizer
from pipelinerl.types import Group, Sample
from tiny_models import smollm2_layout

torch.set_num_threads(1)


def _groups(rng: random.Random) -> list[Group]:
    samples = []
    for i in range(8):
        n = rng.randint(5, 30)
        samples.append(Sample(prompt_ids=[rng.randrange(512) for _ in range(12)],
                              token_ids=[rng.randrange(512) for _ in range(n)],
                              logprobs=[-6.0] * n, versions=[0] * n, reward=float(i % 2),
                              success=bool(i % 2), finish_reason="stop", group_id="g", actor_id=0))
    return [Group("g", "p", samples, actor_id=0)]


@pytest.mark.parametrize("precision,computed", [("float32", torch.float32),
                                                ("bfloat16", torch.bfloat16)])
def test_the_step_computes_in_the_chosen_precision_over_float32_weights(
        precision: str, computed: torch.dtype) -> None:
    cfg = load_config(overrides=["model.path=unused", "trainer.batch_size=8", "actor.group_size=8",
                                 f"trainer.precision={precision}"])
    model = smollm2_layout(2).train()
    set_packed_attention(model, cfg.trainer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen: set[torch.dtype] = set()
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
    optimizer = make_optimizer(model, cfg.trainer)
    metrics = rl_step(model, optimizer, _groups(random.Random(0)), cfg, 0)
    assert seen == {computed}
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    # Weights, their gradients and AdamW's moments stay float32; the step moved the weights.
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in model.parameters())
    assert all(v.dtype == torch.float32 for s in optimizer.state.values() for v in s.values()
               if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert not torch.is_autocast_enabled("cpu")  # the step's autocast ends with it


def test_tf32_is_refused_off_cuda_naming_the_key() -> None:
    with pytest.raises((ConfigError, ValueError), match="trainer.precision=tf32 needs a CUDA"):
        load_config(overrides=["model.path=unused", "trainer.precision=tf32"])
