"""Group ids name the actor and the restart of it that made a group (pipelinerl.run.group_ids)."""

from pipelinerl.run.group_ids import (
    actor_of,
    format_group_id,
    next_restart,
    process_seed,
    restart_of,
)


def test_an_id_gives_back_its_actor_and_restart() -> None:
    for actor, restart, n in [(0, 0, 0), (3, 0, 17), (12, 2, 5), (1, 40, 999)]:
        gid = format_group_id(actor, restart, n)
        assert (actor_of(gid), restart_of(gid)) == (actor, restart)
    assert format_group_id(1, 0, 3) == "a1-g3"  # a first process's ids as older runs wrote them
    assert actor_of("not-an-id") == -1 and restart_of("a0-x2-g1") == 0


def test_a_restarted_process_counts_on_from_its_predecessors_last_record() -> None:
    assert next_restart(None) == 0
    assert next_restart({"group_id": "a0-g9"}) == 1
    assert next_restart({"group_id": "a0-r2-g1"}) == 3
    assert next_restart({"heartbeat": True, "generation": 4}) == 5  # a heartbeat's last word
    seeds = {process_seed(7, a, r) for a in range(3) for r in range(3)}
    assert len(seeds) == 9  # each actor process samples with its own seed
