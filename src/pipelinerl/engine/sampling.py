"""The truncation of the sampling distribution, shared by the engine and the trainer, and the
engine's sampler (`SlotSampler`).

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

from dataclasses import dataclass
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
    the candidates costs two or three host syncs per call (`static_threshold` costs none)."""
    n, vocab = scaled.shape
    top_k, top_p, use_k, use_p, k = _per_row(scaled, top_k, top_p)
    any_p = bool(use_p.any())
    floor = _min_p_floor(scaled, min_p)
    m = int(torch.where(use_k, k, 0).max())
    if any_p:
        m = max(m, min(vocab, _TOP_P_CANDIDATES))
    if m == 0:
        return floor
    while True:
        threshold, short = _over_candidates(scaled, m, k, use_k, top_p if any_p else None,
                                            use_p, floor)
        if short is None or m == vocab or not bool(short.any()):
            return threshold
        m = min(vocab, 8 * m)


def static_threshold(scaled: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor | float,
                     candidates: int, uses_top_p: bool) -> Tensor:
    """`truncation_threshold` without a host sync (shapes fixed by the caller, so a CUDA graph
    can hold it), equal to it where the caller's `candidates` (0: no top-k or top-p) hold
    every row's top-k and top-p set: at least every top_k, and the whole vocabulary for a row
    with top-p but no top-k. `uses_top_p`: some row's top_p < 1."""
    top_k, top_p, use_k, use_p, k = _per_row(scaled, top_k, top_p)
    floor = _min_p_floor(scaled, min_p)
    if candidates == 0:
        return floor
    return _over_candidates(scaled, candidates, k, use_k, top_p if uses_top_p else None,
                            use_p, floor)[0]


def _per_row(scaled: Tensor, top_k: Tensor | int, top_p: Tensor | float
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    n, vocab = scaled.shape
    top_k = torch.as_tensor(top_k, device=scaled.device).expand(n).long()
    top_p = torch.as_tensor(top_p, dtype=scaled.dtype, device=scaled.device).expand(n)
    use_k, use_p = top_k > 0, top_p < 1
    return top_k, top_p, use_k, use_p, torch.where(use_k, top_k.clamp(max=vocab), 1)


def _over_candidates(scaled: Tensor, m: int, k: Tensor, use_k: Tensor, top_p: Tensor | None,
                     use_p: Tensor, floor: Tensor) -> tuple[Tensor, Tensor | None]:
    """The threshold found among the `m` largest values of each row (top-p skipped where
    `top_p` is None), and the rows whose top-p set may reach past them (None without top-p)."""
    values = scaled.topk(m, dim=-1).values  # descending: the sorted prefix of each row
    kth = torch.where(use_k.unsqueeze(1), values.gather(1, k.unsqueeze(1) - 1), float("-inf"))
    # Both keep a prefix of the descending order: together, the shorter one.
    kth = torch.maximum(kth, floor)
    if top_p is None:
        return kth, None
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
    return torch.maximum(kth, pth), short


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
    columns looked at, so no narrower than the longest length (reading the length from the
    device would be a host sync, so the caller passes a width it knows); `lengths`, on
    `tokens`' device, and `penalty` (n,); a row with penalty 1 is unchanged."""
    valid = torch.arange(tokens.shape[1], device=tokens.device) < lengths.unsqueeze(1)
    # Positions past a row's length name its first token instead, which is in it anyway.
    ids = torch.where(valid, tokens, tokens[:, :1])
    seen = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, ids, True)
    p = penalty.unsqueeze(1)
    return torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)


@dataclass(frozen=True)
class SamplingPlan:
    """What a sampling call over some rows has to compute, known on the host from the rows'
    parameters (so the call reads none from the device), and the key of its captured graph.
    Every row is computed alike: a row with penalty 1, min_p 0, top_k 0 or top_p 1 comes out
    unchanged by the step it does not use, bit for bit."""

    penalise: bool = False  # some row's repetition penalty != 1
    truncate: bool = False  # some row uses top-k, top-p or min-p (sampling, not greedy)
    min_p: bool = False  # some row's min_p > 0
    candidates: int = 0  # the largest values sorted per row for top-k and top-p (0: none)
    top_p: bool = False  # some sampled row's top_p < 1
    # Some sampled row uses top-p without top-k over a vocabulary wider than the candidates
    # taken for it: `truncation_threshold` sizes them (host syncs), and no graph holds it.
    sized: bool = False

    @classmethod
    def of(cls, temperature: Tensor, top_k: Tensor, top_p: Tensor, truncates: Tensor,
           penalised: Tensor, uses_min_p: Tensor, vocab: int) -> SamplingPlan:
        """From the rows' parameters in host tensors (n,)."""
        penalise = bool(penalised.any())
        if not bool(truncates.any()):
            return cls(penalise)
        sampled = temperature > 0  # greedy rows are never truncated
        use_p = sampled & (top_p < 1)
        top_p_alone = bool((use_p & (top_k == 0)).any())
        k = int(torch.where(sampled, top_k, 0).max())
        # Rounded up to a power of two, so that few plans (graphs) cover every top_k.
        candidates = vocab if top_p_alone else min(vocab, 1 << (k - 1).bit_length()) if k else 0
        return cls(penalise, True, bool(uses_min_p.any()), candidates, bool(use_p.any()),
                   top_p_alone and vocab > _TOP_P_CANDIDATES)


class SlotSampler:
    """The engine's sampling over its slots as one function of device tensors (`sample`):
    the per-slot tokens and parameters it reads live in static device tensors the engine
    writes in place when a request takes a slot, and the noise each draw uses is drawn into
    a static buffer beforehand (`draw`), so that `sample` holds no host sync and no random
    generator and a CUDA graph can replay it.

    A token is sampled as vLLM's sampler does (V1, in this order): the repetition penalty on
    the raw logits (greedy rows too), temperature, min-p, top-k, top-p, then softmax over the
    kept set; rows with T = 0 are greedy and report log_softmax of the (penalised) logits. The
    draw is an exponential race (argmax p / E, E ~ Exp(1)), which samples from p with no host
    sync; the log-prob reported is the sampled token's under the distribution sampled from."""

    def __init__(self, capacity: int, max_seq_len: int, vocab: int, device: torch.device) -> None:
        # Prompt and generated tokens; column max_seq_len is scratch, where a step writes the
        # token of a row that needs none (a padding row, a sequence past its end).
        self.tokens = torch.zeros(capacity, max_seq_len + 1, dtype=torch.long, device=device)
        self.temperature = torch.ones(capacity, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(capacity, dtype=torch.long, device=device)
        self.top_p = torch.ones(capacity, dtype=torch.float32, device=device)
        self.min_p = torch.zeros(capacity, dtype=torch.float32, device=device)
        self.penalty = torch.ones(capacity, dtype=torch.float32, device=device)  # repetition
        self.noise = torch.ones(capacity, vocab, dtype=torch.float32, device=device)
        if vocab > 2**24:
            raise ValueError(f"a vocabulary of {vocab} tokens: ids past 2**24 are not exact in "
                             "the float32 the sampled tokens travel in")

    def params(self) -> list[Tensor]:
        """The per-slot parameters (capacity,), for the engine's slot moves."""
        return [self.temperature, self.top_k, self.top_p, self.min_p, self.penalty]

    def draw(self, start: int, end: int, generator: torch.Generator,
             own_generators: Sequence[tuple[int, torch.Generator]] = ()) -> None:
        """The noise of slots start..end-1 from `generator`, then the rows named in
        `own_generators` (row from start, generator: a request's seed) again from their own."""
        self.noise[start:end].exponential_(generator=generator)
        for row, own in own_generators:
            self.noise[start + row].exponential_(generator=own)

    def sample(self, logits: Tensor, start: int, end: int, cols: Tensor, plan: SamplingPlan,
               width: int) -> Tensor:
        """Sample the next token of slots start..end-1 from their fp32 `logits` (n, V) under
        `plan` (the rows' own parameters decide the rest) and the noise drawn for them; write
        each into `tokens[slot, cols[i]]` (`cols`: the sequence's length, on the device) and
        return (n, 2) float32: the token (exact: ids below 2**24) and its log-prob, for one
        copy to the host. `width` >= every length bounds the tokens the penalty looks at."""
        rows = slice(start, end)
        if plan.penalise:
            logits = apply_repetition_penalty(logits, self.tokens[rows, :width], cols,
                                              self.penalty[rows])
        temperature = self.temperature[rows]
        greedy = temperature == 0
        scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
        if plan.truncate:
            top_k = torch.where(greedy, 0, self.top_k[rows])
            top_p = torch.where(greedy, 1.0, self.top_p[rows])
            min_p = torch.where(greedy, 0.0, self.min_p[rows]) if plan.min_p else 0.0
            threshold = (truncation_threshold(scaled, top_k, top_p, min_p) if plan.sized else
                         static_threshold(scaled, top_k, top_p, min_p, plan.candidates, plan.top_p))
            scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
        logprobs = scaled.log_softmax(dim=-1)
        tokens = torch.where(greedy, logprobs.argmax(dim=-1),
                             (logprobs.exp() / self.noise[rows]).argmax(dim=-1))
        self.tokens[torch.arange(start, end, device=cols.device), cols] = tokens
        logprob = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        return torch.stack([tokens.float(), logprob], dim=1)


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
