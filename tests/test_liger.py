"""trainer.liger: Liger's fused kernels run on CUDA only, with liger-kernel installed (the
optional extra `gpu`); everywhere else they are refused, naming why, before any step. The
eager path is their reference (benchmarks/gpu.py, plan issue54, compares them on a GPU)."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_models import random_groups, smollm2_layout

from pipelinerl.config import ConfigError, load_config
from pipelinerl.rl.fused import use_liger
from pipelinerl.rl.packing import pack
from pipelinerl.rl.scores import score_tokens

torch.set_num_threads(1)


def test_liger_is_refused_off_cuda_and_beside_compile_or_an_entropy_bonus() -> None:
    for overrides, match in (([], "needs a CUDA trainer.device"),
                             (["trainer.device=cuda", "trainer.compile=true"], "choose one"),
                             (["trainer.device=cuda", "trainer.loss.entropy_coef=0.01"],
                              "computes no entropy")):
        with pytest.raises((ConfigError, ValueError), match=match):
            load_config(overrides=["model.path=unused", "trainer.liger=true", *overrides])
    with pytest.raises(ValueError, match="needs a CUDA trainer.device, not 'cpu'"):
        use_liger(smollm2_layout(1), "cpu")


def test_the_fused_head_refuses_truncation_and_says_how_to_install_liger() -> None:
    samples = [s for g in random_groups(1, random.Random(0)) for s in g.samples]
    (batch,) = pack(samples, [0.0] * len(samples), 4096)
    model = smollm2_layout(1)
    with pytest.raises(ValueError, match="untruncated distributions only"):
        score_tokens(model, batch, 1.0, 20, 1.0, mode="liger")
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match=r"pipelinerl\[gpu\]"):
            score_tokens(model, batch, mode="liger")
