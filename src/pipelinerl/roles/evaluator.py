"""The evaluator role: follows the trainer's versions and runs held-out passes on them
(`roles/heldout.py` runs one pass).

Why a role of its own, with its own engine, rather than a share of an actor's engine: an
actor's weights change between two decode steps, so an evaluation sequence spread over a few
hundred steps would mix a dozen versions and measure no policy. The evaluator loads a version
at the start of a pass and keeps it to the end (every token of a pass is checked to carry
it), so each figure belongs to one version. It also leaves the actors' scheduling untouched
and works with every engine backend. Its cost is CPU (or accelerator) time while a pass runs,
measured in docs/evaluation.md.

Flow: the trainer publishes weights as usual; the evaluator is one more receiver of the weight
channel. It evaluates version 0 at once, then the newest version whenever `eval.every_steps`
or `eval.every_s` is due, and the final weights once the trainer's stop record says they are
published. Each result goes to the run's `eval` stream; the trainer logs it to metrics.jsonl
(as `eval/...` keys, at the step of the version evaluated and the wall-clock time that version
was made; `pipelinerl.run.eval_results`) and waits for the final one before it plots and exits.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import deque
from typing import Any, Callable, Mapping

import torch

from pipelinerl.config import Config, EvalConfig
from pipelinerl.engine import torch_dtype
from pipelinerl.metrics.logger import METRICS
from pipelinerl.models.hf import load_model
from pipelinerl.roles.heldout import build_eval_setup, eval_device
from pipelinerl.roles.wiring import (
    Control,
    open_control_reader,
    open_eval_writer,
    open_weight_receiver,
)
from pipelinerl.run.eval_results import logged_versions
from pipelinerl.run.eval_snapshots import Snapshots
from pipelinerl.run.replay import (
    eval_due,
    evaluated_versions,
    record_evaluated,
    resume_point,
)
from pipelinerl.run.samples import open_eval_record
from pipelinerl.sync.base import WeightReceiver

log = logging.getLogger(__name__)

POLL_S = 0.05


class _Due:
    """When the newest weights are due for evaluation (eval.every_steps / eval.every_s);
    `exact`: deterministic mode, exactly the versions `exact` names."""

    def __init__(self, cfg: EvalConfig, exact: Callable[[int], bool] | None = None) -> None:
        self.cfg = cfg
        self.exact = exact
        self.last_version = -1
        self.last_time = time.monotonic()

    def __call__(self, version: int) -> bool:
        if version <= self.last_version:
            return False
        if self.exact is not None:
            return self.exact(version)
        if self.last_version < 0:
            return True
        steps = self.cfg.every_steps and version - self.last_version >= self.cfg.every_steps
        seconds = self.cfg.every_s and time.monotonic() - self.last_time >= self.cfg.every_s
        return bool(steps or seconds)

    def done(self, version: int) -> None:
        self.last_version, self.last_time = version, time.monotonic()


class _Staging:
    """The newest published weights, received into a copy of the model's tensors, so the
    engine's own weights change only between passes. With a channel whose sender waits for
    every receiver at each publish (broadcast), every version is taken as it comes, during a
    pass too; with shared memory only a version that is wanted."""

    def __init__(self, receiver: WeightReceiver, tensors: Mapping[str, torch.Tensor],
                 follow: bool, keep: Callable[[int], bool] | None = None,
                 kept: Callable[[int], None] = lambda version: None) -> None:
        self.receiver = receiver
        self.tensors = tensors
        self.follow = follow
        self.version = 0
        self.received = False
        # Deterministic mode: a copy of each version `keep` names, taken on receipt (a newer
        # one may come during a pass), evaluated in order; `kept` says so to the trainer.
        self.keep, self.kept = keep, kept
        self.queue: deque[tuple[int, dict[str, torch.Tensor]]] = deque()

    def pump(self, want: Callable[[int], bool] = lambda version: False) -> None:
        newest = self.receiver.poll()
        if newest is not None and (self.follow or want(newest)):
            self.version = self.receiver.receive_into(self.tensors)
            self.received = True
            if self.keep is not None and self.keep(self.version):
                self.queue.append((self.version, {k: t.clone() for k, t in self.tensors.items()}))
                self.kept(self.version)


def run_evaluator(cfg: Config) -> None:
    """The evaluator role: the starting weights (a resumed run's newest), then the newest
    whenever due, until the trainer's stop record; then the final weights."""
    torch.set_num_threads(cfg.eval.threads)
    evaluator = _Evaluator(cfg)
    try:
        evaluator.start()
        evaluator.finish(evaluator.follow())
    finally:
        evaluator.close()


class _Evaluator:
    """The evaluator role's engine and passes, the weights it stages, and its streams."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.setup, self.engine = build_eval_setup(cfg, cfg.model.path)
        self.setup.samples = open_eval_record(cfg.run_dir, cfg.metrics, cfg.attempt)
        # On the engine's device and in its dtype: one more copy of the model, not an fp32 one
        # in host memory that every received version would cross.
        staging_model = load_model(cfg.model.path, dtype=torch_dtype(cfg.engine.dtype),
                                   device=eval_device(cfg))
        # restarted: the launcher may start the evaluator again after it died, and a broadcast
        # group then forms again to take it (only the launcher starts an evaluator: no duplicate).
        receiver = open_weight_receiver(cfg, cfg.actor.num_actors, eval_device(cfg),
                                        restarted=True)
        self.writer = open_eval_writer(cfg)
        exact = functools.partial(eval_due, cfg) if cfg.deterministic.enabled else None
        self.staging = _Staging(receiver, staging_model.state_dict(),
                                follow=cfg.sync.backend == "broadcast", keep=exact,
                                kept=self.say_staged)
        self.control = Control(open_control_reader(cfg), cfg.attempt)
        self.due = _Due(cfg.eval, exact)
        self.snapshots = Snapshots(cfg.run_dir, cfg.attempt) if cfg.eval.deferred else None

    def start(self) -> None:
        cfg = self.cfg
        if self.due.exact is not None:
            self.start_exact()
            return
        if cfg.attempt == 0 and not logged_versions(cfg.run_dir / METRICS):
            self.run_pass(final=False)  # version 0: the starting policy, before any update
            return
        # A resumed run, or an evaluator restarted after it died: the newest weights come
        # first. They are evaluated unless metrics.jsonl holds their result already (a
        # resumed trainer cut the file back to its checkpoint before publishing them).
        _await_version(self.staging, 0, cfg.sync.timeout_s)
        if self.staging.version in logged_versions(cfg.run_dir / METRICS):
            self.due.done(self.staging.version)
        else:
            self.run_pass(final=False)

    def start_exact(self) -> None:
        """Deterministic mode: version 0 (the engine holds the starting model), unless an
        earlier attempt evaluated it. A resumed attempt's trainer starts from its resume point,
        step S, whose scheduled versions up to S were all evaluated (the launcher chose it so):
        it takes version S and goes on from there."""
        cfg = self.cfg
        step = resume_point(cfg.run_dir, cfg.attempt).step if cfg.attempt else 0
        if step == 0:
            if 0 in evaluated_versions(cfg.run_dir):
                self.due.done(0)
            else:
                self.run_pass(final=False)
            return
        _await_version(self.staging, step, cfg.sync.timeout_s)
        self.staging.queue = deque(k for k in self.staging.queue if k[0] != step)
        self.due.done(step)

    def say_staged(self, version: int) -> None:
        """Deterministic mode: tell the trainer, waiting to publish on, that `version` is kept."""
        self.writer.write({"version": version, "staged": True, "attempt": self.cfg.attempt})

    def follow(self) -> dict[str, Any]:
        """Evaluate the newest weights whenever due, until the trainer's stop record (returned)."""
        while self.control.stop is None:
            self.staging.pump(want=self.due)
            if self.staging.queue:
                self.run_kept()
            elif self.staging.keep is None and self.due(self.staging.version):
                self.run_pass(final=False)
            self.control.poll()
            if self.control.stop is None:
                time.sleep(POLL_S)
        return self.control.stop

    def finish(self, stop: dict[str, Any]) -> None:
        """The final weights, once the trainer says they are published (and the kept ones)."""
        if stop.get("final_published"):
            _await_version(self.staging, int(stop["step"]), self.cfg.sync.timeout_s)
            while self.staging.queue:
                self.run_kept()
            if self.snapshots is not None:
                self.run_deferred()
            self.run_pass(final=True)

    def run_pass(self, final: bool) -> None:
        """Evaluate the newest weights received, or keep them for later (eval.deferred)."""
        version = self.staging.version
        if final and self.due.last_version == version:
            # Evaluated already: the record only marks the end (the trainer logs no repeat).
            self.writer.write({"version": version, "final": True, "attempt": self.cfg.attempt})
            return
        if self.snapshots is not None and not final:
            self.snapshots.save(version, self.staging.tensors)
            self.done(version)
            return
        if version != self.engine.version:
            self.engine.load_weights(self.staging.tensors, version)
        self.evaluate_loaded(final, self.between_steps)
        self.done(version)

    def done(self, version: int) -> None:
        """`version` evaluated, or its weights kept for a deferred pass (deterministic mode:
        noted for a resume's choice of checkpoint)."""
        self.due.done(version)
        if self.due.exact is not None:
            record_evaluated(self.cfg.run_dir, version, self.cfg.attempt)

    def between_steps(self) -> None:
        """Between two decode steps of a pass: the weights the channel brings (deterministic
        mode: a version to keep too, so the trainer waiting for it is not held a whole pass)."""
        if self.staging.keep is not None:
            self.staging.pump(want=self.due)
        else:
            self.staging.pump()

    def run_kept(self) -> None:
        """Deterministic mode: the oldest version kept, evaluated (or kept for later)."""
        version, tensors = self.staging.queue.popleft()
        if self.snapshots is not None:
            self.snapshots.save(version, tensors)
        else:
            self.engine.load_weights(tensors, version)
            self.evaluate_loaded(False, self.between_steps)
        self.done(version)

    def run_deferred(self) -> None:
        """The kept versions, oldest first, on the cores the run's roles had."""
        assert self.snapshots is not None
        torch.set_num_threads(_run_threads(self.cfg))
        for version, path in self.snapshots.pending(logged_versions(self.cfg.run_dir / METRICS)):
            self.engine.load_weights(Snapshots.load(path, eval_device(self.cfg)), version)
            self.evaluate_loaded(final=False)
            path.unlink()
        torch.set_num_threads(self.cfg.eval.threads)

    def evaluate_loaded(self, final: bool, between_steps: Callable[[], None] = lambda: None
                        ) -> None:
        """A pass over the weights the engine holds, its record written."""
        version = self.engine.version
        metrics = self.setup.run(self.engine, between_steps=between_steps)
        log.info("evaluated version %d: %s", version, {k: round(v, 4) for k, v in metrics.items()})
        self.writer.write({"version": version, "final": final, "attempt": self.cfg.attempt,
                           **metrics})

    def close(self) -> None:
        self.setup.close()
        self.writer.close()
        self.control.close()
        self.staging.receiver.close()


def _run_threads(cfg: Config) -> int:
    """The threads the run's roles had (they are done once deferred evaluation starts)."""
    roles = cfg.actor.num_actors * cfg.actor.threads + cfg.trainer.threads + cfg.eval.threads
    return max(1, min(roles, os.cpu_count() or 1))


def _await_version(staging: _Staging, version: int, timeout_s: float) -> None:
    """Until weights of `version` or newer were received (not the starting model's)."""
    deadline = time.monotonic() + timeout_s
    while not staging.received or staging.version < version:
        if time.monotonic() > deadline:
            raise TimeoutError(f"weights of version {version} did not arrive within "
                               f"sync.timeout_s={timeout_s:.0f} s")
        staging.pump(want=lambda v: True)
        time.sleep(POLL_S)
