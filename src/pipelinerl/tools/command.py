"""`pipelinerl tools CONFIG`: what the model will be offered (each tool's name, source and
schema, the call format, the rendered prompt of the task's first problem), and
`pipelinerl tools CONFIG --call NAME '{json}'`: one call made as a rollout makes it, so a user
sees their tools work before training."""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Any

from pipelinerl.config import Config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file with a tools section")
    parser.add_argument("overrides", nargs="*", help="dotted overrides")
    parser.add_argument("--call", nargs=2, metavar=("NAME", "JSON"), default=None,
                        help="call tool NAME with these JSON arguments and print its reply")


def main(cfg: Config, call: list[str] | None) -> int:
    from pipelinerl.models.hf import load_tokenizer
    from pipelinerl.tools.task import open_tools

    if not cfg.tools.enabled:
        print("pipelinerl tools: the config names no tools (tools.functions, tools.mcp)",
              file=sys.stderr)
        return 2
    if not cfg.model.path:
        print("pipelinerl tools: tools need model.path (a model with a chat template)",
              file=sys.stderr)
        return 2
    try:
        host, chat, parse, fmt = open_tools(cfg, load_tokenizer(cfg.model.path))
    except (ValueError, RuntimeError, TimeoutError) as e:
        print(f"pipelinerl tools: {e}", file=sys.stderr)
        return 2
    try:
        return _call(host, call) if call else _show(cfg, host, chat, fmt)
    finally:
        host.close()


def _show(cfg: Config, host: Any, chat: Any, fmt: str) -> int:
    from pipelinerl.tasks import make_task

    for spec in host.specs.values():
        print(f"{spec.name}  ({spec.source})\n  {spec.description}\n"
              f"  {json.dumps(spec.parameters, ensure_ascii=False)}")
    where = ("the chat template's own" if chat.native else "tools.prompt" if cfg.tools.prompt
             else "pipelinerl's Hermes-style prompt")
    print(f"\ncalls: {fmt} format; tools rendered by {where}; replies as "
          f"{'tool' if chat.native else chat.reply_role} messages; at most "
          f"{cfg.tools.max_calls} calls per rollout")
    problem = make_task(cfg.task.name, cfg.task.params).sample_problem(random.Random(0))
    print("\nthe prompt of a problem, as the model reads it:\n" + chat.prompt_text(problem.prompt))
    return 0


def _call(host: Any, call: list[str]) -> int:
    from pipelinerl.tools.specs import ToolCall, argument_errors

    name, raw = call
    if name not in host.specs:
        print(f"pipelinerl tools: no tool {name!r}; the tools are {', '.join(host.specs)}",
              file=sys.stderr)
        return 2
    try:
        arguments = json.loads(raw)
    except json.JSONDecodeError as e:
        print(f"pipelinerl tools: the arguments are not JSON: {e}", file=sys.stderr)
        return 2
    if problem := argument_errors(host.specs[name], arguments):
        print(f"pipelinerl tools: {problem}", file=sys.stderr)
        return 2
    result = host.run(host.call("cli", ToolCall(name, arguments)))
    print(f"{result.outcome} in {result.latency_s * 1000:.1f} ms\n{result.text}")
    host.end("cli")
    return 0 if result.outcome == "ok" else 1
