"""The user's cache directory for what pipelinerl builds once and reuses across runs (the
warm-started demo models, dequantized GGUF models, downloaded model wheels)."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache(sub: str) -> Path:
    """`sub` in $PIPELINERL_CACHE, else $XDG_CACHE_HOME/pipelinerl, else ~/.cache/pipelinerl:
    the same from every working directory, so a run started elsewhere finds what is cached."""
    if root := os.environ.get("PIPELINERL_CACHE"):
        return Path(root).expanduser().absolute() / sub
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says to ignore a relative XDG_CACHE_HOME.
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "pipelinerl" / sub
