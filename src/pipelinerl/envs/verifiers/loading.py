"""Load a verifiers (0.4.0, `verifiers.v1`) environment to run on the actor's engine, and
refuse at start what cannot run here.

`task.name: verifiers:<taskset id>` names the environment as verifiers does: the id of an
installed (or importable: the working directory is searched) module whose `__all__` exports one
`Taskset` subclass, and optionally an `Env` and its config. `task.params` are the taskset's
config fields, but for pipelinerl's own keys (`task.RESERVED`): `env` (the env's config: `id`
of a built-in env such as `best-of-n`, a role's overrides), `eval_taskset` (the taskset's
params for its evaluation split), `success_threshold`, `episode_timeout_s`, `max_tasks`.

Each role of the env (its `AgentConfig` fields) runs pipelinerl's in-process chat harness
(`harness.py`) in a `subprocess` runtime (a work directory, no container), unless the user
pinned others, and gets the episode deadline as its rollout timeout; the env's own `run` gets
it too. What needs a network, a
container, a sandbox, tool servers, an LLM judge, another model or code run on the host is
refused with every reason found (`refusals`). The check is best effort: an env's own Python
(`Env.run`, `Taskset.load`) can still reach the network; run the actor without egress where
that matters.
"""

from __future__ import annotations

import inspect
import itertools
import os
import sys
from typing import Any, Callable, Iterable

from pydantic import ValidationError

from pipelinerl.proc.plugins import VERIFIERS as PREFIX
from pipelinerl.proc.plugins import working_directory_on_path

HARNESS_ID = "pipelinerl-chat"  # imported by verifiers as the top-level module below
_HARNESS_MODULE = "pipelinerl_chat"
TASK_SAMPLE = 64  # tasks whose data is checked for containers and network policies


class EnvRefused(ValueError):
    """The environment cannot run here, with the reasons."""


def import_verifiers() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ValueError("verifiers environments need the optional extra: "
                         "pip install 'pipelinerl[verifiers]' (verifiers 0.4.0)") from e
    from pipelinerl.envs.verifiers import harness

    sys.modules.setdefault(_HARNESS_MODULE, harness)
    return vf


def env_config(taskset_id: str, taskset_params: dict[str, Any], env_params: dict[str, Any],
               rollout_timeout_s: float) -> dict[str, Any]:
    """The raw env config: every role not pinned by the user on our harness, a local
    runtime and the deadline (each agent's rollout, the env's own `run`)."""
    vf = import_verifiers()
    working_directory_on_path()
    raw = {**env_params, "taskset": {**taskset_params, "id": taskset_id}}
    raw["timeout"] = {"episode": rollout_timeout_s, **(raw.get("timeout") or {})}
    try:
        cls = vf.env_config_type(taskset_id, raw.get("id", ""))
    except ModuleNotFoundError as e:
        raise ValueError(f"verifiers environment {taskset_id!r}: {e} (pipelinerl also looked in "
                         f"the working directory, {os.getcwd()})") from e
    except (ImportError, AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"verifiers environment {taskset_id!r}: {e}") from e
    for name, field in cls.model_fields.items():
        if not isinstance(field.default, vf.AgentConfig):
            continue
        role = dict(raw.get(name) or {})
        declared = field.default.harness.id if field.default.harness else None
        if "harness" not in role and declared in (None, "null"):
            role["harness"] = {"id": HARNESS_ID}  # `null` is the same program: one model call
        role.setdefault("runtime", {"type": "subprocess"})
        role.setdefault("timeout", {"rollout": rollout_timeout_s})
        role.setdefault("network_notice", False)
        raw[name] = role
    return raw


def load_env(taskset_id: str, taskset_params: dict[str, Any], env_params: dict[str, Any],
             rollout_timeout_s: float) -> Any:
    """The env, built and checked; ValueError naming what was wrong."""
    vf = import_verifiers()
    raw = env_config(taskset_id, taskset_params, env_params, rollout_timeout_s)
    env = _built(taskset_id, lambda: vf.load_environment(vf.resolve_env_config(raw)))
    reasons = refusals(env)
    if reasons:
        raise EnvRefused(f"verifiers environment {taskset_id!r} cannot run here: "
                         + "; ".join(reasons))
    return env


def load_taskset(taskset_id: str, taskset_params: dict[str, Any], env_params: dict[str, Any],
                 rollout_timeout_s: float) -> Any:
    """The env's taskset under other params (its evaluation split), built; its tasks' data
    is the caller's to check (`data_refusals`)."""
    vf = import_verifiers()
    from verifiers.v1.utils.loaders import load_taskset as build

    raw = env_config(taskset_id, taskset_params, env_params, rollout_timeout_s)
    return _built(taskset_id, lambda: build(vf.resolve_env_config(raw).taskset))


def _built(taskset_id: str, build: Callable[[], Any]) -> Any:
    """What `build` builds of the env; ValueError naming what was wrong."""
    try:
        return build()
    except ValidationError as e:
        where = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ValueError(f"verifiers environment {taskset_id!r}: bad config: {where}") from e
    except Exception as e:  # noqa: BLE001 - a user's env may raise anything as it builds
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"verifiers environment {taskset_id!r}: {type(e).__name__}: {first}"
                         ) from e


def refusals(env: Any) -> list[str]:
    """Why `env` cannot run in the actor: an empty list if it can."""
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import agent_config_fields

    out = []
    for name, spec in agent_config_fields(env.config).items():
        harness = env._harnesses[name].config.id
        if harness != HARNESS_ID:
            out.append(f"role {name!r} runs harness {harness!r}, a program that needs uv and a "
                       f"network or a container (pipelinerl runs {HARNESS_ID!r})")
        if spec.runtime.type != "subprocess":
            out.append(f"role {name!r} wants runtime {spec.runtime.type!r} (a container or a "
                       "remote sandbox)")
        if spec.client is not None:
            out.append(f"role {name!r} calls its own model endpoint")
        if spec.model is not None:
            out.append(f"role {name!r} names another model, {spec.model!r}")
    if env._requires_tunnel({}):
        out.append("its interception server needs a tunnel")
    taskset = env.taskset
    task_cls = type(taskset).task_type()
    if task_cls.NEEDS_CONTAINER:
        out.append(f"{task_cls.__name__} needs a container")
    if task_cls.toolsets(taskset.config.task) or type(taskset).toolsets(taskset.config):
        out.append("it declares tool servers (MCP toolsets), which pipelinerl's harness "
                   "does not call")
    if taskset.config.task.judges:
        out.append("it scores with LLM judges (an external endpoint)")
    for hook in ("setup", "finalize", "stage_verifier", "validate"):
        if getattr(task_cls, hook) is not getattr(vf.Task, hook):
            out.append(f"{task_cls.__name__}.{hook} runs commands in a runtime")
    tasks = list(itertools.islice(taskset, TASK_SAMPLE))
    for kind in ("reward", "metric", "stop"):
        for fn in tasks[0].hooks(kind) if tasks else ():
            needs = inspect.signature(fn).parameters.get("runtime")
            if needs is not None and needs.default is inspect.Parameter.empty:
                out.append(f"{kind} {fn.__name__!r} runs commands in a runtime")
    return out + data_refusals(tasks)


def data_refusals(tasks: Iterable[Any]) -> list[str]:
    """Why the data of `tasks` cannot run here (the first task found that cannot)."""
    for task in tasks:
        d = task.data
        if (d.image or d.network_allow != ["*"] or d.network_block or d.skills or d.artifacts
                or d.resources.gpu or d.agent_user):
            return [f"task {d.idx} asks for an image, a network policy, skills, artifacts, "
                    "a GPU or a user"]
    return []
