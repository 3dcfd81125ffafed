"""One optimizer step of the RL algorithm over a batch of groups."""

from __future__ import annotations

from typing import Any

import torch

from pipelinerl.config import Config
from pipelinerl.rl.advantages import groups_advantages
from pipelinerl.rl.losses import LossStats, ppo_clip_loss, reinforce_tis_loss
from pipelinerl.rl.packing import pack, pad, token_logprobs
from pipelinerl.types import Group


def rl_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[Group],
    cfg: Config,
    trainer_version: int,
) -> dict[str, Any]:
    """Advantages, micro-batched loss and backward, gradient clipping, optimizer step.

    Returns the step's metrics: loss, grad norm, and the off-policy health numbers of
    `LossStats` (ESS, lag, engine-vs-trainer mismatch) over every trained token.
    """
    tc = cfg.trainer
    samples = [s for g in groups for s in g.samples]
    advantages = groups_advantages(groups, tc.advantage.baseline, tc.advantage.std_normalize)
    if tc.packing:
        batches = pack(samples, advantages, tc.max_tokens_per_row)
    else:
        batches = pad(samples, advantages, tc.max_tokens_per_row)
    # The engine samples from logits / T; greedy (T = 0) is scored at T = 1.
    temperature = cfg.engine.temperature or 1.0
    loss_cfg = tc.loss
    clip_range = (0.0, loss_cfg.is_clip) if loss_cfg.kind == "reinforce" else (
        1 - loss_cfg.ppo_eps, 1 + loss_cfg.ppo_eps)
    stats = LossStats()
    total_loss = 0.0
    input_tokens = 0
    device = next(model.parameters()).device
    optimizer.zero_grad(set_to_none=True)
    for batch in batches:
        batch = batch.to(device)
        new_lp = token_logprobs(model, batch, temperature=temperature)
        if loss_cfg.kind == "reinforce":
            loss = reinforce_tis_loss(new_lp, batch.old_logprobs, batch.advantages,
                                      num_sequences=len(samples), clip_c=loss_cfg.is_clip)
        else:
            loss = ppo_clip_loss(new_lp, batch.old_logprobs, batch.advantages,
                                 num_sequences=len(samples), eps=loss_cfg.ppo_eps)
        loss.backward()
        total_loss += loss.item()
        input_tokens += batch.num_input_tokens
        stats.add(new_lp, batch.old_logprobs, batch.versions, trainer_version, clip_range)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
    optimizer.step()
    return {
        "loss": total_loss,
        "grad_norm": grad_norm.item(),
        "input_tokens": input_tokens,
        "lr": optimizer.param_groups[0]["lr"],
        **stats.finalize(),
    }
