"""Recipe options (trainer.lr_schedule, trainer.loss.*) against numbers worked out by hand.

Every option is off by default; the defaults reproduce the paper's loss and a constant lr.
"""

from __future__ import annotations

import math

import pytest
import torch

from pipelinerl.config import ConfigError, LossConfig, TrainerConfig, load_config
from pipelinerl.rl.advantages import groups_advantages
from pipelinerl.rl.losses import (
    gspo_loss,
    importance_mask,
    ppo_clip_active,
    ppo_clip_loss,
    reinforce_tis_loss,
)
from pipelinerl.rl.packing import pad, token_logprobs
from pipelinerl.rl.schedule import lr_factor, make_scheduler
from pipelinerl.rl.step import rl_step
from pipelinerl.types import Group, Sample
from tiny_models import VOCAB, tiny_hf_model

torch.set_num_threads(1)


def close(actual: torch.Tensor | float | list[float], expected: list[float] | float,
          tol: float = 1e-6) -> None:
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), atol=tol, rtol=0)


def with_ratios(new: list[float], rho: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """new log-probs (with grad) and old ones such that exp(new - old) = rho exactly."""
    new_t = torch.tensor(new, dtype=torch.float64, requires_grad=True)
    old = torch.tensor([n - math.log(r) for n, r in zip(new, rho)], dtype=torch.float64)
    return new_t, old


def test_defaults_are_off() -> None:
    loss, tc = LossConfig(), TrainerConfig()
    assert (loss.kind, loss.aggregate, loss.is_mask) == ("reinforce", "sum_per_sequence", None)
    assert loss.eps_low == loss.eps_high == loss.ppo_eps
    assert (tc.lr_schedule, tc.warmup_steps) == ("constant", 0)
    assert [lr_factor(s, "constant", 0, 10) for s in range(12)] == [1.0] * 12


# ---- lr warm-up and schedule ------------------------------------------------------------


def test_lr_factor_by_hand() -> None:
    # W = 2 warm-up steps of max_steps = 6: steps 0, 1 get 1/2, 2/2; then p = (s - 2) / 4.
    assert [lr_factor(s, "constant", 2, 6) for s in range(6)] == [0.5, 1, 1, 1, 1, 1]
    # linear: 1 - p = 1, 0.75, 0.5, 0.25 at s = 2..5; 0 at s = 6 (never taken) and after.
    close([lr_factor(s, "linear", 2, 6) for s in range(8)], [0.5, 1, 1, 0.75, 0.5, 0.25, 0, 0])
    # cosine: (1 + cos(pi p)) / 2 = 1, (1 + 0.7071068) / 2, 0.5, (1 - 0.7071068) / 2, 0
    close([lr_factor(s, "cosine", 2, 6) for s in range(7)],
          [0.5, 1, 1, 0.8535534, 0.5, 0.1464466, 0], tol=1e-7)


def test_scheduler_sets_the_lr_of_each_optimizer_step() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.4)
    scheduler = make_scheduler(optimizer, TrainerConfig(lr=0.4, lr_schedule="linear",
                                                        warmup_steps=1, max_steps=3))
    lrs = []
    for _ in range(3):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    # step 0: warm-up 1/1; then p = (s - 1) / 2: 0 at s = 1, 0.5 at s = 2
    close(lrs, [0.4, 0.4, 0.2])


def test_trainer_steps_the_schedule_after_each_step_with_fake_rl_step(monkeypatch) -> None:
    """A fake rl_step stands in for the loss: only the trainer's lr bookkeeping is tested."""
    import pipelinerl.rl.step as step_module
    from pipelinerl.trainer import Trainer

    def fake_rl_step(model, optimizer, groups, cfg, trainer_version, num_sequences=None):
        optimizer.step()
        return {"input_tokens": 0, "lr": optimizer.param_groups[0]["lr"]}

    monkeypatch.setattr(step_module, "rl_step", fake_rl_step)
    cfg = load_config(overrides=["trainer.lr=1.0", "trainer.warmup_steps=4",
                                 "trainer.lr_schedule=cosine", "trainer.max_steps=8"])
    trainer = Trainer(cfg, torch.nn.Linear(1, 1), source=None, sender=None)
    lrs = [trainer.train_step([], num_sequences=1)["lr"] for _ in range(5)]
    close(lrs, [0.25, 0.5, 0.75, 1.0, 1.0])


def test_schedule_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="warmup_steps"):
        load_config(overrides=["trainer.warmup_steps=-1"])
    with pytest.raises(ConfigError, match="lr_schedule"):
        load_config(overrides=["trainer.lr_schedule=step"])


# ---- asymmetric PPO clipping ------------------------------------------------------------


def test_asymmetric_ppo_clip_by_hand() -> None:
    # rho = (1.25, 0.75, 1.3), A = (1, -1, 1), one sequence (normalizer 1), eps 0.2 / 0.28:
    #   t0: min(1.25, clip(1.25, 0.8, 1.28) = 1.25) = 1.25, unclipped: grad -r A = -1.25
    #   t1: min(-0.75, 0.8 * -1) = -0.8, clipped (no gradient)
    #   t2: min(1.3, 1.28) = 1.28, clipped
    new, old = with_ratios([-1.0, -2.0, -0.5], [1.25, 0.75, 1.3])
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    loss = ppo_clip_loss(new, old, adv, 1, eps=0.2, eps_high=0.28)
    close(loss, -(1.25 - 0.8 + 1.28))
    loss.backward()
    close(new.grad, [-1.25, 0.0, 0.0])
    # symmetric 0.2 clips t0 at 1.2 instead: -(1.2 - 0.8 + 1.2)
    close(ppo_clip_loss(new, old, adv, 1, eps=0.2), -1.6)
    rho = torch.tensor([1.25, 0.75, 1.3])
    assert ppo_clip_active(0.2, 0.28)(rho, adv).tolist() == [False, True, True]
    assert ppo_clip_active(0.2)(rho, adv).tolist() == [True, True, True]


def test_eps_low_high_config() -> None:
    cfg = LossConfig(kind="ppo", ppo_eps=0.2, ppo_eps_high=0.28)
    assert (cfg.eps_low, cfg.eps_high) == (0.2, 0.28)
    with pytest.raises(ConfigError, match="ppo_eps_low"):
        load_config(overrides=["trainer.loss.ppo_eps_low=0"])


# ---- masked importance sampling ---------------------------------------------------------


def test_importance_mask_by_hand() -> None:
    # rho = (2, 10, 0.5), A = (1, 1, -2), B = 2, is_mask [0.6, 3]: only token 0 is kept.
    new, old = with_ratios([-1.0, -2.0, -0.5], [2.0, 10.0, 0.5])
    adv = torch.tensor([1.0, 1.0, -2.0], dtype=torch.float64)
    mask = importance_mask(new, old, 0.6, 3.0)
    assert mask.tolist() == [True, False, False]
    loss = reinforce_tis_loss(new, old, adv, 2, clip_c=5.0, mask=mask)
    # J = min(2, 5) * 1 * (-1) = -2;  loss = 2 / 2 = 1;  grad = (-2 * 1 / 2, 0, 0)
    close(loss, 1.0)
    loss.backward()
    close(new.grad, [-1.0, 0.0, 0.0])


@pytest.mark.parametrize("bounds", [[1.0, 2.0], [0.5, 0.9], [-0.1, 2.0], [2.0, 0.5]])
def test_is_mask_must_keep_on_policy_tokens(bounds: list[float]) -> None:
    with pytest.raises(ConfigError, match="is_mask"):
        load_config(overrides=[f"trainer.loss.is_mask={bounds}"])


# ---- GSPO -------------------------------------------------------------------------------


def test_gspo_by_hand() -> None:
    # Three sequences (ids 5, 2, 7, in token order), B = 3, eps = 0.2:
    #   seq 5: log rho = (log 2, 0), A = +1: s = exp(log 2 / 2) = 1.4142 > 1.2: clipped, 1.2
    #   seq 2: log rho = (log 1.1, 0), A = +1: s = sqrt(1.1) = 1.0488088, unclipped;
    #          d(-s A / B)/d new_t = -s A / (2 B) = -1.0488088 / 6 = -0.1748015 per token
    #   seq 7: log rho = log 0.9, A = -2: s = 0.9, min(-1.8, 0.9 * -2) = -1.8, unclipped;
    #          grad -s A / B = 1.8 / 3 = 0.6
    # loss = -(1.2 + 1.0488088 - 1.8) / 3 = -0.1496029
    new, old = with_ratios([-1.0, -0.5, -2.0, -0.3, -0.7], [2.0, 1.0, 1.1, 1.0, 0.9])
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, -2.0], dtype=torch.float64)
    seq = torch.tensor([5, 5, 2, 2, 7])
    loss = gspo_loss(new, old, adv, seq, 3, eps=0.2)
    close(loss, -0.1496029, tol=1e-7)
    loss.backward()
    close(new.grad, [0.0, 0.0, -0.1748015, -0.1748015, 0.6], tol=1e-7)
    # Token-level PPO differs: token (log 2) alone is clipped at 1.2, token 0 of seq 5 is not.
    assert not torch.isclose(ppo_clip_loss(new, old, adv, 3), loss)


def test_gspo_mask_drops_tokens_from_the_sequence_mean() -> None:
    # seq 2's second token masked: s = exp(log 1.1 / 1) = 1.1, unclipped; grad -1.1 / 1.
    new, old = with_ratios([-2.0, -0.3], [1.1, 1.0])
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    loss = gspo_loss(new, old, adv, torch.tensor([2, 2]), 1, mask=torch.tensor([True, False]))
    close(loss, -1.1)
    loss.backward()
    close(new.grad, [-1.1, 0.0])


def test_gspo_config_rules() -> None:
    with pytest.raises(ConfigError, match="sum_per_sequence"):
        load_config(overrides=["trainer.loss.kind=gspo", "trainer.loss.aggregate=token_mean"])
    with pytest.raises(ConfigError, match="is_mask"):
        load_config(overrides=["trainer.loss.kind=gspo", "trainer.loss.is_mask=[0.5, 2]"])


# ---- the step: token_mean's normaliser, options wired through rl_step --------------------

GROUP = 4


def random_groups(n_groups: int = 2) -> list[Group]:
    """Random prompts and completions of different lengths with made-up engine log-probs."""
    g = torch.Generator().manual_seed(3)
    groups = []
    for p in range(n_groups):
        prompt = torch.randint(0, VOCAB, (3,), generator=g).tolist()
        samples = []
        for j in range(GROUP):
            n = 2 + 3 * j + p
            tokens = torch.randint(0, VOCAB, (n,), generator=g).tolist()
            old = (-3.0 + 0.8 * torch.randn(n, generator=g)).tolist()
            reward = float(j % 2)
            samples.append(Sample(prompt, tokens, old, [0] * n, reward, reward > 0, "stop",
                                  group_id=str(p)))
        groups.append(Group(str(p), "prompt", samples))
    return groups


def step_grads(groups: list[Group], *overrides: str) -> tuple[list[torch.Tensor], dict]:
    """rl_step's gradient (SGD at lr 0 leaves it in .grad) with tiny micro-batches."""
    model = tiny_hf_model("qwen2", seed=1).train()
    cfg = load_config(overrides=[f"actor.group_size={GROUP}", "trainer.batch_size=8",
                                 "trainer.max_tokens_per_row=24", "trainer.grad_clip=1e9",
                                 *overrides])
    metrics = rl_step(model, torch.optim.SGD(model.parameters(), lr=0.0), groups, cfg, 0)
    return [p.grad.clone() for p in model.parameters()], metrics


def test_token_mean_divides_by_the_steps_trained_tokens() -> None:
    groups = random_groups()
    samples = [s for grp in groups for s in grp.samples]
    tokens = sum(len(s.token_ids) for s in samples)  # 2+5+8+11 + 3+6+9+12 = 56
    assert tokens == 56
    per_seq, m_seq = step_grads(groups)
    per_token, m_tok = step_grads(groups, "trainer.loss.aggregate=token_mean")
    assert m_tok["tokens"] == tokens
    # Several micro-batches: a per-micro-batch token count would break the ratio below.
    assert m_tok["input_tokens"] > 24
    for a, b in zip(per_seq, per_token):
        torch.testing.assert_close(b, a * len(samples) / tokens, atol=1e-6, rtol=1e-4)  # fp32
    close(m_tok["loss"], m_seq["loss"] * len(samples) / tokens, tol=1e-6)


def test_is_mask_through_the_step() -> None:
    """The step's gradient with is_mask equals the masked loss computed in one piece."""
    groups = random_groups()
    samples = [s for grp in groups for s in grp.samples]
    model = tiny_hf_model("qwen2", seed=1).train()
    (batch,) = pad(samples, groups_advantages(groups, "mean", False))
    new = token_logprobs(model, batch, 1.0)
    keep = importance_mask(new, batch.old_logprobs, 0.5, 2.0)
    assert 0 < (~keep).sum() < keep.numel()  # the made-up log-probs put tokens on both sides
    reinforce_tis_loss(new, batch.old_logprobs, batch.advantages, len(samples), mask=keep).backward()
    grads, m = step_grads(groups, "trainer.loss.is_mask=[0.5, 2.0]")
    for expected, got in zip((p.grad for p in model.parameters()), grads):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-4)
    close(m["is_mask_frac"], (~keep).sum().item() / keep.numel())
    _, m_off = step_grads(groups)
    assert "is_mask_frac" not in m_off


def test_gspo_and_asymmetric_ppo_run_through_the_step() -> None:
    groups = random_groups()
    for kind in ("gspo", "ppo"):
        grads, m = step_grads(groups, f"trainer.loss.kind={kind}", "trainer.loss.ppo_eps_high=0.28")
        assert math.isfinite(m["loss"]) and any(g.abs().sum() > 0 for g in grads)
