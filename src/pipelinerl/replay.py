"""Deterministic mode's logical clocks (deterministic.enabled, docs/determinism.md).

A free-running actor loads weights when they arrive, publishes a group when its verifiers
answer and admits groups as the trainer's drops reach it: all wall-clock. Here each of these
happens at a point its own counters decide, so two runs of one config and seed do the same:
- `TrainerMirror` follows the trainer's use of this actor's published groups (which it
  trains, which it drops as stale, at which step) with the trainer's own rule, so the actor
  knows without asking which version the trainer can have made and how many places it gave
  back;
- `DueQueue` takes groups' scores in the order their groups finished, and an environment's
  replies in the order their turns ended, each at a set number of decode steps after;
- per-request samplers are seeded by (run seed, group, attempt) (`request_seed`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import pickle
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from pipelinerl.batches import is_stale, stale_bound
from pipelinerl.checkpoint import checkpoint_steps, complete_checkpoints, read_state
from pipelinerl.config import Config
from pipelinerl.records import append_row, read_rows
from pipelinerl.streams.base import StreamReader
from pipelinerl.tasks.base import Task
from pipelinerl.types import Group

# metrics.jsonl fields measured by the clock: they differ between two replays of a run.
WALL_CLOCK_FIELDS = frozenset({
    "time_s", "trainer_tokens_per_s", "trainer_wait_frac", "trainer_idle_frac", "publish_s",
    "actor_tokens_per_s", "actor_idle_frac", "actor_slot_time_frac", "actor_decode_time_frac",
    "actor_last_update_pause_s", "actor_mean_update_pause_s", "actor_env_latency_mean_s",
    "actor_env_wait_frac", "eval/duration_s",
})


def request_seed(seed: int, group_id: str, attempt: int) -> int:
    """The sampler seed of attempt `attempt` of group `group_id` (63 bits of a hash)."""
    digest = hashlib.blake2b(f"{seed}/{group_id}/{attempt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def reply_delay_steps(cfg: Config) -> int | None:
    """How many decode steps after a turn an environment's reply is applied (None: as it
    comes back, free-running)."""
    return cfg.deterministic.reply_delay_steps if cfg.deterministic.enabled else None


def eval_due(cfg: Config, version: int) -> bool:
    """Whether the evaluator must evaluate `version` past the starting one: every
    eval.every_steps-th (its final weights besides). The trainer waits, after publishing such
    a version, until the evaluator holds it: a newer one could replace it in the channel."""
    every = cfg.eval.every_steps
    return version > 0 and every > 0 and version % every == 0


def eval_schedule(cfg: Config) -> Callable[[int], bool] | None:
    """`eval_due` for this config when it evaluates (None: no evaluation): what a resume
    point's evaluations must cover (`paired_checkpoint`)."""
    return functools.partial(eval_due, cfg) if cfg.eval.enabled else None


def check_deterministic_task(cfg: Config, task: Task) -> None:
    """Refuse, naming the key, a task whose episodes run on their own timing (an environment of
    another library, which drives its own model calls)."""
    if getattr(task, "episodic", False):
        raise ValueError(f"deterministic.enabled=true with task.name={cfg.task.name!r}: its "
                         "episodes call the model when their own code decides (not yet "
                         "deterministic, docs/determinism.md)")


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


class DueQueue:
    """Keys waiting for a worker's answer (groups for their scores, rollouts for an
    environment's reply), in the order they were sent, each due `delay` decode steps after."""

    def __init__(self, delay: int) -> None:
        self.delay = delay
        self._waiting: deque[tuple[str, int]] = deque()  # (key, decode step due)

    def expect(self, key: str, decode_steps: int) -> None:
        self._waiting.append((key, decode_steps + self.delay))

    def pop_due(self, decode_steps: int, idle: bool) -> str | None:
        """The oldest key if it is due at `decode_steps` (any is when `idle`: nothing to decode,
        so the decode clock stands), else None. One at a time: a version the actor loads after
        a group may stop it from publishing the next (a snapshot's drain)."""
        if self._waiting and (idle or self._waiting[0][1] <= decode_steps):
            return self._waiting.popleft()[0]
        return None

    def entries(self) -> list[tuple[str, int]]:
        """(key, decode step due), oldest first: an actor snapshot's part."""
        return list(self._waiting)

    def restore(self, entries: list[tuple[str, int]]) -> None:
        self._waiting = deque(entries)


# ---- crash and resume (docs/determinism.md, "A crash changes nothing") ---------------------
#
# The actor writes a snapshot of its whole state at the first engine-empty moment after it
# loads a version that is a multiple of trainer.checkpoint_every_steps (it admits nothing and
# publishes nothing in between, so it still holds that version and the trainer cannot have
# trained past what it published). A resume pairs the trainer's newest checkpoint that has
# such a snapshot at its step with that snapshot: the trainer continues from the checkpoint,
# the actor from the snapshot, and the groups the actor published after it are superseded (the
# resumed actor publishes them again, bit for bit).

REPLAY_DIR = "replay"
RESUMES_FILE = "resumes.jsonl"
EVALUATED_FILE = "evaluated.jsonl"


def snapshot_path(run_dir: Path, actor_id: int, step: int) -> Path:
    return Path(run_dir) / REPLAY_DIR / f"actor_{actor_id}" / f"step_{step:08d}.pkl"


def write_snapshot(run_dir: Path, actor_id: int, step: int, state: dict[str, Any]) -> Path:
    """Write the actor's state at version `step` atomically (fsynced, then renamed), and delete
    the snapshots no resume can pair: those older than the trainer's newest checkpoint with no
    checkpoint at their step. A snapshot of a step the trainer kept a checkpoint of stays
    (the trainer keeps, past its newest `checkpoint_keep`, the newest one a resume can use,
    which may be far back while the evaluator lags), and so do those newer than its newest
    checkpoint (the actor runs ahead: their checkpoints are still to come)."""
    path = snapshot_path(run_dir, actor_id, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        pickle.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    checkpointed = checkpoint_steps(run_dir)
    newest = checkpointed[-1] if checkpointed else -1
    for old in path.parent.glob("step_*.pkl"):
        old_step = int(old.stem.removeprefix("step_"))
        if old_step < newest and old_step not in checkpointed:
            old.unlink(missing_ok=True)
    return path


def read_snapshot(path: Path) -> dict[str, Any]:
    """A snapshot this run's actor wrote (pickle: the run directory is trusted, as its
    checkpoints' trainer.pt is)."""
    with Path(path).open("rb") as f:
        return pickle.load(f)


@dataclass(frozen=True)
class ResumePoint:
    """Where attempt `attempt` resumes: the trainer from its checkpoint of `step` (None: the
    starting model, step 0), the actor from its snapshot there (None: from its start), after
    `seq` groups of its published history."""

    attempt: int
    step: int
    seq: int
    checkpoint: str | None
    snapshot: str | None

    @property
    def fresh(self) -> bool:
        return self.snapshot is None


def choose_resume_point(run_dir: Path, attempt: int, actor_id: int = 0,
                        eval_due_at: Callable[[int], bool] | None = None) -> ResumePoint:
    """The newest checkpoint with the actor's snapshot at its step, else the run's start.
    With evaluation (`eval_due_at`: whether a version past 0 is on its schedule), also every
    version of the schedule up to that step evaluated (`evaluated_versions`): a version the
    crashed evaluator held but had not evaluated yet is gone, and must be made again."""
    paired = paired_checkpoint(run_dir, actor_id, eval_due_at)
    if paired is None:
        return ResumePoint(attempt, 0, 0, None, None)
    step = read_state(paired)["step"]
    snapshot = snapshot_path(run_dir, actor_id, step)
    return ResumePoint(attempt, step, read_snapshot(snapshot)["published"], str(paired),
                       str(snapshot))


def paired_checkpoint(run_dir: Path, actor_id: int = 0,
                      eval_due_at: Callable[[int], bool] | None = None) -> Path | None:
    """The newest complete checkpoint whose step has a snapshot of the actor (and, with
    `eval_due_at`, whose evaluations up to its step are all done)."""
    evaluated = evaluated_versions(run_dir) if eval_due_at is not None else set()
    for path in reversed(complete_checkpoints(run_dir)):
        step = read_state(path)["step"]
        if not snapshot_path(run_dir, actor_id, step).exists():
            continue
        if eval_due_at is None or all(v in evaluated for v in range(step + 1)
                                      if v == 0 or eval_due_at(v)):
            return path
    return None


def record_evaluated(run_dir: Path, version: int, attempt: int) -> None:
    """The evaluator's note that `version`'s result is on the eval stream (or its weights kept
    for a deferred pass), written after it: a resume need not make that version again."""
    path = Path(run_dir) / REPLAY_DIR / EVALUATED_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    append_row(path, {"version": version, "attempt": attempt})


def evaluated_versions(run_dir: Path) -> set[int]:
    """The versions evaluated (or kept for a deferred pass) by any attempt: in deterministic
    mode a version's weights, and so its result, are the same in every attempt."""
    path = Path(run_dir) / REPLAY_DIR / EVALUATED_FILE
    return {int(row["version"]) for row in read_rows(path)} if path.exists() else set()


def record_resume_point(run_dir: Path, point: ResumePoint) -> None:
    """Before the attempt's roles start: both read it (`resume_point`)."""
    path = Path(run_dir) / REPLAY_DIR / RESUMES_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    append_row(path, asdict(point))


def resume_points(run_dir: Path) -> list[ResumePoint]:
    path = Path(run_dir) / REPLAY_DIR / RESUMES_FILE
    return [ResumePoint(**row) for row in read_rows(path)] if path.exists() else []


def resume_point(run_dir: Path, attempt: int) -> ResumePoint:
    """Attempt `attempt`'s resume point, as the launcher chose it."""
    found = [p for p in resume_points(run_dir) if p.attempt == attempt]
    if not found:
        raise ValueError(f"deterministic.enabled=true with attempt={attempt}: no resume point "
                         f"for it in {Path(run_dir) / REPLAY_DIR / RESUMES_FILE}; resume with "
                         "`pipelinerl train CONFIG --resume`, which pairs a checkpoint with the "
                         "actor's snapshot")
    return found[-1]


def superseded_after(points: list[ResumePoint]) -> dict[int, int]:
    """Per earlier attempt, the published groups (seq) still in the run's history: those a
    later resume's actor did not publish again (the lowest seq any later attempt resumed at)."""
    attempts = {0, *(p.attempt for p in points)}
    return {a: min(p.seq for p in points if p.attempt > a) for a in attempts
            if any(p.attempt > a for p in points)}


def is_superseded(attempt: int, seq: int, kept: Mapping[int, int]) -> bool:
    """Whether group `seq` (its actor's count) of `attempt` was published again by a later
    attempt (`kept`: from `superseded_after`)."""
    return attempt in kept and seq > kept[attempt]


class SupersededFilter:
    """A rollout reader that leaves out groups superseded by a later attempt (`kept`, from
    `superseded_after`): the trainer neither trains nor counts them."""

    def __init__(self, reader: StreamReader, kept: Mapping[int, int]) -> None:
        self.reader, self.kept = reader, dict(kept)

    def read(self, max_count: int, timeout_s: float) -> list[dict[str, Any]]:
        return [r for r in self.reader.read(max_count, timeout_s)
                if r.get("heartbeat")
                or not is_superseded(r.get("attempt", 0), int(r.get("seq", 0)), self.kept)]

    def offsets(self) -> dict[str, Any]:
        return self.reader.offsets()

    def trim(self, offsets: dict[str, Any]) -> int:
        return self.reader.trim(offsets)

    def close(self) -> None:
        self.reader.close()
