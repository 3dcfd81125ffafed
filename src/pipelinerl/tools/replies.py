"""A tool-using rollout's turns answered: the calls parsed from the model's turn, run, and
their replies rendered by the chat template (the multi-turn protocol's reply pool,
`pipelinerl.envs.rollout`).

A turn with no call ends the rollout (the model answered). Every call gets a reply the model
reads, whatever went wrong, and each is counted by outcome: a call that does not parse, names
no tool or whose arguments fail the schema is `tool_bad_call` (its reason goes back); a call
past `tools.max_calls` in the rollout is `tool_over_limit` (not run); a tool that fails is
`tool_error`, `tool_timeout` or `tool_server_restart`, answered with its error text
(`tools.on_error=reply`) or ending the rollout so its group is dropped (`drop`, counted as
`skipped_<outcome>`).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any, Callable

from pipelinerl.config import ToolsConfig
from pipelinerl.envs.pool import FutureReplies
from pipelinerl.tasks.base import Problem
from pipelinerl.tasks.environment import Reply, Turn
from pipelinerl.tools.chat import Answered, ToolChat
from pipelinerl.tools.formats import Parsed
from pipelinerl.tools.host import CallResult, ToolHost
from pipelinerl.tools.record import ToolLog, call_key
from pipelinerl.tools.specs import ToolCall, argument_errors

FAILURES = ("tool_error", "tool_timeout", "tool_server_restart")


class ToolStats:
    """What the host measured of the calls (wall-clock and process events; the calls by
    outcome and tool are counted on the decode clock, `envs.rollout.EnvStats`)."""

    def __init__(self) -> None:
        self.calls = 0
        self.latency_s = 0.0

    def add(self, record: dict[str, Any]) -> None:
        self.calls += 1
        self.latency_s += record["latency_s"]

    def snapshot(self, restarts: int, log: ToolLog) -> dict[str, float]:
        return {
            "tool_latency_mean_s": self.latency_s / max(self.calls, 1),
            "tool_server_restarts": restarts,
            "tool_replayed": log.replayed,
            "tool_replay_misses": log.misses,
        }


class ToolReplies(FutureReplies):
    def __init__(self, host: ToolHost, chat: ToolChat, parse: Callable[[str], Parsed],
                 cfg: ToolsConfig, log: ToolLog, deterministic: bool = False) -> None:
        """`deterministic`: a sample's calls carry no latency (so runs replay bit for bit)."""
        super().__init__()
        self.host, self.chat, self.parse, self.cfg, self.log = host, chat, parse, cfg, log
        self.deterministic = deterministic
        self.stats = ToolStats()
        self._calls: defaultdict[str, int] = defaultdict(int)  # per rollout

    # -- the reply pool's interface (pipelinerl.envs.pool.EnvPool's) -------------------------
    def submit(self, key: str, problem: Problem, turns: list[Turn],
               ended_on: str | None = None) -> None:
        turn = sum(t.role == "model" for t in turns) - 1
        self._track(key, self.host.submit(self._respond(key, turn, turns[-1].text, ended_on)))

    def end(self, key: str) -> None:
        self._calls.pop(key, None)
        self.host.end(key)

    def snapshot(self) -> dict[str, float]:
        return self.stats.snapshot(self.host.restarts(), self.log)

    def close(self) -> None:
        self.host.close()
        self.log.close()

    def answer(self, key: str, turn: int, text: str, ended_on: str | None) -> Reply | None:
        """One turn answered now, as `submit` would (for demonstrations written outside a
        rollout: `pipelinerl.tools.warmstart`); None when `on_error=drop` drops it."""
        return self.host.run(self._respond(key, turn, text, ended_on))[0]

    # -- on the host's loop ------------------------------------------------------------------
    async def _respond(self, key: str, turn: int, text: str, ended_on: str | None
                       ) -> tuple[Reply | None, str]:
        parsed = self.parse(text)
        if not parsed.any:
            return Reply(done=True), ""
        planned: list[tuple[ToolCall | None, str]] = [(None, f"error: {e}")
                                                      for e in parsed.errors]
        planned += [(call, self._refusal(key, call)) for call in parsed.calls]
        records = await asyncio.gather(*(self._answer(key, turn, i, call, refusal)
                                         for i, (call, refusal) in enumerate(planned)))
        failed = [r["outcome"] for r in records if r["outcome"] in FAILURES]
        if failed and self.cfg.on_error == "drop":
            return None, failed[0]
        answers = [Answered(r["name"], r["reply"]) for r in records]
        return Reply(self.chat.reply_text(answers, ended_on), calls=tuple(records)), ""

    def _refusal(self, key: str, call: ToolCall) -> str:
        """Why a parsed call is not run ("" when it is)."""
        spec = self.host.specs.get(call.name)
        if spec is None:
            return (f"error: unknown tool {call.name!r}; the tools are "
                    f"{', '.join(sorted(self.host.specs))}")
        if self._calls[key] >= self.cfg.max_calls:
            return f"error: no more calls: at most {self.cfg.max_calls} per episode"
        self._calls[key] += 1
        if problem := argument_errors(spec, call.arguments):
            return f"error: bad arguments for {call.name}: {problem}"
        return ""

    async def _answer(self, key: str, turn: int, index: int, call: ToolCall | None,
                      refusal: str) -> dict[str, Any]:
        name = call.name if call else ""
        arguments = call.arguments if call else {}
        record: dict[str, Any] = {"key": call_key(key, turn, index), "turn": turn,
                                  "name": name, "arguments": arguments}
        if refusal:
            over = refusal.startswith("error: no more calls")
            record.update(reply=refusal, latency_s=0.0,
                          outcome="tool_over_limit" if over else "tool_bad_call")
            return record
        assert call is not None
        recorded = self.log.recorded_reply(record["key"], name, arguments)
        if recorded is not None:  # the recorded call's own latency, so the sample is the same
            result = CallResult(recorded["reply"], recorded["outcome"], recorded["latency_s"])
        else:
            result = await self.host.call(key, call)
        record.update(reply=_cut(result.text, self.cfg.max_reply_chars), outcome=result.outcome,
                      latency_s=round(result.latency_s, 6))
        self.log.append({**record, "replayed": recorded is not None})
        self.stats.add(record)
        if self.deterministic:  # a wall-clock figure: in the log and the metrics only
            del record["latency_s"]
        return record


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"... ({len(text) - limit} more characters cut)"
