"""Config -> the concrete streams and weight channels a role talks through."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from pipelinerl.config import Config
from pipelinerl.rollouts.admission import LocalLedger, RedisLedger, open_ledger
from pipelinerl.streams import (
    Reader,
    StreamConnectionError,
    Writer,
    open_reader,
    open_writer,
)
from pipelinerl.streams.base import WriterStateLost
from pipelinerl.sync import make_receiver, make_sender
from pipelinerl.sync.base import WeightReceiver, WeightSender
from pipelinerl.sync.shm import shm_path

log = logging.getLogger(__name__)

ROLLOUTS = "rollouts"
CONTROL = "control"
EVAL = "eval"

MISSING_RUN_ID = (
    "run_id is empty: every role of one run needs the same run_id, and each run a new one "
    "(`pipelinerl train` sets it; by hand pass e.g. run_id=$SLURM_JOB_ID to every role, "
    "see docs/multinode.md)"
)


def _locations(cfg: Config) -> dict[str, Any]:
    # Per run id, not per name: a re-run under the same name (same redis, same run directory)
    # must not read the previous run's rollouts or its stop record.
    if not cfg.run_id:
        raise ValueError(MISSING_RUN_ID)
    return {"root": str(cfg.run_dir / "streams" / cfg.run_id), "url": cfg.stream.redis_url,
            "run": f"{cfg.name}:{cfg.run_id}", "timeout_s": cfg.stream.timeout_s}


def open_rollout_writer(cfg: Config, actor_id: int) -> Writer:
    return open_writer(cfg.stream.backend, stream=ROLLOUTS, writer_id=f"actor_{actor_id}",
                       segment_bytes=int(cfg.stream.segment_mb * 2**20), **_locations(cfg))


def predecessor_record(writer: Writer, actor_id: int) -> dict[str, Any] | None:
    """The last record an earlier process of actor `actor_id` wrote to its rollout stream
    (None for the first): where a restarted actor continues from."""
    try:
        return writer.last_record()
    except WriterStateLost as err:
        raise RuntimeError(f"actor {actor_id} refuses to start: {err}. Without it the actor "
                           "would repeat group ids, under-count its admission claim and "
                           "restart its data") from None


def open_rollout_reader(cfg: Config, offsets: dict | None = None) -> Reader:
    return open_reader(cfg.stream.backend, stream=ROLLOUTS, offsets=offsets, **_locations(cfg))


def open_admission_ledger(cfg: Config) -> LocalLedger | RedisLedger:
    """The ledger of places every actor of this run claims from (pipelinerl.rollouts.admission)."""
    return open_ledger(cfg.stream.backend, **_locations(cfg))


def open_control_writer(cfg: Config) -> Writer:
    return open_writer(cfg.stream.backend, stream=CONTROL, writer_id="trainer", **_locations(cfg))


def open_control_reader(cfg: Config) -> Reader:
    return open_reader(cfg.stream.backend, stream=CONTROL, **_locations(cfg))


def open_eval_writer(cfg: Config) -> Writer:
    return open_writer(cfg.stream.backend, stream=EVAL, writer_id="evaluator", **_locations(cfg))


def open_eval_reader(cfg: Config) -> Reader:
    return open_reader(cfg.stream.backend, stream=EVAL, **_locations(cfg))


def check_run_id_unused(cfg: Config) -> None:
    """Refuse a run id and attempt whose control stream already holds a stop record: a
    finished launch's (a resumed run is a new attempt of the same run id)."""
    with open_control_reader(cfg) as reader:
        control = Control(reader, cfg.attempt)
        control.poll()
        if control.stop is not None:
            raise RuntimeError(
                f"run_id {cfg.run_id!r} of run {cfg.name!r} (attempt {cfg.attempt}) already "
                "finished (its stop record is in the control stream): give every role of this "
                "run a new run_id, or continue it with `pipelinerl train CONFIG --resume`"
            )


class Control:
    """The trainer's control records for one attempt of the run, read as they come: the stop
    record, and how many of each actor's groups the trainer dropped (their places go back to
    the actor's admission count). Records of other attempts are ignored: a resumed run's roles
    must not stop on the crashed attempt's stop record or count its drops."""

    def __init__(self, reader: Reader, attempt: int) -> None:
        self.reader = reader
        self.attempt = attempt
        self.stop: dict[str, Any] | None = None
        self.returned: dict[str, int] = {}  # actor id (str: JSON keys) -> groups given back

    def poll(self) -> None:
        while records := self.reader.read(max_count=256, timeout_s=0.0):
            for record in records:
                if record.get("attempt", 0) != self.attempt:
                    continue
                if record.get("type", "stop") == "stop":
                    self.stop = record
                elif record["type"] == "returned":
                    self.returned = record["returned"]

    def returned_total(self) -> int:
        """Groups the trainer dropped, over every actor: their places are free again."""
        return sum(int(v) for v in self.returned.values())

    def close(self) -> None:
        self.reader.close()


def write_stop(writer: Writer, cfg: Config, step: int, **extra: Any) -> None:
    writer.write({"type": "stop", "attempt": cfg.attempt, "step": step, **extra})


def write_stop_unwinding(writer: Writer, cfg: Config, step: int) -> None:
    """The stop record as the trainer unwinds (Ctrl-C, SIGTERM, an error), so the actors
    leave sooner: one try. A launcher killed outright takes the run's redis-server with it, and
    reconnecting for a minute would keep the orphaned trainer alive as long."""
    writer.stop_retrying()
    try:
        write_stop(writer, cfg, step)
    except StreamConnectionError as e:
        log.warning("no stop record written: %s", e)


def write_returned(writer: Writer, cfg: Config, returned: dict[int, int]) -> None:
    """Cumulative per actor: a reader needs only the newest record."""
    writer.write({"type": "returned", "attempt": cfg.attempt,
                  "returned": {str(k): v for k, v in returned.items()}})


def _channel_id(cfg: Config, attempt: int | None = None) -> str:
    """Unique per launch (run_id) and attempt. Another launch's weights left in /dev/shm must
    never reach an actor: a run killed outright left version 6 there, a new launch of the same
    name in the same directory read it at start, and its trainer dropped every group as
    negative lag. Nor may a resumed attempt's actors see the newer weights the crashed attempt
    published after its last checkpoint."""
    digest = hashlib.sha1(str(cfg.run_dir.resolve()).encode()).hexdigest()[:8]
    return f"{cfg.name}-{digest}-{cfg.run_id}-{cfg.attempt if attempt is None else attempt}"


def _n_receivers(cfg: Config) -> int:
    """Every actor, and the evaluator (receiver id num_actors) when evaluation is on."""
    return cfg.actor.num_actors + int(cfg.eval.enabled)


def open_weight_sender(cfg: Config) -> WeightSender:
    if cfg.sync.backend == "shm":
        for earlier in range(cfg.attempt):  # what crashed attempts left: memory, not files
            shm_path(_channel_id(cfg, earlier)).unlink(missing_ok=True)
        return make_sender("shm", run_id=_channel_id(cfg))
    return make_sender("broadcast", init_method=_require_init_method(cfg),
                       n_actors=_n_receivers(cfg), device=cfg.trainer.device,
                       bucket_mb=cfg.sync.bucket_mb, timeout_s=cfg.sync.timeout_s,
                       interface=cfg.sync.interface)


def open_weight_receiver(cfg: Config, actor_id: int, device: str = "",
                         restarted: bool = False) -> WeightReceiver:
    """Actor `actor_id`'s receiver; the evaluator's is id num_actors (`device`: its own).
    `restarted`: the process continues an earlier one of its actor (a broadcast group is
    formed again to take it)."""
    if cfg.sync.backend == "shm":
        return make_receiver("shm", run_id=_channel_id(cfg), timeout_s=cfg.sync.timeout_s)
    return make_receiver("broadcast", init_method=_require_init_method(cfg), actor_id=actor_id,
                         n_actors=_n_receivers(cfg), device=device or cfg.engine.device,
                         timeout_s=cfg.sync.timeout_s, may_rejoin=restarted,
                         interface=cfg.sync.interface)


def _require_init_method(cfg: Config) -> str:
    if not cfg.sync.init_method:
        raise ValueError("sync.backend=broadcast needs sync.init_method=tcp://HOST:PORT "
                         "(the trainer's address, reachable from every actor)")
    return cfg.sync.init_method
