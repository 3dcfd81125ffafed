"""The whole pipeline with `engine.backend=vllm`: actor on vLLM, trainer, in-flight updates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vllm extra is not installed (make test-vllm)")

from pipelinerl.config import load_config  # noqa: E402
from pipelinerl.roles.launch import launch  # noqa: E402

pytestmark = pytest.mark.vllm

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arithmetic.yaml"


def test_pipeline_on_vllm_updates_weights_in_flight(tmp_path, warm_cache):
    cfg = load_config(EXAMPLE, [
        "name=vllm", f"output_dir={tmp_path / 'runs'}",
        f"warmstart.cache_dir={warm_cache}", "warmstart.steps=20", "eval.enabled=false",
        "engine.backend=vllm", "engine.capacity=16", "actor.group_size=4",
        "trainer.batch_size=16", "trainer.max_steps=4", "actor.max_lag=1",
        "trainer.sample_timeout_s=300", "metrics.progress=false",
    ])
    assert launch(cfg) == 0
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["actor_weight_updates"] >= 1
    assert all(r["lag_max"] <= 1 for r in records)
    # Tokens sampled by the very weights the trainer held: vLLM's processed log-probs agree
    # with the trainer's recomputation (fp32).
    lag0 = [r["mismatch_abs_lag0"] for r in records if "mismatch_abs_lag0" in r]
    assert lag0 and max(lag0) < 1e-3
