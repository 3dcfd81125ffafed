"""The trainer role: takes finished groups from the stream, takes optimizer steps, publishes
weights.

Loop (paper, "Trainer"): take B samples from the stream, compute group advantages, recompute
log-probs with packing, REINFORCE with truncated importance weights (or PPO-clip), AdamW with
gradient clipping, then publish the new weights (version = optimizer steps taken).

`run_trainer` is the recipe every rank runs: `TrainerRun.setup`, `train`, `finish`, `close`.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from tqdm import tqdm

from pipelinerl.config import Config, TrainerConfig, save_config
from pipelinerl.metrics.logger import METRICS, MetricsLogger
from pipelinerl.models.hf import load_model, load_tokenizer, save_model
from pipelinerl.models.lora import apply_lora, is_lora, merged_weights, to_save
from pipelinerl.records import read_rows
from pipelinerl.rl.attention import set_packed_attention
from pipelinerl.rl.batches import BatchSource, stale_bound
from pipelinerl.rl.fused import use_liger
from pipelinerl.rl.parallel import (
    GatheredWeights,
    full_state_dict,
    is_sharded,
    load_shards,
    shard_frozen,
    wrap_model,
)
from pipelinerl.rl.process_group import (
    call_to_publish,
    init_distributed,
    rank0_says,
    share_groups,
)
from pipelinerl.rl.schedule import continue_schedule, make_scheduler
from pipelinerl.rl.step import rl_step
from pipelinerl.roles.wiring import (
    check_run_id_unused,
    open_control_writer,
    open_eval_reader,
    open_rollout_reader,
    open_weight_sender,
    write_returned,
    write_stop,
    write_stop_unwinding,
)
from pipelinerl.run.attempts import record_resume, valid_upto
from pipelinerl.run.checkpoint import (
    CheckpointDue,
    agreed_latest_checkpoint,
    load_checkpoint,
    read_state,
    save_checkpoint,
)
from pipelinerl.run.eval_results import EvalResults, step_times
from pipelinerl.run.replay import (
    MergedReader,
    SupersededFilter,
    checkpoint_to_protect,
    eval_due,
    eval_schedule,
    is_superseded,
    resume_point,
    resume_points,
    superseded_after,
    use_deterministic_torch,
    weights_sha256,
)
from pipelinerl.run.trainer_records import TrainerRecords
from pipelinerl.streams import Writer
from pipelinerl.sync.base import CastWeights, RejoinableSender, WeightSender
from pipelinerl.types import Group, Sample

log = logging.getLogger(__name__)


def run_trainer(cfg: Config) -> None:
    """The trainer role on this rank: build, train to trainer.max_steps (or max_time_s), save
    the final weights and stop the run."""
    run = TrainerRun.setup(cfg)
    try:
        run.train()
        run.finish()
    finally:
        run.close()


@dataclass
class TrainerRun:
    """One rank's run: what `setup` built, for `train`, `finish` and `close`. Rank 0 alone reads
    the stream and writes the records: the fields that are None on the other ranks."""

    cfg: Config
    rank: int
    world: int
    device: str
    model: torch.nn.Module  # unwrapped: a DDP wrapper lives in trainer.model alone (see close)
    sharded: bool  # FSDP2: gathering weights, saving and publishing involve every rank
    trainer: Trainer
    tokenizer: Any
    due: CheckpointDue
    bar: tqdm
    batches: Iterator[list[Group] | None] | None
    records: TrainerRecords | None  # metrics.jsonl, trained.jsonl, samples.jsonl
    control: Writer | None  # the control stream: places given back, the stop record
    evals: EvalResults | None  # the evaluator's results (eval.enabled)
    stop_written: bool = False

    @classmethod
    def setup(cls, cfg: Config) -> TrainerRun:
        """Ranks, rank 0's records, the model, rank 0's channels, the trainer, the resume."""
        torch.set_num_threads(cfg.trainer.threads)
        torch.manual_seed(cfg.trainer.seed)
        if cfg.deterministic.enabled:
            use_deterministic_torch()
        rank, world, device = join_ranks(cfg)
        is_main = rank == 0
        # A resumed run (attempt > 0) continues from its newest complete checkpoint, or from the
        # starting model when the crashed attempt wrote none; a deterministic one from the
        # checkpoint the launcher paired with the actor's snapshot.
        checkpoint = resume_checkpoint(cfg) if cfg.attempt else None
        state = read_state(checkpoint)
        resume_step = (state or {}).get("step", 0) if cfg.attempt else None
        records = open_records(cfg, resume_step) if is_main else None
        model, wrapped = build_model(cfg, device, world)
        source = sender = control = evals = None
        if records is not None:
            offsets = state["source"]["offsets"] if state and state["source"] else None
            source, sender, control, evals = open_channels(cfg, offsets, records.metrics)
        trainer = Trainer(cfg, wrapped, source, sender)
        tokenizer = load_tokenizer(cfg.model.path)
        sharded = is_sharded(wrapped)
        if resume_step is not None:
            resume_attempt(cfg, trainer, checkpoint, evals, publish=is_main or sharded)
        due = CheckpointDue(cfg.trainer.checkpoint_every_steps, cfg.trainer.checkpoint_every_s,
                            trainer.step, aligned=cfg.deterministic.enabled)
        if records is not None:
            records.open_samples(cfg, tokenizer, resume_step)
        return cls(cfg=cfg, rank=rank, world=world, device=device, model=model, sharded=sharded,
                   trainer=trainer, tokenizer=tokenizer, due=due,
                   bar=progress_bar(cfg, enabled=cfg.metrics.progress and is_main),
                   batches=trainer.batches() if is_main else None, records=records,
                   control=control, evals=evals)

    @property
    def is_main(self) -> bool:
        """Rank 0: it alone reads the stream, sends the weights and writes the records."""
        return self.rank == 0

    @property
    def round_steps(self) -> int:
        """Optimizer steps per generated round: a conventional round's G, else 1."""
        return self.cfg.conventional_g if self.cfg.mode == "conventional" else 1

    def train(self) -> None:
        """Optimizer steps until trainer.max_steps, or until the time budget runs out."""
        trainer = self.trainer
        while trainer.step < self.cfg.trainer.max_steps and not self.out_of_time():
            groups = next(self.batches) if self.batches is not None else None
            shard = share_groups(groups, self.rank, self.world, trainer.publish)
            if shard is None:  # out of time while waiting for groups
                if self.is_main:  # groups dropped meanwhile are recorded, though no step follows
                    self.write_trained([])
                break
            keep = self.records.groups_to_keep(len(shard)) if self.records is not None else 0
            metrics = trainer.train_step(shard, keep_groups=keep)
            scored = metrics.pop("scored", None)
            if self.sharded or self.is_main:
                trainer.maybe_publish()
            if self.is_main:
                self.await_evaluator()
            record = self.record_step(groups, metrics) if self.is_main else None
            if self.records is not None and scored is not None:
                self.records.write_samples(trainer.step, shard[:keep], scored)
            self.checkpoint_if_due()  # after the step's records, which a resume from it keeps
            if record is not None:
                self.report_step(record)

    def await_evaluator(self) -> None:
        """Deterministic mode: the evaluator takes each version its schedule names before a
        newer one can replace it in the channel (shared memory holds only the newest)."""
        step = self.trainer.step
        if (self.evals is not None and self.cfg.deterministic.enabled
                and self.trainer.published_version == step and eval_due(self.cfg, step)):
            self.evals.await_staged(step, self.cfg.sync.timeout_s)

    def out_of_time(self) -> bool:
        """The wall-clock budget is rank 0's call, so every rank stops after the same step."""
        if not self.cfg.trainer.max_time_s:
            return False
        over = time.monotonic() - self.trainer.started_at > self.cfg.trainer.max_time_s
        return rank0_says(over, self.device) if self.world > 1 else over

    def record_step(self, groups: list[Group] | None, metrics: dict[str, Any]) -> dict[str, Any]:
        """Rank 0: the step's row in metrics.jsonl and in trained.jsonl."""
        assert groups is not None and self.records is not None
        source = self.trainer.source
        assert source is not None
        record = self.trainer.step_record(groups, metrics)
        self.records.write_step(self.trainer.step, record, [g.group_id for g in groups], source)
        return record

    def write_trained(self, trained: list[str]) -> None:
        """trained.jsonl's row without a step's metrics (out of time waiting for groups)."""
        assert self.records is not None and self.trainer.source is not None
        self.records.write_trained(self.trainer.step, trained, self.trainer.source)

    def checkpoint_if_due(self) -> None:
        """Rank 0's clock decides; with a sharded model every rank writes its shards."""
        step = self.trainer.step
        # Conventional mode: only between rounds, where no generated round is half-trained.
        save = self.is_main and self.due(step) and step % self.round_steps == 0
        if self.sharded:
            save = rank0_says(save, self.device)
        if save:
            self.trainer.save_checkpoint(self.tokenizer)
            self.due.done(step)

    def report_step(self, record: dict[str, Any]) -> None:
        """Rank 0: the evaluator's results so far into the metrics, the progress bar on."""
        if self.evals is not None:
            self.evals.made(self.trainer.step, record["time_s"])
            self.evals.drain()
        advance_progress(self.bar, self.cfg, record["time_s"])
        self.bar.set_postfix(step=self.trainer.step, reward=f"{record['reward']:.2f}",
                             success=f"{record['success_ema']:.2f}",
                             ess=f"{record.get('ess', float('nan')):.3f}",
                             lag=f"{record.get('lag_mean', float('nan')):.2f}")

    def finish(self) -> None:
        """The final weights and checkpoint, the stop record, the final evaluation and the
        plot; then every rank leaves together."""
        trainer, final_published = self.trainer, False
        if self.is_main or self.sharded:
            # Before the stop record: the actors, and after them the launcher, leave only once
            # the final weights are on disk, so a slow save is never cut short. The last
            # checkpoint lets `--resume` extend a finished run.
            save_final(self.cfg, self.model, self.tokenizer, self.is_main)
            if self.cfg.deterministic.enabled and self.is_main:
                write_weights_hash(self.cfg.run_dir, trainer_weights(self.trainer.model))
            if trainer.step % self.round_steps == 0 and self.due.last_step != trainer.step:
                trainer.save_checkpoint(self.tokenizer)
            # The evaluator takes the final weights from the channel once the stop record
            # says they are there; the plot waits for its result.
            final_published = self.cfg.eval.enabled and trainer.publish_final()
        if self.is_main:
            assert self.control is not None and self.records is not None
            write_stop(self.control, self.cfg, trainer.step, final_published=final_published)
            self.stop_written = True
            if final_published and self.evals is not None:
                self.evals.wait_final(self.cfg.eval.final_timeout_s)
            if self.cfg.metrics.plot:
                _plot(self.cfg, self.records.metrics.path)
        if self.world > 1:
            # The other ranks wait for rank 0's save, so all leave the group together: a rank
            # that tore down its DDP model and group early left rank 0 hanging at exit.
            dist.barrier()

    def close(self) -> None:
        """Whatever happened: a stop record (an unwinding one unless `finish` wrote it), every
        channel and record closed, the process group left."""
        self.bar.close()
        if self.is_main:
            assert self.control is not None and self.records is not None
            if not self.stop_written:
                write_stop_unwinding(self.control, self.cfg, self.trainer.step)
            self.control.close()
            if self.evals is not None:
                self.evals.reader.close()
            self.records.close()
            if self.trainer.sender is not None:
                self.trainer.sender.close()
        if dist.is_initialized():
            self.trainer.model = None  # DDP's reducer goes before the group it uses
            dist.destroy_process_group()


def join_ranks(cfg: Config) -> tuple[int, int, str]:
    """(rank, world, device) of this trainer process; a step's groups split evenly over ranks."""
    # The final barrier waits for rank 0's final evaluation too.
    final_eval_s = cfg.eval.final_timeout_s if cfg.eval.enabled else 0.0
    broadcast = cfg.sync.backend == "broadcast"
    rank, world, device = init_distributed(
        cfg.trainer.device, timeout_s=1800.0 + final_eval_s,
        sharded=cfg.trainer.strategy == "fsdp2",
        weight_store=cfg.sync.init_method if broadcast else "", interface=cfg.sync.interface)
    n_groups = cfg.trainer.batch_size // cfg.actor.group_size
    if n_groups % world:
        raise ValueError(f"trainer.batch_size / actor.group_size = {n_groups} groups per step "
                         f"cannot be split evenly over {world} trainer ranks")
    return rank, world, device


def open_records(cfg: Config, resume_step: int | None) -> TrainerRecords:
    """Rank 0's metrics.jsonl and trained.jsonl, cut back to `resume_step` on a resume."""
    # Refused before anything loads: a finished run's id, or another launch's files.
    check_run_id_unused(cfg)
    # A trainer started by hand (docs/multinode.md) has no launcher to write it, and
    # `pipelinerl audit RUN_DIR` reads it.
    if not (cfg.run_dir / "config.yaml").exists():
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, cfg.run_dir / "config.yaml")
    return TrainerRecords.open(cfg, resume_step)


def build_model(cfg: Config, device: str, world: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model to train (with LoRA adapters when configured), and the same laid over the
    ranks (`wrap_model`: DDP's wrapper, or the model itself sharded by FSDP2)."""
    # FSDP2: every rank builds the model empty (meta device), shards it, then receives its
    # shards of the weights from rank 0 (`load_shards`): no rank holds the whole model.
    fsdp = cfg.trainer.strategy == "fsdp2"
    model = load_model(cfg.model.path, dtype=torch.float32, device="meta" if fsdp else device)
    if cfg.model.lora is not None:
        model = apply_lora(model, cfg.model.lora)
    model.train()
    set_packed_attention(model, cfg.trainer)
    if cfg.trainer.liger:
        use_liger(model, device)
    wrapped = wrap_model(model, cfg.trainer, device, world)
    if is_sharded(wrapped):
        load_shards(wrapped, cfg.model.path, cfg.trainer.fsdp, device)
    return model, wrapped


def resume_checkpoint(cfg: Config) -> Path | None:
    """The checkpoint a resumed attempt continues from (None: the starting model)."""
    if not cfg.deterministic.enabled:
        return agreed_latest_checkpoint(cfg.run_dir)
    chosen = resume_point(cfg.run_dir, cfg.attempt).checkpoint
    return Path(chosen) if chosen else None


def open_channels(cfg: Config, offsets: dict | None, metrics: MetricsLogger | None
                  ) -> tuple[BatchSource, WeightSender, Writer, EvalResults | None]:
    """Rank 0's channels: the rollouts (read from the checkpoint's `offsets`), the weights, the
    control stream (places given back) and the evaluator's results (logged into `metrics`)."""
    control = open_control_writer(cfg)
    merged = cfg.deterministic.enabled and cfg.actor.num_actors > 1
    reader = open_rollout_reader(cfg, offsets["inner"] if merged and offsets else offsets)
    if cfg.deterministic.enabled and cfg.attempt:
        # Groups that a resumed actor published again: only the later copies count.
        reader = SupersededFilter(reader, superseded_after(resume_points(cfg.run_dir)))
    if merged:  # the actors' groups in one order, whatever their timing
        reader = MergedReader(reader, cfg.actor.num_actors, offsets)
    source = BatchSource(reader, cfg.actor.group_size,
                         stale_bound(cfg), cfg.trainer.sample_timeout_s,
                         announce=functools.partial(write_returned, control, cfg),
                         keep_dropped=cfg.metrics.samples_per_step)
    sender = open_weight_sender(cfg)
    evals = None
    if cfg.eval.enabled:
        assert metrics is not None
        evals = EvalResults(open_eval_reader(cfg), metrics.log, cfg.attempt,
                            hold=cfg.deterministic.enabled)
    return source, sender, control, evals


def resume_attempt(cfg: Config, trainer: Trainer, checkpoint: Path | None,
                   evals: EvalResults | None, publish: bool) -> None:
    """Attempt cfg.attempt continues from `checkpoint` (None: from the starting model) and
    `publish`es its weights at once: its actors admit nothing before they hold them."""
    trainer.resume(checkpoint)
    log.info("attempt %d resumes at step %d from %s", cfg.attempt, trainer.step,
             checkpoint or "the starting model (no complete checkpoint)")
    if publish:
        trainer.publish_final()
    if evals is not None:
        # Versions of earlier attempts (deferred evaluation may still log them).
        evals.version_time.update(step_times(cfg.run_dir / METRICS))
        evals.made(trainer.step, time.monotonic() - trainer.started_at)


class Trainer:
    """The model in training: AdamW and its schedule, the optimizer steps taken (the version of
    the weights it holds), its checkpoints and its publishing of weights."""

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
        self.ref_model = reference_model(cfg, model) if tc.loss.kl_coef > 0 else None
        self.step = 0  # optimizer steps taken = version of the weights the trainer holds
        self.samples_trained = 0
        self.started_at = time.monotonic()
        self.compute_s = 0.0
        self.publish_s = 0.0
        self.tokens_trained = 0
        self.success_ema: float | None = None
        self.published_version = 0  # version 0 is the model every role starts from
        self.last_record = (0.0, 0.0)  # (elapsed s, stream wait s) at the previous step record

    # -- checkpoints (pipelinerl.run.checkpoint) ------------------------------------------------
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
        state = self.checkpoint_state()
        # Deterministic mode resumes only from a checkpoint the actor has a snapshot for (and
        # whose evaluations are done): the newest such one is kept (else the oldest whose
        # evaluations may still come), and the stream it reads from.
        paired = (checkpoint_to_protect(self.cfg.run_dir, self.cfg.actor.num_actors,
                                        eval_schedule(self.cfg))
                  if self.cfg.deterministic.enabled else None)
        path = save_checkpoint(self.cfg.run_dir, self.step, self.model, tokenizer, self.optimizer,
                               self.scheduler, state, self.cfg.trainer.checkpoint_keep,
                               protect=paired)
        log.info("checkpoint of step %d written to %s", self.step, path)
        if self.source is not None and not self.cfg.stream.keep_all:
            offsets = state["source"]["offsets"]
            if self.cfg.deterministic.enabled:
                paired_state = read_state(paired)
                offsets = paired_state["source"]["offsets"] if paired_state else None
            if offsets is not None:
                self.source.trimmed += self.source.reader.trim(offsets)
        return path

    def resume(self, path: Path | None) -> None:
        """Continue from checkpoint `path` (None: none was complete, start again from the
        starting model), as attempt cfg.attempt. The stream reader must already stand at the
        checkpoint's offsets; the source gets back what was read and not trained."""
        state: dict[str, Any] = {"samples_trained": 0, "tokens_trained": 0,
                                 "elapsed_s": 0.0, "compute_s": 0.0, "success_ema": None,
                                 "source": None, "step": 0}
        if path is not None:
            state = load_checkpoint(path, self.model, self.optimizer, self.scheduler)
        self.step = state["step"]
        for change in continue_schedule(self.scheduler, self.cfg.trainer):
            log.warning("resume: %s", change)
        self.published_version = -1  # this attempt's channel holds nothing yet
        self.samples_trained = state["samples_trained"]
        self.tokens_trained = state["tokens_trained"]
        self.started_at = time.monotonic() - state["elapsed_s"]  # time_s continues
        self.compute_s, self.success_ema = state["compute_s"], state["success_ema"]
        if self.source is not None:  # rank 0: it alone reads the stream and keeps the history
            if state["source"] is not None:
                self.source.restore(state["source"])
            self.source.given_back_changed = True  # the new attempt's actors learn it at once
            self.last_record = (state["elapsed_s"], self.source.wait_s)
            resumes = record_resume(self.cfg.run_dir, self.cfg.attempt, self.step)
            if self.cfg.deterministic.enabled:
                # The weights a crashed attempt published are made again bit for bit; what a
                # resumed actor publishes again replaces its earlier copy (SupersededFilter).
                kept = superseded_after(resume_points(self.cfg.run_dir))
                self.source.buffer = [g for g in self.source.buffer
                                      if not is_superseded(g.attempt, g.actor_id, g.seq, kept)]
                if isinstance(self.source.reader, MergedReader):
                    point = resume_point(self.cfg.run_dir, self.cfg.attempt)
                    self.source.buffer = self.source.reader.resume_at(
                        point.seqs, self.source.buffer, kept)
            else:
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
        round_steps = self.cfg.conventional_g
        while True:
            # Conventional RL: the whole round of B*G samples is generated with frozen weights
            # before the first of its G optimizer steps.
            round_groups = self.source.take(n_groups * round_steps, self.step, deadline)
            if round_groups is None:
                yield None
                continue
            for i in range(round_steps):
                yield round_groups[i * n_groups:(i + 1) * n_groups]

    def train_step(self, groups: list[Group], num_sequences: int | None = None,
                   keep_groups: int = 0) -> dict[str, Any]:
        """One optimizer step on `groups`, this rank's shard of a step of `num_sequences`
        samples (None: counted over the ranks; an episode's branches are a sample each, so a
        step may hold more than trainer.batch_size, and `samples_trained` counts them all).
        `keep_groups`: the first so many groups' `scored` samples come back (rl_step)."""
        t0 = time.monotonic()
        metrics = rl_step(self.model, self.optimizer, groups, self.cfg, trainer_version=self.step,
                          num_sequences=num_sequences, ref_model=self.ref_model,
                          keep_groups=keep_groups)
        self.scheduler.step()
        self.compute_s += time.monotonic() - t0
        self.step += 1
        self.samples_trained += metrics["samples"]
        self.tokens_trained += metrics["input_tokens"]
        return metrics

    def maybe_publish(self) -> None:
        """Every rank calls it (a sharded model's weights are gathered by all); rank 0 sends."""
        conventional = self.cfg.mode == "conventional"
        every = self.cfg.conventional_g if conventional else self.cfg.trainer.publish_every
        if self.step % every == 0:
            self.publish()

    def publish_final(self) -> bool:
        """Publish the final weights unless this step's already went out (every rank calls
        it); whether the channel holds them. A run that ends before its first step has
        nothing to publish: every role holds version 0 (an evaluator waiting for it would wait
        until sync.timeout_s, die and wait again on each restart)."""
        if self.published_version != self.step:
            self.publish()
        return self.sender is not None and self.published_version > 0

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
            call_to_publish()
        self.publish()

    def publish(self) -> None:
        """Send the weights as version `step` (every rank of a sharded model gathers them)."""
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
        """metrics.jsonl's row for the step just taken on `groups` (rank 0)."""
        assert self.source is not None
        samples: list[Sample] = [s for g in groups for s in g.samples]
        success = sum(s.success for s in samples) / len(samples)
        ema = self.success_ema
        self.success_ema = success if ema is None else 0.9 * ema + 0.1 * success
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
        record.update(_aggregate_actor_stats(self.actor_stats(groups)))
        self.last_record = (elapsed, self.source.wait_s)
        return record

    def actor_stats(self, groups: list[Group]) -> dict[int, dict[str, float]]:
        """Each actor's latest stats: as last read from the stream, or, in deterministic mode,
        as of the last of its groups in this step (how far the stream was read is timing)."""
        assert self.source is not None
        if not self.cfg.deterministic.enabled:
            return self.source.actor_stats
        return {g.actor_id: g.actor_stats for g in groups}


def reference_model(cfg: Config, model: torch.nn.Module) -> torch.nn.Module:
    """The KL penalty's reference: the starting model, frozen, laid out like `model`."""
    tc = cfg.trainer
    if is_sharded(model):  # built empty, then filled shard by shard as the model
        ref = load_model(cfg.model.path, dtype=torch.float32, device="meta").eval()
        set_packed_attention(ref, tc)
        return load_shards(shard_frozen(ref, tc.fsdp, tc.device), cfg.model.path, tc.fsdp,
                           tc.device)
    param = next(model.parameters())
    ref = load_model(cfg.model.path, dtype=param.dtype, device=param.device).eval()
    set_packed_attention(ref, tc)
    return ref.requires_grad_(False)


def trainer_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Weights by Hugging Face name (unwrapping DistributedDataParallel's `module.`; with LoRA,
    the base weights merged with the adapters)."""
    if is_lora(model):
        return merged_weights(model)
    model = getattr(model, "module", model)
    return {name: t.detach() for name, t in model.state_dict().items()}


def completion_stats(samples: list[Sample]) -> dict[str, float]:
    """Completion lengths, and the fraction cut at engine.max_new_tokens (finish_reason
    "length": no stop token, the answer may be incomplete)."""
    lengths = [len(s.token_ids) for s in samples]
    stats = {
        "completion_len_mean": sum(lengths) / len(lengths),
        "completion_len_max": max(lengths),
        "completion_truncated_frac":
            sum(s.finish_reason == "length" for s in samples) / len(samples),
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
    """The actors' latest stats as one `actor_<key>` each: rates and counts (skips, scores'
    outcomes) summed over the actors, the rest averaged."""
    summed = ("tokens_per_s", "weight_updates", "groups_published")
    stats = list(per_actor.values())
    combined: dict[str, float] = {}
    for key in {k for actor in stats for k in actor}:
        values = [actor.get(key, 0.0) for actor in stats]
        total = key in summed or key.startswith(("skipped_", "outcome_"))
        combined[f"actor_{key}"] = sum(values) if total else sum(values) / len(values)
    return combined


def save_final(cfg: Config, model: torch.nn.Module, tokenizer: Any, is_main: bool) -> None:
    """The trained model as `final/` (atomically); with LoRA, merged, and the adapter alone
    as `final_adapter/`. A sharded model is gathered to rank 0's memory, tensor by tensor
    (every rank calls this)."""
    state = full_state_dict(model) if is_sharded(model) else None
    if not is_main:
        return
    final = save_model(to_save(model, cfg.run_dir / "final_adapter"),
                       tokenizer, cfg.run_dir / "final", state_dict=state)
    log.info("saved final weights to %s", final)


def write_weights_hash(run_dir: Path, weights: dict[str, torch.Tensor]) -> None:
    """Deterministic mode: the final weights' hash in weights.sha256, for comparing replays."""
    digest = weights_sha256(weights)
    (run_dir / "weights.sha256").write_text(digest + "\n")
    log.info("final weights sha256 %s", digest)


def _plot(cfg: Config, metrics_path: Path) -> None:
    """metrics.png: the run's metrics rows drawn."""
    # Lazy: matplotlib costs 0.8-1.7 s (python -X importtime); only rank 0 plots, at the end.
    from pipelinerl.metrics.plot import plot_run

    plot_run(read_rows(metrics_path), cfg.run_dir / "metrics.png", title=cfg.name)
