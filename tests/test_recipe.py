"""Recipe options (trainer.lr_schedule, trainer.loss.*, trainer.advantage.baseline)
against numbers worked out by hand.

Every option is off by default; the defaults reproduce the paper's loss and a constant lr.
"""

from __future__ import annotations

import io
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from ranks import run_ranks
from tiny_models import VOCAB, reference_truncation, tiny_hf_model

from pipelinerl.config import (
    ActorConfig,
    AdvantageConfig,
    Config,
    ConfigError,
    LossConfig,
    TrainerConfig,
    load_config,
)
from pipelinerl.rl.advantages import group_advantages, groups_advantages, zero_variance
from pipelinerl.rl.losses import (
    gspo_loss,
    importance_mask,
    ppo_clip_active,
    ppo_clip_loss,
    reference_k3,
    reinforce_tis_loss,
)
from pipelinerl.rl.packing import pack, pad
from pipelinerl.rl.schedule import LrFactor, make_scheduler
from pipelinerl.rl.scores import _SelectedLogprobs, score_tokens
from pipelinerl.rl.step import _sequence_ess, rl_step
from pipelinerl.types import Group, Sample

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
    assert (loss.kl_coef, loss.entropy_coef, loss.ess_lr_scale) == (0.0, 0.0, False)
    assert (loss.truncated, loss.truncated_reward) == ("keep", 0.0)
    assert (AdvantageConfig().baseline, AdvantageConfig().std_normalize) == ("mean", False)
    assert ActorConfig().drop_zero_variance is False
    assert (tc.lr_schedule, tc.warmup_steps) == ("constant", 0)
    assert [LrFactor("constant", 0, 10)(s) for s in range(12)] == [1.0] * 12


# ---- lr warm-up and schedule ------------------------------------------------------------


def test_lr_factor_by_hand() -> None:
    # W = 2 warm-up steps of max_steps = 6: steps 0, 1 get 1/2, 2/2; then p = (s - 2) / 4.
    assert [LrFactor("constant", 2, 6)(s) for s in range(6)] == [0.5, 1, 1, 1, 1, 1]
    # linear: 1 - p = 1, 0.75, 0.5, 0.25 at s = 2..5; 0 at s = 6 (never taken) and after.
    close([LrFactor("linear", 2, 6)(s) for s in range(8)], [0.5, 1, 1, 0.75, 0.5, 0.25, 0, 0])
    # cosine: (1 + cos(pi p)) / 2 = 1, (1 + 0.7071068) / 2, 0.5, (1 - 0.7071068) / 2, 0
    close([LrFactor("cosine", 2, 6)(s) for s in range(7)],
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
    from pipelinerl.roles.trainer import Trainer

    def fake_rl_step(model, optimizer, groups, cfg, trainer_version, num_sequences=None,
                     ref_model=None, keep_groups=0):
        optimizer.step()
        return {"input_tokens": 0, "samples": num_sequences, "lr": optimizer.param_groups[0]["lr"]}

    monkeypatch.setattr("pipelinerl.roles.trainer.rl_step", fake_rl_step)
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


def branched_group() -> Group:
    """random_groups' group 1 (4 attempts, one sample each), but its episode 0 branched (as a
    verifiers trace can): a second sample of that episode, with its reward: 5 samples."""
    group = random_groups()[1]
    first = group.samples[0]
    branch = replace(first, prompt_ids=first.prompt_ids + first.token_ids[:2],
                     token_ids=[(t + 1) % VOCAB for t in first.token_ids])
    group.samples = [replace(s, episode=i) for i, s in enumerate(group.samples)]
    group.samples.append(replace(branch, episode=0))
    return group


class _Source(SimpleNamespace):
    """What `TrainerRun.train` reads of rank 0's stream source besides the groups."""

    def __init__(self) -> None:
        super().__init__(wait_s=0.0, dropped={}, actor_stats={})

    def take_dropped_ids(self) -> dict[str, list[str]]:
        return {}


def test_a_step_with_a_branched_episode_divides_by_and_counts_every_branch() -> None:
    """trainer.batch_size is 4 samples, the step holds 5 (an episode's two branches): the
    sum_per_sequence loss divides by 5 and samples_trained counts 5."""
    from pipelinerl.roles.trainer import Trainer, TrainerRun, progress_bar
    from pipelinerl.run.trainer_records import TrainerRecords

    group = branched_group()
    cfg = load_config(overrides=[f"actor.group_size={GROUP}", f"trainer.batch_size={GROUP}",
                                 "trainer.max_steps=1", "trainer.grad_clip=1e9"])
    reference = tiny_hf_model("qwen2", seed=1).train()
    expected = rl_step(reference, torch.optim.SGD(reference.parameters(), lr=0.0), [group], cfg,
                       0, num_sequences=5)["loss"]
    model = tiny_hf_model("qwen2", seed=1).train()
    records: list[dict] = []
    run = TrainerRun(cfg=cfg, rank=0, world=1, device="cpu", model=model, sharded=False,
                     trainer=Trainer(cfg, model, source=_Source(), sender=None), tokenizer=None,
                     due=lambda step: False, bar=progress_bar(cfg, enabled=False),
                     batches=iter([[group]]),
                     records=TrainerRecords(
                         SimpleNamespace(log=lambda step, record: records.append(record)),
                         io.StringIO()),
                     control=None, evals=None)
    run.train()
    (record,) = records
    assert record["samples_trained"] == 5
    close(record["loss"], expected, tol=1e-6)
    assert record["samples"] == 5


def test_is_mask_through_the_step() -> None:
    """The step's gradient with is_mask equals the masked loss computed in one piece."""
    groups = random_groups()
    samples = [s for grp in groups for s in grp.samples]
    model = tiny_hf_model("qwen2", seed=1).train()
    (batch,) = pad(samples, groups_advantages(groups, "mean", False))
    new = score_tokens(model, batch, 1.0).logprobs
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


# ---- a model with fixed logits, for gradients worked out by hand ------------------------

LN2, LN3 = math.log(2), math.log(3)


class FixedLogits(torch.nn.Module):
    """Logits at grid column c are table[c], whatever the input: log-probs, entropies and their
    gradients (with respect to the table) can be written down."""

    def __init__(self, rows: list[list[float]]) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.tensor(rows, dtype=torch.float32))

    def forward(self, input_ids: torch.Tensor, logits_to_keep: torch.Tensor,
                **_: object) -> SimpleNamespace:
        return SimpleNamespace(logits=self.table[logits_to_keep][None])


def sample(tokens: list[int], old: list[float], reward: float = 0.0, finish: str = "stop"
           ) -> Sample:
    """Prompt [0]; completion token j is predicted at grid column j (of its own row)."""
    return Sample([0], tokens, old, [0] * len(tokens), reward, reward > 0, finish)


def fixed_step(model: torch.nn.Module, samples: list[Sample], *overrides: str,
               lr: float = 0.0, ref_model: torch.nn.Module | None = None) -> dict:
    """rl_step on one group of `samples` with SGD at `lr` (0: the gradient stays in .grad)."""
    n = len(samples)
    cfg = load_config(overrides=[f"actor.group_size={n}", f"trainer.batch_size={n}", *overrides])
    return rl_step(model, torch.optim.SGD(model.parameters(), lr=lr),
                   [Group("g", "p", samples)], cfg, 0, ref_model=ref_model)


# ---- KL penalty to the reference model --------------------------------------------------


def test_reference_k3_by_hand() -> None:
    # new = log 1/2, ref = log 1/4: d = ref - new = -ln 2, k3 = 1/2 + ln 2 - 1 = 0.1931472,
    #   dk3/dnew = 1 - exp(d) = 1/2
    # new = log 1/4, ref = log 1/2: d = ln 2, k3 = 2 - ln 2 - 1 = 0.3068528, dk3/dnew = 1 - 2
    new = torch.tensor([math.log(0.5), math.log(0.25)], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([math.log(0.25), math.log(0.5)], dtype=torch.float64, requires_grad=True)
    k3 = reference_k3(new, ref)
    close(k3, [0.1931472, 0.3068528], tol=1e-7)
    k3.sum().backward()
    close(new.grad, [0.5, -1.0])
    assert ref.grad is None  # the reference is a constant
    close(reference_k3(new, new), [0.0, 0.0])


def test_kl_penalty_through_the_step_by_hand() -> None:
    # One sample, group of 1: A = 0, so the gradient is the penalty's alone. The policy's
    # logits (0, 0) give p(1) = 1/2; the reference's (0, ln 3) give 3/4:
    #   d = ln(3/4) - ln(1/2) = ln 1.5 = 0.4054651, k3 = 1.5 - 0.4054651 - 1 = 0.0945349
    #   dk3/dnew = 1 - 1.5 = -0.5; dnew/dlogits = onehot(1) - p = (-0.5, 0.5)
    #   loss = 0.1 * k3 / B(1) = 0.00945349; grad = 0.1 * -0.5 * (-0.5, 0.5) = (0.025, -0.025)
    model, ref = FixedLogits([[0.0, 0.0]]), FixedLogits([[0.0, LN3]])
    m = fixed_step(model, [sample([1], [math.log(0.5)])], "trainer.loss.kl_coef=0.1",
                   ref_model=ref)
    close(m["kl_ref"], 0.0945349, tol=1e-6)
    close(m["loss"], 0.00945349, tol=1e-7)
    close(model.table.grad, [[0.025, -0.025]])
    assert ref.table.grad is None
    # The starting model as its own reference: k3 = 0 and no gradient.
    m = fixed_step(model, [sample([1], [math.log(0.5)])], "trainer.loss.kl_coef=0.1",
                   ref_model=FixedLogits([[0.0, 0.0]]))
    close(m["kl_ref"], 0.0)
    close(model.table.grad, [[0.0, 0.0]])
    assert "kl_ref" not in fixed_step(model, [sample([1], [math.log(0.5)])])
    with pytest.raises(ValueError, match="kl_coef"):
        fixed_step(model, [sample([1], [math.log(0.5)])], "trainer.loss.kl_coef=0.1")


def test_trainer_loads_the_reference_only_when_used(monkeypatch) -> None:
    from pipelinerl.roles.trainer import Trainer

    loaded: list[tuple] = []

    def fake_load_model(path, dtype, device):
        loaded.append((path, dtype, device))
        return torch.nn.Linear(1, 1).train()

    seen: list[torch.nn.Module | None] = []

    def fake_rl_step(model, optimizer, groups, cfg, trainer_version, num_sequences=None,
                     ref_model=None, keep_groups=0):
        seen.append(ref_model)
        optimizer.step()
        return {"input_tokens": 0, "samples": num_sequences}

    monkeypatch.setattr("pipelinerl.roles.trainer.load_model", fake_load_model)
    monkeypatch.setattr("pipelinerl.roles.trainer.rl_step", fake_rl_step)
    off = Trainer(load_config(overrides=["model.path=start"]), torch.nn.Linear(1, 1), None, None)
    assert off.ref_model is None and loaded == []
    # masked_row: the stand-in reference (a Linear) has no attention to set.
    on = Trainer(load_config(overrides=["model.path=start", "trainer.loss.kl_coef=0.05",
                                        "trainer.packed_attention=masked_row"]),
                 torch.nn.Linear(1, 1), None, None)
    assert loaded == [("start", torch.float32, torch.device("cpu"))]
    assert not on.ref_model.training
    assert not any(p.requires_grad for p in on.ref_model.parameters())
    on.train_step([], num_sequences=1)
    off.train_step([], num_sequences=1)
    assert seen == [on.ref_model, None]


# ---- entropy bonus ----------------------------------------------------------------------

# Logits (0, ln 3): p = (1/4, 3/4), H = 1/4 ln 4 + 3/4 ln(4/3) = 0.5623351;
# dH/dx = -p (log p + H) = (-1/4 (-1.3862944 + 0.5623351), -3/4 (-0.2876821 + 0.5623351))
#       = (0.2059898, -0.2059898). Uniform (0, 0): H = ln 2 and dH/dx = -1/2 (-ln 2 + ln 2) = 0.
H_QUARTER, DH_QUARTER = 0.5623351, 0.2059898


@pytest.mark.parametrize("chunk_tokens", [None, 1])  # plain autograd, and the chunked function
def test_entropy_gradient_by_hand(chunk_tokens: int | None) -> None:
    model = FixedLogits([[0.0, LN3], [0.0, 0.0]])
    (batch,) = pack([sample([1, 0], [0.0, 0.0])], [1.0], max_tokens_per_row=16)
    scores = score_tokens(model, batch, chunk_tokens=chunk_tokens, entropy_grad=True)
    close(scores.entropy, [H_QUARTER, LN2], tol=1e-6)
    scores.entropy.sum().backward()
    close(model.table.grad, [[DH_QUARTER, -DH_QUARTER], [0.0, 0.0]], tol=1e-6)


@pytest.mark.parametrize("chunk_tokens", [None, 2])
def test_default_entropy_stays_graph_free_and_log_prob_gradient_unchanged(
        chunk_tokens: int | None) -> None:
    model = FixedLogits([[0.0, LN3, -1.0], [0.5, 0.0, 2.0], [1.0, -2.0, 0.0]])
    (batch,) = pack([sample([1, 0, 2], [0.0] * 3)], [1.0], max_tokens_per_row=16)
    grads, entropies = [], []
    for entropy_grad in (False, True):
        model.zero_grad()
        scores = score_tokens(model, batch, chunk_tokens=chunk_tokens, entropy_grad=entropy_grad)
        assert scores.entropy.requires_grad == entropy_grad
        scores.logprobs.sum().backward()
        grads.append(model.table.grad.clone())
        entropies.append(scores.entropy.detach())
    # Asking for the entropy's gradient changes neither the values nor the log-probs' gradient.
    torch.testing.assert_close(entropies[1], entropies[0], atol=1e-7, rtol=0)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-7, rtol=0)


@pytest.mark.parametrize("truncation", [None, (3, 1.0), (0, 0.7), (4, 0.6)])
def test_chunked_entropy_gradient_matches_autograd(truncation: tuple[int, float] | None) -> None:
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 11, generator=g, dtype=torch.float64, requires_grad=True)
    rows = torch.tensor([5, 0, 3, 6, 2])
    targets = torch.tensor([1, 10, 0, 4, 4])
    w_lp, w_h = torch.randn(2, 5, generator=g, dtype=torch.float64)
    t = 0.6
    # chunk of 2 tokens forces three chunks, the last one partial
    lp, h = _SelectedLogprobs.apply(logits, rows, targets, t, 2, truncation, True)
    ((lp.double() * w_lp).sum() + (h.double() * w_h).sum()).backward()
    got = logits.grad.clone()
    logits.grad = None
    x, dropped = reference_truncation(logits[rows] / t, targets, truncation)
    log_p = torch.log_softmax(x, -1)
    want_h = -(log_p.exp() * log_p.masked_fill(dropped, 0.0)).sum(-1)
    want_lp = log_p.gather(-1, targets[:, None]).squeeze(-1)
    ((want_lp * w_lp).sum() + (want_h * w_h).sum()).backward()
    torch.testing.assert_close(h.double(), want_h.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(got, logits.grad, atol=1e-6, rtol=0)
    assert (got[rows][dropped] == 0).all()  # the kept set stays a stop-gradient choice


def test_entropy_bonus_through_the_step_by_hand() -> None:
    # Group of 1 (A = 0): loss = -0.1 * H / B(1) = -0.05623351, grad = -0.1 * dH/dx.
    model = FixedLogits([[0.0, LN3]])
    m = fixed_step(model, [sample([1], [math.log(0.75)])], "trainer.loss.entropy_coef=0.1")
    close(m["entropy"], H_QUARTER, tol=1e-6)
    close(m["loss"], -0.1 * H_QUARTER, tol=1e-7)
    close(model.table.grad, [[-0.1 * DH_QUARTER, 0.1 * DH_QUARTER]], tol=1e-7)


def test_coefficients_must_not_be_negative() -> None:
    for key in ("kl_coef", "entropy_coef"):
        with pytest.raises(ConfigError, match=f"trainer.loss.{key}"):
            load_config(overrides=[f"trainer.loss.{key}=-0.1"])


# ---- truncated samples ------------------------------------------------------------------


def truncated_group() -> Group:
    """Rewards (1, 0, 1, 0); sample 1 was cut at max_new_tokens."""
    finishes = ["stop", "length", "stop", "stop"]
    return Group("g", "p", [sample([1, 2], [-1.0, -1.0], r, f)
                            for r, f in zip([1.0, 0.0, 1.0, 0.0], finishes)])


def test_truncated_advantages_by_hand() -> None:
    groups = [truncated_group()]
    # keep: mean 0.5
    close(groups_advantages(groups), [0.5, -0.5, 0.5, -0.5])
    # penalty -1: rewards (1, -1, 1, 0), mean 0.25
    close(groups_advantages(groups, truncated="penalty", truncated_reward=-1.0),
          [0.75, -1.25, 0.75, -0.25])
    # mask: the baseline of (1, 1, 0) is 2/3; the masked sample gets 0
    close(groups_advantages(groups, truncated="mask"), [1 / 3, 0.0, 1 / 3, -2 / 3])
    # mask, loo: 1 - mean(1, 0) = 0.5; 0 - mean(1, 1) = -1
    close(groups_advantages(groups, "loo", truncated="mask"), [0.5, 0.0, 0.5, -1.0])


def test_truncated_mask_through_the_step() -> None:
    """mask: the step's gradient is the loss of the other samples alone, still divided by
    every sequence of the step (B = 8)."""
    groups = random_groups()
    for g in groups:
        g.samples[1] = replace(g.samples[1], finish_reason="length")
    samples = [s for g in groups for s in g.samples]
    kept = [s for s in samples if s.finish_reason == "stop"]
    adv = groups_advantages(groups, truncated="mask")
    kept_adv = adv[[i for i, s in enumerate(samples) if s.finish_reason == "stop"]]
    model = tiny_hf_model("qwen2", seed=1).train()
    (batch,) = pad(kept, kept_adv)
    new = score_tokens(model, batch, 1.0).logprobs
    reinforce_tis_loss(new, batch.old_logprobs, batch.advantages, len(samples)).backward()
    grads, m = step_grads(groups, "trainer.loss.truncated=mask")
    kept_grads, _ = step_grads(groups)
    for expected, got, keep in zip((p.grad for p in model.parameters()), grads, kept_grads):
        # fp32: packed micro-batches against one padded batch
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert max((g - k).abs().max() for g, k in zip(grads, kept_grads)) > 1e-2
    assert m["tokens"] == sum(len(s.token_ids) for s in kept)  # 56 - (5 + 6)
    assert m["tokens"] == 45


def test_zero_variance_sees_the_rewards_the_advantages_see() -> None:
    # Rewards (1, 1, 0), the last one truncated.
    group = [sample([1], [0.0], r, f) for r, f in zip([1.0, 1.0, 0.0], ["stop", "stop", "length"])]
    assert not zero_variance(group)
    assert zero_variance(group, "mask")  # (1, 1) left
    assert zero_variance(group, "penalty", 1.0)  # (1, 1, 1)
    assert not zero_variance(group, "penalty", 0.0)
    assert zero_variance([sample([1], [0.0], 1.0, "length")], "mask")  # nothing left to train


def test_truncated_config_rules() -> None:
    with pytest.raises(ConfigError, match="truncated_reward.*penalty"):
        load_config(overrides=["trainer.loss.truncated_reward=-1"])
    with pytest.raises(ConfigError, match="truncated"):
        load_config(overrides=["trainer.loss.truncated=drop"])
    cfg = load_config(overrides=["trainer.loss.truncated=penalty",
                                 "trainer.loss.truncated_reward=-1"])
    assert (cfg.trainer.loss.truncated, cfg.trainer.loss.truncated_reward) == ("penalty", -1.0)
    with pytest.raises(ConfigError, match="drop_zero_variance.*group_size"):
        load_config(overrides=["actor.drop_zero_variance=true", "actor.group_size=1",
                               "trainer.batch_size=4"])


# ---- VCPO: minimum-variance baseline, ESS-scaled lr -------------------------------------


def test_vcpo_baseline_by_hand() -> None:
    # w = (1, 2, 1/2): w^2 = (1, 4, 1/4), sum 5.25; b = 1 * 1 / 5.25 = 0.1904762
    adv = group_advantages([1.0, 0.0, 0.0], "vcpo",
                           log_weights=torch.tensor([0.0, LN2, -LN2], dtype=torch.float64))
    close(adv, [0.8095238, -0.1904762, -0.1904762], tol=1e-7)
    # log w (30, 20) are both clamped to 20: equal weights, b = mean = 0.5
    close(group_advantages([1.0, 0.0], "vcpo", log_weights=torch.tensor([30.0, 20.0])),
          [0.5, -0.5])
    # equal weights give the mean baseline; a group of 1 gets 0
    close(group_advantages([1.0, 0.0, 0.0], "vcpo", log_weights=torch.zeros(3)),
          [2 / 3, -1 / 3, -1 / 3])
    close(group_advantages([1.0], "vcpo", log_weights=torch.tensor([5.0])), [0.0])
    with pytest.raises(ValueError, match="vcpo"):
        group_advantages([1.0, 0.0], "vcpo")


def test_vcpo_baseline_through_the_step() -> None:
    """The step's gradient equals the loss with advantages from the sequences' weights under
    the weights being trained, computed in one piece."""
    groups = random_groups()
    samples = [s for g in groups for s in g.samples]
    model = tiny_hf_model("qwen2", seed=1).train()
    (batch,) = pad(samples, torch.zeros(len(samples)))
    new = score_tokens(model, batch, 1.0).logprobs
    log_w = torch.zeros(len(samples), dtype=torch.float64).index_add(
        0, batch.seq_idx, (new.detach() - batch.old_logprobs).double())
    adv = groups_advantages(groups, "vcpo", log_weights=log_w)
    assert not torch.allclose(adv, groups_advantages(groups), atol=1e-3)  # unequal weights
    batch = replace(batch, advantages=adv[batch.seq_idx])
    reinforce_tis_loss(new, batch.old_logprobs, batch.advantages, len(samples)).backward()
    grads, _ = step_grads(groups, "trainer.advantage.baseline=vcpo")
    mean_grads, _ = step_grads(groups)
    for expected, got in zip((p.grad for p in model.parameters()), grads):
        # fp32: the weights, then the gradient, from packed micro-batches against one batch
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert max((g - m).abs().max() for g, m in zip(grads, mean_grads)) > 1e-2


def test_sequence_ess_by_hand() -> None:
    # w = (1, 2): (1 + 2)^2 / (2 * (1 + 4)) = 0.9, whatever the common factor
    close(_sequence_ess(torch.tensor([0.0, LN2], dtype=torch.float64)), 0.9)
    close(_sequence_ess(torch.tensor([1000.0, 1000.0 + LN2], dtype=torch.float64)), 0.9)
    close(_sequence_ess(torch.tensor([-1000.0, -1000.0], dtype=torch.float64)), 1.0)
    close(_sequence_ess(torch.zeros(0, dtype=torch.float64)), 1.0)


def test_ess_lr_scale_through_the_step_by_hand() -> None:
    # Two one-token sequences under logits (0, 0) (p = 1/2 each), rewards (1, 0): A = +-0.5.
    # old = (log 1/2, log 1/4): w = (1, 2), ESS 0.9, lr x sqrt(0.9) = 0.9486833.
    # loss = -(1 * 0.5 * new0 + 2 * -0.5 * new1) / 2: dloss/dnew = (-0.25, 0.5);
    # dnew0/dx0 = (-0.5, 0.5), dnew1/dx1 = (0.5, -0.5): grad = ((0.125, -0.125), (0.25, -0.25))
    model = FixedLogits([[0.0, 0.0], [0.0, 0.0]])
    samples = [sample([1], [math.log(0.5)], 1.0), sample([0], [math.log(0.25)], 0.0)]
    m = fixed_step(model, samples, "trainer.loss.ess_lr_scale=true", lr=1.0)
    scale = math.sqrt(0.9)
    close(m["vcpo_lr_scale"], scale)
    close(m["lr"], 1.0)  # the schedule's lr, restored after the step
    close(model.table.grad, [[0.125, -0.125], [0.25, -0.25]])
    close(model.table.detach(), [[-0.125 * scale, 0.125 * scale], [-0.25 * scale, 0.25 * scale]])
    unscaled = FixedLogits([[0.0, 0.0], [0.0, 0.0]])
    assert "vcpo_lr_scale" not in fixed_step(unscaled, samples, lr=1.0)
    close(unscaled.table.detach(), [[-0.125, 0.125], [-0.25, 0.25]])


def _ess_rank(rank: int, world: int) -> float:
    """One of two gloo ranks of `test_sequence_ess_is_the_steps_over_every_rank`."""
    local = [torch.tensor([0.0], dtype=torch.float64),
             torch.tensor([LN2, LN2], dtype=torch.float64)][rank]
    return _sequence_ess(local)


def test_sequence_ess_is_the_steps_over_every_rank() -> None:
    # Rank 0 holds w = 1, rank 1 w = (2, 2): (1 + 4)^2 / (3 * (1 + 8)) = 25 / 27 on both.
    for ess in run_ranks(2, _ess_rank):
        close(ess, 25 / 27)


def test_vcpo_config() -> None:
    cfg = load_config(overrides=["trainer.advantage.baseline=vcpo",
                                 "trainer.loss.ess_lr_scale=true"])
    assert cfg.trainer.advantage.baseline == "vcpo" and cfg.trainer.loss.ess_lr_scale
    with pytest.raises(ConfigError, match="baseline"):
        load_config(overrides=["trainer.advantage.baseline=median"])


def _ddp_rank(rank: int, world: int) -> list[torch.Tensor]:
    """One of two gloo ranks of `test_a_rank_whose_samples_are_all_masked_joins_the_step`:
    its replica's weights after one step."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(tiny_hf_model("qwen2", seed=1).train())
    groups = random_groups()[rank:rank + 1]
    if rank == 1:  # every sample cut at max_new_tokens: nothing left to train on this rank
        groups[0].samples = [replace(x, finish_reason="length") for x in groups[0].samples]
    cfg = load_config(overrides=[f"actor.group_size={GROUP}", f"trainer.batch_size={2 * GROUP}",
                                 "trainer.loss.truncated=mask"])
    rl_step(model, torch.optim.SGD(model.parameters(), lr=1.0), groups, cfg, 0,
            num_sequences=2 * GROUP)
    return [p.detach() for p in model.module.parameters()]


@pytest.mark.slow  # two processes importing transformers
def test_a_rank_whose_samples_are_all_masked_joins_the_step() -> None:
    # Without the joining forward, rank 1 would skip DDP's all-reduce and rank 0 would wait
    # in it until the ranks' deadline failed the test.
    after = run_ranks(2, _ddp_rank, timeout_s=60)
    start = list(tiny_hf_model("qwen2", seed=1).parameters())
    moved = max((a - b).abs().max().item() for a, b in zip(after[0], start))
    assert moved > 1e-3  # rank 0's samples trained both replicas
    for a, b in zip(*after):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def _branched_step_cfg() -> Config:
    return load_config(overrides=[f"actor.group_size={GROUP}", f"trainer.batch_size={2 * GROUP}",
                                  "trainer.grad_clip=1e9"])


def _branched_rank(rank: int, world: int) -> list[torch.Tensor]:
    """One of two gloo ranks of `test_ranks_divide_by_the_samples_of_every_rank`: rank 0's
    shard is the branched group (5 samples), rank 1's a plain one (4). Its weights after."""
    model = torch.nn.parallel.DistributedDataParallel(tiny_hf_model("qwen2", seed=1).train())
    groups = [branched_group(), random_groups()[0]][rank:rank + 1]
    rl_step(model, torch.optim.SGD(model.parameters(), lr=1.0), groups, _branched_step_cfg(), 0)
    return [p.detach() for p in model.module.parameters()]


@pytest.mark.slow  # two processes importing transformers
def test_ranks_divide_by_the_samples_of_every_rank() -> None:
    """Shards of unequal sample counts (a branched episode): each rank's loss divides by the
    step's 9 samples, as one process taking the whole step does, not by its own 5 or 4."""
    after = run_ranks(2, _branched_rank, timeout_s=60)
    whole = tiny_hf_model("qwen2", seed=1).train()
    metrics = rl_step(whole, torch.optim.SGD(whole.parameters(), lr=1.0),
                      [branched_group(), random_groups()[0]], _branched_step_cfg(), 0)
    for a, b in zip(after[0], whole.parameters()):
        torch.testing.assert_close(a, b.detach(), atol=1e-5, rtol=1e-4)
    assert metrics["samples"] == 9


def test_a_non_finite_gradient_skips_the_step() -> None:
    """A NaN reaching the gradient leaves the weights and Adam's moments as they were."""
    groups = random_groups()
    model = tiny_hf_model("qwen2", seed=1).train()
    cfg = load_config(overrides=[f"actor.group_size={GROUP}", "trainer.batch_size=8"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert rl_step(model, optimizer, groups, cfg, 0)["skipped_nonfinite"] == 0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {id(p): optimizer.state[p]["exp_avg"].clone() for p in model.parameters()}
    groups[0].samples[0].logprobs[0] = float("nan")  # the behaviour log-prob: NaN ratio
    metrics = rl_step(model, optimizer, groups, cfg, 1)
    assert metrics["skipped_nonfinite"] == 1 and not math.isfinite(metrics["grad_norm"])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(torch.equal(optimizer.state[p]["exp_avg"], moments[id(p)]) for p in model.parameters())
