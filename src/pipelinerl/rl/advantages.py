"""Group-relative advantages: each attempt at a prompt is scored against its siblings.

Every token of a sequence later receives its sequence's advantage (see `rl.packing`).
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch
from torch import Tensor

from pipelinerl.types import Group

Baseline = Literal["mean", "loo"]


def group_advantages(
    rewards: Sequence[float] | Tensor,
    baseline: Baseline = "mean",
    std_normalize: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """Advantages of one group of attempts at the same prompt.

    baseline="mean": A_i = r_i - mean(r) (the paper's recipe).
    baseline="loo":  A_i = r_i - mean of the other rewards = n/(n-1) * (r_i - mean(r)), so a
                     sample's own reward does not pull its baseline; a group of 1 gets 0.
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
    centred = r - r.mean()
    if baseline == "mean":
        adv = centred
    elif baseline == "loo":
        adv = centred * (n / (n - 1)) if n > 1 else torch.zeros_like(r)
    else:
        raise ValueError(f"baseline must be 'mean' or 'loo', got {baseline!r}")
    if std_normalize:
        adv = adv / (r.std(correction=0) + eps)
    return adv


def groups_advantages(
    groups: Sequence[Group],
    baseline: Baseline = "mean",
    std_normalize: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """One advantage per sample, in the order `[s for g in groups for s in g.samples]`."""
    parts = [
        group_advantages([s.reward for s in g.samples], baseline, std_normalize, eps)
        for g in groups
    ]
    return torch.cat(parts) if parts else torch.zeros(0)
