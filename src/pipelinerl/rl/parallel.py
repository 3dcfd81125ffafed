"""How the trainer's model is laid over its ranks (`trainer.strategy`, docs/scaling.md).

ddp:   every rank holds the whole model and AdamW state; gradients are all-reduced
       (DistributedDataParallel). 16 bytes per parameter on every rank.
fsdp2: parameters, gradients and AdamW state are sharded over the ranks (`fully_shard` on each
       decoder layer, then the root); a layer's full weights exist only while it runs. Mixed
       precision casts the gathered weights (and the gradient reduction) to bf16 while the
       shards, the master weights, stay float32. The model is built on the meta device and
       sharded before any weight exists; each rank then receives only its shards from rank 0
       (`load_shards`), so no rank ever holds the whole float32 model.

What fsdp2 changes for the rest of the trainer: gathering full weights is a collective, so
publishing weights, saving the final model and checkpoints run on every rank in the same order
(rank 0 sends and writes); and every forward pass is a collective, so every rank runs the same
number of micro-batches (`pipelinerl.rl.step` pads a rank short of them with empty passes).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from pipelinerl.config import FsdpConfig, TrainerConfig
from pipelinerl.sync.layout import ParamSpec, WeightLayout

log = logging.getLogger(__name__)


def wrap_model(model: torch.nn.Module, tc: TrainerConfig, device: str, world: int
               ) -> torch.nn.Module:
    """The trainer's model under `tc.strategy` (a single process with ddp: the model itself)."""
    if tc.activation_checkpointing:
        # Non-reentrant: works with parameters gathered on the fly and with no_sync. (The
        # method's name before transformers 5.2x: gradient_checkpointing_enable.)
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if tc.strategy == "fsdp2":
        return shard_model(model, tc.fsdp, device)
    if world > 1:
        return torch.nn.parallel.DistributedDataParallel(model)
    return model


def _mesh(device: str) -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("trainer.strategy=fsdp2 needs a process group (`init_distributed` "
                           "makes one, a single-rank one too)")
    return init_device_mesh(torch.device(device).type, (dist.get_world_size(),))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules of Hugging Face's `_no_split_modules` classes."""
    units = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in units]


def shard_model(model: torch.nn.Module, fc: FsdpConfig, device: str) -> torch.nn.Module:
    """`fully_shard` on every decoder layer (Hugging Face's `_no_split_modules` classes), then
    on the root (embeddings, final norm, head). In place; returns the model."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"trainer.strategy=fsdp2: {type(model).__name__} names no decoder-layer "
                         "class (_no_split_modules) to shard by; use trainer.strategy=ddp")
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, fc.param_dtype),
                              reduce_dtype=getattr(torch, fc.reduce_dtype))
    options: dict[str, Any] = {"mesh": _mesh(device), "mp_policy": mp}
    if fc.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def shard_frozen(model: torch.nn.Module, fc: FsdpConfig, device: str) -> torch.nn.Module:
    """A frozen model (the KL reference) sharded like the trained one: its forward passes
    then run in step with the trained model's on every rank."""
    return shard_model(model.requires_grad_(False), fc, device)


def load_shards(model: torch.nn.Module, path: str | Path, fc: FsdpConfig, device: str,
                chunk_bytes: int | None = None) -> torch.nn.Module:
    """Fill a model built on the meta device (`load_model(path, device="meta")`) and then
    sharded (`shard_model`) with the weights at `path`, so that no rank ever holds the whole
    model: each rank allocates its own shards (float32), rank 0 reads the safetensors files a
    chunk of tensors at a time (in their stored dtype), and torch's
    `set_model_state_dict(broadcast_from_rank0=True)` broadcasts each tensor, of which every
    rank keeps its slice. `chunk_bytes` (None: the checkpoint's size over the ranks, at most
    1 GiB): what rank 0 holds at once, a larger tensor alone.

    Peak host memory (CPU shards): a rank's shards (4 bytes per parameter / N) plus one
    tensor being broadcast; rank 0 plus one chunk; against the whole float32 model on every
    rank before. A collective: every rank calls it. Every rank reads the files' headers and
    checks them against the model before the first broadcast, so a checkpoint that does not
    fit fails on every rank alike. In place; returns the model."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )

    chunks = _checkpoint_chunks(model, Path(path), chunk_bytes, dist.get_world_size())
    # Buffers are real (computed when the model was built; FSDP2 moved them to the device);
    # those the checkpoint lacks (rotary inv_freq) are put back after to_empty, which
    # replaces every tensor by an uninitialised one.
    buffers = dict(model.named_buffers(remove_duplicate=False))
    home = "cpu" if fc.cpu_offload else device  # where FSDP2 keeps the shards
    model.to_empty(device=torch.device(home))
    for name, value in buffers.items():
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, value)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    rank0 = dist.get_rank() == 0
    for chunk in chunks:
        state = chunk() if rank0 else {}
        set_model_state_dict(model, state, options=options)
        del state
    return model


def _checkpoint_chunks(model: torch.nn.Module, path: Path, chunk_bytes: int | None, world: int
                       ) -> list[Callable[[], dict[str, torch.Tensor]]]:
    """The checkpoint at `path` as loaders of at most `chunk_bytes` of tensors each (a larger
    tensor alone; None: the checkpoint's bytes / `world`, at most 1 GiB), covering every
    parameter and persistent buffer of `model` (tied names: one of them suffices). A
    directory without safetensors files: one chunk, the whole model loaded (on rank 0)."""
    from safetensors import safe_open

    objects = _state_objects(model)
    wanted = {name: id(objects[name]) for name in model.state_dict().keys()}
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:  # another format (.bin): rank 0 loads the whole model as before, once
        from pipelinerl.models.hf import load_model

        return [lambda: load_model(path, dtype=torch.float32, device="cpu").state_dict()]
    tensors: list[tuple[Path, str, int]] = []  # (file, name, bytes) in file order
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key not in wanted:  # as from_pretrained: a stale or unused key is skipped
                    log.warning("checkpoint tensor %r (%s) is not in the model; skipped",
                                key, file.name)
                    continue
                piece = f.get_slice(key)
                size = math.prod(piece.get_shape()) * _SAFETENSORS_BYTES.get(piece.get_dtype(), 4)
                tensors.append((file, key, size))
    covered = {wanted[key] for _, key, _ in tensors}
    missing = sorted(name for name, obj in wanted.items() if obj not in covered)
    if missing:
        raise ValueError(f"the checkpoint at {str(path)!r} lacks {len(missing)} of the model's "
                         f"tensors: {missing[:5]}")
    if chunk_bytes is None:
        chunk_bytes = min(1 << 30, -(-sum(size for *_, size in tensors) // world))
    plan: list[tuple[Path, list[str]]] = []
    held = 0
    for file, key, size in tensors:
        if not plan or plan[-1][0] != file or held + size > chunk_bytes:
            plan.append((file, []))
            held = 0
        plan[-1][1].append(key)
        held += size

    def loader(file: Path, keys: list[str]) -> Callable[[], dict[str, torch.Tensor]]:
        def load() -> dict[str, torch.Tensor]:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                return {key: f.get_tensor(key) for key in keys}
        return load

    return [loader(file, keys) for file, keys in plan]


_SAFETENSORS_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2,
                      "BF16": 2, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                      "F8_E4M3": 1, "F8_E5M2": 1}


def _state_objects(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by state-dict name; tied names map to one object."""
    return {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def full_tensor(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A parameter's whole value: a sharded one gathered from every rank (a collective).
    `dtype`: cast to it first (floating tensors only), so a sharded one is gathered in it
    (cast, then gather, equals gather, then cast: the cast is elementwise)."""
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        t = t.detach().to(dtype)  # a DTensor's shard is cast where it lies
    if not isinstance(t, DTensor):
        return t.detach()
    local = t.to_local()
    mesh_device = torch.device(t.device_mesh.device_type)
    if local.device.type != mesh_device.type:  # offloaded shards: gather on the mesh's device
        t = DTensor.from_local(local.to(mesh_device), t.device_mesh, t.placements,
                               shape=t.shape, stride=t.stride())
    return t.full_tensor().detach()


class GatheredWeights:
    """A sharded model's weights as `StreamedWeights` (`pipelinerl.sync.base`): each tensor is
    gathered when the sender asks for it, so no rank ever holds the whole model. Every trainer
    rank walks `tensors()` (rank 0 through its sender, the others with `drain`), because each
    gather is a collective.

    A sender may need to walk again (a broadcast cut by a dead receiver is sent anew): within
    `lead()` on rank 0, every walk is announced to the other ranks, which `follow()` until
    rank 0 leaves it; the weights are then `replayable`.

    `dtype` (the engines' `engine.dtype`): floating tensors are cast to it shard by shard before
    their gather, so a bf16 engine gets bf16 weights (half the float32 master's bytes gathered,
    sent and held by the channel); the actors would cast them on receipt anyway."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype
        self._leading = False
        self._walk: Iterator[torch.Tensor] | None = None  # rank 0's latest walk, when leading
        # A forward without a backward leaves the root's weights gathered (FSDP2 keeps the
        # root unsharded after its forward): register the shards again, or the names below
        # would hold views into a buffer that the next gather frees.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        # The state dict's names (Hugging Face's); tied names share one parameter object.
        objects = _state_objects(model)
        slot_of: dict[int, int] = {}
        params, self._slots = [], []
        for name in model.state_dict().keys():
            obj = objects[name]
            if id(obj) not in slot_of:
                slot_of[id(obj)] = len(self._slots)
                self._slots.append(obj)
            sent = dtype if dtype is not None and obj.is_floating_point() else obj.dtype
            params.append(ParamSpec(name, tuple(obj.shape), sent, slot_of[id(obj)]))
        self.layout = WeightLayout(params)
        first = self._slots[0] if self._slots else torch.empty(0)
        self.device = (torch.device(first.device_mesh.device_type) if isinstance(first, DTensor)
                       else first.device)

    @property
    def replayable(self) -> bool:
        """Whether `tensors()` may be walked again: only when the other ranks follow."""
        return self._leading

    def tensors(self) -> Iterator[torch.Tensor]:
        if not self._leading:
            return self._gathered()
        self._finish_walk()
        self._announce(True)
        self._walk = self._gathered()
        return self._walk

    @torch.no_grad()
    def _gathered(self) -> Iterator[torch.Tensor]:
        for obj in self._slots:
            yield full_tensor(obj, self.dtype)

    def drain(self) -> None:
        """A rank without the sender takes part in every gather of one walk."""
        for _ in self._gathered():
            pass

    @contextmanager
    def lead(self) -> Iterator[GatheredWeights]:
        """Rank 0, around its sender's publish: each walk of `tensors()` is announced to the
        other ranks (`follow`), so the sender may walk again. On leaving, even by an error, a
        walk cut short is finished (the others are in its gathers) and the others are let go."""
        self._leading = True
        try:
            yield self
        finally:
            self._leading = False
            self._finish_walk()
            self._announce(False)

    def follow(self) -> None:
        """Every rank but 0, while rank 0 leads: take part in each walk it announces."""
        while self._announce(None):
            self.drain()

    def _finish_walk(self) -> None:
        if self._walk is not None:
            for _ in self._walk:
                pass
            self._walk = None

    def _announce(self, walk: bool | None) -> bool:
        """Rank 0's word (`walk`; None on the other ranks) on whether another walk follows."""
        flag = torch.tensor([float(bool(walk))], device=self.device)  # NCCL: a device tensor
        dist.broadcast(flag, src=0)
        return bool(flag.item())


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model on rank 0's CPU, gathered tensor by tensor (a collective; the other
    ranks get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


def idle_pass(model: torch.nn.Module, device: torch.device, backward: bool) -> None:
    """A forward (and backward) over one token that changes nothing: it takes a rank with no
    micro-batch left through the collectives the others' micro-batch runs (FSDP2's gathers
    and reduce-scatters, DDP's all-reduce)."""
    out = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    if backward:
        (out.logits.sum() * 0.0).backward()
