"""Kernels launched and host syncs per training step and per decode step, counted on the CPU
on a tiny model of SmolLM2's layout (tests/launch_counts.py says what counts). On a GPU both
bound a small model's step whatever the chip (launch-bound at ~0.1% of its peak, issue 35),
so each has a budget here: a change that adds a loop over sequences or layers, or a read of a
device value, fails this test. The budgets are today's counts (2026-11-27, torch 2.13,
transformers 5) plus about 10%; a change that lowers a count lowers its budget. A new
transformers release may change the model's own op count: re-measure, and say so."""

from __future__ import annotations

import contextlib
import random
from typing import Any, Callable

import pytest
import torch
import torch._inductor.config as inductor_config
import torch._inductor.metrics as inductor_metrics
from launch_counts import HostSyncs, Kernels
from test_compute_dtype import WeightCasts
from tiny_models import random_groups, smollm2_layout
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from pipelinerl.config import load_config
from pipelinerl.engine import EngineOptions
from pipelinerl.engine.torch_engine import TorchEngine
from pipelinerl.rl.attention import set_packed_attention
from pipelinerl.rl.step import rl_step
from pipelinerl.roles.trainer import make_optimizer
from pipelinerl.types import GenerationRequest, SamplingParams

torch.set_num_threads(1)


def _train_step_counts(layers: int, sequences: int, *overrides: str,
                       inside: Callable[[torch.nn.Module], Any] | None = None
                       ) -> tuple[Kernels, HostSyncs]:
    """The second step (the first allocates Adam's state) of the default recipe, packed, with
    `overrides`; `inside(model)`: another counter to hold over that step too."""
    cfg = load_config(overrides=["model.path=unused", f"trainer.batch_size={sequences}",
                                 "actor.group_size=8", *overrides])
    model = smollm2_layout(layers).train()
    set_packed_attention(model, cfg.trainer)
    optimizer = make_optimizer(model, cfg.trainer)  # the trainer's
    rng = random.Random(0)
    rl_step(model, optimizer, random_groups(sequences // 8, rng), cfg, 0)
    extra = inside(model) if inside is not None else contextlib.nullcontext()
    with Kernels() as kernels, HostSyncs() as syncs, extra:
        rl_step(model, optimizer, random_groups(sequences // 8, rng), cfg, 0)
    return kernels, syncs


# (layers, sequences) -> (kernels, host syncs); 16 sequences are one micro-batch, 32 two.
TRAIN_BUDGETS = {(2, 16): (540, 2), (4, 16): (845, 2), (2, 32): (1070, 2)}


@pytest.mark.parametrize(("layers", "sequences"), list(TRAIN_BUDGETS))
def test_a_training_step_stays_within_its_kernel_and_sync_budgets(layers: int,
                                                                   sequences: int) -> None:
    """Today 491 / 769 / 972 kernels and 2 host reads: the step's sums with the gradient norm
    before the optimizer's step (its non-finite check needs the norm), and the statistics
    after it (sums, length bins and the lag histogram in one read). Before issue 54: 494 /
    772 / 974 kernels, 10 / 10 / 13 syncs (the advantages' boolean indexing and the packer's
    read of host tensors, the loss totals, the gradient norm and its finiteness read apart, the
    lag histogram's `unique` and its two reads, the length bins). Before issue 35's cut: 855 /
    1469 / 1518 kernels, 13 / 13 / 19 syncs (the loss statistics read every micro-batch; a
    slice per sequence and layer, each with its own backward; position_ids read back every
    forward; a for-each AdamW)."""
    kernels, syncs = _train_step_counts(layers, sequences)
    kernel_budget, sync_budget = TRAIN_BUDGETS[layers, sequences]
    assert kernels.total <= kernel_budget, kernels.counts.most_common(15)
    assert syncs.total <= sync_budget, syncs.counts


def test_token_micro_batches_cut_the_kernels_with_the_forwards() -> None:
    """32 sequences in rows of 256 tokens: 2392 kernels (one forward per row); in micro-batches
    of up to 4096 tokens (trainer.tokens_per_microbatch): 617, one forward; the default rows
    of 1024 take 972 (two)."""
    rows, _ = _train_step_counts(2, 32, "trainer.max_tokens_per_row=256")
    tokens, syncs = _train_step_counts(2, 32, "trainer.max_tokens_per_row=256",
                                       "trainer.tokens_per_microbatch=4096")
    assert rows.total >= 2 * tokens.total and tokens.total <= 680, (rows.total, tokens.total)
    assert syncs.total <= 2, syncs.counts


def test_bf16_compute_weights_cast_each_weight_once_a_step() -> None:
    """trainer.compute_dtype=bfloat16 at 2 layers, 16 sequences: 20 weight casts (one per
    parameter, the refresh of its bf16 copy), 107 casts and copies in all, 555 kernels, 2 host
    reads; autocast (trainer.precision=bfloat16) casts its weights once too (its cache) but
    launches 685 kernels, 237 of them casts and copies (activations around every norm, rotary
    and attention, forward and backward); float32: 491, 43."""
    casts: dict[str, WeightCasts] = {}

    def weight_casts(model: torch.nn.Module) -> WeightCasts:
        casts["bf16"] = WeightCasts(list(model.parameters()))
        return casts["bf16"]

    kernels, syncs = _train_step_counts(2, 16, "trainer.compute_dtype=bfloat16",
                                        inside=weight_casts)
    assert casts["bf16"].count <= 20  # parameters of the 2-layer model
    assert kernels.total <= 610, kernels.counts.most_common(15)
    assert kernels.counts["_to_copy"] + kernels.counts["copy_"] <= 120, kernels.counts
    assert syncs.total <= 2, syncs.counts


@pytest.mark.slow
def test_the_compiled_step_states_its_kernels_and_never_recompiles() -> None:
    """trainer.compile at 2 layers, 16 sequences: inductor generates 46 kernels for the step's
    graphs (each layer's two parts forward and backward, shared by the layers, and the
    log-probs); one step then launches 24 of them (the elementwise work of norms, rotary,
    SwiGLU, residuals and the log-softmax fused) beside the matmuls and attention it still
    calls, against 491 aten kernels eager (the dispatch counter does not see inside compiled
    graphs: a dispatch mode sends them back to eager). Dynamo compiles 8 frames in the first
    step and none in the next ones."""
    torch._dynamo.reset()
    counters.clear()
    inductor_metrics.reset()
    cfg = load_config(overrides=["model.path=unused", "trainer.batch_size=16",
                                 "actor.group_size=8", "trainer.compile=true"])
    model = smollm2_layout(2).train()
    set_packed_attention(model, cfg.trainer)
    optimizer = make_optimizer(model, cfg.trainer)
    rng = random.Random(0)
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        rl_step(model, optimizer, random_groups(2, rng), cfg, 0)
        frames, generated = counters["frames"]["ok"], inductor_metrics.generated_kernel_count
        for n_groups in (1, 3):
            rl_step(model, optimizer, random_groups(n_groups, rng), cfg, 0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            rl_step(model, optimizer, random_groups(2, rng), cfg, 0)
    launched = sum(1 for e in prof.events() if "cpp_fused" in e.name)
    assert counters["frames"]["ok"] == frames > 0  # no recompilation after the first step
    assert 0 < generated <= 60 and 0 < launched <= 30, (generated, launched)


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
