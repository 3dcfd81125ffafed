"""Top-k / top-p truncation: the trainer scores under the distribution the engine sampled from.

The torch engine samples and reports log mu under softmax(logits / T) truncated to top-k, then
top-p, and renormalised; the trainer applies the same truncation (one shared function) to its
own logits, so with identical weights rho = pi / mu = 1 for every token.
"""

from __future__ import annotations

import math

import pytest
import torch
from slot_sampling import sample_rows
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from pipelinerl.config import ActorConfig, Config, EngineConfig, TrainerConfig
from pipelinerl.engine import EngineOptions, sampling
from pipelinerl.engine.sampling import truncation_threshold
from pipelinerl.engine.torch_engine import TorchEngine
from pipelinerl.rl.packing import pack, pad
from pipelinerl.rl.scores import score_tokens
from pipelinerl.rl.step import rl_step
from pipelinerl.types import GenerationRequest, Group, Sample, SamplingParams

torch.set_num_threads(1)

VOCAB = 100
TEMPERATURE = 0.8
GROUP = 4


def tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.1,  # logits spread enough that top-k / top-p drop real mass
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config).float().eval()


def generate_groups(model: Qwen2ForCausalLM, top_k: int, top_p: float) -> list[Group]:
    """Groups of GROUP samples per prompt from the real torch engine holding `model`'s weights
    (version 0), each token with its engine log-prob."""
    engine = TorchEngine(model.config, EngineOptions(capacity=8, max_seq_len=48, seed=1))
    engine.load_weights(model.state_dict(), version=0)
    params = SamplingParams(max_new_tokens=16, temperature=TEMPERATURE, top_k=top_k, top_p=top_p)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (2 + i,), generator=g).tolist() for i in range(4)]
    for p, prompt in enumerate(prompts):
        for j in range(GROUP):
            engine.add_request(GenerationRequest(f"{p}-{j}", prompt, params))
    outputs = {}
    while engine.num_active():
        outputs.update((o.request_id, o) for o in engine.step())
    groups = []
    for p, prompt in enumerate(prompts):
        samples = []
        for j in range(GROUP):
            o = outputs[f"{p}-{j}"]
            reward = float(j % 2)
            samples.append(Sample(o.prompt_ids, o.token_ids, o.logprobs, o.versions, reward,
                                  reward > 0, o.finish_reason, group_id=str(p)))
        groups.append(Group(str(p), "prompt", samples))
    return groups


TRUNCATIONS = [(20, 1.0), (0, 0.9), (20, 0.9)]


@pytest.mark.parametrize(("top_k", "top_p"), TRUNCATIONS)
def test_lag0_rho_is_one_per_token_packed_padded_and_chunked(top_k: int, top_p: float) -> None:
    model = tiny_qwen2()
    samples = [s for g in generate_groups(model, top_k, top_p) for s in g.samples]
    adv = [0.0] * len(samples)
    with torch.no_grad():
        full = [score_tokens(model, b, TEMPERATURE).logprobs - b.old_logprobs
                for b in pack(samples, adv, 64)]
        # Without the mirrored truncation, log rho = log Z < 0 (the kept mass): the bug.
        assert torch.cat(full).max() < -1e-3
        for batches, chunk in ((pack(samples, adv, 64), None), (pad(samples, adv), None),
                               (pack(samples, adv, 64), 3)):
            for b in batches:
                new = score_tokens(model, b, TEMPERATURE, top_k=top_k, top_p=top_p,
                                     chunk_tokens=chunk).logprobs
                rho = torch.exp(new - b.old_logprobs)
                torch.testing.assert_close(rho, torch.ones_like(rho), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("top_k", "top_p"), TRUNCATIONS)
def test_lag0_rl_step_reports_ess_one(top_k: int, top_p: float) -> None:
    """The trainer's step reads the truncation from engine.* and scores under it."""
    model = tiny_qwen2()
    groups = generate_groups(model, top_k, top_p)
    cfg = Config(
        engine=EngineConfig(temperature=TEMPERATURE, top_k=top_k, top_p=top_p, max_seq_len=48,
                            max_new_tokens=16),
        actor=ActorConfig(group_size=GROUP),
        trainer=TrainerConfig(batch_size=GROUP * len(groups), max_tokens_per_row=64),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    m = rl_step(model.train(), optimizer, groups, cfg, trainer_version=0)
    assert m["lag_max"] == 0
    assert abs(m["ess"] - 1) < 1e-6 and abs(m["rho_mean"] - 1) < 1e-5
    assert m["mismatch_abs_lag0"] < 1e-5 and m["clip_frac"] == 0


# ---- the shared truncation rule -------------------------------------------------------------


def kept(
    scaled: torch.Tensor, top_k: int | torch.Tensor, top_p: float | torch.Tensor
) -> torch.Tensor:
    return scaled >= truncation_threshold(scaled, top_k, top_p)


@pytest.mark.parametrize("candidates", [1024, 3])
def test_threshold_matches_hf_warpers_with_per_row_parameters(
    candidates: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 3 first candidates: the top-p rows need more, taken in rounds of 8 times as many.
    monkeypatch.setattr(sampling, "_TOP_P_CANDIDATES", candidates)
    g = torch.Generator().manual_seed(0)
    scaled = 2 * torch.randn(6, VOCAB, generator=g)
    top_k = torch.tensor([0, 5, 20, 0, 7, VOCAB + 3])
    top_p = torch.tensor([0.9, 1.0, 0.8, 0.3, 0.5, 1.0])
    got = kept(scaled, top_k, top_p)
    for i in range(len(scaled)):
        ref = scaled[i : i + 1]
        if top_k[i]:
            ref = TopKLogitsWarper(min(int(top_k[i]), VOCAB))(None, ref)
        if top_p[i] < 1:
            ref = TopPLogitsWarper(float(top_p[i]))(None, ref)
        assert torch.equal(got[i], torch.isfinite(ref[0])), i
    assert kept(scaled, 0, 1.0).all()


@pytest.mark.parametrize("candidates", [1024, 3])
def test_min_p_then_top_k_then_top_p_match_hf_warpers_in_vllms_order(
    candidates: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM V1 applies min-p after temperature and before top-k and top-p (the endpoint's
    `min_p`); a row without min-p is as before."""
    monkeypatch.setattr(sampling, "_TOP_P_CANDIDATES", candidates)
    g = torch.Generator().manual_seed(1)
    scaled = 2 * torch.randn(7, VOCAB, generator=g)
    min_p = torch.tensor([0.05, 0.0, 0.3, 0.01, 1.0, 0.2, 0.02])
    top_k = torch.tensor([0, 5, 20, 0, 7, 0, 3])
    top_p = torch.tensor([0.9, 1.0, 0.8, 1.0, 0.5, 0.95, 1.0])
    got = scaled >= truncation_threshold(scaled, top_k, top_p, min_p)
    for i in range(len(scaled)):
        ref = scaled[i : i + 1]
        if min_p[i] > 0:
            ref = MinPLogitsWarper(float(min_p[i]))(None, ref)
        if top_k[i]:
            ref = TopKLogitsWarper(int(top_k[i]))(None, ref)
        if top_p[i] < 1:
            ref = TopPLogitsWarper(float(top_p[i]))(None, ref)
        assert torch.equal(got[i], torch.isfinite(ref[0])), i
    only_min_p = scaled >= truncation_threshold(scaled, 0, 1.0, min_p)
    assert torch.equal(only_min_p[1], torch.ones(VOCAB, dtype=torch.bool))
    assert only_min_p[4].sum() == 1 and not only_min_p[0].all()


def test_repetition_penalty_matches_hf_on_each_rows_own_tokens() -> None:
    g = torch.Generator().manual_seed(2)
    logits = 3 * torch.randn(3, VOCAB, generator=g)
    tokens = torch.randint(0, VOCAB, (3, 12), generator=g)
    lengths = torch.tensor([12, 5, 1])  # what follows a row's length is not its own
    penalty = torch.tensor([1.5, 0.7, 1.0])
    got = sampling.apply_repetition_penalty(logits, tokens, lengths, penalty)
    for i in range(3):
        want = RepetitionPenaltyLogitsProcessor(float(penalty[i]))(
            tokens[i : i + 1, : lengths[i]], logits[i : i + 1].clone())
        assert torch.equal(got[i], want[0]), i
    assert not torch.equal(got[1], logits[1]) and torch.equal(got[2], logits[2])


def test_a_row_with_its_own_generator_draws_the_same_whatever_shares_the_batch() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, VOCAB, generator=g)

    def draw(rows: list[int], shared_seed: int) -> list[int]:
        own = torch.Generator().manual_seed(11)  # the row's seed
        tokens = []
        for _ in range(20):
            t, _ = sample_rows(logits[rows], torch.ones(len(rows)),
                               torch.zeros(len(rows), dtype=torch.long), torch.ones(len(rows)),
                               torch.Generator().manual_seed(shared_seed),
                               own_generators=[(len(rows) - 1, own)])
            tokens.append(int(t[-1]))
        return tokens

    alone = draw([0], 0)
    assert draw([1, 2, 3, 0], 5) == alone and len(set(alone)) > 1


def test_ties_at_the_boundary_are_kept_together() -> None:
    # top-k = 2 ends inside the tie at 2.0: every token equal to the k-th largest stays.
    got = kept(torch.tensor([[3.0, 2.0, 1.0, 2.0, 2.0]]), 2, 1.0)
    assert got.tolist() == [[True, True, False, True, True]]
    # probabilities (0.4, 0.2, 0.2, 0.2): top-p 0.5 needs the first two tokens, and the second
    # one's equals come along, whatever order a sort puts them in.
    scaled = torch.tensor([[math.log(0.2), math.log(0.4), math.log(0.2), math.log(0.2)]])
    assert kept(scaled, 0, 0.5).all()
    assert kept(scaled, 0, 0.3).tolist() == [[False, True, False, False]]
    # top-p applies to the top-k-renormalised probabilities.
    scaled = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1]]))
    assert kept(scaled, 2, 0.6).tolist() == [[True, False, False, False]]  # 0.5/0.8 >= 0.6
    assert kept(scaled, 0, 0.6).tolist() == [[True, True, False, False]]  # 0.5 < 0.6


def test_engine_samples_every_tied_token_with_its_renormalised_logprob() -> None:
    n = 4000
    logits = torch.full((n, 8), -1.0)
    logits[:, [1, 4, 6]] = 2.0  # three tokens tie for the top; top_k = 2 keeps all three
    tokens, logprobs = sample_rows(logits, torch.ones(n), torch.full((n,), 2), torch.ones(n),
                                   torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=8)
    assert counts[[0, 2, 3, 5, 7]].sum() == 0
    assert (counts[[1, 4, 6]] > n / 4).all()
    torch.testing.assert_close(logprobs, torch.full((n,), math.log(1 / 3)))


def test_greedy_rows_are_not_truncated() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    tokens, logprobs = sample_rows(
        logits, torch.tensor([0.0, 1.0]), torch.tensor([1, 1]), torch.tensor([0.5, 0.5]),
        torch.Generator().manual_seed(0),
    )
    assert tokens.tolist() == [0, 0]
    raw = logits[0].log_softmax(-1)[0]
    torch.testing.assert_close(logprobs, torch.stack([raw, torch.tensor(0.0)]))
