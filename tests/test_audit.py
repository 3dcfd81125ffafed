"""`pipelinerl audit` on a run directory written by the real stream writer: what it counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelinerl.config import load_config, save_config
from pipelinerl.roles.wiring import open_rollout_writer
from pipelinerl.run.audit import audit, main
from pipelinerl.types import Group, Sample


def _group(group_id: str, skipped: dict[str, int]) -> dict:
    sample = Sample(prompt_ids=[1], token_ids=[2], logprobs=[-1.0], versions=[0], reward=1.0,
                    success=True, finish_reason="stop", group_id=group_id, actor_id=0)
    stats = {"tokens_per_s": 1.0, **{f"skipped_{k}": v for k, v in skipped.items()}}
    return Group(group_id, "p", [sample], actor_id=0, actor_stats=stats).to_dict()


def test_the_audit_counts_the_groups_each_actor_dropped_by_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Review: groups an actor dropped (zero variance, failed verifier or environment) were in
    the metrics only. Each actor process counts from 0, so the audit sums every process's
    newest record: a heartbeat (an orderly stop writes one) or a group's actor_stats."""
    cfg = load_config(overrides=[f"output_dir={tmp_path}", "name=r", "run_id=x",
                                 "actor.group_size=1"])
    cfg.run_dir.mkdir(parents=True)
    save_config(cfg, cfg.run_dir / "config.yaml")
    with open_rollout_writer(cfg, 0) as w:
        w.write(_group("a0-g0", {"zero_variance": 2}))
        w.write({"heartbeat": True, "actor_id": 0, "attempt": 0, "generation": 0, "seq": 1,
                 "skipped": {"zero_variance": 3, "verifier_error": 1}})
        # The restarted process (r1) counts from 0 again; a heartbeat without counts (an
        # older actor's) changes nothing.
        w.write(_group("a0-r1-g0", {"zero_variance": 1}))
        w.write({"heartbeat": True, "actor_id": 0, "attempt": 0, "generation": 1, "seq": 2})
    (cfg.run_dir / "trained.jsonl").write_text(
        json.dumps({"step": 1, "trained": ["a0-g0", "a0-r1-g0"], "dropped": {}}) + "\n")

    tallies, _ = audit(cfg.run_dir)
    assert tallies["actor_0"].actor_dropped == {"zero_variance": 4, "verifier_error": 1}
    assert tallies["total"].published == tallies["total"].trained == 2
    assert main(str(cfg.run_dir)) == 0
    out = capsys.readouterr().out
    assert "dropped by actors" in out and "verifier_error 1, zero_variance 4" in out


def test_the_audit_names_an_unreachable_redis_and_exits_2(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import socket
    with socket.socket() as s:  # a port on 127.0.0.1 that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = load_config(overrides=[f"output_dir={tmp_path}", "name=r", "run_id=x",
                                 "stream.backend=redis", f"stream.redis_url=redis://127.0.0.1:{port}/0"])
    cfg.run_dir.mkdir(parents=True)
    save_config(cfg, cfg.run_dir / "config.yaml")
    (cfg.run_dir / "trained.jsonl").write_text("")
    assert main(str(cfg.run_dir)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pipelinerl audit: ") and f"127.0.0.1:{port}" in err
    assert "\n" not in err and "Traceback" not in err


def test_a_trainer_started_by_hand_writes_the_config_the_audit_reads(tmp_path: Path) -> None:
    from pipelinerl.roles.trainer import open_records
    cfg = load_config(overrides=[f"output_dir={tmp_path}", "name=r", "run_id=byhand"])
    open_records(cfg, None).close()
    assert load_config(cfg.run_dir / "config.yaml").run_id == "byhand"
