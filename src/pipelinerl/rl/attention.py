"""Attention within each packed sequence only (`trainer.packed_attention=per_sequence`).

A packed row holds several sequences, position_ids restarting at 0 for each
(`pipelinerl.rl.packing`). transformers' sdpa path attends over the whole row under a
block-diagonal mask: the work grows with the square of the row's length, although each token
sees only its own sequence. This attention function attends within each sequence instead, so
the work grows with the squares of the sequences' lengths:
- on CUDA, where torch has it, one variable-length flash attention call per layer
  (`torch.nn.attention.varlen.varlen_attn`) over the batch's `cu_seqlens`;
- elsewhere, one causal SDPA per sequence over its segment of the row (split in one op).
The packer gives the sequences' lengths (`PackedBatch.attention_kwargs`), so neither path reads
position_ids back from the device; without them (a caller that did not pack) the segments are
found from position_ids once per forward. It is registered with transformers'
`AttentionInterface` under `per_sequence`; its mask function builds no mask for packed rows
(the segments are the mask), and anything else (a padding mask, one query at a time, a cache)
goes to transformers' own sdpa function unchanged.
"""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from pipelinerl.config import TrainerConfig

NAME = "per_sequence"

try:  # CUDA only (flash attention); absent from older torch
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

# The segments of the last position_ids seen and that tensor's version (an in-place write makes
# them stale): every layer of one forward gets the model's same tensor, so they are found once
# per forward (on a GPU, one host sync rather than one per layer).
_last: tuple[Tensor, int, list[list[tuple[int, int]]]] | None = None


def _segments(position_ids: Tensor) -> list[list[tuple[int, int]]]:
    """Per row, (start, end) of each sequence: a new one wherever the position does not
    continue the previous by one. `position_ids` must be the tensor the model passes to every
    layer, not a view made per call: the cache is keyed on the tensor itself."""
    global _last
    last = _last
    if last is not None and last[0] is position_ids and last[1] == position_ids._version:
        return last[2]
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    length = position_ids.shape[1]
    rows = []
    for row in starts.cpu():
        begin = row.nonzero().flatten().tolist()
        rows.append(list(zip(begin, begin[1:] + [length])))
    _last = (position_ids, position_ids._version, rows)
    return rows


def remember_segments(position_ids: Tensor, lengths: list[list[int]]) -> None:
    """The segments of `position_ids` given by the packer, so that `_segments` reads nothing
    back. A compiled layer (`trainer.compile`) gets them so rather than as the
    `sequence_lengths` keyword, whose host ints its graph would guard on (one recompilation
    per batch layout)."""
    global _last
    rows = []
    for row in lengths:
        ends = list(itertools.accumulate(row))
        rows.append(list(zip([0] + ends[:-1], ends)))
    _last = (position_ids, position_ids._version, rows)


def per_sequence_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                           attention_mask: Tensor | None, dropout: float = 0.0,
                           scaling: float | None = None, position_ids: Tensor | None = None,
                           **kwargs) -> tuple[Tensor, None]:
    """query (B, H, L, D), key and value (B, H_kv, L, D) -> (B, L, H, D), as transformers'
    attention functions return."""
    if (attention_mask is not None or position_ids is None or query.shape[2] == 1
            or key.shape[2] != query.shape[2]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, position_ids=position_ids, **kwargs)
    lengths = kwargs.get("sequence_lengths")
    window = kwargs.get("sliding_window")
    if lengths is not None:
        longest = kwargs["max_seqlen"]
    else:
        lengths = [[e - s for s, e in segments] for segments in _segments(position_ids)]
        if len(lengths) == 1:  # one row of positions for every row of the batch
            lengths = lengths * query.shape[0]
        longest = max(n for row in lengths for n in row)
    if window is not None and longest > window:
        raise ValueError(f"trainer.packed_attention=per_sequence: a sequence is longer than this "
                         f"model's sliding window ({window} tokens), which it does not apply; "
                         "use trainer.packed_attention=masked_row")
    cu_seqlens = kwargs.get("cu_seqlens")
    dtype = flash_dtype(query, key, value)
    if (query.device.type in VARLEN_DEVICES and dtype is not None and varlen_attn is not None
            and cu_seqlens is not None and dropout == 0):
        query, key, value = (t.to(dtype) for t in (query, key, value))
        return _varlen(query, key, value, cu_seqlens, longest, scaling), None
    gqa = key.shape[1] != query.shape[1]
    rows = []
    for b, row in enumerate(lengths):
        qs, ks, vs = (t[b:b + 1].split(row, dim=2) for t in (query, key, value))
        rows.append(torch.cat([
            torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa)
            for q, k, v in zip(qs, ks, vs)], dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


def _varlen(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, longest: int,
            scaling: float | None) -> Tensor:
    """One causal flash-attention call over every sequence of every row: (B, L, H, D)."""
    batch, heads, length, dim = query.shape
    gqa = key.shape[1] != heads  # grouped-query: each key/value head serves heads / H_kv
    if gqa and not _TAKES_GQA:  # torch before 2.12: one copy of k/v per query head
        key, value = (t.repeat_interleave(heads // key.shape[1], dim=1) for t in (key, value))
    flat = [t.transpose(1, 2).reshape(batch * length, t.shape[1], dim) for t in (query, key, value)]
    extra = {"enable_gqa": True} if gqa and _TAKES_GQA else {}
    out = varlen_attn(*flat, cu_seqlens, cu_seqlens, longest, longest, scale=scaling,
                      **_CAUSAL, **extra)
    return out.reshape(batch, length, heads, dim)


def flash_dtype(query: Tensor, key: Tensor, value: Tensor) -> torch.dtype | None:
    """The one half-precision dtype flash attention gets q, k and v in, or None (SDPA per
    sequence). Under autocast the weights stay float32 and the rotary embedding multiplies the
    half-precision q and k by float32 cos/sin, so q and k arrive in float32 and v in bf16: as
    transformers' own flash integration does, all three go in autocast's dtype."""
    dtypes = {query.dtype, key.dtype, value.dtype}
    if len(dtypes) == 1 and query.dtype in _FLASH_DTYPES:
        return query.dtype
    device = query.device.type
    if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in _FLASH_DTYPES:
        return torch.get_autocast_dtype(device)
    return None


_FLASH_DTYPES = (torch.float16, torch.bfloat16)  # flash attention's (fp32: SDPA per sequence)

VARLEN_DEVICES = ("cuda",)  # where varlen_attn has a kernel (flash attention)

# varlen_attn's causal flag: `is_causal` in torch 2.9-2.10, a (left, right) window since;
# `enable_gqa` (fewer key/value heads than query heads, without a copy) since 2.12.
_PARAMETERS = () if varlen_attn is None else inspect.signature(varlen_attn).parameters
_CAUSAL: dict[str, Any] = {"is_causal": True} if "is_causal" in _PARAMETERS else {"window_size": (-1, 0)}
_TAKES_GQA = "enable_gqa" in _PARAMETERS


def _mask(attention_mask: Tensor | None = None, **kwargs) -> Tensor | None:
    """No mask for unpadded rows (packed or not: causal within each segment); with a padding
    mask, sdpa's own, which sends the layer to sdpa."""
    if attention_mask is None:
        return None
    return sdpa_mask(attention_mask=attention_mask, **kwargs)


# Eager under torch.compile too (`trainer.compile`): its sequences' lengths are host ints that
# a traced graph would bake in (one graph per batch layout); on CUDA it is one kernel anyway.
AttentionInterface.register(NAME, torch.compiler.disable(per_sequence_attention))
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _mask)


def use_per_sequence_attention(model: nn.Module) -> None:
    """Make `model` (a Hugging Face causal LM) attend within each packed sequence only."""
    model.set_attn_implementation(NAME)


def set_packed_attention(model: nn.Module, tc: TrainerConfig) -> None:
    """`trainer.packed_attention` on a model the trainer scores packed rows with."""
    if tc.packing and tc.packed_attention == "per_sequence":
        use_per_sequence_attention(model)
