"""Soak: the demo run for a long while, sampling every role's memory and the run directory's size.

A run that leaks grows its roles' resident memory step after step; a run whose streams are
never trimmed grows its directory (docs/reliability.md, "Bounded disk"). This runs
`pipelinerl train examples/arithmetic.yaml` for --minutes (30 by default: thousands of optimizer
steps on the demo), samples every --every-s seconds the RSS of each role (the role's process
and its children: an actor's verifier workers, the trainer's ranks) and the size of the run
directory and its streams, and reports growth after warm-up (the first checkpoint, when the
first stream segments may go). Writes the `soak` section of RESULTS.md and benchmarks/soak.png.

    python benchmarks/soak.py                      # 30 min
    python benchmarks/soak.py --minutes 1 --quick --out /tmp/soak    # smoke, not recorded
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import psutil  # noqa: E402

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from _results import environment, load_average, write_section  # noqa: E402

ROOT = BENCH.parent
CONFIG = ROOT / "examples" / "arithmetic.yaml"
MAX_GROWTH = 0.05  # the bound on memory growth after warm-up
QUICK = ["warmstart.steps=10", "engine.capacity=16", "actor.group_size=4", "trainer.batch_size=16"]


@dataclass
class Samples:
    t: list[float] = field(default_factory=list)
    step: list[int] = field(default_factory=list)
    rss_mb: dict[str, list[float]] = field(default_factory=dict)  # role -> one per sample
    run_mb: list[float] = field(default_factory=list)
    streams_mb: list[float] = field(default_factory=list)
    logs_mb: list[float] = field(default_factory=list)  # metrics.jsonl + trained.jsonl: kept
    checkpoints_at: list[float] = field(default_factory=list)  # when each checkpoint appeared

    @property
    def checkpoint_at(self) -> float | None:
        return self.checkpoints_at[0] if self.checkpoints_at else None


def role_of(proc: psutil.Process) -> str | None:
    """`trainer`, `actor_N` or `evaluator` for a role process started by the launcher."""
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return None
    if "pipelinerl.cli" not in cmd:
        return None
    if "trainer" in cmd or "torch.distributed.run" in cmd:
        return "trainer"
    if "evaluator" in cmd:
        return "evaluator"
    if "actor" in cmd:
        return f"actor_{cmd[cmd.index('--actor-id') + 1]}" if "--actor-id" in cmd else "actor_0"
    return None


def rss_by_role(launcher: psutil.Process) -> dict[str, float]:
    """MB of resident memory per role, its child processes included."""
    out: dict[str, float] = {}
    try:
        children = launcher.children()
    except psutil.Error:
        return out
    for child in children:
        role = role_of(child)
        if role is None:
            continue
        try:
            procs = [child, *child.children(recursive=True)]
            out[role] = out.get(role, 0.0) + sum(p.memory_info().rss for p in procs) / 2**20
        except psutil.Error:
            continue
    return out


def tree_mb(path: Path) -> float:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total / 2**20


def file_mb(path: Path) -> float:
    try:
        return path.stat().st_size / 2**20
    except OSError:
        return 0.0


def last_step(metrics: Path) -> int:
    try:
        with metrics.open("rb") as f:
            f.seek(max(0, metrics.stat().st_size - 65536))
            lines = [line for line in f.read().splitlines() if line.strip()]
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "eval/version" not in record:
            return int(record["step"])
    return 0


def soak(args: argparse.Namespace) -> tuple[Samples, Path]:
    run_dir = args.out / "soak"
    cmd = [sys.executable, "-m", "pipelinerl.cli", "train", str(CONFIG), "name=soak",
           f"output_dir={args.out}", f"trainer.max_time_s={args.minutes * 60}",
           "trainer.max_steps=100000000", "metrics.progress=false", *args.overrides, "--overwrite"]
    print(f"[soak] {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    launcher = psutil.Process(proc.pid)
    s = Samples()
    seen_checkpoint = None
    t0 = time.monotonic()
    while proc.poll() is None:
        time.sleep(args.every_s)
        rss = rss_by_role(launcher)
        if not rss:
            continue  # warm-start, or the roles are leaving
        s.t.append(time.monotonic() - t0)
        s.step.append(last_step(run_dir / "metrics.jsonl"))
        for role, mb in rss.items():
            s.rss_mb.setdefault(role, [float("nan")] * (len(s.t) - 1)).append(mb)
        for values in s.rss_mb.values():
            values.extend([float("nan")] * (len(s.t) - len(values)))
        s.run_mb.append(tree_mb(run_dir))
        s.streams_mb.append(tree_mb(run_dir / "streams"))
        s.logs_mb.append(sum(file_mb(run_dir / name) for name in ("metrics.jsonl", "trained.jsonl")))
        newest = max((c.name for c in (run_dir / "checkpoints").glob("step_*")), default=None)
        if newest is not None and newest != seen_checkpoint:
            seen_checkpoint = newest
            s.checkpoints_at.append(s.t[-1])
    if proc.returncode != 0:
        raise SystemExit(f"the run failed with exit code {proc.returncode}; see {run_dir}/logs")
    return s, run_dir


def warm_index(s: Samples) -> int:
    """The first sample after warm-up: once the first checkpoint exists (its stream segments
    may go from then on), and at least a tenth into the run."""
    start = max(s.checkpoint_at or 0.0, 0.1 * s.t[-1])
    return next(i for i, t in enumerate(s.t) if t >= start)


def growth(values: list[float], i: int) -> tuple[float, float, float]:
    """(after warm-up, at the end, growth: the mean of the last tenth over warm-up's)."""
    tail = [v for v in values[max(i, len(values) - max(1, len(values) // 10)):] if v == v]
    start, end = values[i], sum(tail) / len(tail)
    return start, [v for v in values if v == v][-1], end / start - 1.0


def interval_peaks(s: Samples, values: list[float]) -> list[float]:
    """The largest value between each two checkpoints (from the first on): a directory that
    checkpoints trim saws up and down; bounded means these peaks do not climb."""
    edges = [*s.checkpoints_at, s.t[-1] + 1]
    return [max((v for t, v in zip(s.t, values) if lo <= t < hi), default=float("nan"))
            for lo, hi in zip(edges, edges[1:])]


def report(s: Samples, run_dir: Path, load: tuple[float, float, float], quick: bool) -> str:
    i = warm_index(s)
    rows = []
    for role in sorted(s.rss_mb):
        start, end, g = growth(s.rss_mb[role], i)
        verdict = "ok" if g < MAX_GROWTH else "FAIL"
        rows.append(f"| {role} | {start:.0f} | {end:.0f} | {max(v for v in s.rss_mb[role] if v == v):.0f} "
                    f"| {100 * g:+.1f}% | {verdict} |")
    run_peaks, stream_peaks = interval_peaks(s, s.run_mb), interval_peaks(s, s.streams_mb)
    # The last interval is cut short by the run's end: the full ones decide, the later half's
    # highest peak against the earlier half's.
    full = stream_peaks[:-1] if len(stream_peaks) > 2 else stream_peaks
    half = max(1, len(full) // 2)
    climb = max(full[half:] or full) / max(full[:half]) - 1.0 if full else float("nan")
    per_hour = (s.logs_mb[-1] - s.logs_mb[i]) / ((s.t[-1] - s.t[i]) / 3600)
    lines = [
        "## Soak: memory and disk over a long demo run",
        "",
        environment(load).rstrip("\n"),
        f"- run: {s.t[-1] / 60:.1f} min, {s.step[-1]} optimizer steps; samples every "
        f"{s.t[1] - s.t[0]:.0f} s; warm-up ends at {s.t[i]:.0f} s (step {s.step[i]}: the first "
        "checkpoint, when old stream segments start to go, or a tenth of the run)",
        f"- growth = mean of the last tenth of the samples over the first sample after warm-up; "
        f"bound {100 * MAX_GROWTH:.0f}%" + (" (quick smoke: not recorded)" if quick else ""),
        "",
        "| role (with its child processes) | RSS after warm-up (MB) | RSS at end (MB) | max (MB) "
        "| growth | < 5% |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        f"Disk: the streams grow between checkpoints and drop at each (segments before the "
        f"checkpoint's offsets are deleted), so the run directory saws up and down. Peak per "
        f"interval between checkpoints ({len(s.checkpoints_at)} checkpoints; the last interval "
        "is cut short by the end):",
        "",
        "| | " + " | ".join(f"{k + 1}" for k in range(len(run_peaks))) + " |",
        "| --- |" + " --- |" * len(run_peaks),
        "| run directory (MB) | " + " | ".join(f"{v:.1f}" for v in run_peaks) + " |",
        "| streams (MB) | " + " | ".join(f"{v:.1f}" for v in stream_peaks) + " |",
        "",
        f"- streams: the highest peak of the later half of the full intervals is "
        f"{100 * climb:+.0f}% over the earlier half's "
        f"({'bounded' if climb < 0.25 else 'CLIMBING'}); {s.streams_mb[-1]:.1f} MB at the end, "
        f"{max(s.streams_mb):.1f} MB at most",
        f"- what grows without bound by design: metrics.jsonl and trained.jsonl, "
        f"{s.logs_mb[-1]:.1f} MB at the end ({per_hour:.1f} MB per hour of this demo)",
        "",
        "Plot: benchmarks/soak.png (RSS per role and the run directory's size against time).",
    ]
    return "\n".join(lines)


def plot(s: Samples, path: Path) -> None:
    fig, (mem, disk) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    minutes = [t / 60 for t in s.t]
    for role, values in sorted(s.rss_mb.items()):
        mem.plot(minutes, values, label=role)
    mem.set_ylabel("RSS (MB)")
    mem.legend(fontsize=8)
    disk.plot(minutes, s.run_mb, label="run directory")
    disk.plot(minutes, s.streams_mb, label="streams")
    if s.checkpoint_at is not None:
        for ax in (mem, disk):
            ax.axvline(s.checkpoint_at / 60, color="grey", ls=":", lw=1)
    disk.set_ylabel("MB")
    disk.set_xlabel("minutes (dotted: first checkpoint)")
    disk.legend(fontsize=8)
    for ax in (mem, disk):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--every-s", type=float, default=10.0)
    p.add_argument("--out", type=Path, default=ROOT / "runs")
    p.add_argument("--quick", action="store_true", help="tiny model, not recorded")
    p.add_argument("overrides", nargs="*", help="config overrides for the run")
    args = p.parse_args()
    if args.quick:
        args.overrides = [f"warmstart.cache_dir={args.out / 'cache'}", *QUICK, "eval.enabled=false",
                          "trainer.checkpoint_every_steps=20", "stream.segment_mb=0.05",
                          *args.overrides]
    load = load_average()
    s, run_dir = soak(args)
    (args.out / "soak_samples.json").write_text(json.dumps(asdict(s)))  # the raw figures
    text = report(s, run_dir, load, args.quick)
    print(text)
    plot(s, args.out / "soak.png" if args.quick else BENCH / "soak.png")
    if not args.quick:
        write_section("soak", text)


if __name__ == "__main__":
    main()
