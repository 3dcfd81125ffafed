"""Generation engines behind one interface, chosen by `engine.backend`."""

from __future__ import annotations

from dataclasses import fields

from pipelinerl.config import EngineConfig
from pipelinerl.engine.base import Engine, EngineOptions, torch_dtype

__all__ = ["Engine", "EngineOptions", "make_engine", "torch_dtype"]


def make_engine(cfg: EngineConfig, model_path: str, seed: int = 0) -> Engine:
    # Every option the config section names, by the same name; the others keep their defaults.
    options = EngineOptions(seed=seed, **{f.name: getattr(cfg, f.name) for f in fields(EngineOptions)
                                          if f.name in type(cfg).model_fields})
    if cfg.backend == "torch":
        from pipelinerl.engine.torch_engine import TorchEngine

        return TorchEngine.from_pretrained(model_path, options)
    if cfg.backend == "vllm":
        from pipelinerl.engine.vllm_engine import VllmEngine

        return VllmEngine.from_pretrained(model_path, options)
    raise ValueError(f"engine.backend: unknown backend {cfg.backend!r} (known: torch, vllm)")
