"""Records that flow between roles: task -> actor -> engine -> stream -> trainer.

Every generated token carries the log-probability the engine sampled it with and the policy
version (number of optimizer steps behind the weights) that produced it, so lag, importance
weights and ESS are exact per token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from tokenizers import Tokenizer


@dataclass(frozen=True)
class StopStrings:
    """vLLM's `stop`: a sequence ends once the text of its turn's tokens, decoded as they
    come (skipping special tokens or not), holds one of `strings`; the tokens stay whole
    (engine.sampling.StopMatcher). `tokenizer` is a `tokenizers.Tokenizer` (a fast
    tokenizer's `backend_tokenizer`)."""

    strings: tuple[str, ...]
    tokenizer: Tokenizer
    skip_special_tokens: bool = True


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    stop_token_ids: tuple[int, ...] = ()
    # Token sequences that end the sequence too (the turn of a multi-turn rollout: a tool
    # call's closing tag); the whole sequence is part of the output, as a stop token is.
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    # vLLM's, for the generate endpoint's clients (pipelinerl.engine.sampling says how they
    # sample; the trainer does not apply them): tokens below min_p times the most probable
    # are dropped (0 = disabled); the logits of tokens already in the sequence are divided
    # (positive) or multiplied (negative) by repetition_penalty (1 = disabled); a seed gives
    # the request draws of its own, the same whatever shares its batch (None: the engine's).
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    # Text that ends the sequence (vLLM's `stop`); its tokens are part of the output.
    stop: StopStrings | None = None


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # Multi-turn: when a turn ends the engine keeps the sequence (and its KV cache) until the
    # caller `extend`s it with the environment's tokens or `release`s it.
    hold: bool = False


# An actor that published no group for this long writes a heartbeat record on the rollout
# stream (pipelinerl.roles.actor), so the trainer tells a blocked actor from a dead one.
HEARTBEAT_S = 10.0


# The version of a token the environment wrote (multi-turn rollouts): no policy sampled it.
ENV_VERSION = -1


# Completion-length bins of the by-length metrics (tokens): [1, 32), [32, 64), ..., [512, inf).
# Fixed, so that runs and modes compare bin by bin (`rl.losses.length_bins`).
LENGTH_EDGES = (32, 64, 128, 256, 512)
LENGTH_LABELS = ("1-31", "32-63", "64-127", "128-255", "256-511", "512+")


@dataclass
class GenerationOutput:
    """A finished sequence as the engine returns it; for a held request, one finished turn:
    `token_ids` are the tokens generated since the prompt or the last `extend`."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # log-prob of each token under the distribution it was sampled from
    versions: list[int]  # policy version that produced each token
    finish_reason: str  # "stop" (a stop token was sampled; it is included) or "length"

    def completion_ids(self) -> list[int]:
        """The tokens the verifier reads: without the stop token the engine includes
        (`envs.rollout.Transcript` answers the same for a multi-turn rollout)."""
        return self.token_ids[:-1] if self.finish_reason == "stop" else self.token_ids


@dataclass
class Sample:
    """One scored attempt, as the trainer consumes it."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float
    success: bool
    finish_reason: str
    group_id: str = ""
    actor_id: int = 0
    # Multi-turn rollouts: per token, True if the model sampled it, False if the environment
    # wrote it (its log-prob is 0.0 and its version ENV_VERSION; it is fed, never trained).
    # None: every token is the model's.
    model_mask: list[bool] | None = None
    turns: int = 1  # model turns
    # The attempt of its group it belongs to: an environment's episode that branched
    # (verifiers) trains as one sample per branch, all with the episode's index and reward.
    # None: the sample is an attempt of its own.
    episode: int | None = None
    # Tool-using rollouts (pipelinerl.tools): each call, its reply, outcome and latency, in
    # the order made. None: no tools.
    tool_calls: list[dict[str, Any]] | None = None

    def model_versions(self) -> list[int]:
        """The versions of the tokens the model sampled."""
        if self.model_mask is None:
            return self.versions
        return [v for v, m in zip(self.versions, self.model_mask) if m]


def attempt_index(samples: Sequence[Sample]) -> list[int]:
    """Per sample, the position of its attempt among its group's attempts (the samples of
    one episode share it)."""
    seen: dict[tuple[str, int], int] = {}
    return [seen.setdefault(("sample", i) if s.episode is None else ("episode", s.episode),
                            len(seen)) for i, s in enumerate(samples)]


@dataclass
class Group:
    """The n attempts at one prompt: the unit the actor publishes (advantages need the group)."""

    group_id: str
    prompt: str
    samples: list[Sample]
    actor_id: int = 0
    actor_stats: dict[str, float] = field(default_factory=dict)
    attempt: int = 0  # the run's attempt whose actor made it (see Config.attempt)
    seq: int = 0  # groups its actor had published, this one included: the admission count
    # Where its actor's draws resume after a restart: the task position (tasks.dataset) of its
    # oldest problem not yet published; None for tasks without positions.
    data_pos: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Group":
        samples = [Sample(**s) for s in d["samples"]]
        return cls(
            group_id=d["group_id"],
            prompt=d["prompt"],
            samples=samples,
            actor_id=d.get("actor_id", 0),
            actor_stats=d.get("actor_stats", {}),
            attempt=d.get("attempt", 0),
            seq=d.get("seq", 0),
            data_pos=d.get("data_pos"),
        )
