"""Weight channels: the trainer publishes new weights, each actor loads them between steps."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Protocol, runtime_checkable

import torch

from pipelinerl.sync.layout import WeightLayout


@runtime_checkable
class StreamedWeights(Protocol):
    """Weights handed over one tensor at a time, so the sender never holds them all at once.

    `layout` (names, full shapes, dtypes, ties) is known up front; `tensors()` yields one tensor
    per slot of the layout, in slot order, each needed only until the next is asked for; the
    sender casts it to the layout's dtype as it copies it into the channel. A
    sharded trainer gathers each tensor on demand: a collective that every trainer rank runs
    in the same order (`pipelinerl.rl.parallel.GatheredWeights`).
    """

    layout: WeightLayout
    device: torch.device  # where the yielded tensors live
    # Whether `tensors()` may be walked again (a failed transfer sent anew): not where each
    # walk is a collective of every trainer rank.
    replayable: bool

    def tensors(self) -> Iterator[torch.Tensor]: ...


Weights = Mapping[str, torch.Tensor] | StreamedWeights


class CastWeights:
    """`weights` sent with their floating tensors in `dtype` (the engines'): the layout says
    `dtype` and the sender casts each tensor as it copies it into the channel (one pass, no
    cast copy on the trainer). A bfloat16 engine gets bfloat16 weights from a float32 trainer:
    half the bytes moved and held by the channel. The engine would round them to its dtype on
    receipt anyway: the same values arrive."""

    replayable = True

    def __init__(self, weights: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        own = WeightLayout.from_weights(weights)  # ties, from the tensors' storage
        self._sources = own.sources(weights)
        self.layout = WeightLayout([
            replace(p, dtype=dtype if p.dtype.is_floating_point else p.dtype) for p in own.params])
        self.device = self._sources[0].device if self._sources else torch.device("cpu")

    def tensors(self) -> Iterator[torch.Tensor]:
        return iter(self._sources)


def open_weights(weights: Weights, first: WeightLayout | None
                 ) -> tuple[WeightLayout, Iterator[torch.Tensor], torch.device | None]:
    """(layout, one tensor per slot in order, the GPU the tensors are on or None on the host)
    of a publish; a layout that differs from the first publish's (`first`) raises. A trainer
    rank's weights are on one device."""
    if isinstance(weights, Mapping):
        layout = first or WeightLayout.from_weights(weights)
        sources = layout.sources(weights)
        return layout, iter(sources), next((t.device for t in sources if t.is_cuda), None)
    if first is not None and first.to_json() != weights.layout.to_json():
        raise ValueError("weights differ from the layout of the first publish")
    return weights.layout, weights.tensors(), weights.device if weights.device.type == "cuda" else None


class WeightSender(Protocol):
    def publish(self, weights: Weights, version: int) -> None:
        """Make `weights` (Hugging Face names) available to every receiver as `version`."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class RejoinableSender(Protocol):
    """A sender whose receivers all take part in every transfer (broadcast). A receiver
    restarted after its process died waits for the group to be formed again and receives
    nothing meanwhile, so the trainer asks `rejoined()` while it waits for samples and then
    publishes: the version it last published again (`publish` takes it once a receiver
    rejoined), or a newer one."""

    def rejoined(self) -> bool:
        """Whether a restarted receiver waits to be taken in (cheap: one store read)."""
        ...


class WeightReceiver(Protocol):
    def poll(self) -> int | None:
        """The newest published version if it is newer than the last received, else None."""
        ...

    def receive_into(self, targets: Mapping[str, torch.Tensor]) -> int:
        """Copy the newest weights into `targets` in place (casting dtype); return the version."""
        ...

    def close(self) -> None: ...
