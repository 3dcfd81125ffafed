"""Multi-turn rollouts: environment tokens are fed but never trained, provenance across turns,
environment calls off the decode loop (issue: multi-turn and tool use)."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
import torch
from fake_tasks import FakeEnv
from test_actor import ListWriter, decode, encode, make_actor, stop_after
from test_rl import _FixedLogitsModel
from tiny_models import tiny_hf_model

from pipelinerl.engine import EngineOptions
from pipelinerl.engine.torch_engine import TorchEngine
from pipelinerl.rl.packing import pack
from pipelinerl.roles.actor import Schedule
from pipelinerl.types import ENV_VERSION, Group, Sample, SamplingParams

torch.set_num_threads(1)


def test_gradient_is_exactly_zero_on_environment_tokens() -> None:
    """Sample 0 is prompt [0] + model, model, env, env, model tokens: input position p predicts
    completion token p. The loss's gradient on the logits at the positions predicting the
    environment's tokens is exactly 0, and not at the model's; lag and ESS count 3 + 2 tokens."""
    from pipelinerl.config import ActorConfig, Config, EngineConfig, TrainerConfig
    from pipelinerl.rl.step import rl_step

    row = [math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]
    model = _FixedLogitsModel(torch.tensor([row] * 5 + [row] * 2))
    multi = Sample(prompt_ids=[0], token_ids=[1, 2, 3, 0, 1],
                   logprobs=[math.log(0.3), math.log(0.2), 0.0, 0.0, math.log(0.3)],
                   versions=[2, 2, ENV_VERSION, ENV_VERSION, 3], reward=1.0, success=True,
                   finish_reason="stop", model_mask=[True, True, False, False, True], turns=2)
    single = Sample(prompt_ids=[0], token_ids=[2, 3], logprobs=[math.log(0.2), math.log(0.1)],
                    versions=[3, 3], reward=0.0, success=False, finish_reason="stop")
    (batch,) = pack([multi, single], [1.0, -1.0], max_tokens_per_row=64)
    assert batch.num_tokens == 5 and ENV_VERSION not in batch.versions.tolist()
    assert batch.input_ids[0, :5].tolist() == [0, 1, 2, 3, 0]  # environment tokens are fed
    cfg = Config(engine=EngineConfig(temperature=1.0, top_k=0, top_p=1.0),
                 actor=ActorConfig(group_size=2),
                 trainer=TrainerConfig(batch_size=2, max_tokens_per_row=64))
    metrics = rl_step(model, torch.optim.SGD(model.parameters(), lr=0.0),
                      [Group(group_id="g", prompt="p", samples=[multi, single])], cfg,
                      trainer_version=3)
    grad = model.table.grad
    # Packed longest first: the multi-turn sample holds positions 0-4 of the row.
    assert torch.equal(grad[2], torch.zeros(4)) and torch.equal(grad[3], torch.zeros(4))
    assert all(grad[p].abs().sum() > 0 for p in (0, 1, 4, 5, 6))
    assert metrics["lag_hist"] == {"0": 3, "1": 2}
    assert metrics["ess"] == pytest.approx(1.0)


def char_of(token: int) -> str:
    """A character that `encode` maps to `token`."""
    return chr(token - 1 + 49)


def multiturn_actor(hang: frozenset[str] = frozenset(), fail: frozenset[str] = frozenset(),
                    **kwargs: Any) -> tuple[Any, Any, TorchEngine]:
    """An actor on a real engine whose greedy first token is the environment's turn stop, so
    every rollout has at least two model turns."""
    hf = tiny_hf_model("qwen2")
    engine = TorchEngine(hf.config, EngineOptions(capacity=4, max_seq_len=40))
    engine.load_weights(hf.state_dict(), version=0)
    prompt = "abcd"
    first = int(hf(torch.tensor([encode(prompt)])).logits[0, -1].argmax())
    env = FakeEnv(stop=char_of(first), reply="xy", turn_reward=0.25, env_hang=hang,
                  env_fail=fail, prompt=prompt)
    actor = make_actor(engine, env, Schedule(batch_size=4, group_size=2, max_lag=100),
                       engine_cfg={"max_new_tokens": 12, "temperature": 0.0}, env_workers=3,
                       **kwargs)
    return actor, hf, engine


@torch.no_grad()
def test_rollouts_carry_exact_provenance_across_turns() -> None:
    actor, hf, _ = multiturn_actor(should_stop=stop_after(60))
    actor.run(max_groups=3)
    groups = [Group.from_dict(r) for r in actor.streams.writer.records if "samples" in r]
    assert len(groups) >= 3
    reply = encode("xy")
    for s in (s for g in groups for s in g.samples):
        assert s.turns >= 2 and s.model_mask is not None and not all(s.model_mask)
        env = [j for j, m in enumerate(s.model_mask) if not m]
        assert [s.token_ids[j] for j in env] == reply * (len(env) // 2)
        assert all(s.versions[j] == ENV_VERSION and s.logprobs[j] == 0.0 for j in env)
        # Model tokens: greedy, with the log-probs of a teacher-forced pass over the whole
        # conversation (the environment's tokens as context).
        logits = hf(torch.tensor([s.prompt_ids + s.token_ids])).logits[0, len(s.prompt_ids) - 1 : -1]
        model = [j for j, m in enumerate(s.model_mask) if m]
        expected = logits.log_softmax(-1)[model, torch.tensor(s.token_ids)[model]]
        torch.testing.assert_close(torch.tensor([s.logprobs[j] for j in model]), expected,
                                   atol=1e-4, rtol=0)
        assert all(s.token_ids[j] == int(logits[j].argmax()) for j in model)
        assert s.reward % 1 == pytest.approx(0.25 * (s.turns - 1) % 1)  # per-turn rewards added
    stats = groups[-1].actor_stats
    assert stats["env_calls"] >= 6 and stats["env_latency_mean_s"] > 0


def test_a_hanging_tool_is_counted_and_does_not_block_other_sequences() -> None:
    published: list[tuple[float, str]] = []

    class TimedWriter(ListWriter):
        def write(self, record: dict[str, Any]) -> None:
            published.append((time.monotonic(), record.get("group_id", "")))
            super().write(record)

    actor, _, _ = multiturn_actor(hang=frozenset({"fake:0"}), fail=frozenset({"fake:1"}),
                                  writer=TimedWriter(), env_timeout_s=4.0)
    t0 = time.monotonic()
    timed_out: list[float] = []

    def should_stop() -> bool:
        if actor.stats.skipped["env_timeout"] and not timed_out:
            timed_out.append(time.monotonic())
        return bool(timed_out) or time.monotonic() - t0 > 60

    actor.streams.should_stop = should_stop
    actor.run()
    assert actor.stats.skipped["env_timeout"] == 1 and actor.stats.skipped["env_error"] == 1
    # Groups went on being published while the hanging call waited for its deadline: in the
    # env_timeout_s before it was counted (measured from then, not from the start: under load
    # the env workers' start-up alone took most of a window counted from t0).
    during = [g for t, g in published if timed_out[0] - 4.0 <= t < timed_out[0] and g]
    assert len(during) >= 2, (published, timed_out)
    snapshot = actor.snapshot()
    assert snapshot["env_timeouts"] == 2 and snapshot["env_errors"] == 2  # two attempts each
    assert 0 < snapshot["env_wait_frac"] <= 1


class ScriptedEngine:
    """Records what the rollouts ask of an engine (extend, release); generates nothing."""

    def __init__(self) -> None:
        self.extended: list[tuple[str, list[int], int]] = []
        self.released: list[str] = []

    def extend(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        self.extended.append((request_id, token_ids, params.max_new_tokens))

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def turn(request_id: str, tokens: list[int], finish: str = "stop") -> Any:
    from pipelinerl.types import GenerationOutput

    return GenerationOutput(request_id, [1], tokens, [-0.5] * len(tokens), [7] * len(tokens), finish)


def wait_for_replies(rollouts: Any, count: int) -> list[Any]:
    ended: list[Any] = []
    deadline = time.monotonic() + 30
    while rollouts.waiting() and time.monotonic() < deadline:
        rollouts.pool.wait(0.05)
        ended += rollouts.poll()
    assert not rollouts.waiting()
    return ended


def test_rollout_ends_on_the_model_stop_on_done_on_max_turns_and_on_budget() -> None:
    from pipelinerl.envs.rollout import Rollouts
    from pipelinerl.tasks.base import Problem

    env = FakeEnv(stop="q", reply="xy", turn_reward=0.5)  # encode("q") = [16]; max_turns 3
    engine = ScriptedEngine()
    rollouts = Rollouts(env, engine, encode, decode,
                        SamplingParams(max_new_tokens=12, stop_token_ids=(0,)), 10.0, 1)
    problem = Problem("fake:0", "abcd", None)
    try:
        # The model's own stop token ends the rollout at once, no environment call.
        rollouts.request("a", problem, [1])
        done = rollouts.on_turn(turn("a", [5, 0]))
        assert done.finish_reason == "stop" and done.ends_with_stop_token and done.model_turns == 1
        # Three turns ending on the turn stop: two replies appended, the third (at max_turns)
        # answered but not appended, the rollout cut short as truncated.
        rollouts.request("b", problem, [1])
        assert rollouts.on_turn(turn("b", [5, 16])) is None
        assert wait_for_replies(rollouts, 1) == []
        assert engine.extended[-1] == ("b", encode("xy"), 12 - 2 - 2)  # budget left for turn 2
        assert rollouts.on_turn(turn("b", [16])) is None
        wait_for_replies(rollouts, 1)
        assert rollouts.on_turn(turn("b", [4, 16])) is None
        (cut,) = wait_for_replies(rollouts, 1)
        assert cut.finish_reason == "length" and cut.model_turns == 3 and cut.turn_reward == 1.5
        assert cut.model_mask == [True, True, False, False, True, False, False, True, True]
        assert cut.versions == [7, 7, -1, -1, 7, -1, -1, 7, 7] and engine.released == ["a", "b"]
        # A reply that leaves the model no token ends the rollout as truncated.
        rollouts.request("c", problem, [1])
        assert rollouts.on_turn(turn("c", [3] * 9 + [16])) is None
        (full,) = wait_for_replies(rollouts, 1)
        assert full.finish_reason == "length" and len(full.token_ids) == 10
    finally:
        rollouts.close()


def _slow_first_rollouts(reply_delay: int | None) -> tuple[Any, ScriptedEngine]:
    """Rollouts over an environment that answers problem fake:0 in 0.3 s and fake:1 at once,
    two workers; turns "slow" (fake:0) and "fast" (fake:1) asked at decode step 5."""
    from pipelinerl.envs.rollout import Rollouts
    from pipelinerl.tasks.base import Problem

    env = FakeEnv(stop="q", env_slow=frozenset({"fake:0"}))  # encode("q") = [16]
    engine = ScriptedEngine()
    rollouts = Rollouts(env, engine, encode, decode,
                        SamplingParams(max_new_tokens=12, stop_token_ids=(0,)), 10.0, 2,
                        reply_delay)
    for rid, pid in (("slow", "fake:0"), ("fast", "fake:1")):
        rollouts.request(rid, Problem(pid, "abcd", None), [1])
        assert rollouts.on_turn(turn(rid, [5, 16]), decode_steps=5) is None
    return rollouts, engine


def test_deterministic_replies_are_applied_at_their_decode_step_in_turn_order() -> None:
    # Free-running, the fast reply would be applied first, as it comes back.
    rollouts, engine = _slow_first_rollouts(reply_delay=2)
    try:
        time.sleep(0.1)  # the fast reply is back, the slow one not yet
        assert rollouts.poll(decode_steps=6) == [] and engine.extended == []
        assert rollouts.waiting() == 2
        t0 = time.monotonic()
        assert rollouts.poll(decode_steps=7) == []  # due: waits for the slow one, then both
        assert time.monotonic() - t0 > 0.05
        assert [rid for rid, _, _ in engine.extended] == ["slow", "fast"]
        assert rollouts.waiting() == 0 and rollouts.stats.counts()["calls"] == 2
    finally:
        rollouts.close()
    # With nothing left to decode the decode clock stands: every reply asked is taken now.
    rollouts, engine = _slow_first_rollouts(reply_delay=100)
    try:
        rollouts.poll(decode_steps=5, idle=True)
        assert [rid for rid, _, _ in engine.extended] == ["slow", "fast"]
    finally:
        rollouts.close()
