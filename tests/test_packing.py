"""Packed and padded trainer inputs give the same log-probs as one sequence at a time."""

import dataclasses
import itertools
import math
import random

import pytest
import torch
from tiny_models import (
    ARCHS,
    random_groups,
    reference_truncation,
    smollm2_layout,
    tiny_hf_model,
)
from tiny_models import VOCAB as VOCAB_HF
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from pipelinerl.config import ConfigError, load_config
from pipelinerl.rl.attention import (
    _segments,
    set_packed_attention,
    use_per_sequence_attention,
)
from pipelinerl.rl.losses import reinforce_tis_loss
from pipelinerl.rl.packing import PackedBatch, pack, pad
from pipelinerl.rl.scores import _SelectedLogprobs, score_tokens
from pipelinerl.rl.step import rl_step
from pipelinerl.roles.trainer import make_optimizer
from pipelinerl.types import Sample

torch.set_num_threads(1)

VOCAB = 97
# (prompt length, completion length); input length = sum - 1
SHAPES = [(3, 5), (1, 1), (6, 9), (2, 4), (4, 2), (5, 7), (1, 3), (2, 2), (14, 17)]
ROW = 16


def tiny_model(attn: str) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    return Qwen2ForCausalLM(cfg).float()


def make_samples() -> list[Sample]:
    return make_samples_for(VOCAB)


def make_samples_for(vocab: int) -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    samples = []
    for k, (p, c) in enumerate(SHAPES):
        ids = torch.randint(0, vocab, (p + c,), generator=g).tolist()
        samples.append(
            Sample(
                prompt_ids=ids[:p],
                token_ids=ids[p:],
                logprobs=(-torch.rand(c, generator=g)).tolist(),
                versions=[k % 3] * c,
                reward=float(k % 2),
                success=bool(k % 2),
                finish_reason="stop",
            )
        )
    return samples


def reference_logprobs(
    model: Qwen2ForCausalLM, s: Sample, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """One sequence alone, no padding, no packing: the ground truth. Truncation by
    transformers' warpers, the sampled token always kept (its log-prob stays finite)."""
    ids = torch.tensor([s.prompt_ids + s.token_ids])
    logits = model(ids, use_cache=False).logits[0, :-1] / temperature
    targets = ids[0, 1:, None]
    warped = logits
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p < 1:
        warped = TopPLogitsWarper(top_p)(None, warped)
    keep = torch.isfinite(warped).scatter_(-1, targets, True)
    logits = logits.masked_fill(~keep, float("-inf"))
    lp = torch.log_softmax(logits, -1).gather(-1, targets).squeeze(-1)
    return lp[len(s.prompt_ids) - 1 :]


def by_sequence(batches: list[PackedBatch], lps: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    out: dict[int, list[torch.Tensor]] = {}
    for b, lp in zip(batches, lps):
        for i in b.seq_idx.unique().tolist():
            out.setdefault(i, []).append(lp[b.seq_idx == i])
    return {i: torch.cat(v) for i, v in out.items()}


def test_pack_layout() -> None:
    samples = make_samples()
    adv = [float(i) for i in range(len(samples))]
    batches = pack(samples, adv, ROW)
    lengths = [p + c - 1 for p, c in SHAPES]
    assert sum(b.num_sequences for b in batches) == len(samples)
    assert any(b.num_sequences >= 3 for b in batches)
    for b in batches:
        assert b.input_ids.shape[0] == 1 and b.attention_mask is None
        assert b.input_ids.shape[1] <= ROW or b.num_sequences == 1
        seqs = b.seq_idx.unique_consecutive().tolist()
        assert b.input_ids.shape[1] == sum(lengths[i] for i in seqs)
        # position_ids restart at 0 at each sequence start
        assert (b.position_ids[0] == 0).sum().item() == len(seqs)
        for i in seqs:
            sel = b.seq_idx == i
            s = samples[i]
            assert b.target_ids[sel].tolist() == s.token_ids
            assert b.versions[sel].tolist() == s.versions
            torch.testing.assert_close(b.old_logprobs[sel], torch.tensor(s.logprobs))
            assert (b.advantages[sel] == adv[i]).all()
            # the position before each trained token holds the previous token of the sequence
            prev = (s.prompt_ids + s.token_ids)[len(s.prompt_ids) - 1 : -1]
            width = b.logit_cols.numel()
            rows, cols = b.logit_index[sel] // width, b.logit_cols[b.logit_index[sel] % width]
            assert b.input_ids[rows, cols].tolist() == prev
        # the sequences' lengths, as the attention reads them, tile the row
        assert b.sequence_lengths == [[lengths[i] for i in seqs]]
        assert b.cu_seqlens.tolist() == [0, *itertools.accumulate(lengths[i] for i in seqs)]
    # the 30-token sequence exceeds the row limit and sits alone
    assert [b.num_sequences for b in batches if b.input_ids.shape[1] > ROW] == [1]


def test_context_versions_are_each_sequences_first_sampled_version() -> None:
    s = make_samples()[0]
    spanning = Sample(s.prompt_ids, s.token_ids, s.logprobs, [3, 3, 4, 4, 5], 1.0, True, "stop")
    multi = Sample(s.prompt_ids, s.token_ids, s.logprobs, [-1, 2, -1, -1, 3], 0.0, False, "stop",
                   model_mask=[False, True, False, False, True])  # env tokens first and between
    batch = pack([spanning, multi], [1.0, -1.0], ROW)[0]
    assert batch.versions.tolist() == [3, 3, 4, 4, 5, 2, 3]
    assert batch.context_versions.tolist() == [3] * 5 + [2, 2]


def test_pack_skips_empty_and_validates() -> None:
    s = make_samples()[:2]
    empty = Sample([1, 2], [], [], [], 0.0, False, "length")
    batches = pack(s + [empty], [0.0, 0.0, 0.0], ROW)
    assert sum(b.num_sequences for b in batches) == 2
    with pytest.raises(ValueError, match="advantages"):
        pack(s, [0.0], ROW)
    with pytest.raises(ValueError, match="prompt"):
        pack([Sample([], [1], [-0.1], [0], 0.0, False, "stop")], [0.0], ROW)
    with pytest.raises(ValueError, match="differ in length"):
        pack([Sample([1], [1, 2], [-0.1], [0, 0], 0.0, False, "stop")], [0.0], ROW)


def test_pad_layout() -> None:
    samples = make_samples()
    batches = pad(samples, [0.0] * len(samples), max_tokens_per_batch=40)
    assert [i for b in batches for i in b.seq_idx.unique_consecutive().tolist()] == list(
        range(len(samples))
    )
    for b in batches:
        assert b.input_ids.numel() <= 40 or b.num_sequences == 1
        assert b.num_sequences == b.input_ids.shape[0]
    assert len(pad(samples, [0.0] * len(samples))) == 1


@pytest.mark.parametrize(
    "attn, temperature, chunk, top_k, top_p",
    [
        ("sdpa", 1.0, None, 0, 1.0),
        ("eager", 1.0, None, 0, 1.0),
        ("sdpa", 0.7, None, 0, 1.0),
        ("eager", 0.7, 3, 0, 1.0),
        ("sdpa", 0.7, None, 10, 0.8),
        ("sdpa", 1.3, 3, 0, 0.6),
        ("per_sequence", 1.0, None, 0, 1.0),
        ("per_sequence", 0.7, 3, 10, 0.8),
    ],
)
def test_packed_and_padded_match_unpacked(
    attn: str, temperature: float, chunk: int | None, top_k: int, top_p: float
) -> None:
    model = tiny_model(attn)
    samples = make_samples()
    adv = [0.0] * len(samples)
    with torch.no_grad():
        ref = {
            i: reference_logprobs(model, s, temperature, top_k, top_p)
            for i, s in enumerate(samples)
        }
        for batches in (pack(samples, adv, ROW), pad(samples, adv), pad(samples, adv, 40)):
            lps = [
                score_tokens(model, b, temperature, top_k, top_p, chunk_tokens=chunk).logprobs
                for b in batches
            ]
            got = by_sequence(batches, lps)
            assert got.keys() == ref.keys()
            for i in ref:
                torch.testing.assert_close(got[i], ref[i], atol=1e-5, rtol=0)


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (10, 0.8)])
def test_packed_gradient_matches_padded(top_k: int, top_p: float) -> None:
    """A step split into packed rows (micro-batches) gives the gradient of one padded batch."""
    model = tiny_model("sdpa")
    samples = make_samples()
    adv = torch.linspace(-1, 1, len(samples))

    def step_grad(batches: list[PackedBatch], chunk: int | None = None) -> torch.Tensor:
        model.zero_grad()
        for b in batches:
            new = score_tokens(model, b, top_k=top_k, top_p=top_p, chunk_tokens=chunk).logprobs
            reinforce_tis_loss(new, b.old_logprobs, b.advantages, len(samples)).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    packed = pack(samples, adv, ROW)
    assert len(packed) > 1
    want = step_grad(pad(samples, adv))
    torch.testing.assert_close(step_grad(packed), want, atol=1e-6, rtol=0)
    # the chunked (memory-bounded) log-prob path gives the same gradient
    torch.testing.assert_close(step_grad(packed, chunk=4), want, atol=1e-6, rtol=0)
    # and so does attention within each packed sequence (trainer.packed_attention)
    use_per_sequence_attention(model)
    torch.testing.assert_close(step_grad(packed), want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_per_sequence_attention_matches_the_masked_row(arch: str) -> None:
    """Every supported family (GQA, q/k norms, head_dim != hidden/heads, a sliding window
    longer than the rows): attending per sequence gives the masked row's log-probs."""
    samples = make_samples_for(VOCAB_HF)
    batches = pack(samples, [0.0] * len(samples), 40)
    assert any(len(b.seq_idx.unique()) > 2 for b in batches)  # rows of several sequences
    model = tiny_hf_model(arch)
    with torch.no_grad():
        want = [score_tokens(model, b).logprobs for b in batches]
        use_per_sequence_attention(model)
        got = [score_tokens(model, b).logprobs for b in batches]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=0)


def test_per_sequence_attention_refuses_a_sequence_beyond_the_sliding_window() -> None:
    samples = make_samples_for(VOCAB_HF)
    model = tiny_hf_model("mistral", sliding_window=8)
    use_per_sequence_attention(model)
    with pytest.raises(ValueError, match="sliding window"):
        score_tokens(model, pack(samples, [0.0] * len(samples), 40)[0]).logprobs


@pytest.mark.parametrize("arch", ARCHS)
def test_per_sequence_segments_cost_no_host_copy_from_the_packer_and_one_without(
        arch: str, monkeypatch) -> None:
    """The packer gives the sequences' lengths: no read of position_ids back from the device
    (a GPU sync per forward). Without them (a caller that did not pack), one per forward however
    deep the model, not one per layer (review issue 25, F8)."""
    copies = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu",
                        lambda self, *a, **k: copies.append(1) or real_cpu(self, *a, **k))

    def host_copies(layers: int, packer_lengths: bool) -> int:
        model = tiny_hf_model(arch, num_hidden_layers=layers)
        use_per_sequence_attention(model)
        batch = pack(make_samples_for(VOCAB_HF), [0.0] * len(SHAPES), 40)[0]  # new positions
        if not packer_lengths:
            batch = dataclasses.replace(batch, sequence_lengths=None, cu_seqlens=None)
        copies.clear()
        with torch.no_grad():
            score_tokens(model, batch).logprobs
        return len(copies)

    assert host_copies(4, True) == host_copies(1, True) == 0
    assert host_copies(4, False) == host_copies(1, False) == 1


def test_per_sequence_segments_follow_an_in_place_write() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
    assert _segments(positions) == [[(0, 3), (3, 5)], [(0, 5)]]
    positions[0, 3:] = torch.tensor([3, 4])  # the same tensor, one sequence: the cache is stale
    assert _segments(positions) == [[(0, 5)], [(0, 5)]]


def test_per_sequence_attention_broadcasts_one_row_of_positions() -> None:
    """Rows without a mask or positions get the model's single row of positions: plain causal."""
    ids = torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(0))
    model = tiny_model("per_sequence")
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
        model.set_attn_implementation("sdpa")
        torch.testing.assert_close(got, model(input_ids=ids, use_cache=False).logits)


@pytest.mark.parametrize("truncation", [None, (3, 1.0), (0, 0.7), (4, 0.6)])
def test_chunked_logprobs_gradient(truncation: tuple[int, float] | None) -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(7, 11, generator=g, dtype=torch.float64, requires_grad=True)
    rows = torch.tensor([5, 0, 3, 6, 2])
    targets = torch.tensor([1, 10, 0, 4, 4])
    weights = torch.randn(5, generator=g, dtype=torch.float64)
    t = 0.6
    # chunk of 2 tokens forces three chunks, the last one partial
    got, _ = _SelectedLogprobs.apply(logits, rows, targets, t, 2, truncation)
    (got.double() * weights).sum().backward()
    got_grad = logits.grad.clone()
    logits.grad = None
    x, dropped = reference_truncation(logits[rows] / t, targets, truncation)
    want = torch.log_softmax(x, -1).gather(-1, targets[:, None]).squeeze(-1)
    (want * weights).sum().backward()
    torch.testing.assert_close(got.double(), want.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(got_grad, logits.grad, atol=1e-6, rtol=0)
    # The kept set is a stop-gradient choice: a dropped logit gets no gradient.
    assert (got_grad[rows][dropped] == 0).all()


def test_sampled_token_outside_the_kept_set_stays_finite() -> None:
    """After an update the trainer's top-k may no longer hold a sampled token: its log-prob is
    then taken with the token added to the kept set, not -inf."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    # top-1 keeps token 0 only; the sampled token 3 joins it: log(e^0 / (e^3 + e^0))
    lp, _ = _SelectedLogprobs.apply(logits, torch.tensor([0]), torch.tensor([3]), 1.0, 1, (1, 1.0))
    torch.testing.assert_close(lp, -torch.log1p(torch.tensor([math.exp(3.0)])))


def test_token_micro_batches_take_one_forward_each_and_equal_the_row_by_row_step() -> None:
    """trainer.tokens_per_microbatch: 16 sequences (~800 input tokens) in rows of 128 tokens
    take 7 forwards; in micro-batches of up to 4096 tokens, one varlen row, one forward. The
    step's loss, gradient norm and weights agree within fp32 noise."""
    runs = {}
    for name, extra in (("rows", []), ("tokens", ["trainer.tokens_per_microbatch=4096"])):
        cfg = load_config(overrides=["model.path=unused", "trainer.batch_size=16",
                                     "actor.group_size=8", "trainer.max_tokens_per_row=128",
                                     *extra])
        model = smollm2_layout(2).train()
        set_packed_attention(model, cfg.trainer)
        forwards = []
        model.register_forward_hook(lambda m, args, out: forwards.append(1))
        metrics = rl_step(model, make_optimizer(model, cfg.trainer),
                          random_groups(2, random.Random(0)), cfg, 0)
        runs[name] = (metrics, model, len(forwards))
    (rows, rows_model, rows_forwards), (tokens, tokens_model, tokens_forwards) = runs.values()
    assert rows_forwards >= 6 and tokens_forwards == 1, (rows_forwards, tokens_forwards)
    for key in ("loss", "grad_norm", "ess", "tokens"):
        assert tokens[key] == pytest.approx(rows[key], rel=1e-5, abs=1e-7), key
    for a, b in zip(rows_model.parameters(), tokens_model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)


def test_token_micro_batches_need_per_sequence_attention() -> None:
    for extra in ("trainer.packed_attention=masked_row", "trainer.packing=false"):
        with pytest.raises((ConfigError, ValueError), match="one varlen row"):
            load_config(overrides=["model.path=unused", "trainer.tokens_per_microbatch=8192",
                                   extra])
