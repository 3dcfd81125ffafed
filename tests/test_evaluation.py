"""Held-out evaluation: the split training never sees, one evaluation pass through the real
torch engine, and (slow) the evaluator role in a whole run and `pipelinerl eval`."""

from __future__ import annotations

import json
import os
import pickle
import random
from pathlib import Path

import pytest
import torch
from fake_tasks import AnswerTask, FirstAttemptTask
from tiny_models import VOCAB, tiny_hf_model

from pipelinerl.config import ConfigError, EvalConfig, load_config
from pipelinerl.engine import EngineOptions
from pipelinerl.engine.torch_engine import TorchEngine
from pipelinerl.roles.heldout import EvalMode, eval_modes, evaluate
from pipelinerl.rollouts.scoring import Scorer
from pipelinerl.tasks import (
    ChainArithmeticTask,
    TrainSplit,
    heldout_problems,
    make_train_task,
)
from pipelinerl.tasks.split import MAX_REDRAWS, heldout_fraction_of, is_heldout
from pipelinerl.types import SamplingParams

torch.set_num_threads(1)

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arithmetic.yaml"


# ---- the split -----------------------------------------------------------------------------


def test_split_is_a_stable_fraction_of_problem_ids() -> None:
    ids = [f"arith:{i}" for i in range(20_000)]
    places = [heldout_fraction_of(i) for i in ids]
    assert places == [heldout_fraction_of(i) for i in ids]  # no per-process salt
    assert all(0.0 <= p < 1.0 for p in places)
    held = sum(is_heldout(i, 0.1) for i in ids) / len(ids)
    assert abs(held - 0.1) < 0.01  # binomial sd of 20k draws at 0.1: 0.002
    assert not any(is_heldout(i, 0.0) for i in ids)


def test_training_never_draws_a_heldout_problem_and_evaluation_only_those() -> None:
    task = ChainArithmeticTask()
    train = make_train_task("arithmetic", {}, 0.1)
    rng = random.Random(0)
    drawn = {train.sample_problem(rng).problem_id for _ in range(20_000)}
    heldout = heldout_problems(task, 500, seed=0, heldout_frac=0.1)
    assert len(heldout) == 500 and all(is_heldout(p.problem_id, 0.1) for p in heldout)
    assert not drawn & {p.problem_id for p in heldout}
    assert not any(is_heldout(i, 0.1) for i in drawn)
    # The same set for every process and call with the same seed, another with another seed.
    assert heldout == heldout_problems(ChainArithmeticTask(), 500, seed=0, heldout_frac=0.1)
    assert heldout != heldout_problems(task, 500, seed=1, heldout_frac=0.1)
    # Without a split, short chains repeat: held-out ids do occur among unfiltered draws.
    raw = {task.sample_problem(rng).problem_id for _ in range(20_000)}
    assert raw & {p.problem_id for p in heldout}


def test_train_split_keeps_the_task_interface_and_pickles() -> None:
    train = make_train_task("arithmetic", {"max_terms": 4}, 0.2)
    assert isinstance(train, TrainSplit)
    assert train.name == "arithmetic" and train.alphabet == ChainArithmeticTask.alphabet
    assert train.params() == {**ChainArithmeticTask(max_terms=4).params(), "heldout_frac": 0.2}
    problem = train.sample_problem(random.Random(1))
    assert train.score(problem, f"A={problem.answer}").success
    assert train.demonstration(problem, random.Random(0), 0.0).endswith(f"A={problem.answer:02d}")
    clone = pickle.loads(pickle.dumps(train))  # the verifier workers unpickle it
    assert clone.params() == train.params()
    assert make_train_task("arithmetic", {}, 0.0).__class__ is ChainArithmeticTask


def test_a_split_that_leaves_nothing_fails_naming_the_key() -> None:
    one = AnswerTask([True])
    frac = heldout_fraction_of("answer:0")
    with pytest.raises(RuntimeError, match=f"{MAX_REDRAWS} draws.*task.heldout_frac"):
        TrainSplit(one, frac + 1e-9).sample_problem(random.Random(0))
    with pytest.raises(RuntimeError, match="raise task.heldout_frac"):
        heldout_problems(one, 1, seed=0, heldout_frac=frac - 1e-9)


def test_eval_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="task.heldout_frac > 0"):
        load_config(EXAMPLE, ["eval.enabled=true", "task.heldout_frac=0"])
    with pytest.raises(ConfigError, match="nothing to evaluate"):
        load_config(EXAMPLE, ["eval.enabled=true", "eval.greedy=false", "eval.temperature=0"])
    modes = eval_modes(EvalConfig(temperature=0.7, samples=4), SamplingParams(top_k=5, top_p=0.9))
    assert [(m.name, m.params.temperature, m.params.top_k, m.params.top_p, m.attempts)
            for m in modes] == [("greedy", 0.0, 0, 1.0, 1), ("sampled", 0.7, 5, 0.9, 4)]


# ---- one pass through the torch engine -------------------------------------------------------


def _engine(capacity: int = 8) -> TorchEngine:
    hf = tiny_hf_model("qwen2")
    engine = TorchEngine(hf.config, EngineOptions(capacity=capacity, max_seq_len=64))
    engine.load_weights(hf.state_dict(), version=3)
    return engine


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (2 + i % 5,), generator=gen).tolist() for i in range(n)]


def _run(task, engine: TorchEngine, modes: list[EvalMode], workers: int = 2, **kw):
    problems = task.problems()
    scorer = Scorer(task, timeout_s=30, workers=workers)
    try:
        return evaluate(engine, problems, _prompts(len(problems)), modes, scorer,
                        decode=lambda ids: " ".join(map(str, ids)), **kw)
    finally:
        scorer.close()


SOLVABLE = [True, False, True, True, False, False, True, False, False, True, True, False, True]


def test_a_pass_scores_every_problem_once_per_attempt() -> None:
    # 13 problems, 7 solvable; the engine holds 8 sequences, so problems queue behind others.
    base = SamplingParams(max_new_tokens=6)
    modes = [EvalMode("greedy", SamplingParams(max_new_tokens=6, temperature=0.0), 1),
             EvalMode("sampled", base, 3)]
    out = _run(FirstAttemptTask(SOLVABLE), _engine(), modes)
    assert out["eval/greedy"] == pytest.approx(7 / 13)
    # Sampled: 3 attempts, exactly the first scored of a solvable problem succeeds. The
    # greedy attempt was the first, so none of the sampled ones does.
    assert out["eval/sampled/pass@1"] == 0.0 and out["eval/sampled/pass@3"] == 0.0
    out = _run(FirstAttemptTask(SOLVABLE), _engine(), modes[1:])
    assert out["eval/sampled/pass@1"] == pytest.approx(7 / 13 / 3)
    assert out["eval/sampled/pass@3"] == pytest.approx(7 / 13)
    assert out["eval/num_problems"] == 13
    assert 1 <= out["eval/sampled/completion_len"] <= 6
    assert 0 <= out["eval/sampled/truncated_frac"] <= 1


def test_a_failing_verifier_counts_as_unsolved_and_is_counted() -> None:
    solvable: list = list(SOLVABLE)
    solvable[0] = solvable[1] = None  # AnswerTask.score raises on these (in worker processes)
    modes = [EvalMode("greedy", SamplingParams(max_new_tokens=4, temperature=0.0), 1)]
    out = _run(AnswerTask(solvable), _engine(), modes)
    assert out["eval/greedy"] == pytest.approx(6 / 13)
    assert out["eval/greedy/verifier_failures"] == 2


def test_weights_changing_mid_pass_are_refused() -> None:
    engine = _engine(capacity=2)
    weights = tiny_hf_model("qwen2", seed=1).state_dict()
    modes = [EvalMode("greedy", SamplingParams(max_new_tokens=8, temperature=0.0), 1)]
    with pytest.raises(RuntimeError, match="weights changed mid-pass"):
        _run(AnswerTask(SOLVABLE), engine, modes,
             between_steps=lambda: engine.load_weights(weights, version=4))


# ---- the evaluator role after a resume, with stand-ins for its engine and channels ----------


class _Receiver:
    """The resumed trainer's channel: it published its checkpoint's weights."""

    def __init__(self, version: int) -> None:
        self.version = version

    def poll(self) -> int:
        return self.version

    def receive_into(self, tensors: dict) -> int:
        return self.version

    def close(self) -> None:
        pass


class _Records:
    """A stream: records written, or read once."""

    def __init__(self, records: list[dict] | None = None) -> None:
        self.records = records or []

    def write(self, record: dict) -> None:
        self.records.append(record)

    def read(self, max_count: int, timeout_s: float) -> list[dict]:
        out, self.records = self.records, []
        return out

    def close(self) -> None:
        pass


class _Engine:
    version = 0

    def load_weights(self, tensors: dict, version: int) -> None:
        self.version = version


class _Setup:
    def __init__(self) -> None:
        self.evaluated: list[int] = []

    def run(self, engine: _Engine, between_steps: object) -> dict[str, float]:
        self.evaluated.append(engine.version)
        return {"eval/greedy": 0.5}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("logged_before_the_crash", [False, True])
def test_a_resumed_evaluator_evaluates_the_checkpoints_version_unless_it_was_logged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logged_before_the_crash: bool) -> None:
    """Attempt 1 resumes from the checkpoint of step 4 and stops there (a finished run resumed).
    The crashed attempt's result for version 4, if any, counts only once in metrics.jsonl: the
    trainer logs no other attempt's results."""
    import pipelinerl.roles.evaluator as evaluation

    cfg = load_config(overrides=["model.path=unused", f"output_dir={tmp_path}", "name=r",
                                 "attempt=1", "eval.every_steps=1", "eval.every_s=0"])
    rows = [{"step": s} for s in range(1, 5)] + [{"step": 2, "eval/version": 2}]
    if logged_before_the_crash:
        rows.append({"step": 4, "eval/version": 4})
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    setup, results = _Setup(), _Records()
    stop = {"type": "stop", "attempt": 1, "step": 4, "final_published": True}
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(evaluation, "build_eval_setup", lambda cfg, path: (setup, _Engine()))
    monkeypatch.setattr(evaluation, "load_model", lambda *a, **kw: torch.nn.Linear(1, 1))
    monkeypatch.setattr(evaluation, "open_weight_receiver", lambda *a, **kw: _Receiver(4))
    monkeypatch.setattr(evaluation, "open_eval_writer", lambda cfg: results)
    monkeypatch.setattr(evaluation, "open_control_reader", lambda cfg: _Records([stop]))
    evaluation.run_evaluator(cfg)
    assert setup.evaluated == ([] if logged_before_the_crash else [4])
    final = {"version": 4, "final": True, "attempt": 1}
    assert results.records == ([final] if logged_before_the_crash else [
        {"version": 4, "final": False, "attempt": 1, "eval/greedy": 0.5}, final])


class _Publishing(_Receiver):
    """A trainer publishing `versions` one poll after another; each version's weights are
    filled with its number."""

    def __init__(self, versions: list[int]) -> None:
        super().__init__(0)
        self.queue = list(versions)

    def poll(self) -> int | None:
        return self.queue[0] if self.queue else None

    def receive_into(self, tensors: dict) -> int:
        version = self.queue.pop(0)
        for t in tensors.values():
            t.fill_(float(version))
        return version


class _StopAfter(_Records):
    """The control stream: the stop record at the `n`-th read."""

    def __init__(self, stop: dict, n: int) -> None:
        super().__init__()
        self.stop, self.n = stop, n

    def read(self, max_count: int, timeout_s: float) -> list[dict]:
        self.n -= 1
        return [self.stop] if self.n == 0 else []


class _LoadingEngine(_Engine):
    def __init__(self) -> None:
        self.loaded: dict[int, float] = {}

    def load_weights(self, tensors: dict, version: int) -> None:
        super().load_weights(tensors, version)
        self.loaded[version] = float(next(iter(tensors.values())).flatten()[0])


def test_deferred_evaluation_keeps_each_due_version_and_evaluates_them_after_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pipelinerl.roles.evaluator as evaluation
    from pipelinerl.run.eval_snapshots import SNAPSHOTS_DIR

    cfg = load_config(overrides=["model.path=unused", f"output_dir={tmp_path}", "name=r",
                                 "eval.every_steps=1", "eval.every_s=0", "eval.deferred=true"])
    cfg.run_dir.mkdir(parents=True)
    setup, results, engine = _Setup(), _Records(), _LoadingEngine()
    stop = {"type": "stop", "attempt": 0, "step": 4, "final_published": True}
    threads: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(evaluation, "build_eval_setup", lambda cfg, path: (setup, engine))
    monkeypatch.setattr(evaluation, "load_model", lambda *a, **kw: torch.nn.Linear(2, 2))
    monkeypatch.setattr(evaluation, "open_weight_receiver", lambda *a, **kw: _Publishing([2, 4]))
    monkeypatch.setattr(evaluation, "open_eval_writer", lambda cfg: results)
    monkeypatch.setattr(evaluation, "open_control_reader", lambda cfg: _StopAfter(stop, 3))
    evaluation.run_evaluator(cfg)
    # nothing evaluated while the run went on: versions 0, 2, 4, each with its own weights
    # (starting model: the stand-in's; then filled with the version), after it
    assert setup.evaluated == [0, 2, 4]
    assert engine.loaded[2] == 2.0 and engine.loaded[4] == 4.0
    assert results.records == [
        *({"version": v, "final": False, "attempt": 0, "eval/greedy": 0.5} for v in (0, 2, 4)),
        {"version": 4, "final": True, "attempt": 0}]
    # on the cores of every role (no more than the machine's), then back to its own
    roles = cfg.actor.threads + cfg.trainer.threads + cfg.eval.threads
    assert threads[-2:] == [min(roles, os.cpu_count()), cfg.eval.threads]
    assert list((cfg.run_dir / SNAPSHOTS_DIR).iterdir()) == []


def test_snapshots_of_versions_a_resume_remade_are_dropped(tmp_path: Path) -> None:
    """Attempt 0 kept versions 0, 3, 6; attempt 1 resumed from step 5 and kept 5 (the
    checkpoint's, equal to attempt 0's) and 8. Attempt 0's 6 is no version of the run's."""
    from pipelinerl.run.attempts import record_resume
    from pipelinerl.run.eval_snapshots import Snapshots

    weights = {"w": torch.ones(2)}
    for attempt, versions in ((0, (0, 3, 6)), (1, (5, 8))):
        for version in versions:
            Snapshots(tmp_path, attempt).save(version, weights)
    record_resume(tmp_path, 1, 5)
    snapshots = Snapshots(tmp_path, 1)
    pending = snapshots.pending(evaluated={0})
    assert [(v, p.name) for v, p in pending] == [
        (3, "a0-v3.safetensors"), (5, "a1-v5.safetensors"), (8, "a1-v8.safetensors")]
    # the dropped and the evaluated are gone from disk
    assert sorted(p.name for p in snapshots.dir.iterdir()) == [
        "a0-v3.safetensors", "a1-v5.safetensors", "a1-v8.safetensors"]
    assert torch.equal(Snapshots.load(pending[0][1], "cpu")["w"], weights["w"])


# ---- the evaluator role in a run, and `pipelinerl eval` (slow) ------------------------------


def _run_overrides(tmp_path: Path, cache: Path, name: str, *extra: str) -> list[str]:
    return [
        f"name={name}", f"output_dir={tmp_path / 'runs'}",
        f"warmstart.cache_dir={cache}", "warmstart.steps=20",
        "engine.capacity=16", "actor.group_size=4", "trainer.batch_size=16",
        "trainer.max_steps=6", "metrics.progress=false",
        "eval.enabled=true", "eval.num_problems=24", "eval.every_steps=2", "eval.every_s=0",
        "eval.samples=2", *extra,
    ]


@pytest.mark.slow
@pytest.mark.parametrize("sync,deferred", [("broadcast", False), ("shm", True)])
def test_a_run_logs_heldout_evaluations_from_version_0_to_the_final_weights(
        tmp_path: Path, warm_cache: Path, sync: str, deferred: bool) -> None:
    """Over the broadcast channel, whose receivers must be in the group from the start; and
    deferred, over shm (the shm evaluator also runs in tests/test_dataset_task.py's CLI run):
    the same records, made after the run from the weights kept while it ran."""
    from pipelinerl.roles.launch import launch
    from pipelinerl.run.eval_snapshots import SNAPSHOTS_DIR

    cfg = load_config(EXAMPLE, _run_overrides(tmp_path, warm_cache, f"eval-{sync}",
                                              f"sync.backend={sync}", f"eval.deferred={str(deferred).lower()}"))
    assert launch(cfg) == 0
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/version" in r]
    steps = [r for r in records if "eval/version" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    versions = [r["eval/version"] for r in evals]
    # Version 0 first, the final weights last, each version once, every step of one version.
    assert versions[0] == 0 and versions[-1] == 6 and versions == sorted(set(versions))
    made = {r["step"]: r["time_s"] for r in steps} | {0: 0.0}
    for r in evals:
        assert r["step"] == r["eval/version"] and r["time_s"] == made[r["step"]]
        assert 0.0 <= r["eval/greedy"] <= 1.0 and r["eval/num_problems"] == 24
        assert 0.0 <= r["eval/sampled/pass@1"] <= r["eval/sampled/pass@2"] <= 1.0
    assert "evaluated version 6" in (cfg.run_dir / "logs" / "evaluator.log").read_text()
    if deferred:  # logged after the last step, every kept version evaluated and removed
        assert "eval/version" not in records[-len(evals) - 1]
        assert list((cfg.run_dir / SNAPSHOTS_DIR).iterdir()) == []


@pytest.mark.slow
def test_the_eval_command_evaluates_a_saved_model(tmp_path, warm_cache, capsys):
    from pipelinerl.cli import main
    from pipelinerl.roles.launch import prepare_run

    cfg = prepare_run(load_config(EXAMPLE, _run_overrides(tmp_path, warm_cache, "cli")), overwrite=False)
    overrides = [f"warmstart.cache_dir={warm_cache}", "eval.num_problems=16",
                 "eval.samples=2"]
    assert main(["eval", cfg.model.path, str(EXAMPLE), *overrides]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert figures["eval/num_problems"] == 16
    assert 0.0 <= figures["eval/sampled/pass@1"] <= figures["eval/sampled/pass@2"] <= 1.0
    assert main(["eval", str(tmp_path / "missing"), str(EXAMPLE)]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("test_split", [None, "test"])
def test_the_eval_command_names_what_chose_its_held_out_set(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], test_split: str | None) -> None:
    """task.heldout_frac in the header only when it chose the set: a dataset's test split (an
    environment's eval_taskset likewise) is the task's own held-out set (issue 41)."""
    from pipelinerl.models.tiny import build_char_tokenizer, build_tiny_model
    from pipelinerl.roles.heldout import evaluate_saved_model

    model = build_tiny_model(tmp_path / "model", build_char_tokenizer("0123456789+=", tmp_path))
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text("".join(
            json.dumps({"q": f"{a}+{b}=", "sol": str(a + b)}) + "\n"
            for a in range(10) for b in range(10)))
    params = json.dumps({"path": str(data), "prompt_column": "q", "answer_column": "sol",
                         **({"test_split": test_split} if test_split else {})})
    cfg = load_config(overrides=[f"model.path={model}", "task.name=dataset",
                                 f"task.params={params}", "task.heldout_frac=0.5",
                                 "eval.num_problems=2", "eval.temperature=0",
                                 "engine.max_new_tokens=2", "eval.capacity=2"])
    assert evaluate_saved_model(str(model), cfg) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "2 held-out problems of task 'dataset'" in header
    if test_split:
        assert "the task's own held-out set" in header and "heldout_frac" not in header
    else:
        assert "task.heldout_frac=0.5" in header


def test_the_eval_command_refuses_a_task_its_verifier_workers_cannot_receive(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One line, exit 2, before the model loads (there is none here): before, a TypeError
    traceback after the model was loaded."""
    from pipelinerl.roles.heldout import evaluate_saved_model

    (tmp_path / "locked_task.py").write_text(
        "import threading\n"
        "from pipelinerl.tasks import ChainArithmeticTask\n"
        "class Locked(ChainArithmeticTask):\n"
        "    def __init__(self, **kw):\n"
        "        super().__init__(**kw)\n"
        "        self.lock = threading.Lock()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(overrides=["task.name=locked_task:Locked", "eval.num_problems=2"])
    assert evaluate_saved_model(str(tmp_path / "no-model-needed"), cfg) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipelinerl eval: task ") and "cannot be sent to the verifier" in err
    assert "Traceback" not in err
