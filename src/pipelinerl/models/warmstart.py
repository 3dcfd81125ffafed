"""Supervised warm-start: the starting policy for RL on a synthetic task.

A randomly initialised tiny model (or a given base model) is trained with next-token
cross-entropy on NOISY worked demonstrations: each step is wrong with probability
`step_error_prob`, the chain continuing from the wrong value. The model learns the format and
most of the arithmetic, but at temperature 1 it reproduces the slips, so its success rate
leaves RL room to climb. The result is cached under a hash of everything that determines it.

The demonstrations are the task's (`encode_demo`), or a `Demos` source's: a given chat model's
prompts through its template (`ChatDemos`), or tool-using conversations whose replies come
from the tools themselves (`pipelinerl.tools.warmstart`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from pipelinerl.models.hf import encode_prompt, load_model, load_tokenizer, save_model
from pipelinerl.models.prompts import PromptEncoder
from pipelinerl.models.sources import file_sha256
from pipelinerl.models.tiny import build_char_tokenizer, init_tiny_model
from pipelinerl.proc.cache import building, user_cache
from pipelinerl.proc.cpu_threads import ContentionGuard, usable_threads
from pipelinerl.tasks import DemonstrationTask, Problem
from pipelinerl.tasks.environment import is_environment

logger = logging.getLogger(__name__)

# Bump when a change here alters the trained weights, so stale caches are not reused.
CODE_VERSION = 1
MANIFEST = "warmstart.json"
BUCKET = 8  # batches drawn at once and grouped by length


@dataclass(frozen=True)
class WarmStartConfig:
    preset: str = "tiny"  # tiny-model preset; ignored when a base model dir is given
    steps: int = 1000
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 30
    # 0.1 rather than the usual 0.01: the result's units digit depends on two digits jointly
    # (no signal from either alone), and training sits on a plateau until it clicks; with 0.1
    # the plateau ended sooner and the term lookup came out much better (greedy 87% vs 64%).
    weight_decay: float = 0.1
    step_error_prob: float = 0.3
    seed: int = 0
    # bf16 autocast (weights stay fp32). Off by default: measured 5-9x SLOWER than fp32 on an
    # AVX2-only CPU (no native bf16 matmul), 1.6x faster on one with AVX512-BF16 (0.76 vs 1.23
    # s a step of the progression task's demonstrations, 2 threads, same loss).
    bf16: bool = False
    # Not part of the cache key: they do not change what is learnt.
    num_threads: int = 2  # this runs before the RL roles start, so it may use both cores
    eval_problems: int = 256  # success measured after training, in the manifest; 0: skip

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"warm-start {name} must be >= 1, got {getattr(self, name)}")
        if self.eval_problems < 0:
            raise ValueError(f"warm-start eval_problems must be >= 0, got {self.eval_problems}")
        if not 0.0 <= self.step_error_prob <= 1.0:
            raise ValueError(f"step_error_prob must be in [0, 1], got {self.step_error_prob}")
        if self.lr <= 0:
            raise ValueError(f"warm-start lr must be > 0, got {self.lr}")


_NOT_IN_KEY = {"num_threads", "eval_problems"}

Example = tuple[list[int], list[int]]  # (input_ids, labels), labels -100 where not trained


class Demos(Protocol):
    """A source of demonstrations other than the task's plain prompt + completion."""

    def key(self) -> dict[str, Any]:
        """What the encoding depends on beyond the task and the model (for the cache key)."""
        ...

    def encode(self, rng: random.Random, step_error_prob: float) -> Example:
        """One noisy demonstration, labels -100 on what the model does not write."""
        ...


class ChatDemos:
    """The task's demonstrations with its prompts as the run's roles encode them (a given
    chat model: through its template, with `task.system_prompt`)."""

    def __init__(self, task: DemonstrationTask, prompts: PromptEncoder) -> None:
        self.task, self.prompts = task, prompts

    def key(self) -> dict[str, Any]:
        return {"prompt": self.prompts.text("PROMPT")}

    def encode(self, rng: random.Random, step_error_prob: float) -> Example:
        return encode_demo(self.task, self.prompts.tokenizer, rng, step_error_prob,
                           prompt=self.prompts)


def cache_key(
    task: DemonstrationTask, cfg: WarmStartConfig, base_model_dir: str | Path | None = None,
    demos: Demos | None = None,
) -> str:
    """Hash of everything that determines the warm-started weights."""
    spec: dict[str, Any] = {
        "code_version": CODE_VERSION,
        "task": task.name,
        "task_params": _params(task),
        "task_code": _task_code(task),
        "cfg": {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in _NOT_IN_KEY},
        "base_model": _dir_fingerprint(base_model_dir) if base_model_dir else None,
    }
    if demos is not None:  # absent otherwise, so the tiny models' keys stay as they were
        spec["demos"] = demos.key()
    if base_model_dir:
        spec["cfg"].pop("preset")
    blob = json.dumps(spec, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _params(task: DemonstrationTask) -> dict[str, Any]:
    # A user's task may have none: its code's hash (`_task_code`) still keys it.
    return task.params() if hasattr(task, "params") else {}


def _task_code(task: object) -> list[str]:
    """The SHA-256 of each source file that defines the task's class or a base (stdlib aside),
    through wrappers that hold it as `.task` (the train split): editing a task's
    demonstrations must not reuse a model trained on the old ones. Contents only, not paths,
    so every clone of the same code shares the cache."""
    sources = {cls: _source_file(cls) for cls in _task_classes(task)}
    files = dict.fromkeys(f for f in sources.values() if f)  # read once, however many classes
    # A class no file holds (defined in a REPL) counts by its name alone.
    unfiled = [f"{cls.__module__}.{cls.__qualname__}" for cls, f in sources.items() if f is None]
    return [file_sha256(Path(f)) for f in files] + unfiled


def _source_file(cls: type) -> str | None:
    try:
        return inspect.getsourcefile(cls)
    except (TypeError, OSError):
        return None


def _task_classes(task: object) -> Iterator[type]:
    """The classes of the task and of what it wraps, with their bases, outside the stdlib."""
    stdlib = sys.stdlib_module_names | {"builtins"}
    layer: object | None = task
    while layer is not None:
        yield from (c for c in type(layer).__mro__ if c.__module__.partition(".")[0] not in stdlib)
        layer = getattr(layer, "__dict__", {}).get("task")


def _dir_fingerprint(path: str | Path) -> list[Any]:
    # Names, sizes and mtimes: cheap, and changes whenever the checkpoint is rewritten.
    root = Path(path).resolve()
    return [str(root)] + [
        [p.name, p.stat().st_size, p.stat().st_mtime_ns]
        for p in sorted(root.iterdir())
        if p.is_file()
    ]


def resolve_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """The absolute warm-start cache directory. Empty or None: `warmstart/` in the user's
    cache ($PIPELINERL_CACHE, else $XDG_CACHE_HOME/pipelinerl, else ~/.cache/pipelinerl), the
    same from every working directory, so a run started elsewhere finds the cached model.
    A relative explicit path is taken against the working directory."""
    if cache_dir:
        return Path(cache_dir).expanduser().absolute()
    return user_cache("warmstart")


def warm_start(
    task: DemonstrationTask,
    cfg: WarmStartConfig = WarmStartConfig(),
    cache_dir: str | Path | None = None,
    base_model_dir: str | Path | None = None,
    progress: bool = True,
    demos: Demos | None = None,
) -> Path:
    """Return the directory of the warm-started model (HF format, tokenizer included),
    training it first unless the cache already holds it. `base_model_dir` replaces the
    tiny model built for `task.alphabet`; `cache_dir` as in `resolve_cache_dir`; `demos`
    (with a base model, whose tokenizer it encodes with) replaces `encode_demo`."""
    if demos is not None and not base_model_dir:
        raise ValueError("demos need the base model whose tokenizer encodes them")
    key = cache_key(task, cfg, base_model_dir, demos)
    name = f"{task.name}-{'base' if base_model_dir else cfg.preset}-{key}"
    out = resolve_cache_dir(cache_dir) / name
    if (out / MANIFEST).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Two runs started together on a new cache entry: the second waits, then takes the first's.
    with building(out):
        if not (out / MANIFEST).is_file():
            _build(task, cfg, base_model_dir, key, out, progress, demos)
    return out


def _build(task: DemonstrationTask, cfg: WarmStartConfig, base_model_dir: str | Path | None,
           key: str, out: Path, progress: bool, demos: Demos | None) -> None:
    """Train the warm-started model and save it, with its manifest, as `out`."""
    # Build in a private directory and rename at the end, so a crash or a concurrent run
    # never leaves a half-written model where the cache looks for a finished one.
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    prev_threads = torch.get_num_threads()
    threads = usable_threads(cfg.num_threads, "warm-start")
    torch.set_num_threads(threads)
    guard = ContentionGuard("warm-start")
    try:
        if base_model_dir:
            tokenizer = load_tokenizer(base_model_dir)
            if tokenizer.eos_token_id is None:
                raise ValueError(
                    f"tokenizer of {str(base_model_dir)!r} has no eos token to end demos"
                )
            with quiet_transformers(not progress):
                model = load_model(base_model_dir)
        else:
            tokenizer = build_char_tokenizer(task.alphabet, tmp)
            model = init_tiny_model(tokenizer, cfg.preset, cfg.seed)
        t0 = time.perf_counter()
        losses = train(model, tokenizer, task, cfg, progress, guard, demos)
        train_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        # Generation is many small ops, each a barrier across threads: one thread was about
        # as fast when quiet (4.0 vs 3.5 s) and 3x faster beside a busy process (4.7 vs 15.6).
        torch.set_num_threads(1)
        rng = random.Random(f"eval-{cfg.seed}")
        # An environment's rollouts need its replies, and other demos their own prompts, which
        # plain generation here lacks: the evaluator's version-0 pass measures the start.
        n_eval = 0 if is_environment(task) or demos else cfg.eval_problems
        problems = [task.sample_problem(rng) for _ in range(n_eval)]
        evals = {
            f"success_{name}": success_rate(model, tokenizer, task, problems, temperature, cfg.seed)
            for name, temperature in (("t1", 1.0), ("greedy", 0.0))
            if problems
        }
        eval_s = time.perf_counter() - t0
        with quiet_transformers(not progress):
            save_model(model, tokenizer, tmp)
        manifest = {
            "key": key,
            "task": task.name,
            "task_params": _params(task),
            "config": asdict(cfg),
            "base_model_dir": str(base_model_dir) if base_model_dir else None,
            "code_version": CODE_VERSION,
            "threads": threads,
            "threads_dropped_to_1_after_step": guard.dropped_at,
            "train_seconds": round(train_s, 1),
            "eval_seconds": round(eval_s, 1),
            "loss_first": losses[0],
            "loss_last": sum(losses[-20:]) / len(losses[-20:]),
            "eval_problems": n_eval,
            **evals,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        try:
            tmp.rename(out)
        except OSError:
            if not (out / MANIFEST).is_file():  # not a concurrent run that finished first
                raise
    finally:
        torch.set_num_threads(prev_threads)
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def quiet_transformers(quiet: bool = True) -> Iterator[None]:
    """When `quiet`, inside: no transformers progress bars ("Loading weights", "Writing model
    shards") and only its errors, so `progress=False` leaves a clean log; restored on exit."""
    if not quiet:
        yield
        return
    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def encode_demo(
    task: DemonstrationTask,
    tokenizer: PreTrainedTokenizerBase,
    rng: random.Random,
    step_error_prob: float,
    prompt: Callable[[str], list[int]] | None = None,
) -> Example:
    """(input_ids, labels) of one noisy demonstration; labels are -100 on the prompt, so the
    loss covers the completion and its EOS only. Prompt and completion are encoded
    separately, as the engine sees them; `prompt` encodes the prompt (default: as is)."""
    problem = task.sample_problem(rng)
    prompt_ids = prompt(problem.prompt) if prompt else encode_prompt(tokenizer, problem.prompt)
    completion = tokenizer.encode(
        task.demonstration(problem, rng, step_error_prob), add_special_tokens=False
    )
    completion.append(tokenizer.eos_token_id)
    return prompt_ids + completion, [-100] * len(prompt_ids) + completion


def collate(
    examples: list[tuple[list[int], list[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, labels). No attention mask is needed: attention is causal,
    so real tokens never see the padding that follows them, and padding has no labels."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, (seq, lab) in enumerate(examples):
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, : len(lab)] = torch.tensor(lab)
    return ids, labels


def demo_batches(
    task: DemonstrationTask,
    tokenizer: PreTrainedTokenizerBase,
    cfg: WarmStartConfig,
    rng: random.Random,
    demos: Demos | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches of fresh demonstrations (the task's, or `demos`'). Examples are drawn
    BUCKET batches at a time and grouped by length, so a batch is not padded to the rare long
    tail (about half the compute with the default length distribution)."""
    while True:
        pool = [
            demos.encode(rng, cfg.step_error_prob) if demos
            else encode_demo(task, tokenizer, rng, cfg.step_error_prob)
            for _ in range(BUCKET * cfg.batch_size)
        ]
        pool.sort(key=lambda ex: len(ex[0]))
        batches = [pool[i : i + cfg.batch_size] for i in range(0, len(pool), cfg.batch_size)]
        rng.shuffle(batches)
        for batch in batches:
            yield collate(batch, tokenizer.pad_token_id)


def train(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: DemonstrationTask,
    cfg: WarmStartConfig,
    progress: bool = True,
    guard: ContentionGuard | None = None,
    demos: Demos | None = None,
) -> list[float]:
    """Train in place on fresh noisy demonstrations; returns the loss of every step.
    `guard` is told each step's time and tokens (it may take threads away when the CPUs get
    shared)."""
    # The only randomness is the data: the model has no dropout.
    rng = random.Random(f"warmstart-{cfg.seed}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def lr_factor(step: int) -> float:  # linear warm-up, cosine decay to 10%
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * frac))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    model.train()
    losses = []
    batches = demo_batches(task, tokenizer, cfg, rng, demos)
    bar = tqdm(range(cfg.steps), desc="warm-start", disable=not progress, mininterval=1.0)
    for _ in bar:
        t0 = time.perf_counter()
        ids, labels = next(batches)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if guard:
            guard.step_took(time.perf_counter() - t0, ids.numel())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    model.eval()
    return losses


@torch.no_grad()
def sample_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    temperature: float = 1.0,
    max_new_tokens: int = 96,
    seed: int = 0,
    batch_size: int = 128,
) -> list[str]:
    """Plain HF `generate` (greedy when temperature is 0, else pure sampling: no top-k/p),
    decoded up to the first EOS. A reference sampler, independent of the project's engine;
    `seed` seeds a private RNG state, so the caller's torch RNG is left as it was."""
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    else:
        sampling = {"do_sample": False}
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    out = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(prompts), batch_size):
            enc = [
                encode_prompt(tokenizer, p)
                for p in prompts[start : start + batch_size]
            ]
            width = max(len(e) for e in enc)
            # Left padding so every prompt ends where generation starts.
            ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])
            mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
            gen = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos,
                pad_token_id=pad,
                **sampling,
            )
            for row in gen[:, width:].tolist():
                row = row[: row.index(eos)] if eos in row else row
                out.append(tokenizer.decode(row, skip_special_tokens=True))
    return out


def success_rate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: DemonstrationTask,
    problems: list[Problem],
    temperature: float = 1.0,
    seed: int = 0,
) -> float:
    """Fraction of `problems` solved by `sample_completions` at `temperature`, with room
    for the longest worked solution of `problems` (long chains run to hundreds of tokens)."""
    rng = random.Random(0)
    longest = max(len(tokenizer.encode(task.demonstration(p, rng, 0.0))) for p in problems)
    completions = sample_completions(
        model, tokenizer, [p.prompt for p in problems], temperature,
        max_new_tokens=max(96, longest + 16), seed=seed,
    )
    solved = sum(task.score(p, c).success for p, c in zip(problems, completions, strict=True))
    return solved / len(problems)
