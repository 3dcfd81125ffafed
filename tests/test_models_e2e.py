"""docs/models.md's paths on tiny locally built Qwen2 and Llama instruct models (Qwen's chat
template and special tokens, two EOS ids): countdown in the instruct style and the math task,
each through `pipelinerl train`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_prompts import instruct_tokenizer

from pipelinerl.config import load_config
from pipelinerl.models.hf import load_tokenizer
from pipelinerl.roles.wiring import open_rollout_reader

ROOT = Path(__file__).resolve().parent.parent


def _train(tmp_path: Path, config: str, name: str, *overrides: str) -> Path:
    proc = subprocess.run(
        [sys.executable, "-m", "pipelinerl.cli", "train", str(ROOT / "examples" / config),
         f"name={name}", f"output_dir={tmp_path / 'runs'}", "trainer.max_steps=2",
         "trainer.max_time_s=0", "trainer.batch_size=8", "actor.group_size=4",
         "engine.capacity=8", "engine.max_seq_len=512", "engine.max_new_tokens=12",
         "eval.num_problems=4", "stream.keep_all=true", "metrics.progress=false",
         "metrics.plot=false", *overrides],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp_path / "runs" / name


def _check_run(run_dir: Path, model: Path) -> None:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert max(r.get("step", 0) for r in rows) == 2
    assert any("eval/version" in r for r in rows)
    with open_rollout_reader(load_config(run_dir / "config.yaml")) as reader:
        groups = [r for r in reader.read(1000, timeout_s=1.0) if not r.get("heartbeat")]
    tokenizer = load_tokenizer(model)
    for group in groups:
        assert tokenizer.decode(group["samples"][0]["prompt_ids"]) == (
            f"<|im_start|>user\n{group['prompt']}<|im_end|>\n<|im_start|>assistant\n")
    ends = {s["token_ids"][-1] for g in groups for s in g["samples"] if s["finish_reason"] == "stop"}
    assert ends <= {0, 2}


@pytest.mark.slow
def test_an_instruct_model_trains_on_countdown(tmp_path: Path) -> None:
    # Llama here; a Qwen2 instruct model runs the same path in
    # tests/test_dataset_task.py::test_a_dataset_with_a_user_reward_trains_and_evaluates_through_the_cli.
    arch = "llama"
    model = instruct_tokenizer(tmp_path / "model", arch=arch)
    run_dir = _train(tmp_path, "countdown.yaml", f"countdown-{arch}", f"model.path={model}",
                     "task.params.style=instruct")
    _check_run(run_dir, model)


@pytest.mark.slow
def test_an_instruct_model_trains_on_math(tmp_path: Path) -> None:
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"problem": f"What is {a} + {b}?", "answer": str(a + b)})
                            + "\n" for a in range(5) for b in range(5)))
    model = instruct_tokenizer(tmp_path / "model", arch="llama")
    run_dir = _train(tmp_path, "arithmetic.yaml", "math-llama", f"model.path={model}",
                     "task.name=math", f"task.params.dataset_path={data}",
                     "task.system_prompt=Put the final answer in \\boxed{}.")
    _check_run_with_system(run_dir, model)


def _check_run_with_system(run_dir: Path, model: Path) -> None:
    with open_rollout_reader(load_config(run_dir / "config.yaml")) as reader:
        groups = [r for r in reader.read(1000, timeout_s=1.0) if not r.get("heartbeat")]
    tokenizer = load_tokenizer(model)
    text = tokenizer.decode(groups[0]["samples"][0]["prompt_ids"])
    assert text.startswith("<|im_start|>system\nPut the final answer in \\boxed{}.<|im_end|>\n"
                           "<|im_start|>user\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
