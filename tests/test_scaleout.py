"""Scale-out: 2 trainer ranks (torchrun, DDP over gloo) and 2 actors over a real redis-server."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from pipelinerl.config import load_config
from pipelinerl.roles.launch import launch
from pipelinerl.streams import open_reader
from pipelinerl.types import Group

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arithmetic.yaml"


def _read_all(url: str, run: str, stream: str) -> list[dict]:
    reader = open_reader("redis", stream=stream, url=url, run=run)
    records, batch = [], reader.read(max_count=1000, timeout_s=1.0)
    while batch:
        records += batch
        batch = reader.read(max_count=1000, timeout_s=0.2)
    reader.close()
    return records


def test_two_trainer_ranks_two_actors_over_redis_train_every_sample_once(tmp_path, warm_cache,
                                                                       redis_server):
    cfg = load_config(EXAMPLE, [
        "name=scaleout", f"output_dir={tmp_path / 'runs'}",
        f"warmstart.cache_dir={warm_cache}", "warmstart.steps=20", "eval.enabled=false",
        # Places are global (pipelinerl.rollouts.admission): with max_lag 4 the first 20 places, a whole
        # 5-step run, could all go to whichever actor started first. max_lag 1 and room for two
        # groups per actor leave 8 places at version 0 and 4 per step after, more than one
        # actor can hold at once: both must contribute.
        "engine.capacity=8", "actor.group_size=4", "trainer.batch_size=16", "actor.max_lag=1",
        "trainer.max_steps=5", "trainer.num_procs=2", "actor.num_actors=2",
        "stream.backend=redis", f"stream.redis_url={redis_server.url}",
        "metrics.progress=false",
        "stream.keep_all=true",  # the stream is read below: no trimming after checkpoints
    ])
    assert launch(cfg) == 0

    audit = [json.loads(line) for line in (cfg.run_dir / "trained.jsonl").read_text().splitlines()]
    assert [a["step"] for a in audit] == [1, 2, 3, 4, 5]
    trained = [gid for a in audit for gid in a["trained"]]
    dropped = [gid for a in audit for ids in a["dropped"].values() for gid in ids]
    assert len(trained) == 5 * 16 // 4
    # Every group the actors published was trained at most once, or dropped with a reason, or
    # still waiting in the stream when the run stopped: none vanished, none counted twice.
    run = f"scaleout:{load_config(cfg.run_dir / 'config.yaml').run_id}"  # the launch's streams
    published = [Group.from_dict(r) for r in _read_all(redis_server.url, run, "rollouts")
                 if not r.get("heartbeat")]
    published_ids = [g.group_id for g in published]
    assert len(set(published_ids)) == len(published_ids)
    assert not Counter(trained + dropped) - Counter(published_ids)
    assert max(Counter(trained + dropped).values()) == 1

    metrics = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["samples_trained"] for m in metrics] == [16, 32, 48, 64, 80]
    # Both actors contributed and both received new weights: later groups of each actor hold
    # tokens of versions above 0.
    for actor_id in (0, 1):
        mine = [g for g in published if g.actor_id == actor_id]
        assert mine, f"actor {actor_id} published nothing"
        assert max(v for g in mine for s in g.samples for v in s.versions) >= 1
    assert metrics[-1]["lag_max"] <= cfg.actor.max_lag
