"""reasoning-gym's procedural datasets as a task (`task.name=reasoning_gym`).

reasoning-gym (`pip install 'pipelinerl[reasoning-gym]'`) generates verifiable problems on the
fly: `create_dataset(name, size=, seed=, **config)` gives entries with a question, an answer and
metadata, and the dataset's own `score_answer(answer=, entry=)` grades an answer in [0, 1].
Here:
- `dataset` names one (its config, the difficulty knobs, in `config`), or `datasets` lists
  several as `{name, weight, config}`, mixed by reasoning-gym's own `composite` dataset (also
  reachable as `dataset: composite`).
- A problem is an index into the dataset (deterministic for a seed): the verifier workers
  regenerate the entry from it and grade with the dataset's `score_answer`. The reward is that
  grade (partial credit kept); success is a grade of at least `success_threshold`.
- The prompt is the question and an instruction for the answer's form; `extract` picks the
  answer out of the completion (the graders want the bare answer; small models write
  sentences): `last_line`, `last_word` (the last number or word), `tag` (inside
  `<answer>...</answer>`, reasoning-gym's own convention) or `raw`.
- Problem ids are the questions, so the held-out split (tasks.split) keeps every question it
  holds out away from training, whatever index or seed generated it.
"""

from __future__ import annotations

import difflib
import random
import re
from typing import Any

from pipelinerl.tasks.base import Problem, Score, require_int

INSTRUCTIONS = {
    "last_line": " Give the final answer alone on the last line.",
    "last_word": " Answer with just the answer.",
    "tag": " Give the final answer inside <answer> </answer> tags.",
    "raw": " Answer with just the answer.",
}
_WORD = re.compile(r"[-+]?\d+(?:\.\d+)?|\w+")
_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)


def extract_answer(completion: str, how: str) -> str:
    """The answer a completion gives, read as `how` says ('' when it gives none)."""
    text = completion.strip()
    if how == "raw":
        return text
    if how == "tag":
        found = _TAG.findall(text)
        return found[-1].strip() if found else ""
    if how == "last_line":
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return lines[-1].removeprefix("Answer:").strip().rstrip(".") if lines else ""
    words = _WORD.findall(text)
    return words[-1] if words else ""


def _load_reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError("task reasoning_gym needs the reasoning-gym package: "
                         "pip install 'pipelinerl[reasoning-gym]'") from None
    return reasoning_gym


def build_dataset(dataset: str | None, config: dict[str, Any], datasets: list[dict] | None,
                  seed: int, size: int) -> Any:
    """The reasoning-gym dataset the params describe; an unknown name, config key or value
    raises ValueError naming it."""
    rg = _load_reasoning_gym()
    from reasoning_gym.composite import DatasetSpec
    from reasoning_gym.factory import DATASETS

    if (dataset is None) == (datasets is None):
        raise ValueError("give either `dataset` (one reasoning-gym dataset, its config in "
                         "`config`) or `datasets` (a list of {name, weight, config})")
    if datasets is not None:
        dataset, config = "composite", {"datasets": datasets}
    specs = []
    if dataset == "composite":
        for spec in config.get("datasets") or []:
            if not isinstance(spec, dict) or "name" not in spec:
                raise ValueError(f"each of `datasets` must be a mapping with a name, got {spec!r}")
            unknown = sorted(set(spec) - {"name", "weight", "config"})
            if unknown:
                raise ValueError(f"dataset {spec['name']!r}: unknown key(s) {unknown}; accepted: "
                                 "name, weight, config")
            specs.append(spec)
        if not specs:
            raise ValueError("a composite needs a non-empty list of datasets")
    for name in [dataset] if dataset != "composite" else [s["name"] for s in specs]:
        if name not in DATASETS:
            close = difflib.get_close_matches(str(name), list(DATASETS), n=3)
            raise ValueError(f"unknown reasoning-gym dataset {name!r}"
                             + (f"; did you mean {close}?" if close else "")
                             + f" ({len(DATASETS)} registered: reasoning_gym.factory.DATASETS)")
    if specs:
        config = {**config, "datasets": [DatasetSpec(name=s["name"], weight=s.get("weight", 1.0),
                                                     config=s.get("config") or {})
                                         for s in specs]}
    try:
        return rg.create_dataset(dataset, size=size, seed=seed, **config)
    except (TypeError, AssertionError, ValueError, KeyError) as e:
        # Unknown config keys raise TypeError, out-of-range values AssertionError.
        raise ValueError(f"reasoning-gym dataset {dataset!r} refuses config {config!r}: "
                         f"{type(e).__name__}: {e}") from None


class ReasoningGymTask:
    name = "reasoning_gym"

    def __init__(self, dataset: str | None = None, config: dict[str, Any] | None = None,
                 datasets: list[dict[str, Any]] | None = None, seed: int = 0,
                 size: int = 100_000, extract: str = "last_line",
                 instruction: str | None = None, success_threshold: float = 1.0) -> None:
        if extract not in INSTRUCTIONS:
            raise ValueError(f"extract must be one of {sorted(INSTRUCTIONS)}, got {extract!r}")
        require_int("size", size)
        if not 0.0 < success_threshold <= 1.0:
            raise ValueError(f"success_threshold must be in (0, 1], got {success_threshold!r}")
        self.dataset = build_dataset(dataset, dict(config or {}), datasets, seed, size)
        self.size, self.extract = size, extract
        self.instruction = INSTRUCTIONS[extract] if instruction is None else instruction
        self.success_threshold = success_threshold

    def sample_problem(self, rng: random.Random) -> Problem:
        index = rng.randrange(self.size)
        question = self.dataset[index]["question"]
        return Problem(problem_id=f"reasoning_gym:{question}", prompt=question + self.instruction,
                       answer=index)

    def score(self, problem: Problem, completion: str) -> Score:
        entry = self.dataset[int(problem.answer)]
        grade = self.dataset.score_answer(answer=extract_answer(completion, self.extract),
                                          entry=entry)
        reward = min(1.0, max(0.0, float(grade or 0.0)))
        return Score(reward=reward, success=reward >= self.success_threshold)
