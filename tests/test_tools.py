"""Tools in the model's own format (docs/tools.md): specs, call parsing, the tokens at every
assistant/tool boundary for each format, Python functions and real MCP servers (stdio and
streamable HTTP, started here on 127.0.0.1), failures counted, replies recorded and replayed.

The rollouts here are driven by a scripted engine (a fake: it returns the turns a test writes,
as the model would sample them) so each boundary is known; the engines' own multi-turn paths
are tested in test_multiturn_engine.py."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_multiturn import ScriptedEngine, turn, wait_for_replies
from tool_kit.templates import FAMILIES, family_tokenizer

from pipelinerl.config import Config, McpServerConfig, ToolsConfig
from pipelinerl.envs.rollout import Rollouts
from pipelinerl.models.prompts import Codec
from pipelinerl.tasks.base import Problem
from pipelinerl.tools.chat import ToolChat
from pipelinerl.tools.formats import detect_format, parse_hermes, parse_llama3
from pipelinerl.tools.host import ToolHost
from pipelinerl.tools.record import ToolLog
from pipelinerl.tools.specs import ToolCall, argument_errors, function_spec
from pipelinerl.tools.task import equip
from pipelinerl.types import SamplingParams

KIT = Path(__file__).parent / "tool_kit"
SERVER = [sys.executable, str(KIT / "mcp_server.py")]
FUNCS = "tool_kit.functions"
PROBLEM = Problem("p:0", "What is the code of a pear?", "1187")


class Plain:
    """A single-turn task: success when the transcript names the answer."""

    name = "plain"

    def sample_problem(self, rng: Any) -> Problem:
        return PROBLEM

    def score(self, problem: Problem, transcript: str) -> Any:
        from pipelinerl.tasks.base import Score

        ok = problem.answer in transcript.rsplit("</tool_response>", 1)[-1]
        return Score(float(ok), ok)


def _cfg(**tools: Any) -> Config:
    return Config(tools=ToolsConfig(**tools))


def _codec(tokenizer: Any) -> Codec:
    return Codec(encode=lambda p: tokenizer.encode(p, add_special_tokens=False),
                 decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                 encode_text=lambda t: tokenizer.encode(t, add_special_tokens=False),
                 stop_ids=tuple(tokenizer.convert_tokens_to_ids(FAMILIES_EOS(tokenizer))),
                 token_text=lambda t: tokenizer.decode([t]))


def FAMILIES_EOS(tokenizer: Any) -> list[str]:  # noqa: N802 - the families' EOS tokens
    return next(eos for _, special, eos, _ in FAMILIES.values()
                if set(special) <= set(tokenizer.get_vocab()))


def _rollouts(family: str, tmp_path: Path | None = None, **tools: Any
              ) -> tuple[Rollouts, ScriptedEngine, Any, Codec]:
    tokenizer = family_tokenizer(family)
    cfg = _cfg(**{"functions": [f"{FUNCS}:lookup", f"{FUNCS}:add"], **tools})
    task, codec = equip(cfg, Plain(), _codec(tokenizer), tokenizer, "actor0", tmp_path)
    engine = ScriptedEngine()
    rollouts = Rollouts(task, engine, codec.encode_text, codec.decode,
                        SamplingParams(max_new_tokens=1500, stop_token_ids=codec.stop_ids),
                        10.0, 1, None, codec.token_text)
    return rollouts, engine, tokenizer, codec


def _model_turn(tokenizer: Any, text: str) -> list[int]:
    """The ids a model of the family samples for a message: its text, then its EOS."""
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


# -- specs and parsing ---------------------------------------------------------------------

def test_a_functions_schema_comes_from_its_hints_and_docstring() -> None:
    from tool_kit.functions import add, lookup

    spec = function_spec(lookup, "function:x")
    assert spec.description == "The code of a fruit (apple, pear, plum)."
    assert spec.parameters["required"] == ["key"]
    assert spec.parameters["properties"]["key"]["type"] == "string"
    adder = function_spec(add, "function:y")
    assert adder.parameters["properties"]["b"]["default"] == 0
    assert argument_errors(adder, {"a": 1}) == ""
    assert "is not of type 'integer'" in argument_errors(adder, {"a": "one"})
    assert "'a' is a required property" in argument_errors(adder, {"b": 2})
    assert "JSON object" in argument_errors(adder, [1, 2])

    def untyped(x):  # type: ignore[no-untyped-def]
        return x

    with pytest.raises(ValueError, match="argument 'x' has no type hint"):
        function_spec(untyped, "function:z")


@pytest.mark.parametrize(("text", "calls", "errors"), [
    ('I will look.\n<tool_call>\n{"name": "lookup", "arguments": {"key": "pear"}}\n</tool_call>',
     [ToolCall("lookup", {"key": "pear"})], 0),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", '
     '"arguments": "{\\"x\\": 1}"}</tool_call>', [ToolCall("a"), ToolCall("b", {"x": 1})], 0),
    ("<tool_call>{'name': 'lookup'}</tool_call>", [], 1),  # not JSON
    ('<tool_call>{"name": "lookup", "arguments": {"key": "pe', [], 1),  # never closed
    ('<tool_call>["lookup"]</tool_call>', [], 1),  # not an object
    ('<tool_call>{"name": "x", "arguments": [1]}</tool_call>', [], 1),
    ("The code is 1187.", [], 0),  # an answer
])
def test_hermes_calls_are_parsed_and_malformed_ones_give_their_reason(
        text: str, calls: list[ToolCall], errors: int) -> None:
    parsed = parse_hermes(text)
    assert parsed.calls == calls and len(parsed.errors) == errors


def test_llama3_calls_are_a_json_turn_and_anything_else_an_answer() -> None:
    assert parse_llama3('{"name": "lookup", "parameters": {"key": "pear"}}').calls == [
        ToolCall("lookup", {"key": "pear"})]
    assert parse_llama3('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", '
                        '"parameters": {}}').calls == [ToolCall("a"), ToolCall("b")]
    assert not parse_llama3("The code is 1187.").any
    assert len(parse_llama3('{"name": "lookup", "parameters": ').errors) == 1
    assert detect_format(FAMILIES["llama3.1"][0]) == "llama3"
    assert detect_format(FAMILIES["qwen2.5"][0]) == "hermes"
    assert detect_format(FAMILIES["chatml"][0]) == "hermes"


# -- the tokens at every boundary ----------------------------------------------------------

CALLS = {
    "qwen2.5": '<tool_call>\n{"name": "lookup", "arguments": {"key": "pear"}}\n</tool_call>',
    "llama3.1": '{"name": "lookup", "parameters": {"key": "pear"}}',
    "chatml": '<tool_call>\n{"name": "lookup", "arguments": {"key": "pear"}}\n</tool_call>',
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_trained_ids_are_the_sampled_ids_plus_the_templated_replies_at_every_boundary(
        family: str) -> None:
    """Two calls then an answer. The rollout's ids are the engine's sampled ids, untouched,
    with the replies between them; prompt + rollout is exactly the serving rendering of the
    whole conversation (apply_chat_template of the messages), up to the template's text after
    the last stop token: no separator lost or added at any assistant/tool boundary."""
    rollouts, engine, tokenizer, codec = _rollouts(family)
    try:
        prompt_ids = codec.encode(PROBLEM.prompt)
        rollouts.request("g-0", PROBLEM, prompt_ids)
        second = CALLS[family].replace("lookup", "add").replace('"key": "pear"', '"a": 2, "b": 3')
        sampled = [_model_turn(tokenizer, CALLS[family]), _model_turn(tokenizer, second),
                   _model_turn(tokenizer, "The code is 1187.")]
        for ids in sampled[:2]:
            assert rollouts.on_turn(turn("g-0", ids)) is None
            wait_for_replies(rollouts, 1)
        assert rollouts.on_turn(turn("g-0", sampled[2])) is None  # no call in it: the end
        (done,) = wait_for_replies(rollouts, 1)
        assert done.finish_reason == "stop" and done.ends_with_stop_token
        # The model's tokens are exactly what it sampled, in order, and only they are trained.
        model_ids = [t for t, m in zip(done.token_ids, done.model_mask) if m]
        assert model_ids == [t for ids in sampled for t in ids]
        assert [ids for _, ids, _ in engine.extended] == [
            done.token_ids[len(sampled[0]):len(sampled[0]) + len(engine.extended[0][1])],
            engine.extended[1][1]]
        chat = rollouts.pool.chat
        messages = [{"role": "user", "content": PROBLEM.prompt}]
        if chat.system_text():
            messages.insert(0, {"role": "system", "content": chat.system_text()})
        replies = [r["reply"] for r in done.tool_calls]
        assert replies == ["1187", "5"]
        for text, reply in zip([CALLS[family], second], replies):
            messages.append({"role": "assistant", "content": text})
            messages += (chat._messages([type("A", (), {"name": "t", "text": reply})()]))
        messages.append({"role": "assistant", "content": "The code is 1187."})
        served = tokenizer.apply_chat_template(
            messages, tools=chat._tools if chat.native else None, tokenize=False)
        served_ids = tokenizer.encode(served, add_special_tokens=False)
        ours = prompt_ids + done.token_ids
        assert served_ids[:len(ours)] == ours
        after_last = tokenizer.decode(served_ids[len(ours):])
        assert after_last == served[served.rindex("The code is 1187.") + 17:].removeprefix(
            tokenizer.eos_token)
        assert [r["outcome"] for r in done.tool_calls] == ["ok", "ok"]
    finally:
        rollouts.close()


def test_malformed_unknown_bad_arguments_and_over_the_limit_calls_get_reasons_not_exceptions(
        ) -> None:
    rollouts, engine, tokenizer, codec = _rollouts("qwen2.5", max_calls=2)
    try:
        rollouts.request("g-0", PROBLEM, codec.encode(PROBLEM.prompt))
        text = ('<tool_call>{"name": "lookup", "arguments": {"key": }</tool_call>'
                '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
                '<tool_call>{"name": "add", "arguments": {"a": "two"}}</tool_call>'
                '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
                '<tool_call>{"name": "lookup", "arguments": {"key": "plum"}}</tool_call>')
        assert rollouts.on_turn(turn("g-0", _model_turn(tokenizer, text))) is None
        wait_for_replies(rollouts, 1)
        reply = tokenizer.decode(engine.extended[-1][1])
        calls = rollouts._running["g-0"].tool_calls
        assert [c["outcome"] for c in calls] == ["tool_bad_call", "tool_bad_call",
                                                 "tool_bad_call", "ok", "tool_over_limit"]
        assert "not valid JSON" in calls[0]["reply"]
        assert "unknown tool 'search'; the tools are add, lookup" in calls[1]["reply"]
        assert "bad arguments for add: a: 'two' is not of type 'integer'" in calls[2]["reply"]
        assert calls[3]["reply"] == "2" and "at most 2 per episode" in calls[4]["reply"]
        assert reply.count("<tool_response>") == 5
        stats = rollouts.stats.tool_snapshot()
        assert stats["tool_bad_calls"] == 3 and stats["tool_over_limits"] == 1
        assert stats["tool_well_formed_frac"] == pytest.approx(2 / 5)
        assert stats["tool_calls_add"] == 2
    finally:
        rollouts.close()


def test_a_tool_that_raises_hangs_or_kills_its_worker_is_counted_and_answered() -> None:
    rollouts, engine, tokenizer, codec = _rollouts(
        "qwen2.5", functions=[f"{FUNCS}:boom", f"{FUNCS}:stall", f"{FUNCS}:crash",
                              f"{FUNCS}:lookup"], timeout_s=1.0, max_calls=8)
    try:
        for i, call in enumerate(['{"name": "boom", "arguments": {}}',
                                  '{"name": "stall", "arguments": {"seconds": 30}}',
                                  '{"name": "crash", "arguments": {}}',
                                  '{"name": "lookup", "arguments": {"key": "apple"}}']):
            rollouts.request(f"g-{i}", PROBLEM, codec.encode(PROBLEM.prompt))
            text = f"<tool_call>{call}</tool_call>"
            assert rollouts.on_turn(turn(f"g-{i}", _model_turn(tokenizer, text))) is None
            wait_for_replies(rollouts, 1)
        outcomes = [rollouts._running[f"g-{i}"].tool_calls[0] for i in range(4)]
        assert [o["outcome"] for o in outcomes] == ["tool_error", "tool_timeout", "tool_error",
                                                    "ok"]
        assert "boom went the tool" in outcomes[0]["reply"]
        assert outcomes[3]["reply"] == "7421"  # the pool replaced after the crash
    finally:
        rollouts.close()


def test_with_on_error_drop_a_failed_call_ends_the_rollout_as_that_failure() -> None:
    rollouts, engine, tokenizer, codec = _rollouts(
        "qwen2.5", functions=[f"{FUNCS}:boom"], on_error="drop")
    try:
        rollouts.request("g-0", PROBLEM, codec.encode(PROBLEM.prompt))
        call = '<tool_call>{"name": "boom", "arguments": {}}</tool_call>'
        assert rollouts.on_turn(turn("g-0", _model_turn(tokenizer, call))) is None
        (ended,) = wait_for_replies(rollouts, 1)
        assert ended.finish_reason == "tool_error" and engine.released == ["g-0"]
        from pipelinerl.envs.groups import is_call_failure

        assert is_call_failure(ended.finish_reason)  # its group is dropped, counted
    finally:
        rollouts.close()


# -- recorded replies ----------------------------------------------------------------------

def _clock_rollout(tmp_path: Path, replay: str = "", attempt: int = 0,
                   deterministic: bool = False) -> list[str]:
    tokenizer = family_tokenizer("qwen2.5")
    cfg = _cfg(functions=[f"{FUNCS}:clock"], replay_from=replay)
    cfg = cfg.model_copy(update={"attempt": attempt})
    if deterministic:
        cfg.deterministic.enabled = True
        cfg.actor.max_restarts = 0
    task, codec = equip(cfg, Plain(), _codec(tokenizer), tokenizer, "actor0", tmp_path)
    rollouts = Rollouts(task, ScriptedEngine(), codec.encode_text, codec.decode,
                        SamplingParams(max_new_tokens=1500, stop_token_ids=codec.stop_ids),
                        10.0, 1, None, codec.token_text)
    try:
        rollouts.request("a0-g0-0", PROBLEM, codec.encode(PROBLEM.prompt))
        for _ in range(2):
            call = '<tool_call>{"name": "clock", "arguments": {}}</tool_call>'
            assert rollouts.on_turn(turn("a0-g0-0", _model_turn(tokenizer, call))) is None
            wait_for_replies(rollouts, 1)
        return [c["reply"] for c in rollouts._running["a0-g0-0"].tool_calls]
    finally:
        rollouts.close()


def test_replies_are_recorded_and_a_replay_or_a_deterministic_resume_takes_them(
        tmp_path: Path) -> None:
    first = _clock_rollout(tmp_path / "run")
    records = [json.loads(line) for line in
               (tmp_path / "run" / "tool_replies" / "actor0.jsonl").read_text().splitlines()]
    assert [r["reply"] for r in records] == first and first[0] != first[1]
    assert records[0]["key"] == "a0-g0-0/0/0" and records[1]["key"] == "a0-g0-0/1/0"
    assert _clock_rollout(tmp_path / "other") != first  # called again: a new time
    assert _clock_rollout(tmp_path / "rerun", replay=str(tmp_path / "run")) == first
    # A deterministic resume (attempt 1) of the same run directory takes its own records.
    assert _clock_rollout(tmp_path / "run", attempt=1, deterministic=True) == first
    # A torn last line (a crash mid-write) is skipped.
    path = tmp_path / "run" / "tool_replies" / "actor0.jsonl"
    path.write_text(path.read_text() + '{"key": "a0-g0-0/2/0", "rep')
    log = ToolLog(None, "actor0", [tmp_path / "run"])
    assert log.recorded_reply("a0-g0-0/0/0", "clock", {})["reply"] == first[0]
    assert log.recorded_reply("a0-g0-0/0/0", "clock", {"x": 1}) is None and log.misses == 1


# -- the warm start's demonstrations --------------------------------------------------------

def test_a_tool_demonstration_holds_the_ids_a_rollout_of_the_same_turns_holds() -> None:
    """The warm start trains on what RL will see: the prompt with the tools, each model turn
    and its stop token (trained), each real reply with the next turn's header (not trained),
    id for id the rollout's."""
    from tool_kit.demos import FruitCodes

    from pipelinerl.tools.warmstart import ToolDemos

    rollouts, _, tokenizer, codec = _rollouts("qwen2.5")
    try:
        task = FruitCodes()
        problem = task.sample_problem(random.Random(0))
        turns = task.tool_demonstration(problem, random.Random(0), 0.0)
        prompt_ids = codec.encode(problem.prompt)
        rollouts.request("g-0", problem, prompt_ids)
        assert rollouts.on_turn(turn("g-0", _model_turn(tokenizer, turns[0]))) is None
        wait_for_replies(rollouts, 1)
        assert rollouts.on_turn(turn("g-0", _model_turn(tokenizer, turns[1]))) is None
        (done,) = wait_for_replies(rollouts, 1)
        assert [r["reply"] for r in done.tool_calls] == [problem.answer]
        demos = ToolDemos(task, tokenizer, rollouts.pool.chat, rollouts.pool, "hermes")
        ids, labels = demos.encode(random.Random(0), 0.0)
        assert ids == prompt_ids + done.token_ids
        assert [label != -100 for label in labels] == \
            [False] * len(prompt_ids) + [bool(m) for m in done.model_mask]
        assert [i for i, label in zip(ids, labels) if label != -100] == [
            t for text in turns for t in _model_turn(tokenizer, text)]
    finally:
        rollouts.close()


def test_a_demonstration_turn_without_a_call_before_more_turns_is_refused_naming_the_task(
        ) -> None:
    from tool_kit.demos import FruitCodes

    from pipelinerl.tools.warmstart import ToolDemos

    class Rambles(FruitCodes):
        def tool_demonstration(self, problem: Problem, rng: Any, error_prob: float) -> list[str]:
            return ["Let me think.", "The code is 1."]

    rollouts, _, tokenizer, _ = _rollouts("qwen2.5")
    try:
        demos = ToolDemos(Rambles(), tokenizer, rollouts.pool.chat, rollouts.pool, "hermes")
        with pytest.raises(ValueError, match="fruit_codes.*calls no tool but more turns"):
            demos.encode(random.Random(0), 0.0)
    finally:
        rollouts.close()


def test_a_tool_prompt_of_ones_own_replaces_the_hermes_prompt_and_must_hold_the_specs() -> None:
    with pytest.raises(ValueError, match=r"tools.prompt must hold \{tools\}"):
        ToolsConfig(prompt="Call tools.")
    tokenizer = family_tokenizer("chatml")
    from tool_kit.functions import lookup

    specs = [function_spec(lookup, "function")]
    chat = ToolChat(tokenizer, specs, "Be brief.", "Tools:\n{tools}\nCall with <tool_call>.")
    assert chat.system_text() == ("Be brief.\n\nTools:\n" + json.dumps(specs[0].openai())
                                  + "\nCall with <tool_call>.")
    assert "function signatures" in ToolChat(tokenizer, specs).system_text()  # Hermes'


# -- MCP servers ---------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def http_server() -> Any:
    port = _free_port()
    proc = subprocess.Popen([*SERVER, "http", str(port)], stderr=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    try:
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.kill()
        proc.wait()


def _host(timeout_s: float = 20.0, **server: Any) -> ToolHost:
    return ToolHost(ToolsConfig(mcp=[McpServerConfig(name="t", **server)], timeout_s=timeout_s))


def _count(host: ToolHost, key: str, by: int) -> str:
    return host.run(host.call(key, ToolCall("count", {"by": by}))).text


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_each_rollout_has_a_session_of_its_own_and_shared_has_one(transport: str,
                                                                  request: Any) -> None:
    where = ({"command": [*SERVER, "stdio"]} if transport == "stdio"
             else {"url": request.getfixturevalue("http_server")})
    host = _host(**where)
    try:
        assert sorted(host.specs) == ["count", "die", "fail", "lookup", "sleep"]
        assert host.specs["lookup"].source == "mcp:t"
        assert [_count(host, k, b) for k, b in (("r1", 2), ("r2", 5), ("r1", 3), ("r2", 1))] \
            == ["2", "5", "5", "6"]
        host.end("r1")
        assert _count(host, "r1", 1) == "1"  # a new rollout under an old key: a new session
        assert host.run(host.call("r2", ToolCall("fail", {}))).outcome == "tool_error"
    finally:
        host.close()
    shared = _host(session="shared", **where)
    try:
        assert [_count(shared, k, 1) for k in ("r1", "r2")][1] != "1"
    finally:
        shared.close()


def test_a_stdio_server_that_dies_mid_call_is_counted_and_started_again() -> None:
    host = _host(command=[*SERVER, "stdio"])
    try:
        assert _count(host, "r1", 4) == "4"
        died = host.run(host.call("r1", ToolCall("die", {})))
        assert died.outcome == "tool_server_restart" and "server died" in died.text
        assert _count(host, "r1", 1) == "1" and host.restarts() == 1  # a new process
    finally:
        host.close()


def test_a_call_that_hangs_past_the_deadline_is_a_timeout(http_server: str) -> None:
    host = _host(timeout_s=1.0, url=http_server)
    try:
        hung = host.run(host.call("r1", ToolCall("sleep", {"seconds": 20})))
        assert hung.outcome == "tool_timeout" and hung.latency_s < 5
        assert host.run(host.call("r1", ToolCall("lookup", {"key": "plum"}))).text == "5530"
    finally:
        host.close()


@pytest.mark.parametrize(("server", "message"), [
    ({"command": [*SERVER, "empty"]}, "lists no tools"),
    ({"command": [*SERVER, "mute"]}, "answered nothing within tools.timeout_s=3 s"),
    ({"command": ["/nonexistent/mcp-server"]}, "did not start"),
    ({"url": f"http://127.0.0.1:{_free_port()}/mcp"}, "did not start"),
])
def test_a_server_that_does_not_start_answers_nothing_or_lists_no_tools_is_named(
        server: dict[str, Any], message: str) -> None:
    with pytest.raises(RuntimeError, match="tools.mcp server 't'") as error:
        _host(timeout_s=3.0 if "mute" in str(server) else 20.0, **server)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.slow
def test_hundreds_of_concurrent_rollout_sessions_against_one_http_server(
        http_server: str) -> None:
    """300 rollouts at once, each with a session of its own (up to max_sessions=300 open),
    two calls each: every rollout sees its own count, none is dropped."""
    host = ToolHost(ToolsConfig(mcp=[McpServerConfig(name="t", url=http_server,
                                                     max_sessions=300)], timeout_s=60))
    try:
        import asyncio

        async def episode(i: int) -> tuple[str, str]:
            first = await host.call(f"r{i}", ToolCall("count", {"by": i}))
            second = await host.call(f"r{i}", ToolCall("count", {"by": 1}))
            return first.text, second.text

        async def all_at_once() -> list[tuple[str, str]]:
            return await asyncio.gather(*(episode(i) for i in range(300)))

        results = host.run(all_at_once(), timeout_s=240)
        assert results == [(str(i), str(i + 1)) for i in range(300)]
        assert max(s.open_sessions for s in host.servers) == 300
        for i in range(300):
            host.end(f"r{i}")
    finally:
        host.close()
