"""PipelineRL vs conventional RL (and TRL's GRPOTrainer) on the CPU demo: held-out accuracy
against wall-clock, over seeds, under two fairness rules (docs/learning_speed.md).

Every run starts from the same warm-started model and trains on the same task with the same
loss, batch size B, engine capacity, wall-clock budget and held-out evaluation; modes differ in
schedule and threads:
- `pipeline` (KV cache kept across weight updates) and `pipeline recompute-KV`: actor and
  trainer at once, one core each;
- `conventional G=1,2,4,8` under rule (a), one core per role (1 thread each), and rule (b),
  the whole machine per phase (2 threads each: the roles alternate, so each phase gets both);
- with --trl, TRL's GRPOTrainer (benchmarks/trl_grpo.py), one process on both cores.
Time to target = the `time_s` at which the first evaluated version with held-out pass@1
(`eval/sampled/pass@1`, T = 1) >= --target was made. The target is chosen before the runs and
recorded in --out/plan.json with the role throughputs measured before the runs. Writes the
`learning_speed` section of RESULTS.md, benchmarks/learning_speed.png and the runs' records
behind them (benchmarks/learning_speed_runs.json.gz: the --out directory is outside the
checkout and may not outlive the machine).

    python benchmarks/learning_speed.py --target 0.45 --trl      # full: about 6 h, see docs
    python benchmarks/learning_speed.py --report-only            # rebuild from the runs in --out
    python benchmarks/learning_speed.py --from-archive           # rebuild from the checkout's records
    python benchmarks/learning_speed.py --quick --out /tmp/ls    # CI smoke: tiny, not recorded
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from _results import environment, load_average, table, this_command, write_section  # noqa: E402

from pipelinerl.config import Config, load_config  # noqa: E402
from pipelinerl.roles.launch import role_env  # noqa: E402

ROOT = BENCH.parent
CONFIG = ROOT / "examples" / "arithmetic.yaml"
PIPELINE, RECOMPUTE, TRL = "pipeline", "pipeline recompute-KV", "TRL GRPOTrainer"
RULES = {"a": ("one core per role", 1), "b": ("the whole machine per phase", 2)}
GS = (1, 2, 4, 8)
TRL_THREADS = 2  # one process: the whole machine
PASS1 = "eval/sampled/pass@1"
ESS_WINDOW = 16  # optimizer steps in the plot's rolling mean
QUICK_TARGET = 0.1
RUN_RECORD = "bench.json"  # written when a run finished: when it ran
ARCHIVE = BENCH / "learning_speed_runs.json.gz"  # the runs behind RESULTS.md's section
# What the report reads from a run's optimizer steps: all the archive keeps of them.
STEP_KEYS = ("step", "time_s", "samples_trained", "ess", "lag_mean", "actor_mean_update_pause_s")
SMOOTH = 3  # evaluations in the centred mean of the smoothed crossing
WORTH_STEPS = (150, 300, 600)  # optimizer steps at which held-out accuracy is compared
WORTH_TIMES = (120, 300, 600)  # and wall-clock seconds
PAUSE = "PAUSE"
QUICK_OVERRIDES = ["warmstart.steps=10", "engine.capacity=16", "actor.group_size=4",
                   "trainer.batch_size=16"]
# 97.5% quantiles of Student's t by degrees of freedom (scipy is not a dependency). Between two
# entries the smaller df's is used: a slightly wider interval, never a narrower one.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120,
        17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000,
        120: 1.980}


def _modes() -> dict[str, list[str]]:
    one_core = ["actor.threads=1", "trainer.threads=1"]
    modes = {PIPELINE: ["mode=pipeline", *one_core],
             RECOMPUTE: ["mode=pipeline", *one_core, "engine.recompute_kv_on_update=true"]}
    for rule, (_, threads) in RULES.items():
        for g in GS:
            modes[f"conventional G={g} ({rule})"] = [
                "mode=conventional", f"conventional_g={g}", f"actor.threads={threads}",
                f"trainer.threads={threads}"]
    return modes


MODES = _modes()
# Colours: tab20 pairs a dark and a light shade of one hue, here a G's rule (a) and (b) modes.
PLOT_ORDER = [PIPELINE, RECOMPUTE, *(f"conventional G={g} ({r})" for g in GS for r in RULES), TRL]


# -- runs -------------------------------------------------------------------------------------


def run_name(label: str, seed: int) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_") + f"_s{seed}"


def run_overrides(args: argparse.Namespace) -> list[str]:
    """Every run's overrides apart from its mode: budget, evaluation, the user's."""
    return [f"trainer.max_time_s={args.budget_s}", "trainer.max_steps=1000000",
            "eval.enabled=true", f"eval.every_s={args.eval_every_s}",
            f"eval.num_problems={args.eval_problems}", "metrics.progress=false",
            "metrics.plot=false", *args.overrides]


def run(label: str, seed: int, out: Path, overrides: list[str], config: Path = CONFIG) -> Run:
    """One run of `config`, or its finished copy in `out` (a run counts once its bench.json is
    written)."""
    name = run_name(label, seed)
    if (out / name / RUN_RECORD).exists():
        print(f"[learning_speed] {label} seed {seed}: done earlier, kept", flush=True)
        return Run.load(out / name)
    wait_while_paused(out)
    common = [f"name={name}", f"output_dir={out}", f"seed={seed}", f"trainer.seed={seed}",
              *overrides, "--overwrite"]
    if label == TRL:
        cmd = [sys.executable, str(BENCH / "trl_grpo.py"), f"--threads={TRL_THREADS}",
               f"--config={config}", *common]
        env = role_env(TRL_THREADS, progress=False)
    else:
        cmd = [sys.executable, "-m", "pipelinerl.cli", "train", str(config), *MODES[label], *common]
        env = None
    print(f"[learning_speed] {label} seed {seed}: {shlex.join(cmd[1:])}", flush=True)
    record = {"label": label, "seed": seed, "started": now(), "commit": commit()}
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env=env)
    record["finished"] = now()
    (out / name / RUN_RECORD).write_text(json.dumps(record, indent=1))
    return Run.load(out / name, record)


def wait_while_paused(out: Path) -> None:
    """Hold the next run while `out/PAUSE` exists: another job may then use the machine without
    landing inside a timed run (the run in progress finishes first)."""
    if (out / PAUSE).exists():
        print(f"[learning_speed] paused: waiting for {out / PAUSE} to go", flush=True)
        while (out / PAUSE).exists():
            time.sleep(5)


def commit() -> str:
    """The code a run used: the checkout's commit, marked when it has uncommitted changes
    (the reports an earlier seed's call rewrote, RESULTS.md and the plots, are not code)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                            ":!benchmarks/RESULTS.md", ":!benchmarks/*.png"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return f"{head}+changes" if dirty else head


def now() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M")


def first_crossing(x: np.ndarray, y: np.ndarray, target: float) -> float | None:
    """Where `y` over `x`, linear between its points, first reaches `target`; None if it
    never does."""
    above = np.flatnonzero(y >= target)
    if not above.size:
        return None
    i = int(above[0])
    if i == 0:
        return float(x[0])
    return float(x[i - 1] + (target - y[i - 1]) / (y[i] - y[i - 1]) * (x[i] - x[i - 1]))


@dataclass
class Run:
    """One run's metrics.jsonl: optimizer-step records, and held-out evaluations by version."""

    steps: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    record: dict[str, Any] = field(default_factory=dict)  # bench.json

    @classmethod
    def load(cls, run_dir: Path, record: dict[str, Any] | None = None) -> "Run":
        with (run_dir / "metrics.jsonl").open() as f:
            rows = [json.loads(line) for line in f]
        if record is None and (run_dir / RUN_RECORD).exists():
            record = json.loads((run_dir / RUN_RECORD).read_text())
        return cls.from_rows(rows, record or {}, str(run_dir))

    @classmethod
    def from_rows(cls, rows: list[dict[str, Any]], record: dict[str, Any], where: str) -> "Run":
        """A run from its metrics.jsonl rows (`where` names them in an error)."""
        evals = sorted((r for r in rows if "eval/version" in r), key=lambda r: r["eval/version"])
        if not evals:
            raise SystemExit(f"{where}: no held-out evaluation; runs need eval.enabled=true")
        return cls([r for r in rows if "eval/version" not in r], evals, record)

    def to_json(self) -> dict[str, Any]:
        """The run as archived: its record, evaluations, and the report's keys of each step."""
        steps = [{k: compact(r[k]) for k in STEP_KEYS if r.get(k) is not None} for r in self.steps]
        return {"record": self.record, "evals": self.evals, "steps": steps}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Run":
        return cls(data["steps"], data["evals"], data["record"])

    def seed(self, default: int) -> int:
        return self.record.get("seed", default)

    def time_to(self, target: float) -> float | None:
        return next((r["time_s"] for r in self.evals if r[PASS1] >= target), None)

    def time_to_smoothed(self, target: float) -> float | None:
        """When the centred mean of SMOOTH consecutive evaluations first reaches `target`,
        interpolated linearly in time. One lucky evaluation (+-0.03 at 300 problems) can set
        the first crossing early, most often in a slow mode, which has more evaluations near
        the target; it moves this one a third as much."""
        if len(self.evals) < SMOOTH:
            return None
        y = np.convolve([r[PASS1] for r in self.evals], np.ones(SMOOTH) / SMOOTH, mode="valid")
        t = np.array([r["time_s"] for r in self.evals], dtype=float)[SMOOTH // 2:][:len(y)]
        return first_crossing(t, y, target)

    def samples_per_s(self) -> float:
        return self.steps[-1]["samples_trained"] / self.steps[-1]["time_s"]

    def step_mean(self, key: str) -> float | None:
        values = [r[key] for r in self.steps if r.get(key) is not None]
        return statistics.fmean(values) if values else None

    def last(self, key: str) -> float | None:
        return self.steps[-1].get(key)

    def pass1_at(self, key: str, x: float) -> float | None:
        """Held-out pass@1 interpolated at `x` of `key` (`eval/version`: optimizer steps, or
        `time_s`); None past the last evaluation."""
        xs = [r[key] for r in self.evals]
        if x > xs[-1]:
            return None
        return float(np.interp(x, xs, [r[PASS1] for r in self.evals]))


def compact(value: float) -> float:
    """6 significant digits: far finer than the report shows, and half the archive's size."""
    return value if isinstance(value, int) else float(f"{value:.6g}")


def save_archive(path: Path, plan: dict[str, Any], results: dict[str, list[Run]]) -> None:
    """The plan and every run's records, gzipped JSON (15-25 kB a run: fewer steps, less)."""
    data = {"plan": plan, "runs": {label: [r.to_json() for r in runs]
                                   for label, runs in results.items()}}
    with gzip.open(path, "wt") as f:
        json.dump(data, f, separators=(",", ":"))


def load_archive(path: Path) -> tuple[dict[str, Any], dict[str, list[Run]]]:
    if not path.exists():
        raise SystemExit(f"{path} not found: it is written with the report of a full benchmark")
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    return data["plan"], {label: [Run.from_json(r) for r in runs]
                          for label, runs in data["runs"].items()}


# -- role throughputs and the bound -----------------------------------------------------------


def engine_rates(cfg: Config, model_path: str, threads: tuple[int, ...], n_prompts: int,
                 reps: int) -> dict[int, float]:
    """Samples/s of the torch engine while every slot is busy (benchmarks/engine.py's workload:
    the task's prompts, completion lengths of its worked solutions), per thread count."""
    import torch
    from engine import Workload, make_workload, run_engine

    from pipelinerl.engine import EngineOptions
    from pipelinerl.engine.torch_engine import TorchEngine
    from pipelinerl.models.hf import load_tokenizer

    wl = make_workload(load_tokenizer(model_path), n_prompts)
    engine = TorchEngine.from_pretrained(model_path, EngineOptions(
        capacity=cfg.engine.capacity, max_seq_len=cfg.engine.max_seq_len))
    run_engine(engine, Workload(wl.prompts[:engine.capacity], [8] * engine.capacity))  # warm-up
    rates: dict[int, list[float]] = {t: [] for t in threads}
    for _ in range(reps):  # interleaved, so a change of load hits every thread count alike
        for t in threads:
            torch.set_num_threads(t)
            r = run_engine(engine, wl)
            rates[t].append(r.full_tokens / r.full_seconds[0] / statistics.fmean(wl.max_new))
    return {t: statistics.median(v) for t, v in rates.items()}


def trainer_rates(cfg: Config, model_path: str, threads: tuple[int, ...],
                  steps: int) -> dict[int, float]:
    """Samples/s of `rl_step` on recorded-like batches (benchmarks/trainer.py's: the task's
    noisy worked solutions, behaviour log-probs = the model's + noise), per thread count."""
    import torch
    from trainer import GROUP_SIZE, make_batches

    from pipelinerl.models.hf import load_model, load_tokenizer
    from pipelinerl.rl.step import rl_step
    from pipelinerl.types import Group

    model = load_model(model_path).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.lr)
    batches = [[Group(f"g{i}", "", samples[i:i + GROUP_SIZE])
                for i in range(0, len(samples), GROUP_SIZE)]
               for samples, _ in make_batches(load_tokenizer(model_path), model, steps + 1,
                                              cfg.trainer.batch_size)]
    rl_step(model, optimizer, batches[0], cfg, trainer_version=0)  # warm-up
    rates: dict[int, list[float]] = {t: [] for t in threads}
    for groups in batches[1:]:
        for t in threads:
            torch.set_num_threads(t)
            t0 = time.perf_counter()
            rl_step(model, optimizer, groups, cfg, trainer_version=0)
            rates[t].append(cfg.trainer.batch_size / (time.perf_counter() - t0))
    return {t: statistics.median(v) for t, v in rates.items()}


def measure_scaling(cfg: Config, quick: bool) -> dict[str, dict[str, float]]:
    """Samples/s of each role at 1 and 2 threads (1 only in --quick: a smoke, not timed)."""
    from pipelinerl.roles.launch import starting_model

    model_path = cfg.model.path or str(starting_model(cfg))
    threads = (1,) if quick else (1, 2)
    gen = engine_rates(cfg, model_path, threads, n_prompts=(2 if quick else 6) * cfg.engine.capacity,
                       reps=1 if quick else 3)
    train = trainer_rates(cfg, model_path, threads, steps=1 if quick else 6)
    return {"engine": {str(t): v for t, v in gen.items()},
            "trainer": {str(t): v for t, v in train.items()}}


def rate_bound(scaling: dict[str, dict[str, float]], threads: int) -> float | None:
    """Upper bound on pipeline samples/s / conventional samples/s when conventional roles get
    `threads` threads: the pipeline runs both roles at once on one core each, so at most
    min(gen_1, train_1); conventional alternates them, 1 / (1/gen_t + 1/train_t)."""
    gen, train = scaling["engine"], scaling["trainer"]
    if str(threads) not in gen:
        return None
    return min(gen["1"], train["1"]) * (1 / gen[str(threads)] + 1 / train[str(threads)])


# -- statistics -------------------------------------------------------------------------------


def t975(df: int) -> float:
    return T975[max(d for d in T975 if d <= df)]


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95% interval (t-distribution over seeds); NaN bounds for one value."""
    a = np.asarray(values, dtype=float)
    if len(a) < 2:
        return float(a.mean()), math.nan, math.nan
    half = t975(len(a) - 1) * a.std(ddof=1) / math.sqrt(len(a))
    return float(a.mean()), float(a.mean() - half), float(a.mean() + half)


def ratio_interval(num: list[float], den: list[float]) -> tuple[float, float]:
    """95% interval of mean(num) / mean(den) by the delta method on its log, with the t
    quantile at min(n) - 1 degrees of freedom (Welch's smallest, so conservative)."""
    n = min(len(num), len(den))
    if n < 2:
        return math.nan, math.nan
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    se = math.sqrt(a.var(ddof=1) / (len(a) * a.mean() ** 2) + b.var(ddof=1) / (len(b) * b.mean() ** 2))
    ratio, q = a.mean() / b.mean(), t975(n - 1)
    return float(ratio * math.exp(-q * se)), float(ratio * math.exp(q * se))


def paired_ratio(num: dict[int, float], den: dict[int, float]) -> tuple[float, float, float]:
    """Geometric mean over the seeds in both of num[s] / den[s], with the 95% t interval of
    the mean log ratio: a seed's modes ran back to back, so the machine's state that seed (its
    speed drifts between hours) cancels in each ratio. NaN bounds below two seeds."""
    logs = [math.log(num[s] / den[s]) for s in sorted(num.keys() & den.keys())]
    if not logs:
        return math.nan, math.nan, math.nan
    mean, lo, hi = t_interval(logs)
    return math.exp(mean), math.exp(lo), math.exp(hi)


@dataclass
class Speedup:
    against: str  # the reference mode
    ratio: float  # its mean time to target / the pipeline's
    interval: tuple[float, float]
    lower_bound: bool  # the reference missed the target in some seed (counted at the budget)


def speedup(pipe: list[float | None], others: dict[str, list[float | None]],
            budget_s: float) -> Speedup | str:
    """The pipeline's speed-up over the fastest of `others`, or why there is none."""
    if not others:
        return "no such mode was run"
    reached = sum(t is not None for t in pipe)
    if reached < len(pipe):
        return f"the pipeline reached the target in {reached}/{len(pipe)} seeds"
    censored = {m: [budget_s if t is None else t for t in ts] for m, ts in others.items()}
    best = min(censored, key=lambda m: statistics.fmean(censored[m]))
    if statistics.fmean(censored[best]) == 0 or statistics.fmean(pipe) == 0:
        return "the starting model (version 0) already meets the target"
    lower = any(t is None for t in others[best])
    return Speedup(best, statistics.fmean(censored[best]) / statistics.fmean(pipe),
                   (math.nan, math.nan) if lower else ratio_interval(censored[best], pipe), lower)


# -- report -----------------------------------------------------------------------------------


def fmt_interval(values: list[float], spec: str) -> str:
    if not values:
        return "-"
    m, lo, hi = t_interval(values)
    return format(m, spec) if math.isnan(lo) else f"{m:{spec}} [{lo:{spec}}, {hi:{spec}}]"


def time_cell(runs: list[Run], target: float, budget_s: float,
              time_to: Callable[[Run, float], float | None] = Run.time_to) -> str:
    times = [time_to(r, target) for r in runs]
    reached = [t for t in times if t is not None]
    if len(reached) < len(times):
        return f"> {budget_s:.0f} ({len(reached)}/{len(times)} reached)"
    return fmt_interval(reached, ".0f")


def per_seed(runs: list[Run], fn: Callable[[Run], float | None]) -> list[float]:
    return [v for v in map(fn, runs) if v is not None]


def times_by_seed(runs: list[Run], target: float) -> dict[int, float]:
    """Time to target by seed, for the seeds that reached it."""
    return {r.seed(i): t for i, r in enumerate(runs) if (t := r.time_to(target)) is not None}


def paired_detail(result: Speedup, results: dict[str, list[Run]], target: float) -> str:
    ratio, lo, hi = paired_ratio(times_by_seed(results[result.against], target),
                                 times_by_seed(results[PIPELINE], target))
    if math.isnan(lo):
        return ""
    return (f"; paired by seed (geometric mean of each seed's ratio): {ratio:.1f}x, 95% interval "
            f"{lo:.1f}x-{hi:.1f}x")


def smoothed_detail(result: Speedup, results: dict[str, list[Run]], target: float) -> str:
    """The same ratio of mean times with the smoothed crossing, where every seed has one."""
    ref = [r.time_to_smoothed(target) for r in results[result.against]]
    pipe = [r.time_to_smoothed(target) for r in results[PIPELINE]]
    if None in ref or None in pipe or not statistics.fmean(pipe):
        return ""
    return (f"; smoothed crossing (centred mean of {SMOOTH} evaluations): "
            f"{statistics.fmean(ref) / statistics.fmean(pipe):.1f}x")


def headline(versus: str, result: Speedup | str, results: dict[str, list[Run]],
             target: float) -> list[str]:
    head = f"Learning speed-up (pipeline vs {versus}): "
    if isinstance(result, str):
        return [head + f"not measured ({result})", ""]
    pipe = statistics.fmean(r.time_to(target) for r in results[PIPELINE])
    versus_s = f"{result.ratio * pipe:.0f} s" + (" (misses at the budget)" if result.lower_bound else "")
    if result.lower_bound:
        reached = sum(r.time_to(target) is not None for r in results[result.against])
        detail = (f"a lower bound: {result.against} reached the target in {reached}/"
                  f"{len(results[result.against])} seeds; the others count at the budget")
    elif math.isnan(result.interval[0]):
        detail = "no interval with one seed"
    else:
        detail = (f"95% interval {result.interval[0]:.1f}x-{result.interval[1]:.1f}x (delta "
                  "method on the log of the ratio of mean times over seeds, t quantile)"
                  + paired_detail(result, results, target)
                  + smoothed_detail(result, results, target))
    return [head + f"{result.ratio:.1f}x" + (" (a lower bound)" if result.lower_bound else ""),
            f"- {result.against}: {versus_s} to the target vs the pipeline's {pipe:.0f} s; {detail}",
            ""]


def headlines(results: dict[str, list[Run]], target: float, budget_s: float) -> list[str]:
    def times(label: str) -> list[float | None]:
        return [r.time_to(target) for r in results[label]]

    lines = []
    for rule, (name, _) in RULES.items():
        others = {m: times(m) for m in results if m.endswith(f"({rule})")}
        lines += headline(f"best conventional, rule ({rule}): {name}",
                          speedup(times(PIPELINE), others, budget_s), results, target)
    if TRL in results:
        lines += headline(TRL, speedup(times(PIPELINE), {TRL: times(TRL)}, budget_s), results,
                          target)
    return lines


def mode_table(results: dict[str, list[Run]], target: float, budget_s: float) -> str:
    rows = [[label, str(len(runs)), time_cell(runs, target, budget_s),
             time_cell(runs, target, budget_s, Run.time_to_smoothed),
             fmt_interval([r.evals[-1][PASS1] for r in runs], ".3f"),
             fmt_interval([r.samples_per_s() for r in runs], ".1f"),
             fmt_interval(per_seed(runs, lambda r: r.step_mean("ess")), ".3f"),
             fmt_interval(per_seed(runs, lambda r: r.step_mean("lag_mean")), ".2f")]
            for label, runs in results.items()]
    return table(["mode", "seeds", "time to target (s) [95% CI]",
                  "smoothed crossing (s) [95% CI]", "final held-out pass@1 [95% CI]",
                  "samples/s [95% CI]", "ESS [95% CI]", "lag mean [95% CI]"], rows)


def seed_table(results: dict[str, list[Run]], target: float, seeds: int) -> str:
    """Each run: time to target and samples/s, a column per seed (the seeds ran as blocks, one
    after another, so a column shares the machine's state)."""
    rows = []
    for label, runs in results.items():
        cells = {r.seed(i): (f"{t:.0f}" if (t := r.time_to(target)) is not None else "missed")
                 + f" / {r.samples_per_s():.0f}" for i, r in enumerate(runs)}
        rows.append([label, *(cells.get(s, "-") for s in range(seeds))])
    return table(["mode", *(f"seed {s}: time to target (s) / samples/s" for s in range(seeds))],
                 rows)


def scaling_row(role: str, rates: dict[str, float]) -> list[str]:
    if "2" not in rates:  # --quick measures one thread only
        return [role, f"{rates['1']:.1f}", "-", "-"]
    return [role, f"{rates['1']:.1f}", f"{rates['2']:.1f}", f"{rates['2'] / rates['1']:.2f}x"]


def scaling_section(results: dict[str, list[Run]], scaling: dict[str, dict[str, float]]) -> list[str]:
    rows = [scaling_row("engine decode", scaling["engine"]),
            scaling_row("trainer rl_step", scaling["trainer"])]
    lines = ["### Role throughput (measured before the runs) and the bound on the pipeline's "
             "sample-rate edge", "",
             table(["role", "1 thread (samples/s)", "2 threads (samples/s)", "2 / 1"], rows),
             "Bound: the pipeline runs both roles at once, one core each: samples/s <= "
             "min(gen_1, train_1); a conventional run alternates them: samples/s = "
             "1 / (1/gen_t + 1/train_t) with t threads per role; bound = min(gen_1, train_1) x "
             "(1/gen_t + 1/train_t). The pipeline's measured rate is also held back by max_lag "
             "and the evaluator; a conventional round's tail (the engine draining) is not in "
             "the bound.", ""]
    pipe = statistics.fmean(r.samples_per_s() for r in results[PIPELINE])
    for rule, (name, threads) in RULES.items():
        conv = {m: statistics.fmean(r.samples_per_s() for r in runs)
                for m, runs in results.items() if m.endswith(f"({rule})")}
        bound = rate_bound(scaling, threads)
        if not conv or bound is None:
            lines.append(f"- rule ({rule}), {name}: not measured")
            continue
        fastest = max(conv, key=conv.get)
        lines.append(f"- rule ({rule}), {name}: bound {bound:.2f}x; measured pipeline / fastest "
                     f"conventional ({fastest}, {conv[fastest]:.1f} samples/s) = "
                     f"{pipe / conv[fastest]:.2f}x")
    return lines + [""]


def kv_section(results: dict[str, list[Run]], target: float, budget_s: float) -> list[str]:
    rows = [[label, fmt_interval([1e3 * s for s in per_seed(
                 results[label], lambda r: r.last("actor_mean_update_pause_s"))], ".2f"),
             fmt_interval(per_seed(results[label], lambda r: r.step_mean("ess")), ".3f"),
             time_cell(results[label], target, budget_s)]
            for label in (PIPELINE, RECOMPUTE) if label in results]
    return ["### KV cache kept vs recomputed on weight updates", "",
            table(["mode", "update pause (ms) [95% CI]", "ESS [95% CI]", "time to target (s) [95% CI]"],
                  rows)]


def worth_cell(runs: list[Run], key: str, x: float) -> str:
    """Mean over seeds of held-out pass@1 at `x`; '-' unless every seed got that far."""
    values = [r.pass1_at(key, x) for r in runs]
    return "-" if None in values else f"{statistics.fmean(values):.2f}"


def worth_section(results: dict[str, list[Run]]) -> list[str]:
    """Held-out accuracy at equal optimizer steps (what a sample is worth, lag included) and at
    equal wall-clock (what the schedule buys), interpolated between evaluations."""
    rows = [[label, *(worth_cell(runs, "eval/version", n) for n in WORTH_STEPS),
             *(worth_cell(runs, "time_s", t) for t in WORTH_TIMES)]
            for label, runs in results.items()]
    return ["### Held-out pass@1 at equal optimizer steps and at equal wall-clock", "",
            "Mean over seeds, interpolated between a run's evaluations; '-' where a seed did not "
            "get that far. Equal steps: what a batch of samples is worth (the lag included); "
            "equal wall-clock: what the schedule buys.", "",
            table(["mode", *(f"{n} steps" for n in WORTH_STEPS),
                   *(f"{t} s" for t in WORTH_TIMES)], rows)]


def masked_command(command: str) -> str:
    """The command with its --out directory shown as OUT: the runs' directory is this
    machine's, outside the checkout, and means nothing to a reader."""
    args = shlex.split(command)
    for i, arg in enumerate(args):
        if arg == "--out" and i + 1 < len(args):
            args[i + 1] = "OUT"
        elif arg.startswith("--out="):
            args[i] = "--out=OUT"
    return shlex.join(args)


def run_span(results: dict[str, list[Run]]) -> str:
    """When the runs were made (they may span sessions: --resume)."""
    records = [r.record for runs in results.values() for r in runs if r.record]
    if not records:
        return "run dates not recorded"
    days = sorted({r["started"][:10] for r in records})
    commits = sorted({r.get("commit", "unknown") for r in records})
    return (f"{len(records)} runs made {min(r['started'] for r in records)} to "
            f"{max(r['finished'] for r in records)} ({len(days)} day(s)), code at "
            f"{', '.join(commits)}")


def report(results: dict[str, list[Run]], plan: dict[str, Any],
           load: tuple[float, float, float] | None) -> str:
    target, budget_s = plan["target"], plan["budget_s"]
    start = fmt_interval([r.evals[0][PASS1] for r in results[PIPELINE]], ".3f")
    lines = [
        "## Learning speed: PipelineRL vs conventional RL, held-out accuracy",
        "",
        environment(load, masked_command(this_command())).rstrip("\n"),
        f"- runs: `{masked_command(plan['command'])}` (OUT: the runs' directory), started "
        f"{plan['started']}; {plan['seeds']} seed(s) per "
        f"mode, {budget_s:.0f} s of wall-clock each, seed by seed through the modes; "
        f"{run_span(results)}; plot: benchmarks/learning_speed.png",
        f"- target: held-out pass@1 (`{PASS1}`, temperature 1, {plan['eval_problems']} problems "
        f"training never sees) >= {target:.3f}, chosen before the runs and recorded in "
        f"plan.json; time to target = when the first evaluated version at or above it was made "
        f"(the headlines); smoothed crossing = when the centred mean of {SMOOTH} consecutive "
        "evaluations first reaches it, linear in time between them (less sensitive to one "
        "evaluation's noise). "
        f"Starting model (version 0): {start}",
        f"- evaluation: every run, the newest weights every {plan['eval_every_s']:.0f} s, "
        "version 0 and the final weights, by the same code and settings; in pipelinerl runs the "
        "evaluator is a process beside the roles (1 thread), TRL's pauses its clock",
        "- same task, starting model, loss, B, engine capacity in every mode. Threads: pipeline "
        "1 per role (both rules: its roles run at once); conventional 1 per role under rule "
        f"(a), 2 under rule (b) (its roles alternate); TRL {TRL_THREADS} in one process",
        "- intervals: 95%, t-distribution over seeds",
        "",
        *headlines(results, target, budget_s),
        mode_table(results, target, budget_s),
        "Per seed:", "",
        seed_table(results, target, plan["seeds"]),
        *worth_section(results),
        *scaling_section(results, plan["scaling"]),
        *kv_section(results, target, budget_s),
    ]
    return "\n".join(lines)


# -- plot -------------------------------------------------------------------------------------


def eval_curve(run: Run) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([r["time_s"] for r in run.evals], dtype=float),
            np.array([r[PASS1] for r in run.evals], dtype=float))


def ess_curve(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """ESS per optimizer step, rolling mean over ESS_WINDOW steps, at each window's end."""
    rows = [(r["time_s"], r["ess"]) for r in run.steps if r.get("ess") is not None]
    w = min(ESS_WINDOW, len(rows))
    if not w:
        return np.array([]), np.array([])
    t, ess = np.array(rows, dtype=float).T
    return t[w - 1:], np.convolve(ess, np.ones(w) / w, mode="valid")


def draw_band(ax: Any, curves: list[tuple[np.ndarray, np.ndarray]], style: dict[str, Any],
              label: str | None) -> float:
    """Mean over seeds with a min-max band, interpolated at common times (where every seed has
    data); returns the band's lowest value."""
    grid = np.linspace(max(t[0] for t, _ in curves), min(t[-1] for t, _ in curves), 200)
    ys = np.array([np.interp(grid, t, y) for t, y in curves])
    ax.plot(grid, ys.mean(axis=0), label=label, **style)
    ax.fill_between(grid, ys.min(axis=0), ys.max(axis=0), color=style["color"], alpha=0.15, lw=0)
    return float(ys.min())


def plot(results: dict[str, list[Run]], target: float, path: Path) -> None:
    fig, (acc, ess) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
    cmap = plt.get_cmap("tab20")
    ess_low = [0.9]
    for label, runs in results.items():
        style = {"color": cmap(PLOT_ORDER.index(label)), "ls": "--" if label.endswith("(b)") else "-",
                 "lw": 1.5}
        draw_band(acc, [eval_curve(r) for r in runs], style, label)
        curves = [c for c in map(ess_curve, runs) if len(c[0])]
        if len(curves) == len(runs):
            ess_low.append(draw_band(ess, curves, style, None))
    acc.axhline(target, color="grey", ls=":", lw=1, label=f"target {target:.2f}")
    acc.set_ylabel("held-out pass@1 (T = 1)")
    acc.legend(loc="lower right", fontsize=7, ncol=2)
    acc.set_title("Held-out accuracy vs wall-clock: mean over seeds, min-max band")
    ess.set_ylabel(f"ESS (rolling mean, {ESS_WINDOW} steps)")
    ess.set_ylim(min(ess_low) - 0.005, 1.005)  # ESS sits near 1: a fixed top keeps it readable
    ess.set_xlabel("wall-clock (s; TRL: training clock, evaluation excluded)")
    for ax in (acc, ess):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main -------------------------------------------------------------------------------------


def new_plan(args: argparse.Namespace, labels: list[str], overrides: list[str]) -> dict[str, Any]:
    """The settings fixed before the runs (the target first), with the role throughputs; with
    --resume, the plan of the runs already in --out (refused if the settings changed)."""
    path = args.out / "plan.json"
    earlier = json.loads(path.read_text()) if path.exists() else None
    if earlier is not None and earlier["target"] != args.target:
        raise SystemExit(f"{args.out} holds runs made for target {earlier['target']}: the target "
                         "is chosen before the runs; use another --out")
    fixed = {"target": args.target, "quick": args.quick, "budget_s": args.budget_s,
             "seeds": args.seeds, "eval_every_s": args.eval_every_s,
             "eval_problems": args.eval_problems, "overrides": args.overrides}
    if args.resume:
        if earlier is None:
            raise SystemExit(f"--resume: no plan.json in {args.out}; start without --resume")
        changed = [k for k, v in fixed.items() if earlier[k] != v]
        if changed:
            raise SystemExit(f"--resume: {', '.join(changed)} differ from the runs in {args.out} "
                             f"({', '.join(f'{k}={earlier[k]!r}' for k in changed)})")
        earlier["modes"] = list(dict.fromkeys([*earlier["modes"], *labels]))
        path.write_text(json.dumps(earlier, indent=1))
        return earlier
    cfg = load_config(CONFIG, overrides)
    plan = {**fixed, "modes": labels,
            "command": shlex.join(["python", str(Path(sys.argv[0])), *sys.argv[1:]]),
            "started": now(), "scaling": measure_scaling(cfg, args.quick)}
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=1))
    return plan


def read_plan(args: argparse.Namespace) -> dict[str, Any]:
    path = args.out / "plan.json"
    if not path.exists():
        raise SystemExit(f"{path} not found: --report-only rebuilds the report of runs made there")
    plan = json.loads(path.read_text())
    if args.target is not None and args.target != plan["target"]:
        raise SystemExit(f"the runs in {args.out} were made for target {plan['target']}, chosen "
                         f"before them; --target {args.target} would be chosen after")
    return plan


def load_results(out: Path, labels: list[str], seeds: int) -> dict[str, list[Run]]:
    """The finished runs of `labels` found in `out` (a mode not run is left out)."""
    found = {label: [Run.load(out / run_name(label, s)) for s in range(seeds)
                     if (out / run_name(label, s) / RUN_RECORD).exists()] for label in labels}
    return {label: runs for label, runs in found.items() if runs}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=float,
                   help="held-out pass@1 to reach; required, chosen before the runs")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=600.0, help="wall-clock per run")
    p.add_argument("--eval-every-s", type=float, default=30.0)
    p.add_argument("--eval-problems", type=int, default=300)
    p.add_argument("--modes", nargs="+", choices=list(MODES), help="default: all")
    p.add_argument("--trl", action="store_true",
                   help="add TRL's GRPOTrainer (needs `pip install -e .[bench]`)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "learning_speed")
    p.add_argument("--resume", action="store_true",
                   help="keep the finished runs in --out (same target and settings), run the rest")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild the report and plot from the runs in --out")
    p.add_argument("--from-archive", action="store_true",
                   help=f"rebuild the report and plot from {ARCHIVE.relative_to(ROOT)}, the runs "
                        "behind RESULTS.md (no --out needed)")
    p.add_argument("--quick", action="store_true", help="tiny smoke run, not recorded")
    p.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = p.parse_args()
    if args.quick:
        args.budget_s, args.seeds, args.eval_every_s, args.eval_problems = 15.0, 1, 5.0, 16
        args.modes = args.modes or [PIPELINE, "conventional G=2 (a)"]
        args.target = QUICK_TARGET if args.target is None else args.target
        args.overrides += [f"warmstart.cache_dir={args.out / 'cache'}", *QUICK_OVERRIDES]
    if args.target is None and not (args.report_only or args.from_archive):
        p.error("--target is required: choose the held-out pass@1 to reach before the runs")
    if args.modes and PIPELINE not in args.modes:
        p.error("the pipeline mode is the reference: keep it in --modes")
    return args


def main() -> None:
    args = parse_args()
    labels = (args.modes or list(MODES)) + ([TRL] if args.trl or args.report_only else [])
    load = None if args.report_only or args.from_archive else load_average()
    if args.from_archive:
        plan, results = load_archive(ARCHIVE)
    elif args.report_only:
        plan = read_plan(args)
        results = load_results(args.out, labels, plan["seeds"])
    else:
        overrides = run_overrides(args)
        plan = new_plan(args, labels, overrides)
        # Seed by seed, every mode in turn: a drift of the machine's speed over the hours
        # touches every mode alike, and a benchmark stopped early leaves equal seed counts.
        runs = {(label, seed): run(label, seed, args.out, overrides)
                for seed in range(args.seeds) for label in labels}
        results = {label: [runs[label, seed] for seed in range(args.seeds)] for label in labels}
    if PIPELINE not in results:
        raise SystemExit(f"no pipeline run in {args.out}: it is the reference")
    text = report(results, plan, load)
    print(text)
    smoke = args.quick or plan["quick"]  # a smoke's figures are never recorded
    plot(results, plan["target"], args.out / "learning_speed.png" if smoke
         else BENCH / "learning_speed.png")
    if not smoke:
        write_section("learning_speed", text)
        if not args.from_archive:
            save_archive(ARCHIVE, plan, results)


if __name__ == "__main__":
    main()
