"""Multi-turn rollouts: the actor's bookkeeping between the engine and an environment.

A rollout is one held engine request. Each turn the engine returns ends in one of three ways:
on a turn stop (the tokens of one of the environment's `turn_stops`), the environment's reply
is asked for in the worker pool while the sequence waits parked in the engine; on the model's
stop token or at the token budget, the rollout is over. A reply is tokenised and appended
(`Engine.extend`), its tokens marked as the environment's (no log-prob, version ENV_VERSION,
never trained); `done`, a failed call, `max_turns` or a reply that leaves no budget end it.
`engine.max_new_tokens` bounds the whole transcript after the prompt, model and environment
tokens together, so a rollout fits the engine whatever its turns. The last turn allowed
(`max_turns`) is answered too: a `done` reply ends the rollout as finished, any other as
truncated ("length", its text not appended).

In deterministic mode (`reply_delay`, docs/determinism.md) a reply is applied at a point of the
decode clock rather than when its worker returns it: `reply_delay` decode steps after its turn
ended, in the order the turns ended (all at once when nothing is left to decode), waiting for
the worker if it is not back yet. The batch then changes at the same steps on every run.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable

from pipelinerl.engine.base import Engine
from pipelinerl.envs.pool import EnvPool, EnvResult
from pipelinerl.rollouts.due import DueQueue
from pipelinerl.tasks.base import Problem
from pipelinerl.tasks.environment import Environment, Reply, Turn
from pipelinerl.types import (
    ENV_VERSION,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
)


@dataclass
class Transcript:
    """A finished (or running) rollout: what the actor scores and publishes."""

    request_id: str
    problem: Problem
    prompt_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    model_mask: list[bool] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    turn_reward: float = 0.0  # the replies' rewards, summed
    tool_calls: list[dict] = field(default_factory=list)  # the replies' calls (pipelinerl.tools)
    # "stop" (the model stopped, or the environment said done), "length" (budget or
    # max_turns), or the failure of an environment call (env_timeout / env_error / env_crash).
    finish_reason: str = ""
    ends_with_stop_token: bool = False

    @property
    def model_turns(self) -> int:
        return sum(t.role == "model" for t in self.turns)

    def completion_ids(self) -> list[int]:
        """The tokens the verifier reads: without the model's final stop token."""
        return self.token_ids[:-1] if self.ends_with_stop_token else self.token_ids


@dataclass
class EnvStats:
    calls: int = 0
    latency_s: float = 0.0
    failures: Counter = field(default_factory=Counter)
    wait_slot_s: float = 0.0  # engine slot-seconds spent waiting for the environment

    # Tool calls (pipelinerl.tools) by outcome and by tool, counted as their replies are
    # applied (on the decode clock, so a deterministic run counts the same).
    tool_outcomes: Counter = field(default_factory=Counter)
    tool_names: Counter = field(default_factory=Counter)

    def count_calls(self, calls: tuple[dict, ...]) -> None:
        self.tool_outcomes.update(c["outcome"] for c in calls)
        self.tool_names.update(c["name"] or "?" for c in calls)

    def counts(self) -> dict[str, object]:
        """The counters of the logical clocks (a deterministic snapshot's; the rest are
        wall-clock)."""
        return {"calls": self.calls, "failures": Counter(self.failures),
                "tool_outcomes": Counter(self.tool_outcomes),
                "tool_names": Counter(self.tool_names)}

    def restore_counts(self, counts: dict[str, object]) -> None:
        self.calls, self.failures = counts["calls"], Counter(counts["failures"])
        self.tool_outcomes = Counter(counts.get("tool_outcomes", {}))
        self.tool_names = Counter(counts.get("tool_names", {}))

    def tool_snapshot(self) -> dict[str, float]:
        calls = sum(self.tool_outcomes.values())
        if not calls:
            return {}
        return {
            "tool_calls": calls,
            "tool_well_formed_frac": 1 - self.tool_outcomes["tool_bad_call"] / calls,
            **{f"tool_{o.removeprefix('tool_')}s": n for o, n in self.tool_outcomes.items()},
            **{f"tool_calls_{name}": n for name, n in self.tool_names.items()},
        }

    def snapshot(self, elapsed_s: float, capacity: int) -> dict[str, float]:
        return {
            "env_calls": self.calls,
            "env_latency_mean_s": self.latency_s / max(self.calls, 1),
            "env_wait_frac": self.wait_slot_s / max(elapsed_s * capacity, 1e-9),
            **{f"env_{reason.removeprefix('env_')}s": n for reason, n in self.failures.items()},
            **self.tool_snapshot(),
        }


class Rollouts:
    """The multi-turn rollouts of one actor; see the module docstring."""

    def __init__(
        self,
        env: Environment,
        engine: Engine,
        encode_text: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        sampling: SamplingParams,
        timeout_s: float,
        workers: int,
        reply_delay: int | None = None,
        decode_special: Callable[[int], str] = lambda token: "",
    ) -> None:
        """`encode_text`: plain tokenisation (no special tokens, no template); `sampling`:
        the actor's, the default of `request`. A request's max_new_tokens is the budget of its
        whole transcript. `reply_delay`: deterministic mode's, in decode steps (None: replies
        are applied as they come back). `decode_special`: a stop token's text (for an
        environment that answers turns ending on one, `respond_on_stop`)."""
        self.env = env
        self.engine = engine
        self.encode_text = encode_text
        self.decode = decode
        self.stop_token_ids = set(sampling.stop_token_ids)
        self.turn_stops = tuple(tuple(encode_text(s)) for s in env.turn_stops)
        if not all(self.turn_stops):
            raise ValueError(f"environment {env.name!r}: a turn stop of {env.turn_stops} "
                             "tokenises to no token")
        self.sampling = sampling
        # An environment may bring its own pool (tools: sessions per rollout on an event loop).
        make_pool = getattr(env, "reply_pool", None)
        self.pool = make_pool(timeout_s, workers) if make_pool else EnvPool(env, timeout_s,
                                                                             workers)
        self.respond_on_stop = bool(getattr(env, "respond_on_stop", False))
        self.stop_text = {i: decode_special(i) for i in self.stop_token_ids}
        self.stats = EnvStats()
        self._running: dict[str, Transcript] = {}
        self._asked: set[str] = set()  # rollouts whose reply is not applied yet
        self._due = None if reply_delay is None else DueQueue(reply_delay)
        self._back: dict[str, EnvResult] = {}  # deterministic: replies back before they are due
        self._last_tick = time.monotonic()

    def request(self, request_id: str, problem: Problem, prompt_ids: list[int],
                params: SamplingParams | None = None) -> GenerationRequest:
        """The engine request that starts a rollout; `params` (default: the actor's) keep
        their temperature and truncation in every turn."""
        params = replace(params or self.sampling, stop_sequences=self.turn_stops)
        self._running[request_id] = Transcript(request_id, problem, list(prompt_ids), params)
        return GenerationRequest(request_id, list(prompt_ids), params, hold=True)

    def running(self) -> int:
        return len(self._running)

    def waiting(self) -> int:
        """Rollouts whose sequence waits for the environment."""
        return len(self._asked)

    def on_turn(self, out: GenerationOutput, decode_steps: int = 0) -> Transcript | None:
        """Record a finished turn (after `decode_steps` steps of the decode clock); the
        transcript if the rollout is over (its engine request released), else None (the
        environment was asked)."""
        t = self._running[out.request_id]
        t.token_ids += out.token_ids
        t.logprobs += out.logprobs
        t.versions += out.versions
        t.model_mask += [True] * len(out.token_ids)
        t.turns.append(Turn("model", self.decode(out.token_ids)))
        if out.finish_reason == "length":
            return self._end(t, "length")
        ended_on = None
        if not any(tuple(out.token_ids[-len(s):]) == s for s in self.turn_stops):
            t.ends_with_stop_token = out.token_ids[-1] in self.stop_token_ids
            if not (self.respond_on_stop and t.ends_with_stop_token):
                return self._end(t, "stop")
            ended_on = self.stop_text[out.token_ids[-1]]
        self.stats.calls += 1
        self._asked.add(t.request_id)
        if self._due is not None:
            self._due.expect(t.request_id, decode_steps)
        self.pool.submit(t.request_id, t.problem, list(t.turns), ended_on)
        return None

    def poll(self, decode_steps: int = 0, idle: bool = False) -> list[Transcript]:
        """Apply the environment's replies that came back (deterministic mode: those due at
        `decode_steps`, every one asked when `idle`, waiting for them): the rollouts they
        ended."""
        now = time.monotonic()
        self.stats.wait_slot_s += (now - self._last_tick) * len(self._asked)
        self._last_tick = now
        if self._due is None:
            return [t for result in self.pool.poll() if (t := self._apply(result)) is not None]
        ended = []
        while (key := self._due.pop_due(decode_steps, idle)) is not None:
            while key not in self._back:
                self._back.update((r.key, r) for r in self.pool.poll())
                if key not in self._back:
                    self.pool.wait(0.005)
            if (t := self._apply(self._back.pop(key))) is not None:
                ended.append(t)
        return ended

    def _apply(self, result: EnvResult) -> Transcript | None:
        """Apply one reply; the transcript if it ended the rollout."""
        t = self._running[result.key]
        self._asked.discard(result.key)
        self.stats.latency_s += result.latency_s
        if result.reply is None:
            self.stats.failures[result.failure] += 1
            return self._end(t, result.failure)
        if (reason := self._continue(t, result.reply)) is not None:
            return self._end(t, reason)
        return None

    def _continue(self, t: Transcript, reply: Reply) -> str | None:
        """Append the reply and start the model's next turn; or the reason the rollout ends."""
        t.turn_reward += reply.reward
        t.tool_calls += reply.calls
        self.stats.count_calls(reply.calls)
        if reply.done:
            return "stop"
        if t.model_turns >= self.env.max_turns:  # the environment wanted more: cut short
            return "length"
        ids = self.encode_text(reply.text)
        room = t.params.max_new_tokens - len(t.token_ids) - len(ids)
        if room < 1:  # no token left for the model's next turn
            return "length"
        t.turns.append(Turn("env", reply.text))
        t.ends_with_stop_token = False  # the model's turn goes on after a stop token answered
        t.token_ids += ids
        t.logprobs += [0.0] * len(ids)
        t.versions += [ENV_VERSION] * len(ids)
        t.model_mask += [False] * len(ids)
        self.engine.extend(t.request_id, ids, replace(t.params, max_new_tokens=room))
        return None

    def _end(self, t: Transcript, reason: str) -> Transcript:
        t.finish_reason = reason
        del self._running[t.request_id]
        self.engine.release(t.request_id)
        self.pool.end(t.request_id)
        return t

    def close(self) -> None:
        self.pool.close()
