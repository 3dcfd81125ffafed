"""Decode-step cost against the number of sequences decoding: what a drained slot costs here.

A conventional RL round starts a batch of sequences together and starts no new one until the
trainer's next weights, so as they finish the engine decodes fewer and fewer (on
examples/long_chains.yaml its slot occupancy is 24-40%, docs/learning_speed.md). What that
costs depends on the hardware. On a GPU a small-batch decode step is bound by reading the
weights and the KV cache: it takes about as long for 8 sequences as for 64, so a drained batch
wastes the idle slots' share of the engine. On a CPU the step's arithmetic grows with the
sequences it decodes, so an idle slot costs only the step's fixed part.

This measures which holds on this machine, for the model the long-generation benchmark trains
(the v3 starting model) in the torch engine (capacity 64, fp32, one thread): for n sequences
decoding together, the process CPU time per decode step, interleaved over repetitions
(median), at the same positions for every n (the sequences' tokens 40 to 40 + STEPS, after a
typical 9-token prompt; long_chains' median answer is 84 tokens). The least-squares line
cost(n) = fixed + per_sequence * n gives the fixed part; the table gives, per n, the cost of
one token relative to a full engine's.

    python benchmarks/step_cost.py              # RESULTS.md section `step_cost`, ~1 minute
    python benchmarks/step_cost.py --quick --out /tmp/sc   # smoke: seconds, nothing recorded
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool

import argparse
import random
import statistics
from pathlib import Path

import numpy as np
import torch

from _results import Timer, environment, load_average, results_file, table, write_section

BENCH = Path(__file__).resolve().parent
MODEL = BENCH / "learning_speed_v3" / "starting_model"
CAPACITY = 64
WARM_STEPS = 40  # tokens each sequence generates before the timed steps
STEPS = 100
SIZES = [1, 2, 4, 8, 16, 32, 64]
REPS = 5
QUICK = {"sizes": [1, 8, 64], "steps": 5, "reps": 1}


def make_engine() -> tuple[object, list[list[int]]]:
    """The torch engine on the starting model, and long_chains prompts for it."""
    from pipelinerl.engine import EngineOptions
    from pipelinerl.engine.torch_engine import TorchEngine
    from pipelinerl.models.hf import encode_prompt, load_tokenizer
    from pipelinerl.tasks.progression import ProgressionTask

    tokenizer = load_tokenizer(MODEL)
    task, rng = ProgressionTask(max_steps=60), random.Random(0)
    prompts = [encode_prompt(tokenizer, task.sample_problem(rng).prompt) for _ in range(CAPACITY)]
    max_seq = max(map(len, prompts)) + WARM_STEPS + STEPS + 2
    return TorchEngine.from_pretrained(MODEL, EngineOptions(capacity=CAPACITY, max_seq_len=max_seq)), prompts


def step_cost_ms(engine: object, prompts: list[list[int]], n: int, steps: int) -> float:
    """CPU milliseconds per decode step with `n` sequences decoding, after WARM_STEPS tokens.
    No stop token and one length for all: exactly `n` decode for the whole timed stretch."""
    from pipelinerl.types import GenerationRequest, SamplingParams

    params = SamplingParams(max_new_tokens=WARM_STEPS + steps + 1, temperature=1.0)
    for i in range(n):
        engine.add_request(GenerationRequest(f"n{n}-{i}", list(prompts[i]), params))
    for _ in range(WARM_STEPS):  # the first also prefills
        engine.step()
    if engine.num_running() != n:
        raise RuntimeError(f"{engine.num_running()} sequences decoding, expected {n}")
    timer = Timer()
    for _ in range(steps):
        engine.step()
    cpu_s = timer.elapsed()[1]
    while engine.num_active():  # the last token of each
        engine.step()
    return 1000 * cpu_s / steps


def measure(sizes: list[int], steps: int, reps: int) -> dict[int, float]:
    """Median CPU ms per decode step by number of sequences, sizes interleaved per repetition."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    engine, prompts = make_engine()
    step_cost_ms(engine, prompts, max(sizes), min(steps, 10))  # warm-up
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(reps):
        for n in sizes:
            samples[n].append(step_cost_ms(engine, prompts, n, steps))
    return {n: statistics.median(v) for n, v in samples.items()}


def linear_fit(cost: dict[int, float]) -> tuple[float, float]:
    """Least-squares fixed cost and cost per sequence (ms) of a decode step."""
    n, ms = np.array(list(cost), dtype=float), np.array(list(cost.values()))
    per_sequence, fixed = np.polyfit(n, ms, 1)
    return float(fixed), float(per_sequence)


def report(cost: dict[int, float], load: tuple[float, float, float], steps: int,
           reps: int) -> str:
    full = max(cost)
    fixed, per_sequence = linear_fit(cost)
    rows = [[str(n), f"{n / full:.0%}", f"{ms:.2f}", f"{ms / cost[full]:.2f}",
             f"{ms / n:.3f}", f"{(ms / n) / (cost[full] / full):.2f}x", f"{full / n:.0f}x"]
            for n, ms in sorted(cost.items())]
    return "\n".join([
        "## Decode-step cost against sequences decoding (`benchmarks/step_cost.py`)",
        "",
        environment(load).rstrip("\n"),
        f"- model: benchmarks/learning_speed_v3/starting_model (the long_chains policy, tiny "
        f"preset) in the torch engine, capacity {CAPACITY}, fp32; CPU time per decode step over "
        f"{steps} steps at the sequences' tokens {WARM_STEPS}-{WARM_STEPS + steps}, median of "
        f"{reps} interleaved repetitions",
        "",
        table(["sequences decoding", "occupancy", "CPU ms per step", "step cost / full",
               "ms per token", "token cost / full engine's", "if the step cost were fixed"],
              rows),
        f"Least-squares line: cost(n) = {fixed:.2f} ms + {per_sequence:.3f} ms x n; the fixed "
        f"part is {fixed / cost[full]:.0%} of a full step. The last column is what a token would "
        "cost if a step took as long whatever the sequences decoding (the GPU case, memory-bound "
        "at small batches): the drained batch's loss there; the column before it is the loss "
        "measured here.",
    ])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke: seconds, into --out only")
    p.add_argument("--out", type=Path, help="a directory: write the section to its RESULTS.md")
    args = p.parse_args()
    sizes, steps, reps = (QUICK["sizes"], QUICK["steps"], QUICK["reps"]) if args.quick \
        else (SIZES, STEPS, REPS)
    if args.quick and args.out is None:
        p.error("--quick writes only into --out")
    load = load_average()
    text = report(measure(sizes, steps, reps), load, steps, reps)
    print(text)
    write_section("step_cost", text, results_file(args.out))


if __name__ == "__main__":
    main()
