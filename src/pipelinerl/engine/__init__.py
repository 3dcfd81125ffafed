"""Generation engines behind one interface, chosen by `engine.backend`."""

from __future__ import annotations

import torch

from pipelinerl.config import EngineConfig
from pipelinerl.engine.base import Engine

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_engine(cfg: EngineConfig, model_path: str, seed: int = 0) -> Engine:
    dtype = _DTYPES[cfg.dtype]
    if cfg.backend == "torch":
        from pipelinerl.engine.torch_engine import TorchEngine

        return TorchEngine.from_pretrained(
            model_path,
            capacity=cfg.capacity,
            max_seq_len=cfg.max_seq_len,
            device=cfg.device,
            dtype=dtype,
            recompute_kv_on_update=cfg.recompute_kv_on_update,
            seed=seed,
            cuda_graphs=cfg.cuda_graphs,
        )
    if cfg.backend == "vllm":
        from pipelinerl.engine.vllm_engine import VllmEngine

        return VllmEngine.from_pretrained(
            model_path,
            capacity=cfg.capacity,
            max_seq_len=cfg.max_seq_len,
            dtype=dtype,
            seed=seed,
            recompute_kv_on_update=cfg.recompute_kv_on_update,
        )
    raise ValueError(f"engine.backend: unknown backend {cfg.backend!r} (known: torch, vllm)")
