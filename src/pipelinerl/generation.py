"""What the actor and the evaluator share about generation: the sampling settings of the
run's engine section, and the completion tokens a verifier reads."""

from __future__ import annotations

from typing import Any

from pipelinerl.envs.rollout import Transcript
from pipelinerl.types import GenerationOutput, SamplingParams


def sampling_from_config(engine_cfg: Any, stop_token_ids: tuple[int, ...]) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=engine_cfg.max_new_tokens,
        temperature=engine_cfg.temperature,
        top_p=engine_cfg.top_p,
        top_k=engine_cfg.top_k,
        stop_token_ids=stop_token_ids,
    )


def completion_ids(out: GenerationOutput | Transcript) -> list[int]:
    """The tokens the verifier reads: without the stop token the engine includes."""
    if isinstance(out, Transcript):
        return out.completion_ids()
    return out.token_ids[:-1] if out.finish_reason == "stop" else out.token_ids
