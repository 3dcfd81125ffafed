"""Kernels launched and host syncs per training step and per decode step, counted on the CPU
on a tiny model of SmolLM2's layout (tests/launch_counts.py says what counts). On a GPU both
bound a small model's step whatever the chip (launch-bound at ~0.1% of its peak, issue 35),
so each has a budget here: a change that adds a loop over sequences or layers, or a read of a
device value, fails this test. The budgets are today's counts (2026-11-27, torch 2.13,
transformers 5) plus about 10%; a change that lowers a count lowers its budget. A new
transformers release may change the model's own op count: re-measure, and say so."""

from __future__ import annotations

import random

import pytest
import torch

from launch_counts import HostSyncs, Kernels
from pipelinerl.config import load_config
from pipelinerl.engine import EngineOptions
from pipelinerl.engine.torch_engine import TorchEngine
from pipelinerl.rl.attention import set_packed_attention
from pipelinerl.rl.step import rl_step
from pipelinerl.trainer import make_optimizer
from pipelinerl.types import GenerationRequest, SamplingParams
from tiny_models import random_groups, smollm2_layout

torch.set_num_threads(1)


def _train_step_counts(layers: int, sequences: int) -> tuple[Kernels, HostSyncs]:
    """The second step (the first allocates Adam's state) of the default recipe, packed."""
    cfg = load_config(overrides=["model.path=unused", f"trainer.batch_size={sequences}",
                                 "actor.group_size=8"])
    model = smollm2_layout(layers).train()
    set_packed_attention(model, cfg.trainer)
    optimizer = make_optimizer(model, cfg.trainer)  # the trainer's
    rng = random.Random(0)
    rl_step(model, optimizer, random_groups(sequences // 8, rng), cfg, 0)
    with Kernels() as kernels, HostSyncs() as syncs:
        rl_step(model, optimizer, random_groups(sequences // 8, rng), cfg, 0)
    return kernels, syncs


# (layers, sequences) -> (kernels, host syncs); 16 sequences are one micro-batch, 32 two.
TRAIN_BUDGETS = {(2, 16): (545, 10), (4, 16): (850, 10), (2, 32): (1070, 13)}


@pytest.mark.parametrize(("layers", "sequences"), list(TRAIN_BUDGETS))
def test_a_training_step_stays_within_its_kernel_and_sync_budgets(layers: int,
                                                                   sequences: int) -> None:
    """Today 494 / 772 / 974 kernels, 10 / 10 / 13 syncs. Before issue 35's cut: 855 / 1469 /
    1518 kernels, 13 / 13 / 19 syncs (the loss statistics read every micro-batch; a slice per
    sequence and layer, each with its own backward; position_ids read back every forward; a
    for-each AdamW)."""
    kernels, syncs = _train_step_counts(layers, sequences)
    kernel_budget, sync_budget = TRAIN_BUDGETS[layers, sequences]
    assert kernels.total <= kernel_budget, kernels.counts.most_common(15)
    assert syncs.total <= sync_budget, syncs.counts


def _decode_step_counts(layers: int, running: int, late: bool = False) -> tuple[Kernels, HostSyncs]:
    hf = smollm2_layout(layers)
    engine = TorchEngine(hf.config, EngineOptions(capacity=8, max_seq_len=128, late_stop_check=late))
    engine.load_weights(hf.state_dict(), version=0)
    for i in range(running):
        engine.add_request(GenerationRequest(f"r{i}", [1 + i, 2, 3, 4, 5],
                                             SamplingParams(max_new_tokens=100, temperature=1.0)))
    for _ in range(3):  # past the prefill
        engine.step()
    with Kernels() as kernels, HostSyncs() as syncs:
        engine.step()
    return kernels, syncs


@pytest.mark.parametrize("late", [False, True], ids=["at_once", "late"])
def test_a_decode_step_costs_the_same_whatever_the_batch_and_stays_within_budget(late: bool) -> None:
    """One batched forward: the same kernels for 4 or 8 running sequences; 31 per layer, 58
    outside the layers: 120 at 2 layers (96 in the runner's step: forward, sampling, the
    sampled tokens written; 1 draw, 1 copy out; 22 on the host's mirrors: lengths, the stop
    check). One host read, the stop check's `nonzero` over host flags; it reads no device
    value (tests/test_sampling_syncs.py). Before issue 54's part 2: 112 kernels and 6 host
    reads (the longest length, three `bool()` of the batch's sampling flags, the stop flags'
    `.cpu()` from the device, a `nonzero`), 2-3 more with top-k or top-p (the candidates
    sized on the device's values)."""
    small, small_syncs = _decode_step_counts(2, 4, late)
    large, large_syncs = _decode_step_counts(2, 8, late)
    deep, _ = _decode_step_counts(4, 4, late)
    assert small.counts == large.counts and small_syncs.total == large_syncs.total
    assert (deep.total - small.total) / 2 <= 35, deep.counts - small.counts
    assert small.total <= 125, small.counts.most_common(15)
    assert small_syncs.total <= 1, small_syncs.counts
