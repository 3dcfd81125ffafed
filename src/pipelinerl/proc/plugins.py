"""User code named by an import path, `module:attribute` (a task class, a reward function):
imported with every failure turned into one ValueError that names what was wrong."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

# Environments of other libraries, named `<prefix><id>` as a task, and what builds one (an
# import path to a callable taking the id and the task's params): tasks/ finds them here
# without importing envs/, which builds on tasks/.
VERIFIERS = "verifiers:"
OPENENV = "openenv:"
TASK_PREFIXES = {VERIFIERS: "pipelinerl.envs.verifiers.task:VerifiersTask",
                 OPENENV: "pipelinerl.envs.openenv:OpenEnvTask"}


def working_directory_on_path() -> None:
    """Console scripts do not put the working directory on sys.path; `python -m` does. Both
    should find a user's module sitting beside their config."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())


def import_object(spec: str, what: str) -> Any:
    """The object `spec` ("module:attr", "module:Outer.inner") names; `what` ("task 'x'",
    "reward 'y'") starts every error message."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what}: an import path is 'module:attribute' (e.g. my_tasks:Reverse)")
    working_directory_on_path()
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name):
            raise ValueError(f"{what}: no module named {e.name!r} (looked in the working "
                             f"directory {os.getcwd()}, PYTHONPATH and installed packages)") from e
        raise ValueError(f"{what}: importing module {module_name!r} failed: {e}") from e
    except Exception as e:  # noqa: BLE001 - a user's module may raise anything at import
        raise ValueError(f"{what}: importing module {module_name!r} raised "
                         f"{type(e).__name__}: {e}") from e
    owner = module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what}: {owner} has no attribute {part!r}")
        obj, owner = getattr(obj, part), f"{owner}.{part}"
    return obj
