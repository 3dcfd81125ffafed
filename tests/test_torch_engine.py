"""The torch engine: continuous batching, exact log-probs and versions, in-flight updates."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from pipelinerl.engine import EngineOptions
from pipelinerl.engine.torch_engine import TorchEngine
from pipelinerl.models.decoder import KVCache
from pipelinerl.types import GenerationOutput, GenerationRequest, SamplingParams

torch.set_num_threads(1)

from tiny_models import ARCHS, VOCAB, tiny_hf_model  # noqa: E402


def make_engine(hf: torch.nn.Module, **kwargs: Any) -> TorchEngine:
    engine = TorchEngine(hf.config, EngineOptions(**{"capacity": 4, "max_seq_len": 64, **kwargs}))
    engine.load_weights(hf.state_dict(), version=0)
    return engine


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (3 + i % 7,), generator=gen).tolist() for i in range(count)]


def run_to_end(engine: TorchEngine) -> dict[str, GenerationOutput]:
    outputs: dict[str, GenerationOutput] = {}
    while engine.num_active():
        outputs.update((o.request_id, o) for o in engine.step())
    return outputs


@torch.no_grad()
def hf_greedy(hf: torch.nn.Module, prefix: list[int], n: int) -> list[int]:
    ids = list(prefix)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prefix) :]


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, out: GenerationOutput) -> torch.Tensor:
    """Teacher-forced logits [len(token_ids), V] of the distributions each token was drawn from."""
    ids = torch.tensor([out.prompt_ids + out.token_ids])
    return hf(ids).logits[0, len(out.prompt_ids) - 1 : -1]


def greedy(max_new_tokens: int, stop: tuple[int, ...] = ()) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stop)


@pytest.mark.parametrize(
    ("arch", "max_prefill_tokens"), [("qwen2", 8192), ("llama", 12), ("qwen3", 8192), ("mistral", 12)]
)
def test_continuous_batching_matches_generating_each_prompt_alone(arch: str, max_prefill_tokens: int) -> None:
    hf = tiny_hf_model(arch)
    engine = make_engine(hf, capacity=3, max_prefill_tokens=max_prefill_tokens)
    ps = prompts(8)
    budgets = [2 + (5 * i) % 9 for i in range(8)]  # sequences finish at different steps
    for i, (p, n) in enumerate(zip(ps, budgets)):
        engine.add_request(GenerationRequest(f"r{i}", p, greedy(n)))
    outputs = {o.request_id: o for o in engine.step()}
    # Prompts of 3, 4 and 5 tokens: one prefill forward, or two within a 12-token budget.
    assert engine.stats.prefill_forwards == (1 if max_prefill_tokens > 15 else 2)
    outputs.update(run_to_end(engine))
    assert engine.num_active() == 0 and engine.num_running() == 0
    for i, (p, n) in enumerate(zip(ps, budgets)):
        out = outputs[f"r{i}"]
        assert out.prompt_ids == p and out.finish_reason == "length"
        assert out.token_ids == hf_greedy(hf, p, n)
        expected = hf_logits(hf, out).log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)
        assert out.versions == [0] * n
    assert engine.stats.generated_tokens == sum(budgets)
    assert engine.stats.finished_requests == 8
    # Joining mid-flight: far fewer decode steps than generating the 8 prompts one after another.
    assert engine.stats.decode_steps < sum(budgets) - 8


def test_requests_with_the_same_prompt_share_one_prefill() -> None:
    """A group's attempts: the prompt is computed once, the copies get its K/V; each still
    samples on its own, with exact log-probs, and greedy copies equal the prompt alone."""
    hf = tiny_hf_model("qwen2")
    ps = prompts(2)
    order = [ps[0], ps[1], ps[0], ps[0], ps[1]]
    engine = make_engine(hf, capacity=8, seed=5)
    for i, p in enumerate(order):
        engine.add_request(GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=9, temperature=1.0)))
    outputs = run_to_end(engine)
    assert engine.stats.prefill_tokens == len(ps[0]) + len(ps[1])
    assert engine.stats.shared_prefill_tokens == 2 * len(ps[0]) + len(ps[1])
    assert len({tuple(outputs[f"r{i}"].token_ids) for i in (0, 2, 3)}) > 1  # sampled apart
    for i, p in enumerate(order):
        out = outputs[f"r{i}"]
        assert out.prompt_ids == p
        expected = hf_logits(hf, out).log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)
    greedy_engine = make_engine(hf, capacity=3)
    for i in range(3):
        greedy_engine.add_request(GenerationRequest(f"g{i}", ps[1], greedy(7)))
    assert all(o.token_ids == hf_greedy(hf, ps[1], 7) for o in run_to_end(greedy_engine).values())


def test_decode_runs_over_active_slots_only_and_their_longest_length() -> None:
    hf = tiny_hf_model("qwen2")
    engine = make_engine(hf, capacity=8)
    calls: list[tuple[int, int, int]] = []
    decode = engine.model.decode

    def recording_decode(cache: KVCache, input_ids: torch.Tensor, positions: torch.Tensor, attend_len: int) -> torch.Tensor:
        calls.append((input_ids.shape[0], attend_len, int(positions.max()) + 1))
        return decode(cache, input_ids, positions, attend_len)

    engine.model.decode = recording_decode
    for i, n in enumerate([2, 9, 4]):
        engine.add_request(GenerationRequest(f"r{i}", [1, 2, 3], greedy(n)))
    run_to_end(engine)
    batch_sizes = [b for b, _, _ in calls]
    assert batch_sizes == sorted(batch_sizes, reverse=True) and batch_sizes[0] == 3 and batch_sizes[-1] == 1
    assert all(span == needed for _, span, needed in calls)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_sampled_logprobs_match_teacher_forced_hf(arch: str) -> None:
    hf = tiny_hf_model(arch)
    engine = make_engine(hf, capacity=3, seed=7)
    for i, p in enumerate(prompts(5)):
        engine.add_request(GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=12, temperature=0.7)))
    for out in run_to_end(engine).values():
        logp = (hf_logits(hf, out) / 0.7).log_softmax(-1)
        expected = logp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.8), (8, 0.6)])
def test_top_k_top_p_sample_inside_the_truncated_set_with_its_logprobs(top_k: int, top_p: float) -> None:
    hf = tiny_hf_model("llama")
    engine = make_engine(hf, capacity=3, seed=3)
    temperature = 1.5  # flatten so that truncation actually removes probable tokens
    params = SamplingParams(max_new_tokens=16, temperature=temperature, top_k=top_k, top_p=top_p)
    for i, p in enumerate(prompts(5)):
        engine.add_request(GenerationRequest(f"r{i}", p, params))
    # A greedy request in the same batch is unaffected by its neighbours' truncation.
    engine.add_request(GenerationRequest("greedy", prompts(1)[0], greedy(16)))
    outputs = run_to_end(engine)
    assert outputs.pop("greedy").token_ids == hf_greedy(hf, prompts(1)[0], 16)
    truncated_away = 0
    for out in outputs.values():
        scores = hf_logits(hf, out) / temperature
        if top_k:
            scores = TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1:
            scores = TopPLogitsWarper(top_p)(None, scores)
        tokens = torch.tensor(out.token_ids)[:, None]
        assert torch.isfinite(scores.gather(1, tokens)).all(), "sampled a token outside the top-k/top-p set"
        expected = scores.log_softmax(-1).gather(1, tokens)[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)
        truncated_away += int((~torch.isfinite(scores)).sum())
    assert truncated_away > 0


def test_sampling_is_reproducible_with_the_seed() -> None:
    hf = tiny_hf_model("qwen2")

    def sample(seed: int) -> list[list[int]]:
        engine = make_engine(hf, seed=seed)
        for i, p in enumerate(prompts(6)):
            engine.add_request(GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=10, top_p=0.9)))
        return [o.token_ids for _, o in sorted(run_to_end(engine).items())]

    assert sample(1) == sample(1)
    assert sample(1) != sample(2)


def test_stop_tokens_and_max_new_tokens() -> None:
    hf = tiny_hf_model("llama")
    prompt = prompts(1)[0]
    free_run = hf_greedy(hf, prompt, 10)
    stop = free_run[3]
    first = free_run.index(stop)
    engine = make_engine(hf)
    engine.add_request(GenerationRequest("stop", prompt, greedy(10, stop=(VOCAB - 1, stop))))
    engine.add_request(GenerationRequest("length", prompt, greedy(10)))
    engine.add_request(GenerationRequest("one", prompt, greedy(1)))
    engine.add_request(GenerationRequest("first-is-stop", prompt, greedy(10, stop=(free_run[0],))))
    outputs = run_to_end(engine)
    assert outputs["stop"].token_ids == free_run[: first + 1] and outputs["stop"].finish_reason == "stop"
    assert len(outputs["stop"].logprobs) == len(outputs["stop"].versions) == first + 1
    assert outputs["length"].token_ids == free_run and outputs["length"].finish_reason == "length"
    assert outputs["one"].token_ids == free_run[:1] and outputs["one"].finish_reason == "length"
    assert outputs["first-is-stop"].token_ids == free_run[:1]
    assert outputs["first-is-stop"].finish_reason == "stop"


def test_invalid_requests_raise() -> None:
    engine = make_engine(tiny_hf_model("qwen2"), max_seq_len=20)
    with pytest.raises(ValueError, match=r"'too-long'.*12 tokens.*max_new_tokens=9.*= 21.*max_seq_len=20"):
        engine.add_request(GenerationRequest("too-long", [1] * 12, greedy(9)))
    engine.add_request(GenerationRequest("fits", [1] * 12, greedy(8)))
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add_request(GenerationRequest("empty", [], greedy(4)))
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request(GenerationRequest("bad", [1], SamplingParams(max_new_tokens=4, top_p=0.0)))
    with pytest.raises(ValueError, match="outside"):
        engine.add_request(GenerationRequest("oov", [VOCAB], greedy(4)))
    assert engine.num_active() == 1


def _in_flight_run(engine: TorchEngine, weights: dict[str, torch.Tensor], ps: list[list[int]], steps_before: int) -> dict[str, GenerationOutput]:
    """Generate greedily, swap in `weights` as version 1 after `steps_before` steps, then add
    one request under the new weights."""
    for i, p in enumerate(ps):
        engine.add_request(GenerationRequest(f"r{i}", p, greedy(12)))
    outputs: dict[str, GenerationOutput] = {}
    for _ in range(steps_before):
        outputs.update((o.request_id, o) for o in engine.step())
    engine.load_weights(weights, version=1)
    engine.add_request(GenerationRequest("late", ps[0], greedy(12)))
    outputs.update(run_to_end(engine))
    return outputs


@pytest.mark.parametrize("recompute", [False, True])
def test_in_flight_weight_update(recompute: bool) -> None:
    a, b = tiny_hf_model("llama", seed=0), tiny_hf_model("llama", seed=1)
    ps = prompts(3)
    steps_before = 4  # the first step yields two tokens (prefill + decode), later steps one
    n_old = steps_before + 1
    engine = make_engine(a, recompute_kv_on_update=recompute)
    outputs = _in_flight_run(engine, b.state_dict(), ps, steps_before)
    assert engine.version == 1
    for i, p in enumerate(ps):
        out = outputs[f"r{i}"]
        assert out.versions == [0] * n_old + [1] * (12 - n_old)
        assert out.token_ids[:n_old] == hf_greedy(a, p, n_old)
        if recompute:
            assert out.token_ids[n_old:] == hf_greedy(b, p + out.token_ids[:n_old], 12 - n_old)
    if not recompute:
        # A and B disagree, and the kept (A-computed) cache still continues under B's weights.
        assert any(outputs[f"r{i}"].token_ids != hf_greedy(a, p, 12) for i, p in enumerate(ps))
        assert engine.stats.recomputed_tokens == 0
    else:
        assert engine.stats.recomputed_tokens == sum(len(p) + n_old - 1 for p in ps)
    late = outputs["late"]
    assert late.token_ids == hf_greedy(b, ps[0], 12) and late.versions == [1] * 12


def test_kept_kv_cache_differs_from_recomputed_but_uses_the_new_weights() -> None:
    a, b = tiny_hf_model("llama", seed=0), tiny_hf_model("llama", seed=1)
    ps = prompts(3)
    kept = _in_flight_run(make_engine(a), b.state_dict(), ps, 4)
    redone = _in_flight_run(make_engine(a, recompute_kv_on_update=True), b.state_dict(), ps, 4)
    # The first post-update token is drawn from a distribution over stale K/V: its log-prob
    # differs from the recomputed one.
    assert any(abs(kept[f"r{i}"].logprobs[5] - redone[f"r{i}"].logprobs[5]) > 1e-4 for i in range(3))

    # When B differs from A only in lm_head the kept cache is exact, so kept == B's greedy.
    head_only = dict(a.state_dict())
    head_only["lm_head.weight"] = b.state_dict()["lm_head.weight"]
    b_head = tiny_hf_model("llama", seed=0)
    b_head.load_state_dict(head_only)
    outputs = _in_flight_run(make_engine(a), head_only, ps, 4)
    for i, p in enumerate(ps):
        out = outputs[f"r{i}"]
        assert out.token_ids[5:] == hf_greedy(b_head, p + out.token_ids[:5], 7)


def test_receive_weights_copies_into_the_engine_tensors() -> None:
    a, b = tiny_hf_model("qwen2", seed=0), tiny_hf_model("qwen2", seed=1)
    engine = make_engine(a, recompute_kv_on_update=True)
    p = prompts(1)[0]
    engine.add_request(GenerationRequest("r", p, greedy(10)))
    engine.step()

    def receive(targets: Mapping[str, torch.Tensor]) -> int:
        # A receiver copying every HF name; the tied pair is one tensor, so twice is harmless.
        assert targets["lm_head.weight"].data_ptr() == targets["model.embed_tokens.weight"].data_ptr()
        for name, tensor in b.state_dict().items():
            targets[name].copy_(tensor)
        return 3

    assert engine.receive_weights(receive) == 3 and engine.version == 3
    out = run_to_end(engine)["r"]
    assert out.versions == [0, 0] + [3] * 8
    assert out.token_ids[2:] == hf_greedy(b, p + out.token_ids[:2], 8)


def test_receive_weights_from_another_thread_lands_between_steps() -> None:
    """A slow fake receiver in a background thread alternates weights A and B while the main
    thread decodes. With the KV cache recomputed on update, every token must be exactly what
    the weights of its stamped version give on its prefix: never a torn mix of A and B."""
    models = [tiny_hf_model("llama", seed=0), tiny_hf_model("llama", seed=1)]
    states = [m.state_dict() for m in models]
    engine = make_engine(models[0], recompute_kv_on_update=True)
    ps = prompts(7, seed=5)

    def slow_receive(version: int) -> Callable[[Mapping[str, torch.Tensor]], int]:
        def receive(targets: Mapping[str, torch.Tensor]) -> int:
            for name, target in targets.items():
                target.copy_(states[version % 2][name])
                time.sleep(0.001)  # room for a step() to run in the middle of the copy
            return version
        return receive

    done, landed = threading.Event(), []

    def updater() -> None:
        while not done.is_set():
            version = len(landed) + 1
            landed.append(engine.receive_weights(slow_receive(version)))
            time.sleep(0.005)

    thread = threading.Thread(target=updater)
    thread.start()
    outputs: dict[str, GenerationOutput] = {}
    try:
        # Keep the engine busy with sequences of varied lengths until four updates landed.
        while len(landed) < 4 or engine.num_active():
            while len(landed) < 4 and engine.num_active() < engine.capacity:
                i = len(outputs) + engine.num_active()
                engine.add_request(GenerationRequest(f"r{i}", ps[i % 7], greedy(8 + i % 7)))
            outputs.update((o.request_id, o) for o in engine.step())
    finally:
        done.set()
        thread.join()
    assert landed == list(range(1, len(landed) + 1))
    assert any(len(set(out.versions)) > 1 for out in outputs.values()), "no update landed mid-sequence"
    for out in outputs.values():
        assert out.versions == sorted(out.versions)
        reference = [hf_logits(m, out).log_softmax(-1) for m in models]
        for j, (token, logprob, version) in enumerate(zip(out.token_ids, out.logprobs, out.versions)):
            expected = reference[version % 2][j]
            assert token == int(expected.argmax()), (out.request_id, j, version)
            assert abs(logprob - float(expected[token])) < 1e-4, (out.request_id, j, version)


def test_failed_receive_stops_the_engine() -> None:
    engine = make_engine(tiny_hf_model("qwen2"))
    engine.add_request(GenerationRequest("r", prompts(1)[0], greedy(4)))

    def broken(targets: Mapping[str, torch.Tensor]) -> int:
        next(iter(targets.values())).zero_()
        raise TimeoutError("writer crashed mid-publish")

    with pytest.raises(TimeoutError):
        engine.receive_weights(broken)
    with pytest.raises(RuntimeError, match="mix of two versions"):
        engine.step()


def test_sliding_window_shorter_than_max_seq_len_is_refused_at_start() -> None:
    hf = tiny_hf_model("mistral", sliding_window=32)
    make_engine(hf, max_seq_len=32)
    with pytest.raises(ValueError, match="sliding_window=32.*64 positions.*engine.max_seq_len"):
        make_engine(hf, max_seq_len=64)


def test_from_pretrained(tmp_path: Path) -> None:
    hf = tiny_hf_model("qwen2")
    hf.save_pretrained(tmp_path / "model")
    engine = TorchEngine.from_pretrained(tmp_path / "model", EngineOptions(capacity=2, max_seq_len=32))
    p = prompts(1)[0]
    engine.add_request(GenerationRequest("r", p, greedy(8)))
    assert run_to_end(engine)["r"].token_ids == hf_greedy(hf, p, 8)
    with pytest.raises(FileNotFoundError, match="missing-model"):
        TorchEngine.from_pretrained(tmp_path / "missing-model", EngineOptions(capacity=2, max_seq_len=32))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_engine_matches_cpu(arch: str) -> None:
    hf = tiny_hf_model(arch)
    cpu, gpu = make_engine(hf), make_engine(hf, device="cuda")
    for engine in (cpu, gpu):
        for i, p in enumerate(prompts(6)):
            engine.add_request(GenerationRequest(f"r{i}", p, greedy(10)))
    expected, got = run_to_end(cpu), run_to_end(gpu)
    for key, out in expected.items():
        assert got[key].token_ids == out.token_ids
        torch.testing.assert_close(torch.tensor(got[key].logprobs), torch.tensor(out.logprobs), atol=1e-3, rtol=0)
