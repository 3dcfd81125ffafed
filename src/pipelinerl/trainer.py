"""The trainer role: takes finished groups from the stream, takes optimizer steps, publishes
weights.

Loop (paper, "Trainer"): take B samples from the stream, compute group advantages, recompute
log-probs with packing, REINFORCE with truncated importance weights (or PPO-clip), AdamW with
gradient clipping, then publish the new weights (version = optimizer steps taken).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections import Counter
from datetime import timedelta
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator

import torch
import torch.distributed as dist
from tqdm import tqdm

from pipelinerl.attempts import record_resume, valid_upto
from pipelinerl.config import Config, TrainerConfig
from pipelinerl.parallel import (
    GatheredWeights,
    full_state_dict,
    is_sharded,
    load_shards,
    shard_frozen,
    wrap_model,
)
from pipelinerl.rl.attention import set_packed_attention
from pipelinerl.rl.schedule import continue_schedule, make_scheduler
from pipelinerl.streams.base import StreamReader
from pipelinerl.sync.base import CastWeights, RejoinableSender, WeightSender
from pipelinerl.types import HEARTBEAT_S, Group, Sample, attempt_index

log = logging.getLogger(__name__)



@dataclass
class BatchSource:
    """Pulls whole groups from the stream; drops (and counts) groups beyond the lag bound,
    groups of negative lag (another run's) and malformed records. Every drop gives the group's
    place back to its actor's admission count (`returned`, sent on the control stream), so
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
    dropped: Counter = field(default_factory=Counter)
    dropped_ids: dict[str, list[str]] = field(default_factory=dict)  # by reason, until taken
    returned: Counter = field(default_factory=Counter)  # actor id -> places given back
    returned_changed: bool = False
    # Sends `returned` to the actors (the control stream). Called whenever the source is about
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
                "returned": {str(k): v for k, v in self.returned.items()}}

    def restore(self, snapshot: dict[str, Any]) -> None:
        """After opening the reader at snapshot["offsets"]."""
        self.buffer = [Group.from_dict(d) for d in snapshot["buffered"]]
        self.dropped = Counter(snapshot["dropped"])
        self.trimmed = snapshot.get("trimmed", 0)
        self.returned = Counter({int(k): v for k, v in snapshot["returned"].items()})
        self.returned_changed = True  # the actors of the new attempt learn it at once

    def _give_back(self, actor_id: int, reason: str, group_id: str) -> None:
        self.dropped[reason] += 1
        self.dropped_ids.setdefault(reason, []).append(group_id)
        self.returned[actor_id] += 1
        self.returned_changed = True

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
        if self.max_lag is not None and step - _oldest_version(group) > self.max_lag:
            return "stale"
        return None

    def take_dropped_ids(self) -> dict[str, list[str]]:
        """Group ids dropped since the last call, by reason (trained.jsonl's `dropped`)."""
        ids, self.dropped_ids = self.dropped_ids, {}
        return ids

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
                    continue
                batch.append(group)
                last_usable = time.monotonic()
            if len(batch) == n_groups:
                break
            self._announce_returned()
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
        self._announce_returned()
        return batch

    def _announce_returned(self) -> None:
        if self.returned_changed and self.announce is not None:
            self.announce(dict(self.returned))
            self.returned_changed = False

    def actors_report(self, step: int) -> str:
        """What each actor last said: blocked (alive, admitting nothing), busy, or silent."""
        now = time.monotonic()
        if not self.heartbeats and not self.last_group:
            return "No actor has written anything: none started, or all died at start."
        parts = []
        for actor in sorted({*self.heartbeats, *self.last_group}):
            heard, beat = self.heartbeats.get(actor, (0.0, None))
            heard = max(heard, self.last_group.get(actor, 0.0))
            ago = now - heard
            if beat is None or ago > 3 * HEARTBEAT_S:
                parts.append(f"actor {actor}: silent for {ago:.0f} s, so dead or hung")
            elif beat.get("waiting_for_weights"):
                parts.append(f"actor {actor}: alive, waiting for the trainer's weights")
            elif beat.get("blocked"):
                parts.append(f"actor {actor}: alive but blocked by the staleness bound (it holds "
                             f"weights of version {beat['version']} at trainer step {step}; its "
                             f"claim {beat['claimed']}, the run's limit {beat['limit']}): the "
                             "trainer's weights do not reach it, or admission is miscounted")
            else:
                parts.append(f"actor {actor}: alive, generating ({beat['in_flight']} sequences "
                             "in flight) but finishing none")
        return "; ".join(parts) + "."


def stale_bound(cfg: Config) -> int | None:
    """The lag past which the trainer drops a group (None: it drops none for staleness)."""
    return cfg.actor.max_lag if cfg.mode == "pipeline" and cfg.trainer.drop_stale else None


def _oldest_version(group: Group) -> int:
    return min(min(s.model_versions()) for s in group.samples if s.token_ids)


def _validate(group: Group, group_size: int) -> None:
    attempts = len(set(attempt_index(group.samples)))  # an episode's branches: one attempt
    if attempts != group_size:
        raise ValueError(f"group {group.group_id} has {attempts} attempts, expected {group_size}")
    for s in group.samples:
        if not (len(s.token_ids) == len(s.logprobs) == len(s.versions)) or not s.token_ids:
            raise ValueError(f"group {group.group_id}: token, log-prob and version lists differ in length")
        if s.model_mask is not None and (len(s.model_mask) != len(s.token_ids) or not any(s.model_mask)):
            raise ValueError(f"group {group.group_id}: model_mask does not match its tokens or marks none")


def trainer_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights by Hugging Face name (unwrapping DistributedDataParallel's `module.`; with LoRA,
    the base weights merged with the adapters)."""
    from pipelinerl.models.lora import is_lora, merged_weights

    if is_lora(model):
        return merged_weights(model)
    model = getattr(model, "module", model)
    return {name: t.detach() for name, t in model.state_dict().items()}


class Trainer:
    def __init__(self, cfg: Config, model: torch.nn.Module, source: BatchSource | None,
                 sender: WeightSender | None) -> None:
        self.cfg = cfg
        self.model = model
        self.source = source
        self.sender = sender
        if source is not None:
            source.idle = self.serve_rejoined
        tc = cfg.trainer
        self.optimizer = make_optimizer(model, tc)
        self.scheduler = make_scheduler(self.optimizer, tc)
        # The KL penalty's reference: the starting model, frozen; loaded only when used.
        self.ref_model: torch.nn.Module | None = None
        if tc.loss.kl_coef > 0:
            from pipelinerl.models.hf import load_model

            if is_sharded(model):  # built empty, then filled shard by shard as the model
                ref = load_model(cfg.model.path, dtype=torch.float32, device="meta").eval()
            else:
                param = next(model.parameters())
                ref = load_model(cfg.model.path, dtype=param.dtype, device=param.device).eval()
            set_packed_attention(ref, tc)
            self.ref_model = (
                load_shards(shard_frozen(ref, tc.fsdp, tc.device), cfg.model.path, tc.fsdp,
                            tc.device)
                if is_sharded(model) else ref.requires_grad_(False))
        self.step = 0  # optimizer steps taken = version of the weights the trainer holds
        self.samples_trained = 0
        self.started_at = time.monotonic()
        self.compute_s = 0.0
        self.publish_s = 0.0
        self.tokens_trained = 0
        self.success_ema: float | None = None
        self.published_version = 0  # version 0 is the model every role starts from
        self.last_record = (0.0, 0.0)  # (elapsed s, stream wait s) at the previous step record

    # -- checkpoints (pipelinerl.checkpoint) ------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any]:
        """The JSON part of a checkpoint (rank 0's: it alone reads the stream)."""
        return {"attempt": self.cfg.attempt,
                "samples_trained": self.samples_trained, "tokens_trained": self.tokens_trained,
                "elapsed_s": time.monotonic() - self.started_at, "compute_s": self.compute_s,
                "success_ema": self.success_ema,
                "source": self.source.snapshot() if self.source is not None else None}

    def save_checkpoint(self, tokenizer: Any) -> Path:
        """Write a checkpoint; then, unless stream.keep_all, delete the rollouts before its
        reader offsets: no resume goes back before the newest checkpoint."""
        from pipelinerl.checkpoint import save_checkpoint

        state = self.checkpoint_state()
        path = save_checkpoint(self.cfg.run_dir, self.step, self.model, tokenizer, self.optimizer,
                               self.scheduler, state, self.cfg.trainer.checkpoint_keep)
        log.info("checkpoint of step %d written to %s", self.step, path)
        if self.source is not None and not self.cfg.stream.keep_all:
            self.source.trimmed += self.source.reader.trim(state["source"]["offsets"])
        return path

    def resume(self, path: Path | None) -> None:
        """Continue from checkpoint `path` (None: none was complete, start again from the
        starting model), as attempt cfg.attempt. The stream reader must already stand at the
        checkpoint's offsets; the source gets back what was read and not trained."""
        from pipelinerl.checkpoint import load_checkpoint

        state: dict[str, Any] = {"samples_trained": 0, "tokens_trained": 0,
                                 "elapsed_s": 0.0, "compute_s": 0.0, "success_ema": None,
                                 "source": None, "step": 0}
        if path is not None:
            state = load_checkpoint(path, self.model, self.optimizer, self.scheduler)
        self.step = state["step"]
        for change in continue_schedule(self.scheduler, self.cfg.trainer):
            log.warning("resume: %s", change)
        self.published_version = -1  # this attempt's channel holds nothing yet
        self.samples_trained, self.tokens_trained = state["samples_trained"], state["tokens_trained"]
        self.started_at = time.monotonic() - state["elapsed_s"]  # time_s continues
        self.compute_s, self.success_ema = state["compute_s"], state["success_ema"]
        if self.source is not None:  # rank 0: it alone reads the stream and keeps the history
            if state["source"] is not None:
                self.source.restore(state["source"])
            self.source.returned_changed = True  # the new attempt's actors learn it at once
            self.last_record = (state["elapsed_s"], self.source.wait_s)
            resumes = record_resume(self.cfg.run_dir, self.cfg.attempt, self.step)
            self.source.valid_upto = valid_upto(resumes)

    def batches(self) -> Iterator[list[Group] | None]:
        """Yields one batch of groups per optimizer step, on the configured schedule; None once
        trainer.max_time_s runs out while it waits for groups (a wait never overruns it)."""
        assert self.source is not None, "only trainer rank 0 reads the stream"
        n_groups = self.cfg.trainer.batch_size // self.cfg.actor.group_size
        max_time_s = self.cfg.trainer.max_time_s
        deadline = self.started_at + max_time_s if max_time_s else None
        if self.cfg.mode == "pipeline":
            while True:
                yield self.source.take(n_groups, self.step, deadline)
        g = self.cfg.conventional_g
        while True:
            # Conventional RL: the whole round of B*G samples is generated with frozen weights
            # before the first of its G optimizer steps.
            round_groups = self.source.take(n_groups * g, self.step, deadline)
            if round_groups is None:
                yield None
                continue
            for i in range(g):
                yield round_groups[i * n_groups:(i + 1) * n_groups]

    def train_step(self, groups: list[Group], num_sequences: int | None = None) -> dict[str, Any]:
        """One optimizer step on `groups` (this rank's shard of a step of `num_sequences`)."""
        from pipelinerl.rl.step import rl_step

        t0 = time.monotonic()
        metrics = rl_step(self.model, self.optimizer, groups, self.cfg, trainer_version=self.step,
                          num_sequences=num_sequences, ref_model=self.ref_model)
        self.scheduler.step()
        self.compute_s += time.monotonic() - t0
        self.step += 1
        self.samples_trained += num_sequences or sum(len(g.samples) for g in groups)
        self.tokens_trained += metrics["input_tokens"]
        return metrics

    def maybe_publish(self) -> None:
        """Every rank calls it (a sharded model's weights are gathered by all); rank 0 sends."""
        every = self.cfg.conventional_g if self.cfg.mode == "conventional" else self.cfg.trainer.publish_every
        if self.step % every == 0:
            self._publish()

    def publish_final(self) -> bool:
        """Publish the final weights unless this step's already went out (every rank calls
        it); False without a channel."""
        if self.published_version != self.step:
            self._publish()
        return self.sender is not None

    def serve_rejoined(self) -> None:
        """Rank 0, while it waits for groups: an actor restarted since the last publish gets
        the current weights now (the last version again, or this step's), not at the next
        publish. It generates nothing before, so with one actor that publish never came. A
        sharded trainer's other ranks wait in `share_groups`: they are told to gather."""
        if not (isinstance(self.sender, RejoinableSender) and self.sender.rejoined()):
            return
        log.warning("a restarted actor waits for weights: publishing version %d to it",
                    self.step)
        if is_sharded(self.model) and dist.get_world_size() > 1:
            dist.broadcast_object_list([_PUBLISH_AGAIN], src=0)
        self._publish()

    def _publish(self) -> None:
        t0 = time.monotonic()
        # In the engines' dtype: what they hold, half of float32's bytes for bf16.
        dtype = getattr(torch, self.cfg.engine.dtype)
        if is_sharded(self.model):
            weights = GatheredWeights(self.model, dtype=dtype)
            if self.sender is None:
                weights.follow()
            else:  # the sender may gather again: a transfer cut by a dead actor is resent
                with weights.lead():
                    self.sender.publish(weights, self.step)
        elif self.sender is not None:
            self.sender.publish(CastWeights(trainer_weights(self.model), dtype), self.step)
        self.publish_s = time.monotonic() - t0
        self.published_version = self.step

    def step_record(self, groups: list[Group], metrics: dict[str, Any]) -> dict[str, Any]:
        assert self.source is not None
        samples: list[Sample] = [s for g in groups for s in g.samples]
        success = sum(s.success for s in samples) / len(samples)
        self.success_ema = success if self.success_ema is None else 0.9 * self.success_ema + 0.1 * success
        elapsed = time.monotonic() - self.started_at
        record: dict[str, Any] = {
            "time_s": elapsed,
            "reward": sum(s.reward for s in samples) / len(samples),
            "success": success,
            "success_ema": self.success_ema,
            "samples_trained": self.samples_trained,
            **completion_stats(samples),
            "trainer_tokens_per_s": self.tokens_trained / max(self.compute_s, 1e-9),
            "trainer_wait_frac": self.source.wait_s / max(elapsed, 1e-9),
            # Since the previous step: a conventional round's first step waits for the whole
            # round's generation, the pipeline's steps for a batch's worth of groups.
            "trainer_idle_frac": (self.source.wait_s - self.last_record[1])
            / max(elapsed - self.last_record[0], 1e-9),
            "publish_s": self.publish_s,
            **{f"dropped_{k}": v for k, v in self.source.dropped.items()},
            **metrics,
        }
        record.update(_aggregate_actor_stats(self.source.actor_stats))
        self.last_record = (elapsed, self.source.wait_s)
        return record


def completion_stats(samples: list[Sample]) -> dict[str, float]:
    """Completion lengths, and the fraction cut at engine.max_new_tokens (finish_reason
    "length": no stop token, the answer may be incomplete)."""
    lengths = [len(s.token_ids) for s in samples]
    stats = {
        "completion_len_mean": sum(lengths) / len(lengths),
        "completion_len_max": max(lengths),
        "completion_truncated_frac": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }
    if any(s.model_mask is not None for s in samples):  # multi-turn rollouts
        env_tokens = sum(m.count(False) for s in samples if (m := s.model_mask) is not None)
        stats["turns_mean"] = sum(s.turns for s in samples) / len(samples)
        stats["env_tokens_frac"] = env_tokens / max(sum(lengths), 1)
    return stats


def make_optimizer(model: torch.nn.Module, tc: TrainerConfig) -> torch.optim.AdamW:
    """AdamW over what trains (with LoRA: the adapters, so its state is that small). Fused
    (one kernel for all parameters) unless the model is sharded: on this CPU 6x faster than
    the default for-each update (68M parameters: 0.09 s vs 0.52 s), on a GPU far fewer launches.
    FSDP2's DTensor parameters keep the for-each update."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=tc.lr,
                             betas=tc.betas, weight_decay=tc.weight_decay,
                             fused=None if is_sharded(model) else True)


def progress_bar(cfg: Config, enabled: bool) -> tqdm:
    """Counts wall-clock seconds when the run is bounded by trainer.max_time_s (its step bound
    is then usually a far-off default, and a bar over steps would estimate hours), else steps."""
    tc = cfg.trainer
    if tc.max_time_s:
        return tqdm(total=round(tc.max_time_s), unit="s", desc="train", dynamic_ncols=True,
                    disable=not enabled)
    return tqdm(total=tc.max_steps, unit="step", desc="train", dynamic_ncols=True,
                disable=not enabled)


def advance_progress(bar: tqdm, cfg: Config, elapsed_s: float) -> None:
    """One optimizer step done, `elapsed_s` after the trainer started."""
    if cfg.trainer.max_time_s:
        bar.update(min(round(elapsed_s), bar.total) - bar.n)
    else:
        bar.update(1)


def _aggregate_actor_stats(per_actor: dict[int, dict[str, float]]) -> dict[str, float]:
    if not per_actor:
        return {}
    stats = list(per_actor.values())
    keys = {k for s in stats for k in s}
    out: dict[str, float] = {}
    for key in keys:
        values = [s.get(key, 0.0) for s in stats]
        total_keys = ("tokens_per_s", "weight_updates", "groups_published")
        agg = sum(values) if key in total_keys or key.startswith("skipped_") else sum(values) / len(values)
        out[f"actor_{key}"] = agg
    return out


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
        dist.init_process_group(backend=backend, timeout=timeout)
    return rank, world, device


# share_groups' payload when rank 0 publishes while it waits (Trainer.serve_rejoined).
_PUBLISH_AGAIN = "publish again"


def share_groups(groups: list[Group] | None, rank: int, world: int,
                 publish: Callable[[], None] | None = None) -> list[Group] | None:
    """Rank 0 read the step's groups; every rank gets its equal shard (groups are whole), or
    None when rank 0 got none (the time budget ran out while it waited). A sharded trainer's
    other ranks `publish` with rank 0 whenever it says so meanwhile."""
    if world == 1:
        return groups
    payload = [None if rank != 0 or groups is None else [g.to_dict() for g in groups]]
    dist.broadcast_object_list(payload, src=0)
    while payload[0] == _PUBLISH_AGAIN:
        assert publish is not None, "rank 0 publishes while waiting only when sharded"
        publish()
        dist.broadcast_object_list(payload, src=0)
    return None if payload[0] is None else [Group.from_dict(d) for d in payload[0][rank::world]]


def _write_trained(audit: IO[str], step: int, trained: list[str],
                   dropped: dict[str, list[str]]) -> None:
    """trained.jsonl's row: the groups trained at `step` and those dropped since the last row."""
    audit.write(json.dumps({"step": step, "trained": trained, "dropped": dropped}) + "\n")


def _out_of_time(cfg: Config, trainer: Trainer, world: int, device: str) -> bool:
    """The wall-clock budget is rank 0's call, so every rank stops after the same step."""
    if not cfg.trainer.max_time_s:
        return False
    over = time.monotonic() - trainer.started_at > cfg.trainer.max_time_s
    return _rank0_says(over, device) if world > 1 else over


def run_trainer(cfg: Config) -> None:
    from pipelinerl.checkpoint import CheckpointDue, agreed_latest_checkpoint, read_state
    from pipelinerl.eval_results import EvalResults, step_times
    from pipelinerl.metrics.logger import METRICS, MetricsLogger
    from pipelinerl.records import open_resumed
    from pipelinerl.models.hf import load_model, load_tokenizer
    from pipelinerl.roles import (
        check_run_id_unused,
        open_control_writer,
        open_eval_reader,
        open_rollout_reader,
        open_weight_sender,
        write_returned,
        write_stop,
        write_stop_unwinding,
    )

    torch.set_num_threads(cfg.trainer.threads)
    torch.manual_seed(cfg.trainer.seed)
    rank, world, device = init_distributed(
        cfg.trainer.device, timeout_s=1800.0 + (cfg.eval.final_timeout_s if cfg.eval.enabled else 0.0),
        sharded=cfg.trainer.strategy == "fsdp2")
    n_groups = cfg.trainer.batch_size // cfg.actor.group_size
    if n_groups % world:
        raise ValueError(f"trainer.batch_size / actor.group_size = {n_groups} groups per step "
                         f"cannot be split evenly over {world} trainer ranks")
    is_main = rank == 0
    run_dir = cfg.run_dir
    # A resumed run (attempt > 0) continues from its newest complete checkpoint, or from the
    # starting model when the crashed attempt wrote none.
    checkpoint = agreed_latest_checkpoint(run_dir) if cfg.attempt else None
    state = read_state(checkpoint)
    resume_step = (state or {}).get("step", 0) if cfg.attempt else None
    logger = audit = None
    if is_main:
        # Refused before anything loads: a finished run's id, or another launch's files.
        check_run_id_unused(cfg)
        logger = MetricsLogger(run_dir, cfg.metrics, cfg.name, cfg.model_dump(mode="json"),
                               resume_step=resume_step, attempt=cfg.attempt)
        audit = open_resumed(run_dir / "trained.jsonl", resume_step, cfg.attempt)
    # FSDP2: every rank builds the model empty (meta device), shards it, then receives its
    # shards of the weights from rank 0 (`load_shards`): no rank holds the whole model.
    fsdp = cfg.trainer.strategy == "fsdp2"
    model = load_model(cfg.model.path, dtype=torch.float32, device="meta" if fsdp else device)
    if cfg.model.lora is not None:
        from pipelinerl.models.lora import apply_lora

        model = apply_lora(model, cfg.model.lora)
    model.train()
    set_packed_attention(model, cfg.trainer)
    wrapped = wrap_model(model, cfg.trainer, device, world)
    sharded = is_sharded(wrapped)
    if sharded:
        load_shards(wrapped, cfg.model.path, cfg.trainer.fsdp, device)
    source = sender = control = evals = None
    if is_main:
        offsets = state["source"]["offsets"] if state and state["source"] else None
        control = open_control_writer(cfg)
        source = BatchSource(open_rollout_reader(cfg, offsets), cfg.actor.group_size,
                             stale_bound(cfg),
                             cfg.trainer.sample_timeout_s,
                             announce=functools.partial(write_returned, control, cfg))
        sender = open_weight_sender(cfg)
        if cfg.eval.enabled:
            evals = EvalResults(open_eval_reader(cfg), logger.log, cfg.attempt)
    trainer = Trainer(cfg, wrapped, source, sender)
    tokenizer = load_tokenizer(cfg.model.path)
    if resume_step is not None:
        trainer.resume(checkpoint)
        log.info("attempt %d resumes at step %d from %s", cfg.attempt, trainer.step,
                 checkpoint or "the starting model (no complete checkpoint)")
        # The actors of this attempt admit nothing before they hold these weights.
        if is_main or sharded:
            trainer.publish_final()
        if is_main:
            if evals is not None:
                # Versions of earlier attempts (deferred evaluation may still log them).
                evals.version_time.update(step_times(cfg.run_dir / METRICS))
                evals.made(trainer.step, time.monotonic() - trainer.started_at)
    due = CheckpointDue(cfg.trainer.checkpoint_every_steps, cfg.trainer.checkpoint_every_s,
                        trainer.step)
    round_steps = cfg.conventional_g if cfg.mode == "conventional" else 1

    def checkpoint_due(step: int) -> bool:
        # Conventional mode: only between rounds, where no generated round is half-trained.
        return due(step) and step % round_steps == 0

    batches = trainer.batches() if is_main else None
    bar = progress_bar(cfg, enabled=cfg.metrics.progress and is_main)
    stop_written = False
    try:
        while trainer.step < cfg.trainer.max_steps and not _out_of_time(cfg, trainer, world, device):
            groups = next(batches) if batches is not None else None
            shard = share_groups(groups, rank, world, trainer._publish)
            if shard is None:  # out of time while waiting for groups
                if is_main:  # groups dropped meanwhile are recorded, though no step follows
                    _write_trained(audit, trainer.step, [], trainer.source.take_dropped_ids())
                break
            metrics = trainer.train_step(shard, num_sequences=cfg.trainer.batch_size)
            if sharded or is_main:
                trainer.maybe_publish()
            if is_main:
                assert groups is not None and logger is not None and audit is not None
                record = trainer.step_record(groups, metrics)
                logger.log(trainer.step, record)
                _write_trained(audit, trainer.step, [g.group_id for g in groups],
                               trainer.source.take_dropped_ids())
            # After the step's records, which a resume from this checkpoint keeps.
            save = checkpoint_due(trainer.step) if is_main else False
            if sharded:
                save = _rank0_says(save, device)  # rank 0's clock decides; every rank writes
            if save:
                trainer.save_checkpoint(tokenizer)
                due.done(trainer.step)
            if not is_main:
                continue
            if evals is not None:
                evals.made(trainer.step, record["time_s"])
                evals.drain()
            advance_progress(bar, cfg, record["time_s"])
            bar.set_postfix(step=trainer.step, reward=f"{record['reward']:.2f}",
                            success=f"{record['success_ema']:.2f}",
                            ess=f"{record.get('ess', float('nan')):.3f}",
                            lag=f"{record.get('lag_mean', float('nan')):.2f}")
        if is_main or sharded:
            # Before the stop record: the actors, and after them the launcher, leave only once
            # the final weights are on disk, so a slow save is never cut short. The last
            # checkpoint lets `--resume` extend a finished run.
            _save_final(cfg, model, tokenizer, is_main)
            if trainer.step % round_steps == 0 and due.last_step != trainer.step:
                trainer.save_checkpoint(tokenizer)
            # The evaluator takes the final weights from the channel once the stop record
            # says they are there; the plot waits for its result.
            final_published = cfg.eval.enabled and trainer.publish_final()
        if is_main:
            write_stop(control, cfg, trainer.step, final_published=final_published)
            stop_written = True
            if final_published:
                evals.wait_final(cfg.eval.final_timeout_s)
            if cfg.metrics.plot:
                _plot(cfg, logger.path)
        if world > 1:
            # The other ranks wait for rank 0's save, so all leave the group together: a rank
            # that tore down its DDP model and group early left rank 0 hanging at exit.
            dist.barrier()
    finally:
        bar.close()
        if is_main:
            if not stop_written:
                write_stop_unwinding(control, cfg, trainer.step)
            control.close()
            if evals is not None:
                evals.reader.close()
            logger.close()
            audit.close()
            if sender is not None:
                sender.close()
        if dist.is_initialized():
            trainer.model = wrapped = None  # DDP's reducer goes before the group it uses
            dist.destroy_process_group()


def _save_final(cfg: Config, model: torch.nn.Module, tokenizer: Any, is_main: bool) -> None:
    """The trained model as `final/` (atomically); with LoRA, merged, and the adapter alone
    as `final_adapter/`. A sharded model is gathered to rank 0's memory, tensor by tensor
    (every rank calls this)."""
    from pipelinerl.models.hf import save_model
    from pipelinerl.models.lora import to_save

    state = full_state_dict(model) if is_sharded(model) else None
    if not is_main:
        return
    final = save_model(to_save(model, cfg.run_dir / "final_adapter"),
                       tokenizer, cfg.run_dir / "final", state_dict=state)
    log.info("saved final weights to %s", final)


def _rank0_says(flag: bool, device: str) -> bool:
    """Rank 0's `flag` on every rank (a decision that reads rank 0's clock)."""
    t = torch.tensor([float(flag)], device=device)  # NCCL broadcasts no CPU tensor
    dist.broadcast(t, src=0)
    return bool(t.item())


def _plot(cfg: Config, metrics_path: Path) -> None:
    from pipelinerl.records import read_rows
    from pipelinerl.metrics.plot import plot_run

    plot_run(read_rows(metrics_path), cfg.run_dir / "metrics.png", title=cfg.name)
