"""Deterministic mode's logical clocks (deterministic.enabled, docs/determinism.md).

A free-running actor loads weights when they arrive, publishes a group when its verifiers
answer and admits groups as the trainer's drops reach it: all wall-clock. Here each of these
happens at a point its own counters decide, so two runs of one config and seed do the same:
- `TrainerMirror` follows the trainer's use of this actor's published groups (which it
  trains, which it drops as stale, at which step) with the trainer's own rule, so the actor
  knows without asking which version the trainer can have made and how many places it gave
  back;
- `rollouts.due.DueQueue` takes groups' scores in the order their groups finished, and an environment's
  replies in the order their turns ended, each at a set number of decode steps after;
- per-request samplers are seeded by (run seed, group, attempt) (`request_seed`).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import pickle
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from pipelinerl.config import Config
from pipelinerl.records import append_row, read_rows
from pipelinerl.rl.batches import is_stale_version, stale_bound
from pipelinerl.run.checkpoint import checkpoint_steps, complete_checkpoints, read_state
from pipelinerl.streams.base import StreamReader
from pipelinerl.tasks.base import Task
from pipelinerl.types import Group

# metrics.jsonl fields measured by the clock: they differ between two replays of a run.
WALL_CLOCK_FIELDS = frozenset({
    "time_s", "trainer_tokens_per_s", "trainer_wait_frac", "trainer_idle_frac", "publish_s",
    "actor_tokens_per_s", "actor_idle_frac", "actor_slot_time_frac", "actor_decode_time_frac",
    "actor_last_update_pause_s", "actor_mean_update_pause_s", "actor_env_latency_mean_s",
    "actor_env_wait_frac", "eval/duration_s",
    # Process events and measurements of the tools' host (a replayed run replays by design).
    "actor_tool_latency_mean_s", "actor_tool_server_restarts", "actor_tool_replayed",
    "actor_tool_replay_misses",
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
    """The trainer's reading of the run's published groups (in its order, `MergedView`),
    replayed in an actor: it takes them in that order, drops those past `max_lag` (None: none)
    at the step it would train them, and publishes every `publish_every` steps of `per_step`
    groups, `max_steps` of them."""

    def __init__(self, per_step: int, max_lag: int | None, publish_every: int,
                 max_steps: int) -> None:
        self.per_step, self.max_lag = per_step, max_lag
        self.publish_every, self.max_steps = publish_every, max_steps
        self.usable = 0  # groups the trainer will train
        self.dropped = 0  # groups it will drop, giving their places back

    @classmethod
    def of(cls, cfg: Config) -> TrainerMirror:
        conventional = cfg.mode == "conventional"
        return cls(per_step=cfg.trainer.batch_size // cfg.actor.group_size,
                   max_lag=stale_bound(cfg),
                   publish_every=cfg.conventional_g if conventional else cfg.trainer.publish_every,
                   max_steps=cfg.trainer.max_steps)

    def add(self, oldest_version: int) -> None:
        """The next group in the trainer's order, by the oldest weights version in it."""
        if is_stale_version(oldest_version, self.usable // self.per_step, self.max_lag):
            self.dropped += 1
        else:
            self.usable += 1

    def done(self) -> bool:
        """Whether the trainer has every group its last step trains."""
        return self.usable >= self.max_steps * self.per_step

    def version_due(self) -> int:
        """The newest version the trainer can have published after the groups seen."""
        steps = self.usable // self.per_step
        return steps - steps % self.publish_every


def merged_position(actor_id: int, seq: int, num_actors: int) -> int:
    """Where group `seq` (its actor's count, from 1) of `actor_id` stands in the trainer's
    order of every actor's groups: round-robin by seq (`MergedReader`)."""
    return (seq - 1) * num_actors + actor_id


class MergedView:
    """One actor's view of the trainer's order, fed to its `TrainerMirror`: group k of the run
    is actor k mod A's (k // A + 1)-th. Once this actor has published n groups, the mirror has
    seen every group before its next one but the last `lag_groups` (position n x A + actor_id
    - lag_groups): the version due there is the one the actor holds until its next publish.
    Other actors' groups are known by their `PublishedLog`s (their oldest weights version is
    all the mirror needs); this actor waits on a log that is behind."""

    def __init__(self, mirror: TrainerMirror, actor_id: int, num_actors: int, lag_groups: int,
                 logs: Mapping[int, PublishedLog]) -> None:
        self.mirror, self.actor_id, self.num_actors = mirror, actor_id, num_actors
        self.lag_groups, self.logs = lag_groups, dict(logs)
        self.position = 0  # groups of the trainer's order fed to the mirror
        self.complete = False  # the trainer takes no more of this actor's groups (`trains`)
        self.pending: dict[int, dict[int, int]] = {a: {} for a in range(num_actors)}

    def publish(self, seq: int, oldest_version: int) -> None:
        """This actor published its group `seq`."""
        self.pending[self.actor_id][seq] = oldest_version

    def catch_up(self, published: int, should_stop: Callable[[], bool]) -> bool:
        """Feed the mirror up to this actor's point after `published` groups, waiting for the
        other actors' logs; False if the trainer stopped meanwhile."""
        target = max(published * self.num_actors + self.actor_id - self.lag_groups, 0)
        while self.position < target:
            oldest = self._oldest_at(self.position, should_stop)
            if oldest is None:
                return False
            self.mirror.add(oldest)
            del self.pending[self.position % self.num_actors][self._seq_at(self.position)]
            self.position += 1
        return True

    def trains(self, seq: int, should_stop: Callable[[], bool]) -> bool:
        """Whether the trainer takes this actor's group `seq` (trains or drops it): whether
        it has fewer groups than its last step trains before it. Near the run's end this waits
        for the other actors' groups before it. Once False, `complete`: no later group of
        this actor is taken either, and the weights it holds no longer matter."""
        position = merged_position(self.actor_id, seq, self.num_actors)
        needed = self.mirror.max_steps * self.mirror.per_step
        if self.complete or self.mirror.done():
            self.complete = True
        elif self.mirror.usable + position - self.position < needed:
            return True  # even if every group before it not seen yet is usable
        else:
            mirror = copy.copy(self.mirror)
            for before in range(self.position, position):
                oldest = self._oldest_at(before, should_stop)
                if oldest is None or mirror.done():
                    break
                mirror.add(oldest)
            self.complete = mirror.done() or should_stop()
        return not self.complete

    def _seq_at(self, position: int) -> int:
        return position // self.num_actors + 1

    def _oldest_at(self, position: int, should_stop: Callable[[], bool]) -> int | None:
        """The oldest version of the group at `position`, once its actor's log has it (None:
        the trainer stopped first)."""
        actor, seq = position % self.num_actors, self._seq_at(position)
        while seq not in self.pending[actor]:
            self._read(actor)
            if seq in self.pending[actor]:
                break
            if should_stop():
                return None
            time.sleep(0.002)
        return self.pending[actor][seq]

    def _read(self, actor: int) -> None:
        fed = -(-(self.position - actor) // self.num_actors)  # its groups fed: seqs 1..fed
        for seq, oldest in self.logs[actor].new_rows():
            if seq > fed:
                self.pending[actor].setdefault(seq, oldest)  # a replay's copy is the same

    def state(self) -> dict[str, Any]:
        return {"position": self.position, "complete": self.complete,
                "pending": {a: dict(p) for a, p in self.pending.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        self.position, self.complete = state["position"], state["complete"]
        self.pending = {int(a): {int(s): v for s, v in p.items()}
                        for a, p in state["pending"].items()}


class PublishedLog:
    """An actor's published groups, one row each (attempt, seq, oldest weights version), in
    `replay/actor_<id>/published.jsonl`: what the other actors' `MergedView`s read. Rows a
    later attempt superseded (`kept`) are left out by readers; a replayed group's row equals
    its first copy."""

    def __init__(self, run_dir: Path, actor_id: int,
                 kept: Mapping[tuple[int, int], int] | None = None) -> None:
        self.path = Path(run_dir) / REPLAY_DIR / f"actor_{actor_id}" / "published.jsonl"
        self.actor_id, self.kept = actor_id, dict(kept or {})
        self._offset = 0

    def append(self, attempt: int, seq: int, oldest_version: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("ab") as f:
            if f.tell() and not self._ends_in_newline():  # a crash cut the last row short
                f.write(b"\n")
            f.write(json.dumps({"attempt": attempt, "seq": seq,
                                "oldest": oldest_version}).encode() + b"\n")

    def _ends_in_newline(self) -> bool:
        with self.path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def new_rows(self) -> list[tuple[int, int]]:
        """(seq, oldest version) of the whole rows written since the last call."""
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        whole = data[:data.rfind(b"\n") + 1]
        self._offset += len(whole)
        rows = []
        for line in whole.splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # cut short by a crash: its seq is written again
                continue
            if not is_superseded(row["attempt"], self.actor_id, row["seq"], self.kept):
                rows.append((int(row["seq"]), int(row["oldest"])))
        return rows


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
    starting model, step 0), each actor from its snapshot there (`snapshots`, by actor id;
    None: from their start), after `seqs[actor_id]` groups of its published history."""

    attempt: int
    step: int
    seqs: tuple[int, ...]
    checkpoint: str | None
    snapshots: tuple[str, ...] | None

    @property
    def fresh(self) -> bool:
        return self.snapshots is None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> ResumePoint:
        if "seq" in row:  # written before several actors: one actor's
            row = {**row, "seqs": [row.pop("seq")], "snapshots":
                   None if row["snapshot"] is None else [row["snapshot"]]}
            row.pop("snapshot")
        snapshots = row["snapshots"]
        return cls(row["attempt"], row["step"], tuple(row["seqs"]), row["checkpoint"],
                   None if snapshots is None else tuple(snapshots))


def choose_resume_point(run_dir: Path, attempt: int, num_actors: int = 1,
                        eval_due_at: Callable[[int], bool] | None = None) -> ResumePoint:
    """The newest checkpoint with every actor's snapshot at its step, else the run's start.
    With evaluation (`eval_due_at`: whether a version past 0 is on its schedule), also every
    version of the schedule up to that step evaluated (`evaluated_versions`): a version the
    crashed evaluator held but had not evaluated yet is gone, and must be made again."""
    paired = paired_checkpoint(run_dir, num_actors, eval_due_at)
    if paired is None:
        return ResumePoint(attempt, 0, (0,) * num_actors, None, None)
    step = read_state(paired)["step"]
    snapshots = tuple(snapshot_path(run_dir, a, step) for a in range(num_actors))
    return ResumePoint(attempt, step, tuple(read_snapshot(p)["published"] for p in snapshots),
                       str(paired), tuple(map(str, snapshots)))


def paired_checkpoint(run_dir: Path, num_actors: int = 1,
                      eval_due_at: Callable[[int], bool] | None = None) -> Path | None:
    """The newest complete checkpoint whose step has a snapshot of every actor (and, with
    `eval_due_at`, whose evaluations up to its step are all done)."""
    evaluated = evaluated_versions(run_dir) if eval_due_at is not None else set()
    for path in reversed(complete_checkpoints(run_dir)):
        step = read_state(path)["step"]
        if not all(snapshot_path(run_dir, a, step).exists() for a in range(num_actors)):
            continue
        if eval_due_at is None or all(v in evaluated for v in range(step + 1)
                                      if v == 0 or eval_due_at(v)):
            return path
    return None


def checkpoint_to_protect(run_dir: Path, num_actors: int = 1,
                          eval_due_at: Callable[[int], bool] | None = None) -> Path | None:
    """The checkpoint the trainer keeps past its newest `checkpoint_keep`: the newest a resume
    can use now (`paired_checkpoint`), else the oldest with every actor's snapshot, whose
    evaluations may still come (an evaluator lagging more than `checkpoint_keep` checkpoints
    would otherwise see every usable checkpoint pruned before its results, and a crash then
    resume the run from its start)."""
    paired = paired_checkpoint(run_dir, num_actors, eval_due_at)
    if paired is not None or eval_due_at is None:
        return paired
    for path in complete_checkpoints(run_dir):
        step = read_state(path)["step"]
        if all(snapshot_path(run_dir, a, step).exists() for a in range(num_actors)):
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
    return [ResumePoint.from_row(row) for row in read_rows(path)] if path.exists() else []


def resume_point(run_dir: Path, attempt: int) -> ResumePoint:
    """Attempt `attempt`'s resume point, as the launcher chose it."""
    found = [p for p in resume_points(run_dir) if p.attempt == attempt]
    if not found:
        raise ValueError(f"deterministic.enabled=true with attempt={attempt}: no resume point "
                         f"for it in {Path(run_dir) / REPLAY_DIR / RESUMES_FILE}; resume with "
                         "`pipelinerl train CONFIG --resume`, which pairs a checkpoint with the "
                         "actor's snapshot")
    return found[-1]


def superseded_after(points: list[ResumePoint]) -> dict[tuple[int, int], int]:
    """Per earlier attempt and actor, the published groups (seq) still in the run's history:
    those a later resume's actor did not publish again (the lowest seq any later attempt
    resumed it at)."""
    attempts = {0, *(p.attempt for p in points)}
    actors = range(max((len(p.seqs) for p in points), default=0))
    return {(a, actor): min(p.seqs[actor] for p in points if p.attempt > a)
            for a in attempts if any(p.attempt > a for p in points) for actor in actors}


def is_superseded(attempt: int, actor_id: int, seq: int,
                  kept: Mapping[tuple[int, int], int]) -> bool:
    """Whether group `seq` (its actor's count) of `actor_id` in `attempt` was published again
    by a later attempt (`kept`: from `superseded_after`)."""
    return (attempt, actor_id) in kept and seq > kept[attempt, actor_id]


class SupersededFilter:
    """A rollout reader that leaves out groups superseded by a later attempt (`kept`, from
    `superseded_after`): the trainer neither trains nor counts them."""

    def __init__(self, reader: StreamReader, kept: Mapping[tuple[int, int], int]) -> None:
        self.reader, self.kept = reader, dict(kept)

    def read(self, max_count: int, timeout_s: float) -> list[dict[str, Any]]:
        return [r for r in self.reader.read(max_count, timeout_s)
                if r.get("heartbeat")
                or not is_superseded(r.get("attempt", 0), r.get("actor_id", 0),
                                     int(r.get("seq", 0)), self.kept)]

    def offsets(self) -> dict[str, Any]:
        return self.reader.offsets()

    def trim(self, offsets: dict[str, Any]) -> int:
        return self.reader.trim(offsets)

    def close(self) -> None:
        self.reader.close()


class MergedReader:
    """The trainer's rollout reader with several deterministic actors: it hands on their
    groups in one order whatever their timing, round-robin by each actor's `seq` (actor 0's
    first, actor 1's first, ..., actor 0's second, ...: `merged_position`), holding a group
    until every one before it came. Heartbeats and records without an actor's seq pass at
    once. Its offsets carry the groups held: a checkpoint's resume holds them again."""

    def __init__(self, reader: StreamReader, num_actors: int,
                 offsets: dict[str, Any] | None = None) -> None:
        self.reader, self.num_actors = reader, num_actors
        self.next = list(offsets["next"]) if offsets else [1] * num_actors
        self.held: dict[tuple[int, int], dict[str, Any]] = {}
        for record in offsets["held"] if offsets else ():
            self.held[record["actor_id"], record["seq"]] = record

    def read(self, max_count: int, timeout_s: float) -> list[dict[str, Any]]:
        out = []
        for record in self.reader.read(max_count, timeout_s):
            actor, seq = record.get("actor_id"), record.get("seq")
            if (record.get("heartbeat") or not isinstance(actor, int)
                    or not isinstance(seq, int) or not 0 <= actor < self.num_actors):
                out.append(record)  # the trainer counts or drops it as it comes
            elif seq >= self.next[actor]:
                self.held.setdefault((actor, seq), record)
        while (head := self._head()) in self.held:
            out.append(self.held.pop(head))
            self.next[head[0]] += 1
        return out

    def _head(self) -> tuple[int, int]:
        """(actor, seq) of the next group in the trainer's order."""
        actor = min(range(self.num_actors), key=lambda a: (self.next[a], a))
        return actor, self.next[actor]

    def resume_at(self, seqs: list[int] | tuple[int, ...], buffered: list[Group],
                  kept: Mapping[tuple[int, int], int]) -> list[Group]:
        """A resumed run: each actor publishes again from its group seqs[actor] + 1. The
        checkpoint's groups (`buffered`, read and not trained, in order) from the first of
        those on are held again, with the copies `kept` leaves in the history, so the groups
        published again take their places; returns those before it."""
        first = min(merged_position(a, seq + 1, self.num_actors) for a, seq in enumerate(seqs))
        again = {a: -(-(first - a) // self.num_actors) + 1 for a in range(self.num_actors)}
        self.next = [min(n, again[a]) for a, n in enumerate(self.next)]
        before = []
        for group in buffered:
            if merged_position(group.actor_id, group.seq, self.num_actors) < first:
                before.append(group)
            else:
                self.held[group.actor_id, group.seq] = group.to_dict()
        self.held = {key: r for key, r in self.held.items()
                     if not is_superseded(r.get("attempt", 0), key[0], key[1], kept)}
        return before

    def offsets(self) -> dict[str, Any]:
        return {"inner": self.reader.offsets(), "next": list(self.next),
                "held": list(self.held.values())}

    def trim(self, offsets: dict[str, Any]) -> int:
        return self.reader.trim(offsets["inner"])

    def close(self) -> None:
        self.reader.close()
