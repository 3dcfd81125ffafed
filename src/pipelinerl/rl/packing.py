"""Turn samples into model inputs for the trainer: packed rows (default) or padded rows.

Layout. A sequence is prompt + completion; the model is fed all of it but the last token,
and input position p predicts the next token. Only completion tokens the model sampled are
trained (a multi-turn completion also holds the environment's tokens, `Sample.model_mask`), so each
`PackedBatch` carries the input grid (rows x length) and, flat and aligned, one entry per
trained token: where it is predicted in the grid, its id, the engine's log-prob, the policy
version that sampled it, the advantage of its sequence and the index of its sample.

Packed rows. Several sequences share one row, with position_ids restarting at 0 for each. What
transformers 5.23 honours (measured on Qwen2 with sdpa and eager, see tests/test_packing.py):
  - position_ids restarts with attention_mask=None: transformers detects the packed
    sequences and builds the block-diagonal causal mask itself (flash-attention uses varlen).
    It does so only when no KV cache is passed, and a causal LM creates a cache whenever
    use_cache is on, which is the config default even in train mode: without use_cache=False
    the sequences silently attend to each other. `rl.scores.score_tokens` always passes it.
  - a 4D boolean mask is honoured by sdpa but eager adds it to the scores as 0/1, silently
    wrong; a 4D additive float mask works with both but costs rows x L^2 memory and is
    refused by flash-attention. So we do not build 4D masks.
Each packed `PackedBatch` is a single row, which therefore needs no padding.

Padded rows. One sequence per row, right-padded, with a 2D attention_mask: the conventional
layout, kept so a benchmark can compare and the trainer can switch (same output format).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch
from torch import Tensor

from pipelinerl.rl.attention import remember_segments
from pipelinerl.types import Sample


@dataclass
class PackedBatch:
    """One forward pass: an input grid plus flat per-trained-token data (K entries)."""

    input_ids: Tensor  # (R, L) long
    position_ids: Tensor  # (R, L) long, restarting at 0 for each sequence
    attention_mask: Tensor | None  # (R, L) long padding mask; None when no row is padded
    target_ids: Tensor  # (K,) long: the trained (completion) token
    old_logprobs: Tensor  # (K,) float32: engine log-prob mu(a_t)
    versions: Tensor  # (K,) long: policy version that sampled the token
    # (K,) long: the version of the sequence's first sampled token. An engine that keeps its
    # KV cache across an update computed the token's context with weights from this version
    # up to its own; only where the two are equal did one set of weights compute it all.
    context_versions: Tensor
    advantages: Tensor  # (K,) float32: the advantage of the token's sequence
    seq_idx: Tensor  # (K,) long: index of the token's sample in the list given to pack/pad
    # (C,) long, sorted: the grid columns whose logits are kept (those predicting a trained
    # token in some row), and per trained token its row in those logits flattened to (R * C).
    logit_cols: Tensor
    logit_index: Tensor
    num_sequences: int
    # Unpadded rows: per row, the input length of each sequence, in order (host ints, so the
    # attention finds the sequences without reading position_ids back from a GPU)...
    sequence_lengths: list[list[int]] | None = None
    # ... and their boundaries over the flattened rows, int32 (varlen attention's cu_seqlens).
    cu_seqlens: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Trained tokens in this batch."""
        return self.target_ids.numel()

    @property
    def num_input_tokens(self) -> int:
        """Grid cells the model computes, padding included (throughput accounting)."""
        return self.input_ids.numel()

    def attention_kwargs(self, compiled: bool = False) -> dict[str, Any]:
        """What the model's forward passes on to `per_sequence` attention (rl.attention): the
        packed sequences' lengths (host ints), their cu_seqlens and the longest; {} when padded.
        `compiled` (compiled layers): cu_seqlens alone, the lengths handed to the attention
        beside the graph (`rl.attention.remember_segments`), since a graph guards on them."""
        if self.sequence_lengths is None:
            return {}
        if compiled:
            remember_segments(self.position_ids, self.sequence_lengths)
            return {"cu_seqlens": self.cu_seqlens}
        return {"sequence_lengths": self.sequence_lengths, "cu_seqlens": self.cu_seqlens,
                "max_seqlen": max(n for row in self.sequence_lengths for n in row)}

    def to(self, device: torch.device | str) -> PackedBatch:
        moved = {
            f.name: v.to(device) if isinstance(v := getattr(self, f.name), Tensor) else v
            for f in fields(self)
        }
        return PackedBatch(**moved)


def _input_length(s: Sample) -> int:
    if not s.prompt_ids:
        raise ValueError("a sample needs a non-empty prompt: its first token has no context")
    if not len(s.token_ids) == len(s.logprobs) == len(s.versions):
        raise ValueError(
            f"token_ids, logprobs and versions differ in length: "
            f"{len(s.token_ids)}, {len(s.logprobs)}, {len(s.versions)}"
        )
    if s.model_mask is not None and len(s.model_mask) != len(s.token_ids):
        raise ValueError(f"model_mask has {len(s.model_mask)} entries for {len(s.token_ids)} tokens")
    return len(s.prompt_ids) + len(s.token_ids) - 1


def _build(
    samples: Sequence[Sample], advantage: list[float], rows: list[list[int]], pad_id: int
) -> PackedBatch:
    lengths = [[_input_length(samples[i]) for i in row] for row in rows]
    row_lengths = [sum(ls) for ls in lengths]
    width = max(row_lengths)
    padded = any(n < width for n in row_lengths)
    if padded and any(len(row) > 1 for row in rows):
        # A 2D attention_mask switches off transformers' packed-sequence detection.
        raise ValueError("a padded batch must hold one sequence per row")
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long) if padded else None
    tok_rows: list[int] = []
    tok_cols: list[int] = []
    targets: list[int] = []
    old_lp: list[float] = []
    versions: list[int] = []
    context_versions: list[int] = []
    adv: list[float] = []
    seq_idx: list[int] = []
    for r, row in enumerate(rows):
        offset = 0
        for i, n in zip(row, lengths[r]):
            s = samples[i]
            ids = (list(s.prompt_ids) + list(s.token_ids))[:-1]
            input_ids[r, offset : offset + n] = torch.tensor(ids, dtype=torch.long)
            position_ids[r, offset : offset + n] = torch.arange(n)
            # Completion token j is predicted from the position just before it. The tokens an
            # environment wrote (multi-turn) are fed but not trained.
            first = offset + len(s.prompt_ids) - 1
            trained = [j for j, m in enumerate(s.model_mask) if m] if s.model_mask is not None \
                else range(len(s.token_ids))
            c = len(trained)
            tok_rows += [r] * c
            tok_cols += [first + j for j in trained]
            targets += [s.token_ids[j] for j in trained]
            old_lp += [s.logprobs[j] for j in trained]
            versions += [s.versions[j] for j in trained]
            context_versions += [s.versions[trained[0]]] * c if c else []
            adv += [advantage[i]] * c
            seq_idx += [i] * c
            offset += n
        if attention_mask is not None:
            attention_mask[r, :offset] = 1
    cols = sorted(set(tok_cols))
    at = {c: i for i, c in enumerate(cols)}
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        target_ids=torch.tensor(targets, dtype=torch.long),
        old_logprobs=torch.tensor(old_lp, dtype=torch.float32),
        versions=torch.tensor(versions, dtype=torch.long),
        context_versions=torch.tensor(context_versions, dtype=torch.long),
        advantages=torch.tensor(adv, dtype=torch.float32),
        seq_idx=torch.tensor(seq_idx, dtype=torch.long),
        logit_cols=torch.tensor(cols, dtype=torch.long),
        logit_index=torch.tensor([r * len(cols) + at[c] for r, c in zip(tok_rows, tok_cols)],
                                 dtype=torch.long),
        num_sequences=sum(len(row) for row in rows),
        sequence_lengths=None if padded else lengths,
        cu_seqlens=None if padded else torch.tensor(
            list(itertools.accumulate((n for row in lengths for n in row), initial=0)),
            dtype=torch.int32),
    )


def _floats(advantages: Sequence[float] | Tensor) -> list[float]:
    """The advantages as host floats: a tensor read once, not once per sequence (the step
    passes a list: no read at all)."""
    return advantages.tolist() if isinstance(advantages, Tensor) else [float(a) for a in advantages]


def _trainable(samples: Sequence[Sample], advantages: Sequence[float]) -> list[int]:
    if len(advantages) != len(samples):
        raise ValueError(f"{len(samples)} samples but {len(advantages)} advantages")
    # An empty completion has no token to train; it would only cost compute.
    return [i for i, s in enumerate(samples) if s.token_ids]


def pack(
    samples: Sequence[Sample],
    advantages: Sequence[float] | Tensor,
    max_tokens_per_row: int,
    pad_id: int = 0,
) -> list[PackedBatch]:
    """Pack sequences into single-row batches of at most `max_tokens_per_row` input tokens.

    First-fit decreasing: longest first, each into the first row with room. A sequence longer
    than the limit gets a row of its own. Samples with no completion tokens are skipped.
    """
    if max_tokens_per_row < 1:
        raise ValueError(f"max_tokens_per_row must be >= 1, got {max_tokens_per_row}")
    adv = _floats(advantages)
    keep = _trainable(samples, adv)
    lengths = {i: _input_length(samples[i]) for i in keep}
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(keep, key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(max_tokens_per_row - lengths[i])
    return [_build(samples, adv, [row], pad_id) for row in rows]


def pad(
    samples: Sequence[Sample],
    advantages: Sequence[float] | Tensor,
    max_tokens_per_batch: int | None = None,
    pad_id: int = 0,
) -> list[PackedBatch]:
    """Right-padded batches, one sequence per row, in the given order.

    Consecutive samples share a batch while rows x longest length stays within
    `max_tokens_per_batch` (None: all in one batch); a sequence over the limit goes alone.
    Samples with no completion tokens are skipped.
    """
    adv = _floats(advantages)
    batches: list[list[int]] = []
    width = 0
    for i in _trainable(samples, adv):
        n = _input_length(samples[i])
        grown = max(width, n)
        if batches and (
            max_tokens_per_batch is None or grown * (len(batches[-1]) + 1) <= max_tokens_per_batch
        ):
            batches[-1].append(i)
            width = grown
        else:
            batches.append([i])
            width = n
    return [_build(samples, adv, [[i] for i in b], pad_id) for b in batches]
