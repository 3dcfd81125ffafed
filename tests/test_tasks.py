"""Tasks: arithmetic scoring and demonstrations, the math task's data loading and verifier
deadline, and the registry's errors."""

from __future__ import annotations

import json
import logging
import random
import re
import statistics
import time

import pytest

from pipelinerl.tasks import (ChainArithmeticTask, MathTask, Problem, heldout_problems, make_task,
                              make_train_task)
from pipelinerl.tasks.math import last_boxed


def _problem(prompt: str, answer: int) -> Problem:
    return Problem(problem_id=f"arith:{prompt}", prompt=prompt, answer=answer)


# ---- arithmetic ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, ok",
    [
        ("12+7=19,19-5=14,14+3=17;A=17", True),
        ("A=017", True),  # numbers are zero-padded; the value is what counts
        ("12+7=19,19-5=14,14+3=17;A=17\n", True),  # trailing whitespace is harmless
        ("12+7=20,20-5=15,15+3=17;A=17", True),  # steps are not checked, only the answer
        ("A=17", True),
        ("12+7=19,19-5=14,14+3=18;A=18", False),  # wrong answer
        ("12+7=19,19-5=14,14+3=17;A=-17", False),
        ("12+7=19,19-5=14,14+3=17", False),  # no final answer
        ("12+7=19,19-5=14,14+3=17;A=", False),
        ("12+7=19,19-5=14,14+3=17;A=17,", False),  # anything after the answer
        ("12+7=19,19-5=14,14+3=17;A=17x", False),
        ("12+7=19;A=17;A=1", False),  # the last answer counts
        ("12+7=19,19-5=14,14+3=17A=17", False),  # answer glued to a step
        ("A=" + "1" * 5000, False),  # absurdly long number: no int() overflow error
        ("", False),
    ],
)
def test_arithmetic_score(completion: str, ok: bool) -> None:
    task = ChainArithmeticTask()
    score = task.score(_problem("12+7-5+3=", 17), completion)
    assert score.success is ok
    assert score.reward == (1.0 if ok else 0.0)


def test_arithmetic_problems_stay_in_range() -> None:
    task = ChainArithmeticTask(max_operand=9, max_value=30)
    rng = random.Random(0)
    for _ in range(500):
        p = task.sample_problem(rng)
        assert re.fullmatch(r"\d\d([+-]\d)+=", p.prompt), p.prompt  # first term zero-padded
        terms = [int(t) for t in re.findall(r"[+-]?\d+", p.prompt[:-1])]
        assert 2 <= len(terms) <= 8
        totals = [sum(terms[: i + 1]) for i in range(len(terms))]
        assert all(0 <= v <= 30 for v in totals), p.prompt
        operands = [abs(t) for t in terms[1:]]
        assert all(1 <= t <= 9 for t in operands)
        assert len(set(operands)) == len(operands)  # distinct: the next term is found by content
        assert p.answer == totals[-1]
        assert p.problem_id == f"arith:{p.prompt}"


def test_arithmetic_wider_numbers() -> None:
    task = ChainArithmeticTask(max_operand=12, max_value=500)
    rng = random.Random(5)
    p = task.sample_problem(rng)
    demo = task.demonstration(p, rng)
    assert re.fullmatch(r"\d{3}([+-]\d\d)+=", p.prompt), p.prompt
    assert re.fullmatch(r"(\d{3}[+-]\d\d=\d{3},)*\d{3}[+-]\d\d=\d{3};A=\d{3}", demo), demo
    assert task.score(p, demo).success


def test_arithmetic_sampling_is_reproducible() -> None:
    task = ChainArithmeticTask()
    a = [task.sample_problem(random.Random(3)).prompt for _ in range(5)]
    assert len(set(a)) == 1  # the task holds no RNG of its own: the caller's rng decides


def test_arithmetic_lengths_have_a_tail() -> None:
    task = ChainArithmeticTask()
    rng = random.Random(1)
    lengths = [len(task.demonstration(task.sample_problem(rng), rng)) for _ in range(3000)]
    assert min(lengths) <= 12
    assert statistics.median(lengths) <= 25
    assert max(lengths) >= 55  # the thin tail out to max_terms
    long_frac = sum(n >= 45 for n in lengths) / len(lengths)
    assert 0.01 < long_frac < 0.15


def test_clean_demonstrations_always_score_one() -> None:
    task = ChainArithmeticTask()
    rng = random.Random(2)
    for _ in range(1000):
        p = task.sample_problem(rng)
        demo = task.demonstration(p, rng, step_error_prob=0.0)
        assert task.score(p, demo).success, (p.prompt, demo)
        assert set(demo) <= set(task.alphabet)


def test_noisy_demonstrations_are_consistent_chains() -> None:
    task = ChainArithmeticTask()
    rng = random.Random(4)
    wrong_steps = steps = failures = 0
    for _ in range(500):
        p = task.sample_problem(rng)
        demo = task.demonstration(p, rng, step_error_prob=0.3)
        body, final = demo.split(";A=")
        assert len(final) == 2
        prev = None
        for step in body.split(","):
            # Slips keep every number in range, so the fixed width holds in noisy chains too.
            m = re.fullmatch(r"(\d\d)([+-])(\d)=(\d\d)", step)
            assert m, demo
            left, sign, op, result = int(m[1]), m[2], int(m[3]), int(m[4])
            if prev is not None:
                assert left == prev, demo  # continues from the (possibly wrong) result
            true = left + op if sign == "+" else left - op
            wrong_steps += result != true
            steps += 1
            prev = result
        assert int(final) == prev
        failures += not task.score(p, demo).success
    assert 0.25 < wrong_steps / steps < 0.35
    assert failures > 100


@pytest.mark.parametrize(
    "params, needle",
    [
        ({"max_terms": 1}, "max_terms"),
        ({"max_terms": 11}, "max_terms"),  # more than 9 distinct one-digit operands
        ({"min_terms": 1}, "min_terms"),
        ({"max_operand": 0}, "max_operand"),
        ({"max_value": 10}, "max_value"),
        ({"max_terms": "8"}, "max_terms"),
        ({"term_weights": [1, 2]}, "term_weights"),
        ({"term_weights": [0] * 7}, "term_weights"),
        ({"nope": 1}, "nope"),
    ],
)
def test_make_task_bad_params(params: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as info:
        make_task("arithmetic", params)
    assert "arithmetic" in str(info.value)


def test_harmonic_term_weights_weigh_a_problem_of_k_steps_1_over_k() -> None:
    task = make_task("arithmetic", {"max_terms": 10, "term_weights": "harmonic"})
    assert task.term_weights == pytest.approx([1 / k for k in range(1, 10)])
    with pytest.raises(ValueError, match="term_weights.*harmonic"):
        make_task("arithmetic", {"term_weights": "zipf"})


def test_the_long_chains_example_has_a_long_tail_of_long_generations() -> None:
    """examples/long_chains.yaml: worked solutions (what a solved completion is, EOS included)
    of mean >= 100 tokens, p95 / median >= 3 and max / min >= 10 (issue 24's workload), each
    one solving its problem, all within the engine's budget."""
    from pathlib import Path

    from pipelinerl.config import load_config

    cfg = load_config(Path(__file__).parent.parent / "examples" / "long_chains.yaml")
    task = make_task(cfg.task.name, cfg.task.params)
    rng = random.Random(0)
    lengths = []
    for _ in range(5000):
        problem = task.sample_problem(rng)
        worked = task.demonstration(problem, rng)
        assert task.score(problem, worked).success
        assert len(problem.prompt) + len(worked) + 1 <= cfg.engine.max_seq_len
        lengths.append(len(worked) + 1)
    lengths.sort()
    median, p95 = lengths[len(lengths) // 2], lengths[int(0.95 * len(lengths))]
    assert statistics.fmean(lengths) >= 100 and p95 / median >= 3
    assert lengths[-1] / lengths[0] >= 10
    assert lengths[-1] <= cfg.engine.max_new_tokens


def test_a_progression_is_worked_step_by_step_counting_down_the_steps_left() -> None:
    task = make_task("progression", {"max_steps": 5, "max_value": 99})
    problem = Problem("p", "41+7*3=", 62)
    worked = "3:41+7=48,2:48+7=55,1:55+7=62;A=62"
    assert task.demonstration(problem, random.Random(0)) == worked
    assert task.score(problem, worked).success
    assert not task.score(problem, "3:41+7=48;A=48").success  # stopping early is wrong
    rng = random.Random(1)
    for _ in range(200):  # k steps, counted down from k to 1
        p = task.sample_problem(rng)
        k = int(p.prompt.split("*")[1][:-1])
        steps = task.demonstration(p, rng).split(";")[0].split(",")
        assert 1 <= k <= 5 and [int(s.split(":")[0]) for s in steps] == list(range(k, 0, -1))
    # slips continue from the wrong sums: wrong answers (these seeds: no slips that cancel)
    noisy = [task.demonstration(problem, random.Random(s), step_error_prob=1.0) for s in range(20)]
    assert all(not task.score(problem, d).success for d in noisy)
    # at the top of the range only the slips that stay in it: 99 can only slip down
    top = Problem("t", "90+9*1=", 99)
    assert {task.demonstration(top, random.Random(s), 1.0) for s in range(20)} == {
        "1:90+9=89;A=89", "1:90+9=98;A=98"}


@pytest.mark.parametrize("params, needle", [
    ({"max_operand": 10}, "max_operand"), ({"max_steps": 0}, "max_steps"),
    ({"max_steps": 60, "max_value": 99}, "max_value"), ({"max_steps": "5"}, "max_steps")])
def test_progression_refuses_bad_params(params: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        make_task("progression", params)


def test_make_task_known_and_unknown() -> None:
    task = make_task("arithmetic", {"max_terms": 4, "term_weights": [3, 2, 1]})
    assert isinstance(task, ChainArithmeticTask) and task.max_terms == 4
    with pytest.raises(ValueError, match="arithmetic.*math"):
        make_task("chess", {})
    with pytest.raises(ValueError, match="math.*dataset_path"):
        make_task("math", {})


# ---- math ---------------------------------------------------------------------------------


def hanging_verifier(gold: str, pred: str) -> bool:
    """Run inside the verifier worker: never returns for the prediction 'hang'."""
    while pred == "hang":
        time.sleep(1)
    return gold == pred


def _write(path, lines: list[str]):
    path.write_text("\n".join(lines) + "\n")
    return path


def test_math_bad_rows_are_counted_and_named(tmp_path, caplog) -> None:
    data = _write(
        tmp_path / "data.jsonl",
        [
            '{"problem": "1+1?", "answer": "2"}',
            "not json",
            '{"problem": "no answer"}',
            "",
            '["a list"]',
            '{"question": "renamed", "answer": 3}',
            '{"problem": "3*3?", "answer": 9}',
        ],
    )
    with caplog.at_level(logging.WARNING):
        task = MathTask(str(data))
    assert [p.answer for p in task.problems] == ["2", "9"]
    assert task.skipped == {
        "invalid_json": 1,
        "missing_answer": 1,
        "not_an_object": 1,
        "missing_problem": 1,
    }
    assert f"{data}:2" in caplog.text and "invalid_json" in caplog.text
    assert f"{data}:6" in caplog.text
    rng = random.Random(0)
    assert task.sample_problem(rng).prompt.startswith(("1+1?", "3*3?"))


def test_math_custom_fields_and_template(tmp_path) -> None:
    data = _write(tmp_path / "d.jsonl", ['{"q": "What is 2+2?", "a": 4}'])
    task = MathTask(
        str(data), problem_field="q", answer_field="a", prompt_template="Q: {problem}\nA:"
    )
    assert task.problems[0].prompt == "Q: What is 2+2?\nA:"
    with pytest.raises(ValueError, match="problem"):
        MathTask(str(data), prompt_template="no slot")


def test_math_rows_of_one_problem_land_on_the_same_side_of_the_split(tmp_path) -> None:
    # Each problem on two lines, the second spaced differently: a held-out problem must never
    # be trained on through its other line (review issue 25, F5).
    questions = [f"What is {a} * {b}?" for a in range(10) for b in range(5)]
    lines = [json.dumps({"problem": q, "answer": "0"}) for q in questions]
    lines += [json.dumps({"problem": q.replace(" is ", " is  ") + " ", "answer": "0"})
              for q in questions]
    params = {"dataset_path": str(_write(tmp_path / "d.jsonl", lines)),
              "prompt_template": "{problem}"}
    train, rng = make_train_task("math", params, 0.2), random.Random(0)
    drawn = {" ".join(train.sample_problem(rng).prompt.split()) for _ in range(2000)}
    held = {" ".join(p.prompt.split())
            for p in heldout_problems(make_task("math", params), 200, seed=0, heldout_frac=0.2)}
    assert not drawn & held
    assert drawn | held == set(questions)
    assert 0 < len(held) < len(questions)


def test_math_empty_or_all_bad_dataset(tmp_path) -> None:
    empty = _write(tmp_path / "empty.jsonl", [""])
    with pytest.raises(ValueError, match="no usable rows.*file is empty"):
        MathTask(str(empty))
    bad = _write(tmp_path / "bad.jsonl", ["{", '{"problem": "x"}'])
    with pytest.raises(ValueError, match="no usable rows.*invalid_json"):
        MathTask(str(bad))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        MathTask(str(tmp_path / "missing.jsonl"))


def test_last_boxed() -> None:
    assert last_boxed(r"a \boxed{1} b \boxed{\frac{1}{2}} c") == r"\frac{1}{2}"
    assert last_boxed(r"\boxed{1} then \boxed{2") is None  # the last one is unclosed
    assert last_boxed(r"\boxed{ }") is None
    assert last_boxed("no box") is None


def test_math_score_with_math_verify(tmp_path) -> None:
    pytest.importorskip("math_verify")
    data = _write(tmp_path / "d.jsonl", [r'{"problem": "half?", "answer": "\\frac{1}{2}"}'])
    task = MathTask(str(data))
    p = task.problems[0]
    try:
        assert task.score(p, r"so \boxed{\frac{1}{2}}").success  # exact: no worker needed
        assert task.score(p, r"it is \boxed{0.5}").reward == 1.0
        assert not task.score(p, r"\boxed{3}").success
        assert not task.score(p, "1/2").success
        assert task.stats == {"wrong": 1, "no_boxed": 1}
    finally:
        task.close()


def test_math_hanging_verifier_times_out_and_recovers(tmp_path) -> None:
    data = _write(tmp_path / "d.jsonl", ['{"problem": "p", "answer": "7"}'])
    task = MathTask(str(data), verify_timeout_s=0.5, verifier=f"{__name__}:hanging_verifier")
    p = task.problems[0]
    try:
        t0 = time.monotonic()
        score = task.score(p, r"\boxed{hang}")
        assert time.monotonic() - t0 < 30  # worker start-up plus the 0.5 s deadline
        assert score.reward == 0.0 and not score.success
        assert task.stats["timeout"] == 1
        # The stuck worker was replaced: the next verification works.
        assert not task.score(p, r"\boxed{8}").success
        assert task.stats == {"timeout": 1, "wrong": 1}
    finally:
        task.close()


def test_math_bad_verifier_spec(tmp_path) -> None:
    data = _write(tmp_path / "d.jsonl", ['{"problem": "p", "answer": "7"}'])
    with pytest.raises(ValueError, match="module:function"):
        MathTask(str(data), verifier="no_colon")


# ---- countdown ----------------------------------------------------------------------------


def _countdown(numbers: list[int], target: int) -> Problem:
    return Problem("c", "", {"numbers": numbers, "target": target, "solution": ""})


@pytest.mark.parametrize(
    "completion, ok",
    [
        ("(3+5)*2", True),
        ("2*(5+3)", True),
        ("6/4*8+4", False),   # 16, with numbers not given
        ("5*2+3+3", False),   # 3 used twice
        ("8+8", False),       # 8 not given
        ("3+5", False),       # 8, not 16
        ("<answer>3+5</answer> then <answer>(3+5)*2</answer>", True),  # the last tag
        ("thinking...\n(3+5)*2\n", True),  # the last line
        ("__import__('os').system('true')", False),
        ("(3).__class__", False),
        ("2**4", False),
        ("16.0", False),
        ("-(-16)", False),
        ("5/(3-3)", False),
        ("(" * 150 + "16" + ")" * 150, False),
        ("", False),
    ],
)
def test_countdown_verifier(completion: str, ok: bool) -> None:
    task = make_task("countdown", {})
    assert task.score(_countdown([3, 5, 2, 6], 16), completion).success is ok


def test_countdown_fractions_are_exact_and_use_all_counts_every_number() -> None:
    task = make_task("countdown", {})
    assert task.score(_countdown([6, 4, 8], 12), "6/4*8").success  # 1.5 * 8, exactly
    strict = make_task("countdown", {"use_all": True})
    assert not strict.score(_countdown([6, 4, 8, 1], 12), "6/4*8").success
    assert strict.score(_countdown([6, 4, 8, 1], 12), "6/4*8*1").success


def test_countdown_problems_are_solvable_in_range_and_reproducible() -> None:
    task = make_task("countdown", {"min_numbers": 3, "max_numbers": 4, "max_number": 20,
                                   "max_target": 100, "use_all": True})
    rng = random.Random(0)
    problems = [task.sample_problem(rng) for _ in range(500)]
    for p in problems:
        numbers, target = p.answer["numbers"], p.answer["target"]
        assert 3 <= len(numbers) <= 4 and all(1 <= n <= 20 for n in numbers)
        assert 1 <= target <= 100 and set(p.prompt) <= set(task.alphabet)
        demo = task.demonstration(p, rng, 0.0)
        assert task.score(p, demo).success, (p, demo)
        assert sorted(int(n) for n in re.findall(r"\d+", demo)) == sorted(numbers)  # use_all
    again = [task.sample_problem(random.Random(0)) for _ in range(1)]
    assert again[0] == problems[0]
    noisy = [task.score(p, task.demonstration(p, rng, 0.5)).success for p in problems]
    assert 0.05 < sum(noisy) / len(noisy) < 0.6


def test_countdown_instruct_style_asks_for_a_tagged_answer() -> None:
    task = make_task("countdown", {"style": "instruct"})
    problem = task.sample_problem(random.Random(1))
    assert "<answer></answer>" in problem.prompt and str(problem.answer["target"]) in problem.prompt
    demo = task.demonstration(problem, random.Random(1), 0.0)
    assert demo.startswith("<answer>") and task.score(problem, demo).success


@pytest.mark.parametrize(
    "params, needle",
    [({"min_numbers": 1}, "min_numbers"), ({"max_numbers": 2, "min_numbers": 3}, "min_numbers"),
     ({"ops": "+^"}, "ops"), ({"style": "chat"}, "style"), ({"max_target": 0}, "max_target")],
)
def test_countdown_bad_params(params: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        make_task("countdown", params)
