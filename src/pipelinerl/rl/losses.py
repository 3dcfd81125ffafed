"""Policy-gradient losses and the off-policy health metrics of one optimizer step.

All per-token tensors are flat and aligned: one entry per trained (completion) token, as
`rl.packing` produces them. `old_logprobs` are the behaviour log-probs mu(a_t) the engine
sampled with; `new_logprobs` are the trainer's log pi_theta(a_t) (with grad).

Losses are SUMS over tokens divided by `normalizer`, a constant of the whole optimizer step (not
of the micro-batch): the number of sequences B (`trainer.loss.aggregate=sum_per_sequence`, the
paper) or the number of trained tokens (`token_mean`, DAPO), each counted over every rank. B is
the samples the step holds, each branch of a branched episode one, not `trainer.batch_size`.
The gradients of the micro-batches of a step then add up to exactly the gradient of the step
computed in one piece.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from pipelinerl.types import LENGTH_EDGES, LENGTH_LABELS

# (rho, advantages) -> bool mask of the tokens whose clipped term is the active one.
ClipActive = Callable[[Tensor, Tensor], Tensor]

# Per bin: sequences, tokens, sum of rho, sum of rho^2, sum of lag.
_BIN_FIELDS = 5


def length_bins(lengths: Tensor) -> Tensor:
    """The bin (index into LENGTH_LABELS) of each completion length."""
    return torch.bucketize(lengths, torch.tensor(LENGTH_EDGES, device=lengths.device), right=True)


def _masked_sum(x: Tensor, mask: Tensor | None) -> Tensor:
    # where() rather than multiply, so a non-finite value on a masked-out token cannot leak.
    return x.sum() if mask is None else torch.where(mask, x, torch.zeros_like(x)).sum()


def importance_mask(new_logprobs: Tensor, old_logprobs: Tensor, lo: float, hi: float) -> Tensor:
    """Masked importance sampling: True for the tokens whose rho = pi / mu lies in [lo, hi];
    the others get no gradient (`trainer.loss.is_mask`)."""
    rho = torch.exp(new_logprobs.detach() - old_logprobs)
    return (rho >= lo) & (rho <= hi)


def reinforce_tis_loss(
    new_logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    normalizer: float,
    clip_c: float = 5.0,
    mask: Tensor | None = None,
) -> Tensor:
    """REINFORCE with truncated importance sampling (the PipelineRL paper's loss).

    J = sum_t stopgrad(min(rho_t, c)) * A_t * log pi(a_t), rho_t = exp(log pi - log mu);
    loss = -J / normalizer. The weight is detached, so d loss / d log pi(a_t) is exactly
    -min(rho_t, c) * A_t / normalizer.
    """
    rho = torch.exp(new_logprobs.detach() - old_logprobs).clamp(max=clip_c)
    return -_masked_sum(rho * advantages * new_logprobs, mask) / normalizer


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, eps: float, eps_high: float | None
                       ) -> Tensor:
    """min(r * A, clip(r, 1 - eps, 1 + eps_high) * A); eps_high None: eps (symmetric)."""
    high = eps if eps_high is None else eps_high
    return torch.minimum(ratio * advantages, ratio.clamp(1 - eps, 1 + high) * advantages)


def ppo_clip_loss(new_logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, normalizer: float,
                  eps: float = 0.2, mask: Tensor | None = None, eps_high: float | None = None
                  ) -> Tensor:
    """PPO's clipped surrogate with the behaviour policy as the reference policy.

    per token: -min(r * A, clip(r, 1 - eps, 1 + eps_high) * A), r = exp(log pi - log mu);
    summed and divided by normalizer. eps_high None: eps (symmetric clipping).
    """
    ratio = torch.exp(new_logprobs - old_logprobs)
    return -_masked_sum(_clipped_surrogate(ratio, advantages, eps, eps_high), mask) / normalizer


def gspo_loss(new_logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, seq_idx: Tensor,
              normalizer: float, eps: float = 0.2, mask: Tensor | None = None,
              eps_high: float | None = None) -> Tensor:
    """GSPO (Zheng et al. 2025): PPO's clipped surrogate on a sequence-level ratio.

    s_i = exp(mean over sequence i's (unmasked) tokens of log pi - log mu); per sequence
    -min(s_i * A_i, clip(s_i, 1 - eps, 1 + eps_high) * A_i), summed over sequences and divided by
    normalizer. A sequence's tokens must all be in this micro-batch (packing never splits one).
    """
    keep = torch.ones_like(seq_idx, dtype=torch.bool) if mask is None else mask
    log_ratio = torch.where(keep, new_logprobs - old_logprobs, torch.zeros_like(new_logprobs))
    seqs, local = torch.unique(seq_idx, return_inverse=True)
    sums = log_ratio.new_zeros(len(seqs)).index_add(0, local, log_ratio)
    counts = log_ratio.new_zeros(len(seqs)).index_add(0, local, keep.to(log_ratio.dtype))
    # Every token of a sequence carries the sequence's A, so any of them gives it.
    seq_adv = advantages.new_zeros(len(seqs)).scatter(0, local, advantages)
    has_tokens = counts > 0
    ratio = torch.exp(sums / counts.clamp(min=1))
    return -_masked_sum(_clipped_surrogate(ratio, seq_adv, eps, eps_high), has_tokens) / normalizer


def reference_k3(new_logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per token, Schulman's (2020) k3 estimate of KL(pi || ref) (`trainer.loss.kl_coef`):
    exp(ref - new) - (ref - new) - 1 >= 0, the gradient flowing through the trainer's
    log-probs only. As in GRPO, the tokens are the sampled ones, without an importance weight."""
    diff = ref_logprobs.detach() - new_logprobs
    return torch.exp(diff) - diff - 1


def tis_clip_active(clip_c: float) -> ClipActive:
    """REINFORCE-TIS: tokens whose truncation changed their gradient, rho > c with A != 0 (the
    gradient is -min(rho, c) * A * grad log pi / B: with A = 0 it is zero whatever the weight)."""
    return lambda rho, adv: (rho > clip_c) & (adv != 0)


def ppo_clip_active(eps: float, eps_high: float | None = None) -> ClipActive:
    """PPO-clip: tokens where the min picks the clipped term, which has no gradient: r > 1 + eps_high
    with A > 0, or r < 1 - eps with A < 0. Outside [1 - eps, 1 + eps_high] on the other side, or
    with A = 0, the unclipped term is the min and clipping changes nothing."""
    high = eps if eps_high is None else eps_high
    return lambda rho, adv: ((rho > 1 + high) & (adv > 0)) | ((rho < 1 - eps) & (adv < 0))


# The sums LossStats keeps over an optimizer step, in the order of its `sums` vector.
SUMS = ("tokens", "sum_rho", "sum_rho_sq", "clipped", "sum_abs_diff", "sum_k1", "sum_k3",
        "lag0_tokens", "lag0_sum_abs_diff", "lag0_sum_k3", "sum_lag", "entropy_tokens",
        "sum_entropy")


@dataclass
class LossStats:
    """Sums over one optimizer step; `add()` each micro-batch, then `finalize()`.

    rho = exp(new - old) is the untruncated importance weight of each trained token.
    A token's lag is trainer_version - the version that generated it; lag-0 tokens were
    sampled by the very weights the trainer holds, so their log-prob difference is numerical
    engine-vs-trainer mismatch (kernels, dtype, sampling truncation), not policy change.
    Every sum stays on the micro-batches' device until `finalize` reads them all at once: a
    GPU step waits for none of them (no `.item()` or boolean indexing per micro-batch).

    The lag histogram is dense over `lag_range` (lowest, highest lag), counted on the device.
    A caller that knows the range (the step: from its samples' versions, on the host) gives it
    and no micro-batch is read; without it each `add` finds its tokens' range (one read each)
    and the histogram widens to cover it.
    """

    sums: Tensor | None = None  # float64 (len(SUMS),)
    # (bin, field) sums by the completion length of the token's sequence (_BIN_FIELDS)
    by_length: Tensor | None = None
    lag_range: tuple[int, int] | None = None
    lag_hist: Tensor | None = None  # float64 counts of lags lag_range[0] .. lag_range[1]
    _fixed_range: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self._fixed_range = self.lag_range is not None

    def allocate(self, device: torch.device) -> None:
        """Zero sums on `device`, unless already there (a rank with no token reduces them too)."""
        if self.sums is None:
            self.sums = torch.zeros(len(SUMS), dtype=torch.float64, device=device)
            self.by_length = torch.zeros(len(LENGTH_LABELS), _BIN_FIELDS, dtype=torch.float64,
                                         device=device)
        if self.lag_hist is None and self.lag_range is not None:
            lo, hi = self.lag_range
            self.lag_hist = torch.zeros(hi - lo + 1, dtype=torch.float64, device=device)

    def count_sequences(self, bins: Tensor) -> None:
        """Add sequences of the given length bins (`length_bins`)."""
        self.allocate(bins.device)
        self.by_length[:, 0] += torch.bincount(bins, minlength=len(LENGTH_LABELS))

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
        entropy: Tensor | None = None,
        context_versions: Tensor | None = None,
        bins: Tensor | None = None,
    ) -> None:
        """Accumulate one micro-batch.

        bins: per token, the length bin of its sequence (`length_bins`), for `by_length`.

        context_versions: per token, the oldest version whose weights computed part of its
        context (`PackedBatch.context_versions`); the lag-0 mismatch counts only tokens whose
        context is all their own version's, so that it measures engine-vs-trainer numerics
        alone, not a KV cache kept across an update (None: every lag-0 token counts).
        clip_active: the loss's rule for a token whose clipped term is the active one
        (`tis_clip_active(c)`, `ppo_clip_active(eps)`); `clip_frac` counts those tokens.
        mask: the tokens to count (a masked token is weighted 0, not removed: no host sync).
        entropy: per token, the entropy of the trainer's distribution at that position
        (`rl.scores.score_tokens`); the `entropy` metric is absent when never given.
        """
        new, old, ver = new_logprobs.detach().double(), old_logprobs.double(), versions
        self.allocate(new.device)
        keep = torch.ones_like(new, dtype=torch.bool) if mask is None else mask
        ctx = ver if context_versions is None else context_versions
        log_ratio = new - old
        rho = torch.exp(log_ratio)
        # Schulman's (2020) estimators of KL(mu || pi) from tokens sampled by mu, with
        # r = pi/mu: k1 = -log r (unbiased, noisy, negative per token); k3 = r - 1 - log r
        # (unbiased, >= 0 per token, low variance when mu and pi are close).
        k3 = rho - 1 - log_ratio
        abs_diff = log_ratio.abs()
        lag = trainer_version - ver.long()
        lag0 = ((lag == 0) & (ctx == ver)).double()
        ones = torch.ones_like(new)
        ent = torch.zeros_like(new) if entropy is None else entropy.detach().double()
        terms = torch.stack([ones, rho, rho.square(), clip_active(rho, advantages.detach()).double(),
                             abs_diff, -log_ratio, k3, lag0, abs_diff * lag0, k3 * lag0,
                             lag.double(), ones * (entropy is not None), ent])
        # where, not a product: a masked token's weight may be inf (0 * inf is nan).
        self.sums += terms.where(keep, 0.0).sum(dim=1)
        if lag.numel():
            if not self._fixed_range:
                self._cover(int(lag.min()), int(lag.max()), new.device)
            assert self.lag_range is not None and self.lag_hist is not None
            self.lag_hist.index_add_(0, lag - self.lag_range[0], keep.double())
        if bins is not None:
            per_bin = torch.stack([ones, rho, rho.square(), lag.double()], dim=1)
            self.by_length[:, 1:].index_add_(0, bins, per_bin.where(keep[:, None], 0.0))

    def _cover(self, lo: int, hi: int, device: torch.device) -> None:
        """Widen the histogram to lags lo .. hi, keeping its counts."""
        if self.lag_range is not None:
            lo, hi = min(lo, self.lag_range[0]), max(hi, self.lag_range[1])
        wider = torch.zeros(hi - lo + 1, dtype=torch.float64, device=device)
        if self.lag_hist is not None and self.lag_range is not None:
            start = self.lag_range[0] - lo
            wider[start:start + self.lag_hist.numel()] = self.lag_hist
        self.lag_range, self.lag_hist = (lo, hi), wider

    def read(self) -> tuple[list[float], list[list[float]], dict[int, int]]:
        """The sums, the by-length rows and the trained tokens per lag: one read of the
        device for all three."""
        if self.sums is None:
            return [0.0] * len(SUMS), [], {}
        assert self.by_length is not None
        parts = [self.sums, self.by_length.flatten()]
        if self.lag_hist is not None:
            parts.append(self.lag_hist)
        flat = torch.cat(parts).tolist()
        sums, rest = flat[:len(SUMS)], flat[len(SUMS):]
        cells = self.by_length.numel()
        rows = [rest[i:i + _BIN_FIELDS] for i in range(0, cells, _BIN_FIELDS)]
        lo = self.lag_range[0] if self.lag_range is not None else 0
        lags = {lo + i: int(n) for i, n in enumerate(rest[cells:]) if n}
        return sums, rows, lags

    def lag_counts(self) -> dict[int, int]:
        """Trained tokens per lag."""
        return self.read()[2]

    def totals(self) -> dict[str, float]:
        """The sums by name."""
        return dict(zip(SUMS, self.read()[0]))

    def finalize(self) -> dict[str, Any]:
        """Metrics of the step; the lag-0 mismatch keys are absent when no token had lag 0.

        `lag_hist` maps each lag (as a string, JSON's key type) to its count of trained tokens.
        """
        sums, rows, lag_counts = self.read()
        t = dict(zip(SUMS, sums))
        if t["tokens"] == 0:
            return {"tokens": 0.0}
        n = t["tokens"]
        out: dict[str, Any] = {
            "tokens": n,
            # Kong (1992) normalised effective sample size: 1 = every rho equal (on-policy).
            "ess": t["sum_rho"]**2 / (n * t["sum_rho_sq"]),
            "clip_frac": t["clipped"] / n,
            "rho_mean": t["sum_rho"] / n,
            "mismatch_abs": t["sum_abs_diff"] / n,
            "kl_k1": t["sum_k1"] / n,
            "mismatch_k3": t["sum_k3"] / n,
            "lag0_tokens": t["lag0_tokens"],
            "lag_mean": t["sum_lag"] / n,
            # A negative lag (a provenance bug) stays visible: the max of what was seen.
            "lag_max": float(max(lag_counts)),
            "lag_hist": {str(lag): lag_counts[lag] for lag in sorted(lag_counts)},
        }
        if t["lag0_tokens"]:
            out["mismatch_abs_lag0"] = t["lag0_sum_abs_diff"] / t["lag0_tokens"]
            out["mismatch_k3_lag0"] = t["lag0_sum_k3"] / t["lag0_tokens"]
        if t["entropy_tokens"]:
            out["entropy"] = t["sum_entropy"] / t["entropy_tokens"]
        by_length = {label: _bin_metrics(row) for label, row in zip(LENGTH_LABELS, rows) if row[1]}
        if by_length:
            out["by_length"] = by_length
        return out


def _bin_metrics(row: list[float]) -> dict[str, float]:
    sequences, tokens, sum_rho, sum_rho_sq, sum_lag = row
    return {"sequences": sequences, "tokens": tokens, "ess": sum_rho**2 / (tokens * sum_rho_sq),
            "lag_mean": sum_lag / tokens}
