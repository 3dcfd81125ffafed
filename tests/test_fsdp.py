"""FSDP2 trainer (trainer.strategy=fsdp2) on real gloo process groups of 2 CPU ranks: a step
equals a single process's, weights reach the channel gathered tensor by tensor, and sharded
checkpoints resume on another number of ranks."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from ranks import run_ranks
from tiny_models import VOCAB, tiny_hf_model

from pipelinerl.config import Config, load_config
from pipelinerl.rl.parallel import GatheredWeights, is_sharded, wrap_model
from pipelinerl.rl.process_group import share_groups
from pipelinerl.rl.schedule import make_scheduler
from pipelinerl.rl.step import rl_step
from pipelinerl.run.checkpoint import load_checkpoint, save_checkpoint
from pipelinerl.sync import ShmWeightReceiver, ShmWeightSender
from pipelinerl.types import Group, Sample

torch.set_num_threads(1)
GROUP = 4


def _cfg(*overrides: str) -> Config:
    # fp32 compute and reductions: the comparison with one process is exact up to fp32 sums.
    return load_config(overrides=[
        f"actor.group_size={GROUP}", "trainer.batch_size=16", "trainer.max_tokens_per_row=24",
        "trainer.lr=0.01", "trainer.strategy=fsdp2", "trainer.fsdp.param_dtype=float32",
        "trainer.fsdp.reduce_dtype=float32", *overrides])


def _groups(step: int) -> list[Group]:
    """4 groups; groups 0 and 2 (rank 0's shard of 2) are long, 1 and 3 short, so the ranks
    run different numbers of micro-batches (24 tokens per row)."""
    g = torch.Generator().manual_seed(100 + step)
    groups = []
    for p in range(4):
        samples = []
        for j in range(GROUP):
            n = (9 + 3 * j) if p % 2 == 0 else (1 + j)
            tokens = torch.randint(0, VOCAB, (n,), generator=g).tolist()
            old = (-3.0 + 0.8 * torch.randn(n, generator=g)).tolist()
            reward = float((j + p) % 2)
            samples.append(Sample([1 + p, 2, 3], tokens, old, [step] * n, reward, reward > 0,
                                  "stop", group_id=str(p)))
        groups.append(Group(str(p), "prompt", samples))
    return groups


def _adamw(model: torch.nn.Module) -> torch.optim.AdamW:
    # A large eps: Adam's update g / (|g| + eps) of a near-zero gradient would otherwise turn
    # fp32 summation-order noise (sharded vs whole) into differences of the size of the lr.
    return torch.optim.AdamW(model.parameters(), lr=0.01, eps=1e-3)


def _new_model() -> torch.nn.Module:
    return tiny_hf_model("qwen2", seed=1).train()  # tied embeddings: a shared parameter


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: Config, steps: range,
           rank: int, world: int) -> list[dict[str, Any]]:
    metrics = []
    for step in steps:
        shard = share_groups(_groups(step), rank, world) if world > 1 else _groups(step)
        metrics.append(rl_step(model, optimizer, shard, cfg, step, num_sequences=16))
    return metrics


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full weights by name, gathered tensor by tensor (every rank gets them here)."""
    weights = GatheredWeights(model)
    tensors = [t.clone() for t in weights.tensors()]
    return {p.name: tensors[p.slot] for p in weights.layout.params}


def _two_steps(rank: int, world: int, run_id: str) -> dict[str, Any]:
    """Two steps; then rank 0 publishes the weights through the shared-memory channel while
    the other rank takes part in each tensor's gather; then a bf16 mixed-precision step."""
    cfg = _cfg()
    model = wrap_model(_new_model(), cfg.trainer, "cpu", world)
    metrics = _train(model, _adamw(model), cfg, range(2), rank, world)
    weights = GatheredWeights(model)
    received = None
    if rank == 0:
        sender = ShmWeightSender(run_id)
        sender.publish(weights, version=2)
        receiver = ShmWeightReceiver(run_id)
        received = {k: torch.zeros_like(v) for k, v in _new_model().state_dict().items()}
        assert receiver.receive_into(received) == 2
        receiver.close()
        sender.close()
    else:
        weights.drain()
    return {"weights": _gathered(model), "metrics": metrics, "sharded": is_sharded(model),
            "received": received, "bf16": _bf16_step(rank, world)}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    """One 2-rank run (process start-up is most of its cost) for the tests below."""
    return run_ranks(2, _two_steps, f"test-{uuid.uuid4().hex[:12]}")


def test_two_rank_fsdp2_steps_equal_one_process_and_publish_whole_weights(
        two_ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = two_ranks
    assert rank0["sharded"]
    model = _new_model()
    cfg = _cfg()
    # In one process rl_step takes the whole batch (no group, no sharding).
    expected = _train(model, _adamw(model), cfg, range(2), 0, 1)
    reference = model.state_dict()
    assert rank0["weights"].keys() == reference.keys()
    for name, t in reference.items():
        for rank in (rank0, rank1):
            torch.testing.assert_close(rank["weights"][name], t, atol=2e-6, rtol=1e-5, msg=name)
        # What the channel delivered is exactly the gathered weights.
        assert torch.equal(rank0["received"][name], rank0["weights"][name]), name
    for got, want in zip(rank0["metrics"], expected):
        for key in ("loss", "grad_norm", "tokens", "ess", "lag_mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    # Two AdamW steps at lr 0.01 moved every weight: the comparison is not trivially equal.
    start = _new_model().state_dict()["model.norm.weight"]
    assert not torch.equal(rank0["weights"]["model.norm.weight"], start)


def _bf16_step(rank: int, world: int) -> tuple[dict[str, torch.Tensor], float, set, set]:
    cfg = load_config(overrides=[f"actor.group_size={GROUP}", "trainer.batch_size=16",
                                 "trainer.max_tokens_per_row=24", "trainer.strategy=fsdp2"])
    assert (cfg.trainer.fsdp.param_dtype, cfg.trainer.fsdp.reduce_dtype) == ("bfloat16",) * 2
    model = wrap_model(_new_model(), cfg.trainer, "cpu", world)
    optimizer = _adamw(model)
    (metrics,) = _train(model, optimizer, cfg, range(1), rank, world)
    master = {p.dtype for p in model.parameters()}
    moments = {t.dtype for state in optimizer.state.values() for t in state.values() if t.ndim}
    return _gathered(model), metrics["loss"], master, moments


def test_fsdp2_bf16_mixed_precision_keeps_float32_master_weights(
        two_ranks: list[dict[str, Any]]) -> None:
    weights, loss, master, moments = two_ranks[0]["bf16"]
    assert master == {torch.float32} and moments == {torch.float32}
    model = _new_model()
    cfg = _cfg()
    (expected,) = _train(model, _adamw(model), cfg, range(1), 0, 1)
    # Computed in bf16 (8 bits of mantissa): near the float32 step, not equal to it; the
    # update points the same way.
    assert loss != expected["loss"] and loss == pytest.approx(expected["loss"], abs=0.15)
    start = _new_model().state_dict()
    names = list(start)
    assert all(weights[n].dtype == torch.float32 for n in names)
    update_bf16 = torch.cat([(weights[n] - start[n]).flatten() for n in names])
    update_fp32 = torch.cat([(model.state_dict()[n] - start[n]).flatten() for n in names])
    assert torch.nn.functional.cosine_similarity(update_bf16, update_fp32, dim=0) > 0.9


class _Recorder:
    """A weight sender that keeps what a publish hands it: (layout, tensors) per publish."""

    def __init__(self) -> None:
        self.published: list[tuple[Any, list[torch.Tensor]]] = []

    def publish(self, weights: Any, version: int) -> None:
        self.published.append((weights.layout, [t.clone() for t in weights.tensors()]))


def _load_both_ways(rank: int, world: int, dirs: dict[str, str], broken: str, run_id: str
                    ) -> dict[str, Any]:
    """Each saved model loaded as the trainer loaded it before (whole, then sharded) and as
    it does now (built on the meta device, sharded, then filled by `load_shards`), recording
    which rank read checkpoint tensors and how many; then a Trainer on the meta-loaded model
    (with a sharded KL reference) publishes in the engines' bf16."""
    import transformers

    import pipelinerl.rl.parallel as parallel
    from pipelinerl.models.hf import load_model
    from pipelinerl.rl.parallel import load_shards
    from pipelinerl.roles.trainer import Trainer

    cfg = _cfg()
    reads: list[int] = []  # elements of each checkpoint chunk this rank read
    whole_loads: list[str] = []
    chunks = parallel._checkpoint_chunks

    def counted(model: Any, path: Any, chunk_bytes: Any, world: int) -> list[Any]:
        def count(load: Any) -> Any:
            def run() -> dict[str, torch.Tensor]:
                got = load()
                reads.append(sum(t.numel() for t in got.values()))
                return got
            return run
        return [count(load) for load in chunks(model, path, chunk_bytes, world)]

    def no_whole_load(*args: Any, **kwargs: Any) -> Any:
        whole_loads.append(str(args[:1]))
        raise AssertionError("the sharded load read the whole model")

    parallel._checkpoint_chunks = counted
    ids = torch.tensor([[3, 14, 15, 9, 26, 5], [35, 8, 9, 7, 9, 3]])
    out: dict[str, Any] = {}
    for arch, path in dirs.items():
        real = transformers.AutoModelForCausalLM.from_pretrained
        transformers.AutoModelForCausalLM.from_pretrained = no_whole_load
        try:
            meta = load_model(path, device="meta").train()
            new = load_shards(wrap_model(meta, cfg.trainer, "cpu", world), path,
                              cfg.trainer.fsdp, "cpu", chunk_bytes=20_000)
        finally:
            transformers.AutoModelForCausalLM.from_pretrained = real
        local = sum(p.to_local().numel() for p in new.parameters())
        old = wrap_model(load_model(path).train(), cfg.trainer, "cpu", world)
        logits = []
        for model in (new, old):
            with torch.no_grad():
                logits.append(model(input_ids=ids).logits)
        out[arch] = {"new": _gathered(new), "old": _gathered(old), "logits": logits,
                     "tied": new.lm_head.weight is new.model.embed_tokens.weight,
                     "buffers": {n: b.clone() for n, b in new.named_buffers()},
                     "local": local, "total": sum(p.numel() for p in new.parameters()),
                     "reads": list(reads)}
        reads.clear()
    out["whole_loads"] = whole_loads
    try:  # a checkpoint without one of the model's tensors: refused on every rank alike
        load_shards(wrap_model(load_model(broken, device="meta"), cfg.trainer, "cpu", world),
                    broken, cfg.trainer.fsdp, "cpu")
        out["refusal"] = "no error"
    except ValueError as e:
        out["refusal"] = str(e)
    # The trainer's publish: the engines run bf16.
    path = dirs["qwen2"]
    tcfg = _cfg(f"model.path={path}", "engine.dtype=bfloat16", "trainer.loss.kl_coef=0.1")
    model = load_shards(wrap_model(load_model(path, device="meta").train(), tcfg.trainer, "cpu",
                                   world), path, tcfg.trainer.fsdp, "cpu")
    sender = _Recorder() if rank == 0 else None
    trainer = Trainer(tcfg, model, None, sender)
    out["ref_frozen"] = not any(p.requires_grad for p in trainer.ref_model.parameters())
    with torch.no_grad():
        out["ref_logits"] = trainer.ref_model(input_ids=ids).logits
    trainer.publish()
    out["trainer_reads"] = reads  # the trained model's and the reference's, default chunks
    out["fp32"] = _gathered(model)
    if sender is not None:
        ((layout, tensors),) = sender.published
        out["published"] = {p.name: (p.dtype, tensors[p.slot]) for p in layout.params}
        # Through the shared-memory channel into a bf16 engine's and a float32 engine's tensors.
        channel = ShmWeightSender(run_id)
        channel.publish(GatheredWeights(model, dtype=torch.bfloat16), version=1)
        receiver = ShmWeightReceiver(run_id)
        start = tiny_hf_model("qwen2", seed=1).state_dict()
        out["received"] = {}
        for dtype in (torch.bfloat16, torch.float32):
            targets = {k: torch.zeros_like(v, dtype=dtype) for k, v in start.items()}
            assert receiver.receive_into(targets) == 1
            out["received"][dtype] = targets
        receiver.close()
        channel.close()
    else:
        # The other rank took part in the channel's gathers.
        GatheredWeights(model, dtype=torch.bfloat16).drain()
    return out


@pytest.fixture(scope="module")
def loaded_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], dict]:
    """A tied (qwen2) and an untied (llama) model, the llama one saved in several safetensors
    files (an index), loaded both ways on 2 ranks."""
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for arch, shard_size in (("qwen2", None), ("llama", "100KB")):
        dirs[arch] = str(root / arch)
        kwargs = {"max_shard_size": shard_size} if shard_size else {}
        tiny_hf_model(arch, seed=1).save_pretrained(dirs[arch], **kwargs)
    assert (root / "llama" / "model.safetensors.index.json").exists()
    from safetensors.torch import load_file, save_file

    broken = root / "broken"
    tiny_hf_model("qwen2", seed=1).save_pretrained(broken)
    state = load_file(broken / "model.safetensors")
    del state["model.norm.weight"]
    save_file(state, broken / "model.safetensors", metadata={"format": "pt"})
    return run_ranks(2, _load_both_ways, dirs, str(broken), f"test-{uuid.uuid4().hex[:12]}"), dirs


def test_meta_device_load_gives_the_same_model_and_only_rank0_reads_weights(
        loaded_ranks: tuple[list[dict[str, Any]], dict]) -> None:
    from pipelinerl.models.hf import load_model

    ranks, dirs = loaded_ranks
    ids = torch.tensor([[3, 14, 15, 9, 26, 5], [35, 8, 9, 7, 9, 3]])
    for arch, path in dirs.items():
        whole = load_model(path)
        with torch.no_grad():
            want = whole(input_ids=ids).logits
        for rank in ranks:
            got = rank[arch]
            assert got["new"].keys() == got["old"].keys() == whole.state_dict().keys()
            for name, t in whole.state_dict().items():
                assert torch.equal(got["new"][name], t), (arch, name)
                assert torch.equal(got["old"][name], t), (arch, name)
            # The sharded model computes what the old sharded load and the whole model do.
            new_logits, old_logits = got["logits"]
            assert torch.equal(new_logits, old_logits), arch
            torch.testing.assert_close(new_logits, want, atol=1e-5, rtol=1e-5)
            assert got["tied"] == (arch == "qwen2")  # lm_head = embed_tokens stays one tensor
            # Buffers outside the checkpoint (rotary inv_freq) kept their computed values.
            whole_buffers = dict(whole.named_buffers())
            assert got["buffers"].keys() == whole_buffers.keys() and got["buffers"]
            for name, b in got["buffers"].items():
                assert torch.equal(b, whole_buffers[name]), (arch, name)
            # Each rank holds about half the parameters (FSDP2 pads the last shard).
            assert got["local"] <= got["total"] // 2 + 2048, arch
    rank0, rank1 = ranks
    for rank in ranks:
        assert "lacks 1 of the model's tensors: ['model.norm.weight']" in rank["refusal"]
    # No rank built the model from the whole checkpoint; rank 0 alone read tensors, the
    # whole checkpoint once per load, a chunk of at most 20 kB (5,000 float32) at a time
    # unless one tensor is larger (by default: half the checkpoint, on 2 ranks).
    assert rank0["whole_loads"] == rank1["whole_loads"] == []
    assert rank1["trainer_reads"] == [] and all(rank1[arch]["reads"] == [] for arch in dirs)
    for arch, path in dirs.items():
        # Tied: lm_head.weight is saved once, as embed_tokens.
        state = {n: t for n, t in load_model(path).state_dict().items()
                 if not (arch == "qwen2" and n == "lm_head.weight")}
        reads = rank0[arch]["reads"]
        assert sum(reads) == sum(t.numel() for t in state.values()), arch
        largest = max(t.numel() for t in state.values())
        assert len(reads) > 3 and all(n <= max(5_000, largest) for n in reads), (arch, reads)
    # The trainer's model and its KL reference, each in chunks of half the checkpoint.
    qwen2 = sum(rank0["qwen2"]["reads"])
    assert sum(rank0["trainer_reads"]) == 2 * qwen2 and len(rank0["trainer_reads"]) >= 4
    largest = max(t.numel() for t in load_model(dirs["qwen2"]).state_dict().values())
    assert max(rank0["trainer_reads"]) <= max(-(-qwen2 // 2), largest)


def test_fsdp2_publishes_in_the_engine_dtype(
        loaded_ranks: tuple[list[dict[str, Any]], dict]) -> None:
    from pipelinerl.models.hf import load_model

    ranks, dirs = loaded_ranks
    rank0 = ranks[0]
    fp32 = rank0["fp32"]
    assert {t.dtype for t in fp32.values()} == {torch.float32}  # the master weights
    # The trainer (engine.dtype=bfloat16) published bf16: layout and tensors, each exactly
    # the float32 master weight rounded to bf16.
    assert rank0["published"].keys() == fp32.keys()
    for name, (dtype, t) in rank0["published"].items():
        assert dtype == t.dtype == torch.bfloat16, name
        assert torch.equal(t, fp32[name].to(torch.bfloat16)), name
    # The actors load them: into bf16 tensors exactly, into float32 ones widened.
    for dtype, targets in rank0["received"].items():
        for name, t in targets.items():
            assert t.dtype == dtype
            assert torch.equal(t, fp32[name].to(torch.bfloat16).to(dtype)), name
    # The sharded KL reference (built on the meta device too) is the starting model.
    with torch.no_grad():
        want = load_model(dirs["qwen2"])(input_ids=torch.tensor(
            [[3, 14, 15, 9, 26, 5], [35, 8, 9, 7, 9, 3]])).logits
    for rank in ranks:
        assert rank["ref_frozen"]
        torch.testing.assert_close(rank["ref_logits"], want, atol=1e-5, rtol=1e-5)


def _save_after_one_step(rank: int, world: int, run_dir: str) -> dict[str, torch.Tensor]:
    cfg = _cfg()
    model = wrap_model(_new_model(), cfg.trainer, "cpu", world)
    optimizer = _adamw(model)
    scheduler = make_scheduler(optimizer, cfg.trainer)
    _train(model, optimizer, cfg, range(1), rank, world)
    scheduler.step()
    save_checkpoint(Path(run_dir), 1, model, _NoTokenizer(), optimizer, scheduler,
                    {"marker": rank}, keep=2)
    # And on, without a resume: the weights after step 2.
    _train(model, optimizer, cfg, range(1, 2), rank, world)
    return _gathered(model)


def _resume_and_step(rank: int, world: int, checkpoint: str, ddp_checkpoint: str
                     ) -> tuple[dict[str, torch.Tensor], dict, str]:
    cfg = _cfg()
    model = wrap_model(_new_model(), cfg.trainer, "cpu", world)
    optimizer = _adamw(model)
    scheduler = make_scheduler(optimizer, cfg.trainer)
    try:
        load_checkpoint(Path(ddp_checkpoint), model, optimizer, scheduler)
        refusal = "no error"
    except ValueError as e:
        refusal = str(e)
    state = load_checkpoint(Path(checkpoint), model, optimizer, scheduler)
    _train(model, optimizer, cfg, range(1, 2), rank, world)
    return _gathered(model), state, refusal


class _NoTokenizer:
    def save_pretrained(self, path: str) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)


def test_sharded_checkpoint_resumes_on_another_number_of_ranks(tmp_path: Path) -> None:
    uninterrupted, _ = run_ranks(2, _save_after_one_step, str(tmp_path))
    checkpoint = tmp_path / "checkpoints" / "step_00000001"
    assert (checkpoint / "dcp" / ".metadata").exists() and (checkpoint / "state.json").exists()
    assert not list((checkpoint / "model").glob("*.safetensors"))  # the weights are in dcp/
    model = _new_model()  # and a DDP (whole-model) checkpoint, which FSDP2 must refuse
    optimizer = _adamw(model)
    ddp = save_checkpoint(tmp_path / "ddp", 1, model, _NoTokenizer(), optimizer,
                          make_scheduler(optimizer, _cfg().trainer), {}, keep=1)
    # One rank resumes the 2-rank checkpoint (weights and AdamW moments resharded) and its
    # next step lands where the 2 ranks went on without stopping.
    (resumed, state, refusal), = run_ranks(1, _resume_and_step, str(checkpoint), str(ddp))
    assert state["step"] == 1 and state["marker"] == 0  # rank 0's state.json
    for name, t in uninterrupted.items():
        torch.testing.assert_close(resumed[name], t, atol=2e-6, rtol=1e-5, msg=name)
    assert "written with trainer.strategy=ddp" in refusal and "runs fsdp2" in refusal


def test_fsdp2_config_rules() -> None:
    with pytest.raises(Exception, match="LoRA"):
        load_config(overrides=["trainer.strategy=fsdp2", "model.lora.rank=4"])
    with pytest.raises(Exception, match="cpu_offload"):
        load_config(overrides=["trainer.strategy=fsdp2", "trainer.fsdp.cpu_offload=true"])


@pytest.mark.slow
def test_cli_fsdp2_run_on_two_ranks_extended_on_one(tmp_path: Path, warm_cache: Path) -> None:
    """Through the CLI: 2 FSDP2 trainer ranks (torchrun) train and checkpoint; a resume that
    changes the batch shape is refused; `--resume` extends the finished run on 1 rank from the
    sharded checkpoint; the audit finds every group trained once and the final model loads
    with Hugging Face. (A DDP run resumed from a crash: tests/test_reliability.py.)"""
    import json
    import re
    import subprocess
    import sys

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    example = Path(__file__).resolve().parents[1] / "examples" / "arithmetic.yaml"
    run_dir = tmp_path / "runs" / "fsdp"
    args = ["name=fsdp", f"output_dir={tmp_path / 'runs'}", f"warmstart.cache_dir={warm_cache}",
            "warmstart.steps=20", "eval.enabled=false", "engine.capacity=16", "actor.group_size=4",
            "trainer.batch_size=16", "metrics.progress=false", "metrics.plot=false",
            "trainer.strategy=fsdp2", "trainer.checkpoint_every_steps=3",
            "trainer.packed_attention=per_sequence",  # what a long-context user would pick
            # The entropy bonus moves the weights even when no group's rewards differ.
            "trainer.loss.entropy_coef=0.01", "trainer.lr=1e-3"]

    def train(*extra: str, ok: bool = True) -> str:
        out = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "train", str(example),
                              *args, *extra], capture_output=True, text=True, timeout=400)
        assert (out.returncode == 0) == ok, out.stderr[-4000:]
        return out.stderr

    train("trainer.max_steps=4", "trainer.num_procs=2")
    assert (run_dir / "checkpoints" / "step_00000004" / "dcp" / ".metadata").exists()
    # A resume that changes the batch shape is refused before anything starts, naming it.
    err = train("trainer.max_steps=7", "trainer.batch_size=32", "--resume", ok=False)
    assert "trainer.batch_size: 16 then, 32 now" in err
    train("trainer.max_steps=7", "trainer.num_procs=1", "--resume")
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 8))
    out = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "audit", str(run_dir)],
                         capture_output=True, text=True, timeout=120)
    counts = re.search(r"trained (\d+) dropped \d+ lost (\d+) duplicated (\d+)", out.stdout)
    assert counts and counts.groups() == ("28", "0", "0") and out.returncode == 0, out.stdout
    # final/ (gathered to rank 0) holds what the last sharded checkpoint holds, and it trained.
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final").state_dict()
    start_dir = load_config(run_dir / "config.yaml").model.path  # the warm-started model
    start = AutoModelForCausalLM.from_pretrained(start_dir).state_dict()
    dcp_to_torch_save(run_dir / "checkpoints" / "step_00000007" / "dcp", tmp_path / "last.pt")
    last = torch.load(tmp_path / "last.pt", weights_only=False)["model"]
    for name, t in last.items():
        assert torch.equal(final[name], t), name
    assert not torch.equal(final["model.norm.weight"], start["model.norm.weight"])


def test_activation_checkpointing_gives_the_same_step() -> None:
    """trainer.activation_checkpointing recomputes each layer in the backward pass: the same
    loss and gradients, fewer activations kept."""
    grads = []
    for on in (False, True):
        cfg = load_config(overrides=[f"actor.group_size={GROUP}", "trainer.batch_size=16",
                                     "trainer.max_tokens_per_row=24",
                                     f"trainer.activation_checkpointing={str(on).lower()}"])
        model = wrap_model(_new_model(), cfg.trainer, "cpu", 1)
        calls = []
        model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
        metrics = rl_step(model, torch.optim.SGD(model.parameters(), lr=0.0), _groups(0), cfg, 0)
        grads.append((metrics["loss"], [p.grad.clone() for p in model.parameters()], len(calls)))
    (loss_off, off, calls_off), (loss_on, on_, calls_on) = grads
    assert calls_on == 2 * calls_off  # each micro-batch's layer ran again in the backward
    assert loss_on == pytest.approx(loss_off, rel=1e-6)
    for a, b in zip(off, on_):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_scaling_doc_shows_the_estimates_table() -> None:
    """docs/scaling.md's memory table is what docs/memory_estimate.py computes."""
    import importlib.util
    import re
    import sys

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("memory_estimate", root / "docs" / "memory_estimate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["memory_estimate"] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    doc = (root / "docs" / "scaling.md").read_text()
    shown = re.search(r"<!-- memory-table -->\n(.*?)\n<!-- /memory-table -->", doc, re.S)
    assert shown and shown.group(1) == module.table()
    # Spot-check the arithmetic: 16 bytes per parameter under DDP, a 64th of it under FSDP2 x64.
    seven = next(m for m in module.MODELS if m.name == "7B")
    assert abs(seven.params - 7.62e9) < 0.01e9  # Qwen2.5-7B's published size
    state = module.per_gpu(seven, "ddp", 1) - module.activations(seven, 4, False)
    assert state == 16 * seven.params
