"""The torch engine's multi-turn path: held requests, stop sequences, extend and release."""

from __future__ import annotations

import pytest
import torch

from pipelinerl.engine.torch_engine import TorchEngine
from pipelinerl.types import GenerationOutput, GenerationRequest, SamplingParams

torch.set_num_threads(1)

from test_torch_engine import hf_greedy, make_engine, prompts, run_to_end  # noqa: E402
from tiny_models import ARCHS, VOCAB, tiny_hf_model  # noqa: E402


def greedy(n: int, sequences: tuple[tuple[int, ...], ...] = ()) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, stop_sequences=sequences)


def sampled(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=1.0)


def step_until(engine: TorchEngine, request_id: str) -> GenerationOutput:
    for _ in range(200):
        for out in engine.step():
            if out.request_id == request_id:
                return out
    raise AssertionError(f"{request_id} never finished a turn")


@torch.no_grad()
def teacher_forced(hf: torch.nn.Module, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(tokens | prefix) under `hf`, one per token."""
    logits = hf(torch.tensor([prefix + tokens])).logits[0, len(prefix) - 1 : -1]
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_kept_across_turns_equals_a_full_prefill_of_the_conversation(arch: str) -> None:
    hf = tiny_hf_model(arch)
    prompt, reply = prompts(1)[0], [7, 3, 11]
    held = make_engine(hf)
    held.add_request(GenerationRequest("c", prompt, greedy(5), hold=True))
    turn1 = step_until(held, "c")
    assert held.num_active() == 1 and held.num_running() == 0  # parked, holding its slot
    prefill_before = held.stats.prefill_tokens
    held.extend("c", reply, greedy(6))
    turn2 = step_until(held, "c")
    # Only the environment's tokens and the turn's last token were computed again.
    assert held.stats.prefill_tokens == prefill_before and held.stats.extended_tokens == 3
    conversation = prompt + turn1.token_ids + reply
    fresh = make_engine(hf)
    fresh.add_request(GenerationRequest("f", conversation, greedy(6)))
    again = run_to_end(fresh)["f"]
    assert turn2.token_ids == again.token_ids == hf_greedy(hf, conversation, 6)
    torch.testing.assert_close(torch.tensor(turn2.logprobs), torch.tensor(again.logprobs), atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(turn2.logprobs), teacher_forced(hf, conversation, turn2.token_ids),
                               atol=1e-4, rtol=0)
    held.release("c")
    assert held.num_active() == 0


def test_a_turn_ends_on_a_stop_sequence_generated_in_that_turn() -> None:
    hf = tiny_hf_model("qwen2")
    prompt = prompts(1)[0]
    expected = hf_greedy(hf, prompt, 12)
    stop = tuple(expected[3:5])  # the greedy run produces it at tokens 3-4
    assert stop not in {tuple(expected[i : i + 2]) for i in range(3)}, "pick another prompt"
    engine = make_engine(hf)
    engine.add_request(GenerationRequest("c", prompt, greedy(12, (stop, (VOCAB - 1, 0, 1))), hold=True))
    out = step_until(engine, "c")
    assert out.token_ids == expected[:5] and out.finish_reason == "stop"
    # The next turn must generate the sequence anew: the tail of the previous turn and the
    # environment's tokens never count.
    engine.extend("c", [stop[0]], greedy(1, ((stop[0], stop[1]),)))
    out2 = step_until(engine, "c")
    assert len(out2.token_ids) == 1


@pytest.mark.parametrize("recompute", [False, True])
def test_parked_sequences_do_not_disturb_the_others(recompute: bool) -> None:
    """Held requests park between turns while the others decode, admit and finish around them:
    every sequence gets exactly what it gets alone (greedy)."""
    hf = tiny_hf_model("llama")
    engine = make_engine(hf, capacity=4, recompute_kv_on_update=recompute)
    ps = prompts(7, seed=3)
    for i in range(3):
        engine.add_request(GenerationRequest(f"h{i}", ps[i], greedy(2 + i), hold=True))
    for i in range(3, 7):
        engine.add_request(GenerationRequest(f"p{i}", ps[i], greedy(3 + 2 * (i % 3))))
    outputs: dict[str, list[GenerationOutput]] = {}
    replies = {f"h{i}": [i + 1, i + 2] for i in range(3)}
    turns = {rid: 0 for rid in replies}
    while engine.num_active():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
            if out.request_id in turns:
                turns[out.request_id] += 1
                if turns[out.request_id] < 3:
                    engine.extend(out.request_id, replies[out.request_id], greedy(3))
                else:
                    engine.release(out.request_id)
        assert engine.num_running() + engine.num_parked() <= engine.capacity
    for i in range(3, 7):
        assert outputs[f"p{i}"][0].token_ids == hf_greedy(hf, ps[i], 3 + 2 * (i % 3))
    for i in range(3):
        rid, context = f"h{i}", list(ps[i])
        for t, out in enumerate(outputs[rid]):
            n = 2 + i if t == 0 else 3
            assert out.token_ids == hf_greedy(hf, context, n), (rid, t)
            context += out.token_ids + replies[rid]


@pytest.mark.parametrize("recompute", [False, True])
def test_versions_continue_across_turns_with_an_update_between_them(recompute: bool) -> None:
    """Turn 1 under version 0, a weight update while the sequence waits for its environment,
    turn 2 under version 1. Turn 1's log-probs are the old model's (teacher-forced, 1e-4); with
    recomputed K/V, turn 2's are exactly the new model's over the whole conversation."""
    old, new = tiny_hf_model("qwen2", seed=0), tiny_hf_model("qwen2", seed=1)
    engine = make_engine(old, recompute_kv_on_update=recompute)
    prompt, reply = prompts(1)[0], [5, 9]
    engine.add_request(GenerationRequest("c", prompt, sampled(6), hold=True))
    turn1 = step_until(engine, "c")
    engine.load_weights(new.state_dict(), version=1)
    engine.extend("c", reply, sampled(6))
    turn2 = step_until(engine, "c")
    assert turn1.versions == [0] * len(turn1.token_ids) and turn2.versions == [1] * len(turn2.token_ids)
    torch.testing.assert_close(torch.tensor(turn1.logprobs), teacher_forced(old, prompt, turn1.token_ids),
                               atol=1e-4, rtol=0)
    conversation = prompt + turn1.token_ids + reply
    exact = teacher_forced(new, conversation, turn2.token_ids)
    if recompute:
        torch.testing.assert_close(torch.tensor(turn2.logprobs), exact, atol=1e-4, rtol=0)
    else:  # the cache of turn 1 and before was computed by the old weights
        assert not torch.allclose(torch.tensor(turn2.logprobs), exact, atol=1e-4, rtol=0)


def test_extend_and_release_refuse_what_is_not_parked() -> None:
    engine = make_engine(tiny_hf_model("qwen2"), max_seq_len=16)
    engine.add_request(GenerationRequest("c", [1, 2, 3], greedy(3), hold=True))
    with pytest.raises(ValueError, match="not held"):
        engine.extend("c", [1], greedy(1))  # still queued
    step_until(engine, "c")
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.extend("c", [1] * 5, greedy(6))  # 6 + 5 + 6 > 16
    with pytest.raises(ValueError, match="outside"):
        engine.extend("c", [VOCAB], greedy(1))
    engine.extend("c", [4], greedy(1))
    with pytest.raises(ValueError, match="already being extended"):
        engine.extend("c", [4], greedy(1))
    with pytest.raises(ValueError, match="not held"):
        engine.release("other")
    step_until(engine, "c")
    engine.release("c")
    assert engine.num_active() == 0


def test_abort_drops_a_request_in_every_state_and_the_others_are_undisturbed() -> None:
    """Queued, decoding, parked and parked-with-an-extension-pending requests are aborted:
    none of them comes back, their slots free, and every other sequence gets exactly what it
    gets alone (greedy)."""
    hf = tiny_hf_model("llama")
    engine = make_engine(hf, capacity=4)
    ps = prompts(6, seed=5)
    engine.add_request(GenerationRequest("parked", ps[0], greedy(1), hold=True))
    engine.add_request(GenerationRequest("extending", ps[1], greedy(1), hold=True))
    engine.add_request(GenerationRequest("decoding", ps[2], greedy(20)))
    engine.add_request(GenerationRequest("kept", ps[3], greedy(12)))
    engine.add_request(GenerationRequest("queued", ps[4], greedy(5)))  # no slot yet
    first = {o.request_id for o in engine.step()}  # admits four: held ones end their turn
    assert first == {"parked", "extending"} and engine.num_parked() == 2
    engine.extend("extending", [1, 2], greedy(4))  # runs at the next step: aborted before
    for rid in ("queued", "decoding", "parked", "extending"):
        assert engine.abort(rid), rid
        assert not engine.abort(rid), rid  # gone
    assert engine.num_active() == 1 and engine.num_parked() == 0
    engine.add_request(GenerationRequest("late", ps[5], greedy(6)))  # into a freed slot
    outputs = run_to_end(engine)
    assert set(outputs) == {"kept", "late"}
    assert outputs["kept"].token_ids == hf_greedy(hf, ps[3], 12)
    assert outputs["late"].token_ids == hf_greedy(hf, ps[5], 6)
    with pytest.raises(ValueError, match="not held"):
        engine.extend("parked", [1], greedy(1))
