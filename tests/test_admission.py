"""The admission ledger: claims are exact across processes, and retries count once."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

from pipelinerl.rollouts.admission import LocalLedger, MemoryLedger, open_ledger
from pipelinerl.streams.redis_server import RedisServer


def _claim_until_refused(root: str, actor_id: int, limit: int, out: "mp.Queue[int]") -> None:
    ledger = LocalLedger(root)
    claimed = 0
    while ledger.claim(actor_id, claimed + 1, returned=0, limit=limit):
        claimed += 1
    out.put(claimed)


def test_local_claims_from_two_processes_never_exceed_the_limit(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_claim_until_refused, args=(str(tmp_path), a, 500, out))
             for a in range(2)]
    for p in procs:
        p.start()
    counts = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert sum(counts) == 500  # however the two interleaved (one may start after the other ends)
    assert sum(LocalLedger(tmp_path).claims().values()) == 500


def test_places_come_back_through_drops_and_restarts() -> None:
    ledger = MemoryLedger()
    assert all(ledger.claim(0, n, returned=0, limit=4) for n in (1, 2, 3))
    assert ledger.claim(1, 1, returned=0, limit=4) and not ledger.claim(1, 2, returned=0, limit=4)
    # The trainer dropped 2 groups: two places are free again.
    assert ledger.claim(1, 2, returned=2, limit=4) and ledger.claim(1, 3, returned=2, limit=4)
    assert not ledger.claim(1, 4, returned=2, limit=4)
    ledger.set(0, 1)  # actor 0 restarted after publishing 1: its 2 groups in flight are gone
    assert ledger.claim(1, 4, returned=2, limit=4)


def test_redis_claim_retried_after_a_lost_reply_counts_once(redis_server: RedisServer) -> None:
    ledger = open_ledger("redis", url=redis_server.url, run=f"adm-{time.time_ns()}")
    assert ledger.claim(0, 1, returned=0, limit=2)
    assert ledger.claim(0, 1, returned=0, limit=2)  # the same claim again: no second place
    assert ledger.claims() == {"0": 1}
    assert ledger.claim(1, 1, returned=0, limit=2) and not ledger.claim(1, 2, returned=0, limit=2)
    ledger.set(1, 0)
    assert ledger.claims() == {"0": 1, "1": 0}
    ledger.close()
