"""Config -> the concrete streams and weight channels a role talks through."""

from __future__ import annotations

from pipelinerl.config import Config
from pipelinerl.streams import Reader, Writer, open_reader, open_writer

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
