"""Policy-gradient losses and the off-policy health metrics of one optimizer step.

All per-token tensors are flat and aligned: one entry per trained (completion) token, as
`rl.packing` produces them. `old_logprobs` are the behaviour log-probs mu(a_t) the engine
sampled with; `new_logprobs` are the trainer's log pi_theta(a_t) (with grad).

Losses are SUMS over tokens divided by `num_sequences`, the number of sequences in the whole
optimizer step (not in the micro-batch): the gradients of the micro-batches of a step then add
up to exactly the gradient of the step computed in one piece.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

# (rho, advantages) -> bool mask of the tokens whose clipped term is the active one.
ClipActive = Callable[[Tensor, Tensor], Tensor]


def _masked_sum(x: Tensor, mask: Tensor | None) -> Tensor:
    # where() rather than multiply, so a non-finite value on a masked-out token cannot leak.
    return x.sum() if mask is None else torch.where(mask, x, torch.zeros_like(x)).sum()


def reinforce_tis_loss(
    new_logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    num_sequences: int,
    clip_c: float = 5.0,
    mask: Tensor | None = None,
) -> Tensor:
    """REINFORCE with truncated importance sampling (the PipelineRL paper's loss).

    J = sum_t stopgrad(min(rho_t, c)) * A_t * log pi(a_t), rho_t = exp(log pi - log mu);
    loss = -J / num_sequences. The weight is detached, so d loss / d log pi(a_t) is exactly
    -min(rho_t, c) * A_t / num_sequences.
    """
    rho = torch.exp(new_logprobs.detach() - old_logprobs).clamp(max=clip_c)
    return -_masked_sum(rho * advantages * new_logprobs, mask) / num_sequences


def ppo_clip_loss(
    new_logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    num_sequences: int,
    eps: float = 0.2,
    mask: Tensor | None = None,
) -> Tensor:
    """PPO's clipped surrogate with the behaviour policy as the reference policy.

    per token: -min(r * A, clip(r, 1 - eps, 1 + eps) * A), r = exp(log pi - log mu);
    summed and divided by num_sequences.
    """
    ratio = torch.exp(new_logprobs - old_logprobs)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - eps, 1 + eps) * advantages)
    return -_masked_sum(surrogate, mask) / num_sequences


def tis_clip_active(clip_c: float) -> ClipActive:
    """REINFORCE-TIS: tokens whose truncation changed their gradient, rho > c with A != 0 (the
    gradient is -min(rho, c) * A * grad log pi / B: with A = 0 it is zero whatever the weight)."""
    return lambda rho, adv: (rho > clip_c) & (adv != 0)


def ppo_clip_active(eps: float) -> ClipActive:
    """PPO-clip: tokens where the min picks the clipped term, which has no gradient: r > 1 + eps
    with A > 0, or r < 1 - eps with A < 0. Outside [1 - eps, 1 + eps] on the other side, or
    with A = 0, the unclipped term is the min and clipping changes nothing."""
    return lambda rho, adv: ((rho > 1 + eps) & (adv > 0)) | ((rho < 1 - eps) & (adv < 0))


@dataclass
class LossStats:
    """Sums over one optimizer step; `add()` each micro-batch, then `finalize()`.

    rho = exp(new - old) is the untruncated importance weight of each trained token.
    A token's lag is trainer_version - the version that generated it; lag-0 tokens were
    sampled by the very weights the trainer holds, so their log-prob difference is numerical
    engine-vs-trainer mismatch (kernels, dtype, sampling truncation), not policy change.
    """

    tokens: int = 0
    sum_rho: float = 0.0
    sum_rho_sq: float = 0.0
    clipped: int = 0
    sum_abs_diff: float = 0.0
    sum_k3: float = 0.0
    lag0_tokens: int = 0
    lag0_sum_abs_diff: float = 0.0
    lag0_sum_k3: float = 0.0
    sum_lag: int = 0
    max_lag: int = 0

    @torch.no_grad()
    def add(
        self,
        new_logprobs: Tensor,
        old_logprobs: Tensor,
        advantages: Tensor,
        versions: Tensor,
        trainer_version: int,
        clip_active: ClipActive = tis_clip_active(5.0),
        mask: Tensor | None = None,
    ) -> None:
        """Accumulate one micro-batch.

        clip_active: the loss's rule for a token whose clipped term is the active one
        (`tis_clip_active(c)`, `ppo_clip_active(eps)`); `clip_frac` counts those tokens.
        """
        new, old, ver = new_logprobs.detach().double(), old_logprobs.double(), versions
        adv = advantages.detach()
        if mask is not None:
            new, old, ver, adv = new[mask], old[mask], ver[mask], adv[mask]
        if new.numel() == 0:
            return
        log_ratio = new - old
        rho = torch.exp(log_ratio)
        # k3 estimator of KL(mu || pi) from tokens sampled by mu (Schulman 2020): with
        # r = pi/mu, E_mu[r - 1 - log r] = KL(mu || pi), unbiased and >= 0 per token.
        k3 = rho - 1 - log_ratio
        abs_diff = log_ratio.abs()
        lag = trainer_version - ver.long()
        lag0 = lag == 0
        # Seeded from the first tokens, so a negative lag (a provenance bug) stays visible.
        step_max = lag.max().item()
        self.max_lag = step_max if self.tokens == 0 else max(self.max_lag, step_max)
        self.tokens += new.numel()
        self.sum_rho += rho.sum().item()
        self.sum_rho_sq += rho.square().sum().item()
        self.clipped += clip_active(rho, adv).sum().item()
        self.sum_abs_diff += abs_diff.sum().item()
        self.sum_k3 += k3.sum().item()
        self.lag0_tokens += lag0.sum().item()
        self.lag0_sum_abs_diff += abs_diff[lag0].sum().item()
        self.lag0_sum_k3 += k3[lag0].sum().item()
        self.sum_lag += lag.sum().item()

    def finalize(self) -> dict[str, float]:
        """Metrics of the step; the lag-0 mismatch keys are absent when no token had lag 0."""
        if self.tokens == 0:
            return {"tokens": 0.0}
        n = self.tokens
        out = {
            "tokens": float(n),
            # Kong (1992) normalised effective sample size: 1 = every rho equal (on-policy).
            "ess": self.sum_rho**2 / (n * self.sum_rho_sq),
            "clip_frac": self.clipped / n,
            "rho_mean": self.sum_rho / n,
            "mismatch_abs": self.sum_abs_diff / n,
            "mismatch_k3": self.sum_k3 / n,
            "lag0_tokens": float(self.lag0_tokens),
            "lag_mean": self.sum_lag / n,
            "lag_max": float(self.max_lag),
        }
        if self.lag0_tokens:
            out["mismatch_abs_lag0"] = self.lag0_sum_abs_diff / self.lag0_tokens
            out["mismatch_k3_lag0"] = self.lag0_sum_k3 / self.lag0_tokens
        return out
