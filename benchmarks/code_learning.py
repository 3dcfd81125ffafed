"""Code RL on the CPU (issue 42): `examples/code.yaml` (SmolLM2-135M-Instruct writing small
Python functions, each scored by its ten asserts in the sandbox) for its 20 minutes, one run per
seed, one after the other on a quiet machine. Held-out pass@1 (mean of 8 sampled attempts per
problem, T=1) and greedy accuracy on the 25 held-out problems at version 0, the version due
after 600 s and the final weights: the example's deferred evaluation, so the 20 minutes are all
RL and the evaluation runs after them on both cores.

Each run's records (config, metrics.jsonl, held-out completions, health panel) are copied into
benchmarks/code_runs/ as it ends; the report is made from those records alone.

Needs `pipelinerl prepare smollm2` and bubblewrap (`make sandbox`). Run:
`python benchmarks/code_learning.py` (about 25 minutes a seed; `--seeds 0,1,2`), or
`python benchmarks/code_learning.py --report-only` to write the section again from the records.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import _results

RECORDS = Path(__file__).resolve().parent / "code_runs"
CONFIG = _results.ROOT / "examples" / "code.yaml"
SAMPLED, GREEDY = "eval/sampled/pass@1", "eval/greedy"


def run_seed(seed: int, out: Path) -> None:
    name = f"seed{seed}"
    record = _results.train([str(CONFIG), f"seed={seed}", f"output_dir={out}", f"name={name}",
                             "metrics.progress=false"], f"seed {seed}")
    _results.keep_run(out / name, RECORDS, name, {"seed": seed, **record},
                      jsonl=("metrics", "eval_samples"), panel=True)


def seed_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The evaluated versions in order, the steps, and the training curve's ends."""
    evals = sorted((r for r in rows if "eval/version" in r), key=lambda r: r["eval/version"])
    steps = [r for r in rows if "eval/version" not in r and "step" in r and "reward" in r]

    def mean_of(part: list[dict[str, Any]], key: str) -> float:
        return statistics.fmean(r[key] for r in part) if part else float("nan")

    return {
        "evals": evals,
        "steps": len(steps),
        "seconds": steps[-1]["time_s"] if steps else 0.0,
        "reward_first": mean_of(steps[:5], "reward"),
        "reward_last": mean_of(steps[-5:], "reward"),
        "truncated_first": mean_of(steps[:5], "completion_truncated_frac"),
        "truncated_last": mean_of(steps[-5:], "completion_truncated_frac"),
        "len_first": mean_of(steps[:5], "completion_len_mean"),
        "len_last": mean_of(steps[-5:], "completion_len_mean"),
    }


def _eval_cell(row: dict[str, Any]) -> str:
    return (f"{row[SAMPLED]:.3f} / {row[GREEDY]:.3f} "
            f"(v{row['eval/version']}, {row.get('time_s', 0):.0f} s)")


def render(seeds: list[int]) -> str:
    summaries = {s: seed_summary(_results.kept_rows(RECORDS, f"seed{s}")) for s in seeds}
    rows, starts, ends = [], [], []
    for s, m in summaries.items():
        ev = m["evals"]
        middle = _eval_cell(ev[1]) if len(ev) > 2 else "-"
        rows.append([str(s), _eval_cell(ev[0]), middle, _eval_cell(ev[-1]), str(m["steps"]),
                     f"{m['reward_first']:.2f} -> {m['reward_last']:.2f}",
                     f"{m['len_first']:.0f} -> {m['len_last']:.0f}",
                     f"{m['truncated_first']:.2f} -> {m['truncated_last']:.2f}"])
        starts.append((ev[0][SAMPLED], ev[0][GREEDY]))
        ends.append((ev[-1][SAMPLED], ev[-1][GREEDY]))
    gains = [e[0] - b[0] for b, e in zip(starts, ends)]
    rows.append(["mean", " / ".join(f"{statistics.fmean(x):.3f}" for x in zip(*starts)), "",
                 " / ".join(f"{statistics.fmean(x):.3f}" for x in zip(*ends)), "", "", "", ""])
    table = _results.table(
        ["seed", "start: pass@1 / greedy", "~10 minutes", "end", "optimizer steps",
         "batch reward (first 5 -> last 5 steps)", "completion tokens", "cut at 96 tokens"],
        rows)
    return (
        "## Code RL on the CPU: examples/code.yaml (`benchmarks/code_learning.py`)\n\n"
        + _results.environment(None)
        + "- runs: `pipelinerl train examples/code.yaml seed=N` for each seed, one after "
          "another with nothing else running; their records, and when each began and ended "
          "(LOG), are in benchmarks/code_runs/\n\n"
        "Held-out pass@1 (8 sampled attempts per problem, T=1) / greedy accuracy on the 25 "
        "held-out problems (all ten asserts pass), at the version evaluated and the second of "
        "the run it was made; the evaluation is deferred (after the 20 minutes, on both "
        "cores).\n\n"
        + table
        + f"\nGain in sampled pass@1, start to end: "
        + ", ".join(f"{g:+.3f}" for g in gains)
        + f" (seeds {', '.join(map(str, seeds))}).\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--report-only", action="store_true",
                        help="write the section from benchmarks/code_runs/ without running")
    parser.add_argument("--out", type=Path, help="write the section to this directory's RESULTS.md")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if not args.report_only:
        with tempfile.TemporaryDirectory(prefix="code_learning_") as out:
            for seed in seeds:
                run_seed(seed, Path(out))
    section = render(seeds)
    _results.write_section("code_learning", section, _results.results_file(args.out))
    print(section)


if __name__ == "__main__":
    main()
