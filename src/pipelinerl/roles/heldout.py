"""Held-out evaluation of one version of the weights: the task's held-out problems in each
mode (greedy, sampled), through the same rollouts, environments and tools as training, every
token checked to carry the version; the figures (pass@1, pass@k, lengths, failures). Run by
the evaluator role (`roles/evaluator.py`) on each version it follows, and by
`pipelinerl eval MODEL_DIR CONFIG` on a saved model (`evaluate_saved_model`)."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

import torch

from pipelinerl.config import Config, EvalConfig
from pipelinerl.engine import Engine, make_engine
from pipelinerl.envs.groups import GroupCollector, group_key, request_id
from pipelinerl.envs.rollout import Rollouts, Transcript
from pipelinerl.models.prompts import text_codec
from pipelinerl.rollouts.generation import sampling_from_config
from pipelinerl.rollouts.scoring import Scorer, check_sendable
from pipelinerl.run.eval_results import EVAL_PREFIX
from pipelinerl.run.replay import (
    reply_delay_steps,
    request_seed,
)
from pipelinerl.run.samples import EvalPass, EvalSampleRecord
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
