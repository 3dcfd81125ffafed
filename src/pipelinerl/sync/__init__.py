"""Weight channels from the trainer to the actors' engines.

Backends: `shm` (one machine: a shared-memory file, see `shm.py`) and `broadcast`
(`torch.distributed` broadcast across processes and machines, see `broadcast.py`). Options
are passed through to the backend's class, so a wrong option fails with a TypeError naming it:

    shm:       ShmWeightSender(run_id, shm_dir="/dev/shm")
               ShmWeightReceiver(run_id, shm_dir="/dev/shm", timeout_s=60.0)
    broadcast: BroadcastWeightSender(init_method, n_actors, device="cpu", bucket_mb=64.0,
                                     per_parameter=False, timeout_s=120.0,
                                     rendezvous_timeout_s=None, interface="")
               BroadcastWeightReceiver(init_method, actor_id, n_actors, device="cpu",
                                       timeout_s=120.0, rendezvous_timeout_s=None,
                                       may_rejoin=False, interface="")
"""

from __future__ import annotations

from typing import Any

from pipelinerl.sync.base import WeightReceiver, WeightSender
from pipelinerl.sync.broadcast import BroadcastWeightReceiver, BroadcastWeightSender
from pipelinerl.sync.shm import ShmWeightReceiver, ShmWeightSender

_BACKENDS: dict[str, tuple[type, type]] = {
    "shm": (ShmWeightSender, ShmWeightReceiver),
    "broadcast": (BroadcastWeightSender, BroadcastWeightReceiver),
}


def _classes(backend: str) -> tuple[type, type]:
    if backend not in _BACKENDS:
        raise ValueError(f"unknown weight-sync backend {backend!r}; known: {sorted(_BACKENDS)}")
    return _BACKENDS[backend]


def make_sender(backend: str, **options: Any) -> WeightSender:
    """The trainer's end of a `backend` channel ("shm" or "broadcast")."""
    return _classes(backend)[0](**options)


def make_receiver(backend: str, **options: Any) -> WeightReceiver:
    """An actor's end of a `backend` channel ("shm" or "broadcast")."""
    return _classes(backend)[1](**options)


__all__ = [
    "BroadcastWeightReceiver",
    "BroadcastWeightSender",
    "ShmWeightReceiver",
    "ShmWeightSender",
    "WeightReceiver",
    "WeightSender",
    "make_receiver",
    "make_sender",
]
