"""Learning-rate schedule: a linear warm-up, then constant, linear or cosine decay.

`LrFactor(s)` multiplies `trainer.lr` at optimizer step s (0-based): during the warm-up
(s < W) it is (s + 1) / W, so the first step already moves; after it, progress
p = (s - W) / (max_steps - W) runs from 0 to 1 and the factor is 1 (constant), 1 - p (linear)
or (1 + cos(pi p)) / 2 (cosine), reaching 0 at step max_steps, the step never taken.

A resume that changes `trainer.max_steps` (or `lr_schedule`) continues the decay from where it
stands: from the resume step s0 with factor f0, p = (s - s0) / (max_steps - s0) and the factor
is f0 times the shape (constant: f0), so the lr never jumps. A decay that ended (f0 = 0) is
refused, except as `constant`, which restarts at trainer.lr, as the log says. A resume that
changes `trainer.lr` applies it from the resume step on (`continue_schedule`).
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from pipelinerl.config import TrainerConfig


class LrFactor:
    """A callable object, not a function: LambdaLR saves its fields with the scheduler's
    state_dict and restores them on load, the decay's anchor included."""

    def __init__(self, schedule: str, warmup_steps: int, max_steps: int) -> None:
        self.schedule, self.warmup_steps, self.max_steps = schedule, warmup_steps, max_steps
        # Where the decay starts and from which factor: moved by a resume with a new max_steps.
        self.anchor_step, self.anchor_factor = warmup_steps, 1.0

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.anchor_factor
        progress = min(1.0, (step - self.anchor_step) / max(1, self.max_steps - self.anchor_step))
        if self.schedule == "linear":
            return self.anchor_factor * (1.0 - progress)
        return self.anchor_factor * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, tc: TrainerConfig) -> LambdaLR:
    """Step it once after each optimizer step. A resumed run must restore its state_dict, then
    call continue_schedule."""
    return LambdaLR(optimizer, LrFactor(tc.lr_schedule, tc.warmup_steps, tc.max_steps))


def continue_schedule(scheduler: LambdaLR, tc: TrainerConfig) -> list[str]:
    """After a resume's load_state_dict (which restores the checkpoint's schedule): a changed
    `lr_schedule` or `max_steps` continues from the factor at the resume step, a changed `lr`
    replaces the base lr. Returns what changed, for the log. Raises ValueError for a decay that
    has ended (the lr would stay 0 for every step added)."""
    factor = scheduler.lr_lambdas[0]
    assert isinstance(factor, LrFactor), "make_scheduler builds every schedule"
    step = scheduler.last_epoch
    changes = []
    if (factor.schedule, factor.max_steps) != (tc.lr_schedule, tc.max_steps):
        now = factor(step)
        if now == 0 and tc.lr_schedule != "constant":
            raise ValueError(
                f"trainer.max_steps={tc.max_steps}: the run's {factor.schedule} lr schedule "
                f"reached 0 at step {factor.max_steps}, so every step added would train with "
                "lr 0. Resume with trainer.lr_schedule=constant (the lr of trainer.lr), or "
                "start a new run from this one's final/ model")
        # A decay that ended restarts at trainer.lr (the one way on from lr 0); every other
        # change continues from the factor reached, so the lr does not jump.
        start = 1.0 if now == 0 else now
        if step >= factor.warmup_steps:
            factor.anchor_step, factor.anchor_factor = step, start
        changes.append(f"lr schedule {factor.schedule} to step {factor.max_steps} -> "
                       f"{tc.lr_schedule} to step {tc.max_steps} from step {step}, at lr "
                       f"factor {start:.4g}" + (" (it had reached 0)" if start != now else ""))
        factor.schedule, factor.max_steps = tc.lr_schedule, tc.max_steps
    if any(base != tc.lr for base in scheduler.base_lrs):
        changes.append(f"trainer.lr {scheduler.base_lrs[0]:.4g} -> {tc.lr:.4g} from step {step}")
        scheduler.base_lrs = [tc.lr] * len(scheduler.base_lrs)
        for group in scheduler.optimizer.param_groups:
            group["initial_lr"] = tc.lr
    if changes:  # the optimizer's lr for the next step, as the scheduler would have set it
        lrs = [base * factor(step) for base in scheduler.base_lrs]
        for group, lr in zip(scheduler.optimizer.param_groups, lrs):
            group["lr"] = lr
        scheduler._last_lr = lrs
    return changes
