"""The layout of a set of weights: names, shapes, dtypes and ties (tied names share a slot).

What a weight channel's sender and receivers agree on at the first publish (the shared-memory
and broadcast channels, and a sharded trainer's gathered weights).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch


def align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _dtype_from_str(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in weight manifest")
    return dtype


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    slot: int  # index of the distinct tensor holding this parameter; tied names share a slot


@dataclass(frozen=True)
class SlotSpec:
    names: tuple[str, ...]  # every parameter name stored in this slot; names[0] is the source
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _storage_key(t: torch.Tensor) -> tuple:
    # Two names are tied when they are the very same view of the same storage.
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            t.stride(), t.dtype)


class WeightLayout:
    """Names, shapes, dtypes and ties of a set of weights: what sender and receivers agree on.

    Shared by the shared-memory and broadcast channels.
    """

    def __init__(self, params: list[ParamSpec]):
        self.params = params
        self._by_name = {p.name: p for p in params}
        n_slots = max((p.slot for p in params), default=-1) + 1
        names: list[list[str]] = [[] for _ in range(n_slots)]
        for p in params:
            names[p.slot].append(p.name)
        self.slots = [
            SlotSpec(tuple(ns), self._by_name[ns[0]].shape, self._by_name[ns[0]].dtype)
            for ns in names
        ]

    @classmethod
    def from_weights(cls, weights: Mapping[str, torch.Tensor]) -> WeightLayout:
        slot_of: dict[tuple, int] = {}
        params = []
        for name, t in weights.items():
            slot = slot_of.setdefault(_storage_key(t), len(slot_of))
            params.append(ParamSpec(name, tuple(t.shape), t.dtype, slot))
        return cls(params)

    def to_json(self) -> str:
        return json.dumps(
            [{"name": p.name, "shape": list(p.shape), "dtype": str(p.dtype), "slot": p.slot}
             for p in self.params]
        )

    @classmethod
    def from_json(cls, text: str) -> WeightLayout:
        return cls([
            ParamSpec(d["name"], tuple(d["shape"]), _dtype_from_str(d["dtype"]), d["slot"])
            for d in json.loads(text)
        ])

    def slot_offsets(self, alignment: int) -> tuple[list[int], int]:
        """Aligned byte offset of each slot in one flat region, and the region's size."""
        offsets, pos = [], 0
        for s in self.slots:
            pos = align(pos, alignment)
            offsets.append(pos)
            pos += s.nbytes
        return offsets, pos

    def sources(self, weights: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """One tensor per slot from `weights`, after checking they match this layout."""
        if weights.keys() != self._by_name.keys():
            extra = sorted(weights.keys() - self._by_name.keys())
            gone = sorted(self._by_name.keys() - weights.keys())
            raise ValueError(
                f"weights differ from the layout of the first publish: new {extra}, gone {gone}"
            )
        for p in self.params:
            t = weights[p.name]
            if tuple(t.shape) != p.shape or t.dtype != p.dtype:
                raise ValueError(
                    f"parameter {p.name!r} is {tuple(t.shape)} {t.dtype}, but was first "
                    f"published as {p.shape} {p.dtype}"
                )
        for s in self.slots:
            key = _storage_key(weights[s.names[0]])
            for alias in s.names[1:]:
                if _storage_key(weights[alias]) != key:
                    raise ValueError(
                        f"parameter {alias!r} was published tied to {s.names[0]!r} but is "
                        "now a separate tensor"
                    )
        return [weights[s.names[0]].detach() for s in self.slots]

    def bind(self, targets: Mapping[str, torch.Tensor]) -> list[list[torch.Tensor]]:
        """The target tensors to fill from each slot; raises naming any mismatched parameter.

        Every target name must be published; every slot must reach at least one target (a
        tied pair may be exposed under either name or both, as one tensor or two).
        """
        unknown = sorted(targets.keys() - self._by_name.keys())
        if unknown:
            raise ValueError(f"target parameter(s) not in the published weights: {unknown}")
        dests: list[list[torch.Tensor]] = [[] for _ in self.slots]
        seen: dict[tuple, str] = {}  # target tensor -> first name it was given under
        for name, t in targets.items():
            p = self._by_name[name]
            if tuple(t.shape) != p.shape:
                raise ValueError(
                    f"parameter {name!r}: published shape {p.shape}, target shape "
                    f"{tuple(t.shape)}"
                )
            first = seen.setdefault(_storage_key(t), name)
            if first == name:
                dests[p.slot].append(t)
            elif self._by_name[first].slot != p.slot:
                raise ValueError(
                    f"target parameters {first!r} and {name!r} are one tensor, but the "
                    "published weights hold them apart"
                )
        missing = [s.names[0] for s, d in zip(self.slots, dests, strict=True) if not d]
        if missing:
            raise ValueError(f"published parameter(s) missing from the targets: {missing}")
        return dests
