"""Counts, on the CPU, what makes a GPU step slow whatever the chip: kernels launched and host
syncs. A test holds them to budgets so that a change adding a loop over sequences or layers,
or a read of a device value, fails here rather than on a GPU no session may have.

- Kernels: every aten op that computes (views, empty allocations and metadata are free on a
  GPU and not counted), forward and backward, seen by a TorchDispatchMode.
- Host syncs: the calls that wait for a device's value when their tensor lives there
  (`.item()`, `.tolist()`, `.cpu()`, `bool()` / `int()` / `float()` of a tensor, `nonzero`,
  `unique`, boolean-mask indexing), made directly by pipelinerl's code. On the CPU every
  tensor is a host tensor, so this counts each such call once, whether or not its tensor would
  be on the GPU: an upper bound of a GPU step's syncs. Calls inside torch (the optimizer's
  own step counters, which live on the host) are not ours to count.
"""

from __future__ import annotations

import sys
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_FREE = {"empty", "empty_strided", "empty_like", "detach", "alias", "lift_fresh", "_to_copy_noop",
         "resolve_conj", "resolve_neg", "_unsafe_view", "view", "_reshape_alias", "unsqueeze",
         "squeeze", "expand", "permute", "transpose", "t", "slice", "select", "as_strided",
         "narrow", "split", "split_with_sizes", "unbind", "chunk", "_local_scalar_dense",
         "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "set_", "is_same_size"}
_SYNCING = {"item", "tolist", "cpu", "nonzero", "unique", "__bool__", "__int__", "__float__",
            "numpy", "masked_select"}
_PACKAGE = "/pipelinerl/"


class Kernels(TorchDispatchMode):
    """Aten ops that compute, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name.split("::")[-1]
        if name not in _FREE and not func.is_view:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


class HostSyncs(TorchFunctionMode):
    """Calls that would wait for the device, by (call, file:line) of pipelinerl's caller."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in _SYNCING or (name == "__getitem__" and _bool_index(args)):
            caller = sys._getframe(1)
            if _PACKAGE in caller.f_code.co_filename:
                where = f"{caller.f_code.co_filename.rsplit('/', 1)[-1]}:{caller.f_lineno}"
                self.counts[(name, where)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _bool_index(args: Any) -> bool:
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)
