"""Advantages, losses and off-policy metrics against numbers worked out by hand."""

import math

import pytest
import torch
from ranks import run_ranks

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
    loss = reinforce_tis_loss(new, old, adv, normalizer=2, clip_c=5.0)
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
    loss = reinforce_tis_loss(new, old, adv, normalizer=2, mask=mask)
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
    loss = ppo_clip_loss(new, old, adv, normalizer=3, eps=0.2)
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


def test_lag0_mismatch_counts_only_tokens_whose_context_one_version_computed() -> None:
    """Under a KV cache kept across an update, a token sampled by the trainer's version may
    sit on K/V an older version computed: it differs from the trainer by more than numerics,
    and is left out of the lag-0 mismatch (still lag 0 in lag_hist)."""
    old = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64)
    new = old + torch.tensor([1e-6, 0.2, 0.3], dtype=torch.float64)
    stats = LossStats()
    stats.add(new, old, old, torch.tensor([5, 5, 5]), trainer_version=5,
              context_versions=torch.tensor([5, 4, 3]))
    m = stats.finalize()
    close(m["lag0_tokens"], 1.0)
    close(m["mismatch_abs_lag0"], 1e-6)
    assert m["lag_hist"] == {"0": 3}


def test_stats_mask_and_empty() -> None:
    stats = LossStats()
    assert stats.finalize() == {"tokens": 0.0}
    lp = torch.tensor([-1.0, -2.0])
    stats.add(lp, lp - 5.0, lp, torch.tensor([0, 2]), 3, mask=torch.tensor([False, False]))
    assert stats.finalize() == {"tokens": 0.0}
    stats.add(lp, lp, lp, torch.tensor([0, 2]), 3, mask=torch.tensor([False, True]))
    m = stats.finalize()
    assert m["tokens"] == 1.0 and m["lag_max"] == 1.0 and "mismatch_abs_lag0" not in m


# ---- off-policy health panel ------------------------------------------------------------


def test_kl_k1_and_k3_on_known_logprobs() -> None:
    # log rho = new - old = (0.5, -1.0)
    # k1 = -log rho = (-0.5, 1.0): mean 0.25
    # k3 = rho - 1 - log rho = (e^0.5 - 1.5, e^-1 - 1 + 1) = (0.1487213, 0.3678794): mean 0.2583003
    old = torch.tensor([-2.0, -0.5], dtype=torch.float64)
    new = old + torch.tensor([0.5, -1.0], dtype=torch.float64)
    stats = LossStats()
    stats.add(new, old, torch.zeros(2), torch.tensor([0, 0]), trainer_version=0)
    m = stats.finalize()
    close(m["kl_k1"], 0.25)
    close(m["mismatch_k3"], 0.2583003, tol=1e-7)


def test_lag_histogram_counts_tokens_per_lag_across_micro_batches() -> None:
    # trainer at 5; versions (5, 5, 3) then (1, 6, 3) -> lags (0, 0, 2) then (4, -1, 2)
    stats = LossStats()
    lp = torch.zeros(3)
    stats.add(lp, lp, lp, torch.tensor([5, 5, 3]), trainer_version=5)
    stats.add(lp, lp, lp, torch.tensor([1, 6, 3]), trainer_version=5)
    m = stats.finalize()
    # -1 (a provenance bug) is counted, not hidden; keys are strings, JSON's key type.
    assert m["lag_hist"] == {"-1": 1, "0": 2, "2": 2, "4": 1}
    assert m["lag_max"] == 4.0
    close(m["lag_mean"], (0 + 0 + 2 + 4 - 1 + 2) / 6)


def test_lag_max_negative_when_every_token_is_from_the_future() -> None:
    stats = LossStats()
    stats.add(torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.tensor([7, 8]), 5)
    assert stats.finalize()["lag_max"] == -2.0


def test_entropy_mean_over_unmasked_tokens_and_absent_when_not_given() -> None:
    lp = torch.zeros(3)
    stats = LossStats()
    stats.add(lp, lp, lp, torch.zeros(3, dtype=torch.long), 0,
              mask=torch.tensor([True, False, True]), entropy=torch.tensor([1.0, 2.0, 4.0]))
    stats.add(lp[:1], lp[:1], lp[:1], torch.zeros(1, dtype=torch.long), 0,
              entropy=torch.tensor([0.5]))
    close(stats.finalize()["entropy"], (1.0 + 4.0 + 0.5) / 3)
    no_entropy = LossStats()
    no_entropy.add(lp, lp, lp, torch.zeros(3, dtype=torch.long), 0)
    assert "entropy" not in no_entropy.finalize()


class _FixedLogitsModel(torch.nn.Module):
    """A fake causal LM: the logits at input position p are row p of a fixed table."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids: torch.Tensor, logits_to_keep: torch.Tensor,
                **_: object) -> object:
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.table[logits_to_keep][None])


@pytest.mark.parametrize("chunk_tokens", [None, 1])  # plain autograd, and the chunked function
def test_entropy_of_known_distributions_with_fake_model(chunk_tokens: int | None) -> None:
    from pipelinerl.rl.packing import pack
    from pipelinerl.rl.scores import score_tokens

    ln2 = math.log(2)
    # Position 0: probabilities (1/2, 1/4, 1/8, 1/8); position 1: uniform over 4.
    table = torch.tensor([[math.log(p) for p in (0.5, 0.25, 0.125, 0.125)], [0.0] * 4])
    model = _FixedLogitsModel(table)
    sample = Sample(prompt_ids=[0], token_ids=[1, 2], logprobs=[0.0, 0.0], versions=[0, 0],
                    reward=0.0, success=False, finish_reason="stop")
    (batch,) = pack([sample], [1.0], max_tokens_per_row=16)

    def entropy(**kw: object) -> list[float]:
        scores = score_tokens(model, batch, chunk_tokens=chunk_tokens, **kw)
        assert scores.logprobs.requires_grad and not scores.entropy.requires_grad
        return scores.entropy.tolist()

    # H = 1/2 ln 2 + 1/4 ln 4 + 2/8 ln 8 = 1.75 ln 2 = 1.2130076; uniform: ln 4 = 1.3862944
    close(entropy(), [1.75 * ln2, 2 * ln2])
    close(entropy(), [1.2130076, 1.3862944], tol=1e-6)
    # Top-2 keeps (1/2, 1/4) renormalised to (2/3, 1/3): H = ln 3 - 2/3 ln 2 = 0.6365142.
    # The uniform row ties at the boundary, so all 4 stay (engine.sampling): still ln 4.
    close(entropy(top_k=2), [math.log(3) - 2 / 3 * ln2, 2 * ln2])
    # Temperature 2 turns p into sqrt(p) renormalised.
    q = [math.sqrt(p) for p in (0.5, 0.25, 0.125, 0.125)]
    q = [x / sum(q) for x in q]
    close(entropy(temperature=2.0), [-sum(x * math.log(x) for x in q), 2 * ln2])
    # Top-p 0.5 keeps token 0 only, but the sampled token 1 always stays (`_keep_sampled`):
    # scored under (2/3, 1/3) again. The uniform row keeps its tie: ln 4.
    close(entropy(top_p=0.5), [math.log(3) - 2 / 3 * ln2, 2 * ln2])


def _reduce_rank(rank: int, world: int) -> tuple[dict, dict]:
    """One of two gloo ranks of `test_reduce_over_two_ranks_equals_one_rank_with_all_tokens`."""
    from pipelinerl.rl.step import _reduce

    stats = LossStats()
    new, old, ver, ent = _two_rank_tokens()[rank]
    bins = _two_rank_bins()[rank]
    stats.count_sequences(bins.unique())
    stats.add(new, old, torch.tensor([1.0, -1.0, 0.5])[: len(new)], ver, 5, entropy=ent,
              bins=bins)
    out, totals = _reduce(stats, {"loss": float(rank + 1)}, torch.device("cpu"))
    return out.finalize(), totals


def _two_rank_bins() -> list[torch.Tensor]:
    """Per rank, each token's length bin: a bin on one rank only, one on both."""
    return [torch.tensor([0, 0, 2]), torch.tensor([5, 0])]


def _two_rank_tokens() -> list[tuple[torch.Tensor, ...]]:
    """Per rank: new, old log-probs, versions (trainer at 5), entropy; different lag ranges."""
    return [
        (torch.tensor([-1.0, -0.5, -2.0]), torch.tensor([-1.2, -0.5, -1.0]),
         torch.tensor([5, 4, 4]), torch.tensor([0.3, 1.2, 0.9])),
        (torch.tensor([-0.1, -3.0]), torch.tensor([-0.4, -2.5]),
         torch.tensor([2, 6]), torch.tensor([2.0, 0.1])),
    ]


def test_reduce_over_two_ranks_equals_one_rank_with_all_tokens() -> None:
    results = run_ranks(2, _reduce_rank)
    whole = LossStats()
    for (new, old, ver, ent), bins in zip(_two_rank_tokens(), _two_rank_bins()):
        whole.count_sequences(bins.unique())
        whole.add(new, old, torch.tensor([1.0, -1.0, 0.5])[: len(new)], ver, 5, entropy=ent,
                  bins=bins)
    expected = whole.finalize()
    assert expected["lag_hist"] == {"-1": 1, "0": 1, "1": 2, "3": 1}
    assert {k: v["sequences"] for k, v in expected["by_length"].items()} == {
        "1-31": 2, "64-127": 1, "512+": 1}
    for stats, totals in results:
        assert totals == {"loss": 3.0}
        assert stats["lag_hist"] == expected["lag_hist"]
        assert set(stats) == set(expected)
        assert set(stats["by_length"]) == set(expected["by_length"])
        for label, values in expected["by_length"].items():
            for key, value in values.items():
                close(stats["by_length"][label][key], value, tol=1e-6)
        for key, value in expected.items():
            if key not in ("lag_hist", "by_length"):
                close(stats[key], value, tol=1e-6)


def test_by_length_metrics_equal_the_step_metrics_of_each_bins_tokens_alone() -> None:
    from pipelinerl.rl.losses import length_bins

    torch.manual_seed(0)
    lengths = torch.tensor([3, 40, 40, 300, 700])  # bins 1-31, 32-63 (two), 256-511, 512+
    seq = torch.repeat_interleave(torch.arange(5), lengths)
    bins = length_bins(lengths)
    assert bins.tolist() == [0, 1, 1, 4, 5]
    new, old = torch.randn(len(seq)) * 0.1, torch.randn(len(seq)) * 0.1
    versions = 9 - seq  # lag = the sequence's index, trainer at 9
    mask = torch.rand(len(seq)) > 0.2
    stats = LossStats()
    stats.count_sequences(bins)
    half = len(seq) // 2  # two micro-batches
    for part in (slice(0, half), slice(half, None)):
        stats.add(new[part], old[part], torch.ones(len(seq))[part], versions[part], 9,
                  mask=mask[part], bins=bins[seq][part])
    by_length = stats.finalize()["by_length"]
    assert list(by_length) == ["1-31", "32-63", "256-511", "512+"]
    for b, label in ((0, "1-31"), (1, "32-63"), (4, "256-511"), (5, "512+")):
        alone = LossStats()
        keep = mask & (bins[seq] == b)
        alone.add(new[keep], old[keep], torch.ones(int(keep.sum())), versions[keep], 9)
        m = alone.finalize()
        assert by_length[label]["sequences"] == (bins == b).sum()
        assert by_length[label]["tokens"] == keep.sum()
        close(by_length[label]["ess"], m["ess"], tol=1e-9)
        close(by_length[label]["lag_mean"], m["lag_mean"], tol=1e-9)


def test_completion_stats_truncated_fraction() -> None:
    from pipelinerl.roles.trainer import completion_stats

    def sample(n: int, finish: str) -> Sample:
        return Sample(prompt_ids=[0], token_ids=[1] * n, logprobs=[0.0] * n, versions=[0] * n,
                      reward=0.0, success=False, finish_reason=finish)

    # 2 of 5 hit max_new_tokens (finish_reason "length")
    m = completion_stats([sample(8, "length"), sample(3, "stop"), sample(8, "length"),
                          sample(1, "stop"), sample(5, "stop")])
    assert m == {"completion_len_mean": 5.0, "completion_len_max": 8,
                 "completion_truncated_frac": 0.4}


def test_progress_bar_counts_seconds_under_max_time_s() -> None:
    from pipelinerl.config import load_config
    from pipelinerl.roles.trainer import advance_progress, progress_bar

    timed = load_config(None, ["trainer.max_time_s=600", "trainer.max_steps=100000"])
    bar = progress_bar(timed, enabled=True)
    assert (bar.total, bar.unit) == (600, "s")
    advance_progress(bar, timed, 12.4)
    assert bar.n == 12
    advance_progress(bar, timed, 31.6)
    assert bar.n == 32
    advance_progress(bar, timed, 640.0)  # the last step may end past the bound
    assert bar.n == 600
    bar.close()
    stepped = load_config(None, ["trainer.max_steps=50"])
    bar = progress_bar(stepped, enabled=True)
    assert (bar.total, bar.unit) == (50, "step")
    advance_progress(bar, stepped, 12.4)
    assert bar.n == 1
    bar.close()


def test_rl_step_reports_entropy_kl_and_lag_histogram_with_fake_model() -> None:
    from pipelinerl.config import ActorConfig, Config, EngineConfig, TrainerConfig
    from pipelinerl.rl.step import rl_step

    ln2 = math.log(2)
    # Both sequences (prompt 1 token, completion 2) share one packed row: positions 0-3.
    row = [math.log(p) for p in (0.5, 0.25, 0.125, 0.125)]
    model = _FixedLogitsModel(torch.tensor([row, [0.0] * 4, row, [0.0] * 4]))
    # Trainer log-probs: token 1 at p(1/4), token 2 uniform, token 0 at 1/2, token 3 uniform;
    # the engine's are 0.1 lower: log rho = 0.1 on every token.
    samples = [
        Sample(prompt_ids=[0], token_ids=[1, 2], logprobs=[math.log(0.25) - 0.1] * 2,
               versions=[1, 1], reward=1.0, success=True, finish_reason="stop"),
        Sample(prompt_ids=[0], token_ids=[0, 3], logprobs=[math.log(0.5) - 0.1,
               math.log(0.25) - 0.1], versions=[0, 0], reward=0.0, success=False,
               finish_reason="stop"),
    ]
    cfg = Config(engine=EngineConfig(temperature=1.0, top_k=0, top_p=1.0),
                 actor=ActorConfig(group_size=2),
                 trainer=TrainerConfig(batch_size=2, max_tokens_per_row=64))
    m = rl_step(model, torch.optim.SGD(model.parameters(), lr=0.0),
                [Group(group_id="g", prompt="p", samples=samples)], cfg, trainer_version=1)
    close(m["entropy"], (1.75 * ln2 + 2 * ln2) / 2, tol=1e-6)  # mean over the 4 tokens
    close(m["kl_k1"], -0.1, tol=1e-6)
    close(m["mismatch_k3"], math.exp(0.1) - 1.1, tol=1e-6)
    assert m["lag_hist"] == {"0": 2, "1": 2}
    # both completions of 2 tokens; log rho = 0.1 on every token: equal weights, ESS 1
    assert m["by_length"] == {"1-31": {"sequences": 2.0, "tokens": 4.0,
                                       "ess": pytest.approx(1.0), "lag_mean": 0.5}}
