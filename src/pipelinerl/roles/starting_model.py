"""The model a run's RL starts from: the tiny model built and warm-started for the task when
model.path is empty, or a given model.path warm-started on the task's demonstrations
(`warmstart.given_model`: through its chat template, or with the config's tools on tool-using
episodes). Either is built once and cached (`pipelinerl.models.warmstart`)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelinerl.config import Config
from pipelinerl.tasks import make_train_task

if TYPE_CHECKING:
    from pipelinerl.models.warmstart import Demos, WarmStartConfig


def starting_model(cfg: Config) -> Path:
    """The warm-started model's directory (built and cached on first use)."""
    # transformers (~8 s to import here): only a run that warm-starts needs it.
    from pipelinerl.models.warmstart import resolve_cache_dir, warm_start

    base = cfg.model.path if cfg.warmstart.given_model else ""
    if not cfg.warmstart.enabled:
        raise SystemExit("model.path is empty and warmstart.enabled=false: give model.path=DIR "
                         "(a local Hugging Face model directory)" if not cfg.model.path else
                         "warmstart.given_model=true but warmstart.enabled=false")
    if cfg.warmstart.given_model and not cfg.model.path:
        raise SystemExit("warmstart.given_model=true needs model.path (the model to warm-start)")
    # Without the held-out part: the warm-start is training too.
    task = make_train_task(cfg.task.name, cfg.task.params, cfg.task.heldout_frac)
    needs = (("tool_demonstration",) if cfg.tools.enabled else ("demonstration",)) if base \
        else ("demonstration", "alphabet", "params")
    lacks = [a for a in needs if not hasattr(task, a)]
    if lacks:
        raise SystemExit(f"task {cfg.task.name!r} cannot be warm-started (it lacks "
                         f"{', '.join(lacks)}; docs/tasks.md, docs/tools.md): "
                         + ("set warmstart.given_model=false" if base else "give model.path=DIR"))
    cache_dir = resolve_cache_dir(cfg.warmstart.cache_dir)
    print(f"warm-start: starting policy from {cache_dir} (built there on first use)",
          file=sys.stderr)
    ws = _settings(cfg)
    if not base:
        return warm_start(task, ws, cache_dir=cache_dir, progress=cfg.metrics.progress)
    with _demos(cfg, task, base) as demos:
        return warm_start(task, ws, cache_dir=cache_dir, base_model_dir=base,
                          progress=cfg.metrics.progress, demos=demos)


def _settings(cfg: Config) -> WarmStartConfig:
    """The warm-start module's settings, the config's where given (0 or <0: its default)."""
    from pipelinerl.models.warmstart import WarmStartConfig

    w = cfg.warmstart
    ws = WarmStartConfig(preset=cfg.model.preset, seed=w.seed, bf16=w.bf16)
    given: dict[str, Any] = {"steps": w.steps, "batch_size": w.batch_size, "lr": w.lr}
    ws = replace(ws, **{k: v for k, v in given.items() if v})
    if w.warmup_steps >= 0:
        ws = replace(ws, warmup_steps=w.warmup_steps)
    if w.step_error_prob >= 0:
        ws = replace(ws, step_error_prob=w.step_error_prob)
    return ws


@contextmanager
def _demos(cfg: Config, task: Any, base: str) -> Iterator[Demos]:
    """A given model's demonstrations: its chat prompts, or tool-using episodes answered by the
    config's tools (started here, closed after)."""
    from pipelinerl.models.hf import load_tokenizer
    from pipelinerl.models.prompts import PromptEncoder
    from pipelinerl.models.warmstart import ChatDemos

    tokenizer = load_tokenizer(base)
    if not cfg.tools.enabled:
        yield ChatDemos(task, PromptEncoder(tokenizer, cfg.task.chat_template,
                                            cfg.task.system_prompt))
        return
    from pipelinerl.tools.record import ToolLog
    from pipelinerl.tools.replies import ToolReplies
    from pipelinerl.tools.task import open_tools
    from pipelinerl.tools.warmstart import ToolDemos

    try:
        host, chat, parse, fmt = open_tools(cfg, tokenizer)
    except (ValueError, RuntimeError, TimeoutError) as e:
        raise SystemExit(f"pipelinerl: {e}") from e
    replies = ToolReplies(host, chat, parse, cfg.tools, ToolLog(None, "warmstart", []))
    try:
        yield ToolDemos(task, tokenizer, chat, replies, fmt)
    finally:
        replies.close()


def resumed_model(cfg: Config, saved: Config) -> tuple[str, list[str]]:
    """The model a resumed run began from (the saved run's warm-started one), and what `cfg`
    changed of it: the given model that was warm-started, if the manifest names another."""
    if not cfg.warmstart.given_model:
        return saved.model.path, []
    manifest = Path(saved.model.path) / "warmstart.json"
    base = json.loads(manifest.read_text()).get("base_model_dir") if manifest.is_file() else None
    if base is None or Path(base).resolve() == Path(cfg.model.path).resolve():
        return saved.model.path, []
    change = f"model.path (warm-started): {base!r} then, {cfg.model.path!r} now"
    return saved.model.path, [change]
