"""The run's admission ledger: how many places each actor holds, shared by all actors.

Places are global: the group in place g is expected to be trained at optimizer step g // K
(K = batch_size // group_size groups per step), so an actor holding weights of version v may
start a group only while the run's places in use stay below a limit set by v (actor.Schedule).
Places in use = the sum of the actors' claims - the groups the trainer dropped (it sends that
count on the control stream). Claims are taken atomically across the actors' processes, so
admission is exact whatever each actor's pace: a fast actor takes the places a slow one does
not, and no group becomes staler than max_lag because another actor fell behind.

An actor's claim = its groups published (over every process of it) + started and not yet
published; it grows when the actor starts a group and shrinks when the actor drops one itself
(failed verification, zero variance). A restarted actor sets it to what was published: its
predecessor's groups in flight died with it, so their places go back.

Every operation sets the actor's claim to a value the actor computed (only it changes its
own entry), so a call retried after a lost reply does the same thing again: no place is ever
counted twice.

Backends follow the stream's: `local`, a JSON file under the run's stream directory with an
exclusive lock; `redis`, a hash beside the streams, claimed in a Lua script.
"""

from __future__ import annotations

import fcntl
import json
from pathlib import Path
from typing import Protocol

from pipelinerl.streams.redis_stream import connect, naming_url, stream_key

_CLAIM = """
local total = 0
for _, v in ipairs(redis.call('HVALS', KEYS[1])) do total = total + tonumber(v) end
local own = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if total - own + tonumber(ARGV[2]) - 1 - tonumber(ARGV[3]) >= tonumber(ARGV[4]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


class Ledger(Protocol):
    def claim(self, actor_id: int, new_claim: int, returned: int, limit: int) -> bool:
        """Set `actor_id`'s claim to `new_claim` (its current + 1) if the place it takes,
        (the other actors' claims + new_claim - 1 - `returned`), is below `limit`."""
        ...

    def set(self, actor_id: int, claim: int) -> None:
        """Set `actor_id`'s claim (after dropping a group, or on restart)."""
        ...

    def close(self) -> None: ...


def _admits(claims: dict[str, int], actor_id: int, new_claim: int, returned: int, limit: int) -> bool:
    others = sum(claims.values()) - claims.get(str(actor_id), 0)
    return others + new_claim - 1 - returned < limit


class MemoryLedger:
    """In one process: an actor alone (its unit tests, a run of one actor by hand)."""

    def __init__(self) -> None:
        self.entries: dict[str, int] = {}

    def claim(self, actor_id: int, new_claim: int, returned: int, limit: int) -> bool:
        if not _admits(self.entries, actor_id, new_claim, returned, limit):
            return False
        self.entries[str(actor_id)] = new_claim
        return True

    def set(self, actor_id: int, claim: int) -> None:
        self.entries[str(actor_id)] = claim

    def claims(self) -> dict[str, int]:
        return dict(self.entries)

    def close(self) -> None:
        pass


class LocalLedger:
    def __init__(self, root: str | Path) -> None:
        self.path = Path(root) / "admission.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+")

    def _locked_claims(self) -> dict[str, int]:
        self._file.seek(0)
        text = self._file.read()
        return json.loads(text) if text.strip() else {}

    def _write(self, claims: dict[str, int]) -> None:
        self._file.seek(0)
        self._file.truncate()
        self._file.write(json.dumps(claims))
        self._file.flush()

    def claim(self, actor_id: int, new_claim: int, returned: int, limit: int) -> bool:
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)
        try:
            claims = self._locked_claims()
            if not _admits(claims, actor_id, new_claim, returned, limit):
                return False
            claims[str(actor_id)] = new_claim
            self._write(claims)
            return True
        finally:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)

    def set(self, actor_id: int, claim: int) -> None:
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)
        try:
            claims = self._locked_claims()
            claims[str(actor_id)] = claim
            self._write(claims)
        finally:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)

    def claims(self) -> dict[str, int]:
        fcntl.flock(self._file.fileno(), fcntl.LOCK_SH)
        try:
            return self._locked_claims()
        finally:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)

    def close(self) -> None:
        self._file.close()


class RedisLedger:
    def __init__(self, url: str, run: str, timeout_s: float) -> None:
        self.key = stream_key(run, "admission")
        self._client = connect(url, timeout_s)  # every operation is idempotent: retried
        self._claim = self._client.register_script(_CLAIM)
        self.url, self.timeout_s = url, timeout_s

    def claim(self, actor_id: int, new_claim: int, returned: int, limit: int) -> bool:
        with naming_url(self.url, self.timeout_s):
            return bool(self._claim(keys=[self.key], args=[actor_id, new_claim, returned, limit]))

    def set(self, actor_id: int, claim: int) -> None:
        with naming_url(self.url, self.timeout_s):
            self._client.hset(self.key, str(actor_id), claim)

    def claims(self) -> dict[str, int]:
        with naming_url(self.url, self.timeout_s):
            return {k.decode(): int(v) for k, v in self._client.hgetall(self.key).items()}

    def close(self) -> None:
        self._client.close()


def open_ledger(backend: str, *, root: str | Path | None = None, url: str | None = None,
                run: str | None = None, timeout_s: float = 60.0) -> LocalLedger | RedisLedger:
    """The ledger beside the run's streams (callers pass every location, as to open_reader)."""
    if backend == "local":
        if root is None:
            raise ValueError("the local admission ledger needs root (a directory)")
        return LocalLedger(root)
    if not url or not run:
        raise ValueError("the redis admission ledger needs url and run")
    return RedisLedger(url, run, timeout_s)
