"""Learning-rate schedule: a linear warm-up, then constant, linear or cosine decay.

`lr_factor(s)` multiplies `trainer.lr` at optimizer step s (0-based): during the warm-up
(s < W) it is (s + 1) / W, so the first step already moves; after it, progress
p = (s - W) / (max_steps - W) runs from 0 to 1 and the factor is 1 (constant), 1 - p (linear)
or (1 + cos(pi p)) / 2 (cosine), reaching 0 at step max_steps, the step never taken.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR

from pipelinerl.config import TrainerConfig


def lr_factor(step: int, schedule: str, warmup_steps: int, max_steps: int) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, tc: TrainerConfig) -> LambdaLR:
    """Step it once after each optimizer step. A resumed run must restore its state_dict too."""
    return LambdaLR(optimizer, partial(lr_factor, schedule=tc.lr_schedule,
                                       warmup_steps=tc.warmup_steps, max_steps=tc.max_steps))
