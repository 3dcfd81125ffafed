"""Tasks from user code: `task.name` as an import path `module:Class` or an installed entry
point, every failure to import or build one reported before any process starts, and the
example user task (examples/sort_digits.py) run through the CLI."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelinerl.tasks import Problem, make_task

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

GOOD = '''
from pipelinerl.tasks import Problem, Score

class Echo:
    name = "echo"

    def __init__(self, word: str = "ab", **extra):
        self.word, self.extra = word, extra

    def sample_problem(self, rng):
        return Problem(f"echo:{rng.randint(0, 9)}", self.word, self.word)

    def score(self, problem, completion):
        return Score(float(completion == problem.answer), completion == problem.answer)

class NoScore:
    name = "noscore"

    def sample_problem(self, rng):
        return None

class Strict:
    name = "strict"

    def __init__(self, size: int):
        if size < 1:
            raise RuntimeError("size must be positive")

    def sample_problem(self, rng):
        return None

    def score(self, problem, completion):
        return None

NOT_A_CLASS = 3
'''


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding the user's modules, as when they run `pipelinerl train`
    beside them; the modules are forgotten afterwards."""
    (tmp_path / "usertasks_good.py").write_text(GOOD)
    (tmp_path / "usertasks_broken.py").write_text("import math\n1 / 0\n")
    (tmp_path / "usertasks_needs.py").write_text("import not_installed_anywhere_xyz\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("usertasks_")]:
        del sys.modules[name]


def test_a_task_class_is_found_by_import_path_in_the_working_directory(user_dir: Path) -> None:
    task = make_task("usertasks_good:Echo", {"word": "xyz", "anything": 1})
    assert task.name == "echo" and task.word == "xyz" and task.extra == {"anything": 1}
    problem = task.sample_problem(random.Random(0))
    assert task.score(problem, "xyz").success and not task.score(problem, "xy").success


@pytest.mark.parametrize(
    "name, params, needle",
    [
        ("usertasks_missing:Echo", {}, "no module named 'usertasks_missing'"),
        ("usertasks_needs:Echo", {}, "importing module 'usertasks_needs' failed: No module named "
                                     "'not_installed_anywhere_xyz'"),
        ("usertasks_broken:Echo", {}, "importing module 'usertasks_broken' raised "
                                      "ZeroDivisionError"),
        ("usertasks_good:Nope", {}, "has no attribute 'Nope'"),
        ("usertasks_good:NOT_A_CLASS", {}, "'NOT_A_CLASS' is a int, not a class"),
        ("usertasks_good:NoScore", {}, "NoScore is not a Task: it lacks method score"),
        ("usertasks_good:Strict", {}, r"missing required param\(s\) \['size'\]"),
        ("usertasks_good:Strict", {"size": 0}, "building it raised RuntimeError: size must be"),
        ("usertasks_good:", {}, "an import path is 'module:attribute'"),
        ("nonesuch", {}, "not built in.*pipelinerl.tasks.*module:Class"),
    ],
)
def test_every_failure_to_build_a_user_task_names_what_was_wrong(
    user_dir: Path, name: str, params: dict, needle: str
) -> None:
    with pytest.raises(ValueError, match=needle) as info:
        make_task(name, params)
    assert repr(name) in str(info.value)


def test_an_installed_package_provides_a_task_through_its_entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What `pip install` of a package declaring
    # [project.entry-points."pipelinerl.tasks"] echo_pkg = "echo_pkg_mod:Echo" leaves on disk.
    (tmp_path / "echo_pkg_mod.py").write_text(GOOD)
    info = tmp_path / "echo_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: echo-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pipelinerl.tasks]\necho_pkg = echo_pkg_mod:Echo\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        task = make_task("echo_pkg", {"word": "q"})
        assert task.name == "echo" and task.word == "q"
        with pytest.raises(ValueError, match=r"entry point of group 'pipelinerl.tasks' \[.*'echo_pkg'"):
            make_task("echo_pkh")
    finally:
        sys.modules.pop("echo_pkg_mod", None)


def test_the_example_user_task_scores_and_demonstrates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(EXAMPLES)
    task = make_task("sort_digits:SortDigits", {"min_len": 3, "max_len": 5})
    rng = random.Random(0)
    problems = [task.sample_problem(rng) for _ in range(50)]
    assert all(set(p.prompt) <= set(task.alphabet) for p in problems)
    assert all(task.score(p, task.demonstration(p, rng, 0.0)).success for p in problems)
    noisy = [task.score(p, task.demonstration(p, rng, 0.5)).success for p in problems]
    assert 0 < sum(noisy) < len(noisy)
    assert not task.score(Problem("sort:21", "21=", "12"), "21").success
    with pytest.raises(ValueError, match="min_len"):
        make_task("sort_digits:SortDigits", {"min_len": 4, "max_len": 2})


def _train(cwd: Path, config: str, *overrides: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelinerl.cli", "train", config, *overrides],
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["task.name=usertasks_broken:Echo"], "importing module 'usertasks_broken' raised"),
        (["task.name=usertasks_good:NoScore"], "NoScore is not a Task"),
        (["task.name=usertasks_good:Strict"], "missing required param"),
        (["task.name=usertasks_good:Echo", "model.path=no/such/dir"], "model.path=no/such/dir"),
    ],
)
def test_the_cli_refuses_a_bad_task_or_model_before_starting_anything(
    user_dir: Path, overrides: list[str], needle: str
) -> None:
    start = time.monotonic()
    proc = _train(user_dir, str(EXAMPLES / "arithmetic.yaml"), f"output_dir={user_dir / 'runs'}",
                  *overrides, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (user_dir / "runs" / "arithmetic" / "logs").exists()  # no role was started
    assert time.monotonic() - start < 60


@pytest.mark.slow
def test_the_example_user_task_trains_through_the_cli(tmp_path: Path) -> None:
    """The README's command for the example, from its folder, on a short budget."""
    proc = _train(EXAMPLES, "sort_digits.yaml", f"output_dir={tmp_path}",
                  f"warmstart.cache_dir={tmp_path / 'cache'}", "warmstart.steps=60",
                  "trainer.max_steps=6", "trainer.max_time_s=0", "trainer.batch_size=16",
                  "engine.capacity=16", "actor.group_size=4", "eval.num_problems=20",
                  "metrics.progress=false", "metrics.plot=false", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "sort_digits" / "metrics.jsonl").open()]
    steps = [r["step"] for r in rows if "eval/version" not in r and "step" in r]
    assert steps[-1] == 6
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    assert evals, "the held-out evaluation of the user task ran"
    saved = (tmp_path / "sort_digits" / "config.yaml").read_text()
    assert "sort_digits:SortDigits" in saved
    assert (tmp_path / "sort_digits" / "final" / "config.json").exists()
