"""Modules that moved into folders (docs/design/architecture.md): their old names still
import, as the new module itself, with a DeprecationWarning naming the new place. Old run
directories' pickles (actor snapshots) name the old paths and still load."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

MOVED = {
    "pipelinerl.actor": "pipelinerl.roles.actor",
    "pipelinerl.trainer": "pipelinerl.roles.trainer",
    "pipelinerl.evaluation": "pipelinerl.roles.heldout",
    "pipelinerl.launch": "pipelinerl.roles.launch",
    "pipelinerl.admission": "pipelinerl.rollouts.admission",
    "pipelinerl.scoring": "pipelinerl.rollouts.scoring",
    "pipelinerl.generation": "pipelinerl.rollouts.generation",
    "pipelinerl.endpoint": "pipelinerl.rollouts.endpoint",
    "pipelinerl.batches": "pipelinerl.rl.batches",
    "pipelinerl.parallel": "pipelinerl.rl.parallel",
    "pipelinerl.process_group": "pipelinerl.rl.process_group",
    "pipelinerl.attempts": "pipelinerl.run.attempts",
    "pipelinerl.group_ids": "pipelinerl.run.group_ids",
    "pipelinerl.checkpoint": "pipelinerl.run.checkpoint",
    "pipelinerl.samples": "pipelinerl.run.samples",
    "pipelinerl.eval_results": "pipelinerl.run.eval_results",
    "pipelinerl.eval_snapshots": "pipelinerl.run.eval_snapshots",
    "pipelinerl.audit": "pipelinerl.run.audit",
    "pipelinerl.replay": "pipelinerl.run.replay",
    "pipelinerl.workers": "pipelinerl.proc.workers",
    "pipelinerl.cpu_threads": "pipelinerl.proc.cpu_threads",
    "pipelinerl.stop_signals": "pipelinerl.proc.stop_signals",
    "pipelinerl.ports": "pipelinerl.proc.ports",
    "pipelinerl.cache": "pipelinerl.proc.cache",
    "pipelinerl.plugins": "pipelinerl.proc.plugins",
    "pipelinerl.warmstart": "pipelinerl.models.warmstart",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} has moved to {MOVED[spec.name]}; import it from there",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """The new module ran when it was imported."""


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
