"""Tools through the CLI and in whole runs (docs/tools.md): `pipelinerl tools` lists and calls,
a launch with a broken server stops in one line, and a deterministic run with a tool that
answers differently every time (a clock) is replayed bit for bit from its recorded replies.

The model is a tiny random one with a ChatML template whose turns a user's parser reads as
calls whatever they say (tool_kit.parsers), so every rollout calls the tool."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_deterministic import _assert_replayed
from tool_kit.templates import family_model

from pipelinerl.config import Config, load_config
from pipelinerl.roles.launch import launch

TESTS = Path(__file__).parent
KIT = TESTS / "tool_kit"
ARITHMETIC = TESTS.parent / "examples" / "arithmetic.yaml"
ENV = {"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin"}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return family_model("chatml", tmp_path_factory.mktemp("chatml"), more_stops="aeiou.")


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The CLI in this process (its imports paid once), its exit code and output."""
    import contextlib
    import io

    from pipelinerl.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # the launcher's refusals
            code = 2
            print(e.code, file=err)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_pipelinerl_tools_lists_what_the_model_is_offered_and_calls_one(
        tmp_path: Path, chat_model: Path) -> None:
    config = tmp_path / "tools.yaml"
    config.write_text(json.dumps({
        "model": {"path": str(chat_model)},
        "tools": {"functions": ["tool_kit.functions:add"],
                  "mcp": [{"name": "fruit", "command": [sys.executable,
                                                        str(KIT / "mcp_server.py"), "stdio"]}]},
    }))
    shown = _cli("tools", str(config))
    assert shown.returncode == 0, shown.stderr
    assert "add  (function:tool_kit.functions:add)" in shown.stdout
    assert "count  (mcp:fruit)" in shown.stdout and '"by"' in shown.stdout
    assert "hermes format; tools rendered by pipelinerl's Hermes-style prompt" in shown.stdout
    assert "<tools>" in shown.stdout and "<|im_start|>assistant" in shown.stdout
    # Two tools named `lookup` (the function's and the server's): refused, naming both.
    called = _cli("tools", str(config), "tools.functions=[tool_kit.functions:lookup]")
    assert called.returncode == 2 and "two tools are named 'lookup'" in called.stderr
    assert "function:tool_kit.functions:lookup and mcp:fruit" in called.stderr
    called = _cli("tools", str(config), "--call", "count", '{"by": 3}')
    assert called.returncode == 0 and called.stdout.split("\n")[1] == "3", called.stderr
    bad = _cli("tools", str(config), "--call", "count", '{"by": "x"}')
    assert bad.returncode == 2 and "'x' is not of type 'integer'" in bad.stderr


def test_a_launch_with_a_server_that_lists_no_tools_stops_before_any_role(
        tmp_path: Path, chat_model: Path) -> None:
    proc = _cli("train", str(ARITHMETIC), f"model.path={chat_model}",
                f"output_dir={tmp_path / 'runs'}",
                f'tools.mcp=[{{name: empty, command: ["{sys.executable}", '
                f'"{KIT / "mcp_server.py"}", "empty"]}}]')
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "pipelinerl: tools.mcp server 'empty' (")
    assert "lists no tools" in proc.stderr and not (tmp_path / "runs").exists()


def _run(tmp_path: Path, chat_model: Path, name: str, *extra: str) -> Config:
    cfg = load_config(ARITHMETIC, [
        f"name={name}", f"output_dir={tmp_path / 'runs'}", f"model.path={chat_model}",
        "eval.enabled=false", "engine.capacity=8", "engine.max_seq_len=1400",
        "engine.max_new_tokens=160", "actor.group_size=4", "actor.max_lag=2",
        "actor.max_restarts=0", "trainer.batch_size=8", "trainer.max_steps=4",
        "trainer.max_time_s=0", "trainer.sample_timeout_s=120", "stream.keep_all=true",
        "metrics.progress=false", "metrics.plot=false", "metrics.samples_per_step=-1",
        "deterministic.enabled=true", "deterministic.lag_groups=0",
        "trainer.loss.entropy_coef=0.01",
        "tools.functions=[tool_kit.functions:clock]",
        "tools.format=tool_kit.parsers:every_turn_calls_clock", "tools.max_calls=2", *extra])
    assert launch(cfg) == 0
    return load_config(cfg.run_dir / "config.yaml")


@pytest.mark.slow
def test_a_run_with_a_clock_tool_replays_bit_for_bit_from_its_recorded_replies(
        tmp_path: Path, chat_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS))  # the roles import tool_kit from here
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    first = _run(tmp_path, chat_model, "first")
    replayed = _run(tmp_path, chat_model, "replayed", f"tools.replay_from={first.run_dir}")
    groups = _assert_replayed(first, replayed)
    calls = [c for g in groups for s in g["samples"] for c in s["tool_calls"] or []]
    # Two calls per rollout run (tools.max_calls=2), a third is refused.
    outcomes = {(c["name"], c["outcome"]) for c in calls}
    assert ("clock", "ok") in outcomes
    assert outcomes <= {("clock", "ok"), ("clock", "tool_over_limit")}
    times = {c["reply"] for c in calls if c["outcome"] == "ok"}
    assert len(times) > 1  # the clock moved: a rerun that called it would differ
    log = [json.loads(line) for line in
           (replayed.run_dir / "tool_replies" / "actor0.jsonl").read_text().splitlines()]
    # Every call the replayed run made was taken from the recording (groups made past the
    # last step are in the log, not in the stream).
    assert all(r["replayed"] for r in log)
    assert {c["key"] for c in calls if c["outcome"] == "ok"} <= {r["key"] for r in log}
    for g in groups:  # the replies are fed, never trained
        for s in g["samples"]:
            assert not all(s["model_mask"]) and s["turns"] >= 2
    last = json.loads((replayed.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["actor_tool_replay_misses"] == 0 and last["actor_tool_replayed"] > 0
