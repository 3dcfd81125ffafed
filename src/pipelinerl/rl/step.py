"""One optimizer step of the RL algorithm over a batch of groups (on one rank or several)."""

from __future__ import annotations

import contextlib
from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist

from pipelinerl.config import Config
from pipelinerl.rl.advantages import groups_advantages
from pipelinerl.rl.losses import (
    LossStats,
    ppo_clip_active,
    ppo_clip_loss,
    reinforce_tis_loss,
    tis_clip_active,
)
from pipelinerl.rl.packing import pack, pad, token_logprobs
from pipelinerl.types import Group


def rl_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[Group],
    cfg: Config,
    trainer_version: int,
    num_sequences: int | None = None,
) -> dict[str, Any]:
    """Advantages, micro-batched loss and backward, gradient clipping, optimizer step.

    `groups` is this rank's shard; `num_sequences` the number of sequences in the whole step
    across ranks (B in the loss). `model` may be wrapped in DistributedDataParallel: its
    gradients are then all-reduced once, on the last micro-batch. Returns the step's metrics:
    loss, grad norm, and `LossStats` (ESS, lag, mismatch) over every trained token of every rank.
    """
    tc = cfg.trainer
    samples = [s for g in groups for s in g.samples]
    world = dist.get_world_size() if dist.is_initialized() else 1
    num_sequences = num_sequences or len(samples)
    advantages = groups_advantages(groups, tc.advantage.baseline, tc.advantage.std_normalize)
    if tc.packing:
        batches = pack(samples, advantages, tc.max_tokens_per_row)
    else:
        batches = pad(samples, advantages, tc.max_tokens_per_row)
    # Score under the distribution the engine sampled from: logits / T, truncated to top-k and
    # top-p (`engine.sampling`). Greedy (T = 0) is scored at T = 1, untruncated, as reported.
    ec = cfg.engine
    sampled = ec.temperature > 0
    temperature = ec.temperature if sampled else 1.0
    top_k, top_p = (ec.top_k, ec.top_p) if sampled else (0, 1.0)
    loss_cfg = tc.loss
    if loss_cfg.kind == "reinforce":
        clip_active = tis_clip_active(loss_cfg.is_clip)
    else:
        clip_active = ppo_clip_active(loss_cfg.ppo_eps)
    stats = LossStats()
    total_loss = 0.0
    input_tokens = 0
    device = next(model.parameters()).device
    optimizer.zero_grad(set_to_none=True)
    for i, batch in enumerate(batches):
        batch = batch.to(device)
        # DDP averages gradients over ranks; the loss is a sum over the whole step, so each
        # rank's part is scaled back up by the world size.
        is_last = i == len(batches) - 1
        sync = contextlib.nullcontext() if is_last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            new_lp = token_logprobs(model, batch, temperature, top_k=top_k, top_p=top_p)
            if loss_cfg.kind == "reinforce":
                loss = reinforce_tis_loss(new_lp, batch.old_logprobs, batch.advantages,
                                          num_sequences=num_sequences, clip_c=loss_cfg.is_clip)
            else:
                loss = ppo_clip_loss(new_lp, batch.old_logprobs, batch.advantages,
                                     num_sequences=num_sequences, eps=loss_cfg.ppo_eps)
            (loss * world).backward()
        total_loss += loss.item()
        input_tokens += batch.num_input_tokens
        stats.add(new_lp, batch.old_logprobs, batch.advantages, batch.versions, trainer_version,
                  clip_active)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
    optimizer.step()
    totals = {"loss": total_loss, "input_tokens": float(input_tokens)}
    if world > 1:
        stats, totals = _reduce(stats, totals, device)
    return {
        "loss": totals["loss"],
        "grad_norm": grad_norm.item(),
        "input_tokens": int(totals["input_tokens"]),
        "lr": optimizer.param_groups[0]["lr"],
        **stats.finalize(),
    }


def _reduce(stats: LossStats, totals: dict[str, float], device: torch.device
            ) -> tuple[LossStats, dict[str, float]]:
    """Sum the step's statistics over ranks (max for the lag)."""
    names = [f.name for f in fields(LossStats) if f.name != "max_lag"]
    keys = list(totals)
    summed = torch.tensor([float(getattr(stats, n)) for n in names] + [totals[k] for k in keys],
                          dtype=torch.float64, device=device)
    dist.all_reduce(summed)
    # Ranks with no token report -inf so they do not pull the maximum.
    lag = torch.tensor([float(stats.max_lag) if stats.tokens else float("-inf")],
                       dtype=torch.float64, device=device)
    dist.all_reduce(lag, op=dist.ReduceOp.MAX)
    out = LossStats(**{n: type(getattr(stats, n))(v) for n, v in zip(names, summed.tolist())})
    out.max_lag = int(lag.item()) if out.tokens else 0
    return out, dict(zip(keys, summed[len(names):].tolist()))
