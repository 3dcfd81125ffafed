"""reasoning-gym's datasets as a task: prompts, extraction, the dataset's own grader, the
held-out split, refusals at start. The real package (the `reasoning-gym` extra)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from pipelinerl.rollouts.scoring import check_sendable
from pipelinerl.tasks import Score, heldout_problems, make_task, make_train_task
from pipelinerl.tasks.reasoning import extract_answer

EASY_SUMS = {"dataset": "chain_sum", "extract": "last_word",
             "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}


def test_extraction_reads_the_answer_out_of_a_sentence() -> None:
    text = "Let me count.\nThe letter appears 3 times.\nAnswer: 3."
    assert extract_answer(text, "last_line") == "3"
    assert extract_answer("It is 12.", "last_word") == "12"
    assert extract_answer("I think <answer>a</answer> no, <answer> b </answer>", "tag") == "b"
    assert extract_answer("no tags here", "tag") == ""
    assert extract_answer("  as is \n", "raw") == "as is"


def test_the_reward_is_the_datasets_own_grade_partial_credit_kept() -> None:
    task = make_task("reasoning_gym", EASY_SUMS)
    problem = task.sample_problem(random.Random(0))
    entry = task.dataset[problem.answer]
    assert problem.prompt == entry["question"] + " Answer with just the answer."
    assert task.score(problem, f"The sum is {entry['answer']}.") == Score(1.0, True)
    assert task.score(problem, "I do not know") == Score(0.0, False)
    # spell_backward grades a near miss in (0, 1): the grade is the reward, below success.
    spell = make_task("reasoning_gym", {"dataset": "spell_backward", "extract": "raw"})
    problem = spell.sample_problem(random.Random(1))
    answer = spell.dataset[problem.answer]["answer"]
    score = spell.score(problem, answer[:-1] + "#")
    assert 0.0 < score.reward < 1.0 and not score.success
    assert score.reward == spell.dataset.score_answer(answer=answer[:-1] + "#",
                                                      entry=spell.dataset[problem.answer])


def test_several_datasets_mix_by_weight_through_reasoning_gyms_composite() -> None:
    task = make_task("reasoning_gym", {"datasets": [
        {"name": "chain_sum", "weight": 3, "config": {"max_terms": 2}},
        {"name": "letter_counting", "weight": 1}]})
    rng = random.Random(0)
    sources = [task.dataset[task.sample_problem(rng).answer]["metadata"]["source_dataset"]
               for _ in range(400)]
    assert 0.65 < sources.count("chain_sum") / len(sources) < 0.85
    check_sendable(task)  # the verifier workers get it (and regenerate entries from indices)


def test_held_out_questions_never_reach_training() -> None:
    """1-digit sums form a small space (100 questions): indices repeat questions, and only a
    split by question keeps the held-out ones away from training."""
    train = make_train_task("reasoning_gym", EASY_SUMS, heldout_frac=0.2)
    held = {p.problem_id for p in heldout_problems(train.task, 40, seed=0, heldout_frac=0.2)}
    rng = random.Random(1)
    drawn = {train.sample_problem(rng).problem_id for _ in range(3000)}
    assert held and len(drawn) > 50 and not held & drawn


@pytest.mark.parametrize("params,message", [
    ({"dataset": "chain_summ"}, "unknown reasoning-gym dataset 'chain_summ'; did you mean ['chain_sum'"),
    ({"dataset": "chain_sum", "config": {"bogus": 1}}, "unexpected keyword argument 'bogus'"),
    ({"dataset": "chain_sum", "config": {"min_terms": 5, "max_terms": 2}}, "max_terms must be >= min_terms"),
    ({"datasets": [{"name": "chain_sum", "weigth": 1}]}, "unknown key(s) ['weigth']"),
    ({"dataset": "chain_sum", "extract": "first"}, "extract must be one of"),
])
def test_bad_names_and_configs_fail_naming_them(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match="task 'reasoning_gym'") as err:
        make_task("reasoning_gym", params)
    assert message in str(err.value)


def test_the_cli_refuses_an_unknown_dataset_before_starting_anything(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parents[1] / "examples" / "arithmetic.yaml"
    out = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "train", str(example),
                          "task.name=reasoning_gym", "task.params={dataset: chain_summ}",
                          f"output_dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "unknown reasoning-gym dataset 'chain_summ'" in out.stderr.strip().splitlines()[-1]
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_the_reasoning_gym_example_trains_and_evaluates_through_the_cli_on_a_tiny_model(
        tmp_path: Path, tiny_smollm2_dir: Path) -> None:
    """examples/reasoning_gym.yaml as a user runs it, its model swapped for a tiny one with
    SmolLM2's tokenizer and template (SmolLM2 itself: tests/test_real_model.py)."""
    import json

    example = Path(__file__).resolve().parents[1] / "examples" / "reasoning_gym.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "pipelinerl.cli", "train", str(example), "name=rg",
         f"model.path={tiny_smollm2_dir}",
         f"output_dir={tmp_path}", "trainer.max_steps=3", "trainer.max_time_s=0",
         "trainer.batch_size=8", "actor.group_size=4", "engine.capacity=8",
         "engine.max_new_tokens=16", "actor.drop_zero_variance=false", "eval.num_problems=8",
         "metrics.progress=false", "metrics.plot=false"],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "rg" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    evals = {r["eval/version"]: r for r in rows if "eval/version" in r}
    assert {0, 3} <= set(evals)
    assert all(0.0 <= r["eval/greedy"] <= 1.0 and 0.0 <= r["eval/sampled/pass@1"] <= 1.0
               for r in evals.values())
