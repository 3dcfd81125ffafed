"""Per-step metrics: always JSONL in the run directory; TensorBoard / W&B when asked."""

from __future__ import annotations

import html
import json
import math
import re
from itertools import chain, zip_longest
from pathlib import Path
from typing import Any

from pipelinerl.config import MetricsConfig
from pipelinerl.records import METRICS, open_resumed

# A glance at what the model writes each step, where TensorBoard / W&B are on; the whole
# record is samples.jsonl (pipelinerl.run.samples).
TABLE_ROWS = 8
# The tables' key: not "samples", the per-step count of samples trained in the same log.
SAMPLE_TABLE = "sample_table"
TABLE_CHARS = 300  # of a completion or problem: a table cell, not the text's home
TABLE_COLUMNS = ("group_id", "problem", "completion", "reward", "advantage", "finish_reason",
                 "length")


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: MetricsConfig, run_name: str, config: dict[str, Any],
                 resume_step: int | None = None, attempt: int = 0):
        """`resume_step`: a resumed run continues the file after that step (open_resumed)."""
        self.path = run_dir / METRICS
        self._file = open_resumed(self.path, resume_step, attempt)
        self._tb = None
        self._wandb = None
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise RuntimeError(
                    "metrics.tensorboard=true needs the tensorboard package: pip install tensorboard"
                ) from exc
            # A resumed run's events after its checkpoint are purged, as in metrics.jsonl.
            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)
        if cfg.wandb:
            try:
                import wandb
            except ImportError as exc:
                raise RuntimeError("metrics.wandb=true needs the wandb package: pip install wandb") from exc
            self._wandb = wandb.init(project=cfg.wandb_project, name=run_name, config=config,
                                     dir=str(run_dir))
            # Held-out results arrive after later steps: W&B ignores a step below its current
            # one, so they are plotted against their own version instead.
            self._wandb.define_metric("eval/*", step_metric="eval/version")

    def log(self, step: int, values: dict[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in values.items()}}
        self._file.write(json.dumps(record) + "\n")
        numeric = {k: v for k, v in scalars(record).items()
                   if isinstance(v, (int, float)) and k != "step"}
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            if "eval/version" in numeric:
                self._wandb.log(numeric)
            else:
                self._wandb.log(numeric, step=step)

    def log_samples(self, step: int, groups: list[dict[str, Any]]) -> None:
        """A few samples of the step's recorded groups (samples.jsonl's lines) as a table:
        markdown text in TensorBoard (its Text tab), a `wandb.Table` in W&B."""
        if self._tb is None and self._wandb is None:
            return
        rows = sample_table(groups)
        if self._tb is not None:
            self._tb.add_text(SAMPLE_TABLE, markdown_table(rows), step)
        if self._wandb is not None:
            import wandb

            table = wandb.Table(columns=list(TABLE_COLUMNS), data=rows)
            self._wandb.log({SAMPLE_TABLE: table}, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf; keep the file parseable by any reader.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    return value


def sample_table(groups: list[dict[str, Any]]) -> list[list[Any]]:
    """Up to TABLE_ROWS samples, taken from the groups in turn (each group's first, then each
    one's second, ...), one row of TABLE_COLUMNS each, texts cut to TABLE_CHARS."""
    turns = zip_longest(*[[(g, s) for s in g["samples"]] for g in groups])
    picked = [pair for pair in chain.from_iterable(turns) if pair is not None][:TABLE_ROWS]
    return [[g["group_id"], g["problem"][:TABLE_CHARS], s["completion"][:TABLE_CHARS],
             s["reward"], s["advantage"], s["finish_reason"], s["length"]] for g, s in picked]


def markdown_table(rows: list[list[Any]]) -> str:
    """`rows` under TABLE_COLUMNS as a markdown table (TensorBoard renders its text so)."""
    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        # Shown as written: `<eos>` is no tag, `*` or `|` no markup, a newline a line break.
        text = re.sub(r"([\\`*_\[\]|#])", r"\\\1", html.escape(text, quote=False))
        return text.replace("\n", "<br>")

    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def scalars(record: dict[str, Any]) -> dict[str, Any]:
    """Nesting flattened to `key/sub` names (e.g. `lag_hist/2`, the tokens of lag 2;
    `by_length/64-127/ess`): the scalar names TensorBoard and W&B get, which group them under
    `key`."""
    flat: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            flat.update({f"{key}/{sub}": v for sub, v in scalars(value).items()})
        else:
            flat[key] = value
    return flat

