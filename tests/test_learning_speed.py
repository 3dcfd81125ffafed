"""The learning-speed benchmark: its statistics and report on synthetic runs (fast), and the
`--quick` smokes of learning_speed.py and trl_grpo.py end to end (slow, not timed)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import learning_speed as ls  # noqa: E402

HEADLINE = re.compile(r"^Learning speed-up \(pipeline vs (.+?)\): (\d+\.\dx|not measured)", re.M)
RULE_A = "best conventional, rule (a): one core per role"
RULE_B = "best conventional, rule (b): the whole machine per phase"
SCALING = {"engine": {"1": 100.0, "2": 180.0}, "trainer": {"1": 120.0, "2": 200.0}}


def fake_run(reach_at: float | None, samples_per_s: float = 100.0) -> ls.Run:
    """Held-out pass@1 0.3, then 0.6 from `reach_at` seconds on (never when None)."""
    times = [0.0, 10.0, 600.0]
    steps = [{"step": i, "time_s": t, "samples_trained": samples_per_s * t, "ess": 0.99,
              "lag_mean": 1.0, "actor_mean_update_pause_s": 0.001} for i, t in enumerate(times[1:], 1)]
    eval_times = sorted({*range(0, 601, 30), *([reach_at] if reach_at is not None else [])})
    evals = [{"step": v, "time_s": float(t), "eval/version": v,
              ls.PASS1: 0.6 if reach_at is not None and t >= reach_at else 0.3}
             for v, t in enumerate(eval_times)]
    return ls.Run(steps, evals)


def plan(target: float = 0.5) -> dict:
    return {"target": target, "budget_s": 600.0, "seeds": 3, "eval_every_s": 30.0,
            "eval_problems": 300, "command": "python benchmarks/learning_speed.py --target 0.5",
            "started": "2026-11-24 10:00", "scaling": SCALING}


def test_time_to_target_is_when_the_first_version_at_or_above_it_was_made(tmp_path: Path) -> None:
    records = [
        {"step": 1, "time_s": 5.0, "samples_trained": 64},
        {"step": 2, "time_s": 40.0, "eval/version": 2, ls.PASS1: 0.55},  # logged out of order
        {"step": 0, "time_s": 0.0, "eval/version": 0, ls.PASS1: 0.3},
        {"step": 1, "time_s": 5.0, "eval/version": 1, ls.PASS1: 0.52},
        {"step": 2, "time_s": 40.0, "samples_trained": 128},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = ls.Run.load(tmp_path)
    assert [r["eval/version"] for r in run.evals] == [0, 1, 2]
    assert len(run.steps) == 2
    assert run.time_to(0.5) == 5.0 and run.time_to(0.55) == 40.0 and run.time_to(0.6) is None
    assert run.samples_per_s() == pytest.approx(128 / 40)


def test_t_interval_uses_students_t_and_never_narrows_between_table_entries() -> None:
    # 70 +- t(0.975, 2) x sd / sqrt(3), sd = 17.32, t = 4.303
    assert ls.t_interval([60.0, 90.0, 60.0]) == pytest.approx((70.0, 26.97, 113.03), abs=0.01)
    assert ls.t975(35) == ls.T975[30] and ls.t975(1000) == ls.T975[120]


def test_ratio_interval_brackets_the_ratio_and_widens_with_spread() -> None:
    tight = ls.ratio_interval([150.0, 151.0, 149.0], [70.0, 71.0, 69.0])
    loose = ls.ratio_interval([100.0, 150.0, 200.0], [50.0, 70.0, 90.0])
    assert tight[0] < 150 / 70 < tight[1]
    assert loose[0] < tight[0] and loose[1] > tight[1]
    assert all(map(lambda x: x != x, ls.ratio_interval([1.0], [2.0])))  # NaN with one seed


def test_report_has_headlines_in_order_intervals_bound_and_lower_bounds() -> None:
    results = {
        ls.PIPELINE: [fake_run(t, 200.0) for t in (60, 90, 60)],
        ls.RECOMPUTE: [fake_run(t, 190.0) for t in (90, 90, 120)],
        "conventional G=2 (a)": [fake_run(t) for t in (120, 150, 180)],
        "conventional G=4 (a)": [fake_run(t) for t in (None, 300, 330)],
        "conventional G=2 (b)": [fake_run(t, 110.0) for t in (None, None, 390)],
        ls.TRL: [fake_run(t, 20.0) for t in (None, None, None)],
    }
    text = ls.report(results, plan(), (0.5, 0.5, 0.5))
    heads = HEADLINE.findall(text)
    assert [h[0] for h in heads] == [RULE_A, RULE_B, ls.TRL]
    # Rule (a): G=2 (a) is the fastest, 150 s / 70 s; every seed reached: an interval.
    assert heads[0][1] == "2.1x"
    assert "- conventional G=2 (a): 150 s to the target vs the pipeline's 70 s; 95% interval" in text
    # Rule (b): the only mode missed the target twice, counted at the budget: a lower bound.
    assert f"{RULE_B}): 7.6x (a lower bound)" in text
    assert "conventional G=2 (b) reached the target in 1/3 seeds" in text
    assert f"{ls.TRL}): 8.6x (a lower bound)" in text
    assert "| conventional G=4 (a) | 3 | > 600 (2/3 reached) |" in text
    assert "| time to target (s) [95% CI] | smoothed crossing (s) [95% CI] | final held-out " \
           "pass@1 [95% CI] |" in text
    assert re.search(r"\| pipeline \| 3 \| 70 \[\d+, \d+\] \|", text)
    # Bounds from the role rates: (a) 100 x (1/100 + 1/120), (b) 100 x (1/180 + 1/200).
    assert "- rule (a), one core per role: bound 1.83x; measured pipeline / fastest " \
           "conventional (conventional G=2 (a), 100.0 samples/s) = 2.00x" in text
    assert "- rule (b), the whole machine per phase: bound 1.06x" in text
    assert "### KV cache kept vs recomputed on weight updates" in text
    assert "| pipeline recompute-KV | 1.00 [1.00, 1.00] | 0.990 [0.990, 0.990] | 100 [" in text


def test_paired_ratio_cancels_a_seed_blocks_machine_speed() -> None:
    # Seed 1 ran on a machine 2x slower for every mode: the ratio is 2 in each seed, so the
    # paired interval is a point while the ratio of means has a wide one.
    conv, pipe = {0: 100.0, 1: 200.0, 2: 150.0}, {0: 50.0, 1: 100.0, 2: 75.0}
    assert ls.paired_ratio(conv, pipe) == pytest.approx((2.0, 2.0, 2.0))
    lo, hi = ls.ratio_interval(list(conv.values()), list(pipe.values()))
    assert lo < 1.5 and hi > 2.5
    # log ratios ln 2, ln 4: geometric mean 2.83, t(1) = 12.706 x sd / sqrt 2 on the logs.
    ratio, lo, hi = ls.paired_ratio({0: 100.0, 1: 400.0, 5: 9.0}, {0: 50.0, 1: 100.0})
    half = 12.706 * math.log(2) / math.sqrt(2) / math.sqrt(2)
    assert (ratio, lo, hi) == pytest.approx((2 ** 1.5, 2 ** 1.5 * math.exp(-half),
                                             2 ** 1.5 * math.exp(half)))
    assert all(math.isnan(x) for x in ls.paired_ratio({0: 1.0}, {0: 2.0})[1:])


def test_report_pairs_by_the_seed_a_run_records() -> None:
    def seeded(seed: int, reach_at: float | None, sps: float = 100.0) -> ls.Run:
        run = fake_run(reach_at, sps)
        run.record = {"seed": seed, "started": "2026-11-24 10:00", "finished": "2026-11-24 10:11"}
        return run

    # Pipeline seed 1 is missing (a run not made yet): pairs are seeds 0 and 2 only.
    results = {ls.PIPELINE: [seeded(0, 60, 200.0), seeded(2, 90, 150.0)],
               "conventional G=2 (a)": [seeded(0, 120), seeded(1, 600), seeded(2, 180)]}
    text = ls.report(results, plan(), None)
    assert "paired by seed (geometric mean of each seed's ratio): 2.0x, 95% interval 2.0x-2.0x" in text
    assert "| pipeline | 60 / 200 | - | 90 / 150 |" in text
    assert "| conventional G=2 (a) | 120 / 100 | 600 / 100 | 180 / 100 |" in text
    assert "- load average: not this command's" in text


def test_smoothed_crossing_takes_the_centred_mean_of_three_evaluations() -> None:
    def evals(ys: list[float]) -> ls.Run:
        return ls.Run([], [{"time_s": 30.0 * i, "eval/version": i, ls.PASS1: y}
                           for i, y in enumerate(ys)])

    # One lucky evaluation at 60 s: the first crossing of 0.55 is 60 s. Centred means at
    # 30/60/90/120 s: 0.433, 0.533, 0.567, 0.6: 0.55 is crossed halfway from 60 s to 90 s.
    run = evals([0.2, 0.5, 0.6, 0.5, 0.6, 0.7])
    assert run.time_to(0.55) == 60.0
    assert run.time_to_smoothed(0.55) == pytest.approx(75.0)
    assert run.time_to_smoothed(0.4) == 30.0  # the first centred mean already reaches it
    assert run.time_to_smoothed(0.65) is None  # the last mean is 0.6
    assert evals([0.9, 0.9]).time_to_smoothed(0.5) is None  # fewer than 3 evaluations


def test_worth_compares_held_out_accuracy_at_equal_steps_and_equal_wall_clock() -> None:
    def curve(points: list[tuple[float, int, float]]) -> ls.Run:  # (time_s, version, pass@1)
        return ls.Run([], [{"time_s": t, "eval/version": v, ls.PASS1: p} for t, v, p in points])

    fast = curve([(0.0, 0, 0.2), (60.0, 200, 0.44), (120.0, 400, 0.6), (600.0, 2000, 0.7)])
    slow = curve([(0.0, 0, 0.2), (120.0, 200, 0.6), (600.0, 1000, 0.68)])
    # 150 steps: 0.2 + 0.24 x 150/200 = 0.38 (fast), 0.2 + 0.4 x 150/200 = 0.5 (slow).
    assert fast.pass1_at("eval/version", 150) == pytest.approx(0.38)
    assert slow.pass1_at("eval/version", 150) == pytest.approx(0.5)
    assert fast.pass1_at("time_s", 300) == pytest.approx(0.6 + 0.1 * 180 / 480)
    assert slow.pass1_at("eval/version", 1001) is None  # past its last evaluation
    text = "\n".join(ls.worth_section({"fast": [fast], "slow": [slow]}))
    assert "| mode | 150 steps | 300 steps | 600 steps | 120 s | 300 s | 600 s |" in text
    assert "| fast | 0.38 | 0.52 | 0.61 | 0.60 | 0.64 | 0.70 |" in text
    assert "| slow | 0.50 | 0.61 | 0.64 | 0.60 | 0.63 | 0.68 |" in text
    # A mean over seeds only where every seed got that far.
    assert ls.worth_cell([fast, slow], "eval/version", 1500) == "-"
    assert ls.worth_cell([fast, slow], "eval/version", 150) == "0.44"


def test_archive_rebuilds_the_same_report_and_keeps_only_what_it_reads(tmp_path: Path) -> None:
    results = {ls.PIPELINE: [fake_run(t, 200.0) for t in (60, 90)],
               "conventional G=2 (a)": [fake_run(t) for t in (120, None)]}
    for runs in results.values():
        for r in runs:
            r.steps[0]["loss"] = 1.0  # a key the report never reads
            r.record = {"seed": 0, "started": "2026-11-24 10:00", "finished": "2026-11-24 10:11"}
    path = tmp_path / "runs.json.gz"
    ls.save_archive(path, plan(), results)
    archived_plan, archived = ls.load_archive(path)
    assert archived_plan == plan()
    assert ls.report(archived, archived_plan, None) == ls.report(results, plan(), None)
    assert all(set(s) <= set(ls.STEP_KEYS) for runs in archived.values() for r in runs
               for s in r.steps)
    with pytest.raises(SystemExit, match="not found"):
        ls.load_archive(tmp_path / "missing.json.gz")


def test_report_shows_the_runs_directory_as_out(tmp_path: Path) -> None:
    out = str(tmp_path / "ls")  # a runs' directory outside the checkout
    assert ls.masked_command(f"python b/learning_speed.py --target 0.5 --out {out} --trl") == \
        "python b/learning_speed.py --target 0.5 --out OUT --trl"
    assert ls.masked_command(f"python b/learning_speed.py --out={out}") == \
        "python b/learning_speed.py --out=OUT"
    text = ls.report({ls.PIPELINE: [fake_run(60)]},
                     {**plan(), "command": f"python learning_speed.py --target 0.5 --out {out}"}, None)
    assert "`python learning_speed.py --target 0.5 --out OUT` (OUT: the runs' directory)" in text
    assert out not in text


def test_speedup_is_not_measured_when_the_pipeline_misses_or_nothing_compares() -> None:
    assert ls.speedup([60.0, None], {"x": [90.0, 90.0]}, 600.0) == \
        "the pipeline reached the target in 1/2 seeds"
    assert ls.speedup([60.0], {}, 600.0) == "no such mode was run"
    assert ls.speedup([0.0], {"x": [0.0]}, 600.0) == \
        "the starting model (version 0) already meets the target"


def test_target_is_required_before_the_runs(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(sys, "argv", ["learning_speed.py"])
    with pytest.raises(SystemExit):
        ls.parse_args()
    assert "--target is required" in capsys.readouterr().err


def test_report_only_keeps_the_target_chosen_before_the_runs(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "plan.json").write_text(json.dumps(plan(0.5)))
    monkeypatch.setattr(sys, "argv", ["learning_speed.py", "--report-only", "--out", str(tmp_path),
                                      "--target", "0.4"])
    with pytest.raises(SystemExit, match="chosen before them"):
        ls.read_plan(ls.parse_args())


def test_resume_keeps_finished_runs_and_refuses_changed_settings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def args(*extra: str):
        monkeypatch.setattr(sys, "argv", ["learning_speed.py", "--target", "0.5", "--out",
                                          str(tmp_path), "--resume", *extra])
        return ls.parse_args()

    with pytest.raises(SystemExit, match="no plan.json"):
        ls.new_plan(args(), [ls.PIPELINE], [])
    (tmp_path / "plan.json").write_text(json.dumps({**plan(0.5), "quick": False, "overrides": [],
                                                    "modes": [ls.PIPELINE]}))
    with pytest.raises(SystemExit, match=r"budget_s differ .*budget_s=600\.0"):
        ls.new_plan(args("--budget-s", "300"), [ls.PIPELINE], [])
    kept = ls.new_plan(args(), [ls.PIPELINE, ls.RECOMPUTE], [])
    assert kept["scaling"] == SCALING and kept["modes"] == [ls.PIPELINE, ls.RECOMPUTE]
    # A finished run (bench.json written) is loaded, never run again: no subprocess here.
    run_dir = tmp_path / ls.run_name(ls.PIPELINE, 1)
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps(
        {"step": 0, "time_s": 0.0, "eval/version": 0, ls.PASS1: 0.3}) + "\n")
    (run_dir / ls.RUN_RECORD).write_text(json.dumps(
        {"label": ls.PIPELINE, "seed": 1, "started": "2026-11-23 09:00", "finished": "2026-11-23 09:11"}))
    monkeypatch.setattr(ls.subprocess, "run", lambda *a, **k: pytest.fail("ran again"))
    again = ls.run(ls.PIPELINE, 1, tmp_path, [])
    assert again.record["finished"] == "2026-11-23 09:11"
    assert ls.run_span({"p": [again]}) == \
        "1 runs made 2026-11-23 09:00 to 2026-11-23 09:11 (1 day(s)), code at unknown"
    # A run without bench.json (a crash, or stopped midway) is not a finished run.
    (run_dir / ls.RUN_RECORD).unlink()
    assert ls.load_results(tmp_path, [ls.PIPELINE], 3) == {}


@pytest.mark.bench
def test_quick_mode_runs_pipeline_and_conventional(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(BENCHMARKS / "learning_speed.py"), "--quick",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "| pipeline | 1 |" in text and "| conventional G=2 (a) | 1 |" in text
    assert [h[0] for h in HEADLINE.findall(text)] == [RULE_A, RULE_B]
    assert "[95% CI]" in text and "### KV cache kept vs recomputed" in text
    assert re.search(r"\| engine decode \| \d+\.\d \|", text)
    assert json.loads((tmp_path / "plan.json").read_text())["target"] == ls.QUICK_TARGET
    for label in (ls.PIPELINE, "conventional G=2 (a)"):
        run = ls.Run.load(tmp_path / ls.run_name(label, 0))
        assert run.evals[0]["eval/version"] == 0 and run.evals[-1]["eval/version"] > 0
        assert run.evals[-1]["eval/num_problems"] == 16
    assert (tmp_path / "learning_speed.png").stat().st_size > 0


@pytest.mark.bench
@pytest.mark.skipif(importlib.util.find_spec("trl") is None,
                    reason="trl is not installed (the optional bench extra: pip install -e .[bench])")
def test_trl_quick_trains_and_evaluates_with_the_clock_paused(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(BENCHMARKS / "trl_grpo.py"), "--quick", "--threads=1",
                          f"output_dir={tmp_path}", "metrics.progress=false"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    run = ls.Run.load(tmp_path / "trl_grpo")
    assert run.steps and run.steps[-1]["samples_trained"] == 16 * run.steps[-1]["step"]
    versions = [r["eval/version"] for r in run.evals]
    assert versions[0] == 0 and versions[-1] == run.steps[-1]["step"] and len(versions) >= 3
    # Evaluation pauses the training clock: the budget holds on it, not on the wall-clock.
    assert all(r["time_s"] < r["wall_s"] for r in run.evals[1:])
    assert run.steps[-1]["time_s"] < 15 + 10
    assert run.evals[-1]["eval/num_problems"] == 16
