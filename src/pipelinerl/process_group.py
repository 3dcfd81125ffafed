"""The trainer's process group: joining it, and sharing what rank 0 alone knows (the step's
groups, its clock's decisions) with the other ranks."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from pipelinerl.sync.broadcast import _bounded
from pipelinerl.types import Group

# share_groups' payload when rank 0 publishes while it waits (Trainer.serve_rejoined).
_PUBLISH_AGAIN = "publish again"


def init_distributed(device: str, timeout_s: float = 1800.0, sharded: bool = False
                     ) -> tuple[int, int, str]:
    """Join the trainer's process group when started by torchrun (`sharded`: a one-rank group
    too, FSDP2 shards over one); returns (rank, world, device).
    `timeout_s` bounds every collective, the final barrier included: the other ranks wait there
    while rank 0 saves and waits for the final evaluation."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and not sharded:
        return 0, 1, device
    rank = int(os.environ.get("RANK", "0"))
    if device.startswith("cuda"):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    timeout = timedelta(seconds=timeout_s)
    if world == 1:  # FSDP2 on one rank (CPU offload, or a run resumed on fewer ranks)
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    else:
        # A rank waits here for the others (torchrun's store, the backend's connections): in
        # a thread, so a stop signal is heard meanwhile, and never past the timeout.
        _bounded(lambda: dist.init_process_group(backend=backend, timeout=timeout), timeout_s,
                 f"trainer rank {rank}: the trainer's {backend} process group ({world} ranks) "
                 f"did not form within {timeout_s} s")
    return rank, world, device


def share_groups(groups: list[Group] | None, rank: int, world: int,
                 publish: Callable[[], None] | None = None) -> list[Group] | None:
    """Rank 0 read the step's groups; every rank gets its equal shard (groups are whole), or
    None when rank 0 got none (the time budget ran out while it waited). A sharded trainer's
    other ranks `publish` with rank 0 whenever it says so meanwhile (`call_to_publish`)."""
    if world == 1:
        return groups
    payload = [None if rank != 0 or groups is None else [g.to_dict() for g in groups]]
    dist.broadcast_object_list(payload, src=0)
    while payload[0] == _PUBLISH_AGAIN:
        assert publish is not None, "rank 0 publishes while waiting only when sharded"
        publish()
        dist.broadcast_object_list(payload, src=0)
    return None if payload[0] is None else [Group.from_dict(d) for d in payload[0][rank::world]]


def call_to_publish() -> None:
    """Rank 0, before it publishes while the other ranks wait in `share_groups`: they join in."""
    dist.broadcast_object_list([_PUBLISH_AGAIN], src=0)


def rank0_says(flag: bool, device: str) -> bool:
    """Rank 0's `flag` on every rank (a decision that reads rank 0's clock)."""
    flag_tensor = torch.tensor([float(flag)], device=device)  # NCCL broadcasts no CPU tensor
    dist.broadcast(flag_tensor, src=0)
    return bool(flag_tensor.item())
