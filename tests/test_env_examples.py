"""The example environments: chain arithmetic with a calculator tool (built in,
examples/calculator.yaml) and guessing a number from hints (user code, examples/guess_number.py)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from pipelinerl.tasks import make_task
from pipelinerl.tasks.calculator import calculate
from pipelinerl.tasks.environment import Turn

ROOT = Path(__file__).resolve().parent.parent


def test_calculator_reads_sums_and_refuses_the_rest() -> None:
    assert calculate("08+7-05") == "10" and calculate("3-9") == "-6"
    for bad in ("", "1+", "+1", "2*3", "1+(2)", "9" * 12, "1 + 2"):
        assert calculate(bad) == "error", bad


def test_calculator_environment_answers_the_last_call_and_verifies_the_transcript() -> None:
    task = make_task("calculator", {"tool_demo_prob": 1.0})
    rng = random.Random(0)
    problem = task.sample_problem(rng)
    demo = task.demonstration(problem, rng, 0.5)
    call, rest = demo.split("</calc>")
    reply = task.respond(problem, [Turn("model", call + "</calc>")])
    assert not reply.done and rest.startswith(reply.text)  # the demonstration shows the reply
    assert task.score(problem, demo).success
    assert task.respond(problem, [Turn("model", "<calc>1*2</calc>")]).text == "<res>error</res>"
    by_hand = make_task("calculator", {"tool_demo_prob": 0.0}).demonstration(problem, rng, 0.0)
    assert "<calc>" not in by_hand and task.score(problem, by_hand).success
    with pytest.raises(ValueError, match="tool_demo_prob"):
        make_task("calculator", {"tool_demo_prob": 2})


def test_guess_number_demonstrations_replay_through_respond(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every demonstration is a conversation the environment would have had: each guess gets
    the hint the demonstration shows, the last one ends it, and it scores as found."""
    monkeypatch.chdir(ROOT / "examples")
    task = make_task("guess_number:GuessNumber", {"high": 31, "max_turns": 5})
    rng = random.Random(0)
    lengths = []
    for _ in range(100):
        problem = task.sample_problem(rng)
        demo = task.demonstration(problem, rng, 0.7)
        assert set(demo + problem.prompt) <= set(task.alphabet) and task.score(problem, demo).success
        turns: list[Turn] = []
        rest = demo
        while True:
            guess, rest = rest.split("</g>", 1)
            turns.append(Turn("model", guess + "</g>"))
            reply = task.respond(problem, turns)
            if reply.done:
                assert rest == ""
                break
            assert rest.startswith(reply.text)
            rest = rest[len(reply.text):]
            turns.append(Turn("env", reply.text))
        lengths.append(sum(t.role == "model" for t in turns))
    assert max(lengths) > 5 >= min(lengths)  # random guessing takes longer than bisection
    bisect = task.demonstration(problem, rng, 0.0)
    assert bisect.count("<g>") <= 5


@pytest.mark.slow
def test_the_calculator_example_trains_through_the_cli(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pipelinerl.cli", "train", str(ROOT / "examples" / "calculator.yaml"),
         f"output_dir={tmp_path}", f"warmstart.cache_dir={tmp_path / 'cache'}",
         "warmstart.steps=150", "trainer.max_steps=4", "trainer.max_time_s=0",
         "trainer.batch_size=16", "engine.capacity=16", "actor.group_size=4",
         "eval.num_problems=8", "metrics.progress=false",
         "metrics.plot=false"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "calculator" / "metrics.jsonl").open()]
    steps = [r for r in rows if "step" in r and "eval/version" not in r]
    assert steps[-1]["step"] == 4
    assert all(r["turns_mean"] >= 1 for r in steps)
    assert any(r["turns_mean"] > 1 and r["actor_env_calls"] > 0 for r in steps), \
        "some rollouts called the calculator"
    evals = [r for r in rows if "eval/version" in r]
    assert evals, "the held-out evaluation ran multi-turn rollouts"
