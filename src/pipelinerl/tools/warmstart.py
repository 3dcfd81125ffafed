"""Tool-call demonstrations for the supervised warm start (`warmstart.given_model=true` with a
`tools` section): a model that has never written calls in this format learns it before RL.

The task writes the model's turns (`tool_demonstration(problem, rng, error_prob) -> [turn,
...]`, noisy as `demonstration` is: a skipped call, a wrong answer); the calls in each turn
are parsed and run on the real tools, and their replies rendered by the chat template, exactly
as a rollout does (`ToolReplies.answer`). So an example's ids are a rollout's ids: the prompt
with the tools, each model turn and its stop token (trained), each reply with the next turn's
header (not trained).
"""

from __future__ import annotations

import random
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from pipelinerl.models.hf import encode_prompt
from pipelinerl.models.warmstart import Example
from pipelinerl.tasks.base import Problem
from pipelinerl.tools.chat import ToolChat
from pipelinerl.tools.replies import ToolReplies


class ToolDemonstrationTask(Protocol):
    name: str

    def sample_problem(self, rng: random.Random) -> Problem: ...

    def tool_demonstration(self, problem: Problem, rng: random.Random,
                           error_prob: float) -> list[str]:
        """The model's turns of one episode, each without its stop token: calls in the
        config's format, the last turn the answer."""
        ...


class ToolDemos:
    """`models.warmstart.Demos` from a task's tool-using episodes, replies from the tools."""

    def __init__(self, task: ToolDemonstrationTask, tokenizer: PreTrainedTokenizerBase,
                 chat: ToolChat, replies: ToolReplies, fmt: str) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("tool demonstrations need the tokenizer's EOS token to end a turn")
        self.task, self.tokenizer, self.chat, self.replies, self.fmt = (
            task, tokenizer, chat, replies, fmt)
        self.stop = [tokenizer.eos_token_id]
        self.stop_text = tokenizer.decode(self.stop)
        self._episodes = 0

    def key(self) -> dict[str, Any]:
        return {"tools": [s.openai() for s in self.chat.specs], "system": self.chat.system_text(),
                "format": self.fmt, "max_calls": self.replies.cfg.max_calls}

    def encode(self, rng: random.Random, step_error_prob: float) -> Example:
        problem = self.task.sample_problem(rng)
        turns = self.task.tool_demonstration(problem, rng, step_error_prob)
        if not turns:
            raise ValueError(f"task {self.task.name!r}: tool_demonstration gave no turns")
        ids = encode_prompt(self.tokenizer, self.chat.prompt_text(problem.prompt))
        labels = [-100] * len(ids)
        key = f"warmstart-{self._episodes}"
        self._episodes += 1
        try:
            for turn, text in enumerate(turns):
                written = self._plain(text) + self.stop
                ids += written
                labels += written
                if turn == len(turns) - 1:
                    break
                reply = self.replies.answer(key, turn, text, self.stop_text)
                if reply is None or reply.done:
                    what = "failed" if reply is None else "calls no tool"
                    raise ValueError(f"task {self.task.name!r}: turn {turn} of a tool "
                                     f"demonstration {what} but more turns follow: {text!r}")
                heard = self._plain(reply.text)
                ids += heard
                labels += [-100] * len(heard)
        finally:
            self.replies.end(key)
        return ids, labels

    def _plain(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
