"""Per-step metrics: always JSONL in the run directory; TensorBoard / W&B when asked."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pipelinerl.config import MetricsConfig
from pipelinerl.records import open_resumed

METRICS = "metrics.jsonl"


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

