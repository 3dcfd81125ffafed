"""Prompts and answers from a local dataset, scored by a reward function the user names.

`task.name: dataset` reads, with Hugging Face `datasets`, a JSONL, JSON, Parquet or CSV file, a
folder of such files (split by file name: train.jsonl, test.jsonl, ...) or a folder written
by `save_to_disk`; never the hub. Columns map to prompts (`prompt_column`, or a
`prompt_template` over any columns), answers (`answer_column`) and ids (`id_column`, else
`<split>:<row>`; the rows of one prompt share its first row's id, `one_id_per_prompt`). A bad
row is skipped, counted and named in the log.

Training reads the `split` in epochs, each in its own order (`shuffle_seed`, epoch); with
several actors, actor k of n takes positions k, k + n, ... (`shard`). The position travels
with every published group (`Group.data_pos`), so a restarted actor or a resumed run continues
where it stopped (`seek`). The held-out set is the `test_split` when one is named, else the
rows of `split` whose id the run's `task.heldout_frac` holds out (the split every task uses):
all the rows of a prompt, or none.

The reward is `module:function`, called as `function(prompt, completion, answer)`; it returns a
float (success when at least `success_threshold`), a bool, or a `Score`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from pipelinerl.proc.plugins import import_object
from pipelinerl.tasks.base import Problem, Score
from pipelinerl.tasks.split import is_heldout

log = logging.getLogger(__name__)

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
MAX_ROW_WARNINGS = 10  # bad rows named one by one; the rest only counted
DEFAULT_REWARD = f"{__name__}:exact_match"


def exact_match(prompt: str, completion: str, answer: Any) -> bool:
    """The default reward: the completion, stripped, is the answer."""
    return completion.strip() == str(answer).strip()


def prompt_key(prompt: str) -> str:
    """What makes two prompts one problem: their text, runs of whitespace aside."""
    return " ".join(prompt.split())


def one_id_per_prompt(problems: list[Problem]) -> list[Problem]:
    """Each problem under the id of the first one with its prompt (`prompt_key`). The held-out
    split hashes ids (`tasks.split`): with an id per row, a prompt on two rows could be held out
    on one and trained on through the other."""
    first: dict[str, str] = {}
    return [dataclasses.replace(p, problem_id=first.setdefault(prompt_key(p.prompt), p.problem_id))
            for p in problems]


def load_splits(path: Path) -> dict[str, Any]:
    """A local dataset's splits as `datasets.Dataset`s, read once (a single file: `train`)."""
    import datasets

    datasets.disable_progress_bars()  # a bar per load in every role's log says nothing
    if not path.exists():
        raise ValueError(f"dataset {str(path)!r} does not exist (datasets are read from local "
                         "files and folders only)")
    try:
        if path.is_dir() and ((path / "dataset_dict.json").exists()
                              or (path / "state.json").exists()):
            loaded = datasets.load_from_disk(str(path))
        elif path.is_dir():
            loaded = datasets.load_dataset(str(path))
        elif path.suffix in FORMATS:
            loaded = datasets.load_dataset(FORMATS[path.suffix], data_files={"train": str(path)})
        else:
            raise ValueError(f"dataset {str(path)!r}: unknown format {path.suffix!r}; known: "
                             f"{sorted(FORMATS)}, a folder of such files, or a save_to_disk folder")
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets and pyarrow raise many types
        raise ValueError(f"dataset {str(path)!r} could not be read: {type(e).__name__}: {e}") from e
    return dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}


class DatasetTask:
    name = "dataset"

    def __init__(
        self,
        path: str,
        split: str = "train",
        test_split: str | None = None,
        prompt_column: str = "prompt",
        prompt_template: str | None = None,
        answer_column: str = "answer",
        id_column: str | None = None,
        reward: str = DEFAULT_REWARD,
        success_threshold: float = 1.0,
        shuffle_seed: int = 0,
    ) -> None:
        self.path, self.split, self.test_split = Path(path), split, test_split
        self.prompt_column, self.prompt_template = prompt_column, prompt_template
        self.answer_column, self.id_column = answer_column, id_column
        self.reward, self.success_threshold = reward, float(success_threshold)
        self.shuffle_seed = shuffle_seed
        self._reward_fn: Callable[..., Any] | None = self._load_reward()
        self.skipped: Counter[str] = Counter()  # bad rows by reason, over both splits
        splits = load_splits(self.path)
        self.train = self._load(splits, split)
        self.test = self._load(splits, test_split) if test_split else []
        if self.skipped:
            log.warning("dataset %s: skipped %d bad row(s): %s", self.path,
                        sum(self.skipped.values()), dict(self.skipped))
        self.position = 0  # draws this shard has made
        self._shard = (0, 1)
        self._epoch = -1
        self._order: list[int] = []

    # -- data -------------------------------------------------------------------------------
    def _load(self, splits: dict[str, Any], split: str) -> list[Problem]:
        if split not in splits:
            raise ValueError(f"dataset {str(self.path)!r} has no split {split!r}; it has "
                             f"{sorted(splits)}")
        problems: list[Problem] = []
        for index, row in enumerate(splits[split]):
            problem, reason = self._problem(split, index, row)
            if problem is not None:
                problems.append(problem)
                continue
            self.skipped[reason] += 1
            if sum(self.skipped.values()) <= MAX_ROW_WARNINGS:
                log.warning("dataset %s, split %s, row %d: skipped (%s)", self.path, split, index,
                            reason)
        if not problems:
            raise ValueError(f"dataset {str(self.path)!r}, split {split!r}: no usable rows "
                             f"(skipped: {dict(self.skipped) or 'the split is empty'})")
        return one_id_per_prompt(problems)

    def _problem(self, split: str, index: int, row: dict[str, Any]) -> tuple[Problem | None, str]:
        if self.prompt_template is not None:
            try:
                prompt = self.prompt_template.format(**row)
            except KeyError as e:
                return None, f"prompt_template needs column {e.args[0]!r}"
        else:
            prompt = row.get(self.prompt_column)
            if not isinstance(prompt, str):
                return None, f"{self.prompt_column!r} missing or not text"
        if not prompt.strip():
            return None, "empty prompt"
        answer = row.get(self.answer_column)
        if answer is None:
            return None, f"{self.answer_column!r} missing"
        problem_id = f"{split}:{index}"
        if self.id_column is not None:
            if row.get(self.id_column) is None:
                return None, f"{self.id_column!r} missing"
            problem_id = str(row[self.id_column])
        return Problem(problem_id, prompt, answer), ""

    def params(self) -> dict[str, Any]:
        return {"path": str(self.path), "split": self.split, "test_split": self.test_split,
                "prompt_column": self.prompt_column, "prompt_template": self.prompt_template,
                "answer_column": self.answer_column, "id_column": self.id_column}

    # -- drawing ----------------------------------------------------------------------------
    @property
    def has_test_split(self) -> bool:
        return bool(self.test_split)

    def shard(self, index: int, count: int) -> None:
        """Draw every `count`-th position from `index`: actor `index` of `count`."""
        self._shard = (index, count)

    def seek(self, position: int) -> None:
        """Continue from `position` draws of this shard (a restarted or resumed actor)."""
        self.position = position

    def sample_problem(self, rng: random.Random) -> Problem:
        """The next problem in this epoch's order (`rng` is not used: the order is the
        dataset's, shuffled per epoch by `shuffle_seed`)."""
        index, count = self._shard
        epoch, offset = divmod(self.position * count + index, len(self.train))
        self.position += 1
        if epoch != self._epoch:
            self._order = list(range(len(self.train)))
            random.Random(f"{self.shuffle_seed}-{epoch}").shuffle(self._order)
            self._epoch = epoch
        return self.train[self._order[offset]]

    def heldout_problems(self, n: int, seed: int, heldout_frac: float) -> list[Problem]:
        """At most `n` distinct held-out problems, in an order fixed by `seed`."""
        rows = self.test or [p for p in self.train if is_heldout(p.problem_id, heldout_frac)]
        pool = list({prompt_key(p.prompt): p for p in rows}.values())  # a prompt's rows: once
        if not pool:
            raise ValueError(f"dataset {str(self.path)!r}: no held-out rows (name a test_split, "
                             "or raise task.heldout_frac)")
        order = list(range(len(pool)))
        random.Random(f"heldout-{seed}").shuffle(order)
        return [pool[i] for i in order[:n]]

    # -- scoring ----------------------------------------------------------------------------
    def _load_reward(self) -> Callable[..., Any]:
        fn = import_object(self.reward, f"reward {self.reward!r}")
        if not callable(fn):
            raise ValueError(f"reward {self.reward!r} is a {type(fn).__name__}, not a function")
        return fn

    def score(self, problem: Problem, completion: str) -> Score:
        if self._reward_fn is None:  # in a verifier worker: imported there once
            self._reward_fn = self._load_reward()
        value = self._reward_fn(problem.prompt, completion, problem.answer)
        if isinstance(value, Score):
            return value
        if isinstance(value, bool):
            return Score(float(value), value)
        if isinstance(value, (int, float)) and math.isfinite(value):
            return Score(float(value), value >= self.success_threshold)
        raise TypeError(f"reward {self.reward!r} returned {value!r}: expected a finite float, "
                        "a bool or a Score")

    def __getstate__(self) -> dict[str, Any]:
        # Verifier workers only score: they get neither the rows nor the imported function.
        return {"reward": self.reward, "success_threshold": self.success_threshold,
                "_reward_fn": None, "path": self.path, "split": self.split, "test_split":
                self.test_split, "train": [], "test": []}
