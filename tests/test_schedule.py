"""The staleness bound: actor admission (Schedule) and the trainer's hard filter."""

import pytest

from pipelinerl.actor import Schedule
from pipelinerl.trainer import BatchSource
from pipelinerl.types import Group, Sample


def _simulate(schedule: Schedule, group_size: int, steps: int, finish_delay: int) -> list[int]:
    """An idealised run: the actor starts every group the schedule allows; each group finishes
    `finish_delay` optimizer steps after it started; the trainer consumes groups in finishing
    order and publishes after every step. Returns the lag of every trained sample."""
    started, version, in_flight, ready, lags = 0, 0, [], [], []
    for step in range(steps):
        while schedule.may_start(started, group_size, version):
            in_flight.append((step + finish_delay, version))
            started += group_size
        ready += [v for (done, v) in in_flight if done <= step]
        in_flight = [(d, v) for (d, v) in in_flight if d > step]
        need = schedule.batch_size // group_size
        if len(ready) < need:
            continue  # trainer waits; no step taken
        batch, ready = ready[:need], ready[need:]
        lags += [version - v for v in batch]
        version += 1
    return lags


@pytest.mark.parametrize("max_lag", [0, 1, 3])
def test_pipeline_admission_keeps_lag_within_bound(max_lag):
    lags = _simulate(Schedule(batch_size=16, max_lag=max_lag), group_size=4, steps=40, finish_delay=0)
    assert lags and max(lags) <= max_lag
    # The bound is used, not just respected: the actor runs ahead up to it.
    assert max(lags) == max_lag


def test_conventional_generates_one_round_with_frozen_weights():
    s = Schedule(batch_size=8, max_lag=0, conventional_g=4)
    # Round 0 (version 0): exactly B*G = 32 samples may start, then nothing until version 4.
    assert s.may_start(28, 4, version=0) and not s.may_start(32, 4, version=0)
    assert not s.may_start(32, 4, version=3) and s.may_start(32, 4, version=4)
    lags = _simulate(s, group_size=4, steps=40, finish_delay=0)
    assert sorted(set(lags)) == [0, 1, 2, 3]


def test_several_actors_share_the_bound():
    s = Schedule(batch_size=16, max_lag=0, num_actors=2)
    assert s.may_start(4, 4, version=0) and not s.may_start(8, 4, version=0)


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


def test_trainer_drops_and_counts_stale_and_malformed_groups():
    records = [_group("old", 0), {"group_id": "broken"}, _group("fresh", 5), _group("fresh2", 4)]
    source = BatchSource(_ListReader(records), group_size=2, max_lag=2, timeout_s=1.0)
    batch = source.take(2, step=6)
    assert [g.group_id for g in batch] == ["fresh", "fresh2"]
    assert source.dropped == {"stale": 1, "malformed": 1}


def test_trainer_times_out_loudly_when_no_rollouts_arrive():
    source = BatchSource(_ListReader([]), group_size=2, max_lag=2, timeout_s=0.3)
    with pytest.raises(TimeoutError, match="is every actor alive"):
        source.take(1, step=0)
