"""Config -> the concrete streams and weight channels a role talks through."""

from __future__ import annotations

import hashlib

from pipelinerl.config import Config
from pipelinerl.streams import Reader, Writer, open_reader, open_writer
from pipelinerl.sync import make_receiver, make_sender
from pipelinerl.sync.base import WeightReceiver, WeightSender

ROLLOUTS = "rollouts"
CONTROL = "control"


def _locations(cfg: Config) -> dict[str, str]:
    return {"root": str(cfg.run_dir / "streams"), "url": cfg.stream.redis_url, "run": cfg.name}


def open_rollout_writer(cfg: Config, actor_id: int) -> Writer:
    return open_writer(cfg.stream.backend, stream=ROLLOUTS, writer_id=f"actor_{actor_id}",
                       **_locations(cfg))


def open_rollout_reader(cfg: Config, offsets: dict | None = None) -> Reader:
    return open_reader(cfg.stream.backend, stream=ROLLOUTS, offsets=offsets, **_locations(cfg))


def open_control_writer(cfg: Config) -> Writer:
    return open_writer(cfg.stream.backend, stream=CONTROL, writer_id="trainer", **_locations(cfg))


def open_control_reader(cfg: Config) -> Reader:
    return open_reader(cfg.stream.backend, stream=CONTROL, **_locations(cfg))


def _channel_id(cfg: Config) -> str:
    # Two runs of the same name in different output directories must not share a segment.
    digest = hashlib.sha1(str(cfg.run_dir.resolve()).encode()).hexdigest()[:8]
    return f"{cfg.name}-{digest}"


def open_weight_sender(cfg: Config) -> WeightSender:
    if cfg.sync.backend == "shm":
        return make_sender("shm", run_id=_channel_id(cfg))
    return make_sender("broadcast", init_method=_require_init_method(cfg),
                       n_actors=cfg.actor.num_actors, device=cfg.trainer.device,
                       bucket_mb=cfg.sync.bucket_mb, timeout_s=cfg.sync.timeout_s)


def open_weight_receiver(cfg: Config, actor_id: int) -> WeightReceiver:
    if cfg.sync.backend == "shm":
        return make_receiver("shm", run_id=_channel_id(cfg), timeout_s=cfg.sync.timeout_s)
    return make_receiver("broadcast", init_method=_require_init_method(cfg), actor_id=actor_id,
                         n_actors=cfg.actor.num_actors, device=cfg.engine.device,
                         timeout_s=cfg.sync.timeout_s)


def _require_init_method(cfg: Config) -> str:
    if not cfg.sync.init_method:
        raise ValueError("sync.backend=broadcast needs sync.init_method=tcp://HOST:PORT "
                         "(the trainer's address, reachable from every actor)")
    return cfg.sync.init_method
