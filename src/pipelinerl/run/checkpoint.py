"""Trainer checkpoints: what a resumed run needs to continue as if it had never stopped.

    <run_dir>/checkpoints/step_00000123/
      model/       the weights, Hugging Face layout (safetensors, config, tokenizer)
      trainer.pt   optimizer and lr-schedule state, RNG states
      state.json   step, counters, stream-reader offsets, groups read but not yet trained,
                   drop counters, places given back to each actor, the clock

A checkpoint is written into `.step_<N>.tmp`, every file fsynced, then renamed: a directory
named `step_*` is complete, and a crash mid-write leaves only a `.tmp` that is never loaded
(and is removed by the next save). A save of a step that has a checkpoint already moves the
old one aside to `.step_<N>.old` before renaming the new one in, and deletes it only then: a
crash between the two renames leaves the old one there, and it is step N's checkpoint until a
complete `step_<N>` exists. The newest `keep` are kept.

A sharded trainer (`trainer.strategy=fsdp2`) writes the same content in another form:

      dcp/         weights and AdamW state, `torch.distributed.checkpoint` shards (every rank
                   writes its own; a resume on any number of ranks reshards them)
      model/       config and tokenizer only
      trainer.pt   lr-schedule state, RNG states (no optimizer: it is in dcp/)
      state.json   as above

Every rank calls save and load then (rank 0 alone writes trainer.pt and state.json, creates,
fsyncs and renames the directory); the checkpoint directory must be on a file system every
trainer rank sees. A checkpoint resumes under the strategy that wrote it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipelinerl.models.lora import ADAPTER_DIR, is_lora, load_adapter, to_save
from pipelinerl.rl.parallel import is_sharded

log = logging.getLogger(__name__)

DIR = "checkpoints"
_NAME = re.compile(r"^step_\d{8}$")
_ASIDE = re.compile(r"^\.(step_\d{8})\.old$")


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / DIR


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first, one per step: `step_N`, else a `.step_N.old` that a
    save replacing it left when it was cut short (a `.tmp` directory is never one)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    complete = [p for p in root.iterdir() if (p / "state.json").exists()]
    found = {m[1]: p for p in complete if (m := _ASIDE.match(p.name))}
    found.update({p.name: p for p in complete if _NAME.match(p.name)})
    return [found[step] for step in sorted(found)]


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of the complete checkpoints, oldest first (read from their names)."""
    return [int(p.name.strip(".").removesuffix(".old").removeprefix("step_"))
            for p in complete_checkpoints(run_dir)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def agreed_latest_checkpoint(run_dir: Path) -> Path | None:
    """Rank 0's newest checkpoint, on every rank of the trainer's group: on a shared file
    system with attribute caching, ranks listing the directory themselves can see different
    newest ones (DDP replicas would diverge silently, FSDP2 would load a mix of two steps)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return latest_checkpoint(run_dir)
    choice = [latest_checkpoint(run_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    return choice[0]


def rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module, tokenizer: Any,
                    optimizer: torch.optim.Optimizer, scheduler: Any, state: dict[str, Any],
                    keep: int, protect: Path | None = None) -> Path:
    """Write checkpoint `step` atomically and keep the newest `keep`, and `protect` (one an
    older resume needs: deterministic mode's newest paired with an actor snapshot); returns
    its directory. With a sharded model every rank calls it (`state` matters on rank 0 only)."""
    sharded = is_sharded(model)
    main = not sharded or dist.get_rank() == 0
    root = checkpoint_dir(run_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f".{final.name}.tmp"
    if main:
        root.mkdir(parents=True, exist_ok=True)
        # A crash mid-write left a .tmp, never complete; one mid-replace a .old, superseded
        # once its step_N is complete.
        live = complete_checkpoints(run_dir)
        for stale in [*root.glob(".step_*.tmp"), *root.glob(".step_*.old")]:
            if stale not in live:
                shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    try:
        if sharded:
            dist.barrier()  # the directory exists, and no rank writes before the cleanup
            _save_shards(model, optimizer, tmp / SHARDS)
        if main:
            trainer_state = {"scheduler": scheduler.state_dict(), "rng": rng_states()}
            if sharded:
                model.config.save_pretrained(str(tmp / "model"))
            else:
                # Hugging Face layout; with LoRA the merged model, and the adapter a resume loads.
                to_save(model, tmp / ADAPTER_DIR).save_pretrained(str(tmp / "model"))
                trainer_state["optimizer"] = optimizer.state_dict()
            tokenizer.save_pretrained(str(tmp / "model"))
            torch.save(trainer_state, tmp / "trainer.pt")
            (tmp / "state.json").write_text(json.dumps({"step": step, **state}))
            _fsync_tree(tmp)
    except BaseException:  # KeyboardInterrupt too: a stopped trainer leaves no partial copy
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if main:
        # The same step again (a resumed run's last one) replaces it whole; the old copy is
        # deleted only once the new one is in place and durable, so a crash never leaves the
        # step without a complete checkpoint (complete_checkpoints finds the one aside).
        aside = root / f".{final.name}.old"
        if final.exists():
            final.rename(aside)
        tmp.rename(final)
        _fsync(root)
        shutil.rmtree(aside, ignore_errors=True)
        for old in complete_checkpoints(run_dir)[:-keep]:
            if old != protect:
                shutil.rmtree(old, ignore_errors=True)
    if sharded:
        dist.barrier()  # no rank goes on (or loads it) before it is complete
    return final


SHARDS = "dcp"


def _save_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))


def _load_shards(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))  # into this run's shards, whatever the old ranks
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any) -> dict[str, Any]:
    """Restore weights, optimizer, lr schedule and RNG from `path`; returns its state.json."""
    from safetensors.torch import load_file

    target = getattr(model, "module", model)
    if is_sharded(model) != (path / SHARDS).is_dir():
        written, now = ("fsdp2", "ddp") if (path / SHARDS).is_dir() else ("ddp", "fsdp2")
        raise ValueError(f"checkpoint {path} was written with trainer.strategy={written}; this "
                         f"trainer runs {now}: resume with the strategy that wrote it")
    if is_sharded(model):
        _load_shards(model, optimizer, path / SHARDS)
    elif is_lora(target):  # the base weights are the starting model's, frozen
        load_adapter(target, path / ADAPTER_DIR)
    else:
        weights: dict[str, torch.Tensor] = {}
        for shard in sorted((path / "model").glob("*.safetensors")):
            weights.update(load_file(shard))
        missing, unexpected = target.load_state_dict(weights, strict=False)
        # Tied weights are stored once (lm_head = embed_tokens): only those may be missing.
        tied = set(getattr(target, "_tied_weights_keys", None) or [])
        if unexpected or any(k not in tied for k in missing):
            raise ValueError(f"checkpoint {path} does not fit the model: missing {missing}, "
                             f"unexpected {unexpected}")
    trainer = torch.load(path / "trainer.pt", weights_only=False)
    if not is_sharded(model):
        optimizer.load_state_dict(trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    set_rng_states(trainer["rng"])
    return json.loads((path / "state.json").read_text())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Every file, then every directory, so the rename publishes data already on disk."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            _fsync(Path(dirpath) / name)
        _fsync(Path(dirpath))


class CheckpointDue:
    """When the next checkpoint is due (trainer.checkpoint_every_steps / _every_s). `aligned`:
    the step rule checkpoints at multiples of every_steps, whatever checkpoints the clock added
    (deterministic mode: the actor snapshots at those versions, and a resume pairs the two)."""

    def __init__(self, every_steps: int, every_s: float, step: int = 0,
                 aligned: bool = False) -> None:
        self.every_steps, self.every_s, self.aligned = every_steps, every_s, aligned
        self.last_step, self.last_time = step, time.monotonic()

    def __call__(self, step: int) -> bool:
        if self.aligned:
            steps = self.every_steps and step % self.every_steps == 0
        else:
            steps = self.every_steps and step - self.last_step >= self.every_steps
        seconds = self.every_s and time.monotonic() - self.last_time >= self.every_s
        return step > self.last_step and bool(steps or seconds)

    def done(self, step: int) -> None:
        self.last_step, self.last_time = step, time.monotonic()


def read_state(path: Path | None) -> dict[str, Any] | None:
    return None if path is None else json.loads((path / "state.json").read_text())
