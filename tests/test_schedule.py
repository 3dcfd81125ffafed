"""The staleness bound: actor admission (Schedule) and the trainer's hard filter."""

import itertools
import random
from dataclasses import dataclass, field

import pytest

from pipelinerl.config import ConfigError, load_config
from pipelinerl.rl.batches import BatchSource
from pipelinerl.roles.actor import Schedule
from pipelinerl.rollouts.admission import MemoryLedger
from pipelinerl.types import Group, Sample


@dataclass
class _SimActor:
    """An actor's admission bookkeeping as the real one keeps it: its claim on the run's
    shared ledger (published + in the engine), set back when it drops a group."""

    actor_id: int
    schedule: Schedule
    ledger: MemoryLedger
    capacity_groups: int
    pace: int = 1  # ticks per unit of generation delay: 3 is three times slower
    version: int = 0
    published: int = 0
    in_engine: list[tuple[int, int]] = field(default_factory=list)  # (done_tick, version)

    def claim(self) -> bool:
        new = self.published + len(self.in_engine) + 1
        return self.ledger.claim(self.actor_id, new, 0, self.schedule.limit(self.version))


def _simulate(
    schedules: list[Schedule],
    *,
    capacity_groups: int = 1_000,
    publish_every: int = 1,
    steps: int = 12,
    delays: tuple[int, ...] = (1,),
    drop_prob: float = 0.0,
    paces: tuple[int, ...] = (),
    seed: int = 0,
) -> list[int]:
    """Actors start every group the ledger and their engine allow; a group finishes a random
    `delays` ticks later times its actor's pace (so groups arrive out of order), and with
    `drop_prob` fails verification (its place goes back). The trainer takes its batch (a round
    in conventional mode) in arrival order and publishes every `publish_every` steps (every
    round in conventional mode). Returns the lag of every trained group (started under version
    v, trained at step s: s - v); fewer than `steps` batches means the run stalled."""
    rng = random.Random(seed)
    s0 = schedules[0]
    per_step = s0.batch_size // s0.group_size
    take = per_step * (s0.conventional_g or 1)
    every = s0.conventional_g or publish_every
    ledger = MemoryLedger()
    actors = [_SimActor(a, s, ledger, capacity_groups, paces[a] if paces else 1)
              for a, s in enumerate(schedules)]
    ready: list[int] = []  # versions of finished, verified groups in arrival order
    lags: list[int] = []
    step = 0
    for tick in range(steps * 60 + 60):
        for a in actors:
            while len(a.in_engine) < a.capacity_groups and a.claim():
                a.in_engine.append((tick + a.pace * rng.choice(delays), a.version))
        for a in actors:
            for done in [g for g in a.in_engine if g[0] <= tick]:
                a.in_engine.remove(done)
                if rng.random() < drop_prob:
                    ledger.set(a.actor_id, a.published + len(a.in_engine))
                else:
                    a.published += 1
                    ready.append(done[1])
        while len(ready) >= take and step < steps:
            batch, ready = ready[:take], ready[take:]
            for i in range(0, take, per_step):
                lags += [step - v for v in batch[i:i + per_step]]
                step += 1
            if step % every == 0:
                for a in actors:
                    a.version = step
    assert len(lags) % per_step == 0
    return lags


def _actors(n: int, **kwargs) -> list[Schedule]:
    return [Schedule(**kwargs) for _ in range(n)]


@pytest.mark.parametrize("max_lag", [0, 1, 3])
def test_pipeline_admission_keeps_lag_within_bound(max_lag):
    lags = _simulate(_actors(1, batch_size=16, group_size=4, max_lag=max_lag), steps=40)
    assert len(lags) == 40 * 4 and max(lags) <= max_lag
    # The bound is used, not just respected: the actor runs ahead up to it.
    assert max(lags) == max_lag


def _may_start(s: Schedule, place: int, version: int) -> bool:
    return place < s.limit(version)


def test_conventional_generates_one_round_with_frozen_weights():
    s = Schedule(batch_size=8, group_size=4, max_lag=0, conventional_g=4)
    # Round 0 (version 0): exactly B*G/group_size = 8 groups may start, then none until version 4.
    assert s.limit(0) == s.limit(3) == 8 and s.limit(4) == 16
    assert _may_start(s, 7, version=0) and not _may_start(s, 8, version=0)
    assert not _may_start(s, 8, version=3) and _may_start(s, 8, version=4)
    lags = _simulate([s], steps=40)
    assert sorted(set(lags)) == [0, 1, 2, 3]


def test_a_slow_actor_never_pushes_the_lag_past_the_bound():
    """Places are global: with one actor three times slower than the other, the fast one
    takes the places the slow one does not, and no trained group is staler than max_lag
    (dealing places to actors in turn would make the slow one's groups ever staler)."""
    for max_lag in (0, 1, 2):
        lags = _simulate(_actors(2, batch_size=16, group_size=4, max_lag=max_lag), steps=30,
                         delays=(1, 2), paces=(1, 3), seed=4)
        assert len(lags) == 30 * 4 and max(lags) <= max_lag


# The configurations of issue 8 that stalled at step 0 with the pace estimate, and more.
_STALLED_BEFORE = [
    dict(batch_size=24, group_size=8, max_lag=0, n=2),  # admitted 16 of step 0's 24 samples
    dict(batch_size=64, group_size=8, max_lag=0, conventional_g=1, n=3),  # 48 of 64
    dict(batch_size=16, group_size=4, max_lag=1, n=3),
    dict(batch_size=8, group_size=8, max_lag=0, n=4),  # more actors than groups per step
    dict(batch_size=32, group_size=4, max_lag=2, conventional_g=3, n=5),
]


@pytest.mark.parametrize("case", _STALLED_BEFORE, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_several_actors_admit_enough_for_every_step(case):
    case = dict(case)
    n = case.pop("n")
    lags = _simulate(_actors(n, **case), steps=12, delays=(1, 2, 3), seed=1)
    assert len(lags) == 12 * case["batch_size"] // case["group_size"]
    # Without reordering (one delay for every group) every group lands within the bound.
    if not case.get("conventional_g"):
        assert max(_simulate(_actors(n, **case), steps=12)) <= case["max_lag"]


def test_dropped_groups_give_their_place_back():
    lags = _simulate(_actors(2, batch_size=16, group_size=4, max_lag=0), steps=20,
                     delays=(1, 2), drop_prob=0.3, seed=2)
    assert len(lags) == 20 * 4


# ---- every configuration the validator accepts makes progress; the others are refused ----

_GRID = list(itertools.product(
    [1, 4],  # group_size
    [1, 3],  # groups per step
    [1, 2, 3],  # num_actors
    [0, 1],  # max_lag
    [1, 2, 3],  # publish_every
    ["pipeline", "conventional2"],
    [0.5, 1, 2],  # engine capacity in groups (0.5: less than one group)
))


def _config_overrides(g, k, n, lag, every, mode, cap):
    out = [f"actor.group_size={g}", f"trainer.batch_size={g * k}", f"actor.num_actors={n}",
           f"actor.max_lag={lag}", f"trainer.publish_every={every}",
           f"engine.capacity={max(1, int(cap * g))}"]
    if mode.startswith("conventional"):
        out += ["mode=conventional", f"conventional_g={mode[-1]}"]
    return out


def test_each_configuration_runs_or_is_refused_at_start():
    for g, k, n, lag, every, mode, cap in _GRID:
        overrides = _config_overrides(g, k, n, lag, every, mode, cap)
        try:
            cfg = load_config(None, overrides)
        except ConfigError:
            refused = True
        else:
            refused = False
            assert cfg.engine.capacity >= cfg.actor.group_size
        schedules = _actors(n, batch_size=g * k, group_size=g, max_lag=lag,
                            conventional_g=int(mode[-1]) if mode != "pipeline" else 0)
        lags = _simulate(schedules, capacity_groups=max(1, int(cap * g)) // g, publish_every=every,
                         steps=6, delays=(1, 2), seed=3)
        ran = len(lags) == 6 * k
        assert ran != refused, (overrides, "refused" if refused else "accepted", len(lags))


# ---- the trainer's hard filter ---------------------------------------------------------------


def _group(gid: str, version: int, n: int = 2) -> dict:
    samples = [Sample([1], [2, 3], [-0.1, -0.2], [version, version + 1], 1.0, True, "stop", gid)
               for _ in range(n)]
    return Group(gid, "p", samples).to_dict()


class _ListReader:
    def __init__(self, records):
        self.records = list(records)

    def read(self, max_count, timeout_s):
        out, self.records = self.records[:max_count], self.records[max_count:]
        return out

    def close(self):
        pass


def test_the_trainer_drops_stale_groups_only_in_pipeline_mode_with_drop_stale():
    from pipelinerl.rl.batches import stale_bound

    def bound(*overrides: str) -> int | None:
        return stale_bound(load_config(None, ["actor.max_lag=3", *overrides]))

    assert bound() == 3 and bound("trainer.drop_stale=false") is None
    assert bound("mode=conventional") is None
    # without the bound a group of any lag is trained
    source = BatchSource(_ListReader([_group("old", 0)]), group_size=2, max_lag=None,
                         timeout_s=1.0)
    assert [g.group_id for g in source.take(1, step=50)] == ["old"] and not source.dropped


def test_trainer_drops_and_counts_stale_and_malformed_groups():
    records = [_group("old", 0), {"group_id": "broken"}, _group("fresh", 5), _group("fresh2", 4)]
    source = BatchSource(_ListReader(records), group_size=2, max_lag=2, timeout_s=1.0)
    batch = source.take(2, step=6)
    assert [g.group_id for g in batch] == ["fresh", "fresh2"]
    assert source.dropped == {"stale": 1, "malformed": 1}


class _BlockedActorReader(_ListReader):
    """Stale groups, then fresh ones only once the trainer has announced the places the stale
    ones held: an actor blocked by the staleness bound (as after a resume, when a batch drops
    the groups made after the checkpoint)."""

    def __init__(self, stale, fresh):
        super().__init__(stale)
        self.fresh, self.announced = fresh, []

    def read(self, max_count, timeout_s):
        if not self.records and self.announced:
            self.records, self.fresh = self.fresh, []
        return super().read(max_count, timeout_s)


def test_places_of_groups_dropped_in_a_batch_reach_the_actors_before_it_waits():
    reader = _BlockedActorReader([_group(f"old{i}", 0) for i in range(3)],
                                 [_group("fresh", 5), _group("fresh2", 4)])
    source = BatchSource(reader, group_size=2, max_lag=2, timeout_s=1.0,
                         announce=reader.announced.append)
    batch = source.take(2, step=6)  # without the announcement: no group in 1 s, TimeoutError
    assert [g.group_id for g in batch] == ["fresh", "fresh2"]
    assert reader.announced == [{0: 3}]  # cumulative per actor, sent once
    assert not source.given_back_changed


def test_trainer_times_out_loudly_when_no_rollouts_arrive():
    source = BatchSource(_ListReader([]), group_size=2, max_lag=2, timeout_s=0.3)
    with pytest.raises(TimeoutError, match="No actor has written anything"):
        source.take(1, step=0)
