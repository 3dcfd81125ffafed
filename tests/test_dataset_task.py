"""The `dataset` task: local files and folders through Hugging Face `datasets`, column mapping,
named and fractional test splits, per-epoch shuffling, sharding and resuming positions, bad
rows counted and named, and user reward functions scored in real verifier processes."""

from __future__ import annotations

import json
import logging
import random
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from pipelinerl.rollouts.scoring import Scorer
from pipelinerl.tasks import (
    DatasetTask,
    Score,
    TrainSplit,
    heldout_problems,
    make_task,
    make_train_task,
)
from pipelinerl.tasks.split import is_heldout

ROWS = [{"q": f"{a}+{b}=", "sol": str(a + b), "uid": f"p{a}-{b}"} for a in range(6) for b in range(5)]

REWARDS = '''
from pipelinerl.tasks import Score

def closeness(prompt, completion, answer):
    digits = "".join(c for c in completion if c.isdigit())
    return 1.0 / (1 + abs(int(digits) - int(answer))) if digits else 0.0

def as_score(prompt, completion, answer):
    return Score(0.5, completion == answer)

def bad(prompt, completion, answer):
    return "yes"

NOT_CALLABLE = 1
'''


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((json.dumps(r) if not isinstance(r, str) else r) + "\n" for r in rows))
    return path


@pytest.fixture
def rewards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "user_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_rewards"
    sys.modules.pop("user_rewards", None)


def _task(path: Path, **params) -> DatasetTask:
    return make_task("dataset", {"path": str(path), "prompt_column": "q", "answer_column": "sol",
                                 **params})


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv", "save_to_disk", "folder"])
def test_every_local_format_loads_with_its_columns_mapped(tmp_path: Path, fmt: str) -> None:
    import datasets

    data = datasets.Dataset.from_list(ROWS)
    path = tmp_path / f"data.{fmt}"
    if fmt == "jsonl":
        _jsonl(path, ROWS)
    elif fmt == "parquet":
        data.to_parquet(str(path))
    elif fmt == "csv":
        data.to_csv(str(path), index=False)
    elif fmt == "save_to_disk":
        datasets.DatasetDict({"train": data, "test": data.select(range(3))}).save_to_disk(str(path))
    else:
        path.mkdir()
        _jsonl(path / "train.jsonl", ROWS)
        _jsonl(path / "test.jsonl", ROWS[:3])
    task = _task(path, id_column="uid")
    assert len(task.train) == len(ROWS)
    problem = next(p for p in task.train if p.problem_id == "p2-3")
    assert (problem.prompt, str(problem.answer)) == ("2+3=", "5")
    if fmt in ("save_to_disk", "folder"):
        assert len(_task(path, test_split="test").test) == 3


def test_prompt_template_and_default_ids(tmp_path: Path) -> None:
    task = make_task("dataset", {"path": str(_jsonl(tmp_path / "d.jsonl", ROWS)),
                                 "prompt_template": "Q: {q} (id {uid})", "answer_column": "sol"})
    assert task.train[7].prompt == "Q: 1+2= (id p1-2)" and task.train[7].problem_id == "train:7"


def test_bad_rows_are_skipped_counted_and_named(tmp_path: Path, caplog) -> None:
    rows = [ROWS[0], {"q": "", "sol": "1"}, {"q": "1+1=", "other": 2}, {"sol": "3"}, ROWS[1]]
    with caplog.at_level(logging.WARNING):
        task = _task(_jsonl(tmp_path / "d.jsonl", rows))
    assert [p.prompt for p in task.train] == ["0+0=", "0+1="]
    assert task.skipped == Counter({"empty prompt": 1, "'sol' missing": 1,
                                    "'q' missing or not text": 1})
    assert "split train, row 2: skipped ('sol' missing)" in caplog.text
    with pytest.raises(ValueError, match=r"no usable rows.*'sol' missing"):
        _task(_jsonl(tmp_path / "bad.jsonl", [{"q": "a"}]))


@pytest.mark.parametrize(
    "params, needle",
    [
        ({"path": "nope/data.jsonl"}, "'nope/data.jsonl' does not exist"),
        ({"split": "validation"}, r"no split 'validation'; it has \['train'\]"),
        ({"reward": "user_rewards:missing"}, "reward 'user_rewards:missing': user_rewards has no "
                                             "attribute 'missing'"),
        ({"reward": "user_rewards:NOT_CALLABLE"}, "is a int, not a function"),
        ({"reward": "no_such_module_abc:f"}, "no module named 'no_such_module_abc'"),
        ({"colour": 1}, r"unknown param\(s\) \['colour'\]"),
    ],
)
def test_bad_dataset_params_fail_at_build_naming_them(tmp_path: Path, rewards: str,
                                                      params: dict, needle: str) -> None:
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(ValueError, match=needle):
        make_task("dataset", {"path": str(path), "prompt_column": "q", "answer_column": "sol",
                              **params})


def test_named_splits_are_checked(tmp_path: Path) -> None:
    (tmp_path / "f").mkdir()
    _jsonl(tmp_path / "f" / "train.jsonl", ROWS)
    with pytest.raises(ValueError, match=r"no split 'test'; it has \['train'\]"):
        _task(tmp_path / "f", test_split="test")


def test_epochs_visit_every_row_once_in_a_new_order_and_shards_split_them(tmp_path: Path) -> None:
    task = _task(_jsonl(tmp_path / "d.jsonl", ROWS), shuffle_seed=3)
    rng = random.Random(0)
    first = [task.sample_problem(rng).problem_id for _ in range(len(ROWS))]
    second = [task.sample_problem(rng).problem_id for _ in range(len(ROWS))]
    assert sorted(first) == sorted(second) == sorted(p.problem_id for p in task.train)
    assert first != second
    again = _task(_jsonl(tmp_path / "d.jsonl", ROWS), shuffle_seed=3)
    assert [again.sample_problem(rng).problem_id for _ in range(5)] == first[:5]
    shards = []
    for index in range(2):
        shard = _task(tmp_path / "d.jsonl", shuffle_seed=3)
        shard.shard(index, 2)
        shards.append([shard.sample_problem(rng).problem_id for _ in range(len(ROWS) // 2)])
    assert shards[0] == first[0::2] and shards[1] == first[1::2]
    resumed = _task(tmp_path / "d.jsonl", shuffle_seed=3)
    resumed.seek(len(ROWS) + 4)
    assert resumed.sample_problem(rng).problem_id == second[4]


def test_a_named_test_split_is_the_held_out_set_and_training_never_sees_it(tmp_path: Path) -> None:
    (tmp_path / "f").mkdir()
    _jsonl(tmp_path / "f" / "train.jsonl", ROWS[:20])
    _jsonl(tmp_path / "f" / "test.jsonl", ROWS[20:])
    task = make_train_task("dataset", {"path": str(tmp_path / "f"), "prompt_column": "q",
                                       "answer_column": "sol", "test_split": "test"}, 0.5)
    assert not isinstance(task, TrainSplit)  # the test split, not the id hash, holds out
    drawn = {task.sample_problem(random.Random(0)).prompt for _ in range(40)}
    assert drawn == {r["q"] for r in ROWS[:20]}
    held = heldout_problems(make_task("dataset", {"path": str(tmp_path / "f"), "prompt_column": "q",
                                                  "answer_column": "sol", "test_split": "test"}),
                            100, seed=1, heldout_frac=0.5)
    assert sorted(p.prompt for p in held) == sorted(r["q"] for r in ROWS[20:])  # all, once


def test_without_a_test_split_the_id_hash_holds_rows_out(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    task = make_train_task("dataset", {"path": str(path), "prompt_column": "q",
                                       "answer_column": "sol", "id_column": "uid"}, 0.3)
    held_ids = {p.problem_id for p in _task(path, id_column="uid").train if is_heldout(p.problem_id, 0.3)}
    assert 0 < len(held_ids) < len(ROWS)
    drawn = {task.sample_problem(random.Random(0)).problem_id for _ in range(3 * len(ROWS))}
    assert drawn == {r["uid"] for r in ROWS} - held_ids
    held = heldout_problems(_task(path, id_column="uid"), 1000, seed=0, heldout_frac=0.3)
    assert {p.problem_id for p in held} == held_ids


def test_user_rewards_are_scored_in_real_verifier_processes(tmp_path: Path, rewards: str) -> None:
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    task = _task(path, reward="user_rewards:closeness", success_threshold=0.5)
    problem = next(p for p in task.train if p.prompt == "4+4=")
    assert task.score(problem, "8") == Score(1.0, True)
    assert task.score(problem, "7") == Score(0.5, True)
    assert task.score(problem, "5") == Score(0.25, False)
    assert _task(path).score(problem, " 8\n") == Score(1.0, True)  # exact_match by default
    assert _task(path, reward="user_rewards:as_score").score(problem, "8") == Score(0.5, True)
    with pytest.raises(TypeError, match="returned 'yes'"):
        _task(path, reward="user_rewards:bad").score(problem, "8")
    scorer = Scorer(task, timeout_s=30, workers=1)  # pickled to a spawned process, rows left out
    try:
        scorer.submit("g", problem, ["8", "6", "x"])
        deadline = time.monotonic() + 60
        while not (done := scorer.poll()) and time.monotonic() < deadline:
            scorer.wait(0.1)
    finally:
        scorer.close()
    assert [s.reward for s in done[0].scores] == [1.0, pytest.approx(1 / 3), 0.0]


def test_an_actor_publishes_its_data_position_and_its_successor_continues_there(tmp_path: Path) -> None:
    from test_actor import FakeEngine, make_actor

    from pipelinerl.roles.actor import Schedule
    from pipelinerl.tasks import ChainArithmeticTask

    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    schedule = Schedule(batch_size=4, group_size=2, max_lag=1_000)
    task = _task(path, shuffle_seed=1)
    actor = make_actor(FakeEngine(capacity=8), task, schedule)
    actor.run(max_groups=6)
    records = [r for r in actor.streams.writer.records if "group_id" in r]
    positions = [r["data_pos"] for r in records]
    # The oldest problem not yet published: never past what was drawn, never going back.
    assert positions == sorted(positions) and 0 < positions[-1] <= task.position
    # Every problem drawn before that position was published (none was dropped here).
    fresh = _task(path, shuffle_seed=1)
    before = [fresh.sample_problem(random.Random(0)).prompt for _ in range(positions[-1])]
    assert set(before) <= {r["prompt"] for r in records}
    successor_task = _task(path, shuffle_seed=1)
    make_actor(FakeEngine(), successor_task, schedule, predecessor=records[-1])
    assert successor_task.position == positions[-1]
    plain = make_actor(FakeEngine(), ChainArithmeticTask(), schedule)
    plain.run(max_groups=1)
    plain_positions = {r["data_pos"] for r in plain.streams.writer.records if "group_id" in r}
    assert plain_positions == {None}  # a task without positions


@pytest.mark.slow
def test_a_dataset_with_a_user_reward_trains_and_evaluates_through_the_cli(tmp_path: Path) -> None:
    """The lighter path of a user's own task: their data and a reward function, an instruct
    model directory (chat template, two EOS ids), `pipelinerl train`; the evaluator reads the
    test split."""
    import subprocess

    from test_prompts import instruct_tokenizer

    from pipelinerl.config import load_config
    from pipelinerl.models.hf import load_tokenizer
    from pipelinerl.roles.wiring import open_rollout_reader

    (tmp_path / "data").mkdir()
    _jsonl(tmp_path / "data" / "train.jsonl", ROWS[:24])
    _jsonl(tmp_path / "data" / "test.jsonl", ROWS[24:])
    (tmp_path / "user_rewards.py").write_text(REWARDS)
    model = instruct_tokenizer(tmp_path / "model")
    example = Path(__file__).resolve().parent.parent / "examples" / "arithmetic.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "pipelinerl.cli", "train", str(example), "name=ds",
         f"output_dir={tmp_path / 'runs'}", f"model.path={model}", "task.name=dataset",
         "task.params.path=data", "task.params.prompt_column=q", "task.params.answer_column=sol",
         "task.params.test_split=test", "task.params.reward=user_rewards:closeness",
         "trainer.max_steps=4", "trainer.max_time_s=0", "trainer.batch_size=8",
         "actor.group_size=4", "engine.capacity=8", "engine.max_new_tokens=4",
         "eval.num_problems=50", "stream.keep_all=true", "metrics.progress=false",
         "metrics.plot=false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "ds"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert max(r.get("step", 0) for r in rows) == 4
    evals = [r for r in rows if "eval/version" in r]
    assert evals and all(r["eval/num_problems"] == 6 for r in evals)  # the whole test split
    with open_rollout_reader(load_config(run_dir / "config.yaml")) as reader:
        groups = [r for r in reader.read(1000, timeout_s=1.0) if not r.get("heartbeat")]
    assert groups and {g["prompt"] for g in groups} <= {r["q"] for r in ROWS[:24]}
    assert all(isinstance(g["data_pos"], int) for g in groups)
    rewards = {s["reward"] for g in groups for s in g["samples"]}
    assert any(0 < r < 1 for r in rewards)  # the user's closeness reward, not exact match
    tokenizer = load_tokenizer(model)
    sample = groups[0]["samples"][0]
    assert tokenizer.decode(sample["prompt_ids"]) == (
        f"<|im_start|>user\n{groups[0]['prompt']}<|im_end|>\n<|im_start|>assistant\n")
    ends = {s["token_ids"][-1] for g in groups for s in g["samples"] if s["finish_reason"] == "stop"}
    assert ends <= {0, 2}  # <|endoftext|> or <|im_end|>


def test_every_row_of_a_prompt_lands_on_the_same_side_of_the_split(tmp_path: Path) -> None:
    # Each prompt on two rows, the second spaced differently: a held-out prompt must never be
    # trained on through its other row (review issue 25, F5).
    prompts = [f"What is {a} + {b}?" for a in range(10) for b in range(5)]
    rows = ([{"q": q, "sol": "0"} for q in prompts]
            + [{"q": f" {q.replace(' is ', ' is  ')}\n", "sol": "0"} for q in prompts])
    params = {"path": str(_jsonl(tmp_path / "d.jsonl", rows)), "prompt_column": "q",
              "answer_column": "sol"}
    train = make_train_task("dataset", params, 0.2)
    drawn = {" ".join(train.sample_problem(random.Random(0)).prompt.split())
             for _ in range(4 * len(rows))}
    held = heldout_problems(make_task("dataset", params), 1000, seed=0, heldout_frac=0.2)
    held_prompts = {" ".join(p.prompt.split()) for p in held}
    assert not drawn & held_prompts
    assert drawn | held_prompts == set(prompts)
    assert len(held_prompts) == len(held)  # each held-out prompt once, however many rows
    assert 0 < len(held) < len(prompts)
