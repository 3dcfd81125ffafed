"""Deferred held-out evaluation (`eval.deferred`): the evaluator keeps the weights it would
evaluate as safetensors files and evaluates them after the run, when the run's cores are free,
so evaluation as precise as wanted costs the run itself nothing (docs/evaluation.md).

A snapshot is named by the attempt that made it and the version: a resumed run remakes the
versions after its checkpoint with other weights, so an earlier attempt's snapshot of such a
version is not the run's and is dropped (`attempts.valid_upto`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipelinerl.run.attempts import read_resumes, valid_upto

SNAPSHOTS_DIR = "eval_snapshots"
_NAME = re.compile(r"a(\d+)-v(\d+)\.safetensors")


class Snapshots:
    def __init__(self, run_dir: Path, attempt: int) -> None:
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / SNAPSHOTS_DIR
        self.attempt = attempt

    def save(self, version: int, tensors: Mapping[str, torch.Tensor]) -> Path:
        """Write the weights of `version` (a file appears whole or not at all)."""
        self.dir.mkdir(exist_ok=True)
        path = self.dir / f"a{self.attempt}-v{version}.safetensors"
        tmp = path.with_suffix(".tmp")
        # One storage per tensor: tied weights are written twice, as loading expects them.
        save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(tmp))
        tmp.rename(path)
        return path

    def pending(self, evaluated: set[int]) -> list[tuple[int, Path]]:
        """(version, file) of the run's snapshots not yet `evaluated`, oldest first; files of
        versions an earlier attempt made past its valid history are deleted."""
        valid = valid_upto(read_resumes(self.run_dir))
        found: dict[int, tuple[int, Path]] = {}
        for path in sorted(self.dir.glob("a*-v*.safetensors")) if self.dir.exists() else ():
            m = _NAME.fullmatch(path.name)
            if m is None:
                continue
            attempt, version = int(m[1]), int(m[2])
            if attempt in valid and version > valid[attempt]:
                path.unlink()  # weights the run's history no longer has
                continue
            if version in evaluated:
                path.unlink()
                continue
            if version not in found or attempt > found[version][0]:
                found[version] = (attempt, path)
        return [(version, found[version][1]) for version in sorted(found)]

    @staticmethod
    def load(path: Path, device: str | torch.device) -> dict[str, torch.Tensor]:
        return load_file(str(path), device=str(device))
