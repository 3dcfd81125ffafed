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
    the sequences silently attend to each other. `score_tokens` always passes it.
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
from typing import Any, Callable, Literal, Sequence

import torch
from torch import Tensor, nn

from pipelinerl.engine.sampling import truncation_threshold
from pipelinerl.rl.attention import remember_segments
from pipelinerl.types import Sample

# Elements of fp32 logits materialised at once when turning logits into log-probs (256 MB).
_CHUNK_ELEMENTS = 1 << 26


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


def _keep_sampled(scaled: Tensor, threshold: Tensor, targets: Tensor) -> Tensor:
    """`scaled` with the tokens outside the kept set (`scaled >= threshold`) at -inf. The
    sampled token always stays: where the trainer's logits drop it (they moved since it was
    sampled, or differ numerically from the engine's), its log-prob is then small and finite,
    and continuous as it crosses the boundary, instead of -inf (0 * -inf = NaN in the loss)."""
    keep = (scaled >= threshold).scatter_(-1, targets[:, None], True)
    return scaled.masked_fill(~keep, float("-inf"))


@torch.no_grad()
def _entropy(x: Tensor, lse: Tensor) -> Tensor:
    """Entropy of softmax(x) per row, from x (n, V) and its logsumexp (n,); x may be -inf
    (tokens the truncation dropped: probability 0, no contribution). Graph-free."""
    p = (x - lse[:, None]).exp_()
    return torch.special.entr(p, out=p).sum(-1)


def _log_probs_of_kept(x: Tensor, lse: Tensor) -> Tensor:
    """log softmax(x) with the dropped tokens (x = -inf) at 0 instead of -inf: their
    probability is 0, and 0 * -inf would be NaN in a product or its gradient."""
    return (x - lse[:, None]).masked_fill(x == float("-inf"), 0.0)


def _entropy_with_grad(x: Tensor, lse: Tensor) -> Tensor:
    """`_entropy` through autograd: H = -sum p log p over the kept tokens."""
    p = torch.exp(x - lse[:, None])
    return -(p * _log_probs_of_kept(x, lse)).sum(-1)


def _scores_at_once(flat: Tensor, index: Tensor, targets: Tensor, temperature: float,
                    truncation: tuple[int, float] | None, entropy_grad: bool
                    ) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies of `targets` at rows `index` of `flat`, through autograd."""
    x = flat[index].float() / temperature
    if truncation:
        x = _keep_sampled(x, truncation_threshold(x, *truncation), targets)
    lse = torch.logsumexp(x, dim=-1)
    logprobs = x.gather(-1, targets[:, None]).squeeze(-1) - lse
    entropy = _entropy_with_grad(x, lse) if entropy_grad else _entropy(x.detach(), lse.detach())
    return logprobs, entropy


def _chunk_scores(logits: Tensor, rows: Tensor, targets: Tensor, temperature: float,
                  truncation: tuple[int, float] | None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """One chunk's log-probs, logsumexps, entropies and truncation thresholds (None: none)."""
    x = logits[rows].float() / temperature
    threshold = None
    if truncation:
        threshold = truncation_threshold(x, *truncation).squeeze(1)
        x = _keep_sampled(x, threshold[:, None], targets)
    lse = torch.logsumexp(x, dim=-1)
    out = x.gather(-1, targets[:, None]).squeeze(-1) - lse
    return out, lse, _entropy(x, lse), threshold


def _chunk_grad(logits: Tensor, rows: Tensor, targets: Tensor, lse: Tensor,
                threshold: Tensor | None, entropy: Tensor, g: Tensor,
                grad_entropy: Tensor | None, temperature: float) -> Tensor:
    """One chunk's gradient on its logits rows, in the logits' dtype."""
    x = logits[rows].float() / temperature
    if threshold is not None:
        # Dropped tokens get exp(-inf) = 0: the kept set is a stop-gradient choice.
        x = _keep_sampled(x, threshold[:, None], targets)
    # d/dx (x_target - logsumexp x) = onehot(target) - softmax(x); chain through /T.
    p = torch.exp(x - lse[:, None])
    if grad_entropy is not None:
        # dH/dx = -p (log p + H), 0 on the dropped tokens (p = 0).
        log_p = _log_probs_of_kept(x, lse)
        h_term = log_p.add_(entropy[:, None]).mul_(grad_entropy[:, None].float())
        dx = h_term.add_(g).mul_(-p)
    else:
        dx = p.mul_(-g)
    dx.scatter_add_(-1, targets[:, None], g)
    return dx.div_(temperature).to(logits.dtype)


# `trainer.compile`: the same functions under torch.compile, sequence lengths dynamic (one
# graph for every token count), made on first use.
_COMPILED: dict[str, Callable[..., Any]] = {}


def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    if fn.__name__ not in _COMPILED:
        _COMPILED[fn.__name__] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn.__name__]


class _SelectedLogprobs(torch.autograd.Function):
    """log_softmax(logits[rows] / T)[targets], computed in token chunks, optionally under the
    engine's top-k / top-p truncation; and the entropy of each row's distribution (with a
    gradient only when `entropy_grad`).

    Autograd through log_softmax would keep an fp32 (K, vocab) copy alive for backward; this
    keeps only the logits (model dtype), one fp32 chunk at a time and, when truncating, one
    threshold per token (the kept set is recomputed from it in backward, without a sort).
    `compiled`: each chunk's work under torch.compile.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        logits: Tensor,
        rows: Tensor,
        targets: Tensor,
        temperature: float,
        chunk: int,
        truncation: tuple[int, float] | None = None,
        entropy_grad: bool = False,
        compiled: bool = False,
    ) -> tuple[Tensor, Tensor]:
        out = torch.empty(rows.numel(), dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        entropy = torch.empty_like(out)
        threshold = torch.empty_like(out) if truncation else None
        scores = _compiled(_chunk_scores) if compiled else _chunk_scores
        for s in range(0, rows.numel(), chunk):
            e = s + chunk
            out[s:e], lse[s:e], entropy[s:e], cut = scores(logits, rows[s:e], targets[s:e],
                                                           temperature, truncation)
            if threshold is not None:
                threshold[s:e] = cut
        ctx.save_for_backward(logits, rows, targets, lse, threshold, entropy)
        ctx.temperature, ctx.chunk, ctx.entropy_grad = temperature, chunk, entropy_grad
        ctx.compiled = compiled
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        logits, rows, targets, lse, threshold, entropy = ctx.saved_tensors
        with_entropy = ctx.entropy_grad and grad_entropy is not None
        grad = torch.zeros_like(logits)
        chunk_grad = _compiled(_chunk_grad) if ctx.compiled else _chunk_grad
        for s in range(0, rows.numel(), ctx.chunk):
            e = s + ctx.chunk
            dx = chunk_grad(logits, rows[s:e], targets[s:e], lse[s:e],
                            None if threshold is None else threshold[s:e], entropy[s:e],
                            grad_out[s:e, None].float(),
                            grad_entropy[s:e] if with_entropy else None, ctx.temperature)
            grad.index_add_(0, rows[s:e], dx)
        return grad, None, None, None, None, None, None, None


@dataclass
class TokenScores:
    """The trainer's view of a batch's trained tokens, aligned with its fields."""

    logprobs: Tensor  # (K,) float32, with grad: log pi(a_t)
    # (K,) float32: entropy of pi at the position predicting a_t; with grad if entropy_grad.
    # None: not computed (the fused head, `trainer.liger`, gives log-probs only).
    entropy: Tensor | None


# How the scores are computed: eager (the reference), compiled (`trainer.compile`), or with
# Liger's fused linear + cross-entropy head (`trainer.liger`, CUDA).
ScoreMode = Literal["eager", "compiled", "liger"]


def score_tokens(
    model: nn.Module,
    batch: PackedBatch,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    chunk_tokens: int | None = None,
    entropy_grad: bool = False,
    mode: ScoreMode = "eager",
) -> TokenScores:
    """Trainer log-probs of the batch's trained tokens and the entropy of the distribution
    each is scored under, aligned with its fields.

    Log-probs come from the distribution the engine samples from: logits / temperature,
    truncated to the top-k (0: off), then top-p (1: off), set and renormalised
    (`engine.sampling`; the sampled token is always kept, see `_keep_sampled`). Gradients
    flow through the kept logits only; the entropy (of that same truncated, tempered
    distribution) is computed from the same logits without a graph, or with one when
    `entropy_grad` (an entropy bonus in the loss). Only the grid columns
    that predict a trained token are projected onto the vocabulary (`logits_to_keep`), so
    prompt positions cost no lm_head work in packed rows (padded rows keep the union of those
    columns over their rows). Beyond `chunk_tokens` trained tokens (default: 2^26 / vocab) the
    fp32 log-softmax runs chunk by chunk, forward and backward. `mode`: `ScoreMode`.
    """
    if batch.num_tokens == 0:
        empty = torch.zeros(0, device=batch.input_ids.device)
        return TokenScores(empty, empty)
    truncation = (top_k, top_p) if top_k > 0 or top_p < 1 else None
    if mode == "liger":
        from pipelinerl.rl.fused import fused_logprobs

        return TokenScores(fused_logprobs(model, batch, temperature, truncation, entropy_grad),
                           None)
    compiled = mode == "compiled"
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,  # a cache disables packed-sequence masking (module docstring)
        logits_to_keep=batch.logit_cols,
        **batch.attention_kwargs(compiled),
    )
    logits = out.logits  # (R, C, vocab)
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    chunk = chunk_tokens or max(1, _CHUNK_ELEMENTS // vocab)
    if batch.num_tokens <= chunk:
        # Small enough to materialise at once: plain autograd is faster (no recomputation).
        at_once = _compiled(_scores_at_once) if compiled else _scores_at_once
        return TokenScores(*at_once(flat, batch.logit_index, batch.target_ids, temperature,
                                    truncation, entropy_grad))
    logprobs, entropy = _SelectedLogprobs.apply(
        flat, batch.logit_index, batch.target_ids, temperature, chunk, truncation, entropy_grad,
        compiled,
    )
    return TokenScores(logprobs, entropy)
