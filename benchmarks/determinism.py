"""What deterministic mode costs, and the lag ablation it makes possible (issue 44, parts 3-4).

The demo (`examples/arithmetic.yaml`, its warm-started tiny model, one seed) runs for a fixed
number of optimizer steps with held-out pass@1 every `--eval-every` steps:

- free-running, twice: its samples/s, and the spread between two runs of one seed;
- deterministic at several `deterministic.lag_groups` (how far the actor generates ahead of
  the newest weights), twice each: the same, and the check that the two runs are identical
  (final weights hash, every metric but the wall-clock ones), so their spread is zero;
- conventional RL (lag 0: generate a batch, train on it) in deterministic mode, twice;
- two actors, free-running and deterministic, twice each.

Each run's config, metrics and weights hash are kept in benchmarks/determinism/ as it ends;
the `determinism` section of RESULTS.md and benchmarks/determinism.png are rebuilt from every
record there.

    python benchmarks/determinism.py                       # every mode, twice
    python benchmarks/determinism.py --report-only         # rebuild from the records
    python benchmarks/determinism.py --quick --out /tmp/d  # CI smoke: seconds, nothing kept

The machine should be quiet: the roles of a run take both cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from _results import environment, keep_run, kept_rows, table, train, write_section  # noqa: E402

from pipelinerl.run.replay import WALL_CLOCK_FIELDS  # noqa: E402

ROOT = BENCH.parent
CONFIG = ROOT / "examples" / "arithmetic.yaml"
RECORDS = BENCH / "determinism"
PLOT = BENCH / "determinism.png"
PASS1 = "eval/sampled/pass@1"
REPEATS = ("a", "b")
DETERMINISTIC = ["deterministic.enabled=true", "actor.max_restarts=0"]
# The demo: batch 64, groups of 8 (K = 8 groups a step), max_lag 4: lag_groups up to K - 1 = 7.
MODES = {
    "free-running": [],
    "deterministic, lag_groups=0": [*DETERMINISTIC, "deterministic.lag_groups=0"],
    "deterministic, lag_groups=3": [*DETERMINISTIC, "deterministic.lag_groups=3"],
    "deterministic, lag_groups=7": [*DETERMINISTIC, "deterministic.lag_groups=7"],
    "conventional (lag 0), deterministic": [*DETERMINISTIC, "mode=conventional",
                                            "conventional_g=1", "deterministic.lag_groups=0"],
    # Two actors (each its share of the cores): lag_groups up to K - A = 6.
    "free-running, 2 actors": ["actor.num_actors=2"],
    "deterministic, 2 actors, lag_groups=6": [*DETERMINISTIC, "actor.num_actors=2",
                                              "deterministic.lag_groups=6"],
}
QUICK = ["warmstart.steps=20", "trainer.batch_size=16", "actor.group_size=4",
         "engine.capacity=16", "eval.num_problems=8", "actor.max_lag=2"]
QUICK_LAGS = {"deterministic.lag_groups=3": "deterministic.lag_groups=2",
              "deterministic.lag_groups=7": "deterministic.lag_groups=3",
              "deterministic.lag_groups=6": "deterministic.lag_groups=2"}


def stem(mode: str, repeat: str) -> str:
    name = "".join(c if c.isalnum() else "_" for c in mode).strip("_")
    return f"{name}__{repeat}"


def mode_args(mode: str, quick: bool) -> list[str]:
    """The mode's overrides; the quick smoke's smaller batch (K = 4) takes smaller lags."""
    return [QUICK_LAGS.get(a, a) if quick else a for a in MODES[mode]]


def run(mode: str, repeat: str, steps: int, eval_every: int, out: Path, records: Path,
        quick: bool) -> None:
    name = stem(mode, repeat)
    record = train([str(CONFIG), *mode_args(mode, quick), f"name={name}", f"output_dir={out}",
                    "trainer.max_time_s=0", f"trainer.max_steps={steps}", "eval.enabled=true",
                    "eval.every_s=0", f"eval.every_steps={eval_every}", "eval.greedy=false",
                    "metrics.progress=false", "metrics.plot=false", *(QUICK if quick else []),
                    "--overwrite"], f"{mode} ({repeat})")
    record["weights_sha256"] = final_weights_hash(out / name / "final")
    keep_run(out / name, records, name, {"mode": mode, "repeat": repeat, **record})


def final_weights_hash(final: Path) -> str:
    """SHA-256 over the saved final weights' files (safetensors: the same tensors, the same
    bytes), for every mode alike; deterministic runs also write the trainer's weights.sha256."""
    digest = hashlib.sha256()
    for path in sorted(final.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def rows_of(records: Path, mode: str, repeat: str) -> list[dict[str, Any]]:
    return kept_rows(records, stem(mode, repeat))


def without_wall_clock(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK_FIELDS} for r in rows]


def identical(records: Path, mode: str) -> bool | None:
    """Whether the mode's two runs match: weights hash and every metric but wall-clock ones
    (None: fewer than two runs recorded)."""
    runs = [records / f"{stem(mode, r)}.run.json" for r in REPEATS]
    if not all(p.exists() for p in runs):
        return None
    hashes = [json.loads(p.read_text())["weights_sha256"] for p in runs]
    metrics = [without_wall_clock(rows_of(records, mode, r)) for r in REPEATS]
    return hashes[0] == hashes[1] and metrics[0] == metrics[1]


def evals_by_step(rows: list[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """(version, pass@1, the wall-clock second the trainer made that version)."""
    made = {r["step"]: r["time_s"] for r in rows if "loss" in r}
    made[0] = 0.0
    return sorted((r["eval/version"], r[PASS1], made.get(r["eval/version"], float("nan")))
                  for r in rows if "eval/version" in r and PASS1 in r)


def summary(rows: list[dict[str, Any]], target: float) -> dict[str, Any]:
    steps = [r for r in rows if "loss" in r]
    last = steps[-1]
    evals = evals_by_step(rows)
    reached = next((t for _, acc, t in evals if acc >= target), None)
    return {"steps": last["step"], "time_s": last["time_s"],
            "samples_per_s": last["samples_trained"] / last["time_s"],
            "lag_mean": sum(r["lag_mean"] for r in steps) / len(steps),
            "stale": last.get("dropped_stale", 0),
            "start": evals[0][1] if evals else None, "end": evals[-1][1] if evals else None,
            "to_target_s": reached}


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def report(records: Path, modes: list[str], target: float, plot: Path | None) -> str:
    rows = []
    curves: dict[str, list[list[tuple[int, float, float]]]] = {}
    for mode in modes:
        same = identical(records, mode)
        for repeat in REPEATS:
            if not (records / f"{stem(mode, repeat)}.run.json").exists():
                continue
            metrics = rows_of(records, mode, repeat)
            s = summary(metrics, target)
            curves.setdefault(mode, []).append(evals_by_step(metrics))
            rows.append([mode, repeat, {True: "yes", False: "no", None: "-"}[same],
                         f"{s['steps']}", f"{s['samples_per_s']:.1f}", f"{s['lag_mean']:.2f}",
                         f"{s['stale']}", f"{_fmt(s['start'], '.3f')} -> {_fmt(s['end'], '.3f')}",
                         _fmt(s["to_target_s"], ".0f")])
    runs = [json.loads(p.read_text()) for p in sorted(records.glob("*.run.json"))]
    if plot is not None:
        draw(curves, plot)
    return (
        "## Deterministic mode: its cost, and lag alone (`benchmarks/determinism.py`)\n\n"
        + environment(None)
        + f"\nWorkload: the demo (`examples/arithmetic.yaml`, warm-started tiny model, seed 0), "
        "a fixed number of optimizer steps, held-out pass@1 (temperature 1) of every "
        "`--eval-every`-th version; each mode run twice. `identical`: the two runs' final "
        "weights hash and every metric but the wall-clock ones are equal (the spread between "
        f"them is zero); time to target: wall-clock second at which the trainer made the first "
        f"version whose held-out pass@1 reached {target}. Runs: "
        + "; ".join(f"{r['mode']} ({r['repeat']}) {r['started']}, load at start "
                    f"{r['load_at_start'][0]:.2f}" for r in runs) + ".\n\n"
        + table(["mode", "run", "identical", "optimizer steps", "samples/s trained",
                 "lag mean (steps)", "groups dropped stale", "held-out pass@1, start -> end",
                 f"time to pass@1 {target} (s)"], rows)
        + (f"\n\nPlot: benchmarks/{plot.name} (held-out pass@1 by version, both runs of each "
           "mode)." if plot is not None else "")
    )


def draw(curves: dict[str, list[list[tuple[int, float, float]]]], out: Path) -> None:
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, runs in curves.items():
        color = None
        for i, evals in enumerate(runs):
            style = {"ls": "-" if i == 0 else "--", "marker": "o", "ms": 3}
            line, = by_step.plot([v for v, _, _ in evals], [a for _, a, _ in evals],
                                 color=color, label=mode if i == 0 else None, **style)
            color = line.get_color()
            by_time.plot([t for _, _, t in evals], [a for _, a, _ in evals], color=color,
                         **style)
    by_step.set(title="held-out pass@1 by version (dashed: the second run)",
                xlabel="optimizer step", ylim=(0, 1))
    by_time.set(title="held-out pass@1 by wall-clock", xlabel="seconds of RL", ylim=(0, 1))
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=500, help="optimizer steps per run")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--target", type=float, default=0.55,
                   help="held-out pass@1 to time (the demo's, docs/learning_speed.md)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="smoke: seconds; records and the section go under --out")
    p.add_argument("--out", type=Path, help="the runs' directory (default: a temporary one)")
    args = p.parse_args()
    if args.quick and args.out is None:
        p.error("--quick needs --out")
    steps, eval_every = (4, 2) if args.quick else (args.steps, args.eval_every)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        records = out / "records" if args.quick else RECORDS
        if not args.report_only:
            for mode in args.modes:
                for repeat in REPEATS:
                    run(mode, repeat, steps, eval_every, out, records, args.quick)
    recorded = [m for m in MODES if (records / f"{stem(m, 'a')}.run.json").exists()]
    section = report(records, recorded, args.target, None if args.quick else PLOT)
    print(section)
    write_section("determinism", section, *((out / "RESULTS.md",) if args.quick else ()))


if __name__ == "__main__":
    main()
