"""Deterministic mode's logical clocks (deterministic.enabled, docs/determinism.md).

A free-running actor loads weights when they arrive, publishes a group when its verifiers
answer and admits groups as the trainer's drops reach it: all wall-clock. Here each of these
happens at a point its own counters decide, so two runs of one config and seed do the same:
- `TrainerMirror` follows the trainer's use of this actor's published groups (which it
  trains, which it drops as stale, at which step) with the trainer's own rule, so the actor
  knows without asking which version the trainer can have made and how many places it gave
  back;
- `ScoreQueue` takes groups' scores in the order their groups finished, each at a set number
  of decode steps after;
- per-request samplers are seeded by (run seed, group, attempt) (`request_seed`).
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from typing import Mapping

import torch

from pipelinerl.batches import is_stale, stale_bound
from pipelinerl.config import Config
from pipelinerl.tasks.base import Task
from pipelinerl.tasks.environment import is_environment
from pipelinerl.types import Group

# metrics.jsonl fields measured by the clock: they differ between two replays of a run.
WALL_CLOCK_FIELDS = frozenset({
    "time_s", "trainer_tokens_per_s", "trainer_wait_frac", "trainer_idle_frac", "publish_s",
    "actor_tokens_per_s", "actor_idle_frac", "actor_slot_time_frac", "actor_decode_time_frac",
    "actor_last_update_pause_s", "actor_mean_update_pause_s",
})


def request_seed(seed: int, group_id: str, attempt: int) -> int:
    """The sampler seed of attempt `attempt` of group `group_id` (63 bits of a hash)."""
    digest = hashlib.blake2b(f"{seed}/{group_id}/{attempt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def check_deterministic_task(cfg: Config, task: Task) -> None:
    """Refuse, naming the key, a task whose turns or episodes run on their own timing."""
    if is_environment(task) or getattr(task, "episodic", False):
        raise ValueError(f"deterministic.enabled=true with task.name={cfg.task.name!r}: an "
                         "environment's replies and episodes come back when their workers "
                         "finish (not yet deterministic, docs/determinism.md)")


def use_deterministic_torch() -> None:
    """torch's switches for kernels that give the same bits on every run (the CUDA ones need
    cuBLAS's fixed workspace, set before CUDA starts)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def weights_sha256(weights: Mapping[str, torch.Tensor]) -> str:
    """One hash of every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(weights):
        tensor = weights[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


class TrainerMirror:
    """The trainer's reading of this actor's groups, replayed in the actor: it takes them in
    publish order, drops those past `max_lag` (None: none) at the step it would train them,
    and publishes every `publish_every` steps of `per_step` groups, `max_steps` of them.
    Version v is due in the engine once `lag_groups` groups past the v * per_step usable ones
    are published."""

    def __init__(self, per_step: int, max_lag: int | None, publish_every: int,
                 lag_groups: int, max_steps: int) -> None:
        self.per_step, self.max_lag = per_step, max_lag
        self.publish_every, self.lag_groups = publish_every, lag_groups
        self.max_steps = max_steps
        self.usable = 0  # groups the trainer will train
        self.dropped = 0  # groups it will drop, giving their places back

    @classmethod
    def of(cls, cfg: Config) -> TrainerMirror:
        conventional = cfg.mode == "conventional"
        return cls(per_step=cfg.trainer.batch_size // cfg.actor.group_size,
                   max_lag=stale_bound(cfg),
                   publish_every=cfg.conventional_g if conventional else cfg.trainer.publish_every,
                   lag_groups=cfg.deterministic.lag_groups, max_steps=cfg.trainer.max_steps)

    def add(self, group: Group) -> None:
        """A group published, in stream order."""
        if is_stale(group, self.usable // self.per_step, self.max_lag):
            self.dropped += 1
        else:
            self.usable += 1

    def done(self) -> bool:
        """Whether the trainer has every group its last step trains."""
        return self.usable >= self.max_steps * self.per_step

    def version_due(self) -> int:
        """The newest version the actor must hold now."""
        steps = max(self.usable - self.lag_groups, 0) // self.per_step
        return steps - steps % self.publish_every


class ScoreQueue:
    """Groups waiting for their scores, in the order they were sent to the verifiers, each
    due `delay` decode steps after."""

    def __init__(self, delay: int) -> None:
        self.delay = delay
        self._waiting: deque[tuple[str, int]] = deque()  # (group key, decode step due)

    def expect(self, key: str, decode_steps: int) -> None:
        self._waiting.append((key, decode_steps + self.delay))

    def due(self, decode_steps: int, idle: bool) -> list[str]:
        """The keys due at `decode_steps`, oldest first; all of them when `idle` (nothing to
        decode, so the decode clock stands)."""
        keys = []
        while self._waiting and (idle or self._waiting[0][1] <= decode_steps):
            keys.append(self._waiting.popleft()[0])
        return keys
