"""Rank 0's records of a training run: metrics.jsonl (a row per step, the recorded samples'
figures, the evaluator's results as the trainer logs them), trained.jsonl (the groups each
step trained and those dropped since the step before) and samples.jsonl
(`metrics.samples_per_step` groups of each step, `run.samples`), each opened cut back to a
resume's step so that no step repeats."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import IO, Any

from pipelinerl.config import Config
from pipelinerl.metrics.logger import MetricsLogger
from pipelinerl.records import open_resumed
from pipelinerl.rl.batches import BatchSource
from pipelinerl.rl.capture import Scored
from pipelinerl.run.samples import SampleRecord, open_record
from pipelinerl.types import Group


@dataclass
class TrainerRecords:
    metrics: MetricsLogger
    trained_log: IO[str]
    samples: SampleRecord | None = None  # `open_samples`, once the tokenizer is loaded

    @classmethod
    def open(cls, cfg: Config, resume_step: int | None) -> TrainerRecords:
        metrics = MetricsLogger(cfg.run_dir, cfg.metrics, cfg.name, cfg.model_dump(mode="json"),
                                resume_step=resume_step, attempt=cfg.attempt)
        return cls(metrics, open_resumed(cfg.run_dir / "trained.jsonl", resume_step, cfg.attempt))

    def open_samples(self, cfg: Config, tokenizer: Any, resume_step: int | None) -> None:
        self.samples = open_record(cfg.run_dir, cfg.metrics, tokenizer, resume_step)

    def groups_to_keep(self, n_groups: int) -> int:
        """How many of a step's groups (its first) samples.jsonl records."""
        return self.samples.groups_to_keep(n_groups) if self.samples is not None else 0

    def write_step(self, step: int, record: dict[str, Any], trained: list[str],
                   source: BatchSource) -> None:
        """The step's row in metrics.jsonl and in trained.jsonl."""
        self.metrics.log(step, record)
        self.write_trained(step, trained, source)

    def write_trained(self, step: int, trained: list[str], source: BatchSource) -> None:
        """trained.jsonl's row: the groups trained at `step`, those `source` dropped since the
        last (and a few of those in samples.jsonl)."""
        self.trained_log.write(json.dumps({"step": step, "trained": trained,
                                           "dropped": source.take_dropped_ids()}) + "\n")
        if self.samples is not None:
            self.samples.write_dropped(step, source.take_dropped_groups())

    def write_samples(self, step: int, groups: list[Group], scored: list[Scored]) -> None:
        """The step's recorded groups (trained on version step - 1) with what it computed."""
        if self.samples is not None:
            rows = self.samples.write(step, step - 1, groups, scored)
            self.metrics.log_samples(step, rows)

    def close(self) -> None:
        self.metrics.close()
        self.trained_log.close()
        if self.samples is not None:
            self.samples.close()
