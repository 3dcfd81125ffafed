"""Warm-start: batches, caching by content hash, and that training lowers the loss."""

from __future__ import annotations

import json
import random
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import pipelinerl.warmstart as ws
from pipelinerl.models.hf import load_model, load_tokenizer
from pipelinerl.models.tiny import build_char_tokenizer, build_tiny_model, init_tiny_model
from pipelinerl.tasks import ChainArithmeticTask
from pipelinerl.warmstart import WarmStartConfig, cache_key, sample_completions, warm_start

torch.set_num_threads(1)

# Tiny settings: seconds, not minutes.
FAST = WarmStartConfig(steps=3, batch_size=8, num_threads=1, eval_problems=4)


def test_demo_batches_mask_prompt_and_padding(tmp_path: Path) -> None:
    task = ChainArithmeticTask()
    tok = build_char_tokenizer(task.alphabet, tmp_path)
    batches = ws.demo_batches(task, tok, replace(FAST, batch_size=16), random.Random(0))
    widths = []
    for _ in range(ws.BUCKET):
        ids, labels = next(batches)
        widths.append(ids.shape[1])
        for row_ids, row_labels in zip(ids.tolist(), labels.tolist()):
            n_prompt = row_ids.index(tok.convert_tokens_to_ids("=")) + 1
            assert row_labels[:n_prompt] == [-100] * n_prompt  # no loss on the prompt
            eos = row_labels.index(tok.eos_token_id)
            assert row_ids[n_prompt : eos + 1] == row_labels[n_prompt : eos + 1]
            assert set(row_labels[eos + 1 :]) <= {-100}
            assert set(row_ids[eos + 1 :]) <= {tok.pad_token_id}
            completion = tok.decode(row_ids[n_prompt:eos])
            assert ";A=" in completion
    assert min(widths) < max(widths)  # grouped by length: short batches are not padded long


def test_cache_key_covers_what_determines_the_result() -> None:
    task = ChainArithmeticTask()
    key = cache_key(task, FAST)
    assert key == cache_key(ChainArithmeticTask(), FAST)
    assert key == cache_key(task, replace(FAST, num_threads=2, eval_problems=0))
    for change in (
        {"steps": 4},
        {"lr": 1e-3},
        {"step_error_prob": 0.5},
        {"seed": 1},
        {"preset": "small"},
        {"bf16": True},
        {"batch_size": 9},
    ):
        assert cache_key(task, replace(FAST, **change)) != key, change
    assert cache_key(ChainArithmeticTask(max_terms=5), FAST) != key


def test_warm_start_caches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = ChainArithmeticTask()
    out = warm_start(task, FAST, cache_dir=tmp_path, progress=False)
    manifest = json.loads((out / "warmstart.json").read_text())
    assert manifest["key"] == cache_key(task, FAST) and out.name.endswith(manifest["key"])
    assert 0.0 <= manifest["success_t1"] <= 1.0 and "success_greedy" in manifest
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # no temporary dir left

    model, tok = load_model(out), load_tokenizer(out)
    assert model.config.vocab_size == len(tok)
    assert len(sample_completions(model, tok, ["1+2="], max_new_tokens=4)) == 1

    def no_training(*args, **kwargs):
        raise AssertionError("a cached warm-start must not train again")

    monkeypatch.setattr(ws, "train", no_training)
    t0 = time.perf_counter()
    assert warm_start(task, FAST, cache_dir=tmp_path, progress=False) == out
    assert time.perf_counter() - t0 < 1.0
    with pytest.raises(AssertionError, match="must not train"):
        warm_start(task, replace(FAST, seed=1), cache_dir=tmp_path, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # the failed run left nothing


def test_warm_start_from_base_model(tmp_path: Path) -> None:
    task = ChainArithmeticTask()
    base = tmp_path / "base"
    build_tiny_model(base, build_char_tokenizer(task.alphabet, base), seed=3)
    out = warm_start(
        task,
        replace(FAST, eval_problems=0),
        cache_dir=tmp_path / "cache",
        base_model_dir=base,
        progress=False,
    )
    assert out.name.startswith("arithmetic-base-")
    assert cache_key(task, FAST, base) != cache_key(task, FAST)
    assert load_model(out).config.hidden_size == load_model(base).config.hidden_size


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="steps"):
        WarmStartConfig(steps=0)
    with pytest.raises(ValueError, match="step_error_prob"):
        WarmStartConfig(step_error_prob=1.5)


def test_training_lowers_the_loss(tmp_path: Path) -> None:
    task = ChainArithmeticTask()
    tok = build_char_tokenizer(task.alphabet, tmp_path)
    model = init_tiny_model(tok)
    cfg = replace(FAST, steps=150, batch_size=8, lr=3e-3, warmup_steps=10)
    losses = ws.train(model, tok, task, cfg, progress=False)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert first > 2.0  # about log(vocab) at random init
    assert last < 0.6 * first, (first, last)


def test_busy_cpu_falls_back_to_fewer_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ws, "_idle_cpus", lambda: 1.9)
    assert ws._usable_threads(2) == 2
    monkeypatch.setattr(ws, "_idle_cpus", lambda: 1.2)
    assert ws._usable_threads(2) == 1
    monkeypatch.setattr(ws, "_idle_cpus", lambda: 0.1)
    assert ws._usable_threads(2) == 1
    monkeypatch.setattr(ws, "_idle_cpus", lambda: None)  # unknown (not Linux): as asked
    assert ws._usable_threads(2) == 2


def test_idle_cpus_measures_something() -> None:
    idle = ws._idle_cpus(0.05)
    assert idle is None or 0.0 <= idle <= (ws.os.cpu_count() or 1)
