"""SmolLM2-135M-Instruct learns to call an MCP server (issue 52, part 4): `pipelinerl train
examples/tools_mcp.yaml` as a user runs it, from the repository root (the warm start on
tool-call demonstrations, cached after its first build, then RL for the config's 20 minutes),
one run per seed. Held-out success of the warm-started start (version 0) and of the final
weights (the run's evaluator, deferred to after the run so it takes no core from RL); calls per episode and the fraction of well-formed calls over training (the
actor's counts). Records in benchmarks/tools_runs/; the `tools_learning` section of RESULTS.md.

    python benchmarks/tools_learning.py 0 1 2
    python benchmarks/tools_learning.py --report-only

The machine should be quiet: the run's roles take both cores.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from _results import environment, load_average, table, write_section  # noqa: E402
from env_runs import ROOT, run  # noqa: E402

CONFIG = "examples/tools_mcp.yaml"
RECORDS = BENCH / "tools_runs"
# The evaluator after the run on every core (eval.deferred): version 0 and the final weights.
OVERRIDES = ("eval.deferred=true", "eval.every_s=0")


def _rows(stem: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in gzip.open(f"{stem}.metrics.jsonl.gz", "rt")]


def summary(stem: Path) -> list[str]:
    rows = _rows(stem)
    steps = [r for r in rows if "loss" in r]
    evals = sorted((r for r in rows if "eval/version" in r), key=lambda r: r["eval/version"])
    seed = stem.name.rsplit("-seed", 1)[1]
    config = Path(f"{stem}.config.yaml").read_text()
    group_size = int(re.search(r"^  group_size: (\d+)", config, re.M).group(1))

    def trend(key: str) -> str:
        return " -> ".join(f"{r[key]:.2f}" for r in evals)

    early = [r for r in steps if r["time_s"] <= 300]
    late = [r for r in steps if r["time_s"] >= steps[-1]["time_s"] - 300]
    return [seed, str(steps[-1]["step"]), f"{steps[-1]['time_s'] / 60:.1f}",
            trend("eval/greedy"), trend("eval/sampled/pass@1"),
            ", ".join(str(r["eval/version"]) for r in evals),
            _per_episode(early, group_size), _per_episode(late, group_size)]


def _episodes(row: dict[str, Any], group_size: int) -> float:
    """The actor's finished episodes so far: its groups published and dropped, each whole."""
    groups = row["actor_groups_published"] + sum(
        v for k, v in row.items() if k.startswith("actor_skipped_"))
    return groups * group_size


def _per_episode(window: list[dict[str, Any]], group_size: int) -> str:
    """Calls per episode and well-formed fraction between the window's first and last rows of
    the actor's cumulative counts."""
    rows = [r for r in window if "actor_tool_calls" in r]
    if len(rows) < 2:
        return "n/a"
    a, b = rows[0], rows[-1]
    episodes = _episodes(b, group_size) - _episodes(a, group_size)
    calls = b["actor_tool_calls"] - a["actor_tool_calls"]
    bad = b.get("actor_tool_bad_calls", 0) - a.get("actor_tool_bad_calls", 0)
    if episodes <= 0:
        return "n/a"
    return f"{calls / episodes:.2f} calls, {1 - bad / max(calls, 1):.2f} well-formed"


def report(load: tuple[float, float, float] | None) -> str:
    stems = sorted({p.name.split(".")[0] for p in RECORDS.glob("*.metrics.jsonl.gz")})
    rows = [summary(RECORDS / s) for s in stems]
    return (
        "## Tools: SmolLM2 learns to call an MCP server (`benchmarks/tools_learning.py`)\n\n"
        + environment(load) + "\n"
        f"`pipelinerl train {CONFIG}` ({' '.join(OVERRIDES)}): SmolLM2-135M-Instruct "
        "warm-started on noisy demonstrations of the call (`warmstart.given_model`, 40 steps of "
        "8; one build, shared by the seeds), then 20 minutes of RL on two cores. Held-out "
        "success (products never asked in training) at version 0 (the warm-started start) "
        "and on the final weights: greedy, and pass@1 sampled at T=1. Calls per "
        "episode and well-formed fraction: the actor's episodes in the first and the last five "
        "minutes. Records in benchmarks/tools_runs/.\n\n"
        + table(["seed", "steps", "RL minutes", "held-out greedy", "held-out pass@1 (T=1)",
                 "versions evaluated", "calls, first 5 min", "calls, last 5 min"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("seeds", nargs="*", type=int)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "tools_runs")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    load = None if args.report_only else load_average()
    for seed in args.seeds:
        run(CONFIG, seed, args.minutes, args.out, cwd=ROOT, records=RECORDS, extra=OVERRIDES)
        write_section("tools_learning", report(load))
    if args.report_only:
        write_section("tools_learning", report(None))
    print(report(load))


if __name__ == "__main__":
    main()
