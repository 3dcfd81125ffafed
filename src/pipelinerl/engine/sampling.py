"""The truncation of the sampling distribution, shared by the engine and the trainer.

A token is sampled from softmax(logits / T) restricted to a kept set and renormalised: top-k
first, then top-p over the top-k-renormalised probabilities (vLLM's and transformers' order).
The engine reports the sampled token's log-prob under that distribution; the trainer applies
the same function to its own logits so that it scores under the same distribution.

The kept set is always "every token whose scaled logit is >= a per-row threshold", so it
depends on the values only, never on how a sort orders equal values:
  - top-k keeps every token equal to the k-th largest (a tie at the boundary may keep more
    than k tokens; transformers and vLLM on CPU do the same, vLLM's CUDA kernel keeps k);
  - top-p keeps the smallest prefix of the descending order whose mass reaches p (a token is
    dropped once the mass before it already reaches p), plus every token equal to the last one
    kept (vLLM's and transformers' sort order decides among such equals instead).
"""

from __future__ import annotations

import torch
from torch import Tensor


# Candidates taken first for top-p without top-k: a top-p set rarely needs more; a row that
# does (its mass stays below p over all of them) is redone with 8 times as many, up to V.
_TOP_P_CANDIDATES = 1024


@torch.no_grad()
def truncation_threshold(scaled: Tensor, top_k: Tensor | int, top_p: Tensor | float) -> Tensor:
    """The smallest kept value of each row of `scaled` (n, V) (logits / T) under top-k, then
    top-p; -inf where neither truncates. `top_k` (0: off) and `top_p` (1: off) are per row (n,)
    or one for all rows. Returns (n, 1): the kept set is `scaled >= threshold`.

    Only the largest candidates are sorted (`topk`), not the whole vocabulary: a full sort of
    a 150k vocabulary cost 3 times the trainer's log-softmax fwd+bwd around it (H100). Sizing
    the candidates costs two or three host syncs per call."""
    n, vocab = scaled.shape
    top_k = torch.as_tensor(top_k, device=scaled.device).expand(n).long()
    top_p = torch.as_tensor(top_p, dtype=scaled.dtype, device=scaled.device).expand(n)
    use_k, use_p = top_k > 0, top_p < 1
    k = torch.where(use_k, top_k.clamp(max=vocab), 1)
    any_p = bool(use_p.any())
    m = int(torch.where(use_k, k, 0).max())
    if any_p:
        m = max(m, min(vocab, _TOP_P_CANDIDATES))
    if m == 0:
        return scaled.new_full((n, 1), float("-inf"))
    while True:
        values = scaled.topk(m, dim=-1).values  # descending: the sorted prefix of each row
        kth = torch.where(use_k.unsqueeze(1), values.gather(1, k.unsqueeze(1) - 1), float("-inf"))
        if not any_p:
            return kth
        # The top-k-renormalised probabilities: the top-k set is every token >= kth.
        lse = torch.logsumexp(scaled.masked_fill(scaled < kth, float("-inf")), -1, keepdim=True)
        probs = torch.exp(values - lse).masked_fill(values < kth, 0.0)
        mass_before = probs.cumsum(dim=-1) - probs
        # Positions whose preceding mass is below p: at least the first (mass_before = 0).
        count = (mass_before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True)
        pth = torch.where(use_p.unsqueeze(1), values.gather(1, count - 1), float("-inf"))
        # Every candidate kept and more may follow: only rows without top-k (with it, the
        # candidates hold the top-k set, so the threshold is kth whatever follows).
        short = (count == m).squeeze(1) & use_p & ~use_k
        if m == vocab or not bool(short.any()):
            return torch.maximum(kth, pth)
        m = min(vocab, 8 * m)
