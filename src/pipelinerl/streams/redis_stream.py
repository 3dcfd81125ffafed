"""Redis Streams backend: writers XADD, the reader XREADs from the last id it returned.

Why plain XREAD and not consumer groups: the trainer's position must be saved in its own
checkpoint, atomically with the weights it trained on. A consumer group keeps that position on
the server instead (XACK), where it runs ahead of the checkpoint: after a crash the group
would skip records the restored model never saw. With XREAD the position is just the last id
the reader returned (`offsets()`), the server holds no reader state, and a reader reopened
with saved offsets continues right after it: nothing lost, nothing repeated.

Each record is one entry `{w: writer_id, d: JSON}` in the stream `pipelinerl:<run>:<stream>`
(a run's roles pass `<name>:<run_id>` as `run`). Entry ids are assigned by the server (`*`),
so several writers can share a stream, and each writer's records keep its order. Nothing here
ever deletes a stream; trimming happens only through `RedisStreamReader.trim`, below ids the
caller says are safely checkpointed.
"""

from __future__ import annotations

import functools
import json
import re
import time
import uuid
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pipelinerl.streams.base import WriterIdInUse, WriterStateLost

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
# How long one operation may wait on a server that does not answer (down, restarting, stalled)
# before it fails naming the server: `stream.timeout_s` of the config, this by default.
DEFAULT_TIMEOUT_S = 60.0
_MAX_SOCKET_TIMEOUT_S = 30.0
_MAX_BLOCK_S = 5.0  # XREAD BLOCK is cut into slices well under the socket timeout
_PIPELINE_BYTES = 4 << 20  # write_many sends this much per round trip, bounding its buffer
_PIPELINE_RECORDS = 1000
_BACKOFF_FIRST_S, _BACKOFF_CAP_S = 0.1, 2.0
# What a server that went away or went silent raises (BusyLoadingError, while a restarted one
# loads its append-only file, is a ConnectionError).
_RETRIED = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
_T = TypeVar("_T")


class StreamConnectionError(ConnectionError):
    """The Redis server behind a stream cannot be reached."""


def stream_key(run: str, stream: str) -> str:
    """`pipelinerl:<run>:<stream>`; `run` may have parts joined by `:` (name:run_id)."""
    for kind, name in (*(("run", part) for part in run.split(":")), ("stream", stream)):
        if not _NAME_RE.match(name):
            raise ValueError(f"{kind} {name!r} must match {_NAME_RE.pattern}")
    return f"pipelinerl:{run}:{stream}"


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


@contextmanager
def naming_url(url: str, timeout_s: float | None = None) -> Iterator[None]:
    try:
        yield
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
        within = f" (tried for up to stream.timeout_s={timeout_s:g} s)" if timeout_s else ""
        raise StreamConnectionError(f"redis stream server at {_redact(url)}: {e}{within}") from e


def socket_timeout(timeout_s: float) -> float:
    """One silent try's share of an operation's time: a third, so a stalled server is tried
    more than once, and at most 30 s."""
    return min(_MAX_SOCKET_TIMEOUT_S, timeout_s / 3)


def within_deadline(timeout_s: float | None, do: Callable[[], _T]) -> _T:
    """`do()`, tried again with backoff (0.1 s doubling to 2 s) while the server is gone or
    silent and one more try, answered or not, still ends within `timeout_s` of the start (None:
    one try). A count of tries cannot bound time: each try at a stalled server (SIGSTOP, a
    hung host) waits a whole socket timeout, and 30 of them kept a read waiting a quarter of
    an hour."""
    if timeout_s is None:
        return do()
    deadline = time.monotonic() + timeout_s
    try_s = socket_timeout(timeout_s)
    pause = _BACKOFF_FIRST_S
    while True:
        try:
            return do()
        except _RETRIED:
            if time.monotonic() + pause + try_s > deadline:
                raise
            time.sleep(pause)
            pause = min(2 * pause, _BACKOFF_CAP_S)


class DeadlineClient(redis.Redis):
    """A client whose every command is retried within `deadline_s` (within_deadline; None: one
    try). The loop is ours, not a `redis.retry.Retry` handed to the client: how a client uses
    that changed between redis-py versions (5.x disconnects and raises, before any retry, every
    error its connection's `retry_on_error` does not list: a stalled server was tried once, a
    restarting one not at all), while `execute_command`, which every command goes through, is
    the same in each (a pipeline's execute is not: write_many retries it itself)."""

    deadline_s: float | None = None

    def execute_command(self, *args: Any, **options: Any) -> Any:
        return within_deadline(self.deadline_s,
                               functools.partial(super().execute_command, *args, **options))


def connect(url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> DeadlineClient:
    """A client whose every operation retries a server that went away or went silent for up to
    `timeout_s`, then fails naming the URL. A server that is not there at open is reported at
    once, not after the retries."""
    if timeout_s <= 0:
        raise ValueError(f"stream.timeout_s must be > 0, got {timeout_s}")
    try_s = socket_timeout(timeout_s)
    with naming_url(url):
        client = DeadlineClient.from_url(
            url,
            socket_timeout=try_s,
            socket_connect_timeout=min(5.0, try_s),
            retry=Retry(NoBackoff(), 0),  # one try inside redis-py: the retries are ours
            protocol=2,  # fixes the reply shapes parsed below (RESP3 returns dicts)
        )
        client.ping()
    client.deadline_s = timeout_s
    return client


def parse_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    if not (ms.isdigit() and seq.isdigit()):
        raise ValueError(f"malformed redis stream id {entry_id!r} (expected '<ms>-<seq>')")
    return int(ms), int(seq)


# XADD once per (writer, sequence number): a write retried after its reply was lost (the
# server restarted, the connection dropped) is not stored twice. The writer's newest number
# lives beside the stream, updated in the same script, so it survives the server's restart.
# A number already stored is a retry only if this writer object stored it (its token, ARGV[4],
# is the one beside the number): else another live writer has the same id (a restarted role
# whose predecessor still runs), and skipping would drop this record without a word (-1).
_ADD_ONCE = """
local last = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if tonumber(ARGV[2]) <= last then
  if redis.call('HGET', KEYS[4], ARGV[1]) == ARGV[4] then return 0 end
  return -1
end
redis.call('XADD', KEYS[1], '*', 'w', ARGV[1], 'd', ARGV[3])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[4], ARGV[1], ARGV[4])
return 1
"""
_ANOTHER_WRITER = -1


class RedisStreamWriter:
    def __init__(self, url: str, run: str, stream: str, writer_id: str,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.key = stream_key(run, stream)
        self._seq_key = f"{self.key}:seq"
        # Each writer's newest record, set in the same script as its XADD: trims never reach
        # it, so a restarted writer learns where its predecessor stopped (last_record).
        self._last_key = f"{self.key}:last"
        self._owner_key = f"{self.key}:owner"  # the token of whoever stored the newest number
        self._writer_id = writer_id.encode()
        self._token = uuid.uuid4().hex.encode()
        # Retried writes are safe: each record carries the writer's next sequence number and
        # the script stores it once (_ADD_ONCE).
        self._client = connect(url, timeout_s)
        self._add_once = self._client.register_script(_ADD_ONCE)
        with naming_url(url, timeout_s):
            self._seq = int(self._client.hget(self._seq_key, self._writer_id) or 0)

    def _data(self, record: dict[str, Any]) -> bytes:
        # Python's JSON dialect keeps NaN and +-inf, so a -inf log-prob round-trips.
        return json.dumps(record, separators=(",", ":")).encode()

    def _add(self, seq: int, data: bytes, client: Any) -> Any:
        return self._add_once(keys=[self.key, self._seq_key, self._last_key, self._owner_key],
                              args=[self._writer_id, seq, data, self._token], client=client)

    def _check(self, outcomes: list[int]) -> None:
        if _ANOTHER_WRITER in outcomes:
            raise WriterIdInUse(
                f"another live writer with writer id {self._writer_id.decode()!r} writes to "
                f"{self.key} (a restarted role whose predecessor still runs?): its records and "
                "this one's would collide, so the colliding record was not stored")

    def write(self, record: dict[str, Any]) -> None:
        self._seq += 1
        with naming_url(self.url, self._client.deadline_s):
            self._check([self._add(self._seq, self._data(record), self._client)])

    def write_many(self, records: Iterable[dict[str, Any]]) -> None:
        """Pipelined: one round trip per few MB instead of one per record."""
        batch: list[tuple[int, bytes]] = []
        batch_bytes = 0
        for record in records:
            self._seq += 1
            batch.append((self._seq, self._data(record)))
            batch_bytes += len(batch[-1][1])
            if batch_bytes >= _PIPELINE_BYTES or len(batch) >= _PIPELINE_RECORDS:
                self._send(batch)
                batch, batch_bytes = [], 0
        if batch:
            self._send(batch)

    def _send(self, batch: list[tuple[int, bytes]]) -> None:
        """`batch` (sequence number, data) in one round trip. A retry builds the pipeline
        again (a failed execute empties it) and sends the whole batch: what landed before is
        not stored twice (_ADD_ONCE)."""
        def once() -> list[int]:
            with self._client.pipeline(transaction=False) as pipe:
                for seq, data in batch:
                    self._add(seq, data, pipe)
                return pipe.execute()

        with naming_url(self.url, self._client.deadline_s):
            self._check(within_deadline(self._client.deadline_s, once))

    def stop_retrying(self) -> None:
        """From here on a write to a server that is gone fails at once: for what a role writes
        while it stops, when the server may be stopping beside it."""
        self._client.deadline_s = None

    def last_record(self) -> dict[str, Any] | None:
        """The newest record this writer id wrote (an earlier process's too): how a restarted
        writer learns where its predecessor stopped."""
        with naming_url(self.url, self._client.deadline_s):
            data = self._client.hget(self._last_key, self._writer_id)
        if data is None:
            if self._seq:
                raise WriterStateLost(f"writer {self._writer_id.decode()!r} wrote {self._seq} "
                                      f"records to {self.key}, but its last record is gone")
            return None
        return json.loads(data)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "RedisStreamWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisStreamReader:
    def __init__(
        self, url: str, run: str, stream: str, offsets: dict[str, str] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.url = url
        self.timeout_s = timeout_s
        # XREAD BLOCK slices end well within one try's socket timeout.
        self._block_s = min(_MAX_BLOCK_S, socket_timeout(timeout_s) / 2)
        self.stream = stream
        self.key = stream_key(run, stream)
        # "0-0": a fresh reader starts at the beginning, so records written before the trainer
        # came up (actors start first) are not skipped.
        self._last_id = (offsets or {}).get(stream, "0-0")
        parse_id(self._last_id)  # reject a malformed saved offset now
        # Reads are idempotent (the position is ours, not the server's): retrying is safe.
        self._client = connect(url, timeout_s)

    def read(self, max_count: int, timeout_s: float) -> list[dict[str, Any]]:
        """Up to `max_count` records; waits at most `timeout_s` for the first one."""
        if max_count <= 0:
            return []
        deadline = time.monotonic() + timeout_s
        with naming_url(self.url, self.timeout_s):
            while True:
                remaining = deadline - time.monotonic()
                # BLOCK 0 would wait forever, so a spent timeout polls once without blocking.
                block_ms = None
                if remaining > 0:
                    block_ms = max(1, int(min(remaining, self._block_s) * 1000))
                reply = self._client.xread(
                    {self.key: self._last_id}, count=max_count, block=block_ms
                )
                if reply:
                    entries = reply[0][1]
                    self._last_id = entries[-1][0].decode()
                    return [json.loads(fields[b"d"]) for _, fields in entries]
                if block_ms is None or deadline <= time.monotonic():
                    return []

    def offsets(self) -> dict[str, str]:
        """The id of the last record returned, per stream name."""
        return {self.stream: self._last_id}

    def trim(self, offsets: dict[str, str]) -> int:
        """Delete the records up to and including `offsets` (from a durable checkpoint).

        Call it only once no restart can go back before `offsets`; records after them, read or
        not, are kept. Returns how many entries were deleted.
        """
        ms, seq = parse_id(offsets[self.stream])
        with naming_url(self.url, self.timeout_s):
            # MINID keeps ids >= its argument, so pass the id just after the saved one.
            return int(self._client.xtrim(self.key, minid=f"{ms}-{seq + 1}", approximate=False))

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "RedisStreamReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
