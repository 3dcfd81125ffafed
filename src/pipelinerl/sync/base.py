"""Weight channels: the trainer publishes new weights, each actor loads them between steps."""

from __future__ import annotations

from typing import Mapping, Protocol

import torch


class WeightSender(Protocol):
    def publish(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Make `weights` (Hugging Face names) available to every receiver as `version`."""
        ...

    def close(self) -> None: ...


class WeightReceiver(Protocol):
    def poll(self) -> int | None:
        """The newest published version if it is newer than the last received, else None."""
        ...

    def receive_into(self, targets: Mapping[str, torch.Tensor]) -> int:
        """Copy the newest weights into `targets` in place (casting dtype); return the version."""
        ...

    def close(self) -> None: ...
