"""OpenEnv environments (docs/environments.md, "OpenEnv environments") against a real OpenEnv
server: examples/openenv_guess.py's app, served by uvicorn on 127.0.0.1 as a run starts it,
talked to through openenv-core's own client. A server that crashes mid-run (killed) and one
that hangs (stopped) are counted, and the run goes on; one that does not start stops the task
in one line.

The rollouts are driven by the scripted engine of test_multiturn (the model's turns are
written here), so each step's tokens are known."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from test_multiturn import ScriptedEngine, turn, wait_for_replies
from tool_kit.templates import family_tokenizer

from pipelinerl.envs.openenv import OpenEnvTask
from pipelinerl.envs.rollout import Rollouts
from pipelinerl.tasks import make_task
from pipelinerl.tasks.base import Problem
from pipelinerl.types import ENV_VERSION, SamplingParams

pytest.importorskip("openenv.core")

EXAMPLES = Path(__file__).parents[1] / "examples"
TOKENIZER = family_tokenizer("chatml")
EOS = TOKENIZER.eos_token_id
PROMPT = "Guess my number, as <action>N</action>.\n{observation}"


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def decode(ids: list[int]) -> str:
    return TOKENIZER.decode(ids, skip_special_tokens=True)


def secret(seed: int) -> int:
    return random.Random(seed).randint(1, 8)  # what the example's reset draws


@pytest.fixture(scope="module", autouse=True)
def examples_on_path() -> Iterator[None]:
    """The app's module is found as a user's would be: on PYTHONPATH."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXAMPLES), old) if p)
    yield
    if old is None:
        del os.environ["PYTHONPATH"]
    else:
        os.environ["PYTHONPATH"] = old


def _task(**params: Any) -> OpenEnvTask:
    task = make_task("openenv:guess", {"prompt": PROMPT, "max_turns": 4, "timeout_s": 5,
                                       **params})
    assert isinstance(task, OpenEnvTask)
    return task


@pytest.fixture(scope="module")
def task() -> Iterator[OpenEnvTask]:
    t = _task(app="openenv_guess:app")
    yield t
    t.server.stop()


def _rollouts(task: OpenEnvTask, timeout_s: float = 5.0) -> tuple[Rollouts, ScriptedEngine]:
    engine = ScriptedEngine()
    rollouts = Rollouts(task, engine, encode, decode,
                        SamplingParams(max_new_tokens=600, stop_token_ids=(EOS,)), timeout_s, 1,
                        None, lambda t: TOKENIZER.decode([t]))
    return rollouts, engine


def _play(rollouts: Rollouts, rid: str, text: str) -> Any:
    """One model turn; the transcript if the rollout ended (at once, or on the reply)."""
    ended = rollouts.on_turn(turn(rid, encode(text)))
    if ended is not None:
        return ended
    ended = wait_for_replies(rollouts, 1)
    return ended[0] if ended else None


def test_an_episode_is_played_through_the_server_its_prompt_the_first_observation(
        task: OpenEnvTask) -> None:
    problem = task.problem(3)
    assert problem.problem_id == "openenv:guess:3"
    assert problem.prompt == PROMPT.format(
        observation="I think of a number from 1 to 8. You have 4 guesses. Your guess?")
    rollouts, engine = _rollouts(task)
    try:
        rollouts.request("g-0", problem, encode(problem.prompt))
        wrong = 1 if secret(3) != 1 else 2
        assert _play(rollouts, "g-0", f"I say <action>{wrong}</action>") is None
        rid, ids, _ = engine.extended[-1]
        hint = "higher" if wrong < secret(3) else "lower"
        assert rid == "g-0" and decode(ids) == f"\n<observation>{hint}. 3 guesses left." \
                                              "</observation>\n"
        t = _play(rollouts, "g-0", f"<action>{secret(3)}</action>")
        assert t.finish_reason == "stop" and t.turn_reward == 1.0 and t.model_turns == 2
        # The observation's tokens are the environment's: fed, never trained.
        env = [i for i, m in enumerate(t.model_mask) if not m]
        assert env and all(t.versions[i] == ENV_VERSION and t.logprobs[i] == 0.0 for i in env)
        assert [c["arguments"] for c in t.tool_calls] == [{"guess": str(wrong)},
                                                          {"guess": str(secret(3))}]
        assert t.tool_calls[-1]["reply"] == "correct" and t.tool_calls[-1]["done"]
        assert engine.released == ["g-0"]
        assert rollouts.pool.snapshot()["openenv_steps"] == 2
    finally:
        rollouts.close()


def test_many_rollouts_each_play_their_own_episode_at_once_bounded(task: OpenEnvTask) -> None:
    bounded = _task(url=task.url, max_sessions=4)
    rollouts, _ = _rollouts(bounded)
    try:
        seeds = range(24)
        for s in seeds:  # every episode's first guess at once: 24 sessions, 4 open at a time
            problem = bounded.problem(s)
            rollouts.request(f"g{s}-0", problem, encode(problem.prompt))
            assert rollouts.on_turn(turn(f"g{s}-0", encode(f"<action>{secret(s)}</action>"))
                                    ) is None
        ended = wait_for_replies(rollouts, len(seeds))
        assert len(ended) == len(seeds)
        assert all(t.finish_reason == "stop" and t.turn_reward == 1.0 for t in ended)
        counts = rollouts.pool.snapshot()
        assert counts["openenv_sessions"] == len(seeds) and counts["openenv_steps"] == len(seeds)
    finally:
        rollouts.close()


def test_an_action_the_model_wrote_badly_is_answered_and_counted(task: OpenEnvTask) -> None:
    strict = _task(url=task.url, action="json")
    rollouts, engine = _rollouts(strict)
    try:
        problem = strict.problem(5)
        rollouts.request("g-0", problem, encode(problem.prompt))
        assert _play(rollouts, "g-0", "<action>five</action>") is None  # not JSON
        assert "error: the action is not JSON" in decode(engine.extended[-1][1])
        assert _play(rollouts, "g-0", '<action>{"gues": "5"}</action>') is None  # no such field
        assert "does not fit the environment's action schema" in decode(engine.extended[-1][1])
        t = _play(rollouts, "g-0", json.dumps({"guess": str(secret(5))}) + "</action>")
        assert t.finish_reason == "stop" and t.turn_reward == 1.0
        assert rollouts.pool.snapshot()["openenv_bad_actions"] == 2
        assert [c["outcome"] for c in t.tool_calls] == ["bad_action", "bad_action", "ok"]
    finally:
        rollouts.close()


def test_a_session_that_resets_elsewhere_than_the_prompt_is_dropped_counted(
        task: OpenEnvTask) -> None:
    rollouts, _ = _rollouts(task)
    try:
        problem = Problem("openenv:guess:1", "x", {"seed": 1, "first": "another start"})
        rollouts.request("g-0", problem, encode("x"))
        t = _play(rollouts, "g-0", "<action>1</action>")
        assert t.finish_reason == "env_reset_mismatch"
        assert rollouts.stats.failures["env_reset_mismatch"] == 1
    finally:
        rollouts.close()


def test_a_server_that_crashes_then_one_that_hangs_are_counted_and_the_run_goes_on() -> None:
    own = _task(app="openenv_guess:app")
    rollouts, _ = _rollouts(own, timeout_s=1.5)
    try:
        for rid, seed in (("a-0", 1), ("b-0", 2)):
            rollouts.request(rid, own.problem(seed), encode("p"))
        wrong = 1 if secret(1) != 1 else 2
        assert _play(rollouts, "a-0", f"<action>{wrong}</action>") is None  # its session is open
        os.kill(own.server._proc.pid, signal.SIGKILL)  # the server crashes mid-episode
        time.sleep(0.2)
        t = _play(rollouts, "a-0", f"<action>{secret(1)}</action>")
        assert t.finish_reason == "env_crash"
        assert own.server.restarts == 1 and own.server.alive()
        t = _play(rollouts, "b-0", f"<action>{secret(2)}</action>")  # a new session: fine
        assert t.finish_reason == "stop" and t.turn_reward == 1.0

        rollouts.request("c-0", own.problem(3), encode("p"))
        assert _play(rollouts, "c-0", "<action>9</action>") is None
        os.kill(own.server._proc.pid, signal.SIGSTOP)  # the server hangs: answers nothing
        started = time.monotonic()
        t = _play(rollouts, "c-0", "<action>1</action>")
        assert t.finish_reason == "env_timeout" and time.monotonic() - started < 5
        assert rollouts.stats.failures == {"env_crash": 1, "env_timeout": 1}
        # The next episode's prompt: the hung server gives no reset, so it is started again.
        problem = own.problem(4)
        assert own.server.restarts == 2 and "guesses" in problem.prompt
        rollouts.request("d-0", problem, encode("p"))
        assert _play(rollouts, "d-0", f"<action>{secret(4)}</action>").turn_reward == 1.0
    finally:
        rollouts.close()
        own.server.stop()


def test_turns_that_end_on_the_stop_token_get_the_observation_as_the_templates_user_message(
        task: OpenEnvTask) -> None:
    chatml = "\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"
    chat = _task(url=task.url, turn_stop="", reply_format=chatml)
    rollouts, engine = _rollouts(chat)
    try:
        problem = chat.problem(6)
        rollouts.request("g-0", problem, encode(problem.prompt))
        wrong = 1 if secret(6) != 1 else 2
        sampled = encode(str(wrong)) + [EOS]
        assert rollouts.on_turn(turn("g-0", sampled)) is None
        wait_for_replies(rollouts, 1)
        reply = engine.extended[-1][1]
        # What a chat server renders for the same conversation after the sampled message.
        messages = [{"role": "user", "content": problem.prompt},
                    {"role": "assistant", "content": str(wrong)}]
        before = TOKENIZER.apply_chat_template(messages, tokenize=False)
        hint = "higher" if wrong < secret(6) else "lower"
        after = TOKENIZER.apply_chat_template(
            messages + [{"role": "user", "content": f"{hint}. 3 guesses left."}],
            tokenize=False, add_generation_prompt=True)
        assert before.endswith("<|im_end|>" + chatml.split("<|im_start|>user")[0])
        assert TOKENIZER.decode(sampled + reply) == after[before.rindex(str(wrong)):]
    finally:
        rollouts.close()


def test_a_server_that_does_not_start_or_answer_stops_the_task_in_one_line() -> None:
    with pytest.raises(ValueError) as bad_app:
        make_task("openenv:x", {"app": "no_such_module:app", "start_timeout_s": 60})
    message = str(bad_app.value)
    assert "\n" not in message and message.startswith("task 'openenv:x': the OpenEnv server")
    assert "exited with code" in message and "no_such_module" in message
    with pytest.raises(ValueError, match="an app is 'module:attribute'"):
        make_task("openenv:x", {"app": "openenv_guess"})
    with pytest.raises(ValueError, match="does not answer /health"):
        make_task("openenv:x", {"url": "http://127.0.0.1:9", "timeout_s": 1})
    with pytest.raises(ValueError, match="exactly one of task.params.app"):
        make_task("openenv:x", {})
    with pytest.raises(ValueError, match=r"unknown param\(s\) \['apps'\]"):
        make_task("openenv:x", {"apps": "a:b"})


@pytest.mark.slow
def test_pipelinerl_train_on_the_example_environment(tmp_path: Path) -> None:
    """A short whole run: the example config with a tiny random ChatML model, every message an
    action (turn_stop ""), the environment's rewards trained on."""
    from tool_kit.templates import family_model

    model = family_model("chatml", tmp_path / "model", more_stops="aeiou.")
    chatml = "\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"
    proc = subprocess.run(
        [sys.executable, "-m", "pipelinerl.cli", "train", str(EXAMPLES / "openenv_guess.yaml"),
         f"model.path={model}", f"output_dir={tmp_path / 'runs'}", "name=e2e",
         "task.params.app=examples.openenv_guess:app", 'task.params.turn_stop=""',
         f"task.params.reply_format={json.dumps(chatml)}", "eval.enabled=false",
         "trainer.max_steps=3", "trainer.max_time_s=0", "trainer.batch_size=8",
         "actor.group_size=4", "engine.capacity=8", "engine.max_new_tokens=96",
         "metrics.progress=false", "metrics.plot=false"],
        cwd=EXAMPLES.parent, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in
               (tmp_path / "runs" / "e2e" / "metrics.jsonl").read_text().splitlines()]
    last = metrics[-1]
    assert last["step"] == 3, last
    assert last["actor_openenv_steps"] > 0 and last["actor_openenv_sessions"] > 0
    print({k: v for k, v in last.items() if "openenv" in k or k in ("step", "reward_mean")})
