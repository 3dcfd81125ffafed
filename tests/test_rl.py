"""Advantages, losses and off-policy metrics against numbers worked out by hand."""

import math

import pytest
import torch

from pipelinerl.rl.advantages import group_advantages, groups_advantages
from pipelinerl.rl.losses import (
    ClipActive,
    LossStats,
    ppo_clip_active,
    ppo_clip_loss,
    reinforce_tis_loss,
    tis_clip_active,
)
from pipelinerl.types import Group, Sample

torch.set_num_threads(1)


def close(actual: torch.Tensor | float, expected: list[float] | float, tol: float = 1e-6) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        atol=tol,
        rtol=0,
    )


# ---- advantages -------------------------------------------------------------------------


def test_mean_baseline() -> None:
    # mean(1, 0, 0, 0) = 0.25
    close(group_advantages([1.0, 0.0, 0.0, 0.0]), [0.75, -0.25, -0.25, -0.25])


def test_loo_baseline() -> None:
    # sample 0: 1 - mean(0, 0, 0) = 1; samples 1-3: 0 - mean(1, 0, 0) = -1/3
    close(group_advantages([1.0, 0.0, 0.0, 0.0], "loo"), [1.0, -1 / 3, -1 / 3, -1 / 3])
    # r = (3, 1, 2): 3 - 1.5 = 1.5; 1 - 2.5 = -1.5; 2 - 2 = 0
    close(group_advantages(torch.tensor([3.0, 1.0, 2.0]), "loo"), [1.5, -1.5, 0.0])


def test_std_normalize() -> None:
    # population std of (1, 0, 0, 0): sqrt((0.75^2 + 3 * 0.25^2) / 4) = sqrt(0.1875) = sqrt(3)/4
    # 0.75 / (sqrt(3)/4) = sqrt(3);  -0.25 / (sqrt(3)/4) = -1/sqrt(3)
    s3 = math.sqrt(3)
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], std_normalize=True, eps=0.0)
    close(adv, [s3, -1 / s3, -1 / s3, -1 / s3])


def test_degenerate_groups() -> None:
    close(group_advantages([1.0]), [0.0])
    close(group_advantages([1.0], "loo"), [0.0])
    close(group_advantages([1.0], "loo", std_normalize=True), [0.0])
    # all-equal rewards: A = 0 / (0 + eps) = 0, not NaN
    close(group_advantages([1.0, 1.0, 1.0], std_normalize=True), [0.0, 0.0, 0.0])
    assert group_advantages([]).numel() == 0
    with pytest.raises(ValueError):
        group_advantages([1.0], "median")  # type: ignore[arg-type]


def test_groups_advantages_order() -> None:
    def group(gid: str, rewards: list[float]) -> Group:
        samples = [
            Sample([1], [2], [-0.1], [0], r, r > 0, "stop", group_id=gid) for r in rewards
        ]
        return Group(gid, "p", samples)

    adv = groups_advantages([group("a", [1.0, 0.0]), group("b", [2.0, 2.0, 5.0])])
    # group a: mean 0.5; group b: mean 3
    close(adv, [0.5, -0.5, -1.0, -1.0, 2.0])


# ---- losses -----------------------------------------------------------------------------

# Three tokens from two sequences (B = 2): tokens 0, 1 belong to sequence 0 (A = +1),
# token 2 to sequence 1 (A = -2). old = new - log(rho) makes rho = (2, 10, 0.5) exactly.
NEW = [-1.0, -2.0, -0.5]
RHO = [2.0, 10.0, 0.5]
ADV = [1.0, 1.0, -2.0]


def tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    new = torch.tensor(NEW, dtype=torch.float64, requires_grad=True)
    old = torch.tensor([n - math.log(r) for n, r in zip(NEW, RHO)], dtype=torch.float64)
    return new, old, torch.tensor(ADV, dtype=torch.float64)


def test_reinforce_tis_value_and_gradient() -> None:
    new, old, adv = tensors()
    loss = reinforce_tis_loss(new, old, adv, num_sequences=2, clip_c=5.0)
    # weights min(rho, 5) = (2, 5, 0.5): token 1's rho = 10 is truncated, the others are not.
    # J = 2*1*(-1) + 5*1*(-2) + 0.5*(-2)*(-0.5) = -2 - 10 + 0.5 = -11.5;  loss = 11.5 / 2
    close(loss, 5.75)
    loss.backward()
    # weight is stop-gradient: d loss / d new_t = -w_t * A_t / B
    #   = -(2*1, 5*1, 0.5*(-2)) / 2 = (-1, -2.5, 0.5)
    close(new.grad, [-1.0, -2.5, 0.5])


def test_reinforce_tis_mask() -> None:
    new, old, adv = tensors()
    mask = torch.tensor([True, False, True])
    loss = reinforce_tis_loss(new, old, adv, num_sequences=2, mask=mask)
    # J = -2 + 0.5 = -1.5;  loss = 0.75;  masked token gets no gradient
    close(loss, 0.75)
    loss.backward()
    close(new.grad, [-1.0, 0.0, 0.5])


def test_ppo_clip_value_and_gradient() -> None:
    new, old, adv = tensors()
    # a fourth token inside the trust region: rho = 1.1, A = +1, its own sequence (B = 3)
    new = torch.cat([new.detach(), torch.tensor([-0.3], dtype=torch.float64)]).requires_grad_()
    old = torch.cat([old, torch.tensor([-0.3 - math.log(1.1)], dtype=torch.float64)])
    adv = torch.cat([adv, torch.tensor([1.0], dtype=torch.float64)])
    loss = ppo_clip_loss(new, old, adv, num_sequences=3, eps=0.2)
    # token 0: r=2,   A=1:  min(2, 1.2)        = 1.2  (clipped)
    # token 1: r=10,  A=1:  min(10, 1.2)       = 1.2  (clipped)
    # token 2: r=0.5, A=-2: min(-1, 0.8*(-2))  = -1.6 (clipped)
    # token 3: r=1.1, A=1:  min(1.1, 1.1)      = 1.1
    # loss = -(1.2 + 1.2 - 1.6 + 1.1) / 3 = -1.9 / 3
    close(loss, -1.9 / 3)
    loss.backward()
    # clipped tokens carry no gradient; token 3: d(-r*A/3)/d new = -r*A/3 = -1.1/3
    close(new.grad, [0.0, 0.0, 0.0, -1.1 / 3])


@pytest.mark.parametrize("loss_fn", [reinforce_tis_loss, ppo_clip_loss])
def test_micro_batches_add_up_to_the_step(loss_fn) -> None:
    g = torch.Generator().manual_seed(0)
    old = torch.randn(40, generator=g, dtype=torch.float64) - 2
    new = (old + 0.5 * torch.randn(40, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(40, generator=g, dtype=torch.float64)
    b = 6  # sequences in the optimizer step
    loss_fn(new, old, adv, b).backward()
    whole = new.grad.clone()
    new.grad = None
    total = sum(loss_fn(new[s], old[s], adv[s], b) for s in (slice(0, 17), slice(17, 40)))
    total.backward()
    close(new.grad, whole.tolist(), tol=1e-12)


# ---- metrics ----------------------------------------------------------------------------


def test_ess_on_policy_is_one() -> None:
    stats = LossStats()
    lp = torch.tensor([-1.0, -0.2, -3.0])
    stats.add(lp, lp, torch.ones(3), torch.tensor([4, 4, 4]), trainer_version=4)
    m = stats.finalize()
    close(m["ess"], 1.0)
    close(m["rho_mean"], 1.0)
    close(m["clip_frac"], 0.0)
    close(m["mismatch_abs"], 0.0)
    close(m["mismatch_k3"], 0.0)


def test_ess_non_uniform_across_micro_batches() -> None:
    # rho = (1, 3) over two micro-batches: (1 + 3)^2 / (2 * (1 + 9)) = 16 / 20 = 0.8
    stats = LossStats()
    zero = torch.zeros(1, dtype=torch.float64)
    stats.add(zero, zero, zero, torch.tensor([0]), trainer_version=0)
    stats.add(zero + math.log(3), zero, zero, torch.tensor([0]), trainer_version=0)
    m = stats.finalize()
    close(m["ess"], 0.8)
    close(m["rho_mean"], 2.0)


def test_clip_fraction_counts_only_tokens_whose_clipped_term_is_active() -> None:
    # token:      0    1    2    3    4    5   6
    rho = [2.0, 0.5, 2.0, 0.5, 10.0, 10.0, 1.0]
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0, -1.0, 1.0], dtype=torch.float64)
    new = torch.zeros(7, dtype=torch.float64, requires_grad=True)
    old = -torch.log(torch.tensor(rho, dtype=torch.float64))
    versions = torch.zeros(7, dtype=torch.long)

    def clip_frac(clip_active: ClipActive) -> float:
        stats = LossStats()
        stats.add(new, old, adv, versions, 0, clip_active)
        return stats.finalize()["clip_frac"]

    def grad(loss: torch.Tensor) -> torch.Tensor:
        (g,) = torch.autograd.grad(loss, new)
        return g

    # PPO, eps = 0.2: the clipped term is the min only for r > 1.2 with A > 0 (token 0) and
    # r < 0.8 with A < 0 (token 3); tokens 1, 2 and 5 leave [0.8, 1.2] on the side where the
    # unclipped term is the min, token 4 has A = 0.
    close(clip_frac(ppo_clip_active(0.2)), 2 / 7)
    # ... which are exactly the tokens with A != 0 that the clip deprives of their gradient.
    ppo_grad = grad(ppo_clip_loss(new, old, adv, 1, eps=0.2))
    assert ((ppo_grad == 0) & (adv != 0)).tolist() == [i in (0, 3) for i in range(7)]
    # REINFORCE-TIS, c = 5: tokens 4 and 5 have rho > 5, but with A = 0 token 4's gradient is
    # zero whatever the weight: only token 5's gradient changes.
    close(clip_frac(tis_clip_active(5.0)), 1 / 7)
    changed = grad(reinforce_tis_loss(new, old, adv, 1, clip_c=5.0)) != grad(
        reinforce_tis_loss(new, old, adv, 1, clip_c=math.inf))
    assert changed.tolist() == [i == 5 for i in range(7)]


def test_lag_and_lag0_mismatch() -> None:
    # trainer at version 5; tokens from versions (5, 5, 3, 1) -> lags (0, 0, 2, 4)
    # new - old = (0.1, -0.3, 1.0, -2.0): the lag-0 tokens differ only numerically
    old = torch.tensor([-1.0, -1.0, -1.0, -1.0], dtype=torch.float64)
    new = old + torch.tensor([0.1, -0.3, 1.0, -2.0], dtype=torch.float64)
    stats = LossStats()
    stats.add(new[:2], old[:2], old[:2], torch.tensor([5, 5]), trainer_version=5)
    stats.add(new[2:], old[2:], old[2:], torch.tensor([3, 1]), trainer_version=5)
    m = stats.finalize()
    close(m["lag_mean"], (0 + 0 + 2 + 4) / 4)
    close(m["lag_max"], 4.0)
    close(m["lag0_tokens"], 2.0)
    close(m["mismatch_abs"], (0.1 + 0.3 + 1.0 + 2.0) / 4)
    close(m["mismatch_abs_lag0"], (0.1 + 0.3) / 2)

    def k3(d: float) -> float:  # exp(new - old) - (new - old) - 1
        return math.exp(d) - d - 1

    # k3(0.1) = 1.1051709 - 1.1 = 0.0051709;  k3(-0.3) = 0.7408182 - 0.7 = 0.0408182
    close(m["mismatch_k3_lag0"], (k3(0.1) + k3(-0.3)) / 2)
    close(m["mismatch_k3_lag0"], 0.0229946, tol=1e-7)
    close(m["mismatch_k3"], (k3(0.1) + k3(-0.3) + k3(1.0) + k3(-2.0)) / 4)


def test_stats_mask_and_empty() -> None:
    stats = LossStats()
    assert stats.finalize() == {"tokens": 0.0}
    lp = torch.tensor([-1.0, -2.0])
    stats.add(lp, lp - 5.0, lp, torch.tensor([0, 2]), 3, mask=torch.tensor([False, False]))
    assert stats.finalize() == {"tokens": 0.0}
    stats.add(lp, lp, lp, torch.tensor([0, 2]), 3, mask=torch.tensor([False, True]))
    m = stats.finalize()
    assert m["tokens"] == 1.0 and m["lag_max"] == 1.0 and "mismatch_abs_lag0" not in m
