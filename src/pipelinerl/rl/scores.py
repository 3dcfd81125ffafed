"""The trainer's log-probs of the trained tokens of a `PackedBatch` (`score_tokens`): from the
distribution the engine samples from (temperature, top-k, top-p; `engine.sampling`), with the
entropy beside them, chunked over the vocabulary when the logits would not fit, eager,
compiled (`trainer.compile`) or through Liger's fused head (`trainer.liger`, `rl.fused`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
from torch import Tensor, nn

from pipelinerl.engine.sampling import truncation_threshold
from pipelinerl.rl.fused import fused_logprobs
from pipelinerl.rl.packing import PackedBatch

# Elements of fp32 logits materialised at once when turning logits into log-probs (256 MB).
_CHUNK_ELEMENTS = 1 << 26


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
