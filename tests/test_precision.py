"""trainer.precision: the arithmetic of the training step's forward and backward."""

from __future__ import annotations

import math
import random

import pytest
import torch
from tiny_models import random_groups, smollm2_layout

from pipelinerl.config import ConfigError, load_config
from pipelinerl.rl.attention import set_packed_attention
from pipelinerl.rl.step import rl_step
from pipelinerl.roles.trainer import make_optimizer

torch.set_num_threads(1)


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
    metrics = rl_step(model, optimizer, random_groups(1, random.Random(0)), cfg, 0)
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
