"""`pipelinerl audit RUN_DIR`: did every group the actors published reach the trainer once?

Reads the run's rollout stream (every attempt's records), its newest checkpoint and
trained.jsonl (cut back at each resume, docs/reliability.md), and counts per actor and in total:
- published: groups in the stream;
- trained: groups in trained.jsonl's steps;
- dropped: groups the trainer dropped, by reason (stale, negative_lag, after_checkpoint,
  malformed);
- unread: published after the point the trainer had read to at its newest checkpoint, or read
  and waiting in it: the actors publish ahead of the trainer, so a finished run ends with some;
- lost: published before that point, and neither trained, dropped nor waiting;
- duplicated: trained or dropped more than once;
- dropped by actors: groups an actor dropped before publishing (zero variance, a failed
  verifier or environment, ...), by reason, from each actor process's newest record (a
  process killed outright loses its counts since its last group or heartbeat).
The last line reads `published N trained N dropped N lost N duplicated N`; the exit code is
1 when lost or duplicated is above 0.
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelinerl.config import Config, load_config
from pipelinerl.metrics.tables import markdown_table
from pipelinerl.records import read_rows
from pipelinerl.run.checkpoint import latest_checkpoint, read_state
from pipelinerl.run.group_ids import actor_of, restart_of
from pipelinerl.streams.local import segment_name


@dataclass
class Published:
    group_id: str
    actor_id: int
    read_by_checkpoint: bool  # at or before the checkpoint's reader offsets


@dataclass
class Tally:
    published: int = 0
    trained: int = 0
    dropped: Counter = field(default_factory=Counter)
    unread: int = 0
    lost: int = 0
    duplicated: int = 0
    actor_dropped: Counter = field(default_factory=Counter)

    def row(self, name: str) -> list[str]:
        return [name, str(self.published), str(self.trained), str(sum(self.dropped.values())),
                _by_reason(self.dropped), str(self.unread), str(self.lost), str(self.duplicated),
                _by_reason(self.actor_dropped)]


HEADER = ["", "published", "trained", "dropped", "dropped by reason", "unread", "lost",
          "duplicated", "dropped by actors"]


def _by_reason(counts: Counter) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-"


def _actor_drops(record: dict[str, Any]) -> tuple[tuple[int, int, int], dict[str, int] | None]:
    """(actor, attempt, process) of a group or heartbeat, and the groups that process had
    dropped by then, by reason (counts start at 0 in each process); None if it says not."""
    if record.get("heartbeat"):
        process, counts = record.get("generation", 0), record.get("skipped")
    else:
        stats = record.get("actor_stats")
        process = restart_of(str(record.get("group_id")))
        counts = None if not isinstance(stats, dict) else {
            k.removeprefix("skipped_"): v for k, v in stats.items() if k.startswith("skipped_")}
    return (record.get("actor_id", -1), record.get("attempt", 0), process), counts


Record = tuple[dict[str, Any], bool, str]  # a record, read by the checkpoint, id if it has none


def local_records(root: Path, offsets: dict[str, Any]) -> Iterator[Record]:
    """Every record of the writers' segment files, each marked read or not by `offsets`."""
    from pipelinerl.streams.local import parse_segment

    segments = sorted(p for p in (parse_segment(f.name) for f in root.glob("*.jsonl")) if p)
    for writer, segment in segments:
        saved = offsets.get(writer, 0)
        limit = (0, saved) if isinstance(saved, int) else tuple(saved)
        end = 0
        with (root / segment_name(writer, segment)).open("rb") as f:
            for line in f:
                end += len(line)
                if not line.endswith(b"\n"):
                    break  # a torn tail: never a record
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                yield record, (segment, end) <= limit, f"{writer}@{segment}:{end}"


def redis_records(cfg: Config, offsets: dict[str, str], run_dir: Path) -> Iterator[Record]:
    """The stream on the run's server; when that was the launcher's own (gone with the run),
    on a server started here over its append-only file in RUN_DIR/redis."""
    from pipelinerl.streams.redis_server import start_redis_server
    from pipelinerl.streams.redis_stream import (
        StreamConnectionError,
        connect,
        parse_id,
        stream_key,
    )

    server = None
    try:
        client = connect(cfg.stream.redis_url, cfg.stream.timeout_s)
    except StreamConnectionError:
        if not (run_dir / "redis").is_dir():
            raise
        server = start_redis_server(dir=run_dir / "redis")
        client = connect(server.url, cfg.stream.timeout_s)
    limit = parse_id(offsets.get("rollouts", "0-0"))
    last = "-"
    try:
        while entries := client.xrange(stream_key(f"{cfg.name}:{cfg.run_id}", "rollouts"),
                                       min=last, max="+", count=1000):
            for entry_id, fields in entries:
                yield (json.loads(fields[b"d"]), parse_id(entry_id.decode()) <= limit,
                       entry_id.decode())
            ms, seq = parse_id(entries[-1][0].decode())
            last = f"({ms}-{seq}"
    finally:
        client.close()
        if server is not None:
            server.stop()


def audit(run_dir: Path) -> tuple[dict[str, Tally], list[str]]:
    """Per actor (and "total"), and notes on what the audit could not see."""
    cfg = load_config(run_dir / "config.yaml")
    notes: list[str] = []
    state = read_state(latest_checkpoint(run_dir))
    source = (state or {}).get("source") or {"offsets": {}, "buffered": []}
    if state is None:
        notes.append("no checkpoint: the trainer's read position is unknown, so every group "
                     "not trained or dropped counts as unread")
    waiting = {g["group_id"] for g in source["buffered"]}
    if cfg.stream.backend == "local":
        records = local_records(run_dir / "streams" / cfg.run_id / "rollouts", source["offsets"])
    else:
        records = redis_records(cfg, source["offsets"], run_dir)
    published: list[Published] = []
    actor_drops: dict[tuple[int, int, int], dict[str, int]] = {}  # per process, its newest
    for record, read, fallback_id in records:
        process, counts = _actor_drops(record)
        if counts is not None:
            actor_drops[process] = counts
        if not record.get("heartbeat"):
            published.append(Published(record.get("group_id", fallback_id),
                                       record.get("actor_id", -1), read))
    trained: Counter = Counter()
    dropped: dict[str, str] = {}
    handled: Counter = Counter()
    steps = 0
    for row in read_rows(run_dir / "trained.jsonl"):
        steps = row["step"] if state is None else min(row["step"], state["step"])
        if state is not None and row["step"] > state["step"]:
            continue  # a crashed attempt's step after its checkpoint (not resumed)
        trained.update(row["trained"])
        handled.update(row["trained"])
        for reason, ids in row["dropped"].items():
            for gid in ids:
                dropped[gid] = reason
                handled[gid] += 1
    # Records deleted after checkpoints (stream.keep_all=false) were read by then and not
    # waiting in the checkpoint, so trained or dropped: they count as published through the
    # ids trained.jsonl holds.
    present = {p.group_id for p in published}
    trimmed = [Published(gid, actor_of(gid), True) for gid in handled if gid not in present]
    tallies: dict[str, Tally] = defaultdict(Tally)
    for p in published + trimmed:
        for t in (tallies[f"actor_{p.actor_id}"], tallies["total"]):
            t.published += 1
            if p.group_id in trained:
                t.trained += 1
            elif p.group_id in dropped:
                t.dropped[dropped[p.group_id]] += 1
            elif p.group_id in waiting or not p.read_by_checkpoint or state is None:
                t.unread += 1
            else:
                t.lost += 1
            if handled[p.group_id] > 1:
                t.duplicated += 1
    for (actor, _, _), counts in actor_drops.items():
        for t in (tallies[f"actor_{actor}"], tallies["total"]):
            t.actor_dropped.update(counts)
    recorded = source.get("trimmed", 0)
    if trimmed or recorded:
        notes.append(f"{len(trimmed)} groups trained or dropped are no longer in the stream "
                     f"(deleted after checkpoints; the newest checkpoint counts {recorded} "
                     "records deleted before it)")
    notes.append(f"{steps} optimizer steps in trained.jsonl")
    return dict(sorted(tallies.items(), key=lambda kv: (kv[0] == "total", kv[0]))), notes


def main(run_dir: str) -> int:
    path = Path(run_dir)
    if not (path / "config.yaml").exists() or not (path / "trained.jsonl").exists():
        print(f"pipelinerl audit: {path} is not a run directory (no config.yaml or "
              "trained.jsonl)", file=sys.stderr)
        return 2
    try:
        tallies, notes = audit(path)
    except ConnectionError as e:  # StreamConnectionError: names the redis address
        print(f"pipelinerl audit: cannot read the run's stream: {e}", file=sys.stderr)
        return 2
    print(markdown_table(HEADER, [t.row(name) for name, t in tallies.items()]))
    for note in notes:
        print(f"- {note}")
    total = tallies.get("total", Tally())
    print(f"published {total.published} trained {total.trained} dropped "
          f"{sum(total.dropped.values())} lost {total.lost} duplicated {total.duplicated}")
    return int(total.lost > 0 or total.duplicated > 0)
