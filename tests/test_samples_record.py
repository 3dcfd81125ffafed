"""samples.jsonl (pipelinerl.run.samples): what the trainer records of the groups it trains, through
the trainer's own loop (`TrainerRun.train`) on a tiny model, checked against what the step
computes; off at 0, bounded on disk, and continued without repeats by a resumed run."""

from __future__ import annotations

import io
import json
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch
from fake_tasks import AnswerTask
from tiny_models import VOCAB, tiny_hf_model

from pipelinerl.config import Config, MetricsConfig, load_config
from pipelinerl.engine import EngineOptions
from pipelinerl.engine.torch_engine import TorchEngine
from pipelinerl.metrics.logger import (
    SAMPLE_TABLE,
    TABLE_COLUMNS,
    TABLE_ROWS,
    MetricsLogger,
)
from pipelinerl.models.tiny import build_char_tokenizer
from pipelinerl.rl.advantages import groups_advantages
from pipelinerl.rl.batches import BatchSource
from pipelinerl.rl.packing import pack
from pipelinerl.rl.scores import score_tokens
from pipelinerl.rl.step import _scoring
from pipelinerl.roles.heldout import EvalMode, EvalSetup
from pipelinerl.roles.trainer import Trainer, TrainerRun, progress_bar
from pipelinerl.rollouts.scoring import Scorer
from pipelinerl.run.samples import (
    EVAL_SAMPLES,
    SAMPLES,
    EvalSampleRecord,
    SampleRecord,
    open_eval_record,
    open_record,
    read_eval_samples,
    read_samples,
)
from pipelinerl.run.trainer_records import TrainerRecords
from pipelinerl.types import ENV_VERSION, Group, Sample, SamplingParams

torch.set_num_threads(1)

GROUP = 4
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRST"  # 4 specials + 46 = VOCAB


def tokenizer(tmp_path: Path):
    tok = build_char_tokenizer(ALPHABET, tmp_path / "tokenizer")
    assert len(tok) == VOCAB
    return tok


def step_groups(step: int, n_groups: int = 3) -> list[Group]:
    """Groups of different lengths, sampled by versions up to `step`, with made-up engine
    log-probs; group 0 holds an empty completion and a multi-turn sample (environment tokens
    in its middle, not trained)."""
    g = torch.Generator().manual_seed(100 + step)
    groups = []
    for p in range(n_groups):
        prompt = torch.randint(4, VOCAB, (3,), generator=g).tolist()
        samples = []
        for j in range(GROUP):
            n = 2 + 3 * j + p
            tokens = torch.randint(4, VOCAB, (n,), generator=g).tolist()
            old = (-3.0 + 0.8 * torch.randn(n, generator=g)).tolist()
            versions = torch.randint(max(0, step - 3), step + 1, (n,), generator=g).tolist()
            samples.append(Sample(prompt, tokens, old, versions, float(j % 2), j % 2 == 1,
                                  "stop" if j else "length", group_id=f"{step}-{p}"))
        if p == 0:
            samples[0] = Sample(prompt, [], [], [], 0.0, False, "stop", group_id=f"{step}-0")
            mask = [True, True, False, False, True]
            s = samples[1]
            samples[1] = Sample(prompt, s.token_ids, [0.0 if not m else lp for m, lp in
                                                      zip(mask, s.logprobs)],
                                [v if m else ENV_VERSION for m, v in zip(mask, s.versions)],
                                s.reward, s.success, "stop", group_id=s.group_id,
                                model_mask=mask, turns=2)
        groups.append(Group(f"{step}-{p}", f"problem {step}-{p}", samples))
    return groups


class _Source(SimpleNamespace):
    """What `TrainerRun.train` reads of rank 0's stream source besides the groups."""

    def __init__(self) -> None:
        super().__init__(wait_s=0.0, dropped={}, actor_stats={})

    def take_dropped_ids(self) -> dict[str, list[str]]:
        return {}

    def take_dropped_groups(self) -> list[tuple[str, int, Group]]:
        return []


def config(*overrides: str) -> Config:
    return load_config(overrides=[f"actor.group_size={GROUP}", f"trainer.batch_size={3 * GROUP}",
                                  "trainer.max_tokens_per_row=24", *overrides])


def train(cfg: Config, tmp_path: Path, steps: list[list[Group]], start: int = 0,
          resume_step: int | None = None, source: BatchSource | None = None,
          trained_log: io.StringIO | None = None, metrics: Any = None
          ) -> list[dict[str, torch.Tensor]]:
    """`TrainerRun.train` over `steps`' groups (or, given a `source`, the groups it yields)
    from trainer step `start`, recording into `tmp_path` as `setup` opens the record; the
    weights each step started from."""
    model = tiny_hf_model("qwen2", seed=1).train()
    trainer = Trainer(cfg, model, source=source or _Source(), sender=None)
    trainer.step = start
    record = open_record(tmp_path, cfg.metrics, tokenizer(tmp_path), resume_step)
    weights: list[dict[str, torch.Tensor]] = []

    def batches() -> Iterator[list[Group]]:
        for groups in steps:  # taken just before the step trains on them
            weights.append({k: v.clone() for k, v in model.state_dict().items()})
            yield groups

    run = TrainerRun(cfg=cfg, rank=0, world=1, device="cpu", model=model, sharded=False,
                     trainer=trainer, tokenizer=None, due=lambda step: False,
                     bar=progress_bar(cfg, enabled=False),
                     batches=trainer.batches() if source is not None else batches(),
                     records=TrainerRecords(
                         metrics or SimpleNamespace(log=lambda step, record: None,
                                                    log_samples=lambda step, rows: None),
                         trained_log or io.StringIO(), record),
                     control=None, evals=None)
    run.train()
    if record is not None:
        record.close()
    return weights


def expected_logprobs(weights: dict[str, torch.Tensor], cfg: Config, sample: Sample
                      ) -> list[float]:
    """score_tokens on the sample alone under `weights`: its trained tokens' log-probs."""
    model = tiny_hf_model("qwen2", seed=1)
    model.load_state_dict(weights)
    (batch,) = pack([sample], torch.zeros(1), 1000)
    with torch.no_grad():
        return score_tokens(model, batch, *_scoring(cfg.engine)).logprobs.tolist()


def strict_rows(path: Path) -> list[dict]:
    """Every line parses as JSON, without NaN or infinities."""
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in {path}")
    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def test_records_what_the_step_computed_for_each_token(tmp_path: Path) -> None:
    cfg = config("trainer.max_steps=3")
    steps = [step_groups(step) for step in range(3)]
    weights = train(cfg, tmp_path, steps)
    assert any((a != b).any() for a, b in zip(weights[0].values(), weights[-1].values()))
    rows = strict_rows(tmp_path / SAMPLES)
    # The default: 2 groups of the 3 of every step, the first ones.
    assert [(r["step"], r["version"], r["group_id"]) for r in rows] == [
        (s + 1, s, f"{s}-{p}") for s in range(3) for p in range(2)]
    for row in rows:
        version = row["version"]
        group = steps[version][int(row["group_id"].split("-")[1])]
        tc = cfg.trainer
        advantages = groups_advantages([group], tc.advantage.baseline, tc.advantage.std_normalize,
                                       truncated=tc.loss.truncated,
                                       truncated_reward=tc.loss.truncated_reward).tolist()
        assert row["problem"] == group.prompt
        assert row["prompt"] == "".join(ALPHABET[t - 4] for t in group.samples[0].prompt_ids)
        assert len(row["samples"]) == GROUP
        for sample, got, advantage in zip(group.samples, row["samples"], advantages):
            tokens = got["tokens"]
            n = len(sample.token_ids)
            assert got["length"] == n and got["finish_reason"] == sample.finish_reason
            assert got["reward"] == sample.reward
            assert tokens["text"] == [ALPHABET[t - 4] for t in sample.token_ids]
            assert got["completion"] == "".join(tokens["text"])
            assert tokens["version"] == sample.versions
            assert tokens["lag"] == [version - v if v != ENV_VERSION else None
                                     for v in sample.versions]
            mask = sample.model_mask or [True] * n
            assert tokens["mask"] == [int(m) for m in mask]
            if not n:  # nothing trained: no advantage came out of the step
                assert got["advantage"] is None and tokens["trainer_logprob"] == []
                continue
            assert math.isclose(got["advantage"], advantage, abs_tol=1e-5)
            trained = [lp for lp in tokens["trainer_logprob"] if lp is not None]
            expected = expected_logprobs(weights[version], cfg, sample)
            torch.testing.assert_close(torch.tensor(trained), torch.tensor(expected),
                                       atol=1e-5, rtol=0)
            for m, t, e, w, old in zip(mask, tokens["trainer_logprob"], tokens["engine_logprob"],
                                       tokens["importance_weight"], sample.logprobs):
                if not m:  # an environment's token: no engine log-prob, not trained
                    assert (t, e, w) == (None, None, None)
                    continue
                assert math.isclose(e, old, abs_tol=1e-6)
                assert math.isclose(w, math.exp(t - e), rel_tol=1e-5)


def test_all_groups_when_asked(tmp_path: Path) -> None:
    cfg = config("trainer.max_steps=2", "metrics.samples_per_step=-1")
    train(cfg, tmp_path, [step_groups(step) for step in range(2)])
    assert [(r["step"], r["group_id"]) for r in read_samples(tmp_path)] == [
        (s + 1, f"{s}-{p}") for s in range(2) for p in range(3)]


def test_zero_turns_it_off(tmp_path: Path) -> None:
    cfg = config("trainer.max_steps=1", "metrics.samples_per_step=0")
    train(cfg, tmp_path, [step_groups(0)])
    assert not (tmp_path / SAMPLES).exists()


def test_the_step_returns_nothing_more_unless_asked() -> None:
    from pipelinerl.rl.step import rl_step

    cfg = config()
    model = tiny_hf_model("qwen2", seed=1).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    assert "scored" not in rl_step(model, optimizer, step_groups(0), cfg, 0)
    scored = rl_step(model, optimizer, step_groups(0), cfg, 0, keep_groups=1)["scored"]
    assert len(scored) == GROUP and scored[0].advantage is None


def test_a_resumed_run_continues_without_repeats(tmp_path: Path) -> None:
    """Attempt 0 records steps 1-4 and crashes (a torn last line); the resume from step 2's
    checkpoint drops what came after it and records steps 3-4 anew."""
    steps = [step_groups(step) for step in range(4)]
    train(config("trainer.max_steps=4"), tmp_path, steps)
    with (tmp_path / SAMPLES).open("a") as f:
        f.write('{"step": 5, "vers')
    train(config("trainer.max_steps=4"), tmp_path, steps[2:], start=2, resume_step=2)
    rows = strict_rows(tmp_path / SAMPLES)
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3, 4, 4]


def test_bounded_on_disk(tmp_path: Path) -> None:
    """Past half the bound the file rolls on; the newest steps stay, in order, and the two
    files hold no more than the bound and one step's lines."""
    cfg = config("trainer.max_steps=6", "metrics.samples_max_mb=0.02")  # rolls past 10 KiB
    train(cfg, tmp_path, [step_groups(step) for step in range(6)])
    files = [tmp_path / "samples.1.jsonl", tmp_path / SAMPLES]
    assert all(p.exists() for p in files)
    one_step = max(len(json.dumps(r)) + 1 for r in read_samples(tmp_path)) * 2
    assert sum(p.stat().st_size for p in files) <= 0.02 * 2**20 + one_step
    steps = [r["step"] for r in read_samples(tmp_path)]
    assert steps == sorted(steps) and steps[-1] == 6 and steps[0] > 1


def test_record_keeps_the_first_groups(tmp_path: Path) -> None:
    cfg = config("metrics.samples_per_step=5")
    record = SampleRecord(tmp_path, cfg.metrics, tokenizer(tmp_path), None)
    assert (record.groups_to_keep(3), record.groups_to_keep(8)) == (3, 5)
    record.close()


class _Reader:
    """A rollout stream holding `records`, read once."""

    def __init__(self, records: list[dict]) -> None:
        self.records = records

    def read(self, max_count: int, timeout_s: float) -> list[dict]:
        records, self.records = self.records[:max_count], self.records[max_count:]
        return records


def _at_version(group: Group, version: int, group_id: str) -> Group:
    """`group` renamed, every token sampled by `version`."""
    samples = [replace(s, versions=[version] * len(s.token_ids), group_id=group_id)
               for s in group.samples]
    return Group(group_id, group.prompt, samples)


def test_a_group_dropped_as_too_stale_is_recorded_with_its_reason(tmp_path: Path) -> None:
    """Through the trainer's real source (`BatchSource`, lag bound 1) at step 5: two groups of
    version 2 (lag 3) come before the step's three fresh ones; both are dropped as stale, the
    first recorded (samples_per_step=1 bounds the dropped lines too), the step trains on."""
    cfg = config("trainer.max_steps=6", "metrics.samples_per_step=1")
    old = step_groups(2, n_groups=3)
    stale = [_at_version(old[p], 2, f"stale-{p}") for p in (1, 2)]  # group 0 has an empty one
    fresh = [_at_version(g, 5, f"fresh-{p}") for p, g in enumerate(step_groups(5, 4)[1:])]
    source = BatchSource(_Reader([g.to_dict() for g in stale + fresh]), GROUP, max_lag=1,
                         timeout_s=5.0, keep_dropped=cfg.metrics.samples_per_step)
    trained = io.StringIO()
    train(cfg, tmp_path, [], start=5, source=source, trained_log=trained)
    assert json.loads(trained.getvalue())["dropped"] == {"stale": ["stale-1", "stale-2"]}
    rows = strict_rows(tmp_path / SAMPLES)
    assert [(r["step"], r["group_id"], r.get("dropped")) for r in rows] == [
        (6, "stale-1", "stale"), (6, "fresh-0", None)]
    dropped = rows[0]
    assert dropped["version"] == 5 and dropped["problem"] == old[1].prompt
    for sample, got in zip(stale[0].samples, dropped["samples"]):
        assert got["reward"] == sample.reward and got["advantage"] is None
        assert got["completion"] == "".join(ALPHABET[t - 4] for t in sample.token_ids)
        tokens = got["tokens"]
        assert tokens["lag"] == [3] * len(sample.token_ids)
        assert tokens["engine_logprob"] == [round(lp, 6) for lp in sample.logprobs]
        assert set(tokens["mask"]) == {0} and set(tokens["trainer_logprob"]) == {None}
    assert not source.dropped_groups  # taken with the step: nothing held past it


# ---- eval_samples.jsonl: the evaluator's held-out completions -------------------------------


def _eval_setup(tmp_path: Path, record: EvalSampleRecord | None, solvable: list[bool | None]
                ) -> tuple[EvalSetup, TorchEngine]:
    """The evaluator's pass (`EvalSetup.run`) on the torch engine with a tiny model, over
    AnswerTask's problems (problem i solved iff solvable[i]; None: its verifier raises)."""
    hf = tiny_hf_model("qwen2")
    engine = TorchEngine(hf.config, EngineOptions(capacity=4, max_seq_len=64))
    engine.load_weights(hf.state_dict(), version=0)
    task = AnswerTask(solvable)
    problems = task.problems()
    prompts = [[5 + i, 6, 7] for i in range(len(problems))]
    modes = [EvalMode("greedy", SamplingParams(max_new_tokens=5, temperature=0.0), 1),
             EvalMode("sampled", SamplingParams(max_new_tokens=5, temperature=1.0), 2)]
    decode = tokenizer(tmp_path).decode
    return EvalSetup(problems, prompts, modes, Scorer(task, timeout_s=30, workers=1), decode,
                     samples=record), engine


def test_the_evaluator_records_each_versions_completions_once(tmp_path: Path) -> None:
    """Versions 0 and 3 are recorded, one line per problem and mode; a restarted evaluator
    (the same run directory, a torn last line) evaluating version 3 again writes nothing."""
    cfg = config()
    solvable = [True, False, None]
    setup, engine = _eval_setup(tmp_path, open_eval_record(tmp_path, cfg.metrics, 0), solvable)
    metrics = setup.run(engine)
    engine.load_weights(tiny_hf_model("qwen2", seed=2).state_dict(), version=3)
    setup.run(engine)
    setup.close()
    with (tmp_path / EVAL_SAMPLES).open("a") as f:
        f.write('{"version": 7, "mo')
    rows = read_eval_samples(tmp_path)
    assert [(r["version"], r["mode"], r["problem_id"]) for r in rows] == [
        (v, mode, f"answer:{i}") for v in (0, 3) for mode in ("greedy", "sampled")
        for i in range(3)]
    decode = tokenizer(tmp_path).decode
    for row in rows:
        i = int(row["problem_id"].split(":")[1])
        assert row["attempt"] == 0 and row["problem"] == "x"
        assert row["prompt"] == decode([5 + i, 6, 7])
        assert len(row["attempts"]) == (1 if row["mode"] == "greedy" else 2)
        assert (row["failure"] is None) == (solvable[i] is not None)
        for a in row["attempts"]:
            assert 1 <= a["length"] <= 5 and a["finish_reason"] in ("stop", "length")
            assert len(a["completion"]) >= a["length"] - 1  # the char tokenizer: a char a token
            if solvable[i] is None:  # the verifier raised: unscored, `failure` says why
                assert a["reward"] is None
            else:
                assert (a["reward"], a["success"]) == (float(solvable[i]), solvable[i])
    greedy = [r for r in rows if r["version"] == 0 and r["mode"] == "greedy"]
    assert metrics["eval/greedy"] == sum(a["success"] is True for r in greedy
                                         for a in r["attempts"]) / 3
    before = (tmp_path / EVAL_SAMPLES).read_text()
    again, engine = _eval_setup(tmp_path, open_eval_record(tmp_path, cfg.metrics, 0), solvable)
    engine.load_weights(tiny_hf_model("qwen2", seed=2).state_dict(), version=3)
    again.run(engine)
    again.close()
    assert (tmp_path / EVAL_SAMPLES).read_text() == before.rsplit("\n", 1)[0] + "\n"


def test_a_resume_drops_the_lost_attempts_versions(tmp_path: Path) -> None:
    """Attempt 0 recorded versions 0, 2 and 4 and crashed; attempt 1 resumed from step 2:
    attempt 0's version 4 came from lost weights, so attempt 1's version 4 is recorded."""
    from pipelinerl.run.attempts import record_resume

    cfg = config()
    record = EvalSampleRecord(tmp_path, cfg.metrics, 0)
    for version in (0, 2, 4):
        record.write(version, [{"version": version, "attempt": 0, "mode": "greedy"}])
    record.close()
    record_resume(tmp_path, 1, 2)
    record = EvalSampleRecord(tmp_path, cfg.metrics, 1)
    assert not record.write(2, [{"version": 2, "attempt": 1, "mode": "greedy"}])
    assert record.write(4, [{"version": 4, "attempt": 1, "mode": "greedy"}])
    record.close()
    assert [(r["version"], r["attempt"]) for r in read_eval_samples(tmp_path)] == [
        (0, 0), (2, 0), (4, 1)]


def test_eval_record_bounded_on_disk(tmp_path: Path) -> None:
    cfg = config("metrics.samples_max_mb=0.002")  # rolls past 1 KiB
    record = EvalSampleRecord(tmp_path, cfg.metrics, 0)
    for version in range(20):
        record.write(version, [{"version": version, "attempt": 0, "text": "y" * 200}])
    record.close()
    versions = [r["version"] for r in read_eval_samples(tmp_path)]
    assert versions == list(range(versions[0], 20)) and versions[0] > 0
    assert not open_eval_record(tmp_path, config("metrics.samples_per_step=0").metrics, 0)


# ---- a few samples a step in TensorBoard and W&B ---------------------------------------------


def test_tensorboard_gets_a_table_of_samples_each_step(tmp_path: Path) -> None:
    """Read back from the event file: one text per step, a markdown table of TABLE_ROWS samples
    taken from the recorded groups in turn, as samples.jsonl holds them."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = config("trainer.max_steps=2")
    metrics = MetricsLogger(tmp_path, MetricsConfig(tensorboard=True), "run", {})
    train(cfg, tmp_path, [step_groups(step) for step in range(2)], metrics=metrics)
    metrics.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors(f"{SAMPLE_TABLE}/text_summary")
    assert [e.step for e in texts] == [1, 2]
    rows = read_samples(tmp_path)
    for event in texts:
        table = event.tensor_proto.string_val[0].decode().splitlines()
        assert table[0] == "| " + " | ".join(TABLE_COLUMNS) + " |"
        assert len(table) == 2 + TABLE_ROWS
        groups = [r for r in rows if r["step"] == event.step]
        # the groups in turn: group 0's first sample, group 1's first, group 0's second, ...
        firsts = [table[2 + k].split(" | ")[0].lstrip("| ") for k in range(TABLE_ROWS)]
        assert firsts == [groups[k % 2]["group_id"] for k in range(TABLE_ROWS)]
        sample = groups[1]["samples"][0]
        cells = table[3].split(" | ")
        assert cells[2] == sample["completion"] and cells[-1] == f"{sample['length']} |"


def test_wandb_gets_a_table_of_samples_each_step(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb", reason="wandb is not installed: the W&B table is "
                                "untested here")
    monkeypatch.setenv("WANDB_MODE", "offline")
    logged: list[tuple[dict, int]] = []
    metrics = MetricsLogger(tmp_path, MetricsConfig(wandb=True), "run", {})
    monkeypatch.setattr(metrics._wandb, "log", lambda values, step=None: logged.append(
        (values, step)))
    train(config("trainer.max_steps=1"), tmp_path, [step_groups(0)], metrics=metrics)
    metrics.close()
    ((values, step),) = [(v, s) for v, s in logged if SAMPLE_TABLE in v]
    table = values[SAMPLE_TABLE]
    assert step == 1 and isinstance(table, wandb.Table)
    assert table.columns == list(TABLE_COLUMNS) and len(table.data) == TABLE_ROWS
    first = read_samples(tmp_path)[0]
    assert table.data[0][:3] == [first["group_id"], first["problem"],
                                 first["samples"][0]["completion"]]
