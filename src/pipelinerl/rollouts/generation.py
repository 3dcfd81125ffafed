"""What the actor and the evaluator share about generation: the sampling settings of the
run's engine section."""

from __future__ import annotations

from pipelinerl.config import EngineConfig
from pipelinerl.types import SamplingParams


def sampling_from_config(engine_cfg: EngineConfig, stop_token_ids: tuple[int, ...]
                         ) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=engine_cfg.max_new_tokens,
        temperature=engine_cfg.temperature,
        top_p=engine_cfg.top_p,
        top_k=engine_cfg.top_k,
        stop_token_ids=stop_token_ids,
    )

