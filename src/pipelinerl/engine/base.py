"""The generation-engine interface. Backends: `torch` (ours, embedded default) and `vllm`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Mapping, Protocol

import torch

from pipelinerl.types import GenerationOutput, GenerationRequest, SamplingParams

# A weight receiver's `receive_into`: copy weights into the given tensors, return the version.
ReceiveFn = Callable[[Mapping[str, torch.Tensor]], int]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an `engine.dtype` name ("float32", "bfloat16", "float16")."""
    return _DTYPES[name]


@dataclass(frozen=True)
class EngineOptions:
    """An engine's construction options, passed whole to every backend (the vLLM backend
    ignores `device`, `max_prefill_tokens`, `cuda_graphs` and `late_stop_check`).
    `make_engine` fills them from the `engine` config section; tests state only what they
    change."""

    capacity: int  # sequences in flight
    max_seq_len: int  # prompt plus generated tokens, all turns
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    recompute_kv_on_update: bool = False
    seed: int = 0
    max_prefill_tokens: int = 8192  # padded tokens of one prefill forward (torch engine)
    cuda_graphs: bool = True  # replay the torch engine's decode step from CUDA graphs on CUDA
    # Read a decode step's sampled tokens (the stop check) one step late, after launching the
    # next (torch engine); None: on CUDA, where reading them at once waits for the device.
    late_stop_check: bool | None = None


class Engine(Protocol):
    """A continuous-batching generator driven one decode step at a time by the actor.

    The actor adds requests whenever `num_active() < capacity`, calls `step()` in a loop, and
    updates weights (`load_weights` or `receive_weights`, from any thread) between two steps:
    sequences in progress continue under the new weights and stamp their later tokens with
    the new version.
    """

    version: int  # policy version of the weights currently loaded

    @property
    def capacity(self) -> int: ...

    def add_request(self, request: GenerationRequest) -> None: ...

    def extend(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        """Continue a held request (`GenerationRequest.hold`) whose turn `step()` returned:
        append `token_ids` (the environment's reply) and generate the next turn under
        `params`. Its tokens keep their per-token versions across turns."""
        ...

    def release(self, request_id: str) -> None:
        """End a held request whose turn `step()` returned: its slot and cache are freed."""
        ...

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (queued, decoding, held between turns): no output
        comes back for it, and its slot and cache are freed (an endpoint's client that went
        away). False if the engine does not hold it (it finished, or was never added)."""
        ...

    def num_active(self) -> int: ...

    def num_running(self) -> int:
        """Sequences that the next `step()` decodes, parked ones not counted (slot
        occupancy: docs/learning_speed.md)."""
        ...

    def step(self) -> list[GenerationOutput]:
        """Run one decode step over all active sequences; return those that finished."""
        ...

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace the weights in place (Hugging Face parameter names) between two steps."""
        ...

    def receive_weights(self, receive: ReceiveFn) -> int:
        """Run `receive(targets)` between two steps, excluding `step()` from any thread:
        `receive` copies new weights into `targets` (tensors by Hugging Face name) in place
        and returns their version, which the engine then carries; returns it too.

        Together with `load_weights` this is the only way weights enter an engine, so an
        update from a receiver thread can never land in the middle of a decode step, and the
        version changes together with the weights. A `receive` that raises may have copied
        part of the weights: the engine then refuses to step.
        """
        ...
