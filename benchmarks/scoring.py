"""Scoring off the decode path: the actor's decode throughput with a slow verifier.

Target (issue 8): with a verifier that sleeps 50 ms per completion, the actor generates within
10% of the tokens/s it reaches with an instant verifier.

Setup: the real actor loop (`Actor`, `Scorer`) drives the torch engine on the tiny preset model
(random weights, fp32, one torch thread) with arithmetic prompts: group size 8, batch 64,
max_lag 4, engine capacity 64, 96 new tokens and no stop token, so every completion is 96
tokens long and every run does the same work per sample. A stand-in trainer takes each batch
the moment its 8 groups are published and hands the actor the next version through a
stand-in weight channel (no weights move), so admission follows the real staleness bound:
decoding waits only when the actor has run `max_lag` steps ahead of its own scoring.
The verifier is the arithmetic task's, plus the sleep. Rows:
- instant: no sleep, verifier worker processes as in a run;
- 50 ms: the sleep, in `WORKERS` verifier processes (a sleeping verifier costs no CPU, so the
  workers needed grow with completions/s x seconds per verification);
- 50 ms inline: the same verifier called in the actor loop as each group finishes, the path
  before scoring moved off it (for reference).

tok/s = tokens of finished completions / wall time over the measured window, after a warm-up
that covers starting the verifier processes (at least the warm-up time, and until the first
group is published). Actor idle: time the engine had nothing to do
(the inline row's stalls are not counted there: its verifier runs while sequences wait).
Actor CPU / wall: the actor process's CPU time (all its threads) over the window; below 1,
its core was idle or taken by other processes. Rows alternate within each round, and the
ratio to instant is the median over rounds of the ratio within a round, which cancels most
of the drift when other jobs load the machine (the order of the rows alternates too).

Run: `python benchmarks/scoring.py` (writes the `scoring` section of RESULTS.md) or `--quick`.
Top-level imports stay light: verifier worker processes re-import this file to find the task.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelinerl.rollouts.scoring import Scored
from pipelinerl.tasks.arithmetic import ChainArithmeticTask
from pipelinerl.tasks.base import Problem, Score

GROUP_SIZE, BATCH_SIZE, MAX_LAG, CAPACITY, MAX_NEW_TOKENS = 8, 64, 4, 64, 96
DELAY_S = 0.05
WORKERS = 8
TARGET = 0.90
MAX_WARMUP_S = 120.0


class SleepyArithmeticTask(ChainArithmeticTask):
    """The arithmetic task whose verifier also sleeps `delay_s`."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def score(self, problem: Problem, completion: str) -> Score:
        time.sleep(self.delay_s)
        return super().score(problem, completion)


class InstantTrainer:
    """Stands in for the stream and the trainer: every `BATCH_SIZE // GROUP_SIZE` groups
    published make one optimizer step, whose weights are at once available."""

    def __init__(self) -> None:
        self.groups = 0
        self.version = 0

    def write(self, record: dict[str, Any]) -> None:
        self.groups += 1
        self.version = self.groups // (BATCH_SIZE // GROUP_SIZE)

    def close(self) -> None:
        pass


class VersionChannel:
    """Stands in for the weight channel: hands the trainer's version over, copies nothing."""

    def __init__(self, trainer: InstantTrainer) -> None:
        self.trainer = trainer
        self.received = 0

    def poll(self) -> int | None:
        return self.trainer.version if self.trainer.version > self.received else None

    def receive_into(self, targets: Any) -> int:
        self.received = self.trainer.version
        return self.received

    def close(self) -> None:
        pass


class InlineScorer:
    """The path before this change, for reference: a group is scored in the actor loop, one
    completion after the other, as soon as it finishes."""

    def __init__(self, task: SleepyArithmeticTask) -> None:
        self.task = task
        self._scored: list[Scored] = []

    def submit(self, key: str, problem: Problem, completions: list[str]) -> None:
        scores = [self.task.score(problem, c) for c in completions]
        self._scored.append(Scored(key, scores))

    def poll(self) -> list[Scored]:
        scored, self._scored = self._scored, []
        return scored

    def wait(self, timeout_s: float) -> None:
        time.sleep(timeout_s)

    def close(self) -> None:
        pass


@dataclass
class Measure:
    tokens_per_s: float
    idle_frac: float
    groups_per_s: float
    cpu_share: float  # the actor process's CPU time / wall time


def run_actor(model_dir: Path, tokenizer: Any, delay_s: float, inline: bool,
              warmup_s: float, measure_s: float) -> Measure:
    from pipelinerl.config import Config
    from pipelinerl.engine import EngineOptions
    from pipelinerl.engine.torch_engine import TorchEngine
    from pipelinerl.models.hf import encode_prompt
    from pipelinerl.models.prompts import Codec
    from pipelinerl.roles.actor import Actor, Streams

    engine = TorchEngine.from_pretrained(model_dir, EngineOptions(capacity=CAPACITY, max_seq_len=128))
    trainer = InstantTrainer()
    task = SleepyArithmeticTask(delay_s)
    marks: dict[str, float] = {}
    actor: Actor

    def should_stop() -> bool:
        # The window opens after `warmup_s` and the first published group (on a loaded machine
        # the verifier processes and the first batch can take longer than the warm-up).
        now = time.monotonic()
        if "t0" not in marks and now - start > warmup_s and actor.stats.groups_published:
            marks.update(t0=now, cpu=time.process_time(), tokens=actor.stats.generated_tokens,
                         idle=actor.stats.idle_s, groups=actor.stats.groups_published)
        if "t0" not in marks and now - start > MAX_WARMUP_S:
            raise RuntimeError(f"no group was published within {MAX_WARMUP_S:.0f} s")
        return "t0" in marks and now - marks["t0"] > measure_s

    cfg = Config(trainer={"batch_size": BATCH_SIZE},
                 engine={"max_new_tokens": MAX_NEW_TOKENS, "max_seq_len": 128,
                         "temperature": 1.0, "capacity": CAPACITY},
                 actor={"group_size": GROUP_SIZE, "max_lag": MAX_LAG, "verifier_timeout_s": 10.0,
                        "verifier_workers": 1 if inline else WORKERS})
    codec = Codec(encode=lambda text: encode_prompt(tokenizer, text),
                  decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                  encode_text=lambda text: tokenizer.encode(text, add_special_tokens=False),
                  stop_ids=())
    streams = Streams(trainer, VersionChannel(trainer), should_stop=should_stop)
    actor = Actor(cfg, engine, task, codec, streams)
    if inline:
        actor.scorer.close()
        actor.scorer = actor.collector.scorer = InlineScorer(task)  # type: ignore[assignment]
    start = time.monotonic()
    actor.run()
    wall = time.monotonic() - marks["t0"]
    return Measure(
        tokens_per_s=(actor.stats.generated_tokens - marks["tokens"]) / wall,
        idle_frac=(actor.stats.idle_s - marks["idle"]) / wall,
        groups_per_s=(actor.stats.groups_published - marks["groups"]) / wall,
        cpu_share=(time.process_time() - marks["cpu"]) / wall,
    )


ROWS = [("instant", 0.0, False), (f"{DELAY_S * 1000:.0f} ms", DELAY_S, False),
        (f"{DELAY_S * 1000:.0f} ms inline (before)", DELAY_S, True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="seconds; no RESULTS.md")
    parser.add_argument("--out", type=Path, help="write the section to this file instead")
    args = parser.parse_args()

    import _results
    import torch

    from pipelinerl.models.tiny import build_char_tokenizer, build_tiny_model

    torch.set_num_threads(1)
    load = _results.load_average()
    rounds, warmup_s, measure_s = (1, 4.0, 2.0) if args.quick else (5, 5.0, 12.0)
    results: dict[str, list[Measure]] = {name: [] for name, _, _ in ROWS}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_char_tokenizer(ChainArithmeticTask.alphabet, tmp)
        model_dir = build_tiny_model(Path(tmp) / "model", tokenizer, "tiny", seed=0)
        for r in range(rounds):
            for name, delay_s, inline in ROWS if r % 2 == 0 else ROWS[::-1]:
                m = run_actor(model_dir, tokenizer, delay_s, inline, warmup_s, measure_s)
                results[name].append(m)
                print(f"round {r}: {name}: {m.tokens_per_s:.0f} tok/s, idle {m.idle_frac:.0%}, "
                      f"actor CPU / wall {m.cpu_share:.2f}", flush=True)

    def median(name: str, field: str) -> float:
        return statistics.median(getattr(m, field) for m in results[name])

    rows = []
    for name, delay_s, inline in ROWS:
        tps = median(name, "tokens_per_s")
        ratio = statistics.median(
            m.tokens_per_s / base.tokens_per_s for m, base in zip(results[name], results["instant"]))
        verdict = "" if name == "instant" or inline else (
            " (met)" if ratio >= TARGET else " (missed)")
        rows.append([
            name, "inline" if inline else str(WORKERS), f"{tps:.0f}",
            f"**{ratio:.2f}x**{verdict}", f"{median(name, 'idle_frac'):.0%}",
            f"{median(name, 'groups_per_s') * GROUP_SIZE:.0f}",
            f"{median(name, 'cpu_share'):.2f}",
            ", ".join(f"{m.tokens_per_s:.0f}" for m in results[name]),
        ])
    table = _results.table(
        ["verifier", "verifier processes", "tok/s (median)", f"/ instant (target >= {TARGET:.2f}x)",
         "actor idle", "completions scored/s", "actor CPU / wall", "tok/s per round"], rows)
    print(table)
    section = (
        "## Scoring off the decode path (`benchmarks/scoring.py`)\n\n"
        + _results.environment(load) + "\n"
        + __doc__.split("\n\n", 1)[1].split("Run:")[0].strip() + "\n\n"
        + f"{rounds} rounds, at least {warmup_s:.0f} s warm-up + {measure_s:.0f} s measured per row and "
        "round.\n\n" + table
    )
    if args.out or not args.quick:
        _results.write_section("scoring", section, *([args.out] if args.out else []))


if __name__ == "__main__":
    main()
