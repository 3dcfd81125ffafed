"""Environments from other libraries on a real model: held-out accuracy before and after RL
(issue 26, part 4). Each run is `pipelinerl train` of an example config, from the examples
folder as a user runs it, with SmolLM2-135M-Instruct on the CPU; its config and metrics are
copied into benchmarks/env_runs/ as it ends, and the `environments` section of RESULTS.md is
rebuilt from every record there.

    python benchmarks/env_runs.py reasoning_gym.yaml:0 reasoning_gym.yaml:1 vf_qa.yaml:0
    python benchmarks/env_runs.py --report-only
    python benchmarks/env_runs.py --minutes 15 reasoning_gym.yaml:2   # trainer.max_time_s

The machine should be quiet: the three roles of a run take both cores.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from _results import environment, load_average, table, write_section  # noqa: E402

ROOT = BENCH.parent
EXAMPLES = ROOT / "examples"
RECORDS = BENCH / "env_runs"


def run(config: str, seed: int, minutes: float, out: Path, cwd: Path = EXAMPLES,
        records: Path = RECORDS, extra: tuple[str, ...] = ()) -> Path:
    """One training run (from `cwd`, with `extra` overrides); its records, copied into
    `records`, are returned's stem."""
    name = f"{Path(config).stem}-seed{seed}"
    cmd = [sys.executable, "-m", "pipelinerl.cli", "train", config, f"name={name}",
           f"output_dir={out}", f"seed={seed}", f"trainer.max_time_s={minutes * 60:.0f}",
           "metrics.progress=false", "metrics.plot=false", *extra, "--overwrite"]
    print(f"$ (cd {cwd.relative_to(ROOT) if cwd != ROOT else '.'} &&", " ".join(cmd[2:]), ")",
          flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    run_dir = out / name
    records.mkdir(exist_ok=True)
    shutil.copy(run_dir / "config.yaml", records / f"{name}.config.yaml")
    with (run_dir / "metrics.jsonl").open("rb") as src, \
            gzip.open(records / f"{name}.metrics.jsonl.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    (records / f"{name}.wall_s").write_text(f"{time.monotonic() - t0:.0f}\n")
    return records / name


def summary(stem: Path) -> list[str]:
    rows = [json.loads(line) for line in gzip.open(f"{stem}.metrics.jsonl.gz", "rt")]
    steps = [r for r in rows if "loss" in r]
    evals = sorted((r for r in rows if "eval/version" in r), key=lambda r: r["eval/version"])
    first, last = evals[0], evals[-1]
    # The actors' counts of groups they dropped (zero variance, failed episodes), cumulative.
    skipped = {k.removeprefix("actor_skipped_"): v for k, v in steps[-1].items()
               if k.startswith("actor_skipped_")} if steps else {}

    def pair(key: str) -> str:
        return f"{first[key]:.3f} -> {last[key]:.3f}"

    return [stem.name.rsplit("-seed", 1)[0], stem.name.rsplit("-seed", 1)[1],
            str(steps[-1]["step"] if steps else 0), f"{steps[-1]['time_s'] / 60:.1f}" if steps else "0",
            pair("eval/greedy"), pair("eval/sampled/pass@1"),
            f"{int(first['eval/num_problems'])}", str(last["eval/version"]),
            ", ".join(f"{k} {v:g}" for k, v in sorted(skipped.items())) or "none"]


def report(load: tuple[float, float, float] | None) -> str:
    stems = sorted({p.name.split(".")[0] for p in RECORDS.glob("*.metrics.jsonl.gz")})
    rows = [summary(RECORDS / s) for s in stems]
    return (
        "## Environments from other libraries on SmolLM2 (`benchmarks/env_runs.py`)\n\n"
        + environment(load) + "\n"
        "Held-out accuracy of the starting model (version 0) and of the final weights, each "
        "run's own evaluator (greedy: one attempt; pass@1: sampled at T=1). Records in "
        "benchmarks/env_runs/.\n\n"
        + table(["config", "seed", "steps", "RL minutes", "held-out greedy", "held-out pass@1",
                 "problems", "final version", "groups dropped (actor)"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", help="CONFIG:SEED, a config of examples/")
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "env_runs")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    load = None if args.report_only else load_average()
    for spec in args.runs:
        config, _, seed = spec.rpartition(":")
        run(config, int(seed), args.minutes, args.out)
        write_section("environments", report(load))
    if args.report_only:
        write_section("environments", report(None))
    print(report(load))


if __name__ == "__main__":
    main()
