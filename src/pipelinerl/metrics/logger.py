"""Per-step metrics: always JSONL in the run directory; TensorBoard / W&B when asked."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO, Any

from pipelinerl.config import MetricsConfig


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: MetricsConfig, run_name: str, config: dict[str, Any]):
        self.path = run_dir / "metrics.jsonl"
        self._file = open_new_jsonl(self.path)
        self._tb = None
        self._wandb = None
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise RuntimeError(
                    "metrics.tensorboard=true needs the tensorboard package: pip install tensorboard"
                ) from exc
            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
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


def open_new_jsonl(path: Path) -> IO[str]:
    """Create `path` for one launch's records; never append to another launch's file."""
    try:
        return path.open("x", buffering=1)  # O_EXCL: two trainers cannot both get it
    except FileExistsError:
        raise FileExistsError(
            f"{path} already exists: another launch wrote it. Choose another `name=` or "
            "`output_dir=`, or remove the run directory (`pipelinerl train --overwrite` does)"
        ) from None


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf; keep the file parseable by any reader.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    return value


def scalars(record: dict[str, Any]) -> dict[str, Any]:
    """One level of nesting flattened to `key/sub` names (e.g. `lag_hist/2`, the tokens of lag
    2): the scalar names TensorBoard and W&B get, which group them under `key`."""
    flat: dict[str, Any] = {}
    for key, value in record.items():
        if isinstance(value, dict):
            flat.update({f"{key}/{sub}": v for sub, v in value.items()})
        else:
            flat[key] = value
    return flat


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]
