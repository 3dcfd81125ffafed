"""Issue 54, part 2: the decode step's sampling as one function of device tensors (what a CUDA
graph holds) and its stop check read one step late, checked on the CPU through the same code
with graphs off:

- the sampler (`SlotSampler`: penalty, temperature, min-p, top-k, top-p, the draw, the
  log-prob) gives the very tokens and log-probs of the eager sampler it replaced, bit for bit;
- the graph runner's step (its forward and sampling bodies, run uncaptured) gives the eager
  runner's, bit for bit at a bucket's shape;
- reading the stop check late returns what reading it at once does: the same tokens, finish
  reasons and per-token versions (in-flight weight updates between two steps included), no
  token sampled past a sequence's end, and a steady-state step that reads only the tokens of
  the step launched before it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import pytest
import torch

from pipelinerl.engine import EngineOptions
from pipelinerl.engine.runner import EagerRunner, GraphRunner
from pipelinerl.engine.sampling import (SamplingPlan, SlotSampler, apply_repetition_penalty,
                                        truncation_threshold)
from pipelinerl.engine.torch_engine import TorchEngine
from pipelinerl.models.decoder import CausalDecoder, KVCache
from pipelinerl.models.tiny import build_char_tokenizer
from pipelinerl.types import GenerationOutput, GenerationRequest, SamplingParams, StopStrings
from slot_sampling import sample_rows
from tiny_models import smollm2_layout, tiny_hf_model

torch.set_num_threads(1)


def eager_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                 top_p: torch.Tensor, min_p: torch.Tensor, penalty: torch.Tensor,
                 tokens: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator,
                 own_generators: Sequence[tuple[int, torch.Generator]]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's sampling before issue 54 (its `_sample_into` and `sample_tokens`, as they
    were), the reference: which steps run decided by reading the rows' parameters, the
    candidates sized by reading the device, the noise drawn fresh."""
    if (penalty != 1).any():
        logits = apply_repetition_penalty(logits, tokens[:, : int(lengths.max())], lengths, penalty)
    truncate = bool(((temperature > 0) & ((top_k > 0) | (top_p < 1) | (min_p > 0))).any())
    min_p = min_p if (min_p > 0).any() else 0.0
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    if truncate:
        if isinstance(min_p, torch.Tensor):
            min_p = torch.where(greedy, 0.0, min_p)
        threshold = truncation_threshold(
            scaled, torch.where(greedy, 0, top_k), torch.where(greedy, 1.0, top_p), min_p)
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    logprobs = scaled.log_softmax(dim=-1)
    noise = torch.empty_like(logprobs).exponential_(generator=generator)
    for row, own in own_generators:
        noise[row].exponential_(generator=own)
    out = torch.where(greedy, logprobs.argmax(dim=-1), (logprobs.exp() / noise).argmax(dim=-1))
    return out, logprobs.gather(1, out.unsqueeze(1)).squeeze(1)


def _rows(n: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Logits (with ties at the top of some rows) and per-row parameters mixing every step."""
    gen = torch.Generator().manual_seed(seed)
    pick = lambda *values: torch.tensor(values)[torch.randint(len(values), (n,), generator=gen)]  # noqa: E731
    logits = 3 * torch.randn(n, vocab, generator=gen)
    logits[: n // 4, :6] = logits[: n // 4, :6].amax(-1, keepdim=True)
    return dict(logits=logits, temperature=pick(0.0, 0.7, 1.0, 1.3), top_k=pick(0, 0, 1, 5, 40),
                top_p=pick(1.0, 1.0, 0.5, 0.9, 0.99), min_p=pick(0.0, 0.0, 0.05, 0.2),
                penalty=pick(1.0, 1.0, 0.8, 1.3), tokens=torch.randint(vocab, (n, 30), generator=gen),
                lengths=torch.randint(1, 31, (n,), generator=gen))


# Which parameters a batch's rows use: each at its default unless named.
MIXES = {"default": (), "greedy and penalty": ("penalty",), "top_k": ("top_k",),
         "min_p": ("min_p",), "top_k and top_p": ("top_k", "top_p"), "top_p alone": ("top_p",),
         "every one": ("penalty", "top_k", "top_p", "min_p")}
DEFAULTS = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "penalty": 1.0}


@pytest.mark.parametrize("vocab", [50, 3000], ids=["V50", "V3000"])
@pytest.mark.parametrize("mix", list(MIXES))
def test_the_sampler_gives_the_eager_samplers_tokens_and_logprobs_bit_for_bit(mix: str, vocab: int) -> None:
    """V3000 is wider than top-p's 1024 candidates: top-p alone takes the sized path there."""
    rows = _rows(64, vocab, seed=vocab)
    for name, default in DEFAULTS.items():
        if name not in MIXES[mix]:
            rows[name] = torch.full_like(rows[name], default)
    if mix == "top_p alone":
        rows["top_k"].zero_()
    if mix == "top_k and top_p":
        rows["top_k"].clamp_(min=1)  # every top-p row also has top-k: no sizing at any V
    sampled = (rows["temperature"] > 0).any()
    own = lambda: [(3, torch.Generator().manual_seed(11)), (40, torch.Generator().manual_seed(7))]  # noqa: E731
    params = [rows[k] for k in ("temperature", "top_k", "top_p")]
    got = sample_rows(rows["logits"], *params, torch.Generator().manual_seed(1), rows["min_p"],
                      rows["penalty"], rows["tokens"], rows["lengths"], own())
    want = eager_sample(rows["logits"], *params, rows["min_p"], rows["penalty"], rows["tokens"],
                        rows["lengths"], torch.Generator().manual_seed(1), own())
    assert sampled and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    truncates = (rows["temperature"] > 0) & ((rows["top_k"] > 0) | (rows["top_p"] < 1) | (rows["min_p"] > 0))
    plan = SamplingPlan.of(*params, truncates, rows["penalty"] != 1, rows["min_p"] > 0, vocab)
    assert plan.sized == (vocab > 1024 and mix in ("top_p alone", "every one"))


def _runners(model: CausalDecoder, capacity: int, max_len: int, params: SamplingParams
             ) -> tuple[EagerRunner, GraphRunner]:
    """An eager and an uncaptured graph runner over equal caches and samplers (tokens,
    parameters under `params`, noise), as the engine would hand them."""
    runners = []
    for graphs in (False, True):
        cache = KVCache(model.config, capacity, max_len, "cpu", torch.float32, scratch=graphs)
        gen = torch.Generator().manual_seed(1)
        for t in (*cache.k, *cache.v):
            t[:, :, :max_len] = torch.randn(t[:, :, :max_len].shape, generator=gen)
        sampler = SlotSampler(capacity, max_len, model.config.vocab_size, torch.device("cpu"))
        sampler.tokens.copy_(torch.randint(model.config.vocab_size, sampler.tokens.shape, generator=gen))
        for param, value in zip(sampler.params(), (params.temperature, params.top_k, params.top_p,
                                                   params.min_p, params.repetition_penalty)):
            param.fill_(value)
        sampler.draw(0, capacity, gen)
        runners.append(GraphRunner(model, cache, sampler, capacity, max_len, capture=False) if graphs
                       else EagerRunner(model, cache, sampler))
    return runners[0], runners[1]


@pytest.mark.parametrize("params", [
    SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(repetition_penalty=1.3),
    SamplingParams(top_k=7, min_p=0.05), SamplingParams(top_k=20, top_p=0.8),
    SamplingParams(top_p=0.9, temperature=0.7)], ids=lambda p: repr(p)[15:60])
def test_the_graph_runners_step_is_the_eager_runners_bit_for_bit_at_a_buckets_shape(
        params: SamplingParams) -> None:
    """4 rows (a batch bucket) attending 64 positions (a span bucket): the very computation,
    the sampling in its graph body (penalty over every column) as eager's."""
    hf = smollm2_layout(2)
    model = CausalDecoder(hf.config).eval().requires_grad_(False)
    model.load_hf_weights(hf.state_dict())
    eager, graph = _runners(model, 8, 96, params)
    positions = torch.tensor([20, 63, 5, 40])
    truncates = params.temperature > 0 and (params.top_k > 0 or params.top_p < 1 or params.min_p > 0)
    rows = lambda v, dtype=None: torch.full((4,), v, dtype=dtype)  # noqa: E731
    plan = SamplingPlan.of(rows(params.temperature), rows(params.top_k, torch.long),
                           rows(params.top_p), rows(truncates), rows(params.repetition_penalty != 1),
                           rows(params.min_p > 0), model.config.vocab_size)
    with torch.no_grad():
        want, got = eager.decode(positions, 64, plan), graph.decode(positions, 64, plan)
    assert torch.equal(got, want)
    assert torch.equal(graph.sampler.tokens[:4], eager.sampler.tokens[:4])


# -- the engine: reading the stop check late ---------------------------------------------------

def _engine(hf: torch.nn.Module, late: bool, graphs: bool = False, **options: Any) -> TorchEngine:
    """`graphs`: the graph runner, uncaptured (the CUDA engine's code on the CPU)."""
    opts = EngineOptions(**{"capacity": 6, "max_seq_len": 48, "seed": 3, "late_stop_check": late,
                            **options})
    engine = TorchEngine(hf.config, opts)
    if graphs:
        cache = KVCache(engine.model.config, opts.capacity, opts.max_seq_len, "cpu", torch.float32,
                        scratch=True)
        engine._runner = GraphRunner(engine.model, cache, engine._sampler, opts.capacity,
                                     opts.max_seq_len, capture=False)
    engine.load_weights(hf.state_dict(), version=0)
    return engine


class Launches:
    """Rows each decode step launched, and which step's tokens each read took."""

    def __init__(self, engine: TorchEngine) -> None:
        self.rows, self.order = 0, []
        decode, take, send = engine._runner.decode, engine._take, engine._send

        def counting_decode(positions: torch.Tensor, *args: Any) -> torch.Tensor:
            self.rows += positions.shape[0]
            return decode(positions, *args)

        def recording_send(out: torch.Tensor, start: int, end: int, *args: Any) -> Any:
            sampled = send(out, start, end, *args)
            self.order.append(("launched", id(sampled)))
            return sampled

        def recording_take(sampled: Any) -> list[GenerationOutput]:
            self.order.append(("read", id(sampled)))
            return take(sampled)

        engine._runner.decode, engine._send, engine._take = counting_decode, recording_send, recording_take


def _drive(engine: TorchEngine, requests: list[GenerationRequest], turns: int = 1,
           updates: dict[int, torch.nn.Module] | None = None) -> dict[str, list[GenerationOutput]]:
    """Every request to its end, held ones extended (the environment replies `[1, 2]`) until
    they have had `turns` turns; `updates[call]`: weights loaded after that step() call."""
    for r in requests:
        engine.add_request(r)
    outputs: dict[str, list[GenerationOutput]] = {}
    calls = 0
    while engine.num_active():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
            request = next(r for r in requests if r.request_id == out.request_id)
            if request.hold and len(outputs[out.request_id]) < turns:
                engine.extend(out.request_id, [1, 2], replace(request.params, max_new_tokens=5))
            elif request.hold:
                engine.release(out.request_id)
        calls += 1
        if updates and calls in updates:
            engine.load_weights(updates[calls].state_dict(), version=calls)
    return outputs


def _same_outputs(late: dict[str, list[GenerationOutput]], now: dict[str, list[GenerationOutput]]) -> None:
    """The same tokens, finish reasons and versions; log-probs equal within the rounding of a
    batch of another shape (a late step still holds the sequences the previous one ended)."""
    assert late.keys() == now.keys()
    for rid in now:
        assert len(late[rid]) == len(now[rid]), rid
        for a, b in zip(late[rid], now[rid]):
            assert (a.token_ids, a.finish_reason, a.versions) == (b.token_ids, b.finish_reason, b.versions), rid
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=2e-5)


def _requests(tokenizer: Any) -> list[GenerationRequest]:
    """Greedy and seeded requests (their tokens do not depend on what shares the batch) ending
    every way: stop token, stop sequence, stop string, max_new_tokens, the engine's
    max_seq_len, held for more turns."""
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    seeded = SamplingParams(max_new_tokens=12, top_k=8, repetition_penalty=1.2, seed=5)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16], [17, 18, 19], [20, 21], [22]]
    params = [
        replace(greedy, stop_token_ids=tuple(range(4, 30))),
        replace(seeded, stop_token_ids=tuple(range(30, 50))),
        replace(greedy, stop_sequences=((7,), (12, 13), (40,))),
        replace(greedy, stop=StopStrings(("e", "1", "!"), tokenizer.backend_tokenizer)),
        replace(seeded, max_new_tokens=46),  # to the engine's max_seq_len
        replace(seeded, max_new_tokens=1),
        replace(greedy, max_new_tokens=7),
        replace(seeded, seed=9, max_new_tokens=9),
    ]
    return [GenerationRequest(f"r{i}", p, q, hold=i in (2, 6, 7)) for i, (p, q) in enumerate(zip(prompts, params))]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?-+=*/"
    return build_char_tokenizer(alphabet, tmp_path_factory.mktemp("tokenizer"))


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph_runner"])
def test_a_late_stop_check_returns_what_reading_it_at_once_does_and_drops_every_extra_token(
        tokenizer: Any, graphs: bool) -> None:
    """Eight requests on six slots (two wait for a slot a step longer when reading late),
    three held for three turns: the outputs of reading at once. The late engine decoded
    tokens past some sequences' ends and returned none of them: every token it counts is in
    an output."""
    hf = tiny_hf_model("qwen2")
    now = _engine(hf, late=False)
    late = _engine(hf, late=True, graphs=graphs)
    now_launches, late_launches = Launches(now), Launches(late)
    expected = _drive(now, _requests(tokenizer), turns=3)
    got = _drive(late, _requests(tokenizer), turns=3)
    _same_outputs(got, expected)
    reasons = {o.finish_reason for outs in expected.values() for o in outs}
    assert reasons == {"stop", "length"} and len(expected["r4"][0].token_ids) == 46
    assert {len(outs) for rid, outs in got.items() if rid in ("r2", "r6", "r7")} == {3}
    returned = sum(len(o.token_ids) for outs in got.values() for o in outs)
    assert late.stats.generated_tokens == now.stats.generated_tokens == returned
    # Each turn's first token comes from its prefill or extension, the others from decode
    # steps: reading at once decodes no more; reading late, one more per turn that ended.
    decoded = returned - sum(len(outs) for outs in got.values())
    assert now_launches.rows == decoded < late_launches.rows
    assert late.num_active() == 0 and late.num_running() == 0 and late.num_parked() == 0


@pytest.mark.parametrize("recompute", [False, True])
def test_weights_updated_between_two_late_steps_stamp_the_versions_reading_at_once_does(
        recompute: bool) -> None:
    """An update after every call of step() from the third: the step in flight is read first
    (its tokens are the old weights'), so every token carries the version that computed it,
    as when reading at once, and a sequence it ended is not decoded (nor recomputed, with
    `recompute_kv_on_update`) under the new weights."""
    hf = tiny_hf_model("qwen2")
    models = [tiny_hf_model("qwen2", seed=s) for s in (1, 2, 3)]
    updates = {call: models[call % 3] for call in range(3, 20)}
    requests = [GenerationRequest(f"r{i}", [3 + i, 4, 5 + i], SamplingParams(
        max_new_tokens=6 + 2 * i, temperature=0.0 if i % 2 else 1.0, seed=None if i % 2 else i,
        stop_token_ids=(7,))) for i in range(6)]
    now = _engine(hf, late=False, recompute_kv_on_update=recompute)
    late = _engine(hf, late=True, recompute_kv_on_update=recompute)
    expected, got = _drive(now, requests, updates=updates), _drive(late, requests, updates=updates)
    _same_outputs(got, expected)
    versions = {v for outs in got.values() for o in outs for v in o.versions}
    assert {0, 3, 4, 5, 9} <= versions
    assert late.stats.recomputed_tokens == now.stats.recomputed_tokens


def test_a_late_steady_state_step_reads_only_the_tokens_of_the_step_launched_before_it() -> None:
    """Once admitted, each step launches its decode and then reads the previous step's
    tokens: the host never reads the step it has just launched (on a GPU: never waits for the
    device to finish it)."""
    hf = tiny_hf_model("qwen2")
    late = _engine(hf, late=True)
    launches = Launches(late)
    for i in range(4):
        late.add_request(GenerationRequest(f"r{i}", [3, 4 + i], SamplingParams(max_new_tokens=30)))
    late.step()  # the prefill's first tokens, read at once, and the first decode step
    launches.order.clear()
    for _ in range(10):
        assert late.step() == []
    launched, read = launches.order[0::2], launches.order[1::2]
    assert len(launched) == len(read) == 10
    assert {kind for kind, _ in launched} == {"launched"} and {kind for kind, _ in read} == {"read"}
    assert all(r[1] == l[1] for l, r in zip(launched, read[1:]))  # each read: the step before
    assert all(r[1] != l[1] for l, r in zip(launched, read))  # never the one just launched
