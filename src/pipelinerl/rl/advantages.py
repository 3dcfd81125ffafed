"""Group-relative advantages: each attempt at a prompt is scored against its siblings.

Every token of a sequence later receives its sequence's advantage (see `rl.packing`).
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
from torch import Tensor

from pipelinerl.types import Group, Sample, attempt_index

Baseline = Literal["mean", "loo", "vcpo"]
Truncated = Literal["keep", "mask", "penalty"]

# Bound on a sequence's log importance weight in the vcpo baseline (`trainer.advantage`).
MAX_LOG_WEIGHT = 20.0


def group_advantages(
    rewards: Sequence[float] | Tensor,
    baseline: Baseline = "mean",
    std_normalize: bool = False,
    eps: float = 1e-6,
    log_weights: Tensor | None = None,
) -> Tensor:
    """Advantages of one group of attempts at the same prompt.

    baseline="mean": A_i = r_i - mean(r) (the paper's recipe).
    baseline="loo":  A_i = r_i - mean of the other rewards = n/(n-1) * (r_i - mean(r)), so a
                     sample's own reward does not pull its baseline; a group of 1 gets 0.
    baseline="vcpo": A_i = r_i - sum_j w_j^2 r_j / sum_j w_j^2, w_j = exp(log_weights_j)
                     clamped to [e^-20, e^20]: the minimum-variance off-policy baseline
                     (docs/algorithm.md). `log_weights`: the sequences' log importance weights.
    std_normalize:   divide by the group's population std + eps (GRPO-style). The population
                     std (not the n-1 one) keeps a group of 1 defined; a group whose rewards
                     are all equal has A = 0 either way.
    """
    r = torch.as_tensor(rewards)
    if not r.is_floating_point():
        r = r.float()
    n = r.numel()
    if n == 0:
        return r.clone()
    if baseline == "mean":
        adv = r - r.mean()
    elif baseline == "loo":
        adv = (r - r.mean()) * (n / (n - 1)) if n > 1 else torch.zeros_like(r)
    elif baseline == "vcpo":
        if log_weights is None:
            raise ValueError("baseline 'vcpo' needs the sequences' log importance weights")
        adv = r - vcpo_baseline(r, log_weights)
    else:
        raise ValueError(f"baseline must be 'mean', 'loo' or 'vcpo', got {baseline!r}")
    if std_normalize:
        adv = adv / (r.std(correction=0) + eps)
    return adv


def vcpo_baseline(rewards: Tensor, log_weights: Tensor) -> Tensor:
    """sum w^2 r / sum w^2 with log w clamped to [-20, 20]; the normalised w^2 is a softmax of
    2 log w, so neither e^40 nor e^-40 is ever formed."""
    clamped = log_weights.detach().double().clamp(-MAX_LOG_WEIGHT, MAX_LOG_WEIGHT)
    share = torch.softmax(2 * clamped, dim=0)
    return (share * rewards.double()).sum().to(rewards.dtype)


def is_truncated(sample: Sample) -> bool:
    """Cut at engine.max_new_tokens: no stop token, the answer may be incomplete."""
    return sample.finish_reason == "length"


def rewards_and_trained(
    samples: Sequence[Sample], truncated: Truncated = "keep", truncated_reward: float = 0.0
) -> tuple[Tensor, Tensor]:
    """The rewards the advantages see (truncated=penalty: truncated_reward for a truncated
    sample) and which samples are trained (truncated=mask: not the truncated ones)."""
    cut = torch.tensor([is_truncated(s) for s in samples], dtype=torch.bool)
    rewards = torch.as_tensor([s.reward for s in samples])
    if truncated == "penalty":
        rewards = torch.where(cut, torch.as_tensor(truncated_reward, dtype=rewards.dtype), rewards)
    trained = ~cut if truncated == "mask" else torch.ones_like(cut)
    return rewards, trained


def zero_variance(
    samples: Sequence[Sample], truncated: Truncated = "keep", truncated_reward: float = 0.0
) -> bool:
    """True when the group's trained samples all see the same reward: their advantages are 0
    under every baseline, so the group carries no gradient."""
    rewards, trained = rewards_and_trained(samples, truncated, truncated_reward)
    kept = rewards[trained]
    return bool((kept == kept[0]).all()) if kept.numel() else True


def groups_advantages(
    groups: Sequence[Group],
    baseline: Baseline = "mean",
    std_normalize: bool = False,
    eps: float = 1e-6,
    truncated: Truncated = "keep",
    truncated_reward: float = 0.0,
    log_weights: Tensor | None = None,
) -> Tensor:
    """One advantage per sample, in the order `[s for g in groups for s in g.samples]`.

    A sample left out by truncated=mask gets A = 0 and its group's baseline (and std) is
    computed over the group's other samples. `log_weights`: one per sample in the same order
    (baseline vcpo; a left-out sample's is ignored). An episode trained as several samples
    (its branches, `Sample.episode`) is one attempt: the baseline counts it once, its
    importance weight is the product of its samples', and each of them gets its advantage.
    """
    parts = []
    start = 0
    for g in groups:
        index = attempt_index(g.samples)
        firsts: dict[int, Sample] = {}  # an attempt's reward and truncation: its first sample's
        for a, s in zip(index, g.samples):
            firsts.setdefault(a, s)
        attempt = torch.tensor(index, dtype=torch.long)
        rewards, _ = rewards_and_trained(list(firsts.values()), truncated, truncated_reward)
        # The trained attempts by index, from the host's samples: a boolean mask would cost a
        # nonzero (and the launch counter a host read) per group.
        trained = torch.tensor([a for a, s in enumerate(firsts.values())
                                if not (truncated == "mask" and is_truncated(s))], dtype=torch.long)
        weights = None
        if log_weights is not None:
            mine = log_weights[start:start + len(g.samples)]
            weights = mine.new_zeros(len(firsts)).index_add_(0, attempt, mine)[trained]
        adv = torch.zeros(len(firsts))
        adv[trained] = group_advantages(rewards[trained], baseline, std_normalize, eps, weights)
        parts.append(adv[attempt])
        start += len(g.samples)
    return torch.cat(parts) if parts else torch.zeros(0)
