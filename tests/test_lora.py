"""LoRA (peft): only adapters train and hold optimizer state; the engine, loaded with the merged
weights, samples exactly the trainer's policy (log-probs within 1e-4 in fp32, as for full
weights); checkpoints hold the merged model and the adapter, and a resume restores the adapter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_recipe import GROUP, random_groups
from tiny_models import VOCAB, tiny_hf_model

from pipelinerl.config import LoraSettings, load_config
from pipelinerl.engine import EngineOptions
from pipelinerl.engine.torch_engine import TorchEngine
from pipelinerl.models.hf import load_model
from pipelinerl.models.lora import apply_lora, merged_model, merged_weights
from pipelinerl.rl.packing import pack
from pipelinerl.rl.scores import score_tokens
from pipelinerl.rl.step import rl_step
from pipelinerl.roles.trainer import Trainer, trainer_weights
from pipelinerl.run.checkpoint import load_checkpoint, save_checkpoint
from pipelinerl.types import GenerationRequest, Sample, SamplingParams

SETTINGS = LoraSettings(rank=4, alpha=8.0)


def _lora_model(arch: str = "qwen2", seed: int = 0) -> torch.nn.Module:
    """Adapters with random B (peft starts B at 0, where merged == base proves nothing)."""
    model = apply_lora(tiny_hf_model(arch, seed=seed), SETTINGS)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return model


def test_only_adapters_train_and_hold_optimizer_state() -> None:
    model = _lora_model()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    cfg = load_config(overrides=["model.path=unused", f"actor.group_size={GROUP}",
                                 "trainer.batch_size=8", "trainer.lr=1e-2"])
    trainer = Trainer(cfg, model, None, None)
    n_adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"]) == n_adapter
    frozen = {k: v.clone() for k, v in merged_weights(model).items() if "embed" in k}
    before = merged_weights(model)
    trainer.train_step(random_groups(), num_sequences=8)
    state = trainer.optimizer.state
    assert sum(s["exp_avg"].numel() for s in state.values()) == n_adapter
    after = merged_weights(model)
    assert all(torch.equal(after[k], v) for k, v in frozen.items())  # not adapted: unchanged
    assert not torch.equal(after["model.layers.0.self_attn.q_proj.weight"],
                           before["model.layers.0.self_attn.q_proj.weight"])


def test_merged_weights_are_peft_merge_under_the_base_names() -> None:
    model = _lora_model("llama")
    merged = merged_weights(model)
    reference = merged_model(model).state_dict()
    assert set(merged) == set(tiny_hf_model("llama").state_dict())
    for name, tensor in reference.items():
        torch.testing.assert_close(merged[name], tensor, atol=1e-6, rtol=0)
    assert trainer_weights(model).keys() == merged.keys()


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_engine_on_merged_weights_samples_the_trainers_policy(arch: str) -> None:
    model = _lora_model(arch)
    engine = TorchEngine(tiny_hf_model(arch).config, EngineOptions(capacity=4, max_seq_len=64))
    engine.load_weights(merged_weights(model), version=1)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (3 + i,), generator=gen).tolist() for i in range(4)]
    for i, p in enumerate(prompts):
        engine.add_request(GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=10,
                                                                          temperature=1.0)))
    outputs = {}
    while engine.num_active():
        outputs.update((o.request_id, o) for o in engine.step())
    samples = [Sample(p, outputs[f"r{i}"].token_ids, outputs[f"r{i}"].logprobs,
                      outputs[f"r{i}"].versions, 0.0, False, "length")
               for i, p in enumerate(prompts)]
    (batch,) = pack(samples, [0.0] * len(samples), max_tokens_per_row=64)
    with torch.no_grad():
        trainer_lp = score_tokens(model.eval(), batch).logprobs
    for i, sample in enumerate(samples):  # packing orders sequences its own way
        torch.testing.assert_close(trainer_lp[batch.seq_idx == i], torch.tensor(sample.logprobs),
                                   atol=1e-4, rtol=0)


def test_checkpoint_holds_the_merged_model_and_the_adapter_a_resume_restores(tmp_path: Path) -> None:
    model = _lora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = load_config(overrides=["model.path=unused", f"actor.group_size={GROUP}",
                                 "trainer.batch_size=8"])
    rl_step(model, optimizer, random_groups(), cfg, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)

    class NoTokenizer:
        def save_pretrained(self, path: str) -> None:
            pass

    path = save_checkpoint(tmp_path, 1, model, NoTokenizer(), optimizer, scheduler, {}, keep=2)
    assert (path / "adapter" / "adapter_config.json").exists()
    plain = load_model(path / "model")  # a plain HF model: what any role or tool loads
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(tensor, merged_weights(model)[name], atol=1e-6, rtol=0)
    fresh = apply_lora(tiny_hf_model("qwen2", seed=0), SETTINGS)
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    load_checkpoint(path, fresh, fresh_opt, torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda _: 1.0))
    for name, tensor in merged_weights(fresh).items():
        torch.testing.assert_close(tensor, merged_weights(model)[name], atol=0, rtol=0)


def test_a_target_module_the_model_lacks_is_refused_naming_its_layers() -> None:
    with pytest.raises(ValueError, match=r"\['qkv'\] match no module.*'q_proj'"):
        apply_lora(tiny_hf_model("qwen2"), LoraSettings(target_modules=["qkv", "q_proj"]))


@pytest.mark.slow
def test_a_lora_run_saves_the_adapter_and_the_merged_model(tmp_path: Path,
                                                           warm_cache: Path) -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "arithmetic.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "pipelinerl.cli", "train", str(example), "name=lora",
         f"output_dir={tmp_path}", f"warmstart.cache_dir={warm_cache}",
         # A 20-step warm-start earns no reward, so no advantage: the entropy bonus gives the
         # adapters a gradient all the same.
         "warmstart.steps=20", "model.lora.rank=4", "trainer.lr=1e-3", "trainer.max_steps=5",
         "trainer.loss.entropy_coef=0.01",
         "trainer.max_time_s=0", "trainer.batch_size=16", "actor.group_size=4",
         "engine.capacity=16", "eval.num_problems=20", "metrics.progress=false",
         "metrics.plot=false"],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "lora"
    assert json.loads((run / "final_adapter" / "adapter_config.json").read_text())["r"] == 4
    start = load_model(load_config(run / "config.yaml").model.path).state_dict()
    final = load_model(run / "final").state_dict()
    assert torch.equal(final["model.embed_tokens.weight"], start["model.embed_tokens.weight"])
    assert not torch.equal(final["model.layers.0.mlp.up_proj.weight"],
                           start["model.layers.0.mlp.up_proj.weight"])


def test_launch_refuses_a_missing_target_module_before_anything_starts(tmp_path: Path) -> None:
    model = tmp_path / "model"
    tiny_hf_model("llama").save_pretrained(model)
    from pipelinerl.models.tiny import build_char_tokenizer

    build_char_tokenizer("ab", model)
    example = Path(__file__).resolve().parent.parent / "examples" / "arithmetic.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "pipelinerl.cli", "train", str(example), f"model.path={model}",
         f"output_dir={tmp_path / 'runs'}", "model.lora.target_modules=[qkv_proj]"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "['qkv_proj'] match no module" in proc.stderr and "'q_proj'" in proc.stderr
    assert not (tmp_path / "runs").exists()
