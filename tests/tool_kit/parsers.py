"""A user's call parser (`tools.format: tool_kit.parsers:every_turn_calls_clock`): any turn of
a tiny random model is a call, so a run's rollouts make calls whatever the model writes."""

from __future__ import annotations

from pipelinerl.tools.specs import ToolCall


def every_turn_calls_clock(text: str) -> list[ToolCall]:
    return [ToolCall("clock", {})]
