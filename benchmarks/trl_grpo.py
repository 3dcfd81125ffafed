"""TRL's GRPOTrainer on the CPU demo: the peer column of benchmarks/learning_speed.py.

It reads the same config and overrides as a `pipelinerl train` run and keeps what TRL allows:
- the same starting model (the launcher's `prepare_run` resolves the warm-start), training
  problems drawn from the task without its held-out part (`make_train_task`), and reward (the
  task's `score`);
- B = trainer.batch_size samples per optimizer step in groups of actor.group_size
  (num_generations), temperature / top-k / top-p of `engine`, completions of at most
  engine.max_new_tokens, AdamW with trainer.lr, betas and weight decay, the lr schedule, the
  wall-clock budget trainer.max_time_s;
- the loss: one optimizer step per generated batch (num_iterations=1), so TRL's ratio is 1
  and its clipped surrogate has the policy gradient of our truncated-IS loss on-policy;
  advantages r - group mean (scale_rewards="none"), no KL (beta=0), truncated completions kept.
  loss_type="dr_grpo" sums the token terms over the batch and divides by (sequences x
  max_completion_length); ours (`sum_per_sequence`) divides by the sequences only. AdamW is
  invariant to a constant scale of the gradient once its eps is scaled alike, so adam_epsilon
  and max_grad_norm are divided by max_completion_length too and the steps are ours. The other
  types weigh tokens differently: "dapo" and "bnpo" divide by token counts (long completions
  weigh less per token), "grpo" by each sequence's own length.
- fp32 and no activation checkpointing (TRL defaults to bf16 and checkpointing), one process with
  --threads torch threads (default 2: the whole machine).
TRL generates with Hugging Face `generate` on static batches, then trains: no overlap, no lag.

Held-out evaluation uses pipelinerl.roles.evaluator's code and the config's `eval` settings on a
torch engine loaded with the current weights, at version 0, every eval.every_s seconds (or
eval.every_steps steps) and on the final weights. The training clock stops while it runs:
`time_s` excludes evaluation, `wall_s` includes it. metrics.jsonl holds the keys a pipelinerl
run writes (`step`, `time_s`, `samples_trained`, `success`, `eval/version`,
`eval/sampled/pass@1`, ...), so learning_speed.py reads it like any other run.

    pip install -e .[bench]
    python benchmarks/trl_grpo.py name=trl output_dir=runs seed=0     # runs/trl/metrics.jsonl
    python benchmarks/trl_grpo.py --quick output_dir=/tmp/trl          # smoke: tiny, seconds
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from pipelinerl.config import Config, load_config
from pipelinerl.models.hf import load_model, load_tokenizer
from pipelinerl.roles.heldout import EvalSetup, build_eval_setup
from pipelinerl.roles.launch import prepare_run
from pipelinerl.roles.trainer import trainer_weights
from pipelinerl.tasks import Problem, Score, Task, make_train_task

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "arithmetic.yaml"
# More prompts than a budget's steps use (B / group_size per step), so TRL's sampler never starts a
# second pass over them; drawn in well under a second.
TRAIN_PROBLEMS = 20_000
QUICK = ["warmstart.steps=10", "engine.capacity=16", "actor.group_size=4", "trainer.batch_size=16",
         "trainer.max_time_s=15", "eval.every_s=5", "eval.num_problems=16"]
# Our schedule names in Hugging Face's: "constant" has the warm-up (0 steps by default).
LR_SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


class Clock:
    """Seconds since `start()`, without the spans spent inside `paused()`."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.excluded = 0.0

    def start(self) -> None:
        self.started, self.excluded = time.monotonic(), 0.0

    def wall(self) -> float:
        return time.monotonic() - self.started

    def __call__(self) -> float:
        return self.wall() - self.excluded

    @contextmanager
    def paused(self) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.excluded += time.monotonic() - t0


class TaskReward:
    """The task's verifier as TRL's reward function; keeps the scores until `take()`."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.scores: list[Score] = []

    def __call__(self, prompts: list[str], completions: list[str], problem_id: list[str],
                 answer: list[str], **_: Any) -> list[float]:
        scores = [self.task.score(Problem(pid, prompt, json.loads(ans)), completion)
                  for prompt, completion, pid, ans in zip(prompts, completions, problem_id, answer)]
        self.scores += scores
        return [s.reward for s in scores]

    def take(self) -> list[Score]:
        taken, self.scores = self.scores, []
        return taken


class Recorder(TrainerCallback):
    """Writes metrics.jsonl as a pipelinerl trainer does (a record per optimizer step, one per
    held-out evaluation at the version's step and time), and stops at the wall-clock budget."""

    def __init__(self, cfg: Config, setup: EvalSetup, engine: Any, reward: TaskReward,
                 out: IO[str]) -> None:
        self.cfg = cfg
        self.setup = setup
        self.engine = engine
        self.reward = reward
        self.out = out
        self.clock = Clock()
        self.evaluated: tuple[int, float] = (-1, 0.0)  # (version, training clock) of the last

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       **_: Any) -> None:
        self.clock.start()
        self.evaluate(model, 0)

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                    **_: Any) -> None:
        step = state.global_step
        scores = self.reward.take()
        self.write(step, {
            "samples_trained": step * self.cfg.trainer.batch_size,
            "reward": sum(s.reward for s in scores) / max(1, len(scores)),
            "success": sum(s.success for s in scores) / max(1, len(scores)),
            # TRL samples with the weights it then trains: every token has lag 0.
            "lag_mean": 0.0,
            "lag_max": 0,
        })
        if self.eval_due(step):
            self.evaluate(model, step)
        if self.clock() >= self.cfg.trainer.max_time_s:
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None,
                     **_: Any) -> None:
        if self.evaluated[0] != state.global_step:
            self.evaluate(model, state.global_step)

    def eval_due(self, step: int) -> bool:
        version, at = self.evaluated
        every_steps, every_s = self.cfg.eval.every_steps, self.cfg.eval.every_s
        return bool((every_steps and step - version >= every_steps)
                    or (every_s and self.clock() - at >= every_s))

    def evaluate(self, model: torch.nn.Module, version: int) -> None:
        with self.clock.paused():
            self.engine.load_weights(trainer_weights(model), version)
            metrics = self.setup.run(self.engine)
        self.evaluated = (version, self.clock())
        self.write(version, {**metrics, "eval/version": version})
        print(f"[trl_grpo] version {version}: held-out pass@1 "
              f"{metrics.get('eval/sampled/pass@1', float('nan')):.3f}", file=sys.stderr)

    def write(self, step: int, values: dict[str, Any]) -> None:
        record = {"step": step, "time_s": self.clock(), "wall_s": self.clock.wall(), **values}
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()


def train_dataset(cfg: Config) -> Dataset:
    """TRAIN_PROBLEMS problems drawn as the actor draws them: never a held-out one. Answers as
    JSON, so any task's answer type survives the dataset."""
    task = make_train_task(cfg.task.name, cfg.task.params, cfg.task.heldout_frac)
    rng = random.Random(f"trl-{cfg.seed}")
    problems = [task.sample_problem(rng) for _ in range(TRAIN_PROBLEMS)]
    return Dataset.from_dict({
        "prompt": [p.prompt for p in problems],
        "problem_id": [p.problem_id for p in problems],
        "answer": [json.dumps(p.answer) for p in problems],
    })


def grpo_config(cfg: Config, out_dir: Path) -> GRPOConfig:
    tc, ec = cfg.trainer, cfg.engine
    scale = ec.max_new_tokens  # dr_grpo's loss is ours / max_completion_length (docstring)
    return GRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=tc.batch_size,
        gradient_accumulation_steps=1,
        num_generations=cfg.actor.group_size,
        num_iterations=1,
        max_completion_length=ec.max_new_tokens,
        temperature=ec.temperature,
        top_k=ec.top_k,
        top_p=ec.top_p,
        loss_type="dr_grpo",
        scale_rewards="none",
        beta=0.0,
        mask_truncated_completions=False,
        learning_rate=tc.lr,
        lr_scheduler_type=LR_SCHEDULES[tc.lr_schedule],
        warmup_steps=tc.warmup_steps,
        max_steps=tc.max_steps,
        weight_decay=tc.weight_decay,
        adam_beta1=tc.betas[0],
        adam_beta2=tc.betas[1],
        adam_epsilon=1e-8 / scale,
        max_grad_norm=tc.grad_clip / scale,
        optim="adamw_torch",
        bf16=False,
        activation_checkpointing=False,
        use_cpu=ec.device == "cpu",
        seed=cfg.seed,
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


def load_run_config(config: Path, overrides: list[str], quick: bool) -> Config:
    cfg = load_config(config, ["name=trl_grpo", *(QUICK if quick else []), *overrides])
    if quick and not cfg.warmstart.cache_dir:
        cfg.warmstart.cache_dir = str(Path(cfg.output_dir) / "cache")
    return cfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--threads", type=int, default=2, help="torch threads (2: the whole machine)")
    p.add_argument("--quick", action="store_true", help="tiny smoke run: a few steps")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    p.add_argument("overrides", nargs="*", help="config overrides, as for `pipelinerl train`")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = prepare_run(load_run_config(args.config, args.overrides, args.quick), args.overwrite)
    setup, engine = build_eval_setup(cfg, cfg.model.path)
    reward = TaskReward(make_train_task(cfg.task.name, cfg.task.params, cfg.task.heldout_frac))
    try:
        with (cfg.run_dir / "metrics.jsonl").open("w") as out:
            trainer = GRPOTrainer(
                model=load_model(cfg.model.path).train(),
                reward_funcs=[reward],
                args=grpo_config(cfg, cfg.run_dir / "trl"),
                train_dataset=train_dataset(cfg),
                processing_class=load_tokenizer(cfg.model.path),
                callbacks=[Recorder(cfg, setup, engine, reward, out)],
            )
            trainer.train()
    finally:
        setup.close()
    print(f"run finished: {cfg.run_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()
