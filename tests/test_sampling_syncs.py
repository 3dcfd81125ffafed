"""Checked on the CPU, what would sync or copy on a GPU: a decode step whose requests use
min_p or the repetition penalty reads no more device values and copies no more host data to
the device than one whose requests do not (issue 41: the host `_min_p` mirror copied every
step, a `bool()` of a device min_p, the lengths copied again for the penalty), and since issue
54 a decode step reads no device value at all, whatever its requests ask.

On the CPU every tensor is a host tensor, so a mode follows, by storage, which ones would
live on the device: those made with an explicit `device=` (the engine's device-side buffers,
the KV cache, the weights) or moved there with `.to(device)` (a copy here too, as on a GPU),
and whatever is computed from one of them; the engine's host mirrors (`_len`, `_penalised`,
...) and what is computed from them alone stay on the host. It counts, by call and
pipelinerl's line, a sync where a device value is read on the host and a copy where host data
goes to the device or device data into a host tensor."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import replace
from typing import Any, Iterator

import pytest
import torch
from torch.overrides import TorchFunctionMode

from pipelinerl.engine import EngineOptions
from pipelinerl.engine.torch_engine import TorchEngine
from pipelinerl.types import GenerationRequest, SamplingParams
from tiny_models import tiny_hf_model

_READS = {"item", "tolist", "cpu", "numpy", "nonzero", "unique", "masked_select", "__bool__",
          "__int__", "__float__", "__index__"}
_IN_PLACE = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ior__",
             "__iand__", "__set__"}


class DeviceSide(TorchFunctionMode):
    """Which tensors would be on the device; the syncs and host-to-device copies made."""

    def __init__(self) -> None:
        super().__init__()
        self.device: set[int] = set()  # storages' data_ptr
        self.syncs: Counter = Counter()
        self.copies: Counter = Counter()

    def on_device(self, t: torch.Tensor) -> bool:
        return _storage(t) in self.device

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        tensors = [t for t in _flatten((args, kwargs)) if isinstance(t, torch.Tensor)]
        moved = name == "cuda" or (name == "to" and _names_device(args[1:], kwargs))
        made = kwargs.get("device") is not None  # a factory: zeros, arange, tensor, as_tensor...
        if src is not None and self.on_device(src) and (
                name in _READS or (name == "__getitem__" and _bool_index(args[1]))):
            self.syncs[name, _where()] += 1
        if (moved and src is not None and not self.on_device(src)) or (
                name in ("tensor", "as_tensor") and made
                and not (src is not None and self.on_device(src))):
            self.copies[name, _where()] += 1
        elif any(map(self.on_device, tensors)) and any(
                t.ndim and not self.on_device(t) for t in tensors):  # a host tensor in a device op
            self.copies["mixed " + name, _where()] += 1
        out = func(*args, **kwargs)
        if (name == "cpu" or moved) and src is not None and self.on_device(src) != moved:
            out = out.clone()  # a move copies on a GPU; here it would alias its source
        if name in _IN_PLACE or (name.endswith("_") and not name.endswith("__")):
            return out  # still where it was
        device = moved or made or (name != "cpu" and any(map(self.on_device, tensors)))
        shared = {_storage(t) for t in tensors}
        for o in _flatten(out):
            if isinstance(o, torch.Tensor) and _storage(o) not in shared and _storage(o):
                (self.device.add if device else self.device.discard)(_storage(o))
        return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _flatten(x: Any) -> Iterator[Any]:
    if isinstance(x, (list, tuple)):
        for item in x:
            yield from _flatten(item)
    elif isinstance(x, dict):
        yield from _flatten(list(x.values()))
    else:
        yield x


def _names_device(args: Any, kwargs: dict) -> bool:
    return kwargs.get("device") is not None or any(isinstance(a, (torch.device, str)) for a in args)


def _bool_index(index: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in _flatten(index))


def _where() -> str:
    """pipelinerl's innermost line in the calling stack."""
    frame = sys._getframe(2)
    while frame is not None and "/pipelinerl/" not in frame.f_code.co_filename:
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"


def _decode_step(params: list[SamplingParams], late: bool = False) -> DeviceSide:
    """The mode's counts over one decode step of requests under `params`, the mode on from the
    engine's construction (so that it knows which buffers the engine made on its device)."""
    hf = tiny_hf_model("qwen2")
    with DeviceSide() as mode:
        engine = TorchEngine(hf.config, EngineOptions(capacity=len(params), max_seq_len=64,
                                                      late_stop_check=late))
        engine.load_weights(hf.state_dict(), version=0)
        for i, p in enumerate(params):
            engine.add_request(GenerationRequest(f"r{i}", [1 + i, 2, 3, 4, 5], p))
        engine.step()  # admission, the first token and (reading late) one step in flight
        assert mode.on_device(engine._tokens) and not mode.on_device(engine._len)
        mode.syncs.clear()
        mode.copies.clear()
        assert engine.step() == [] and engine.num_running() == len(params)
    return mode


PLAIN = SamplingParams(max_new_tokens=32)
TOP_K = replace(PLAIN, top_k=20)


@pytest.mark.parametrize(("without", "with_them"), [
    ([PLAIN] * 4, [PLAIN, replace(PLAIN, repetition_penalty=1.3), PLAIN,
                   replace(PLAIN, repetition_penalty=0.8, temperature=0.0)]),
    # min_p truncates: compared with top-k, whose candidates cost the same two reads.
    ([TOP_K] * 4, [TOP_K, replace(PLAIN, min_p=0.05), replace(TOP_K, min_p=0.1), TOP_K]),
    ([TOP_K] * 4, [replace(TOP_K, min_p=0.05, repetition_penalty=1.3), TOP_K, TOP_K,
                   replace(PLAIN, min_p=0.2, repetition_penalty=0.9)]),
], ids=["penalty", "min_p", "both"])
def test_min_p_and_penalty_add_no_gpu_sync_or_copy_per_decode_step_checked_on_cpu(
        without: list[SamplingParams], with_them: list[SamplingParams]) -> None:
    base, used = _decode_step(without), _decode_step(with_them)
    assert (used.syncs, used.copies) == (base.syncs, base.copies), (
        used.syncs - base.syncs, used.copies - base.copies)


@pytest.mark.parametrize("late", [False, True], ids=["at_once", "late"])
@pytest.mark.parametrize("params", [[PLAIN] * 4, [TOP_K] * 4, [replace(PLAIN, top_p=0.9)] * 4, [
    replace(TOP_K, top_p=0.8, min_p=0.05, repetition_penalty=1.3), PLAIN,
    replace(PLAIN, temperature=0.0, repetition_penalty=0.8, seed=3), replace(TOP_K, seed=4)]],
    ids=["plain", "top_k", "top_p", "mixed"])
def test_a_decode_step_reads_no_device_value_and_copies_positions_in_and_tokens_out_checked_on_cpu(
        params: list[SamplingParams], late: bool) -> None:
    """Issue 54: the sampling reads nothing from the device (the candidates of top-k and
    top-p sized on the host: 2 reads a step before), and the stop check reads the one copy of
    the sampled tokens (a device read before: `.cpu()` of the stop flags). The copy's wait is
    the step's only one on a GPU, reading at once; reading late, it is for the step before
    (tests/test_decode_in_graph.py)."""
    mode = _decode_step(params, late)
    assert not mode.syncs, mode.syncs
    assert sorted(name for name, _ in mode.copies.elements()) == ["mixed copy_", "to"], mode.copies
