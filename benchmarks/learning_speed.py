"""PipelineRL vs conventional RL (G = 1, 2, 4, 8) on the CPU demo, side by side.

Every mode runs the same task, starting model (the cached warm-start), loss, batch size B,
engine capacity and processes (one actor and one trainer, one torch thread each); only the
schedule differs. Each run gets the same wall-clock budget. Writes the `learning_speed` section
of RESULTS.md and benchmarks/learning_speed.png.

    python benchmarks/learning_speed.py                 # full: every mode, --seeds seeds
    python benchmarks/learning_speed.py --quick --out /tmp/ls   # CI smoke: tiny, not recorded
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from statistics import mean

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import environment, load_average, table, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "arithmetic.yaml"
MODES: dict[str, list[str]] = {
    "pipeline": ["mode=pipeline"],
    "conventional G=1": ["mode=conventional", "conventional_g=1"],
    "conventional G=2": ["mode=conventional", "conventional_g=2"],
    "conventional G=4": ["mode=conventional", "conventional_g=4"],
    "conventional G=8": ["mode=conventional", "conventional_g=8"],
}


def _name(label: str, seed: int) -> str:
    return label.replace(" ", "_").replace("=", "") + f"_s{seed}"


def _read(run_dir: Path) -> list[dict]:
    with (run_dir / "metrics.jsonl").open() as f:
        return [json.loads(line) for line in f]


def run(label: str, seed: int, budget_s: float, out: Path, extra: list[str]) -> list[dict]:
    name = _name(label, seed)
    cmd = [sys.executable, "-m", "pipelinerl.cli", "train", str(CONFIG), *MODES[label],
           f"name={name}", f"output_dir={out}", f"seed={seed}", f"trainer.seed={seed}",
           f"trainer.max_time_s={budget_s}", "trainer.max_steps=1000000",
           "metrics.progress=false", "metrics.plot=false", *extra, "--overwrite"]
    print(f"[learning_speed] {label} seed {seed}: {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return _read(out / name)


WINDOW = 16  # optimizer steps (16 x B = 1024 samples in the default config)


def smoothed(records: list[dict]) -> list[tuple[float, float]]:
    """(wall-clock, mean batch success over the last WINDOW steps), once WINDOW steps exist:
    a single lucky batch cannot reach the target."""
    succ = [r["success"] for r in records]
    return [(records[i]["time_s"], sum(succ[i + 1 - WINDOW:i + 1]) / WINDOW)
            for i in range(WINDOW - 1, len(records))]


def time_to(records: list[dict], target: float) -> float | None:
    return next((t for t, s in smoothed(records) if s >= target), None)


def summarize(runs: list[list[dict]], target: float) -> dict[str, float | int | None]:
    times = [time_to(r, target) for r in runs]
    reached = [t for t in times if t is not None]
    tail = [r[-max(1, len(r) // 10):] for r in runs]  # last 10% of steps
    return {
        "reached": len(reached),
        "time_to_target": mean(reached) if len(reached) == len(runs) else None,
        "success_end": mean(mean(x["success"] for x in t) for t in tail),
        "samples_per_s": mean(r[-1]["samples_trained"] / r[-1]["time_s"] for r in runs),
        "ess": mean(mean(x["ess"] for x in r if "ess" in x) for r in runs),
        "lag_mean": mean(mean(x["lag_mean"] for x in r if "lag_mean" in x) for r in runs),
        "lag_max": max(max(x["lag_max"] for x in r if "lag_max" in x) for r in runs),
        "trainer_wait": mean(r[-1]["trainer_wait_frac"] for r in runs),
        "actor_idle": mean(r[-1].get("actor_idle_frac", 0.0) for r in runs),
        "steps": mean(r[-1]["step"] for r in runs),
    }


def plot(results: dict[str, list[list[dict]]], target: float, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, (label, runs) in enumerate(results.items()):
        for j, records in enumerate(runs):
            curve = smoothed(records)
            ax.plot([t for t, _ in curve], [v for _, v in curve],
                    color=f"C{i}", alpha=0.9 if j == 0 else 0.5, label=label if j == 0 else None)
    ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {target:.2f}")
    ax.set_xlabel("wall-clock (s)")
    ax.set_ylabel(f"success rate (mean of the last {WINDOW} batches)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("PipelineRL vs conventional RL, chain arithmetic, 2-core CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def report(results: dict[str, list[list[dict]]], target: float, budget_s: float,
           seeds: int, load: tuple[float, float, float]) -> str:
    summaries = {label: summarize(runs, target) for label, runs in results.items()}
    rows = []
    for label, s in summaries.items():
        ttt = fmt(s["time_to_target"], ".0f") if s["time_to_target"] is not None else (
            f"> {budget_s:.0f} ({s['reached']}/{seeds} reached)")
        rows.append([label, ttt, fmt(s["success_end"]), fmt(s["samples_per_s"], ".1f"),
                     fmt(s["steps"], ".0f"), fmt(s["ess"], ".3f"), fmt(s["lag_mean"]),
                     fmt(s["lag_max"], ".0f"), fmt(s["trainer_wait"]), fmt(s["actor_idle"])])
    pipe = summaries["pipeline"]["time_to_target"]
    conv = {k: v["time_to_target"] for k, v in summaries.items() if k != "pipeline"}
    # A conventional mode that never reached the target is counted at the budget: its
    # speed-up figure is then a lower bound.
    conv_times = {k: (v if v is not None else budget_s) for k, v in conv.items()}
    best = min(conv_times, key=conv_times.get)
    lower_bound = conv[best] is None
    headline = "pipeline did not reach the target" if pipe is None else (
        f"Learning speed-up (pipeline vs best conventional): {conv_times[best] / pipe:.1f}x")
    lines = [
        "## Learning speed: PipelineRL vs conventional RL",
        "",
        environment(load),
        f"- target success rate: {target:.2f} (mean batch success over the last {WINDOW} optimizer "
        f"steps, i.e. {WINDOW} x B samples); budget "
        f"{budget_s:.0f} s of wall-clock per run; {seeds} seed(s) per mode; plot: "
        "benchmarks/learning_speed.png",
        "- same task, warm-started model, loss, B, engine capacity and processes (actor + "
        "trainer, 1 torch thread each) in every mode; only the schedule differs",
        "",
        headline + (f" (best conventional: {best}" + (", which did not reach the target: a "
                    "lower bound)" if lower_bound else ")") if pipe is not None else ""),
        "",
        table(["mode", "time to target (s)", "success, last 10% of steps", "samples/s",
               "optimizer steps", "mean ESS", "lag mean", "lag max", "trainer wait frac",
               "actor idle frac"], rows),
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke run, not recorded")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "learning_speed")
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--target", type=float, default=0.6)
    p.add_argument("--modes", nargs="*", default=list(MODES))
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the table and plot from the runs already in --out")
    p.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = p.parse_args()
    extra = list(args.overrides)
    if args.quick:
        args.budget_s, args.seeds, args.modes = 15.0, 1, ["pipeline", "conventional G=2"]
        extra += [f"warmstart.cache_dir={args.out / 'cache'}", "warmstart.steps=10",
                  "engine.capacity=16", "actor.group_size=4", "trainer.batch_size=16"]
    load = load_average()
    if args.report_only:
        results = {m: [_read(args.out / _name(m, seed)) for seed in range(args.seeds)]
                   for m in args.modes}
    else:
        results = {m: [run(m, seed, args.budget_s, args.out, extra) for seed in range(args.seeds)]
                   for m in args.modes}
    if "pipeline" not in results:
        raise SystemExit("the pipeline mode is the reference: keep it in --modes")
    text = report(results, args.target, args.budget_s, args.seeds, load)
    print(text)
    if args.quick:
        plot(results, args.target, args.out / "learning_speed.png")
        return
    plot(results, args.target, Path(__file__).resolve().parent / "learning_speed.png")
    write_section("learning_speed", text)


if __name__ == "__main__":
    main()
