"""Per-step metrics: always JSONL in the run directory; TensorBoard / W&B when asked."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import IO, Any

from pipelinerl.config import MetricsConfig

METRICS = "metrics.jsonl"


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg: MetricsConfig, run_name: str, config: dict[str, Any],
                 resume_step: int | None = None, attempt: int = 0):
        """`resume_step`: a resumed run continues the file after that step (open_run_jsonl)."""
        self.path = run_dir / METRICS
        self._file = open_run_jsonl(self.path, resume_step, attempt)
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


def _open_synced(path: Path, mode: str) -> IO[str]:
    """`path`, line-buffered and opened with O_DSYNC: each row is on disk when its write
    returns. A checkpoint counts the rows written before it and is itself fsynced, so after a
    machine crash a resume must find them too (else steps it counts are missing from the file,
    and groups from trained.jsonl). One synchronous write per row, two per optimizer step
    (~0.3 ms each on a local disk): negligible next to a step, and unlike a sync before each
    checkpoint it needs nothing of the code that writes the rows and saves the checkpoints."""
    return open(path, mode, buffering=1,
                opener=lambda name, flags: os.open(name, flags | os.O_DSYNC, 0o666))


def open_new_jsonl(path: Path) -> IO[str]:
    """Create `path` for one launch's records; never append to another launch's file."""
    try:
        return _open_synced(path, "x")  # O_EXCL: two trainers cannot both get it
    except FileExistsError:
        raise FileExistsError(
            f"{path} already exists: another launch wrote it. Choose another `name=` or "
            "`output_dir=`, or remove the run directory (`pipelinerl train --overwrite` does)"
        ) from None


def open_run_jsonl(path: Path, resume_step: int | None, attempt: int) -> IO[str]:
    """A new file for a new run; for a resumed one, the file cut back to the rows of steps up to
    `resume_step` (the checkpoint's), then appended to. The rows a crashed attempt wrote after
    its checkpoint describe weights that are gone: they move to `<name>.discarded.jsonl`,
    marked with the attempt that discarded them, so the file has no repeated or skipped step."""
    if resume_step is None:
        return open_new_jsonl(path)
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    keep = [line for line in lines if line.strip() and json.loads(line)["step"] <= resume_step]
    gone = [line for line in lines if line.strip() and json.loads(line)["step"] > resume_step]
    if gone:  # on disk before the cut file replaces the one that holds them
        with _open_synced(path.with_name(path.stem + ".discarded.jsonl"), "a") as f:
            f.writelines(json.dumps({**json.loads(line), "discarded_by_attempt": attempt}) + "\n"
                         for line in gone)
    tmp = path.with_name(f".{path.name}.tmp")
    with _open_synced(tmp, "w") as f:  # on disk before the rename publishes it
        f.write("".join(keep))
    tmp.replace(path)  # atomic: a crash here leaves the old file or the cut one
    return _open_synced(path, "a")


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


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]
