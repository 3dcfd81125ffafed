"""How the trainer's model is laid over its ranks (`trainer.strategy`, docs/scaling.md).

ddp:   every rank holds the whole model and AdamW state; gradients are all-reduced
       (DistributedDataParallel). 16 bytes per parameter on every rank.
fsdp2: parameters, gradients and AdamW state are sharded over the ranks (`fully_shard` on each
       decoder layer, then the root); a layer's full weights exist only while it runs. Mixed
       precision casts the gathered weights (and the gradient reduction) to bf16 while the
       shards, the master weights, stay float32.

What fsdp2 changes for the rest of the trainer: gathering full weights is a collective, so
publishing weights, saving the final model and checkpoints run on every rank in the same order
(rank 0 sends and writes); and every forward pass is a collective, so every rank runs the same
number of micro-batches (`pipelinerl.rl.step` pads a rank short of them with empty passes).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from pipelinerl.config import FsdpConfig, TrainerConfig
from pipelinerl.sync.layout import ParamSpec, WeightLayout


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


def shard_model(model: torch.nn.Module, fc: FsdpConfig, device: str) -> torch.nn.Module:
    """`fully_shard` on every decoder layer (Hugging Face's `_no_split_modules` classes), then
    on the root (embeddings, final norm, head). In place; returns the model."""
    units = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in units]
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


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value: a sharded one gathered from every rank (a collective)."""
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
    gather is a collective."""

    def __init__(self, model: torch.nn.Module) -> None:
        # The state dict's names (Hugging Face's); tied names share one parameter object.
        objects = {**dict(model.named_parameters(remove_duplicate=False)),
                   **dict(model.named_buffers(remove_duplicate=False))}
        slot_of: dict[int, int] = {}
        params, self._slots = [], []
        for name in model.state_dict().keys():
            obj = objects[name]
            if id(obj) not in slot_of:
                slot_of[id(obj)] = len(self._slots)
                self._slots.append(obj)
            params.append(ParamSpec(name, tuple(obj.shape), obj.dtype, slot_of[id(obj)]))
        self.layout = WeightLayout(params)
        first = self._slots[0] if self._slots else torch.empty(0)
        self.device = (torch.device(first.device_mesh.device_type) if isinstance(first, DTensor)
                       else first.device)

    @torch.no_grad()
    def tensors(self) -> Iterator[torch.Tensor]:
        for obj in self._slots:
            yield full_tensor(obj)

    def drain(self) -> None:
        """A rank without the sender takes part in every gather."""
        for _ in self.tensors():
            pass


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model on rank 0's CPU, gathered tensor by tensor (a collective; the other
    ranks get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))


def idle_pass(model: torch.nn.Module, device: torch.device, backward: bool) -> None:
    """A forward (and backward) over one token that changes nothing: it takes a rank with no
    micro-batch left through the collectives the others' micro-batch runs (FSDP2's gathers
    and reduce-scatters, DDP's all-reduce)."""
    out = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    if backward:
        (out.logits.sum() * 0.0).backward()
