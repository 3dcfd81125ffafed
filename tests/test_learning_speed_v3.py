"""Learning-speed benchmark v3: its measure, seed order, quiet check, archive and report on
synthetic runs (fast), and its `--quick` smoke through the CLI (slow, not timed)."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import learning_speed_v3 as v3  # noqa: E402

G1, G2 = "conventional G=1 (a)", "conventional G=2 (a)"
HEADLINE = re.compile(r"^Learning speed-up \(pipeline vs (.+?)\): (\d+\.\dx|not measured)(.*)$",
                      re.M)
PLAN = {"workload": "examples/long_chains.yaml", "target": 0.35, "lr": 1e-4, "budget_s": 1200, "eval_every_s": 60, "eval_problems": 1000,
        "modes": v3.MODES, "frozen": "2026-11-26"}


def fake_run(pass1: list[float], every_s: float = 60.0, label: str = v3.PIPELINE, seed: int = 0,
             samples_per_s: float = 20.0) -> v3.ls.Run:
    """A run evaluated every `every_s` seconds with these held-out pass@1 values."""
    evals = [{"step": i, "time_s": i * every_s, "eval/version": i, v3.PASS1: y}
             for i, y in enumerate(pass1)]
    # One optimizer step per evaluation, each evaluated snapshot that step's.
    steps = [{"step": i, "time_s": i * every_s, "samples_trained": samples_per_s * i * every_s,
              "ess": 0.99, "lag_mean": 1.5, "actor_slot_occupancy": 0.9, "trainer_wait_frac": 0.4,
              "by_length": {"1-31": {"sequences": 6, "tokens": 300, "lag_mean": 1.0, "ess": 1.0},
                            "512+": {"sequences": 2, "tokens": 1200, "lag_mean": 3.0,
                                         "ess": 0.98}}}
             for i in range(1, len(pass1))]
    record = {"label": label, "seed": seed, "started": "2026-11-26 14:00",
              "finished": "2026-11-26 14:30", "commit": "abc1234", "position": 0,
              "load_1min_at_start": 0.12}
    return v3.ls.Run(steps, evals, record)


def test_time_to_target_crosses_the_isotonic_fit_not_the_first_lucky_evaluation() -> None:
    # Raw pass@1 first touches 0.3 at 60 s by luck; the monotone fit pools 60 s and 120 s to
    # 0.275 and crosses 0.3 a fifth of the way from 120 s to 180 s.
    run = fake_run([0.2, 0.3, 0.25, 0.4])
    assert v3.fitted(run)[1].tolist() == pytest.approx([0.2, 0.275, 0.275, 0.4])
    assert v3.time_to_target(run, 0.3) == pytest.approx(120 + 60 * 0.025 / 0.125)
    assert v3.time_to_target(run, 0.41) is None
    assert v3.time_to_target(run, 0.2) == 0.0


def test_mean_gain_is_the_area_above_the_start_over_the_budget() -> None:
    # A ramp from 0.2 to 0.4 over 600 s, then held to the 1200 s budget: (0.1 * 600 + 0.2 * 600) / 1200.
    run = fake_run([0.2 + 0.02 * i for i in range(11)])
    assert v3.mean_gain(run, 1200) == pytest.approx(0.15, abs=1e-3)
    assert v3.mean_gain(run, 600) == pytest.approx(0.1, abs=1e-3)


def test_speedup_takes_the_faster_conventional_mode_and_counts_a_miss_at_the_budget() -> None:
    times = {v3.PIPELINE: {0: 200.0, 1: 300.0}, G1: {0: 600.0, 1: None}, G2: {0: 500.0, 1: 700.0}}
    result = v3.speedup(times, [G1, G2], budget_s=1200)
    # G1's mean is (600 + 1200) / 2 = 900 > G2's 600: G2 is the reference, and it reached.
    assert result.against == G2 and result.censored == 0
    assert result.ratio == pytest.approx(600 / 250)
    geo, lo, hi = result.paired
    assert geo == pytest.approx((500 / 200 * 700 / 300) ** 0.5)
    assert lo < geo < hi
    only_g1 = v3.speedup(times, [G1], budget_s=1200)
    assert only_g1.censored == 1 and only_g1.ratio == pytest.approx(900 / 250)
    missed = v3.speedup({**times, v3.PIPELINE: {0: 200.0, 1: None}}, [G1, G2], budget_s=1200)
    assert missed == "the pipeline reached the target in 1/2 seeds"
    assert v3.speedup(times, [v3.TRL], budget_s=1200) == "not run"


def test_the_time_ratio_splits_into_sample_rate_and_samples_to_target() -> None:
    # The pipeline trains 30 samples/s and reaches 0.3 at its first evaluation (60 s, 1800
    # samples); the conventional mode trains 20/s and reaches it at 120 s (2400 samples):
    # 2x sooner = 1.5x the rate x 1/0.75 of the samples.
    pipe = fake_run([0.2, 0.3, 0.4], samples_per_s=30.0)
    conv = fake_run([0.2, 0.25, 0.3, 0.35, 0.4], label=G1, samples_per_s=20.0)
    assert v3.samples_to_target(pipe, 0.3) == pytest.approx(1800)
    assert v3.samples_to_target(conv, 0.3) == pytest.approx(2400)
    assert v3.samples_to_target(conv, 0.5) is None
    runs = {v3.PIPELINE: {0: pipe}, G1: {0: conv}}
    samples = {m: {0: v3.samples_to_target(r[0], 0.3)} for m, r in runs.items()}
    assert v3.decomposition(runs, samples, G1).endswith(
        "the pipeline trained 1.50x the samples per second and needed 0.75x the samples (1800 "
        "against 2400); time ratio about 1.50 x 1.33 = 2.00x")
    assert "in no common seed" in v3.decomposition(runs, {**samples, G1: {0: None}}, G1)


def test_each_seed_rotates_which_mode_runs_first() -> None:
    orders = [v3.rotated(v3.MODES, s) for s in range(4)]
    assert orders[0] == v3.MODES and orders[1][0] == v3.MODES[1]
    for position in range(4):  # over four seeds every mode takes every place once
        assert sorted(o[position] for o in orders) == sorted(v3.MODES)
    assert v3.rotated(v3.MODES, 5) == orders[1]


def test_a_busy_machine_is_refused_with_its_load_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(v3.os, "getloadavg", lambda: (1.7, 1.0, 0.5))
    monkeypatch.setattr(v3.time, "sleep", lambda s: None)
    with pytest.raises(SystemExit, match=r"not quiet: 1-minute load 1\.70 >= 0\.3"):
        v3.wait_quiet(limit_s=0)
    loads = iter([0.9, 0.5, 0.21])
    monkeypatch.setattr(v3.os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    assert v3.wait_quiet(limit_s=60) == 0.21


def archived(tmp_path: Path, runs: list[v3.ls.Run]) -> Path:
    """Write `runs` as a run directory each, archive them, return the archive."""
    archive = tmp_path / "archive"
    for run in runs:
        run_dir = tmp_path / "made" / v3.ls.run_name(run.record["label"], run.record["seed"])
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text("name: x\n")
        rows = [*run.steps, *run.evals]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        v3.archive_run(run_dir, archive, run.record)
    return archive


def test_the_archive_round_trips_and_the_report_carries_both_headlines(tmp_path: Path) -> None:
    slow = [0.28, 0.29, 0.3, 0.32, 0.33, 0.34, 0.36, 0.37]
    fast = [0.28, 0.31, 0.34, 0.37, 0.38, 0.4, 0.41, 0.42]
    runs = [fake_run(fast, label=v3.PIPELINE, seed=0), fake_run(slow, label=G1, seed=0),
            fake_run(slow[:1] * 8, label=G2, seed=0), fake_run(slow, label=v3.TRL, seed=0)]
    archive = archived(tmp_path, runs)
    assert sorted(p.name for p in archive.iterdir())[:3] == [
        "TRL_GRPOTrainer_s0.config.yaml", "TRL_GRPOTrainer_s0.metrics.jsonl.gz",
        "TRL_GRPOTrainer_s0.run.json"]
    loaded = v3.load_archive(archive, v3.MODES)
    assert list(loaded) == v3.MODES and loaded[G1][0].evals == runs[1].evals
    text = v3.report(loaded, PLAN, archive, None)
    lines = dict((m[1], (m[2], m[3])) for m in HEADLINE.finditer(text))
    # pipeline crosses 0.35 at 140 s; G1 at 330 s; G2 never (1200 s): G1 is the reference.
    t_pipe, t_g1 = 120 + 60 * (0.35 - 0.34) / 0.03, 300 + 60 * (0.35 - 0.34) / 0.02
    ratio = f"{t_g1 / t_pipe:.1f}x"
    assert lines["best conventional, long generations, rule (a)"] == (
        ratio, " (provisional: 1 of 3 planned seeds)")
    assert lines["TRL GRPOTrainer, long generations"][0] == ratio
    assert f"- {G1}: {t_g1:.0f} s to the target vs the pipeline's {t_pipe:.0f} s" in text
    assert f"| {G2} | 1 | 0/1 reached | 0/1 reached |" in text
    assert "- where it comes from (1 seed(s) in which both reached the target)" in text
    assert "| pipeline | 512+ | 0.25 | 3.00 | 0.980 |" in text


@pytest.mark.bench
def test_quick_runs_a_seed_archives_it_and_reports(tmp_path: Path) -> None:
    """examples/long_chains.yaml shrunk, pipeline and conventional G=1, through the CLI: the
    runs land in the archive with their records, the report and plot in --out, and the
    committed results are not touched."""
    results = BENCHMARKS / "RESULTS.md"
    before = results.read_text()
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "learning_speed_v3.py"), "--quick",
                           "--out", str(tmp_path)],
                          check=False, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("pipeline_s0", "conventional_G_1_a_s0"):
        record = json.loads((tmp_path / "runs" / f"{name}.run.json").read_text())
        assert record["seed"] == 0 and "load_1min_at_start" in record
        with gzip.open(tmp_path / "runs" / f"{name}.metrics.jsonl.gz", "rt") as f:
            assert any("eval/version" in json.loads(line) for line in f)
    section = (tmp_path / "RESULTS.md").read_text()
    assert HEADLINE.search(section)
    assert (tmp_path / "learning_speed_v3.png").stat().st_size > 0
    assert results.read_text() == before


def test_runs_start_from_the_committed_weights_or_refuse() -> None:
    """The plan's runs, across sessions and machines, start from the weights it names."""
    plan_dir = v3.PlanDir(v3.V3)
    digest = v3.hashlib.sha256((plan_dir.starting_model / "model.safetensors").read_bytes()).hexdigest()
    plan = {**PLAN, "starting_model_sha256": digest}
    v3.check_starting_model(plan, plan_dir)
    with pytest.raises(SystemExit, match="the plan's runs start from 0000"):
        v3.check_starting_model({"starting_model_sha256": "0000"}, plan_dir)
    assert {f"model.path={plan_dir.starting_model}", "trainer.lr=0.0001"} <= \
        set(v3.overrides(plan, plan_dir, quick=False))
    assert not any(o.startswith("model.path") for o in v3.overrides(plan, plan_dir, quick=True))
    # A plan naming no starting weights (nor rate) runs the workload's own model (and rate).
    v3.check_starting_model(PLAN, v3.PlanDir(Path("/nonexistent")))
    bare = {k: v for k, v in PLAN.items() if k != "lr"}
    assert not any(o.startswith(("model.path", "trainer.lr"))
                   for o in v3.overrides(bare, v3.PlanDir(Path("/nonexistent")), quick=False))


def test_a_second_plan_reports_under_its_own_name_and_label(tmp_path: Path) -> None:
    """issue 23's SmolLM2 plan: pipeline against one conventional mode, no TRL; its section,
    plot and headline carry the plan's own names, and its committed plan parses."""
    plan_dir = v3.PlanDir(v3.BENCH / "learning_speed_smollm2")
    plan = v3.load_plan(plan_dir, quick=False)
    assert plan["modes"] == [v3.PIPELINE, G2] and (v3.ROOT / plan["workload"]).exists()
    assert (plan_dir.section, plan_dir.plot.name) == (
        "learning_speed_smollm2", "learning_speed_smollm2.png")
    up = [0.05, 0.1, 0.3, 0.6, 0.8, 0.9, 0.9, 0.9]
    runs = [fake_run(up, label=v3.PIPELINE, seed=0), fake_run(up[:1] + up[:-1], label=G2, seed=0)]
    loaded = v3.load_archive(archived(tmp_path, runs), plan["modes"])
    text = v3.report(loaded, plan, tmp_path / "archive", None)
    lines = dict((m[1], m[2]) for m in HEADLINE.finditer(text))
    assert list(lines) == [f"best conventional, {plan['label']}, rule (a)"]
    assert text.startswith(f"## {plan['title']}")


def test_the_archive_directory_is_not_ignored_by_git() -> None:
    """The records are committed as each run ends: an ignored directory would lose them."""
    probe = v3.PlanDir(v3.V3).archive / "pipeline_s9.run.json"
    proc = subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=BENCHMARKS.parent,
                          check=False)
    assert proc.returncode == 1, f"{probe.parent} is ignored by .gitignore"


def test_archived_configs_name_no_path_of_the_machine(tmp_path: Path) -> None:
    out = tmp_path / "made"
    config = f"output_dir: {out}\nmodel:\n  path: {v3.PlanDir(v3.V3).starting_model}\n"
    assert v3.portable(config, out) == \
        "output_dir: OUT\nmodel:\n  path: benchmarks/learning_speed_v3/starting_model\n"
