"""Sampling rows of logits through the engine's sampler (`SlotSampler`) as the engine does it:
the rows' parameters written into the sampler's slots, the plan known from them on the host,
the noise drawn beforehand, one call."""

from __future__ import annotations

from typing import Sequence

import torch

from pipelinerl.engine.sampling import SamplingPlan, SlotSampler


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, generator: torch.Generator, min_p: torch.Tensor | None = None,
                penalty: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None,
                own_generators: Sequence[tuple[int, torch.Generator]] = (),
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens and log-probs the engine samples for rows with these parameters (`tokens`
    (n, W) and `lengths` (n,): each row's sequence so far, for the penalty)."""
    n, vocab = logits.shape
    min_p = torch.zeros(n) if min_p is None else min_p
    penalty = torch.ones(n) if penalty is None else penalty
    tokens = torch.zeros(n, 1, dtype=torch.long) if tokens is None else tokens
    lengths = torch.ones(n, dtype=torch.long) if lengths is None else lengths
    width = tokens.shape[1]
    sampler = SlotSampler(n, width, vocab, torch.device("cpu"))
    sampler.tokens[:, :width] = tokens
    for param, value in zip(sampler.params(), (temperature, top_k, top_p, min_p, penalty)):
        param.copy_(value)
    truncates = (temperature > 0) & ((top_k > 0) | (top_p < 1) | (min_p > 0))
    plan = SamplingPlan.of(temperature, top_k, top_p, truncates, penalty != 1, min_p > 0, vocab)
    sampler.draw(0, n, generator, own_generators)
    out = sampler.sample(logits, 0, n, lengths, plan, width)
    return out[:, 0].long(), out[:, 1]
