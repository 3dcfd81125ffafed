"""Tool calls as the model's family writes them, parsed from the text of one model turn.

- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number per turn; the text around them is the model's.
- `llama3` (Llama 3.1/3.2 JSON tool calling): the whole turn is one JSON object
  `{"name": ..., "parameters": {...}}` (or several joined by `;`); a turn that does not start
  with `{` is an answer, not a call.
- a parser a user names by import path: `text -> list[ToolCall]`, raising ValueError for a call
  that is malformed.

A parser returns the calls it read and, for each malformed one, the reason: the model gets
the reason back (`tool_bad_call`), never an exception in the actor.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from pipelinerl.proc.plugins import import_object
from pipelinerl.tools.specs import ToolCall

HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class Parsed:
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one per malformed call

    @property
    def any(self) -> bool:
        return bool(self.calls or self.errors)


def _call_of(obj: Any, args_key: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError('a call is a JSON object with a string "name"')
    arguments = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError(f'"{args_key}" must be a JSON object')
    return ToolCall(obj["name"], arguments)


def parse_hermes(text: str) -> Parsed:
    parsed = Parsed()
    for match in HERMES_CALL.finditer(text):
        body = match.group(1).strip()
        if not match.group(0).endswith("</tool_call>"):
            parsed.errors.append("a <tool_call> without its closing </tool_call>")
            continue
        try:
            parsed.calls.append(_call_of(json.loads(body), "arguments"))
        except (ValueError, json.JSONDecodeError) as e:
            parsed.errors.append(f"the call {body[:80]!r} is not valid JSON: {e}")
    return parsed


def parse_llama3(text: str) -> Parsed:
    parsed = Parsed()
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return parsed
    for part in (p for p in body.split(";") if p.strip()) if "};" in body else [body]:
        try:
            parsed.calls.append(_call_of(json.loads(part), "parameters"))
        except (ValueError, json.JSONDecodeError) as e:
            parsed.errors.append(f"the call {part.strip()[:80]!r} is not valid JSON: {e}")
    return parsed


BUILTIN: dict[str, Callable[[str], Parsed]] = {"hermes": parse_hermes, "llama3": parse_llama3}


def user_parser(path: str) -> Callable[[str], Parsed]:
    fn = import_object(path, f"tools.format {path!r}")
    if not callable(fn):
        raise ValueError(f"tools.format {path!r} is not callable")

    def parse(text: str) -> Parsed:
        try:
            calls = fn(text)
        except ValueError as e:
            return Parsed(errors=[str(e)])
        if not all(isinstance(c, ToolCall) for c in calls):
            raise TypeError(f"tools.format {path!r} must return a list of ToolCall")
        return Parsed(calls=list(calls))
    return parse


def detect_format(chat_template: str | None) -> str:
    """`auto`: the family the chat template is written for; Hermes when it names none (the
    format of pipelinerl's own tool prompt)."""
    template = chat_template or ""
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes"


def parser_for(fmt: str, chat_template: str | None) -> tuple[str, Callable[[str], Parsed]]:
    """The format's name and parser for `tools.format`."""
    if fmt == "auto":
        fmt = detect_format(chat_template)
    if fmt in BUILTIN:
        return fmt, BUILTIN[fmt]
    if ":" in fmt:
        return fmt, user_parser(fmt)
    raise ValueError(f"tools.format {fmt!r}: expected auto, {', '.join(BUILTIN)} or "
                     "module:callable")
