"""Attention within each packed sequence only (`trainer.packed_attention=per_sequence`).

A packed row holds several sequences, position_ids restarting at 0 for each
(`pipelinerl.rl.packing`). transformers' sdpa path attends over the whole row under a
block-diagonal mask: the work grows with the square of the row's length, although each token
sees only its own sequence. This attention function runs one causal SDPA per sequence instead
(its segment of the row), so the work grows with the squares of the sequences' lengths. It is
registered with transformers' `AttentionInterface` under `per_sequence`; its mask function
builds no mask for packed rows (the segments are the mask), and anything else (a padding mask,
one query at a time, a cache) goes to transformers' own sdpa function unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from pipelinerl.config import TrainerConfig

NAME = "per_sequence"

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
    gqa = key.shape[1] != query.shape[1]
    rows = []
    per_row = _segments(position_ids)
    if len(per_row) == 1:  # one row of positions for every row of the batch
        per_row = per_row * query.shape[0]
    window = kwargs.get("sliding_window")
    if window is not None and max(e - s for segments in per_row for s, e in segments) > window:
        raise ValueError(f"trainer.packed_attention=per_sequence: a sequence is longer than this "
                         f"model's sliding window ({window} tokens), which it does not apply; "
                         "use trainer.packed_attention=masked_row")
    for b, segments in enumerate(per_row):
        rows.append(torch.cat([
            torch.nn.functional.scaled_dot_product_attention(
                query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e],
                dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa)
            for s, e in segments], dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


def _mask(attention_mask: Tensor | None = None, **kwargs) -> Tensor | None:
    """No mask for unpadded rows (packed or not: causal within each segment); with a padding
    mask, sdpa's own, which sends the layer to sdpa."""
    if attention_mask is None:
        return None
    return sdpa_mask(attention_mask=attention_mask, **kwargs)


AttentionInterface.register(NAME, per_sequence_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _mask)


def use_per_sequence_attention(model: nn.Module) -> None:
    """Make `model` (a Hugging Face causal LM) attend within each packed sequence only."""
    model.set_attn_implementation(NAME)


def set_packed_attention(model: nn.Module, tc: TrainerConfig) -> None:
    """`trainer.packed_attention` on a model the trainer scores packed rows with."""
    if tc.packing and tc.packed_attention == "per_sequence":
        use_per_sequence_attention(model)
