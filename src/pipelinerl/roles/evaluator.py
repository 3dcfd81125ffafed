"""Held-out evaluation: the evaluator role, its passes, and the trainer's side of its results.

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
import json
import logging
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from pipelinerl.config import Config, EvalConfig
from pipelinerl.engine import Engine, make_engine, torch_dtype
from pipelinerl.envs.groups import GroupCollector, group_key, request_id
from pipelinerl.envs.rollout import Rollouts, Transcript
from pipelinerl.metrics.logger import METRICS
from pipelinerl.models.hf import load_model
from pipelinerl.models.prompts import text_codec
from pipelinerl.roles.wiring import (
    Control,
    open_control_reader,
    open_eval_writer,
    open_weight_receiver,
)
from pipelinerl.rollouts.generation import sampling_from_config
from pipelinerl.rollouts.scoring import Scorer, check_sendable
from pipelinerl.run.eval_results import EVAL_PREFIX, logged_versions
from pipelinerl.run.eval_snapshots import Snapshots
from pipelinerl.run.replay import (
    eval_due,
    evaluated_versions,
    record_evaluated,
    reply_delay_steps,
    request_seed,
    resume_point,
)
from pipelinerl.run.samples import EvalPass, EvalSampleRecord, open_eval_record
from pipelinerl.sync.base import WeightReceiver
from pipelinerl.tasks import heldout_problems, make_task
from pipelinerl.tasks.base import Problem, Score, Task
from pipelinerl.tasks.environment import is_environment
from pipelinerl.tools.task import equip
from pipelinerl.types import (
    GenerationOutput,
    GenerationRequest,
    Sample,
    SamplingParams,
    attempt_index,
)

if TYPE_CHECKING:  # imported when used: aiohttp costs 0.2-0.6 s (python -X importtime)
    from pipelinerl.envs.verifiers.episodes import EpisodeRunner
    from pipelinerl.rollouts.endpoint import GenerateEndpoint

log = logging.getLogger(__name__)

POLL_S = 0.05


@dataclass(frozen=True)
class EvalMode:
    name: str  # "greedy" or "sampled"
    params: SamplingParams
    attempts: int  # per problem


def eval_modes(cfg: EvalConfig, base: SamplingParams) -> list[EvalMode]:
    """Greedy (one attempt, untruncated) and/or sampled at eval.temperature with the engine's
    top-k / top-p (eval.samples attempts)."""
    modes = []
    if cfg.greedy:
        modes.append(EvalMode("greedy", replace(base, temperature=0.0, top_k=0, top_p=1.0), 1))
    if cfg.temperature > 0:
        modes.append(EvalMode("sampled", replace(base, temperature=cfg.temperature), cfg.samples))
    return modes


@dataclass
class _Tally:
    """One mode's outcome: successes per problem, completion lengths, verifier failures."""

    attempts: int
    solved: dict[int, int] = field(default_factory=dict)
    tokens: int = 0
    completions: int = 0
    truncated: int = 0
    failures: int = 0

    def count(self, outs: list[GenerationOutput | Transcript | Sample]) -> None:
        """Lengths of one problem's finished attempts."""
        self.completions += len(outs)
        self.tokens += sum(len(o.token_ids) for o in outs)
        self.truncated += sum(o.finish_reason == "length" for o in outs)

    def metrics(self, name: str, n_problems: int) -> dict[str, float]:
        counts = [self.solved.get(i, 0) for i in range(n_problems)]
        prefix = f"{EVAL_PREFIX}{name}"
        out = {
            prefix if name == "greedy" else f"{prefix}/pass@1":
                sum(counts) / (n_problems * self.attempts),
            f"{prefix}/completion_len": self.tokens / max(1, self.completions),
            f"{prefix}/truncated_frac": self.truncated / max(1, self.completions),
            f"{prefix}/verifier_failures": float(self.failures),
        }
        if self.attempts > 1:
            # pass@k with k = n = attempts: 1 - C(n - c, k) / C(n, k) is 1 iff c > 0.
            out[f"{prefix}/pass@{self.attempts}"] = sum(c > 0 for c in counts) / n_problems
        return out


def evaluate(
    engine: Engine,
    problems: list[Problem],
    prompt_ids: list[list[int]],
    modes: list[EvalMode],
    scorer: Scorer,
    decode: Callable[[list[int]], str],
    between_steps: Callable[[], None] = lambda: None,
    rollouts: Rollouts | None = None,
    record: EvalPass | None = None,
    seed: int | None = None,
) -> dict[str, float]:
    """One pass over `problems` with the weights the engine holds, which must not change
    during the pass (`between_steps` runs between two decode steps and must not load any).
    A completion whose verification fails (raises, hangs, crashes) counts as unsolved and is
    counted in `<mode>/verifier_failures`. With `rollouts` (an environment's, on this engine)
    the attempts are multi-turn; a failed environment call counts like a failed verifier.
    `record` collects the attempts and their scores (eval_samples.jsonl). `seed`
    (deterministic mode): attempt a of problem i in mode m samples from a generator seeded by
    (seed, m, i, a), the same at every version (common random numbers), else from the
    engine's."""
    version = engine.version
    t0 = time.monotonic()

    def sampling_of(m: int, i: int, a: int) -> SamplingParams:
        if seed is None:
            return modes[m].params
        return replace(modes[m].params, seed=request_seed(seed, f"eval|{m}|{i}", a))

    queue = deque(
        (request_id(f"{m}|{i}", a), i, sampling_of(m, i, a))
        for m, mode in enumerate(modes)
        for i in range(len(prompt_ids))
        for a in range(mode.attempts)
    )
    tallies = [_Tally(mode.attempts) for mode in modes]
    collector = GroupCollector(scorer, decode)
    unscored = 0  # groups submitted to the scorer and not yet back
    steps = 0  # the decode clock of an environment's replies in deterministic mode
    while queue or engine.num_active():
        while queue and engine.num_active() < engine.capacity:
            rid, i, params = queue.popleft()
            engine.add_request(
                rollouts.request(rid, problems[i], prompt_ids[i], params) if rollouts
                else GenerationRequest(rid, list(prompt_ids[i]), params))
        idle = rollouts is not None and rollouts.waiting() == rollouts.running() > 0
        if idle:
            rollouts.pool.wait(POLL_S)  # every sequence waits for its environment
        finished: list[GenerationOutput | Transcript] = []
        outs = engine.step()
        steps += 1
        for out in outs:
            _check_version(out, version)
            if rollouts is None:
                finished.append(out)
            elif (transcript := rollouts.on_turn(out, steps)) is not None:
                finished.append(transcript)
        if rollouts is not None:
            finished += rollouts.poll(steps, idle)
        for out in finished:
            m, i = (int(x) for x in group_key(out.request_id).split("|"))
            group = collector.add(out, problems[i], modes[m].attempts)
            if group is None:
                continue
            if record is not None:
                record.attempts(m, i, problems[i], group.attempts, group.failure)
            tallies[m].count(group.attempts)
            if group.failure is not None:
                tallies[m].failures += len(group.attempts)  # unsolved, like a failed verifier
            else:
                unscored += 1
        unscored -= _collect(scorer, tallies, modes, record)
        between_steps()
    while unscored:
        scorer.wait(POLL_S)
        unscored -= _collect(scorer, tallies, modes, record)
        between_steps()
    return _metrics(modes, tallies, len(problems), t0)


def evaluate_episodes(engine: Engine, endpoint: GenerateEndpoint, runner: EpisodeRunner,
                      problems: list[Problem], modes: list[EvalMode],
                      between_steps: Callable[[], None] = lambda: None,
                      record: EvalPass | None = None) -> dict[str, float]:
    """`evaluate` for an environment of another library (verifiers): each problem's episodes
    call `endpoint`, served here by `engine`, and are scored by the environment. An episode
    that fails (an error, its deadline) counts as unsolved, in `<mode>/verifier_failures`."""
    version = engine.version
    t0 = time.monotonic()
    for m, mode in enumerate(modes):
        for i, problem in enumerate(problems):
            runner.start(f"{m}|{i}", problem, mode.attempts, mode.params)
    tallies = [_Tally(mode.attempts) for mode in modes]
    left = len(modes) * len(problems)
    while left:
        endpoint.abort_abandoned(engine)
        for request in endpoint.take(engine.capacity - engine.num_active()):
            engine.add_request(request)
        if not engine.num_active():
            time.sleep(0.005)  # every episode is between two model calls
        for out in engine.step() if engine.num_active() else ():
            _check_version(out, version)
            endpoint.finish(out)
        for finished in runner.poll():
            m, i = (int(x) for x in finished.group_id.split("|"))
            left -= 1
            if record is not None:
                record.attempts(m, i, problems[i], finished.samples or [],
                                None if finished.samples is not None else "episode")
                if finished.samples is not None:
                    record.scores(m, i, [Score(s.reward, s.success) for s in finished.samples])
            if finished.samples is None:
                tallies[m].failures += modes[m].attempts
                continue
            tallies[m].count(finished.samples)
            # an episode's branches (several samples) are one attempt
            attempts = dict(zip(attempt_index(finished.samples), finished.samples))
            tallies[m].solved[i] = sum(s.success for s in attempts.values())
        between_steps()
    return _metrics(modes, tallies, len(problems), t0)


def _check_version(out: GenerationOutput, version: int) -> None:
    if any(v != version for v in out.versions):
        raise RuntimeError(f"evaluation of version {version} got tokens of versions "
                           f"{sorted(set(out.versions))}: the weights changed mid-pass")


def _metrics(modes: list[EvalMode], tallies: list[_Tally], n_problems: int, t0: float
             ) -> dict[str, float]:
    out: dict[str, float] = {}
    for mode, tally in zip(modes, tallies):
        out.update(tally.metrics(mode.name, n_problems))
    out[f"{EVAL_PREFIX}num_problems"] = float(n_problems)
    out[f"{EVAL_PREFIX}duration_s"] = time.monotonic() - t0
    return out


def _collect(scorer: Scorer, tallies: list[_Tally], modes: list[EvalMode],
             record: EvalPass | None = None) -> int:
    """Tally the scored groups; returns how many came back."""
    scored = scorer.poll()
    for s in scored:
        m, i = (int(x) for x in s.key.split("|"))
        if record is not None:
            record.scores(m, i, s.scores, s.reason)
        if s.scores is None:
            tallies[m].failures += modes[m].attempts
            continue
        tallies[m].solved[i] = sum(score.success for score in s.scores)
    return len(scored)


def fitting_problems(problems: list[Problem], encode: Callable[[str], list[int]],
                     max_prompt_tokens: int) -> tuple[list[Problem], list[list[int]]]:
    """The problems whose prompt fits the engine, with their token ids; those that do not
    are left out with a warning (they cannot be answered, so they say nothing of the policy)."""
    kept, ids = [], []
    for problem in problems:
        enc = encode(problem.prompt)
        if len(enc) <= max_prompt_tokens:
            kept.append(problem)
            ids.append(enc)
    if len(kept) < len(problems):
        log.warning("evaluation: %d of %d held-out prompts are longer than the %d tokens that "
                    "fit and are left out", len(problems) - len(kept), len(problems),
                    max_prompt_tokens)
    if not kept:
        raise ValueError(f"no held-out prompt fits in {max_prompt_tokens} tokens: raise "
                         "engine.max_seq_len or lower engine.max_new_tokens")
    return kept, ids


@dataclass
class EvalSetup:
    """Everything a pass needs apart from the weights."""

    problems: list[Problem]
    prompt_ids: list[list[int]]
    modes: list[EvalMode]
    scorer: Scorer | None  # None: the episodes' environment scores them
    decode: Callable[[list[int]], str]
    rollouts: Rollouts | None = None  # an environment's multi-turn rollouts, on the engine
    # An environment of another library: its episodes, and the endpoint they call.
    episodes: tuple[GenerateEndpoint, EpisodeRunner] | None = None
    # The task's own held-out set (a dataset's test_split, an environment's eval_taskset)
    # chose `problems`, not task.heldout_frac (`tasks.split.heldout_problems`).
    own_heldout: bool = False
    # The evaluator role's eval_samples.jsonl (None: `pipelinerl eval`, or recording off).
    samples: EvalSampleRecord | None = None
    # Deterministic mode: the run's seed, each attempt sampling from a generator of its own
    # (`evaluate`), so a version's result does not depend on the passes before it.
    seed: int | None = None

    def run(self, engine: Engine, between_steps: Callable[[], None] = lambda: None
            ) -> dict[str, float]:
        record = EvalPass(self.decode) if self.samples is not None else None
        if self.episodes is not None:
            metrics = evaluate_episodes(engine, *self.episodes, self.problems, self.modes,
                                        between_steps, record)
        else:
            assert self.scorer is not None
            metrics = evaluate(engine, self.problems, self.prompt_ids, self.modes, self.scorer,
                               self.decode, between_steps, self.rollouts, record, self.seed)
        if self.samples is not None and record is not None:
            self.samples.write(engine.version, record.rows(engine.version, self.samples.attempt,
                                                           [m.name for m in self.modes]))
        return metrics

    def close(self) -> None:
        if self.scorer is not None:
            self.scorer.close()
        if self.samples is not None:
            self.samples.close()
        if self.rollouts is not None:
            self.rollouts.close()
        if self.episodes is not None:
            endpoint, runner = self.episodes
            runner.close()
            endpoint.close()


def eval_device(cfg: Config) -> str:
    return cfg.eval.device or cfg.engine.device


def build_eval_setup(cfg: Config, model_path: str) -> tuple[EvalSetup, Engine]:
    """The held-out problems (`tasks.split`), the tokenizer's view of them, the verifier and
    an engine with the model at `model_path`, as the config asks."""
    task: Task = make_task(cfg.task.name, cfg.task.params)
    check_sendable(task)  # before the model loads: a task the verifier workers cannot receive
    problems = heldout_problems(task, cfg.eval.num_problems, cfg.eval.seed, cfg.task.heldout_frac)
    own_heldout = bool(getattr(task, "has_test_split", False))
    codec, tokenizer = text_codec(cfg, model_path)
    if cfg.tools.enabled:  # held-out rollouts call the tools as training's do
        task, codec = equip(cfg, task, codec, tokenizer, "evaluator", cfg.run_dir)
    base = sampling_from_config(cfg.engine, codec.stop_ids)
    engine_cfg = cfg.engine.model_copy(update={"capacity": cfg.eval.capacity or cfg.engine.capacity,
                                               "device": eval_device(cfg)})
    if getattr(task, "episodic", False):  # the environment renders and scores its episodes
        from pipelinerl.envs.verifiers.episodes import open_episodes
        from pipelinerl.rollouts.endpoint import GenerateEndpoint

        endpoint = GenerateEndpoint(model=model_path, max_model_len=cfg.engine.max_seq_len,
                                    vocab_size=len(tokenizer),
                                    default_max_tokens=cfg.engine.max_new_tokens,
                                    eos_token_ids=codec.stop_ids, tokenizer=tokenizer)
        runner = open_episodes(cfg, task, endpoint, tokenizer, actor_id=-1)
        engine = make_engine(engine_cfg, model_path, seed=cfg.seed * 1000 + 999)
        return EvalSetup(problems, [], eval_modes(cfg.eval, base), None, codec.decode,
                         episodes=(endpoint, runner), own_heldout=own_heldout), engine
    problems, prompt_ids = fitting_problems(
        problems, codec.encode,
        cfg.engine.max_seq_len - cfg.engine.max_new_tokens)
    engine = make_engine(engine_cfg, model_path, seed=cfg.seed * 1000 + 999)
    scorer = Scorer(task, cfg.actor.verifier_timeout_s, cfg.actor.verifier_workers)
    rollouts = None
    if is_environment(task):
        rollouts = Rollouts(task, engine, codec.encode_text, codec.decode, base,
                            cfg.actor.env_timeout_s, cfg.actor.env_workers,
                            reply_delay_steps(cfg), codec.token_text)
    setup = EvalSetup(problems, prompt_ids, eval_modes(cfg.eval, base), scorer, codec.decode,
                      rollouts, own_heldout=own_heldout,
                      seed=cfg.seed if cfg.deterministic.enabled else None)
    return setup, engine


def evaluate_saved_model(model_dir: str, cfg: Config) -> int:
    """`pipelinerl eval MODEL_DIR CONFIG`: one pass over the task's held-out set with the
    config's eval and engine settings; prints one line per figure, then the figures as JSON."""
    torch.set_num_threads(cfg.eval.threads)
    try:
        setup, engine = build_eval_setup(cfg, model_dir)
    except (OSError, ValueError, RuntimeError, TypeError) as e:
        print(f"pipelinerl eval: {e}", file=sys.stderr)
        return 2
    try:
        metrics = setup.run(engine)
    finally:
        setup.close()
    chosen_by = ("the task's own held-out set" if setup.own_heldout
                 else f"task.heldout_frac={cfg.task.heldout_frac}")
    print(f"{model_dir}: {len(setup.problems)} held-out problems of task {cfg.task.name!r} "
          f"({chosen_by}, eval.seed={cfg.eval.seed})")
    for key, value in metrics.items():
        print(f"  {key:<40} {value:.4f}")
    print(json.dumps(metrics))
    return 0


# -- the evaluator role -----------------------------------------------------------------------


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
