"""One optimizer step of the RL algorithm over a batch of groups (on one rank or several)."""

from __future__ import annotations

import contextlib
from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist

from pipelinerl.config import Config, LossConfig
from pipelinerl.rl.advantages import groups_advantages
from pipelinerl.rl.losses import (
    LossStats,
    gspo_loss,
    importance_mask,
    ppo_clip_active,
    ppo_clip_loss,
    reinforce_tis_loss,
    tis_clip_active,
)
from pipelinerl.rl.packing import PackedBatch, pack, pad, score_tokens
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
        clip_active = ppo_clip_active(loss_cfg.eps_low, loss_cfg.eps_high)
    stats = LossStats()
    total_loss = 0.0
    input_tokens = 0
    device = next(model.parameters()).device
    normalizer = _loss_normalizer(loss_cfg, batches, num_sequences, device)
    is_masked = 0
    optimizer.zero_grad(set_to_none=True)
    for i, batch in enumerate(batches):
        batch = batch.to(device)
        # DDP averages gradients over ranks; the loss is a sum over the whole step, so each
        # rank's part is scaled back up by the world size.
        is_last = i == len(batches) - 1
        sync = contextlib.nullcontext() if is_last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            scores = score_tokens(model, batch, temperature, top_k=top_k, top_p=top_p)
            new_lp = scores.logprobs
            mask = None
            if loss_cfg.is_mask is not None:
                mask = importance_mask(new_lp, batch.old_logprobs, *loss_cfg.is_mask)
                is_masked += int((~mask).sum())
            loss = _policy_loss(loss_cfg, new_lp, batch, normalizer, mask)
            (loss * world).backward()
        total_loss += loss.item()
        input_tokens += batch.num_input_tokens
        stats.add(new_lp, batch.old_logprobs, batch.advantages, batch.versions, trainer_version,
                  clip_active, entropy=scores.entropy)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
    optimizer.step()
    totals = {"loss": total_loss, "input_tokens": float(input_tokens),
              "is_masked": float(is_masked)}
    if world > 1:
        stats, totals = _reduce(stats, totals, device)
    return {
        "loss": totals["loss"],
        "grad_norm": grad_norm.item(),
        "input_tokens": int(totals["input_tokens"]),
        "lr": optimizer.param_groups[0]["lr"],
        **stats.finalize(),
        **({"is_mask_frac": totals["is_masked"] / max(1, stats.tokens)}
           if loss_cfg.is_mask is not None else {}),
    }


def _loss_normalizer(loss_cfg: LossConfig, batches: list[PackedBatch], num_sequences: int,
                     device: torch.device) -> float:
    """The loss's denominator, one constant for the whole step: sequences B, or (token_mean)
    trained tokens of every micro-batch of every rank, counted before any backward."""
    if loss_cfg.aggregate == "sum_per_sequence":
        return float(num_sequences)
    tokens = torch.tensor(float(sum(b.num_tokens for b in batches)), dtype=torch.float64,
                          device=device)
    if dist.is_initialized():
        dist.all_reduce(tokens)
    return max(1.0, tokens.item())


def _policy_loss(loss_cfg: LossConfig, new_lp: torch.Tensor, batch: PackedBatch,
                 normalizer: float, mask: torch.Tensor | None) -> torch.Tensor:
    old, adv = batch.old_logprobs, batch.advantages
    if loss_cfg.kind == "reinforce":
        return reinforce_tis_loss(new_lp, old, adv, normalizer, clip_c=loss_cfg.is_clip, mask=mask)
    if loss_cfg.kind == "ppo":
        return ppo_clip_loss(new_lp, old, adv, normalizer, eps=loss_cfg.eps_low, mask=mask,
                             eps_high=loss_cfg.eps_high)
    return gspo_loss(new_lp, old, adv, batch.seq_idx, normalizer, eps=loss_cfg.eps_low,
                     mask=mask, eps_high=loss_cfg.eps_high)


def _reduce(stats: LossStats, totals: dict[str, float], device: torch.device
            ) -> tuple[LossStats, dict[str, float]]:
    """Sum the step's statistics over ranks, the lag histogram bin by bin."""
    names = [f.name for f in fields(LossStats) if f.name != "lag_counts"]
    keys = list(totals)
    summed = torch.tensor([float(getattr(stats, n)) for n in names] + [totals[k] for k in keys],
                          dtype=torch.float64, device=device)
    dist.all_reduce(summed)
    out = LossStats(**{n: type(getattr(stats, n))(v) for n, v in zip(names, summed.tolist())})
    out.lag_counts = _reduce_histogram(stats.lag_counts, device)
    return out, dict(zip(keys, summed[len(names):].tolist()))


def _reduce_histogram(counts: dict[int, int], device: torch.device) -> dict[int, int]:
    """Sum {lag: count} over ranks: agree on the range of lags seen, then add dense bins."""
    # (max, -min); a rank with no token reports -inf so it does not widen the range.
    bounds = torch.tensor([max(counts), -min(counts)] if counts else [float("-inf")] * 2,
                          dtype=torch.float64, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    if not torch.isfinite(bounds).all():
        return {}
    lo, hi = -int(bounds[1].item()), int(bounds[0].item())
    dense = torch.zeros(hi - lo + 1, dtype=torch.float64, device=device)
    for lag, n in counts.items():
        dense[lag - lo] = n
    dist.all_reduce(dense)
    return {lo + i: int(n) for i, n in enumerate(dense.tolist()) if n}
