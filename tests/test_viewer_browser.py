"""`pipelinerl view` as a person uses it: headless Chromium (Debian's chromium and
chromium-driver, `make test-browser`) loads the page of a real run of the demo, while it trains
and after, and the tests check what the page shows against the run's own files. Screenshots go
to $VIEWER_ARTIFACTS (default .artifacts/browser), kept as the step's artifacts."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from pipelinerl.viewer.query import Filters, select_groups

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = Path(os.environ.get("VIEWER_ARTIFACTS", ROOT / ".artifacts" / "browser"))
CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
MAX_STEPS = 10


def _wait(what: str, check: Callable[[], Any], timeout_s: float = 60) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    raise AssertionError(f"waited {timeout_s} s for {what}")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (CHROMIUM and DRIVER):
        pytest.skip("needs Debian's chromium and chromium-driver (make test-browser installs "
                    "them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1500,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


class Viewer:
    """`pipelinerl view RUN_DIR --port 0` in a process of its own."""

    def __init__(self, run_dir: Path, poll_s: float = 0.5) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipelinerl.cli", "view", str(run_dir), "--port", "0",
             "--poll-s", str(poll_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        found = re.search(r"at (http://127\.0\.0\.1:\d+/)", line)
        assert found, (line, self.proc.stderr.read() if self.proc.poll() is not None else "")
        self.url = found.group(1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def _open(driver: Any, url: str) -> None:
    driver.get(url)
    _wait("the page's first load", lambda: driver.execute_script(
        "return document.body.dataset.ready === '1'"))


def _shot(driver: Any, name: str) -> None:
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def _no_console_errors(driver: Any, origin: str) -> None:
    """No error in the console from the page at `origin` (an earlier test's page, its viewer
    stopped, logs its failed polls until the browser leaves it)."""
    errors = [e for e in driver.get_log("browser")
              if e["level"] == "SEVERE" and e["message"].startswith(origin)]
    assert not errors, errors


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def live_run(tmp_path_factory, warm_cache) -> Iterator[tuple[Path, subprocess.Popen]]:
    """The demo (tiny model, arithmetic) training in the background, evaluated every 3 steps."""
    tmp = tmp_path_factory.mktemp("viewer")
    run_dir = tmp / "runs" / "demo"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipelinerl.cli", "train", str(ROOT / "examples/arithmetic.yaml"),
         "name=demo", f"output_dir={tmp / 'runs'}", f"warmstart.cache_dir={warm_cache}",
         "warmstart.steps=20", "engine.capacity=16", "actor.group_size=4",
         "trainer.batch_size=16", f"trainer.max_steps={MAX_STEPS}", "trainer.max_time_s=0",
         "actor.max_lag=2", "eval.every_steps=3", "eval.every_s=0", "eval.num_problems=12",
         "eval.samples=2", "metrics.progress=false", "metrics.samples_per_step=3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield run_dir, proc
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def finished_run(live_run) -> Path:
    run_dir, proc = live_run
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode == 0, out[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def page(browser, finished_run) -> Iterator[tuple[Any, Viewer]]:
    viewer = Viewer(finished_run)
    _open(browser, viewer.url)
    yield browser, viewer
    viewer.stop()


def test_the_page_follows_a_run_while_it_trains(browser, live_run):
    run_dir, proc = live_run
    _wait("the run's directory", lambda: (run_dir / "config.yaml").exists(), 300)
    viewer = Viewer(run_dir)
    try:
        _open(browser, viewer.url)
        newest = lambda: browser.execute_script("return document.body.dataset.newestStep")
        seen = {newest()}
        # Never reloaded: the page polls and shows each new step as the trainer records it.
        _wait("three different newest steps", lambda: seen.add(newest()) or len(seen) >= 3,
              timeout_s=300)
        on_top = "const g = document.querySelector('#groups .group'); return g && g.dataset.step"
        _wait("the newest step's groups on top",
              lambda: browser.execute_script(on_top) == newest())
        _shot(browser, "live")
        _no_console_errors(browser, viewer.url)
    finally:
        viewer.stop()


def test_the_groups_shown_are_the_runs_newest_with_every_attempt(page, finished_run):
    driver, viewer = page
    rows = _rows(finished_run / "samples.jsonl")
    expected = select_groups(rows, Filters())
    cards = driver.find_elements("css selector", "#groups .group")
    assert [c.get_attribute("data-group-id") for c in cards] == \
        [g["group_id"] for g in expected["groups"]]
    assert int(cards[0].get_attribute("data-step")) == max(r["step"] for r in rows) == MAX_STEPS
    for card, group in zip(cards, expected["groups"]):
        attempts = card.find_elements("css selector", ".attempt")
        assert len(attempts) == len(group["samples"])
        for a, s in zip(attempts, group["samples"]):
            assert len(a.find_elements("css selector", ".tok")) == len(s["tokens"]["text"])
    assert f"of {expected['total']}" in driver.find_element("id", "page-info").text
    _shot(driver, "samples")
    _no_console_errors(driver, viewer.url)


def _tokens_of(driver: Any, row: dict[str, Any]) -> tuple[list[Any], dict[str, list]]:
    card = driver.find_element("css selector", f'.group[data-group-id="{row["group_id"]}"]')
    first = card.find_elements("css selector", ".attempt")[0]
    return first.find_elements("css selector", ".tok"), row["samples"][0]["tokens"]


def _rgb(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def _mix(to: tuple[int, int, int], t: float) -> tuple[float, ...]:
    t = max(0.0, min(1.0, t))
    return tuple(255 + (c - 255) * t for c in to)


def _close(got: tuple[int, ...], expected: tuple[float, ...]) -> bool:
    return all(abs(a - b) <= 0.51 for a, b in zip(got, expected))  # the page rounds


def test_tokens_are_coloured_by_the_chosen_value_with_the_values_on_hover(page, finished_run):
    driver, _ = page
    from selenium.webdriver.support.ui import Select

    rows = _rows(finished_run / "samples.jsonl")
    max_lag = max(max(lag for s in r["samples"] for lag in s["tokens"]["lag"] if lag is not None)
                  for r in rows)
    shown = select_groups(rows, Filters())["groups"]
    trained = next(r for r in shown if not r.get("dropped") and r["samples"][0]["tokens"]["text"])
    spans, cols = _tokens_of(driver, trained)
    for i, span in enumerate(spans):  # the default: lag
        expected = _mix((245, 140, 0), cols["lag"][i] / max(1, max_lag))
        assert _close(_rgb(span.value_of_css_property("background-color")), expected)
        title = span.get_attribute("title")
        assert f"lag {cols['lag'][i]}" in title
        assert f"engine log-prob {cols['engine_logprob'][i]:.4f}" in title
        assert f"importance weight {cols['importance_weight'][i]:.4f}" in title
    Select(driver.find_element("id", "colour")).select_by_value("weight")
    spans, _ = _tokens_of(driver, trained)
    for span, w in zip(spans, cols["importance_weight"]):
        x = math.log2(w)
        expected = _mix((60, 110, 230), -x) if x < 0 else _mix((220, 40, 40), x)
        got = _rgb(span.value_of_css_property("background-color"))
        assert _close(got, expected), (got, expected, w)
    Select(driver.find_element("id", "colour")).select_by_value("logprob")
    spans, _ = _tokens_of(driver, trained)
    for span, lp in zip(spans, cols["engine_logprob"]):
        assert _close(_rgb(span.value_of_css_property("background-color")),
                      _mix((220, 40, 40), -lp / 6))
    _shot(driver, "logprob")
    Select(driver.find_element("id", "colour")).select_by_value("lag")


def _apply(driver: Any, **fields: str) -> None:
    """The form cleared, `fields` filled in, applied: returns once the page shows the result."""
    form = driver.find_element("id", "filters")
    driver.execute_script("document.getElementById('filters').reset()")
    for name, value in fields.items():
        el = form.find_element("name", name)
        if el.tag_name == "select":
            from selenium.webdriver.support.ui import Select
            Select(el).select_by_value(value)
        else:
            el.clear()
            el.send_keys(value)
    renders = lambda: driver.execute_script("return document.body.dataset.renders")
    before = renders()
    driver.find_element("id", "apply").click()
    _wait("the filtered page", lambda: renders() != before)


def test_filters_show_what_they_select(page, finished_run):
    driver, _ = page
    rows = _rows(finished_run / "samples.jsonl")
    reasons = Counter(s["finish_reason"] for r in rows for s in r["samples"])
    for fields in ({"length_min": "20"}, {"finish": min(reasons, key=reasons.get)},
                   {"kind": "dropped"},
                   {"reward_min": "1"}, {"step_min": "4", "step_max": "5"}):
        _apply(driver, **fields)
        expected = select_groups(rows, Filters.from_query(fields))
        cards = driver.find_elements("css selector", "#groups .group")
        assert [c.get_attribute("data-group-id") for c in cards] == \
            [g["group_id"] for g in expected["groups"]], fields
        visible = [a for a in driver.find_elements("css selector", "#groups .attempt")
                   if a.is_displayed()]
        assert len(visible) == sum(sum(g["match"]) for g in expected["groups"]), fields
        if "length_min" in fields:
            assert all(int(a.get_attribute("data-length")) >= 20 for a in visible)
    problem = rows[-1]["problem"]
    _apply(driver, problem=problem)
    shown = [c.find_element("css selector", ".problem").text
             for c in driver.find_elements("css selector", "#groups .group")]
    assert shown and all(problem in p for p in shown)
    _shot(driver, "filtered")
    _apply(driver)


def test_held_out_completions_of_two_versions_side_by_side(page, finished_run):
    driver, _ = page
    from selenium.webdriver.support.ui import Select

    evals = _rows(finished_run / "eval_samples.jsonl")
    versions = sorted({r["version"] for r in evals})
    assert len(versions) >= 3, versions  # the start, every 3 steps, the end
    driver.find_element("id", "tab-eval").click()
    assert driver.find_element("id", "eval-head-a").text == f"version {versions[0]}"
    assert driver.find_element("id", "eval-head-b").text == f"version {versions[-1]}"
    greedy = [r for r in evals if r["mode"] == "greedy" and r["version"] == versions[-1]]
    rows = driver.find_elements("css selector", "#eval-rows tr")
    assert [r.get_attribute("data-problem-id") for r in rows] == [r["problem_id"] for r in greedy]
    cells = rows[0].find_elements("css selector", "td")
    assert cells[2].find_element("css selector", "pre").text == \
        greedy[0]["attempts"][0]["completion"].strip()
    Select(driver.find_element("id", "eval-mode")).select_by_value("sampled")
    Select(driver.find_element("id", "eval-a")).select_by_value(str(versions[1]))
    _wait("the sampled comparison", lambda: driver.find_element("id", "eval-head-a").text
          == f"version {versions[1]}")
    first = driver.find_elements("css selector", "#eval-rows tr")[0]
    assert len(first.find_elements("css selector", "td")[1].find_elements("css selector",
                                                                         "pre")) == 2
    assert "sampled accuracy" in driver.find_element("id", "eval-accuracy").text
    _wait("the health panel", lambda: driver.execute_script(
        "const i = document.getElementById('panel'); return i.complete && i.naturalWidth > 0"))
    _shot(driver, "heldout")
    driver.find_element("id", "tab-samples").click()


def test_an_export_shows_the_view_with_no_server(browser, finished_run, tmp_path):
    viewer = Viewer(finished_run)
    try:
        with urllib.request.urlopen(viewer.url + "export.html?kind=trained&a=0") as resp:
            html = resp.read().decode()
    finally:
        viewer.stop()  # the file alone from here
    out = tmp_path / "shared.html"
    out.write_text(html)
    browser.get(out.as_uri())
    _wait("the exported page", lambda: browser.execute_script(
        "return document.body.dataset.ready === '1'"))
    cards = browser.find_elements("css selector", "#groups .group")
    rows = _rows(finished_run / "samples.jsonl")
    assert [c.get_attribute("data-group-id") for c in cards] == \
        [g["group_id"] for g in select_groups(rows, Filters(kind="trained"))["groups"]]
    assert "Exported view" in browser.find_element("id", "banner").text
    _wait("the embedded panel", lambda: browser.execute_script(
        "const i = document.getElementById('panel'); return i.complete && i.naturalWidth > 0"))
    _shot(browser, "export")
    _no_console_errors(browser, out.as_uri())


def test_a_copied_run_with_a_torn_line_and_an_old_run_say_so(browser, finished_run, tmp_path):
    copy = tmp_path / "copied"
    shutil.copytree(finished_run, copy, ignore=shutil.ignore_patterns("checkpoints", "streams"))
    with (copy / "samples.jsonl").open("a") as f:
        f.write('{"step": 11, "version": 10, "grou')  # a crash cut the last line
    old = tmp_path / "old"
    old.mkdir()
    shutil.copy(finished_run / "metrics.jsonl", old / "metrics.jsonl")
    for run, note in ((copy, "samples.jsonl ends in an incomplete line"),
                      (old, "no samples.jsonl yet")):
        viewer = Viewer(run)
        try:
            _open(browser, viewer.url)
            assert note in browser.find_element("id", "notes").text
            assert browser.find_element("id", "error").text == ""
            _shot(browser, f"note-{run.name}")
        finally:
            viewer.stop()


def test_tool_calls_show_at_their_turn_escaped_with_the_replies_shaded(browser, tmp_path):
    """A tool-using sample (samples.jsonl as `pipelinerl.run.samples.group_row` writes it, a reply
    made of markup and control characters) and a held-out attempt with calls."""
    from test_viewer import HOSTILE, tool_group_row, write_rows

    run = tmp_path / "tools"
    run.mkdir()
    (run / "config.yaml").write_text("name: tools\n")
    row = tool_group_row()
    write_rows(run / "samples.jsonl", [row])
    calls = row["samples"][0]["tool_calls"]
    write_rows(run / "eval_samples.jsonl", [{
        "version": 6, "attempt": 0, "mode": "greedy", "problem_id": "p", "problem": "2+2=",
        "prompt": "2+2=", "failure": None,
        "attempts": [{"completion": "A=4", "reward": 1.0, "success": True,
                      "finish_reason": "stop", "length": 18, "tool_calls": calls}]}])
    viewer = Viewer(run)
    try:
        _open(browser, viewer.url)
        attempt = browser.find_element("css selector", "#groups .attempt")
        assert "2 tool calls: 1 ok, 1 tool_timeout" in \
            attempt.find_element("css selector", ".tool-counts.tools-bad").text
        boxes = attempt.find_elements("css selector", ".tokens > .tool-call")
        assert [b.get_attribute("data-outcome") for b in boxes] == ["ok", "tool_timeout"]
        # Placed where turn 0's replies begin: after the model's tokens, before the env's.
        assert browser.execute_script("""
            const calls = arguments[0].querySelectorAll('.tokens > .tool-call');
            const before = calls[0].previousElementSibling, after = calls[1].nextElementSibling;
            return [before.textContent, before.classList.contains('env'),
                    after.textContent, after.classList.contains('env')];""", attempt) \
            == [">", False, "[", True]
        ok, bad = boxes
        assert ok.find_element("css selector", ".tool-name").text == "lookup"
        assert ok.find_element("css selector", ".tool-args").text == '{"q":"2+2","n":1}'
        assert ok.find_element("css selector", ".tool-latency").text == "12.3 ms"
        assert ok.find_element("css selector", ".tool-replayed").text == "called"
        assert ok.find_element("css selector", ".tool-reply").text == "4"
        assert "bad" not in ok.get_attribute("class") and "bad" in bad.get_attribute("class")
        outcome = bad.find_element("css selector", ".tool-outcome")
        assert outcome.text == "tool_timeout"
        assert _rgb(outcome.value_of_css_property("background-color")) == (176, 0, 32)
        assert bad.find_element("css selector", ".tool-args").text == '{"q":"<b>x</b>"}'
        assert bad.find_element("css selector", ".tool-replayed").text == "replayed"
        # The reply as text: its markup shown, not made; control characters as their pictures.
        reply = bad.find_element("css selector", ".tool-reply")
        expected = HOSTILE.replace("\x00", "\u2400").replace("\x1b", "\u241b")
        assert reply.get_attribute("textContent") == expected
        assert browser.execute_script(  # no element made of a reply's or arguments' text
            "return document.querySelectorAll('.tool-reply *, .tool-args *, .tool-name *, "
            ".attempt img, .attempt script').length") == 0
        # The environment's tokens (mask 0) hatched, the model's coloured by lag.
        spans = attempt.find_elements("css selector", ".tok")
        masks = row["samples"][0]["tokens"]["mask"]
        assert [int(s.get_attribute("data-mask")) for s in spans] == masks
        for span, m in zip(spans, masks):
            image = span.value_of_css_property("background-image")
            assert ("repeating-linear-gradient" in image) == (not m), (image, m)
            assert ("env" in span.get_attribute("class")) == (not m)
            if m:
                assert _close(_rgb(span.value_of_css_property("background-color")),
                              _mix((245, 140, 0), 0))  # lag 0 of max lag 0: white
        assert "tool replies" in browser.find_element("id", "legend").text
        _shot(browser, "tool-calls")
        browser.find_element("id", "tab-eval").click()
        cell = browser.find_elements("css selector", "#eval-rows td")[1]
        assert [b.get_attribute("data-outcome") for b in
                cell.find_elements("css selector", ".tool-call")] == ["ok", "tool_timeout"]
        assert cell.find_elements("css selector", ".tool-reply")[1].get_attribute(
            "textContent") == expected
        _shot(browser, "tool-calls-heldout")
        browser.find_element("id", "tab-samples").click()
        _no_console_errors(browser, viewer.url)
    finally:
        viewer.stop()
