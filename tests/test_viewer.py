"""The viewer's reading of a run directory, its filters, its server and `pipelinerl view`
(without a browser: tests/test_viewer_browser.py loads the page of a real run in Chromium)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from aiohttp.test_utils import TestClient, TestServer

from pipelinerl.viewer.export import export_html
from pipelinerl.viewer.panel import PanelCache
from pipelinerl.viewer.query import (
    EvalQuery,
    Filters,
    QueryError,
    compare_eval,
    select_groups,
)
from pipelinerl.viewer.run_data import RunView, ViewerError
from pipelinerl.viewer.server import make_app


def group_row(step: int, n: int = 3, problem: str = "1+1=", dropped: str | None = None,
              completion: str = "A=2") -> dict[str, Any]:
    """A samples.jsonl line in the layout docs/viewing.md gives; sample j has reward j/(n-1),
    length 3 + j, finish 'length' for the last one."""
    samples = []
    for j in range(n):
        length = 3 + j
        samples.append({
            "completion": completion, "reward": j / (n - 1), "success": j == n - 1,
            "advantage": None if dropped else j - 1.0,
            "finish_reason": "length" if j == n - 1 else "stop", "length": length,
            "turns": 1, "episode": None, "actor_id": 0,
            "tokens": {"text": ["x"] * length, "version": [step - 1] * length,
                       "lag": [j] * length, "engine_logprob": [-0.5] * length,
                       "trainer_logprob": [None if dropped else -0.4] * length,
                       "importance_weight": [None if dropped else 1.105] * length,
                       "mask": [0 if dropped else 1] * length}})
    row = {"step": step, "version": step - 1, "group_id": f"a0-g{step}", "problem": problem,
           "prompt": problem, "samples": samples}
    if dropped:
        row["dropped"] = dropped
    return row


def eval_row(version: int, pid: str, success: bool, mode: str = "greedy") -> dict[str, Any]:
    return {"version": version, "attempt": 0, "mode": mode, "problem_id": pid, "problem": pid,
            "prompt": pid, "attempts": [{"completion": "A=?", "reward": float(success),
                                         "success": success, "finish_reason": "stop",
                                         "length": 4}], "failure": None}


def write_rows(path: Path, rows: list[dict[str, Any]], mode: str = "w") -> None:
    with path.open(mode) as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "runs" / "demo"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("name: demo\n")
    write_rows(d / "samples.jsonl", [group_row(s) for s in (1, 2, 3)])
    write_rows(d / "eval_samples.jsonl",
               [eval_row(0, "p1", False), eval_row(0, "p2", False),
                eval_row(3, "p1", True), eval_row(3, "p2", False),
                eval_row(3, "p1", True, "sampled")])
    write_rows(d / "metrics.jsonl", [{"step": s, "time_s": 1.0 * s, "success": 0.1 * s}
                                     for s in (1, 2, 3)])
    return d


# ---- reading the files as they grow ----------------------------------------------------------

def test_appended_lines_are_read_and_a_partial_last_line_waits_for_its_newline(run_dir):
    view = RunView(run_dir)
    assert [g["step"] for g in view.groups()] == [1, 2, 3]
    before = view.fingerprint
    line = json.dumps(group_row(4))
    with (run_dir / "samples.jsonl").open("a") as f:
        f.write(line[:40])  # the trainer is mid-write, or a crash cut it
    view.refresh()
    assert [g["step"] for g in view.groups()] == [1, 2, 3]
    assert any("ends in an incomplete line" in n for n in view.notes())
    with (run_dir / "samples.jsonl").open("a") as f:
        f.write(line[40:] + "\n")
    view.refresh()
    assert [g["step"] for g in view.groups()] == [1, 2, 3, 4]
    assert view.notes() == [] and view.fingerprint != before


def test_a_rolled_file_and_a_cut_back_file_are_read_again_without_repeats(run_dir):
    view = RunView(run_dir)
    samples = run_dir / "samples.jsonl"
    samples.replace(run_dir / "samples.1.jsonl")  # SampleRecord's roll
    write_rows(samples, [group_row(4)])
    view.refresh()
    assert [g["step"] for g in view.groups()] == [1, 2, 3, 4]
    write_rows(samples, [])  # a resume cut it back (a new file, shorter)
    view.refresh()
    assert [g["step"] for g in view.groups()] == [1, 2, 3]


def test_lines_of_another_layout_are_skipped_and_named(run_dir):
    old = group_row(5)
    del old["samples"][0]["tokens"]  # as a line of a version without per-token records
    write_rows(run_dir / "samples.jsonl", [old, group_row(6)], mode="a")
    with (run_dir / "samples.jsonl").open("a") as f:
        f.write("{not json\n")
    view = RunView(run_dir)
    assert [g["step"] for g in view.groups()] == [1, 2, 3, 6]
    notes = view.notes()
    assert any("line 4" in n and "samples.0.tokens" in n and "another version" in n
               for n in notes), notes
    assert any("line 6 is not JSON" in n for n in notes), notes


def test_a_directory_that_is_no_run_is_named_with_the_runs_it_holds(run_dir):
    with pytest.raises(ViewerError, match="no such directory"):
        RunView(run_dir / "missing")
    with pytest.raises(ViewerError, match=re.escape(str(run_dir))) as err:
        RunView(run_dir.parent)  # output_dir, not output_dir/name
    assert "not a pipelinerl run directory" in str(err.value)


def test_a_run_without_samples_shows_its_panel_and_says_why(tmp_path):
    d = tmp_path / "old"
    d.mkdir()
    write_rows(d / "metrics.jsonl", [{"step": 1, "time_s": 1.0}])
    view = RunView(d)
    assert view.groups() == [] and view.summary()["metrics_rows"] == 1
    assert "no samples.jsonl" in view.notes()[0]


def test_summary_offers_what_the_records_hold(run_dir):
    write_rows(run_dir / "samples.jsonl", [group_row(4, dropped="stale")], mode="a")
    s = RunView(run_dir).summary()
    assert s["name"] == "demo" and s["groups"] == 4 and s["steps"] == [1, 2, 3, 4]
    assert s["finish_reasons"] == ["length", "stop"] and s["dropped_reasons"] == ["stale"]
    assert s["max_lag"] == 2 and s["eval_versions"] == [0, 3]
    assert s["eval_modes"] == ["greedy", "sampled"] and s["metrics_rows"] == 3


# ---- filters ---------------------------------------------------------------------------------

def test_filters_pick_samples_and_show_their_groups_newest_first():
    groups = [group_row(1), group_row(2, problem="7*6="), group_row(3, dropped="stale")]
    page = select_groups(groups, Filters())
    assert [g["step"] for g in page["groups"]] == [3, 2, 1] and page["matching_samples"] == 9
    page = select_groups(groups, Filters.from_query({"reward_min": "0.9"}))
    assert page["total"] == 3 and all(g["match"] == [False, False, True] for g in page["groups"])
    page = select_groups(groups, Filters.from_query({"length_max": "3", "finish": "stop"}))
    assert page["matching_samples"] == 3 and all(g["match"][0] for g in page["groups"])
    assert select_groups(groups, Filters(finish=("length",), reward_max=0.4))["total"] == 0
    assert [g["step"] for g in select_groups(groups, Filters(problem="7*"))["groups"]] == [2]
    assert [g["step"] for g in select_groups(groups, Filters(kind="dropped"))["groups"]] == [3]
    assert [g["step"] for g in select_groups(groups, Filters(kind="trained"))["groups"]] == [2, 1]
    assert [g["step"] for g in select_groups(groups, Filters(step_min=2, step_max=2))["groups"]] \
        == [2]
    assert [g["step"] for g in select_groups(groups, Filters(version_max=0))["groups"]] == [1]
    page = select_groups(groups, Filters(offset=1, limit=1))
    assert page["total"] == 3 and [g["step"] for g in page["groups"]] == [2]


def test_a_bad_filter_names_the_parameter():
    with pytest.raises(QueryError, match="reward_min"):
        Filters.from_query({"reward_min": "high"})
    with pytest.raises(QueryError, match="colour"):
        Filters.from_query({"colour": "lag"})
    assert Filters.from_query({"finish": "stop,length", "step_min": ""}).query() == \
        {"finish": "stop,length"}


def test_held_out_pairs_two_versions_by_problem(run_dir):
    rows = RunView(run_dir).eval_rows()
    e = compare_eval(rows, EvalQuery())
    assert (e["a"], e["b"], e["mode"]) == (0, 3, "greedy")
    assert e["accuracy"] == {"a": 0.0, "b": 0.5}
    assert [(p["problem_id"], p["a"]["attempts"][0]["success"], p["b"]["attempts"][0]["success"])
            for p in e["problems"]] == [("p1", False, True), ("p2", False, False)]
    e = compare_eval(rows, EvalQuery(a=3, b=3, mode="sampled"))
    assert [p["problem_id"] for p in e["problems"]] == ["p1"]
    with pytest.raises(QueryError, match="version 2 was not evaluated"):
        compare_eval(rows, EvalQuery(a=2))
    assert compare_eval([], EvalQuery())["problems"] == []


# ---- the server ------------------------------------------------------------------------------

def _get(run_dir: Path, *paths: str) -> list[tuple[int, str, bytes]]:
    async def go() -> list[tuple[int, str, bytes]]:
        async with TestClient(TestServer(make_app(RunView(run_dir), poll_s=1.5))) as client:
            out = []
            for path in paths:
                resp = await client.get(path)
                out.append((resp.status, resp.content_type, await resp.read()))
            return out
    return asyncio.run(go())


def test_the_server_answers_the_page_its_data_and_clear_errors(run_dir):
    page, groups, bad, evals, panel = _get(
        run_dir, "/", "/api/groups?reward_max=0&limit=2", "/api/groups?step_min=x",
        "/api/eval?a=3&b=0", "/api/panel.png")
    assert page[0] == 200 and b"const POLL_S = 1.5;" in page[2]
    assert groups[0] == 200
    body = json.loads(groups[2])
    assert body["total"] == 3 and len(body["groups"]) == 2
    assert bad[0] == 400 and "step_min" in json.loads(bad[2])["error"]
    assert json.loads(evals[2])["accuracy"] == {"a": 0.5, "b": 0.0}
    assert panel[0] == 200 and panel[1] == "image/png" and panel[2][:4] == b"\x89PNG"


def _ask(run_dir: Path, *requests: tuple[str, dict[str, str]], **app: Any
         ) -> list[tuple[int, str, str]]:
    """Each (path, headers) asked in turn of one client (its cookies kept) of
    `make_app(..., **app)`, `{port}` in a header filled in: (status, Set-Cookie, body) each."""
    async def go() -> list[tuple[int, str, str]]:
        async with TestClient(TestServer(make_app(RunView(run_dir), **app))) as client:
            out = []
            for path, headers in requests:
                headers = {k: v.format(port=client.server.port) for k, v in headers.items()}
                resp = await client.get(path, headers=headers)
                out.append((resp.status, resp.headers.get("Set-Cookie", ""), await resp.text()))
            return out
    return asyncio.run(go())


def test_the_server_answers_only_a_host_and_origin_of_its_own(run_dir):
    answers = _ask(run_dir, *[("/api/summary", h) for h in (
        {"Host": "127.0.0.1:{port}"}, {"Host": "localhost"}, {"Host": "[::1]:{port}"},
        {"Host": "LocalHost:{port}", "Origin": "http://LocalHost:{port}"},
        {"Host": "localhost:9000", "Origin": "http://localhost:9000"},  # an ssh tunnel's port
        {"Host": "attacker.example"}, {"Host": "attacker.example:{port}"},
        {"Host": "[::1]junk"},
        {"Host": "127.0.0.1:{port}", "Origin": "http://attacker.example"},
        {"Host": "127.0.0.1:{port}", "Origin": "null"})])
    assert [status for status, _, _ in answers] == [200] * 5 + [403] * 5
    for _, _, body in answers[5:]:  # a reason the page shows, in one line
        assert "\n" not in json.loads(body)["error"]
    assert "attacker.example" in json.loads(answers[5][2])["error"]
    (page, _, text), = _ask(run_dir, ("/", {"Host": "attacker.example"}))
    assert page == 403 and text.count("\n") == 1 and "Host" in text


def test_served_beyond_loopback_every_request_needs_the_token(run_dir):
    app = {"host": "0.0.0.0", "token": "s3cret"}
    no, wrong, page, summary, export, groups = _ask(
        run_dir, ("/", {}), ("/?token=nope", {}), ("/?token=s3cret", {}),
        ("/api/summary", {}), ("/export.html?kind=trained", {}),
        ("/api/groups?token=s3cret&reward_max=0", {}), **app)  # the token is no filter
    assert no[0] == wrong[0] == 401 and "token" in no[2] and "s3cret" not in no[2]
    # The first visit sets the cookie the page's own requests then carry.
    assert page[0] == 200 and "s3cret" in page[1] and "HttpOnly" in page[1]
    assert summary[0] == 200 and json.loads(summary[2])["name"] == "demo"
    assert export[0] == 200 and groups[0] == 200 and json.loads(groups[2])["total"] == 3
    bearer, other_host, own_host = _ask(
        run_dir, ("/api/summary", {"Authorization": "Bearer s3cret"}),
        ("/api/summary", {"Authorization": "Bearer s3cret", "Host": "attacker.example"}),
        ("/api/summary", {"Authorization": "Bearer s3cret", "Host": "0.0.0.0:{port}"}), **app)
    assert bearer[0] == 200 and other_host[0] == 403 and own_host[0] == 200
    (plain, _, _), = _ask(run_dir, ("/", {}))
    assert plain == 200  # loopback: no token unless one is given


def test_an_export_holds_its_view_and_no_completion_can_break_out_of_it(run_dir):
    write_rows(run_dir / "samples.jsonl",
               [group_row(4, completion="</script><script>alert(1)</script>")], mode="a")
    view = RunView(run_dir)
    html = export_html(view, Filters(step_min=3), EvalQuery(), PanelCache())
    assert html.count("</script>") == 2  # the data's and the page's own script elements
    data = re.search(r'<script id="pipelinerl-data" type="application/json">(.*?)</script>',
                     html, re.S).group(1)
    embedded = json.loads(data)
    assert [g["step"] for g in embedded["groups"]["groups"]] == [4, 3]
    assert embedded["filters"] == {"step_min": "3"}
    assert embedded["panel"].startswith("data:image/png;base64,")
    assert "const POLL_S = 0;" in html and "http" not in data


def test_an_export_holds_no_absolute_path_of_the_run_directory(run_dir):
    html = export_html(RunView(run_dir), Filters(), EvalQuery(), PanelCache())
    (status, _, served), = _ask(run_dir, ("/export.html", {}))
    assert status == 200
    for text in (html, served):
        assert str(run_dir.parent) not in text and str(run_dir.resolve().parent) not in text
    summary = json.loads(re.search(r'<script id="pipelinerl-data" type="application/json">'
                                   r'(.*?)</script>', html, re.S).group(1))["summary"]
    assert summary["run_dir"] == "demo"  # its name only: where it lies here is no reader's


# ---- the command -----------------------------------------------------------------------------

def _view(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelinerl.cli", "view", *args],
                          capture_output=True, text=True, timeout=120)


def test_view_names_a_directory_it_cannot_show_without_a_traceback(run_dir):
    out = _view(str(run_dir.parent))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "is not a pipelinerl run directory" in out.stderr and str(run_dir) in out.stderr
    out = _view(str(run_dir), "--export", str(run_dir / "v.html"), "--filter", "reward_min=x")
    assert out.returncode == 2 and "reward_min" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0.01", "1e9", "x"])
def test_a_poll_interval_the_page_cannot_use_is_refused_as_it_is_parsed(run_dir, tmp_path,
                                                                        value, capsys):
    from pipelinerl.cli import main

    with pytest.raises(SystemExit) as exit_:  # --export: a value let through ends, not serves
        main(["view", str(run_dir), "--poll-s", value, "--export", str(tmp_path / "v.html")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("pipelinerl view: --poll-s ") and value in err


def test_view_beyond_loopback_prints_its_token_once_and_asks_for_it(run_dir, monkeypatch):
    import urllib.error
    import urllib.request

    monkeypatch.setenv("PIPELINERL_VIEW_TOKEN", "")  # none given: a fresh one
    proc = subprocess.Popen([sys.executable, "-m", "pipelinerl.cli", "view", str(run_dir),
                             "--host", "0.0.0.0", "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        found = re.search(r"at http://0\.0\.0\.0:(\d+)/\?token=([\w-]{20,}) ", line)
        assert found, line
        url = f"http://127.0.0.1:{found.group(1)}/"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url + "api/summary", timeout=30)
        assert refused.value.code == 401
        with urllib.request.urlopen(f"{url}api/summary?token={found.group(2)}",
                                    timeout=30) as resp:
            assert json.loads(resp.read())["name"] == "demo"
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert found.group(2) not in out + err and "token" in err  # printed once: the URL
    monkeypatch.setenv("PIPELINERL_VIEW_TOKEN", "from-env")
    proc = subprocess.Popen([sys.executable, "-m", "pipelinerl.cli", "view", str(run_dir),
                             "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        assert "/?token=from-env " in proc.stdout.readline()  # given: asked for on loopback too
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_view_exports_a_view_and_serves_on_loopback_by_default(run_dir, tmp_path):
    out = _view(str(run_dir), "--export", str(tmp_path / "v.html"), "--filter", "kind=trained",
                "--filter", "a=3")
    assert out.returncode == 0, out.stderr
    assert '"a": 3' in (tmp_path / "v.html").read_text()
    proc = subprocess.Popen([sys.executable, "-m", "pipelinerl.cli", "view", str(run_dir),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        assert re.search(r"demo at http://127\.0\.0\.1:\d+/", line), line
        listening = [c.laddr for c in psutil.Process(proc.pid).net_connections("inet")
                     if c.status == psutil.CONN_LISTEN]
        assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    with socket.socket() as held:  # a port taken: said, with the way out
        held.bind(("127.0.0.1", 0))
        held.listen()
        out = _view(str(run_dir), "--port", str(held.getsockname()[1]))
    assert out.returncode == 2 and "--port 0" in out.stderr and "Traceback" not in out.stderr


# ---- tool calls ------------------------------------------------------------------------------

class _CharTokenizer:
    """Token id i is chr(i): a completion's text is its ids."""

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))

    def batch_decode(self, batch: list[list[int]]) -> list[str]:
        return [self.decode(ids) for ids in batch]


HOSTILE = "<img src=x onerror=alert(1)>\x00\x1b[31m</pre><script>alert(2)</script>"


def tool_group_row(step: int = 7) -> dict[str, Any]:
    """A samples.jsonl line as the trainer writes it (`pipelinerl.run.samples.group_row`) for a
    tool-using sample: model turn 0 calls two tools, the replies (the environment's tokens,
    mask 0) follow, then model turn 1 answers."""
    from pipelinerl.rl.capture import Scored
    from pipelinerl.run.samples import group_row as trainer_row
    from pipelinerl.types import ENV_VERSION, Group, Sample

    turn0, reply, turn1 = "<call>", "[r1][r2]", "A=4."
    ids = [ord(c) for c in turn0 + reply + turn1]
    mask = [True] * len(turn0) + [False] * len(reply) + [True] * len(turn1)
    calls = [
        {"key": "a0-r1/0/0", "turn": 0, "name": "lookup", "arguments": {"q": "2+2", "n": 1},
         "reply": "4", "outcome": "ok", "latency_s": 0.0123, "replayed": False},
        {"key": "a0-r1/0/1", "turn": 0, "name": "search", "arguments": {"q": "<b>x</b>"},
         "reply": HOSTILE, "outcome": "tool_timeout", "latency_s": 2.5, "replayed": True},
    ]
    sample = Sample(prompt_ids=[ord(c) for c in "2+2="], token_ids=ids,
                    logprobs=[-0.5 if m else 0.0 for m in mask],
                    versions=[step - 1 if m else ENV_VERSION for m in mask], reward=1.0,
                    success=True, finish_reason="stop", model_mask=mask, turns=2,
                    tool_calls=calls)
    scored = [Scored(0.5, [-0.4 if m else None for m in mask])]
    group = Group(group_id=f"a0-g{step}", prompt="2+2=", samples=[sample])
    return trainer_row(step, step - 1, group, scored, _CharTokenizer())


def test_tool_calls_reach_the_page_with_their_turn_reply_and_mask(run_dir):
    row = tool_group_row()
    write_rows(run_dir / "samples.jsonl", [row], mode="a")
    view = RunView(run_dir)
    assert view.notes() == [] and view.summary()["tool_outcomes"] == ["ok", "tool_timeout"]
    (status, _, body), (_, _, failed) = _get(run_dir, "/api/groups?step_min=7",
                                             "/api/groups?tool=failed")
    assert status == 200
    sample = json.loads(body)["groups"][0]["samples"][0]
    assert sample["tool_calls"] == row["samples"][0]["tool_calls"]
    assert sample["tool_calls"][1]["reply"] == HOSTILE  # as written: the page shows it as text
    assert sample["tokens"]["mask"] == [1] * 6 + [0] * 8 + [1] * 4
    assert sample["tokens"]["version"][6:14] == [-1] * 8
    assert [g["step"] for g in json.loads(failed)["groups"]] == [7]
    groups = view.groups()
    assert [g["step"] for g in select_groups(groups, Filters(tool="any"))["groups"]] == [7]
    assert select_groups(groups, Filters(tool="tool_error"))["total"] == 0
    assert select_groups(groups, Filters(tool="ok"))["total"] == 1
    # A line whose calls lack what the page needs is named, not shown half.
    bad = tool_group_row(8)
    del bad["samples"][0]["tool_calls"][0]["outcome"]
    write_rows(run_dir / "samples.jsonl", [bad], mode="a")
    view.refresh()
    assert any("samples.0.tool_calls.0.outcome" in n for n in view.notes()), view.notes()


def test_an_export_with_a_hostile_tool_reply_keeps_it_inside_its_data(run_dir):
    write_rows(run_dir / "samples.jsonl", [tool_group_row()], mode="a")
    html = export_html(RunView(run_dir), Filters(tool="any"), EvalQuery(), PanelCache())
    assert html.count("</script>") == 2 and "<img src=x" not in html
    data = re.search(r'<script id="pipelinerl-data" type="application/json">(.*?)</script>',
                     html, re.S).group(1)
    calls = json.loads(data)["groups"]["groups"][0]["samples"][0]["tool_calls"]
    assert calls[1]["reply"] == HOSTILE
