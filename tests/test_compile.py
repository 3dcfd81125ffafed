"""trainer.compile: the decoder layers and the log-prob computation under torch.compile
(inductor on the CPU), against the eager step as reference. Slow: the first compile takes
~35 s on this 2-core CPU with a cold inductor cache (~6 s warm)."""

from __future__ import annotations

import random
import time

import pytest
import torch
from tiny_models import random_groups, smollm2_layout
from torch._dynamo.utils import counters

from pipelinerl.config import load_config
from pipelinerl.rl.attention import set_packed_attention
from pipelinerl.rl.packing import pack
from pipelinerl.rl.scores import score_tokens
from pipelinerl.rl.step import rl_step
from pipelinerl.roles.trainer import make_optimizer

torch.set_num_threads(1)

pytestmark = pytest.mark.slow


def _run(compiled: bool) -> tuple[list[dict], torch.nn.Module, list[int], float]:
    """Four steps of 1, 2, 3 and 1 groups (rows of 8 to 24 sequences of varied lengths): the
    metrics, the model, the frames dynamo compiled by the end of each step, the first step's
    seconds."""
    cfg = load_config(overrides=["model.path=unused", "trainer.batch_size=8", "actor.group_size=8",
                                 f"trainer.compile={str(compiled).lower()}"])
    model = smollm2_layout(2).train()
    set_packed_attention(model, cfg.trainer)
    optimizer = make_optimizer(model, cfg.trainer)
    rng = random.Random(0)
    metrics, frames, first_s = [], [], 0.0
    for step, n_groups in enumerate((1, 2, 3, 1)):
        t0 = time.perf_counter()
        metrics.append(rl_step(model, optimizer, random_groups(n_groups, rng), cfg, step))
        first_s = first_s or time.perf_counter() - t0
        frames.append(counters["frames"]["ok"])
    return metrics, model, frames, first_s


def test_the_compiled_step_equals_the_eager_step_and_compiles_once() -> None:
    """Loss, gradient norm, ESS and the weights after four steps agree with eager within fp32
    noise; every graph is compiled in the first step (layers, their backward, the log-probs),
    none after it, whatever the batch's layout."""
    eager, eager_model, _, _ = _run(compiled=False)
    torch._dynamo.reset()
    counters.clear()
    compiled, compiled_model, frames, first_s = _run(compiled=True)
    assert frames[0] > 0 and frames[1:] == [frames[0]] * 3, frames  # no recompilation
    print(f"first compiled step {first_s:.1f} s, {frames[0]} frames")
    for e, c in zip(eager, compiled):
        for key in ("loss", "grad_norm", "ess", "mismatch_abs"):
            assert c[key] == pytest.approx(e[key], rel=1e-4, abs=1e-6), key
        assert c["tokens"] == e["tokens"] and c["lag_hist"] == e["lag_hist"]
    for (name, a), b in zip(eager_model.named_parameters(), compiled_model.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_compiled_chunked_logprobs_equal_eager_with_their_gradients(entropy_grad: bool) -> None:
    """The chunked log-softmax (beyond chunk_tokens trained tokens) with each chunk compiled:
    log-probs, entropies and the gradients on the logits within fp32 noise of eager, under
    top-k/top-p truncation."""
    model = smollm2_layout(2).train()
    samples = [s for g in random_groups(1, random.Random(3)) for s in g.samples]
    (batch,) = pack(samples, [0.0] * len(samples), 4096)
    results = []
    for mode in ("eager", "compiled"):
        model.zero_grad()
        scores = score_tokens(model, batch, 0.9, 20, 0.9, chunk_tokens=37,
                              entropy_grad=entropy_grad, mode=mode)
        (scores.logprobs.sum() + scores.entropy.sum()).backward()
        results.append((scores.logprobs.detach(), scores.entropy.detach(),
                        model.lm_head.weight.grad.clone()))
    for e, c in zip(*results):
        assert torch.allclose(e, c, rtol=1e-4, atol=1e-5)
