"""The trainer's process group: joining it, and sharing what rank 0 alone knows (the step's
groups, its clock's decisions) with the other ranks."""

from __future__ import annotations

import os
import pickle
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from pipelinerl.sync.broadcast import _bounded, claim_nccl_interface
from pipelinerl.types import Group

# share_groups' payload when rank 0 publishes while it waits (Trainer.serve_rejoined).
_PUBLISH_AGAIN = "publish again"


def init_distributed(device: str, timeout_s: float = 1800.0, sharded: bool = False,
                     weight_store: str = "", interface: str = "") -> tuple[int, int, str]:
    """Join the trainer's process group when started by torchrun (`sharded`: a one-rank group
    too, FSDP2 shards over one); returns (rank, world, device).
    `timeout_s` bounds every collective, the final barrier included: the other ranks wait there
    while rank 0 saves and waits for the final evaluation.
    `weight_store` (sync.init_method of a broadcast weight channel) and `interface`
    (sync.interface): on CUDA the weight group's NCCL interface is set before this group forms,
    since NCCL takes it from the first NCCL group of the process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and not sharded:
        return 0, 1, device
    rank = int(os.environ.get("RANK", "0"))
    if device.startswith("cuda"):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = f"cuda:{local_rank}"
        torch.cuda.set_device(local_rank)
        backend = "nccl"
        if weight_store:
            claim_nccl_interface(weight_store, interface, f"trainer rank {rank}")
    else:
        backend = "gloo"
    timeout = timedelta(seconds=timeout_s)
    if world == 1:  # FSDP2 on one rank (CPU offload, or a run resumed on fewer ranks)
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    else:
        # A rank waits here for the others (torchrun's store, the backend's connections): in
        # a thread, so a stop signal is heard meanwhile, and never past the timeout.
        failed = (f"trainer rank {rank}: the trainer's {backend} process group ({world} ranks) "
                  f"did not form within {timeout_s} s")
        try:
            _bounded(lambda: dist.init_process_group(backend=backend, timeout=timeout),
                     timeout_s, failed)
        except dist.DistError as e:  # the store's own timeout, which may come first
            raise TimeoutError(f"{failed}: {str(e).splitlines()[0]}") from e
    return rank, world, device


def share_groups(groups: list[Group] | None, rank: int, world: int,
                 publish: Callable[[], None] | None = None) -> list[Group] | None:
    """Rank 0 read the step's groups; every rank gets its equal shard (groups are whole), or
    None when rank 0 got none (the time budget ran out while it waited). A sharded trainer's
    other ranks `publish` with rank 0 whenever it says so meanwhile (`call_to_publish`)."""
    if world == 1:
        return groups
    payload = None if rank != 0 or groups is None else [g.to_dict() for g in groups]
    payload = _broadcast_object(payload, rank)
    while payload == _PUBLISH_AGAIN:
        assert publish is not None, "rank 0 publishes while waiting only when sharded"
        publish()
        payload = _broadcast_object(None, rank)
    return None if payload is None else [Group.from_dict(d) for d in payload[rank::world]]


def call_to_publish() -> None:
    """Rank 0, before it publishes while the other ranks wait in `share_groups`: they join in."""
    _broadcast_object(_PUBLISH_AGAIN, 0)


def rank0_says(flag: bool, device: str) -> bool:
    """Rank 0's `flag` on every rank (a decision that reads rank 0's clock)."""
    flag_tensor = torch.tensor([float(flag)], device=device)  # NCCL broadcasts no CPU tensor
    _heard(dist.broadcast(flag_tensor, src=0, async_op=True))
    return bool(flag_tensor.item())


def _heard(work: dist.Work) -> None:
    """Wait for a collective by polling it: the other ranks may wait here for as long as rank
    0 waits for samples, and a main thread inside a native wait hears no stop signal. The
    group's timeout (init_distributed) still ends a collective whose peer is gone: it then
    completes with an error, which `wait` raises."""
    pause = 0.0001
    while not work.is_completed():
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
    work.wait()


def _broadcast_object(obj: object, rank: int) -> object:
    """Rank 0's `obj` on every rank (as broadcast_object_list, whose waits are native)."""
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    data = pickle.dumps(obj) if rank == 0 else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    _heard(dist.broadcast(size, src=0, async_op=True))
    if rank == 0:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _heard(dist.broadcast(buf, src=0, async_op=True))
    return pickle.loads(buf.cpu().numpy().tobytes())
