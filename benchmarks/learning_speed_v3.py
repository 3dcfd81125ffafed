"""Learning-speed benchmark v3: PipelineRL vs conventional RL (and TRL's GRPOTrainer) by a
measure named before the runs, for a frozen plan.

A plan is a directory, benchmarks/learning_speed_v3/ by default (issue 24: long generations,
examples/long_chains.yaml), or benchmarks/learning_speed_smollm2/ (issue 23: SmolLM2-135M):
its PLAN.md, and the numbers in plan.json beside it, fix the workload, the modes, the budget,
the evaluation and the target. One call runs one seed's modes in one sitting, in the order the
seed rotates to, each only once the machine is quiet (1-minute load below QUIET_LOAD,
recorded); each run's config, metrics and record are copied into the plan's runs/ as it ends,
and the report (the RESULTS.md section named after the plan's directory, and the plot
benchmarks/<directory>.png) is rebuilt from every run there.

Measure: per run, the isotonic (non-decreasing) least-squares fit of held-out pass@1 against
wall-clock; time to target = where that fit, linear between evaluations, first reaches the
target; a run that never does counts at the budget (censored).

    python benchmarks/learning_speed_v3.py --seed 0            # one seed: ~100 minutes, quiet
    python benchmarks/learning_speed_v3.py --report-only       # rebuild from the runs archived
    python benchmarks/learning_speed_v3.py --plan benchmarks/learning_speed_smollm2 --seed 0
    python benchmarks/learning_speed_v3.py --quick --out /tmp/v3   # CI smoke: nothing recorded
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
from scipy.optimize import isotonic_regression

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import drain  # noqa: E402
import learning_speed as ls  # noqa: E402
from _results import environment, load_average, table, this_command, write_section  # noqa: E402

ROOT = BENCH.parent
V3 = BENCH / "learning_speed_v3"  # the default plan (issue 24)
PIPELINE, TRL, PASS1 = ls.PIPELINE, ls.TRL, ls.PASS1
MODES = [PIPELINE, "conventional G=1 (a)", "conventional G=2 (a)", TRL]
PLANNED_SEEDS = 3
QUIET_LOAD = 0.3  # 1-minute load average below which a run may start
QUIET_WAIT_S = 900  # how long to wait for it before refusing
QUICK_PLAN = {"workload": "examples/long_chains.yaml", "target": 0.05, "budget_s": 20,
              "eval_every_s": 5, "eval_problems": 8, "modes": [PIPELINE, "conventional G=1 (a)"]}
# The smoke: a barely warm-started model on short chains, a few small steps.
QUICK = ["warmstart.steps=5", "trainer.batch_size=16", "actor.group_size=4",
         "engine.capacity=16", "engine.max_new_tokens=64", "engine.max_seq_len=256",
         "task.params.max_steps=6"]


@dataclass(frozen=True)
class PlanDir:
    """Where a plan's files live: its runs' records (committed as each run ends), the
    committed starting weights if it has them, its plot and its RESULTS.md section."""

    path: Path

    @property
    def archive(self) -> Path:
        return self.path / "runs"

    @property
    def starting_model(self) -> Path:
        # A warm-started policy, committed: a run in a later session, on another machine,
        # starts from the same weights without rebuilding them.
        return self.path / "starting_model"

    @property
    def plot(self) -> Path:
        return self.path.parent / f"{self.path.name}.png"

    @property
    def section(self) -> str:
        return self.path.name


# Titles of the default plan (issue 24), for a plan.json that names none.
DEFAULT_TITLE = "Learning speed v3: long generations, PipelineRL vs conventional RL and TRL"
DEFAULT_LABEL = "long generations"


def plan_label(plan: dict[str, Any]) -> str:
    """The workload's name in the headlines and the plot."""
    return plan.get("label", DEFAULT_LABEL)


def shown(path: Path) -> Path:
    """A path as the report names it: relative to the checkout when inside it."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


# -- the measure ------------------------------------------------------------------------------


def fitted(run: ls.Run) -> tuple[np.ndarray, np.ndarray]:
    """Evaluation times and the isotonic fit of held-out pass@1 at them."""
    t, y = ls.eval_curve(run)
    return t, isotonic_regression(y).x


def time_to_target(run: ls.Run, target: float) -> float | None:
    """First time the fit, linear between evaluations, reaches `target`; None if it never does."""
    t, fit = fitted(run)
    return ls.first_crossing(t, fit, target)


def samples_at_evals(run: ls.Run) -> np.ndarray:
    """The samples trained into each evaluated snapshot (by its optimizer step)."""
    trained = {r["step"]: r["samples_trained"] for r in run.steps if "samples_trained" in r}
    return np.array([trained[r["step"]] if r["step"] else 0 for r in run.evals], dtype=float)


def samples_to_target(run: ls.Run, target: float) -> float | None:
    """The same crossing against samples trained instead of wall-clock: how many samples the
    mode needs, whatever its rate."""
    return ls.first_crossing(samples_at_evals(run), fitted(run)[1], target)


def mean_gain(run: ls.Run, budget_s: float) -> float:
    """Area under the held-out curve above its start (version 0), over [0, budget] and divided
    by it: the mean gain in pass@1 over the run; the last evaluation holds to the budget."""
    t, y = ls.eval_curve(run)
    t, y = np.append(t, max(budget_s, t[-1])), np.append(y, y[-1]) - y[0]
    grid = np.linspace(0.0, budget_s, 1001)
    return float(np.trapezoid(np.interp(grid, t, y), grid) / budget_s)


@dataclass
class Speedup:
    against: str
    ratio: float  # mean time to target of `against` / the pipeline's (censored at the budget)
    paired: tuple[float, float, float]  # geometric mean of per-seed ratios, its 95% interval
    censored: int  # seeds in which `against` missed the target (then the ratio is a lower bound)


def speedup(times: dict[str, dict[int, float | None]], against: list[str],
            budget_s: float) -> Speedup | str:
    """The pipeline's speed-up over the mode of `against` with the lower mean time to target
    (a miss counts at the budget), or why there is none."""
    pipe = times[PIPELINE]
    if any(t is None for t in pipe.values()):
        reached = sum(t is not None for t in pipe.values())
        return f"the pipeline reached the target in {reached}/{len(pipe)} seeds"
    ran = [m for m in against if times.get(m)]
    if not ran:
        return "not run"
    censored = {m: {s: budget_s if t is None else t for s, t in times[m].items()} for m in ran}
    best = min(ran, key=lambda m: statistics.fmean(censored[m].values()))
    if not statistics.fmean(pipe.values()) or not statistics.fmean(censored[best].values()):
        return "the starting model already meets the target"
    return Speedup(best, statistics.fmean(censored[best].values()) / statistics.fmean(pipe.values()),
                   ls.paired_ratio(censored[best], pipe),
                   sum(t is None for t in times[best].values()))


def decomposition(runs: dict[str, dict[int, ls.Run]], samples: dict[str, dict[int, float | None]],
                  against: str) -> str:
    """The time ratio as (sample-rate ratio) x (samples-to-target ratio), over the seeds in
    which both modes reached the target: whether the pipeline wins by training faster or loses
    by learning less per sample (lag, batch composition)."""
    seeds = [s for s, n in samples[PIPELINE].items()
             if n is not None and samples[against].get(s) is not None]
    if not seeds:
        return f"- where it comes from: not measured ({against} and the pipeline reached the " \
               "target in no common seed)"
    rate = statistics.fmean(runs[PIPELINE][s].samples_per_s() for s in seeds) / \
        statistics.fmean(runs[against][s].samples_per_s() for s in seeds)
    pipe_n = statistics.fmean(samples[PIPELINE][s] for s in seeds)
    other_n = statistics.fmean(samples[against][s] for s in seeds)
    return (f"- where it comes from ({len(seeds)} seed(s) in which both reached the target): "
            f"the pipeline trained {rate:.2f}x the samples per second and needed "
            f"{pipe_n / other_n:.2f}x the samples ({pipe_n:.0f} against {other_n:.0f}); time "
            f"ratio about {rate:.2f} x {other_n / pipe_n:.2f} = {rate * other_n / pipe_n:.2f}x")


# -- runs -------------------------------------------------------------------------------------


def load_plan(plan_dir: PlanDir, quick: bool) -> dict[str, Any]:
    if quick:
        return QUICK_PLAN
    path = plan_dir.path / "plan.json"
    if not path.exists():
        raise SystemExit(f"{path} not found: the plan is frozen (PLAN.md and plan.json) before "
                         "the first run")
    return json.loads(path.read_text())


def check_starting_model(plan: dict[str, Any], plan_dir: PlanDir) -> None:
    """Refuse to run from weights other than the plan's (a plan that names none starts from
    the workload's own model)."""
    if "starting_model_sha256" not in plan:
        return
    weights = plan_dir.starting_model / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    if digest != plan["starting_model_sha256"]:
        raise SystemExit(f"{weights} has sha256 {digest}, the plan's runs start from "
                         f"{plan['starting_model_sha256']}")


def overrides(plan: dict[str, Any], plan_dir: PlanDir, quick: bool) -> list[str]:
    if quick:
        base = QUICK
    else:
        base = [f"model.path={plan_dir.starting_model}"] if "starting_model_sha256" in plan else []
        base += [f"trainer.lr={plan['lr']}"] if "lr" in plan else []
    return [*base, f"trainer.max_time_s={plan['budget_s']}", "trainer.max_steps=1000000",
            "eval.enabled=true", "eval.deferred=true", "eval.greedy=false",
            f"eval.every_s={plan['eval_every_s']}", f"eval.num_problems={plan['eval_problems']}",
            "metrics.progress=false", "metrics.plot=false"]


def rotated(modes: list[str], seed: int) -> list[str]:
    """Seed s starts with mode s mod len(modes): each mode runs first, second, ... in turn."""
    k = seed % len(modes)
    return modes[k:] + modes[:k]


def wait_quiet(limit_s: float) -> float:
    """Wait until the 1-minute load average is below QUIET_LOAD; return it."""
    deadline = time.monotonic() + limit_s
    while (load := os.getloadavg()[0]) >= QUIET_LOAD:
        if time.monotonic() > deadline:
            raise SystemExit(f"the machine is not quiet: 1-minute load {load:.2f} >= {QUIET_LOAD} "
                             f"after {limit_s:.0f} s; the plan runs only on a quiet machine: stop "
                             "what else runs, then start this seed again (its finished runs are kept)")
        time.sleep(10)
    return load


def portable(config: str, out: Path) -> str:
    """A run's config without this machine's paths: the checkout's become relative to it, the
    runs' directory OUT."""
    return config.replace(f"{ROOT}/", "").replace(str(out), "OUT")


def archive_run(run_dir: Path, archive: Path, record: dict[str, Any]) -> None:
    """Copy a finished run's config, metrics (gzipped) and record into the archive."""
    archive.mkdir(parents=True, exist_ok=True)
    name = run_dir.name
    (archive / f"{name}.config.yaml").write_text(portable((run_dir / "config.yaml").read_text(),
                                                          run_dir.parent))
    with (run_dir / "metrics.jsonl").open("rb") as src, \
            gzip.open(archive / f"{name}.metrics.jsonl.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    (archive / f"{name}.run.json").write_text(json.dumps(record, indent=1) + "\n")


def run_seed(seed: int, plan: dict[str, Any], plan_dir: PlanDir, out: Path, archive: Path,
             quick: bool) -> None:
    for position, label in enumerate(rotated(plan["modes"], seed)):
        name = ls.run_name(label, seed)
        if (archive / f"{name}.run.json").exists():
            print(f"[v3] {label} seed {seed}: archived earlier, kept", flush=True)
            continue
        load = os.getloadavg()[0] if quick else wait_quiet(QUIET_WAIT_S)
        t0 = time.monotonic()
        done = ls.run(label, seed, out, overrides(plan, plan_dir, quick),
                      config=ROOT / plan["workload"])
        record = {**done.record, "position": position, "load_1min_at_start": round(load, 2),
                  "wall_s": round(time.monotonic() - t0)}
        archive_run(out / name, archive, record)
        print(f"[v3] {label} seed {seed}: archived in {archive}", flush=True)


def load_archive(archive: Path, modes: list[str]) -> dict[str, dict[int, ls.Run]]:
    """Every archived run, by mode and seed."""
    runs: dict[str, dict[int, ls.Run]] = {m: {} for m in modes}
    for path in sorted(archive.glob("*.run.json")):
        record = json.loads(path.read_text())
        stem = path.name.removesuffix(".run.json")
        with gzip.open(archive / f"{stem}.metrics.jsonl.gz", "rt") as f:
            rows = [json.loads(line) for line in f]
        runs.setdefault(record["label"], {})[record["seed"]] = ls.Run.from_rows(rows, record, stem)
    return {m: by_seed for m, by_seed in runs.items() if by_seed}


# -- report -----------------------------------------------------------------------------------


def headline(versus: str, result: Speedup | str, times: dict[str, dict[int, float | None]],
             seeds: int, runs: dict[str, dict[int, ls.Run]],
             samples: dict[str, dict[int, float | None]]) -> list[str]:
    head = f"Learning speed-up (pipeline vs {versus}): "
    if isinstance(result, str):
        return [head + f"not measured ({result})", ""]
    provisional = f" (provisional: {seeds} of {PLANNED_SEEDS} planned seeds)" \
        if seeds < PLANNED_SEEDS else ""
    bound = " (a lower bound)" if result.censored else ""
    pipe = statistics.fmean(times[PIPELINE].values())
    geo, lo, hi = result.paired
    interval = "no interval with one seed" if math.isnan(lo) else \
        f"95% interval {lo:.1f}x-{hi:.1f}x (t interval on the seeds' log ratios)"
    missed = f"; {result.against} missed the target in {result.censored} seed(s), counted at " \
             "the budget" if result.censored else ""
    return [head + f"{result.ratio:.1f}x" + bound + provisional,
            f"- {result.against}: {result.ratio * pipe:.0f} s to the target vs the pipeline's "
            f"{pipe:.0f} s (means over seeds); paired by seed: {geo:.1f}x, {interval}{missed}",
            decomposition(runs, samples, result.against), ""]


def last_with(run: ls.Run, key: str) -> float | None:
    return next((r[key] for r in reversed(run.steps) if r.get(key) is not None), None)


def reached_cell(values: dict[int, float | None], spec: str) -> str:
    """Mean and interval over the seeds, or how many reached the target and their values."""
    reached = [v for v in values.values() if v is not None]
    if len(reached) == len(values):
        return ls.fmt_interval(reached, spec)
    return f"{len(reached)}/{len(values)} reached" + \
        (f": {ls.fmt_interval(reached, spec)}" if reached else "")


def mode_rows(runs: dict[str, dict[int, ls.Run]], times: dict[str, dict[int, float | None]],
              samples: dict[str, dict[int, float | None]], plan: dict[str, Any]) -> list[list[str]]:
    def cell(label: str, fn: Any, spec: str) -> str:
        return ls.fmt_interval([v for r in runs[label].values() if (v := fn(r)) is not None], spec)

    rows = []
    for label in runs:
        rows.append([label, str(len(times[label])), reached_cell(times[label], ".0f"),
                     reached_cell(samples[label], ".0f"),
                     cell(label, lambda r: mean_gain(r, plan["budget_s"]), "+.3f"),
                     cell(label, lambda r: r.evals[0][PASS1], ".3f"),
                     cell(label, lambda r: fitted(r)[1][-1], ".3f"),
                     cell(label, ls.Run.samples_per_s, ".1f"),
                     cell(label, lambda r: last_with(r, "actor_slot_occupancy"), ".2f"),
                     cell(label, lambda r: last_with(r, "trainer_wait_frac"), ".2f"),
                     cell(label, lambda r: r.step_mean("lag_mean"), ".2f"),
                     cell(label, lambda r: r.step_mean("ess"), ".3f")])
    return rows


def seed_rows(runs: dict[str, dict[int, ls.Run]], times: dict[str, dict[int, float | None]],
              seeds: list[int]) -> list[list[str]]:
    def cell(label: str, seed: int) -> str:
        if seed not in runs[label]:
            return "-"
        record, t = runs[label][seed].record, times[label][seed]
        return (f"{'missed' if t is None else f'{t:.0f}'} (#{record.get('position', 0) + 1}, "
                f"load {record.get('load_1min_at_start', math.nan):.2f})")

    return [[label, *(cell(label, s) for s in seeds)] for label in runs]


def length_rows(runs: dict[str, dict[int, ls.Run]]) -> list[list[str]]:
    """Per mode and completion-length bin, over every seed's optimizer steps: the share of the
    trained sequences, their lag and ESS (token-weighted; TRL does not record them)."""
    rows = []
    for label, by_seed in runs.items():
        stats = drain.by_length([step for r in by_seed.values() for step in r.steps])
        rows += [[label, length, f"{b['share']:.2f}", f"{b['lag_mean']:.2f}", f"{b['ess']:.3f}"]
                 for length, b in stats.items()]
    return rows


def report(runs: dict[str, dict[int, ls.Run]], plan: dict[str, Any], archive: Path,
           load: tuple[float, float, float] | None) -> str:
    target, budget_s = plan["target"], plan["budget_s"]
    times = {m: {s: time_to_target(r, target) for s, r in by_seed.items()}
             for m, by_seed in runs.items()}
    samples = {m: {s: samples_to_target(r, target) for s, r in by_seed.items()}
               for m, by_seed in runs.items()}
    seeds = sorted({s for by_seed in runs.values() for s in by_seed})
    records = [r.record for by_seed in runs.values() for r in by_seed.values()]
    conventional = [m for m in runs if m.startswith("conventional")]
    label = plan_label(plan)
    trl = headline(f"TRL GRPOTrainer, {label}", speedup(times, [TRL], budget_s), times,
                   len(seeds), runs, samples) if TRL in plan["modes"] else []
    trl_clock = "TRL's clock stops while it evaluates. " if TRL in plan["modes"] else ""
    return "\n".join([
        f"## {plan.get('title', DEFAULT_TITLE)}",
        "",
        environment(load, this_command()).rstrip("\n"),
        f"- plan: {shown(archive.parent / 'PLAN.md')} (frozen {plan.get('frozen', '-')}); "
        f"workload `{plan['workload']}`; {budget_s:.0f} s of RL wall-clock per run; "
        f"held-out pass@1 at T=1 on {plan['eval_problems']} problems every "
        f"{plan['eval_every_s']:.0f} s (deferred: evaluated after the run); target "
        f"{target:.3f}",
        f"- runs: {len(records)} in {shown(archive)}, "
        f"made {min(r['started'] for r in records)} to {max(r['finished'] for r in records)}, "
        f"code at {', '.join(sorted({r.get('commit', '?') for r in records}))}; each seed's "
        "modes in one sitting, order rotated by seed, each started with the 1-minute load "
        f"below {QUIET_LOAD}",
        "- time to target: first crossing of the isotonic fit of held-out pass@1 against "
        "wall-clock (linear between evaluations); a miss counts at the budget. Mean gain: the "
        "area under the held-out curve above its start over the budget, divided by it. "
        f"{trl_clock}Samples to target: the same crossing against the samples trained into "
        "each evaluated snapshot",
        "",
        *headline(f"best conventional, {label}, rule (a)",
                  speedup(times, conventional, budget_s), times, len(seeds), runs, samples),
        *trl,
        table(["mode", "seeds", "time to target (s) [95% CI]", "samples to target",
               "mean gain [95% CI]", "start pass@1", "end of fit", "samples/s",
               "slot occupancy", "trainer idle", "lag mean", "ESS"],
              mode_rows(runs, times, samples, plan)),
        "Per seed: time to target (s), the run's place in its seed's order, the load at its start",
        "",
        table(["mode", *(f"seed {s}" for s in seeds)], seed_rows(runs, times, seeds)),
        "By completion length (tokens), every seed's optimizer steps:",
        "",
        table(["mode", "length", "share of trained sequences", "lag mean", "ESS"],
              length_rows(runs)),
    ])


def plot(runs: dict[str, dict[int, ls.Run]], target: float, path: Path, label: str) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (mode, by_seed) in enumerate(runs.items()):
        colour = plt.get_cmap("tab10")(i)
        for j, run in enumerate(by_seed.values()):
            t, y = ls.eval_curve(run)
            ax.plot(t / 60, y, ".", color=colour, alpha=0.35, ms=4)
            ax.plot(t / 60, fitted(run)[1], "-", color=colour, lw=1.3, label=mode if j == 0 else None)
    ax.axhline(target, color="grey", ls=":", lw=1, label=f"target {target:.2f}")
    ax.set_xlabel("wall-clock (min; TRL: training clock)" if TRL in runs else "wall-clock (min)")
    ax.set_ylabel("held-out pass@1 (T = 1)")
    ax.set_title(f"{label[0].upper()}{label[1:]}: held-out pass@1 (dots) and its isotonic fit, "
                 "every seed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", type=Path, default=V3,
                   help="the plan's directory (PLAN.md, plan.json, runs/)")
    p.add_argument("--seed", type=int, help="run this seed's modes (one sitting)")
    p.add_argument("--out", type=Path,
                   help="where the runs are made (outside the archive; a finished run found "
                        "there is kept, not made again); default runs/<the plan's directory>")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the report and plot from the archived runs")
    p.add_argument("--quick", action="store_true", help="tiny smoke run into --out, not recorded")
    args = p.parse_args()
    if args.quick and args.seed is None:
        args.seed = 0
    if args.seed is None and not args.report_only:
        p.error("give --seed S to run a seed, or --report-only")
    return args


def main() -> None:
    args = parse_args()
    plan_dir = PlanDir(args.plan.resolve())
    if args.out is None:
        args.out = ROOT / "runs" / plan_dir.section
    plan = load_plan(plan_dir, args.quick)
    archive = args.out / "runs" if args.quick else plan_dir.archive
    load = None if args.report_only else load_average()
    if not args.report_only:
        if not args.quick:
            check_starting_model(plan, plan_dir)
        run_seed(args.seed, plan, plan_dir, args.out, archive, args.quick)
    runs = load_archive(archive, plan["modes"])
    if PIPELINE not in runs:
        raise SystemExit(f"no pipeline run in {archive}: it is the reference")
    text = report(runs, plan, archive, load)
    print(text)
    label = plan_label(plan)
    if args.quick:  # a smoke's figures stay in --out
        plot(runs, plan["target"], args.out / f"{plan_dir.section}.png", label)
        write_section(plan_dir.section, text, args.out / "RESULTS.md")
    else:
        plot(runs, plan["target"], plan_dir.plot, label)
        write_section(plan_dir.section, text)


if __name__ == "__main__":
    main()
