"""Tool specs and tool replies through the model's own chat template.

The prompt carries the specs as the template puts them (`apply_chat_template(tools=...)`) when
the template renders tools; otherwise in a Hermes-style system prompt (`HERMES_PROMPT`, the
format Qwen2.5 and Hermes models were trained on). A turn's replies are rendered as `tool`
messages by the same template, and the text appended after the model's sampled tokens is the
template's text between the end of an assistant message and the start of the next one: so the
ids a rollout holds are the ids the engine sampled followed by exactly what serving would feed
(a chat server renders the same conversation the same way), and no sampled token is ever
re-tokenized.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from pipelinerl.tools.specs import ToolSpec

HERMES_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>"""

# Placeholders of the conversation the reply text is cut from.
_USER, _ASSISTANT, _REPLY = "PIPELINERL-USER-7f3a", "PIPELINERL-ASSISTANT-7f3a", "PIPELINERL-REPLY-7f3a"


@dataclass(frozen=True)
class Answered:
    """One call's reply as the model reads it."""

    name: str
    text: str


class ToolChat:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, specs: list[ToolSpec],
                 system_prompt: str = "", tool_prompt: str = "") -> None:
        """`tool_prompt`: the prompt offering the tools when the template has none ("{tools}"
        for the specs; empty: `HERMES_PROMPT`)."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("tools need a chat template: the tokenizer has none (a base model "
                             "does not know where a tool call or reply goes)")
        self.tokenizer = tokenizer
        self.specs = specs
        self.system_prompt = system_prompt
        self.tool_prompt = tool_prompt or HERMES_PROMPT
        self._tools = [s.openai() for s in specs]
        plain = [{"role": "user", "content": _USER}]
        self.native = self._render(plain, tools=self._tools) != self._render(plain)
        self.reply_role = self._reply_role()
        self._check_prefix_stable()

    def _render(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False)

    def system_text(self) -> str:
        """The system message (the user's, then the tool prompt when the template has none)."""
        if self.native:
            return self.system_prompt
        tools = "\n".join(json.dumps(t, ensure_ascii=False) for t in self._tools)
        prompt = self.tool_prompt.replace("{tools}", tools)
        return f"{self.system_prompt}\n\n{prompt}" if self.system_prompt else prompt

    def prompt_text(self, prompt: str) -> str:
        """What the model reads at a rollout's start: the task's prompt as the user's message,
        with the tools."""
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        if system := self.system_text():
            messages.insert(0, {"role": "system", "content": system})
        return self._render(messages, tools=self._tools if self.native else None,
                            generation_prompt=True)

    def _reply_role(self) -> str:
        """`tool` when the template renders tool messages (keeping their text), else `user`."""
        try:
            text = self._render([{"role": "user", "content": _USER},
                                 {"role": "assistant", "content": _ASSISTANT},
                                 {"role": "tool", "name": "t", "content": _REPLY}])
        except Exception:  # noqa: BLE001 - templates raise for a role they do not know
            return "user"
        return "tool" if _REPLY in text else "user"

    def _messages(self, answers: list[Answered]) -> list[dict[str, Any]]:
        if self.native:
            return [{"role": "tool", "name": a.name, "content": a.text} for a in answers]
        body = "\n".join(f"<tool_response>\n{a.text}\n</tool_response>" for a in answers)
        return [{"role": self.reply_role, "content": body}]

    def reply_text(self, answers: list[Answered], ended_on: str | None) -> str:
        """The text that follows the model's turn: the template's end of the assistant message
        (without `ended_on`, the text of the stop token the model sampled, which the rollout
        holds already), the replies, and the next assistant message's header."""
        tools = self._tools if self.native else None
        base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        before = self._render(base, tools=tools)
        after = self._render(base + self._messages(answers), tools=tools, generation_prompt=True)
        tail = before[before.rindex(_ASSISTANT) + len(_ASSISTANT):]
        if ended_on and tail.startswith(ended_on):
            tail = tail[len(ended_on):]
        return tail + after[len(before):]

    def _check_prefix_stable(self) -> None:
        """The reply is cut from the rendering of a longer conversation: refuse a template that
        renders a conversation's start differently once it goes on."""
        tools = self._tools if self.native else None
        base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        before = self._render(base, tools=tools)
        after = self._render(base + self._messages([Answered("t", "r")]), tools=tools,
                             generation_prompt=True)
        if not after.startswith(before) or _ASSISTANT not in before:
            raise ValueError("the chat template renders a conversation's start differently once "
                             "tool replies follow (it is not prefix-stable), so the tokens the "
                             "model sampled could not be kept as they are: use a template that "
                             "is, or set tools.format to a parser of your own with a template "
                             "that keeps earlier turns")
