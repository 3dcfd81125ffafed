"""The trainer's sample source: whole groups from the rollout stream, minus the groups it
drops (stale, another run's, made with lost weights, malformed), whose places go back to their
actors; and, when nothing usable comes, what each actor last said."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from pipelinerl.config import Config
from pipelinerl.streams.base import StreamReader
from pipelinerl.types import HEARTBEAT_S, Group, attempt_index

log = logging.getLogger(__name__)


@dataclass
class BatchSource:
    """Pulls whole groups from the stream; drops (and counts) groups beyond the lag bound,
    groups of negative lag (another run's) and malformed records. Every drop gives the group's
    place back to its actor's admission count (`given_back`, sent on the control stream), so
    drops never narrow the pipeline."""

    reader: StreamReader
    group_size: int
    # None: no bound (conventional mode bounds lag by construction; trainer.drop_stale=false)
    max_lag: int | None
    timeout_s: float
    # Per earlier attempt of the run, the newest weight version still in this run's history:
    # the lowest step a later attempt resumed from (docs/reliability.md). Empty: not resumed.
    valid_upto: dict[int, int] = field(default_factory=dict)
    buffer: list[Group] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)  # reason -> groups dropped
    dropped_ids: dict[str, list[str]] = field(default_factory=dict)  # by reason, until taken
    # samples.jsonl's dropped lines: up to so many (reason, step judged at, group) kept until
    # taken (-1: all, 0: none; metrics.samples_per_step), so the record costs nothing when off.
    keep_dropped: int = 0
    dropped_groups: list[tuple[str, int, Group]] = field(default_factory=list)
    given_back: Counter = field(default_factory=Counter)  # actor id -> places given back
    given_back_changed: bool = False
    # Sends `given_back` to the actors (the control stream). Called whenever the source is about
    # to wait for groups: an actor blocked by the staleness bound fills the places of groups
    # dropped in this very batch only once it learns they are free (after a resume, a batch
    # can drop more groups made after the checkpoint than the bound leaves room for).
    announce: Callable[[dict[int, int]], None] | None = None
    # Called likewise: a restarted actor waits for weights while the trainer waits for its
    # groups (Trainer.serve_rejoined).
    idle: Callable[[], None] | None = None
    trimmed: int = 0  # records deleted from the stream after checkpoints (counted for audits)
    wait_s: float = 0.0
    actor_stats: dict[int, dict[str, float]] = field(default_factory=dict)
    # Per actor, when a group or heartbeat of it last came, and the newest heartbeat.
    heartbeats: dict[int, tuple[float, dict[str, Any]]] = field(default_factory=dict)
    last_group: dict[int, float] = field(default_factory=dict)

    def snapshot(self) -> dict[str, Any]:
        """The checkpoint's part: where the reader stands, what it read and has not trained."""
        return {"offsets": self.reader.offsets(), "buffered": [g.to_dict() for g in self.buffer],
                "dropped": dict(self.dropped), "trimmed": self.trimmed,
                "returned": {str(k): v for k, v in self.given_back.items()}}

    def restore(self, snapshot: dict[str, Any]) -> None:
        """After opening the reader at snapshot["offsets"]."""
        self.buffer = [Group.from_dict(d) for d in snapshot["buffered"]]
        self.dropped = Counter(snapshot["dropped"])
        self.trimmed = snapshot.get("trimmed", 0)
        self.given_back = Counter({int(k): v for k, v in snapshot["returned"].items()})
        self.given_back_changed = True  # the actors of the new attempt learn it at once

    def _give_back(self, actor_id: int, reason: str, group_id: str) -> None:
        self.dropped[reason] += 1
        self.dropped_ids.setdefault(reason, []).append(group_id)
        self.given_back[actor_id] += 1
        self.given_back_changed = True

    def _pull(self) -> None:
        t0 = time.monotonic()
        records = self.reader.read(max_count=256, timeout_s=0.5)
        self.wait_s += time.monotonic() - t0
        for record in records:
            if record.get("heartbeat"):
                self.heartbeats[record.get("actor_id", -1)] = (time.monotonic(), record)
                continue
            try:
                group = Group.from_dict(record)
                _validate(group, self.group_size)
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("dropping a malformed rollout record: %r", exc)
                actor_id = record.get("actor_id") if isinstance(record, dict) else None
                if isinstance(actor_id, int):
                    self._give_back(actor_id, "malformed", str(record.get("group_id", "")))
                else:  # whose place it held is unknown: counted, not given back
                    self.dropped["malformed"] += 1
                continue
            self.actor_stats[group.actor_id] = group.actor_stats
            self.last_group[group.actor_id] = time.monotonic()
            self.buffer.append(group)

    def _drop_reason(self, group: Group, step: int) -> str | None:
        newest = max(max(s.versions) for s in group.samples)
        if group.attempt in self.valid_upto and newest > self.valid_upto[group.attempt]:
            # Made with weights a crashed attempt published after the checkpoint the run
            # resumed from: those weights are gone, the group's tokens belong to no policy of
            # this run's history.
            return "after_checkpoint"
        if newest > step:
            # Weights the trainer has not produced yet: another run's group (a stream reused
            # by mistake), however small its lag looks.
            if not self.dropped["negative_lag"]:
                log.warning("dropping group %s: it holds tokens of version %d at trainer step %d, "
                            "so it comes from another run; is run_id shared?",
                            group.group_id, newest, step)
            return "negative_lag"
        if is_stale(group, step, self.max_lag):
            return "stale"
        return None

    def take_dropped_ids(self) -> dict[str, list[str]]:
        """Group ids dropped since the last call, by reason (trained.jsonl's `dropped`)."""
        ids, self.dropped_ids = self.dropped_ids, {}
        return ids

    def take_dropped_groups(self) -> list[tuple[str, int, Group]]:
        """(reason, step judged at, group) of the groups kept since the last call."""
        kept, self.dropped_groups = self.dropped_groups, []
        return kept

    def take(self, n_groups: int, step: int, deadline: float | None = None) -> list[Group] | None:
        """The next `n_groups` groups usable at optimizer step `step`, in arrival order; None
        if the monotonic clock passes `deadline` while waiting for them (the groups taken so
        far go back to the buffer, which a checkpoint keeps).
        Raises TimeoutError when none usable came for `timeout_s`: groups that keep arriving
        only to be dropped (another run's, all stale) stop the run instead of holding it."""
        last_usable = time.monotonic()
        dropped_before = sum(self.dropped.values())
        batch: list[Group] = []
        while len(batch) < n_groups:
            while self.buffer and len(batch) < n_groups:
                group = self.buffer.pop(0)
                reason = self._drop_reason(group, step)
                if reason is not None:
                    self._give_back(group.actor_id, reason, group.group_id)
                    if self.keep_dropped < 0 or len(self.dropped_groups) < self.keep_dropped:
                        self.dropped_groups.append((reason, step, group))
                    continue
                batch.append(group)
                last_usable = time.monotonic()
            if len(batch) == n_groups:
                break
            self._announce_given_back()
            if self.idle is not None:
                self.idle()
            if deadline is not None and time.monotonic() > deadline:
                self.buffer[:0] = batch
                return None
            if time.monotonic() - last_usable > self.timeout_s:  # the buffer is empty here
                dropped = sum(self.dropped.values()) - dropped_before
                raise TimeoutError(
                    f"no usable rollout arrived for {self.timeout_s:.0f} s at step {step} (have "
                    f"{len(batch)}/{n_groups} groups; {dropped} dropped meanwhile, the run's "
                    f"drops by reason: {dict(self.dropped)}). {self.actors_report(step)} See "
                    "the run's logs/ (with actor.drop_zero_variance, actors also drop every "
                    "group a saturated policy solves or fails entirely: "
                    "actor_skipped_zero_variance)"
                )
            self._pull()
        self._announce_given_back()
        return batch

    def _announce_given_back(self) -> None:
        if self.given_back_changed and self.announce is not None:
            self.announce(dict(self.given_back))
            self.given_back_changed = False

    def actors_report(self, step: int) -> str:
        """What each actor last said: blocked (alive, admitting nothing), busy, or silent."""
        now = time.monotonic()
        if not self.heartbeats and not self.last_group:
            return "No actor has written anything: none started, or all died at start."
        parts = []
        for actor in sorted({*self.heartbeats, *self.last_group}):
            heard, heartbeat = self.heartbeats.get(actor, (0.0, None))
            ago = now - max(heard, self.last_group.get(actor, 0.0))
            if heartbeat is None or ago > 3 * HEARTBEAT_S:
                parts.append(f"actor {actor}: silent for {ago:.0f} s, so dead or hung")
            elif heartbeat.get("waiting_for_weights"):
                parts.append(f"actor {actor}: alive, waiting for the trainer's weights")
            elif heartbeat.get("blocked"):
                parts.append(f"actor {actor}: alive but blocked by the staleness bound (it holds "
                             f"weights of version {heartbeat['version']} at trainer step "
                             f"{step}; its claim {heartbeat['claimed']}, the run's limit "
                             f"{heartbeat['limit']}): the trainer's weights do not reach it, or "
                             "admission is miscounted")
            else:
                parts.append(f"actor {actor}: alive, generating ({heartbeat['in_flight']} "
                             "sequences in flight) but finishing none")
        return "; ".join(parts) + "."


def stale_bound(cfg: Config) -> int | None:
    """The lag past which the trainer drops a group (None: it drops none for staleness)."""
    return cfg.actor.max_lag if cfg.mode == "pipeline" and cfg.trainer.drop_stale else None


def is_stale(group: Group, step: int, max_lag: int | None) -> bool:
    """Whether the trainer at `step` drops `group` for its lag (None: no bound)."""
    return is_stale_version(oldest_version(group), step, max_lag)


def is_stale_version(oldest: int, step: int, max_lag: int | None) -> bool:
    """`is_stale` of a group whose oldest token was made by weights of version `oldest`
    (deterministic mode's actors apply it too: pipelinerl.run.replay.TrainerMirror)."""
    return max_lag is not None and step - oldest > max_lag


def oldest_version(group: Group) -> int:
    return min(min(s.model_versions()) for s in group.samples if s.token_ids)


def _validate(group: Group, group_size: int) -> None:
    attempts = len(set(attempt_index(group.samples)))  # an episode's branches: one attempt
    if attempts != group_size:
        raise ValueError(f"group {group.group_id} has {attempts} attempts, expected {group_size}")
    for sample in group.samples:
        tokens = len(sample.token_ids)
        if not tokens or not tokens == len(sample.logprobs) == len(sample.versions):
            raise ValueError(f"group {group.group_id}: token, log-prob and version lists differ "
                             "in length")
        mask = sample.model_mask
        if mask is not None and (len(mask) != tokens or not any(mask)):
            raise ValueError(f"group {group.group_id}: model_mask does not match its tokens or "
                             "marks none")
