"""The truncation of the sampling distribution, shared by the engine and the trainer, and the
engine's sampler (`sample_tokens`).

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

Requests may ask more of the engine, as vLLM's sampler does them (V1, in this order):
`repetition_penalty` changes the raw logits of every token already in the sequence, before
everything else (greedy rows too); `min_p` keeps the tokens whose probability is at least
`min_p` times the largest, after temperature and before top-k; `StopStrings` end a sequence
once its decoded text holds one of them. The log-prob the engine reports is then that of the
distribution these leave. The trainer knows only temperature, top-k and top-p.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
from torch import Tensor

if TYPE_CHECKING:
    from pipelinerl.types import StopStrings


# Candidates taken first for top-p without top-k: a top-p set rarely needs more; a row that
# does (its mass stays below p over all of them) is redone with 8 times as many, up to V.
_TOP_P_CANDIDATES = 1024


@torch.no_grad()
def truncation_threshold(scaled: Tensor, top_k: Tensor | int, top_p: Tensor | float,
                         min_p: Tensor | float = 0.0) -> Tensor:
    """The smallest kept value of each row of `scaled` (n, V) (logits / T) under min-p, then
    top-k, then top-p; -inf where none truncates. `top_k` (0: off), `top_p` (1: off) and
    `min_p` (0: off) are per row (n,) or one for all rows; a tensor `min_p` costs a pass over
    the rows even where every row has 0 (pass 0.0 then). Returns (n, 1): the kept set is
    `scaled >= threshold`.

    Only the largest candidates are sorted (`topk`), not the whole vocabulary: a full sort of
    a 150k vocabulary cost 3 times the trainer's log-softmax fwd+bwd around it (H100). Sizing
    the candidates costs two or three host syncs per call."""
    n, vocab = scaled.shape
    top_k = torch.as_tensor(top_k, device=scaled.device).expand(n).long()
    top_p = torch.as_tensor(top_p, dtype=scaled.dtype, device=scaled.device).expand(n)
    use_k, use_p = top_k > 0, top_p < 1
    k = torch.where(use_k, top_k.clamp(max=vocab), 1)
    any_p = bool(use_p.any())
    floor = _min_p_floor(scaled, min_p)
    m = int(torch.where(use_k, k, 0).max())
    if any_p:
        m = max(m, min(vocab, _TOP_P_CANDIDATES))
    if m == 0:
        return floor
    while True:
        values = scaled.topk(m, dim=-1).values  # descending: the sorted prefix of each row
        kth = torch.where(use_k.unsqueeze(1), values.gather(1, k.unsqueeze(1) - 1), float("-inf"))
        # Both keep a prefix of the descending order: together, the shorter one.
        kth = torch.maximum(kth, floor)
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


def _min_p_floor(scaled: Tensor, min_p: Tensor | float) -> Tensor:
    """Per row (n, 1): p >= min_p * p_max, that is scaled >= max + log(min_p); -inf for
    min_p = 0. A tensor is applied as it is: asking whether any row uses it would be a host
    sync, so the caller, which knows, passes the number 0 instead when none does."""
    n = scaled.shape[0]
    if isinstance(min_p, (int, float)) and not min_p > 0:
        return scaled.new_full((n, 1), float("-inf"))
    min_p = torch.as_tensor(min_p, dtype=scaled.dtype, device=scaled.device).expand(n)
    return (scaled.amax(dim=-1) + min_p.log()).unsqueeze(1)  # log 0 = -inf: off


def apply_repetition_penalty(logits: Tensor, tokens: Tensor, lengths: Tensor,
                             penalty: Tensor) -> Tensor:
    """vLLM's (and transformers') repetition penalty: the logit of every token among the
    first `lengths[i]` of `tokens[i]` (prompt and generated) is divided by `penalty[i]` where
    positive, multiplied where negative. `logits` (n, V); `tokens` (n, W), each of its W
    columns looked at, so no wider than the longest length (the caller cuts it: reading the
    length from the device would be a host sync); `lengths`, on `tokens`' device, and
    `penalty` (n,); a row with penalty 1 is unchanged."""
    valid = torch.arange(tokens.shape[1], device=tokens.device) < lengths.unsqueeze(1)
    # Positions past a row's length name its first token instead, which is in it anyway.
    ids = torch.where(valid, tokens, tokens[:, :1])
    seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, True)
    p = penalty.unsqueeze(1)
    return torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator,
    truncate: bool,
    min_p: torch.Tensor | float = 0.0,
    own_generators: Sequence[tuple[int, torch.Generator]] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of fp32 `logits` [n, V] with per-row parameters; return the
    tokens and their log-probs under the distribution actually sampled from: softmax of
    logits / T restricted to the min-p, then top-k, then top-p, set and renormalised
    (`truncation_threshold`; the trainer applies top-k and top-p too). Rows with T = 0 are
    greedy and report log_softmax of the logits. `truncate` is False when no row uses top-k, top-p
    or min-p, which skips the vocabulary sort. Rows named in `own_generators` (row,
    generator) draw from their own generator (a request's seed), the others from
    `generator`."""
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    if truncate:
        if isinstance(min_p, torch.Tensor):
            min_p = torch.where(greedy, 0.0, min_p)
        threshold = truncation_threshold(
            scaled, torch.where(greedy, 0, top_k), torch.where(greedy, 1.0, top_p), min_p
        )
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    logprobs = scaled.log_softmax(dim=-1)
    # Exponential-race sampling (argmax p / E, E ~ Exp(1)) draws from p without a host sync.
    noise = torch.empty_like(logprobs).exponential_(generator=generator)
    for row, own in own_generators:
        noise[row].exponential_(generator=own)
    tokens = torch.where(greedy, logprobs.argmax(dim=-1), (logprobs.exp() / noise).argmax(dim=-1))
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


class StopMatcher:
    """One turn's text, decoded incrementally (tokenizers' `DecodeStream`, as vLLM does)."""

    def __init__(self, stop: StopStrings, context: list[int]) -> None:
        from tokenizers.decoders import DecodeStream

        self._stop = stop
        self._stream = DecodeStream(ids=context[-_STOP_CONTEXT:],
                                    skip_special_tokens=stop.skip_special_tokens)
        self.text = ""

    def feed(self, token_id: int) -> str | None:
        """Take the next token; return the first of the stop strings its text now holds."""
        try:
            chunk = self._stream.step(self._stop.tokenizer, token_id)
        except Exception as e:  # noqa: BLE001 - only the one below is recovered from
            # A tokenizer whose output is not monotonic UTF-8 breaks the stream's state
            # (vLLM recovers the same way): decode on from this token, without context.
            if not str(e).startswith("Invalid prefix encountered"):
                raise
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=self._stop.skip_special_tokens)
            chunk = self._stream.step(self._stop.tokenizer, token_id)
        if not chunk:  # part of a character, or a skipped special token
            return None
        new_from = len(self.text)
        self.text += chunk
        # Only an occurrence that ends in the new text is new (an older one stopped already).
        return next((s for s in self._stop.strings
                     if self.text.find(s, max(0, new_from - len(s) + 1)) >= 0), None)


# Context tokens a matcher decodes the turn's first tokens after (vLLM primes with fewer).
_STOP_CONTEXT = 8
