"""The generation-engine interface. Backends: `torch` (ours, embedded default) and `vllm`."""

from __future__ import annotations

from typing import Mapping, Protocol

import torch

from pipelinerl.types import GenerationOutput, GenerationRequest


class Engine(Protocol):
    """A continuous-batching generator driven one decode step at a time by the actor.

    The actor adds requests whenever `num_active() < capacity`, calls `step()` in a loop, and
    calls `load_weights()` between two steps: sequences in progress continue under the new
    weights and stamp their later tokens with the new version.
    """

    version: int  # policy version of the weights currently loaded

    @property
    def capacity(self) -> int: ...

    def add_request(self, request: GenerationRequest) -> None: ...

    def num_active(self) -> int: ...

    def step(self) -> list[GenerationOutput]:
        """Run one decode step over all active sequences; return those that finished."""
        ...

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the weights in place (Hugging Face parameter names) between two steps."""
        ...

    def named_weights(self) -> Mapping[str, torch.Tensor]:
        """The engine's parameters by Hugging Face name, for a weight receiver to copy into."""
        ...

    def set_version(self, version: int) -> None:
        """Mark weights written directly into `named_weights()` as `version`, and apply any
        post-update work (recompute the KV cache if configured)."""
        ...
