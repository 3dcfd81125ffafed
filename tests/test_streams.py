"""Streams: ordering, several writer processes, lossless resume, timeouts, big records."""

from __future__ import annotations

import json
import math
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from pipelinerl.streams import (
    Reader,
    StreamConnectionError,
    Writer,
    open_reader,
    open_writer,
    start_redis_server,
)
from pipelinerl.streams.base import WriterIdInUse, WriterStateLost
from pipelinerl.streams.local import LocalStreamReader, LocalStreamWriter
from pipelinerl.streams.redis_server import RedisServer
from pipelinerl.streams.redis_stream import RedisStreamReader, stream_key
from pipelinerl.types import Group, Sample


@dataclass
class Where:
    """Where a test's stream lives, for either backend."""

    backend: str
    location: dict[str, Any]  # root, or url and run
    stream: str = "rollouts"

    def writer(self, writer_id: str) -> Writer:
        return open_writer(self.backend, stream=self.stream, writer_id=writer_id, **self.location)

    def reader(self, offsets: dict[str, Any] | None = None) -> Reader:
        return open_reader(self.backend, stream=self.stream, offsets=offsets, **self.location)


@pytest.fixture(params=["local", pytest.param("redis", marks=pytest.mark.redis)])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Where:
    if request.param == "local":
        return Where("local", {"root": tmp_path / "streams"})
    server: RedisServer = request.getfixturevalue("redis_server")
    return Where("redis", {"url": server.url, "run": f"test-{uuid.uuid4().hex[:12]}"})


def drain(reader: Reader, n: int, timeout_s: float = 20.0, batch: int = 64) -> list[dict]:
    """Read until `n` records arrived (or the deadline passes)."""
    out: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += reader.read(min(batch, n - len(out)), timeout_s=0.5)
    return out


def rec(writer: str, i: int) -> dict[str, Any]:
    return {"w": writer, "i": i, "ids": [i, i + 1, i + 2], "lp": [-0.5, -1.25]}


# --- both backends ---------------------------------------------------------------------------


def test_order_preserved_one_writer(where: Where) -> None:
    with where.writer("a") as w:
        for i in range(100):
            w.write(rec("a", i))
        w.write_many(rec("a", i) for i in range(100, 250))
    with where.reader() as r:
        assert drain(r, 250) == [rec("a", i) for i in range(250)]
        assert r.read(10, timeout_s=0.05) == []


_WRITER_SCRIPT = """
import json, sys
from pipelinerl.streams import open_writer
where, writer_id, n = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
with open_writer(where.pop("backend"), writer_id=writer_id, **where) as w:
    for i in range(n // 2):
        w.write({"w": writer_id, "i": i, "ids": [i, i + 1, i + 2], "lp": [-0.5, -1.25]})
    w.write_many(
        {"w": writer_id, "i": i, "ids": [i, i + 1, i + 2], "lp": [-0.5, -1.25]}
        for i in range(n // 2, n)
    )
"""


def test_two_writer_processes_each_record_once(where: Where) -> None:
    n = 400
    location = {k: str(v) for k, v in where.location.items()}
    spec = json.dumps({"backend": where.backend, "stream": where.stream, **location})
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER_SCRIPT, spec, wid, str(n)])
        for wid in ("actor0", "actor1")
    ]
    with where.reader() as r:
        got = drain(r, 2 * n, timeout_s=60.0)  # reads while the writers write
        for p in procs:
            assert p.wait(30) == 0
        got += r.read(10, timeout_s=0.2)  # nothing beyond the 2N
    assert len(got) == 2 * n
    assert sorted((g["w"], g["i"]) for g in got) == sorted(
        (w, i) for w in ("actor0", "actor1") for i in range(n)
    )
    for wid in ("actor0", "actor1"):
        assert [g["i"] for g in got if g["w"] == wid] == list(range(n))  # per-writer order
    assert got[0] == rec(got[0]["w"], 0)


def test_resume_from_saved_offsets_loses_and_repeats_nothing(where: Where) -> None:
    with where.writer("a") as wa, where.writer("b") as wb:
        for i in range(30):
            wa.write(rec("a", i))
            wb.write(rec("b", i))
        first = where.reader()
        seen = drain(first, 25, batch=7)
        saved = json.loads(json.dumps(first.offsets()))  # as a checkpoint stores them
        first.read(10, timeout_s=0.1)  # read past the checkpoint, then "crash"
        first.close()
        for i in range(30, 40):  # writers keep going while the trainer restarts
            wa.write(rec("a", i))
            wb.write(rec("b", i))
    with where.reader(offsets=saved) as resumed:
        seen += drain(resumed, 80 - 25)
        assert resumed.read(10, timeout_s=0.1) == []
    assert sorted((s["w"], s["i"]) for s in seen) == sorted(
        (w, i) for w in "ab" for i in range(40)
    )
    for wid in "ab":
        assert [s["i"] for s in seen if s["w"] == wid] == list(range(40))


def test_restarted_writer_appends(where: Where) -> None:
    with where.writer("a") as w:
        w.write(rec("a", 0))
    with where.writer("a") as w:  # same id after a restart: nothing deleted, order kept
        w.write(rec("a", 1))
    with where.reader() as r:
        assert drain(r, 2) == [rec("a", 0), rec("a", 1)]


def test_read_timeout_is_bounded(where: Where) -> None:
    with where.reader() as r:
        t0 = time.monotonic()
        assert r.read(10, timeout_s=0.3) == []
        waited = time.monotonic() - t0
        assert 0.25 <= waited < 1.5
        t0 = time.monotonic()
        assert r.read(10, timeout_s=0.0) == []
        assert time.monotonic() - t0 < 0.5


def test_read_returns_as_soon_as_a_record_arrives(where: Where) -> None:
    with where.reader() as r, where.writer("a") as w:
        w.write(rec("a", 0))
        t0 = time.monotonic()
        assert r.read(10, timeout_s=10.0) == [rec("a", 0)]
        assert time.monotonic() - t0 < 1.0


def test_big_record_and_nonfinite_floats_round_trip(where: Where) -> None:
    big = {"token_ids": list(range(150_000)), "logprobs": [-1.0 / (i + 1) for i in range(40_000)]}
    assert len(json.dumps(big)) > 1_000_000
    odd = {"lp": [float("-inf"), float("nan")], "text": "line\nbreak \u00e9 \u2713"}
    with where.writer("a") as w:
        w.write(big)
        w.write(odd)
    with where.reader() as r:
        got = drain(r, 2)
    assert got[0] == big
    assert got[1]["lp"][0] == float("-inf") and math.isnan(got[1]["lp"][1])
    assert got[1]["text"] == odd["text"]


def test_group_round_trips(where: Where) -> None:
    sample = Sample(
        prompt_ids=[1, 2], token_ids=[3, 4], logprobs=[-0.1, -2.5], versions=[7, 8],
        reward=1.0, success=True, finish_reason="stop", group_id="g0", actor_id=1,
    )  # fmt: skip
    group = Group(group_id="g0", prompt="2+2?", samples=[sample, sample], actor_id=1,
                  actor_stats={"lag": 0.5})  # fmt: skip
    with where.writer("a") as w:
        w.write(group.to_dict())
    with where.reader() as r:
        assert Group.from_dict(drain(r, 1)[0]) == group


# --- local ------------------------------------------------------------------------------------


def test_local_partial_line_is_not_consumed(tmp_path: Path) -> None:
    with LocalStreamWriter(tmp_path, "s", "a") as w:
        w.write({"i": 0})
    # Another writer caught mid-write: its line has no newline yet.
    part = tmp_path / "s" / "b.jsonl"
    full = json.dumps({"i": 1, "pad": "x" * 100}).encode() + b"\n"
    part.write_bytes(full[:40])
    r = LocalStreamReader(tmp_path, "s")
    assert r.read(10, timeout_s=0.05) == [{"i": 0}]
    assert r.read(10, timeout_s=0.05) == []
    assert r.offsets()["b"] == 0
    with part.open("ab") as f:
        f.write(full[40:])
    assert r.read(10, timeout_s=1.0) == [{"i": 1, "pad": "x" * 100}]
    assert r.offsets()["b"] == len(full)
    r.close()
    assert r.offsets()["b"] == len(full)  # still valid after close, for the checkpoint


def test_local_torn_tail_after_crash_is_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "s" / "a.jsonl"
    with LocalStreamWriter(tmp_path, "s", "a") as w:
        w.write({"i": 0})
    with path.open("ab") as f:
        f.write(b'{"i": 1, "tok')  # the writer process died here
    r = LocalStreamReader(tmp_path, "s")
    assert r.read(10, timeout_s=0.05) == [{"i": 0}]  # the torn tail is held back
    with LocalStreamWriter(tmp_path, "s", "a") as w:  # the restarted actor
        w.write({"i": 2})
    assert r.read(10, timeout_s=1.0) == [{"i": 2}]
    assert "skipping unparseable line" in caplog.text


def test_local_busy_writer_does_not_starve_others(tmp_path: Path) -> None:
    with LocalStreamWriter(tmp_path, "s", "a") as wa, LocalStreamWriter(tmp_path, "s", "b") as wb:
        wa.write_many({"w": "a", "i": i} for i in range(100))
        wb.write({"w": "b", "i": 0})
    with LocalStreamReader(tmp_path, "s") as r:
        assert {"w": "b", "i": 0} in r.read(4, timeout_s=1.0)


def test_local_rejects_duplicate_writer_and_bad_offsets(tmp_path: Path) -> None:
    with LocalStreamWriter(tmp_path, "s", "a") as w:
        with pytest.raises(WriterIdInUse, match="already open"):  # the lock on a.lock
            LocalStreamWriter(tmp_path, "s", "a")
        w.write({"i": 0})
    with pytest.raises(ValueError, match="record boundary"):
        LocalStreamReader(tmp_path, "s", offsets={"a": 3}).read(1, timeout_s=0.0)
    with pytest.raises(ValueError, match="past the end"):
        LocalStreamReader(tmp_path, "s", offsets={"a": 10_000}).read(1, timeout_s=0.0)
    with pytest.raises(ValueError, match="names a path"):
        LocalStreamWriter(tmp_path, "s", "../x")


def test_factory_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="known: local, redis"):
        open_writer("kafka", stream="s", writer_id="a", root=tmp_path)
    with pytest.raises(ValueError, match="needs root"):
        open_reader("local", stream="s")
    with pytest.raises(ValueError, match="needs url and run"):
        open_reader("redis", stream="s", url="redis://127.0.0.1:1/0")
    with pytest.raises(ValueError, match="needs url and run"):
        open_writer("redis", stream="s", writer_id="a", url="", run="r")


# --- redis ------------------------------------------------------------------------------------


@pytest.mark.redis
def test_redis_server_binds_loopback_only(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    assert client.config_get("bind")["bind"] == "127.0.0.1"
    assert client.config_get("protected-mode")["protected-mode"] == "yes"
    client.close()
    try:  # the address this host uses towards other machines, if it has one
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # UDP connect sends nothing
            external = s.getsockname()[0]
    except OSError:
        external = None
    if external and not external.startswith("127."):
        with pytest.raises(OSError):
            socket.create_connection((external, redis_server.port), timeout=1.0).close()
    with pytest.raises(ValueError, match="loopback"):
        start_redis_server(Path("/nonexistent"), bind="0.0.0.0")


@pytest.mark.redis
def test_redis_runs_are_namespaced(redis_server: RedisServer) -> None:
    url = redis_server.url
    one = Where("redis", {"url": url, "run": f"ns-{uuid.uuid4().hex[:8]}"})
    two = Where("redis", {"url": url, "run": f"ns-{uuid.uuid4().hex[:8]}"})
    with one.writer("a") as w:
        w.write({"run": 1})
    with two.reader() as r:
        assert r.read(10, timeout_s=0.05) == []
    client = redis.Redis.from_url(url)
    assert client.xlen(stream_key(one.location["run"], "rollouts")) == 1
    client.close()


def test_redis_key_of_a_run_name_and_run_id() -> None:
    key = stream_key("my-run:20261123-a1b2", "rollouts")
    assert key == "pipelinerl:my-run:20261123-a1b2:rollouts"
    for bad in ("my-run:", ":x", "my run", "a:b c"):
        with pytest.raises(ValueError, match="must match"):
            stream_key(bad, "rollouts")


@pytest.mark.redis
def test_redis_trim_keeps_records_after_offsets(redis_server: RedisServer) -> None:
    run = f"trim-{uuid.uuid4().hex[:8]}"
    where = Where("redis", {"url": redis_server.url, "run": run})
    with where.writer("a") as w:
        w.write_many({"i": i} for i in range(20))
    with where.reader() as r:
        assert len(drain(r, 8)) == 8
        saved = r.offsets()
        drain(r, 5)  # read past the checkpoint
        assert isinstance(r, RedisStreamReader)
        assert r.trim(saved) == 8
    with where.reader(offsets=saved) as resumed:
        assert [x["i"] for x in drain(resumed, 12)] == list(range(8, 20))


def test_redis_connection_error_names_url() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    url = f"redis://:hunter2@127.0.0.1:{port}/0"
    with pytest.raises(StreamConnectionError, match=f"127.0.0.1:{port}") as err:
        open_writer("redis", url=url, run="r", stream="s", writer_id="a")
    assert "hunter2" not in str(err.value)
    with pytest.raises(StreamConnectionError, match=f"127.0.0.1:{port}"):
        open_reader("redis", url=url, run="r", stream="s")


@pytest.mark.redis
def test_redis_server_restart_with_append_only_file_loses_nothing(tmp_path: Path) -> None:
    """Resume of a whole run: the server restarts in the run dir, the trainer from offsets."""
    loc = {"run": "r", "stream": "rollouts"}
    with start_redis_server(tmp_path / "redis") as server:
        with open_writer("redis", url=server.url, writer_id="a", **loc) as w:
            w.write_many({"i": i} for i in range(50))
        with open_reader("redis", url=server.url, **loc) as r:
            assert [x["i"] for x in drain(r, 20)] == list(range(20))
            saved = r.offsets()
    with start_redis_server(tmp_path / "redis") as server:
        with open_reader("redis", url=server.url, offsets=saved, **loc) as r:
            assert [x["i"] for x in drain(r, 30)] == list(range(20, 50))
            assert r.read(10, timeout_s=0.05) == []


@pytest.mark.redis
def test_redis_writer_that_stopped_retrying_fails_at_once_when_its_server_is_gone(
        tmp_path: Path) -> None:
    """What a trainer writes as it unwinds, when a launcher killed outright took the run's
    redis-server with it: before, the write reconnected for about a minute (CI saw the orphaned
    trainer still running 10 s after the launcher died)."""
    server = start_redis_server(tmp_path, appendonly=False)
    writer = open_writer("redis", url=server.url, run="r", stream="control", writer_id="t")
    writer.write({"i": 0})
    server.stop()
    writer.stop_retrying()
    started = time.monotonic()
    with pytest.raises(StreamConnectionError, match=server.url.split("//")[1]):
        writer.write({"type": "stop"})
    assert time.monotonic() - started < 10  # retrying would try for stream.timeout_s (60 s)
    writer.close()


@pytest.fixture
def stalled_server(tmp_path: Path):
    """A redis-server that stops answering (SIGSTOP: a hung host) once the test says so; its
    kernel still accepts connections, so every try waits a whole socket timeout."""
    server = start_redis_server(tmp_path, appendonly=False)
    try:
        yield server
    finally:
        server.proc.send_signal(signal.SIGCONT)
        server.stop()


def _fails_within(call: Any, url: str, timeout_s: float) -> float:
    started = time.monotonic()
    with pytest.raises(StreamConnectionError,
                       match=rf"{url.split('//')[1]}.*stream.timeout_s={timeout_s:g} s"):
        call()
    return time.monotonic() - started


@pytest.mark.redis
@pytest.mark.parametrize("operation", ["read", "write", "write_many", "ledger claim"])
def test_an_operation_on_a_stalled_redis_server_fails_within_the_stream_timeout(
        stalled_server: RedisServer, operation: str) -> None:
    """Before, each of 30 tries waited a 30 s socket timeout: a trainer's read or an actor's
    write outlived every timeout of the run by a quarter of an hour (issue 45)."""
    from pipelinerl.rollouts.admission import open_ledger

    url, timeout_s = stalled_server.url, 4.0
    loc = {"url": url, "run": "r", "stream": "rollouts", "timeout_s": timeout_s}
    reader = open_reader("redis", **loc)
    writer = open_writer("redis", writer_id="a", **loc)
    ledger = open_ledger("redis", url=url, run="r", timeout_s=timeout_s)
    calls = {"read": lambda: reader.read(10, timeout_s=60.0),
             "write": lambda: writer.write({"i": 0}),
             "write_many": lambda: writer.write_many({"i": i} for i in range(3)),
             "ledger claim": lambda: ledger.claim(0, 1, 0, 8)}
    stalled_server.proc.send_signal(signal.SIGSTOP)
    took = _fails_within(calls[operation], url, timeout_s)
    # At least one silent try (a third of the budget), never past the budget.
    assert timeout_s / 3 - 0.2 < took <= timeout_s + 0.5, took
    stalled_server.proc.send_signal(signal.SIGCONT)
    for closing in (reader, writer, ledger):
        closing.close()


@pytest.mark.redis
def test_a_redis_server_back_within_the_stream_timeout_is_ridden_out(tmp_path: Path) -> None:
    """Stalled for 5 s of a 12 s budget (one try waits 4 s): the write's first try times out,
    the server still runs the command it had buffered, the retry is not stored again
    (_ADD_ONCE), and the reader gets each record once."""
    import threading

    with start_redis_server(tmp_path, appendonly=False) as server:
        loc = {"url": server.url, "run": "r", "stream": "rollouts", "timeout_s": 12.0}
        with open_writer("redis", writer_id="a", **loc) as w, open_reader("redis", **loc) as r:
            w.write({"i": 0})
            server.proc.send_signal(signal.SIGSTOP)
            threading.Timer(5.0, server.proc.send_signal, [signal.SIGCONT]).start()
            started = time.monotonic()
            w.write({"i": 1})  # waits for the server, then lands
            assert 4.5 < time.monotonic() - started < 12, time.monotonic() - started
            assert [x["i"] for x in drain(r, 2)] == [0, 1]
            assert r.read(10, timeout_s=0.05) == []


@pytest.mark.redis
@pytest.mark.parametrize("operation", ["read", "write", "write_many", "ledger claim"])
def test_an_operation_across_a_redis_server_restart_within_the_stream_timeout_succeeds(
        tmp_path: Path, operation: str) -> None:
    """The server is down for 2 s of a 12 s budget, then back on its port with its append-only
    file: each operation waits for it and succeeds, its record stored once. Before, under
    redis-py 5.x, each failed at once: the client raised before its retry ran."""
    import threading

    from pipelinerl.rollouts.admission import open_ledger

    server = start_redis_server(tmp_path / "redis")
    url, timeout_s = server.url, 12.0
    loc = {"url": url, "run": "r", "stream": "rollouts", "timeout_s": timeout_s}
    reader, writer = open_reader("redis", **loc), open_writer("redis", writer_id="a", **loc)
    ledger = open_ledger("redis", url=url, run="r", timeout_s=timeout_s)
    writer.write({"i": 0})
    calls = {"read": lambda: reader.read(10, timeout_s=0.0),
             "write": lambda: writer.write({"i": 1}),
             "write_many": lambda: writer.write_many({"i": i} for i in range(1, 4)),
             "ledger claim": lambda: ledger.claim(0, 1, 0, 8)}
    expected = {"read": [{"i": 0}], "write": None, "write_many": None, "ledger claim": True}
    stored = {"read": [0], "write": [0, 1], "write_many": [0, 1, 2, 3], "ledger claim": [0]}
    back: list[RedisServer] = []
    server.stop()
    restart = threading.Timer(2.0, lambda: back.append(
        start_redis_server(tmp_path / "redis", port=server.port)))
    restart.start()
    try:
        started = time.monotonic()
        assert calls[operation]() == expected[operation]
        assert 1.5 < time.monotonic() - started < timeout_s, time.monotonic() - started
        with open_reader("redis", **loc) as again:
            assert [x["i"] for x in drain(again, len(stored[operation]))] == stored[operation]
            assert again.read(10, timeout_s=0.05) == []
    finally:
        restart.join()
        for closing in (reader, writer, ledger):
            closing.close()
        for restarted in back:
            restarted.stop()


@pytest.mark.redis
@pytest.mark.parametrize("call", ["write", "write_many"])
def test_a_second_live_redis_writer_with_the_same_id_fails_naming_the_stream_and_the_id(
        redis_server: RedisServer, call: str) -> None:
    """An actor restarted while its predecessor still runs: both write as `a`, from the same
    sequence number. Before, the second one's record was skipped as if it were a retry of the
    first's and its write returned: three writes, two records, no error."""
    where = Where("redis", {"url": redis_server.url, "run": f"test-{uuid.uuid4().hex[:12]}"})
    key = stream_key(where.location["run"], where.stream)
    with where.writer("a") as old, where.writer("a") as new, where.reader() as r:
        old.write({"i": 0})
        with pytest.raises(WriterIdInUse,
                           match=rf"another live writer with writer id 'a' .*{re.escape(key)}"):
            new.write({"i": 1}) if call == "write" else new.write_many([{"i": 1}])
        old.write({"i": 2})
        with pytest.raises(WriterIdInUse):  # it keeps failing while the other one writes
            new.write({"i": 3})
        assert [x["i"] for x in drain(r, 2)] == [0, 2]
        assert r.read(10, timeout_s=0.05) == []


@pytest.mark.redis
def test_a_redis_writer_whose_id_a_newer_process_took_fails_at_its_next_write(
        redis_server: RedisServer) -> None:
    """The other order: the restarted actor writes first, so its stalled predecessor's next
    write is the one that collides."""
    where = Where("redis", {"url": redis_server.url, "run": f"test-{uuid.uuid4().hex[:12]}"})
    with where.writer("a") as old:
        old.write({"i": 0})
        with where.writer("a") as new, where.reader() as r:
            new.write({"i": 1})
            with pytest.raises(WriterIdInUse, match="writer id 'a'"):
                old.write({"i": 2})
            new.write({"i": 3})
            assert [x["i"] for x in drain(r, 3)] == [0, 1, 3]


@pytest.mark.redis
def test_redis_server_start_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="apt-get install redis-server"):
        start_redis_server(tmp_path, binary="redis-server-missing")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match="Address already in use"):
            start_redis_server(tmp_path, port=taken.getsockname()[1], appendonly=False)


def test_local_segments_roll_are_read_in_order_resume_and_trim(tmp_path: Path) -> None:
    record = {"pad": "x" * 40}
    with LocalStreamWriter(tmp_path, "s", "a", segment_bytes=200) as w:
        for i in range(12):
            w.write({"i": i, **record})
    names = sorted(p.name for p in (tmp_path / "s").glob("*.jsonl"))
    assert names[0] == "a.jsonl" and "a@1.jsonl" in names and len(names) >= 3
    per_segment = (tmp_path / "s" / "a.jsonl").read_bytes().count(b"\n")
    r = LocalStreamReader(tmp_path, "s")
    assert [x["i"] for x in r.read(5, timeout_s=0.5)] == [0, 1, 2, 3, 4]
    saved = json.loads(json.dumps(r.offsets()))  # as a checkpoint stores them
    assert isinstance(saved["a"], list)  # [segment, offset] past segment 0
    # Whole segments before the saved position go; the one it is in stays.
    trimmed = r.trim(saved)
    assert trimmed == saved["a"][0] * per_segment
    assert not (tmp_path / "s" / "a.jsonl").exists()
    r.close()
    with LocalStreamWriter(tmp_path, "s", "a", segment_bytes=200) as w:  # a restarted writer
        assert w.last_record()["i"] == 11  # its predecessor's newest, across segments
        w.write({"i": 12, **record})
    resumed = LocalStreamReader(tmp_path, "s", offsets=saved)
    assert [x["i"] for x in drain(resumed, 8)] == list(range(5, 13))
    # A reader without offsets starts at the oldest segment left.
    assert drain(LocalStreamReader(tmp_path, "s"), 13 - trimmed)[0]["i"] == trimmed


def test_local_last_record_passes_over_a_torn_tail(tmp_path: Path) -> None:
    with LocalStreamWriter(tmp_path, "s", "a") as w:
        assert w.last_record() is None
        w.write({"i": 0})
        w.write({"i": 1})
    with (tmp_path / "s" / "a.jsonl").open("ab") as f:
        f.write(b'{"i": 2, "tok')
    with LocalStreamWriter(tmp_path, "s", "a") as w:
        assert w.last_record() == {"i": 1}


def test_redis_last_record_is_the_writers_own(redis_server: RedisServer) -> None:
    loc = {"url": redis_server.url, "run": f"last-{time.time_ns()}"}
    with open_writer("redis", stream="s", writer_id="a", **loc) as a, \
            open_writer("redis", stream="s", writer_id="b", **loc) as b:
        assert a.last_record() is None
        a.write({"i": 0})
        for i in range(300):  # more than one page back to a's record
            b.write({"j": i})
        assert a.last_record() == {"i": 0} and b.last_record() == {"j": 299}


def test_local_last_record_survives_a_trim_of_every_segment_holding_it(tmp_path: Path) -> None:
    """The writer rolled on to an empty segment and the reader trimmed the full ones: a
    restarted writer still finds its predecessor's newest record (on main: None, so a
    restarted actor began its count and group ids again)."""
    with LocalStreamWriter(tmp_path, "s", "a", segment_bytes=30) as w:
        for i in range(3):
            w.write({"i": i, "pad": "x" * 20})  # each record fills a segment
    r = LocalStreamReader(tmp_path, "s")
    assert [x["i"] for x in r.read(10, timeout_s=0.5)] == [0, 1, 2]
    r.trim(r.offsets())
    r.close()
    assert [p.name for p in (tmp_path / "s").glob("*.jsonl")] == ["a@3.jsonl"]
    with LocalStreamWriter(tmp_path, "s", "a", segment_bytes=30) as w:
        assert w.last_record()["i"] == 2
    (tmp_path / "s" / "a.last.json").unlink()  # lost: the writer refuses to guess
    with LocalStreamWriter(tmp_path, "s", "a", segment_bytes=30) as w, \
            pytest.raises(WriterStateLost, match="its last record"):
        w.last_record()


def test_redis_last_record_survives_a_trim_of_the_whole_stream(redis_server: RedisServer) -> None:
    loc = {"url": redis_server.url, "run": f"trimmed-{time.time_ns()}"}
    with open_writer("redis", stream="s", writer_id="a", **loc) as a:
        a.write({"i": 0})
        a.write({"i": 1})
    with open_reader("redis", stream="s", **loc) as r:
        assert len(r.read(10, timeout_s=0.5)) == 2
        assert r.trim(r.offsets()) == 2
    with open_writer("redis", stream="s", writer_id="a", **loc) as a:
        assert a.last_record() == {"i": 1}
    redis.Redis.from_url(redis_server.url).delete(stream_key(loc["run"], "s") + ":last")
    with open_writer("redis", stream="s", writer_id="a", **loc) as a, \
            pytest.raises(WriterStateLost, match="its last record is gone"):
        a.last_record()
