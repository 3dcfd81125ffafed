"""Warm-start: batches, caching by content hash, and that training lowers the loss."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from at_once import Builds, run_at_once
from transformers.utils import logging as hf_logging

import pipelinerl.models.warmstart as ws
import pipelinerl.proc.cpu_threads as cpu_threads
from pipelinerl.config import Config
from pipelinerl.models.hf import load_model, load_tokenizer
from pipelinerl.models.tiny import (
    build_char_tokenizer,
    build_tiny_model,
    init_tiny_model,
)
from pipelinerl.models.warmstart import (
    WarmStartConfig,
    cache_key,
    resolve_cache_dir,
    sample_completions,
    warm_start,
)
from pipelinerl.roles.launch import starting_model
from pipelinerl.tasks import ChainArithmeticTask
from pipelinerl.tasks.split import TrainSplit

torch.set_num_threads(1)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arithmetic.yaml"

# Tiny settings: seconds, not minutes.
FAST = WarmStartConfig(steps=3, batch_size=8, num_threads=1, eval_problems=4)


def test_demo_batches_mask_prompt_and_padding(tmp_path: Path) -> None:
    task = ChainArithmeticTask()
    tok = build_char_tokenizer(task.alphabet, tmp_path)
    batches = ws.demo_batches(task, tok, replace(FAST, batch_size=16), random.Random(0))
    widths = []
    for _ in range(ws.BUCKET):
        ids, labels = next(batches)
        widths.append(ids.shape[1])
        for row_ids, row_labels in zip(ids.tolist(), labels.tolist()):
            n_prompt = row_ids.index(tok.convert_tokens_to_ids("=")) + 1
            assert row_labels[:n_prompt] == [-100] * n_prompt  # no loss on the prompt
            eos = row_labels.index(tok.eos_token_id)
            assert row_ids[n_prompt : eos + 1] == row_labels[n_prompt : eos + 1]
            assert set(row_labels[eos + 1 :]) <= {-100}
            assert set(row_ids[eos + 1 :]) <= {tok.pad_token_id}
            completion = tok.decode(row_ids[n_prompt:eos])
            assert ";A=" in completion
    assert min(widths) < max(widths)  # grouped by length: short batches are not padded long


def test_cache_key_covers_what_determines_the_result() -> None:
    task = ChainArithmeticTask()
    key = cache_key(task, FAST)
    assert key == cache_key(ChainArithmeticTask(), FAST)
    assert key == cache_key(task, replace(FAST, num_threads=2, eval_problems=0))
    for change in (
        {"steps": 4},
        {"lr": 1e-3},
        {"step_error_prob": 0.5},
        {"seed": 1},
        {"preset": "small"},
        {"bf16": True},
        {"batch_size": 9},
    ):
        assert cache_key(task, replace(FAST, **change)) != key, change
    assert cache_key(ChainArithmeticTask(max_terms=5), FAST) != key


def test_warm_start_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = ChainArithmeticTask()
    out = warm_start(task, FAST, cache_dir=tmp_path, progress=False)
    manifest = json.loads((out / "warmstart.json").read_text())
    assert manifest["key"] == cache_key(task, FAST) and out.name.endswith(manifest["key"])
    assert 0.0 <= manifest["success_t1"] <= 1.0 and "success_greedy" in manifest
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temporary dir left

    model, tok = load_model(out), load_tokenizer(out)
    assert model.config.vocab_size == len(tok)
    assert len(sample_completions(model, tok, ["1+2="], max_new_tokens=4)) == 1

    def no_training(*args, **kwargs):
        raise AssertionError("a cached warm-start must not train again")

    monkeypatch.setattr(ws, "train", no_training)
    t0 = time.perf_counter()
    assert warm_start(task, FAST, cache_dir=tmp_path, progress=False) == out
    assert time.perf_counter() - t0 < 1.0
    with pytest.raises(AssertionError, match="must not train"):
        warm_start(task, replace(FAST, seed=1), cache_dir=tmp_path, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # the failed run left nothing


def test_warm_start_from_base_model(tmp_path: Path) -> None:
    task = ChainArithmeticTask()
    base = tmp_path / "base"
    build_tiny_model(base, build_char_tokenizer(task.alphabet, base), seed=3)
    out = warm_start(
        task,
        replace(FAST, eval_problems=0),
        cache_dir=tmp_path / "cache",
        base_model_dir=base,
        progress=False,
    )
    assert out.name.startswith("arithmetic-base-")
    assert cache_key(task, FAST, base) != cache_key(task, FAST)
    assert load_model(out).config.hidden_size == load_model(base).config.hidden_size


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="steps"):
        WarmStartConfig(steps=0)
    with pytest.raises(ValueError, match="step_error_prob"):
        WarmStartConfig(step_error_prob=1.5)


def test_training_lowers_the_loss(tmp_path: Path) -> None:
    task = ChainArithmeticTask()
    tok = build_char_tokenizer(task.alphabet, tmp_path)
    model = init_tiny_model(tok)
    cfg = replace(FAST, steps=150, batch_size=8, lr=3e-3, warmup_steps=10)
    losses = ws.train(model, tok, task, cfg, progress=False)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert first > 2.0  # about log(vocab) at random init
    assert last < 0.6 * first, (first, last)


def test_busy_cpu_falls_back_to_fewer_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_threads, "idle_cpus", lambda: 1.9)
    assert cpu_threads.usable_threads(2, "test") == 2
    monkeypatch.setattr(cpu_threads, "idle_cpus", lambda: 1.2)
    assert cpu_threads.usable_threads(2, "test") == 1
    monkeypatch.setattr(cpu_threads, "idle_cpus", lambda: 0.1)
    assert cpu_threads.usable_threads(2, "test") == 1
    monkeypatch.setattr(cpu_threads, "idle_cpus", lambda: None)  # unknown (not Linux): as asked
    assert cpu_threads.usable_threads(2, "test") == 2


def test_idle_cpus_measures_something() -> None:
    idle = cpu_threads.idle_cpus(0.05)
    assert idle is None or 0.0 <= idle <= (os.cpu_count() or 1)


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("two_threads")
def test_steps_slowed_by_a_newly_busy_cpu_drop_the_build_to_one_thread() -> None:
    guard = cpu_threads.ContentionGuard("test")
    # Quiet steps as measured here: 0.06-0.32 s for batches of 18-78 tokens a row, a
    # warm-up step, and single steps up to 2.3x the fastest per token: all kept on 2 threads.
    quiet = [(0.229, 38), (0.062, 18), (0.188, 48), (0.065, 18), (0.106, 28), (0.321, 78),
             (0.115, 18), (0.063, 18), (0.174, 38), (0.293, 78), (0.143, 28), (0.066, 18)]
    for seconds, tokens in quiet:
        guard.step_took(seconds, 64 * tokens)
    assert torch.get_num_threads() == 2 and guard.dropped_at is None
    for seconds, tokens in [(0.9, 28), (0.6, 18), (2.5, 78)]:  # ~10x: another process came
        guard.step_took(seconds, 64 * tokens)
    # The median of the last 5 turns at the third slowed step.
    assert torch.get_num_threads() == 1 and guard.dropped_at == len(quiet) + 3
    guard.step_took(0.05, 64 * 18)  # for good: a quiet moment later does not bring it back
    assert torch.get_num_threads() == 1 and guard.dropped_at == len(quiet) + 3


@pytest.mark.usefixtures("two_threads")
def test_a_build_records_whether_it_dropped_to_one_thread(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_threads, "idle_cpus", lambda: 2.0)
    slow_from = 3
    real_step_took = cpu_threads.ContentionGuard.step_took

    def step_took(self: cpu_threads.ContentionGuard, seconds: float, work: float) -> None:
        # Steps 3 on as if another process had taken a core (a real one would make this
        # test's outcome depend on the machine's load).
        real_step_took(self, seconds * (100 if self._steps + 1 >= slow_from else 1), work)

    monkeypatch.setattr(cpu_threads.ContentionGuard, "step_took", step_took)
    cfg = replace(FAST, steps=8, num_threads=2)
    out = ws.warm_start(ChainArithmeticTask(), cfg, cache_dir=tmp_path, progress=False)
    manifest = json.loads((out / ws.MANIFEST).read_text())
    # Steps 1-5 make the first window; 3 of them slowed make its median slow.
    assert manifest["threads"] == 2 and manifest["threads_dropped_to_1_after_step"] == 5
    assert torch.get_num_threads() == 2  # the caller's setting restored


@pytest.fixture
def user_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh HOME with no cache variables set, and two working directories beside it."""
    home = tmp_path / "home"
    home.mkdir()
    for cwd in ("cwd_a", "cwd_b"):
        (tmp_path / cwd).mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("PIPELINERL_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return home


def test_cache_dir_follows_the_user_cache_variables(
    user_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path / "cwd_a")
    assert resolve_cache_dir("") == user_home / ".cache" / "pipelinerl" / "warmstart"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert resolve_cache_dir("") == tmp_path / "xdg" / "pipelinerl" / "warmstart"
    monkeypatch.setenv("PIPELINERL_CACHE", str(tmp_path / "mine"))
    assert resolve_cache_dir(None) == tmp_path / "mine" / "warmstart"
    # An explicit path wins; a relative one is taken against the working directory.
    assert resolve_cache_dir(tmp_path / "given") == tmp_path / "given"
    assert resolve_cache_dir("rel/ws") == tmp_path / "cwd_a" / "rel" / "ws"


def test_cached_warm_start_is_found_from_another_working_directory(
    user_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = ChainArithmeticTask()
    monkeypatch.chdir(tmp_path / "cwd_a")
    out = warm_start(task, FAST, progress=False)
    assert out.parent == user_home / ".cache" / "pipelinerl" / "warmstart"

    def no_training(*args, **kwargs):
        raise AssertionError("a cached warm-start must not train again")

    monkeypatch.setattr(ws, "train", no_training)
    monkeypatch.chdir(tmp_path / "cwd_b")
    assert warm_start(task, FAST, progress=False) == out


def test_launcher_default_cache_dir_does_not_depend_on_cwd_with_fake_warm_start(
    user_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Path] = []

    def fake_warm_start(task, cfg, cache_dir, progress) -> Path:  # records, trains nothing
        seen.append(Path(cache_dir))
        return Path(cache_dir) / "model"

    monkeypatch.setattr(ws, "warm_start", fake_warm_start)
    for cwd in ("cwd_a", "cwd_b"):
        monkeypatch.chdir(tmp_path / cwd)
        starting_model(Config())
    expected = user_home / ".cache" / "pipelinerl" / "warmstart"
    assert seen == [expected, expected]
    starting_model(Config(warmstart={"cache_dir": "rel"}))  # explicit and relative: the cwd
    assert seen[-1] == tmp_path / "cwd_b" / "rel"


def test_the_run_configs_warm_start_settings_reach_the_warm_start_with_a_fake_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[WarmStartConfig] = []
    monkeypatch.setattr(ws, "warm_start", lambda task, cfg, cache_dir, progress: seen.append(cfg))
    starting_model(Config(warmstart={"cache_dir": str(tmp_path)}))
    starting_model(Config(warmstart={"cache_dir": str(tmp_path), "steps": 7, "bf16": True,
                                     "step_error_prob": 0.15, "seed": 2}))
    assert (seen[0].steps, seen[0].bf16) == (WarmStartConfig().steps, False)
    assert (seen[1].steps, seen[1].bf16, seen[1].step_error_prob, seen[1].seed) == (7, True, 0.15, 2)


def test_warm_start_without_progress_prints_no_bar(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    bars_before = hf_logging.is_progress_bar_enabled()
    warm_start(ChainArithmeticTask(), FAST, cache_dir=tmp_path, progress=False)
    out, err = capfd.readouterr()
    assert "%|" not in out + err and "\r" not in out + err, err
    assert hf_logging.is_progress_bar_enabled() == bars_before  # restored for the caller


@pytest.mark.slow
def test_run_with_progress_off_prints_no_progress_bar(tmp_path: Path) -> None:
    """A whole short run (fresh warm-start, actor, trainer) with metrics.progress=false: no
    progress bar in the launcher's output, which the trainer shares, nor in any role's log."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY")}
    overrides = [
        "name=quiet", f"output_dir={tmp_path / 'runs'}", f"warmstart.cache_dir={tmp_path / 'ws'}",
        "warmstart.steps=20", "eval.enabled=false", "engine.capacity=16", "actor.group_size=4",
        "trainer.batch_size=16", "trainer.max_steps=2", "trainer.sample_timeout_s=120",
        "metrics.progress=false",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "pipelinerl.cli", "train", str(EXAMPLE), *overrides],
        env=env, capture_output=True, text=True, timeout=240,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    for log in (tmp_path / "runs" / "quiet" / "logs").glob("*.log"):
        output += log.read_text()
    assert "%|" not in output and "\r" not in output, output


def test_countdown_warm_starts_from_its_demonstrations(tmp_path: Path) -> None:
    from pipelinerl.tasks import CountdownTask

    task = CountdownTask()
    tok = build_char_tokenizer(task.alphabet, tmp_path)
    model = init_tiny_model(tok)
    losses = ws.train(model, tok, task, replace(FAST, steps=150, batch_size=8, lr=3e-3,
                                                warmup_steps=10), progress=False)
    # Less far down than arithmetic's: which expression reaches a target is not determined by
    # the prompt's characters as a worked sum is (measured: 2.84 -> 1.81 in 150 steps).
    assert sum(losses[-10:]) / 10 < 0.75 * sum(losses[:10]) / 10


def test_cache_key_follows_the_task_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Editing the file that defines a user's task retrains the warm-start; a copy of the same
    code elsewhere shares the cached one."""
    source = (
        "from pipelinerl.tasks.arithmetic import ChainArithmeticTask\n"
        "class MyTask(ChainArithmeticTask):\n"
        "    def demonstration(self, problem, rng, step_error_prob):\n"
        "        return super().demonstration(problem, rng, step_error_prob){tail}\n"
    )

    def key_of(name: str, tail: str) -> str:
        path = tmp_path / f"{name}.py"
        path.write_text(source.format(tail=tail))
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)  # as an import of a user's task makes it
        spec.loader.exec_module(module)
        return cache_key(TrainSplit(module.MyTask(), 0.1), FAST)  # as the launcher wraps it

    key = key_of("task_a", "")
    assert key == key_of("task_b", "")  # same contents, another path
    assert key != key_of("task_c", " + ';'")
    assert key != cache_key(TrainSplit(ChainArithmeticTask(), 0.1), FAST)


def test_two_runs_warm_starting_one_new_entry_at_once_build_it_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs started together on a task not yet cached: the second waits for the first
    (and says so) and takes its model, instead of training it a second time."""
    builds = Builds()
    waiting = threading.Event()

    class SeesTheWait(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for another process building" in record.getMessage():
                waiting.set()

    def slow_build(task, cfg, base_model_dir, key, out: Path, progress, demos) -> None:
        with builds.one():
            waiting.wait(10)  # the other run is at the lock, however late it came
            out.mkdir()
            (out / ws.MANIFEST).write_text("{}")

    monkeypatch.setattr(ws, "_build", slow_build)
    handler = SeesTheWait()
    logger = logging.getLogger("pipelinerl.proc.cache")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        results = run_at_once(
            lambda: warm_start(ChainArithmeticTask(), FAST, cache_dir=tmp_path, progress=False))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert waiting.is_set() and len(builds.by) == 1 and builds.most_at_once == 1
    assert len(results) == 2 and results[0] == results[1]


# -- a given model warm-started (warmstart.given_model) --------------------------------------

def _given(model_dir: Path, cache: Path, **overrides: object) -> Config:
    return Config(model={"path": str(model_dir)},
                  task={"name": "tool_kit.demos:FruitCodes", "heldout_frac": 0.0},
                  tools={"functions": ["tool_kit.functions:lookup"], **overrides},
                  warmstart={"given_model": True, "steps": 2, "batch_size": 2, "lr": 1e-3,
                             "warmup_steps": 0, "cache_dir": str(cache)},
                  metrics={"progress": False})


def test_a_given_model_is_warm_started_on_tool_episodes_once_and_a_resume_keeps_it(
        tiny_smollm2_dir: Path, tmp_path: Path) -> None:
    """The tiny model with SmolLM2's tokenizer, trained two steps on the task's tool-using
    episodes (replies from the real function): cached under what it depends on, the base
    recorded, and a resume that names another base refused."""
    from pipelinerl.roles.starting_model import resumed_model

    cfg = _given(tiny_smollm2_dir, tmp_path)
    out = starting_model(cfg)
    manifest = json.loads((out / ws.MANIFEST).read_text())
    assert Path(manifest["base_model_dir"]) == tiny_smollm2_dir
    assert (manifest["config"]["steps"], manifest["config"]["lr"]) == (2, 1e-3)
    assert manifest["eval_problems"] == 0  # the evaluator's version-0 pass measures it
    base = load_model(tiny_smollm2_dir).state_dict()
    tuned = load_model(out).state_dict()
    assert any(not torch.equal(base[k], tuned[k]) for k in base)
    built = (out / ws.MANIFEST).stat().st_mtime_ns
    assert starting_model(cfg) == out and (out / ws.MANIFEST).stat().st_mtime_ns == built
    # The tool prompt is part of what the model learnt: another one is another model.
    assert starting_model(_given(tiny_smollm2_dir, tmp_path, prompt="T:\n{tools}")) != out

    saved = cfg.model_copy(deep=True)
    saved.model.path = str(out)
    assert resumed_model(cfg, saved) == (str(out), [])
    other = _given(tmp_path / "elsewhere", tmp_path)
    assert resumed_model(other, saved)[1] == [
        f"model.path (warm-started): {str(tiny_smollm2_dir)!r} then, "
        f"{str(tmp_path / 'elsewhere')!r} now"]


def test_a_given_model_whose_task_writes_no_tool_episodes_is_refused_naming_what_it_lacks(
        tiny_smollm2_dir: Path, tmp_path: Path) -> None:
    cfg = _given(tiny_smollm2_dir, tmp_path)
    cfg.task.name = "arithmetic"  # demonstrations, but none with tools
    with pytest.raises(SystemExit, match="lacks tool_demonstration.*given_model=false"):
        starting_model(cfg)
