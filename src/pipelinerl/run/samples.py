"""The trainer's record of what it trained: `<run_dir>/samples.jsonl`, one JSON line per
recorded group (`metrics.samples_per_step` groups of each step), with its text and, per
token, the provenance the step used: the policy version, the lag, the engine's and the
trainer's log-prob, the importance weight and whether the token was trained.

What the step computed comes from `rl.step.rl_step(keep_groups=n)`: an `rl.capture.Capture` keeps the
micro-batches that hold a recorded sample's tokens, their new log-probs on the device, and
reads them back in one copy after the step's loop; other micro-batches cost nothing.

Groups the trainer drops (too stale, another run's, made with lost weights) get a line too,
with `"dropped": <reason>` and no trainer log-probs: up to `metrics.samples_per_step` of them
per step (`BatchSource.keep_dropped`), written with the step whose trained.jsonl row lists them.

The evaluator keeps `<run_dir>/eval_samples.jsonl` likewise (`EvalSampleRecord`): per
evaluated version, one line per held-out problem and mode with its attempts and scores.

Bounded on disk as the streams are: past half of `metrics.samples_max_mb` the file rolls on to
`samples.1.jsonl` (replacing the one before), so the newest steps are kept and the two files
stay within the bound. A resumed run cuts both back to the checkpoint's step (`open`), so no
step repeats. Readers: `read_samples`. Layout of a line: docs/viewing.md.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO, Any

from pipelinerl.config import MetricsConfig
from pipelinerl.records import EVAL_ROLLED, EVAL_SAMPLES, ROLLED, SAMPLES, read_rows
from pipelinerl.rl.capture import Scored
from pipelinerl.run.attempts import read_resumes, valid_upto
from pipelinerl.tasks.base import Problem, Score
from pipelinerl.types import ENV_VERSION, Group

_DIGITS = 6  # decimals of log-probs, significant digits of weights: far below their noise


def _num(x: float | None) -> float | None:
    """Rounded; None for None or a non-finite value (JSON has neither NaN nor inf)."""
    return round(x, _DIGITS) if x is not None and math.isfinite(x) else None


def _weight(trainer: float | None, engine: float | None) -> float | None:
    """exp(trainer - engine) to `_DIGITS` significant digits; None unless both exist."""
    if trainer is None or engine is None:
        return None
    w = math.exp(min(trainer - engine, 700.0))  # 700: the largest exp stays a float
    return float(f"{w:.{_DIGITS}g}") if math.isfinite(w) else None


def group_row(step: int, version: int, group: Group, scored: list[Scored],
              tokenizer: Any) -> dict[str, Any]:
    """One line of samples.jsonl: `group` as trained at `step` by the weights of `version`."""
    pieces = tokenizer.batch_decode([[t] for s in group.samples for t in s.token_ids])
    samples, at = [], 0
    for s, sc in zip(group.samples, scored):
        n = len(s.token_ids)
        engine = [lp if v != ENV_VERSION else None for lp, v in zip(s.logprobs, s.versions)]
        samples.append({
            "completion": tokenizer.decode(s.token_ids),
            "reward": s.reward, "success": s.success, "advantage": _num(sc.advantage),
            "finish_reason": s.finish_reason, "length": n, "turns": s.turns,
            "episode": s.episode, "actor_id": s.actor_id,
            **({"tool_calls": s.tool_calls} if s.tool_calls else {}),
            "tokens": {
                "text": pieces[at:at + n],
                "version": s.versions,
                "lag": [version - v if v != ENV_VERSION else None for v in s.versions],
                "engine_logprob": [_num(lp) for lp in engine],
                "trainer_logprob": [_num(lp) for lp in sc.logprobs],
                "importance_weight": [_weight(t, e) for t, e in zip(sc.logprobs, engine)],
                "mask": [int(lp is not None) for lp in sc.logprobs],
            },
        })
        at += n
    prompt_ids = group.samples[0].prompt_ids if group.samples else []
    return {"step": step, "version": version, "group_id": group.group_id,
            "problem": group.prompt, "prompt": tokenizer.decode(prompt_ids), "samples": samples}


class SampleRecord:
    """Rank 0's samples.jsonl writer."""

    def __init__(self, run_dir: Path, cfg: MetricsConfig, tokenizer: Any,
                 resume_step: int | None) -> None:
        """`resume_step`: a resumed run keeps the lines of steps up to it and appends."""
        self.path, self.rolled = run_dir / SAMPLES, run_dir / ROLLED
        self.per_step = cfg.samples_per_step
        self.roll_bytes = int(cfg.samples_max_mb * 2**20) // 2
        self.tokenizer = tokenizer
        if resume_step is not None:
            for path in (self.rolled, self.path):
                _cut(path, resume_step)
        self._file: IO[str] = self.path.open("a" if resume_step is not None else "w")

    def groups_to_keep(self, n_groups: int) -> int:
        """How many of a step's `n_groups` (rank 0's) to record: the first so many."""
        return n_groups if self.per_step < 0 else min(self.per_step, n_groups)

    def write(self, step: int, version: int, groups: list[Group], scored: list[Scored]
              ) -> list[dict[str, Any]]:
        """The lines of `groups` (`scored`: their samples', flattened, as `Capture` gives),
        returned for the metrics logger's table."""
        rows, at = [], 0
        for group in groups:
            n = len(group.samples)
            rows.append(group_row(step, version, group, scored[at:at + n], self.tokenizer))
            at += n
        self._append(rows)
        return rows

    def write_dropped(self, step: int, dropped: list[tuple[str, int, Group]]) -> None:
        """The lines of groups the trainer dropped, recorded with `step`'s (trained.jsonl's
        row that lists them): (reason, the trainer version they were judged at, group)."""
        rows = []
        for reason, version, group in dropped:
            untrained = [Scored(None, [None] * len(s.token_ids)) for s in group.samples]
            rows.append({**group_row(step, version, group, untrained, self.tokenizer),
                         "dropped": reason})
        if rows:
            self._append(rows)

    def _append(self, rows: list[dict[str, Any]]) -> None:
        self._file.writelines(json.dumps(row) + "\n" for row in rows)
        self._file.flush()  # a reader (the viewer) sees whole steps
        if self._file.tell() >= self.roll_bytes:
            self._file.close()
            self.path.replace(self.rolled)
            self._file = self.path.open("w")

    def close(self) -> None:
        self._file.close()


def open_record(run_dir: Path, cfg: MetricsConfig, tokenizer: Any, resume_step: int | None
                ) -> SampleRecord | None:
    """Rank 0's record, None when `metrics.samples_per_step` is 0 (off)."""
    if not cfg.samples_per_step:
        return None
    return SampleRecord(run_dir, cfg, tokenizer, resume_step)


def _cut(path: Path, step: int) -> None:
    """`path` without its lines of steps after `step` (or cut by a crash), replaced atomically."""
    if not path.exists():
        return
    _rewrite(path, [row for row in read_rows(path) if row["step"] <= step])


def _rewrite(path: Path, rows: list[dict[str, Any]]) -> None:
    """`path` replaced atomically by `rows`."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    tmp.replace(path)


def read_samples(run_dir: Path) -> list[dict[str, Any]]:
    """The recorded groups still on disk, oldest first."""
    paths = [run_dir / ROLLED, run_dir / SAMPLES]
    return [row for path in paths if path.exists() for row in read_rows(path)]


class EvalPass:
    """One evaluation pass's attempts and scores, per (mode index, problem index), as the
    pass collects them (`pipelinerl.roles.heldout.evaluate` and `evaluate_episodes`)."""

    def __init__(self, decode: Any) -> None:
        self.decode = decode
        self._rows: dict[tuple[int, int], dict[str, Any]] = {}

    def attempts(self, m: int, i: int, problem: Problem, outs: list[Any],
                 failure: str | None = None) -> None:
        """A problem's finished attempts in mode `m` (engine outputs, transcripts or samples:
        anything with prompt_ids, token_ids and finish_reason); `failure`: why it is unscored."""
        self._rows[m, i] = {
            "problem_id": problem.problem_id, "problem": problem.prompt,
            "prompt": self.decode(outs[0].prompt_ids) if outs else "",
            "attempts": [{"completion": self.decode(o.token_ids), "reward": None,
                          "success": None, "finish_reason": o.finish_reason,
                          "length": len(o.token_ids),
                          **({"tool_calls": list(o.tool_calls)}
                             if getattr(o, "tool_calls", None) else {})} for o in outs],
            "failure": failure}

    def scores(self, m: int, i: int, scores: list[Score] | None, failure: str = "") -> None:
        """Their scores, in attempt order; None: verification failed (`failure`)."""
        row = self._rows[m, i]
        if scores is None:
            row["failure"] = failure or "verifier"
            return
        for attempt, score in zip(row["attempts"], scores):
            attempt["reward"], attempt["success"] = score.reward, score.success

    def rows(self, version: int, attempt: int, modes: list[str]) -> list[dict[str, Any]]:
        """The pass's lines, by mode then problem."""
        return [{"version": version, "attempt": attempt, "mode": modes[m], **row}
                for (m, _), row in sorted(self._rows.items())]


class EvalSampleRecord:
    """The evaluator's eval_samples.jsonl writer: one pass's lines per version, never a version
    twice. Rolls on to eval_samples.1.jsonl as SampleRecord does (`metrics.samples_max_mb`)."""

    def __init__(self, run_dir: Path, cfg: MetricsConfig, attempt: int) -> None:
        self.run_dir = run_dir
        self.path, self.rolled = run_dir / EVAL_SAMPLES, run_dir / EVAL_ROLLED
        self.roll_bytes = int(cfg.samples_max_mb * 2**20) // 2
        self.attempt = attempt
        self.recorded: set[int] = set()
        self._file: IO[str] | None = None

    def _open(self) -> None:
        """At the first write, not before: a resumed trainer records its resume in
        attempts.jsonl before it publishes the weights the evaluator waits for."""
        # A crashed attempt's versions past the step a later attempt resumed from were made by
        # lost weights: their lines go, and the new attempt's evaluation of the number is kept.
        valid = valid_upto(read_resumes(self.run_dir))
        for path in (self.rolled, self.path):
            if path.exists():
                rows = [r for r in read_rows(path)
                        if r["version"] <= valid.get(r["attempt"], r["version"])]
                self.recorded.update(r["version"] for r in rows)
                _rewrite(path, rows)  # also drops a line a crash cut short
        self._file = self.path.open("a")

    def write(self, version: int, rows: list[dict[str, Any]]) -> bool:
        """A pass's lines (`EvalPass.rows`), unless `version` is recorded already."""
        if self._file is None:
            self._open()
        assert self._file is not None
        if version in self.recorded:
            return False
        self._file.writelines(json.dumps(row) + "\n" for row in rows)
        self._file.flush()
        self.recorded.add(version)
        if self._file.tell() >= self.roll_bytes:
            self._file.close()
            self.path.replace(self.rolled)
            self._file = self.path.open("w")
        return True

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def open_eval_record(run_dir: Path, cfg: MetricsConfig, attempt: int
                     ) -> EvalSampleRecord | None:
    """The evaluator's record, None when `metrics.samples_per_step` is 0 (off)."""
    return EvalSampleRecord(run_dir, cfg, attempt) if cfg.samples_per_step else None


def read_eval_samples(run_dir: Path) -> list[dict[str, Any]]:
    """The evaluator's recorded lines still on disk, oldest first."""
    paths = [run_dir / EVAL_ROLLED, run_dir / EVAL_SAMPLES]
    return [row for path in paths if path.exists() for row in read_rows(path)]
