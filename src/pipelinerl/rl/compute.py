"""Compute weights (`trainer.compute_dtype=bfloat16`): the forward and backward run on a bf16
copy of the parameters while AdamW updates the float32 masters.

Autocast (`trainer.precision=bfloat16`) keeps float32 weights and casts around each op: its
cache casts each weight once within the step, but activations are cast to and from float32
around every norm, rotary embedding and attention, forward and backward (on the CPU's tiny
SmolLM2 layout 2x the casts of this path; on an H200 a SmolLM2 step of 32 samples launched
1515 `copy_`). Here each parameter has one bf16 copy, made once and refreshed in place from
its master at the start of every step, so that whatever wrote the masters since (the
optimizer's step, a checkpoint load) is seen, and a step casts each parameter once; the
forward then runs in bf16 throughout. (Fused AdamW does not bump the parameters' version
counters, so "changed since" cannot be told cheaply: every copy is refreshed.) For the step
the model's parameter slots hold the copies (tied slots share one copy); each copy's
gradient, bf16 as the backward computes it, is added into its master's float32 `.grad` as
soon as the micro-batch's backward has accumulated it and then dropped, so gradients add up
over micro-batches in float32. Outside the step the model holds its masters: checkpoints,
the published weights and the optimizer see float32 only.

Memory: 2 bytes per parameter for the copies, plus one micro-batch's bf16 gradients at a
time, on top of the float32 masters, gradients and AdamW moments (16 bytes per parameter).
One process only: DDP's gradient hooks sit on the masters, which the backward no longer
reaches (FSDP2 has its own bf16 compute weights, `trainer.fsdp.param_dtype`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

_ATTRIBUTE = "_pipelinerl_compute_weights"  # where a model keeps its copies between steps


class ComputeWeights:
    """A model's parameters in `dtype`, swapped in for a step (`swapped`)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        copies: dict[int, nn.Parameter] = {}
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []  # (master, copy), one per tensor
        self.slots: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
        for module in model.modules():
            for name, master in module._parameters.items():
                if master is None or not master.is_floating_point():
                    continue
                if id(master) not in copies:
                    copy = nn.Parameter(torch.empty_like(master, dtype=dtype),
                                        requires_grad=master.requires_grad)
                    if master.requires_grad:
                        copy.register_post_accumulate_grad_hook(_into_master(master))
                    copies[id(master)] = copy
                    self.pairs.append((master, copy))
                self.slots.append((module, name, master, copies[id(master)]))

    @torch.no_grad()
    def refresh(self) -> None:
        """Each master into its copy, in place (one cast a parameter)."""
        for master, copy in self.pairs:
            copy.copy_(master)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The copies, refreshed, in the model's parameter slots for the duration."""
        self.refresh()
        for module, name, _, copy in self.slots:
            module._parameters[name] = copy
        try:
            yield
        finally:
            for module, name, master, _ in self.slots:
                module._parameters[name] = master


def _into_master(master: nn.Parameter) -> Callable[[nn.Parameter], None]:
    def hook(copy: nn.Parameter) -> None:
        assert copy.grad is not None
        if master.grad is None:
            master.grad = copy.grad.to(master.dtype)
        else:
            master.grad.add_(copy.grad)  # float32 += bf16: one kernel, no float32 copy
        copy.grad = None
    return hook


def compute_weights(model: nn.Module, dtype: torch.dtype) -> ComputeWeights:
    """The model's compute weights in `dtype`, made on first use and kept with the model."""
    weights = model.__dict__.get(_ATTRIBUTE)
    if weights is None or weights.dtype != dtype:
        weights = ComputeWeights(model, dtype)
        model.__dict__[_ATTRIBUTE] = weights
    return weights


def computing(model: nn.Module, compute_dtype: str) -> contextlib.AbstractContextManager[None]:
    """`trainer.compute_dtype` around a step's forward and backward passes: float32 computes
    on the masters themselves (nothing to do)."""
    if compute_dtype == "float32":
        return contextlib.nullcontext()
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError(f"trainer.compute_dtype={compute_dtype} runs in one trainer process: "
                         "DDP's gradient hooks are on the float32 masters, which its backward "
                         "does not reach (use trainer.precision=bfloat16 under DDP)")
    return compute_weights(model, getattr(torch, compute_dtype)).swapped()
