"""Any task made tool-using by the config's `tools` section (docs/tools.md).

`equip` starts the role's tools (functions loaded, MCP servers started and listed), and gives
back the task as an environment whose turns end where the model ends its message (its stop
token), answered by `ToolReplies`, and a codec whose prompts carry the tools through the chat
template. The task's own `score` reads the whole transcript, the tool replies included.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from transformers import PreTrainedTokenizerBase

from pipelinerl.config import Config
from pipelinerl.models.hf import encode_prompt
from pipelinerl.models.prompts import Codec
from pipelinerl.tasks.base import Task
from pipelinerl.tasks.environment import is_environment
from pipelinerl.tools.chat import ToolChat
from pipelinerl.tools.formats import Parsed, parser_for
from pipelinerl.tools.host import ToolHost
from pipelinerl.tools.record import ToolLog
from pipelinerl.tools.replies import ToolReplies


def _unwrapped(task: Task) -> Task:
    return task


class ToolTask:
    """`task` with tools: an environment (`respond_on_stop`) whose replies come from
    `replies`. Pickled (to the verifier workers) it is the plain task again."""

    turn_stops: tuple[str, ...] = ()
    respond_on_stop = True

    def __init__(self, task: Task, replies: ToolReplies, max_turns: int) -> None:
        self._task = task
        self.replies = replies
        self.max_turns = max_turns

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_task":
            raise AttributeError(name)
        return getattr(self._task, name)

    def __reduce__(self) -> tuple[Any, tuple[Task]]:
        return _unwrapped, (self._task,)

    def respond(self, problem: Any, turns: Any) -> Any:
        raise RuntimeError("a tool task's turns are answered by its reply pool")

    def reply_pool(self, timeout_s: float, workers: int) -> ToolReplies:
        return self.replies


def refuse_unsupported(cfg: Config, task: Task) -> None:
    if getattr(task, "episodic", False) or is_environment(task):
        raise ValueError(f"tools with task {cfg.task.name!r}: it is an environment already "
                         "(its own turns and replies); tools turn a single-turn task into a "
                         "tool-using one")


def open_tools(cfg: Config, tokenizer: PreTrainedTokenizerBase
               ) -> tuple[ToolHost, ToolChat, Callable[[str], Parsed], str]:
    """The role's tools started (functions loaded, MCP servers started and listed), their
    chat rendering, the call parser and the format's name; a wrong part is refused with one
    line naming it (ValueError, RuntimeError)."""
    tools = cfg.tools
    host = ToolHost(tools, workers=cfg.actor.env_workers)
    try:
        chat = ToolChat(tokenizer, list(host.specs.values()), cfg.task.system_prompt,
                        tools.prompt)
        fmt, parse = parser_for(tools.format, tokenizer.chat_template)
    except BaseException:
        host.close()
        raise
    return host, chat, parse, fmt


def equip(cfg: Config, task: Task, codec: Codec, tokenizer: PreTrainedTokenizerBase,
          role: str, run_dir: Path | None = None) -> tuple[ToolTask, Codec]:
    """The role's tools started; the tool task and the codec that renders them. `role`:
    which of the run's records is this one's (`actor0`, `evaluator`). The tools stop when
    the rollouts close their reply pool (`ToolReplies.close`)."""
    refuse_unsupported(cfg, task)
    host, chat, parse, _ = open_tools(cfg, tokenizer)
    replay = [Path(cfg.tools.replay_from)] if cfg.tools.replay_from else []
    if cfg.deterministic.enabled and cfg.attempt > 0 and run_dir is not None:
        replay.append(run_dir)  # a resume takes what its crashed attempt recorded
    try:
        log = ToolLog(run_dir, role, replay)
    except BaseException:
        host.close()
        raise
    replies = ToolReplies(host, chat, parse, cfg.tools, log, cfg.deterministic.enabled)
    encode = lambda prompt: encode_prompt(tokenizer, chat.prompt_text(prompt))  # noqa: E731
    return ToolTask(task, replies, cfg.tools.max_calls + 1), replace(codec, encode=encode)
