"""The recorded samples' share of a training step (`rl.step.rl_step(keep_groups=n)`): the
micro-batches holding a recorded sample's tokens and their new log-probs, kept on the device
and read back in one copy after the step's loop; `run.samples` writes them to samples.jsonl."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipelinerl.rl.packing import PackedBatch
from pipelinerl.types import Sample


@dataclass
class Scored:
    """What the step computed for one recorded sample: its advantage and, per completion
    token, the trainer's log-prob (None: not trained, an environment's token or a sample
    without trained tokens); advantage None when none of its tokens trained."""

    advantage: float | None
    logprobs: list[float | None]


@dataclass
class Capture:
    """The recorded samples' share of a step: `recorded` are the first samples of the step's
    flattened groups, `trained` the indices (into those flattened samples) of the samples the
    step trains, in the order the micro-batches' `seq_idx` numbers them."""

    recorded: list[Sample]
    trained: list[int]
    _parts: list[tuple[PackedBatch, torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # The recorded samples come first, so theirs are the seq_idx below this.
        self._n = sum(i < len(self.recorded) for i in self.trained)

    def add(self, batch: PackedBatch, new_lp: torch.Tensor) -> None:
        """A micro-batch (its host copy) and its new log-probs (kept on the device, no copy)."""
        if bool((batch.seq_idx < self._n).any()):  # host tensor: no device sync
            self._parts.append((batch, new_lp.detach()))

    def scored(self) -> list[Scored]:
        """Per recorded sample, what the step computed; one device-to-host copy."""
        got: dict[int, tuple[float, list[float]]] = {}
        if self._parts:
            lps = torch.cat([lp for _, lp in self._parts]).float().cpu().tolist()
            seq = torch.cat([b.seq_idx for b, _ in self._parts]).tolist()
            adv = torch.cat([b.advantages for b, _ in self._parts]).tolist()
            # A sequence's tokens sit in one micro-batch, in completion order.
            for s, a, lp in zip(seq, adv, lps):
                if s < self._n:
                    got.setdefault(self.trained[s], (a, []))[1].append(lp)
        return [_spread(sample, got.get(i)) for i, sample in enumerate(self.recorded)]


def _spread(sample: Sample, got: tuple[float, list[float]] | None) -> Scored:
    """The trained tokens' log-probs laid over the completion (None on untrained tokens)."""
    n = len(sample.token_ids)
    if got is None:
        return Scored(None, [None] * n)
    mask = sample.model_mask if sample.model_mask is not None else [True] * n
    values = iter(got[1])
    return Scored(got[0], [next(values) if m else None for m in mask])
