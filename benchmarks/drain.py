"""Where conventional RL loses time on long generations (issue 24, part 2): engine slot
occupancy, trainer idle time, and lag and ESS by completion length, the pipeline against
conventional RL, on examples/long_chains.yaml (completions of 19-786 tokens, a long tail).

Each mode is one `pipelinerl train` of the example for --minutes of RL (one core per role,
the same warm-started model, batch and engine capacity); its config and metrics are copied into
benchmarks/drain/ as it ends, and the `drain` section of RESULTS.md and benchmarks/drain.png
are rebuilt from every record there.

    python benchmarks/drain.py                      # the four modes, 5 minutes each
    python benchmarks/drain.py --report-only        # rebuild from benchmarks/drain/
    python benchmarks/drain.py --quick --out /tmp/d # CI smoke: seconds, nothing recorded

The machine should be quiet: the roles of a run take both cores.
"""

from __future__ import annotations

import argparse
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

from pipelinerl.types import LENGTH_LABELS  # noqa: E402

ROOT = BENCH.parent
CONFIG = ROOT / "examples" / "long_chains.yaml"
RECORDS = BENCH / "drain"
PLOT = BENCH / "drain.png"
PASS1 = "eval/sampled/pass@1"
MODES = {
    "pipeline": ["mode=pipeline"],  # the example's trainer.drop_stale=false: late groups trained
    # Groups older than max_lag when their turn comes are dropped (the long ones).
    "pipeline, stale dropped": ["mode=pipeline", "trainer.drop_stale=true"],
    "conventional G=1": ["mode=conventional", "conventional_g=1"],
    "conventional G=2": ["mode=conventional", "conventional_g=2"],
}
# Held-out accuracy every minute, evaluated after the run (eval.deferred): free for the run.
EVAL = ["eval.enabled=true", "eval.deferred=true", "eval.every_s=60", "eval.num_problems=300",
        "eval.greedy=false"]
# The smoke: a barely warm-started model, a few small steps.
QUICK = ["eval.num_problems=8", "warmstart.steps=5", "trainer.batch_size=16", "actor.group_size=4",
         "engine.capacity=16", "engine.max_new_tokens=64", "engine.max_seq_len=256",
         "task.params.max_steps=6", "trainer.max_steps=4", "trainer.max_time_s=0"]


def stem(mode: str) -> str:
    return mode.replace(",", "").replace(" ", "_").replace("=", "")


def run(mode: str, minutes: float, out: Path, records: Path, quick: bool) -> None:
    name = stem(mode)
    extra = QUICK if quick else [f"trainer.max_time_s={minutes * 60:.0f}"]
    record = train([str(CONFIG), *MODES[mode], f"name={name}", f"output_dir={out}", *EVAL,
                    "metrics.progress=false", "metrics.plot=false", *extra, "--overwrite"], mode)
    keep_run(out / name, records, name, {"mode": mode, **record})


def rows_of(records: Path, mode: str) -> list[dict[str, Any]]:
    return kept_rows(records, stem(mode))


def steps_of(records: Path, mode: str) -> list[dict[str, Any]]:
    return [r for r in rows_of(records, mode) if "loss" in r]


def evals_of(records: Path, mode: str) -> list[dict[str, Any]]:
    return sorted((r for r in rows_of(records, mode) if "eval/version" in r),
                  key=lambda r: r["eval/version"])


def by_length(steps: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Over the run, per length bin: share of trained sequences, and the token-weighted mean
    of the steps' lag and ESS."""
    sums: dict[str, list[float]] = {}
    for r in steps:
        for label, b in (r.get("by_length") or {}).items():
            s = sums.setdefault(label, [0.0, 0.0, 0.0, 0.0])
            s[0] += b["sequences"]
            s[1] += b["tokens"]
            s[2] += b["lag_mean"] * b["tokens"]
            s[3] += b["ess"] * b["tokens"]
    total = sum(s[0] for s in sums.values()) or 1.0
    return {label: {"share": sums[label][0] / total, "lag_mean": sums[label][2] / sums[label][1],
                    "ess": sums[label][3] / sums[label][1]} for label in LENGTH_LABELS
            if label in sums}


def summary(steps: list[dict[str, Any]]) -> dict[str, float]:
    last = steps[-1]
    # The actor's figures come with its groups; the last step that carried them.
    actor = next(r for r in reversed(steps) if "actor_slot_occupancy" in r)
    return {"steps": last["step"], "time_s": last["time_s"],
            "samples_per_s": last["samples_trained"] / last["time_s"],
            "occupancy": actor["actor_slot_occupancy"],
            "slot_time": actor["actor_slot_time_frac"],
            "trainer_idle": last["trainer_wait_frac"],
            "stale": last.get("dropped_stale", 0),
            "len_mean": sum(r["completion_len_mean"] for r in steps) / len(steps),
            "truncated": sum(r["completion_truncated_frac"] for r in steps) / len(steps)}


def report(records: Path, modes: list[str], minutes: float, plot: Path | None) -> str:
    rows, length_rows = [], []
    stats = {m: steps_of(records, m) for m in modes}
    runs = [json.loads((records / f"{stem(m)}.run.json").read_text()) for m in modes]
    for mode, steps in stats.items():
        s = summary(steps)
        evals = evals_of(records, mode)
        rows.append([mode, f"{s['steps']}", f"{s['samples_per_s']:.1f}", f"{s['occupancy']:.0%}",
                     f"{s['slot_time']:.0%}", f"{s['trainer_idle']:.0%}", f"{s['stale']}",
                     f"{s['len_mean']:.0f}", f"{s['truncated']:.1%}",
                     f"{evals[0][PASS1]:.3f} -> {evals[-1][PASS1]:.3f}" if evals else "-"])
        for label, b in by_length(steps).items():
            length_rows.append([mode, label, f"{b['share']:.1%}", f"{b['lag_mean']:.2f}",
                                f"{b['ess']:.4f}"])
    if plot is not None:
        draw(stats, {m: evals_of(records, m) for m in modes}, plot)
    return (
        "## Long generations: where conventional RL loses time (`benchmarks/drain.py`)\n\n"
        + environment(None)  # each run's load at its start is listed below
        + f"\nWorkload: `examples/long_chains.yaml` (progressions of 1-60 worked steps, a "
        "problem of k steps drawn with weight 1/k: worked answers of 19-786 tokens), its "
        f"warm-started tiny model; {minutes:g} minutes of RL per mode, one core per role "
        "(rule (a) of docs/learning_speed.md); held-out pass@1 (temperature 1, 300 problems "
        "training never sees) of the weights every 60 s, evaluated after the run "
        "(`eval.deferred`: no cost to it; one seed, a pilot, not a learning-speed figure). "
        "Slot occupancy = busy slot-steps "
        "/ (capacity x decode steps); slot time = busy slot-seconds / (capacity x wall-clock), "
        "lowered also by time with no decode step; trainer idle = wall-clock waiting for "
        "samples; all since the start of the run. Runs: "
        + "; ".join(f"{r['mode']} {r['started']} (load at start {r['load_at_start'][0]:.2f})"
                    for r in runs) + ".\n\n"
        + table(["mode", "optimizer steps", "samples/s trained", "slot occupancy",
                 "slot time", "trainer idle", "groups dropped stale",
                 "completion tokens (mean)", "cut at max_new_tokens",
                 "held-out pass@1, start -> end"], rows)
        + "\n\nBy completion length (tokens), over the run: the share of trained sequences, and "
        "the token-weighted mean of each step's lag and ESS in the bin.\n\n"
        + table(["mode", "length", "share of trained sequences", "lag mean", "ESS"],
                length_rows)
        + (f"\n\nPlot: benchmarks/{plot.name}." if plot is not None else "")
    )


def draw(stats: dict[str, list[dict[str, Any]]], evals: dict[str, list[dict[str, Any]]],
         out: Path) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    use, lag, share, acc = axes.flat
    for mode, steps in stats.items():
        actor = [r for r in steps if "actor_slot_time_frac" in r]
        line, = use.plot([r["time_s"] for r in actor], [r["actor_slot_time_frac"] for r in actor],
                         label=f"{mode}: slots busy")
        use.plot([r["time_s"] for r in steps], [r["trainer_wait_frac"] for r in steps],
                 ls="--", color=line.get_color(), label=f"{mode}: trainer idle")
        bins = by_length(steps)
        lag.plot(list(bins), [b["lag_mean"] for b in bins.values()], marker="o", label=mode)
        share.plot(list(bins), [b["share"] for b in bins.values()], marker="o", label=mode)
        acc.plot([r["time_s"] for r in evals[mode]], [r[PASS1] for r in evals[mode]],
                 marker="o", label=mode)
    use.set(title="slot-seconds busy and trainer idle (since start)", xlabel="wall-clock (s)",
            ylim=(0, 1))
    lag.set(title="lag by completion length", xlabel="completion tokens",
            ylabel="mean lag (steps)")
    share.set(title="trained sequences by completion length", xlabel="completion tokens",
              ylabel="share")
    acc.set(title="held-out pass@1 (T = 1; one seed)", xlabel="wall-clock (s)", ylim=(0, 1))
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="smoke: seconds; records and the section go under --out")
    p.add_argument("--out", type=Path, help="the runs' directory (default: a temporary one)")
    args = p.parse_args()
    if args.quick and args.out is None:
        p.error("--quick needs --out")
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        records = out / "records" if args.quick else RECORDS
        if not args.report_only:
            for mode in args.modes:
                run(mode, args.minutes, out, records, args.quick)
    # Every mode with records: a mode run later joins the section of those run before.
    recorded = [m for m in MODES if (records / f"{stem(m)}.run.json").exists()]
    section = report(records, recorded, args.minutes, None if args.quick else PLOT)
    print(section)
    write_section("drain", section, *((out / "RESULTS.md",) if args.quick else ()))


if __name__ == "__main__":
    main()
