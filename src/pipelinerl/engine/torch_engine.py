"""The `torch` engine: continuous batching over our hand-written decoder, CPU or CUDA.

Active sequences live packed in cache slots 0..n-1; a finished sequence's slot is refilled by
moving the last active one into it, so each decode step is one batched forward over exactly the
active sequences. All per-token state (tokens, log-probs, versions, sampling parameters) sits in
per-slot tensors on the device; the hot loop touches Python per sequence only when one finishes.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch

from pipelinerl.engine.sampling import truncation_threshold
from pipelinerl.engine.base import ReceiveFn
from pipelinerl.models.decoder import CausalDecoder, KVCache, load_pretrained
from pipelinerl.types import GenerationOutput, GenerationRequest, SamplingParams

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass
class EngineStats:
    """Cumulative counters for metrics."""

    generated_tokens: int = 0
    decode_steps: int = 0
    prefill_forwards: int = 0
    prefill_tokens: int = 0  # prompt tokens written to the cache (padding excluded)
    finished_requests: int = 0
    weight_updates: int = 0
    recomputed_tokens: int = 0  # tokens whose K/V were recomputed after weight updates


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator,
    truncate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of fp32 `logits` [n, V] with per-row parameters; return the
    tokens and their log-probs under the distribution actually sampled from: softmax of
    logits / T restricted to the top-k, then top-p, set and renormalised (`engine.sampling`,
    which the trainer applies too). Rows with T = 0 are greedy and report log_softmax of the
    raw logits. `truncate` is False when no row uses top-k/top-p, which skips the vocabulary
    sort."""
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(1)
    if truncate:
        threshold = truncation_threshold(
            scaled, torch.where(greedy, 0, top_k), torch.where(greedy, 1.0, top_p)
        )
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    logprobs = scaled.log_softmax(dim=-1)
    # Exponential-race sampling (argmax p / E, E ~ Exp(1)) draws from p without a host sync.
    noise = torch.empty_like(logprobs).exponential_(generator=generator)
    tokens = torch.where(greedy, logprobs.argmax(dim=-1), (logprobs.exp() / noise).argmax(dim=-1))
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


class TorchEngine:
    """Continuous-batching generation engine implementing `pipelinerl.engine.base.Engine`."""

    def __init__(
        self,
        model: CausalDecoder | PretrainedConfig,
        *,
        capacity: int,
        max_seq_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        recompute_kv_on_update: bool = False,
        seed: int = 0,
        max_prefill_tokens: int = 8192,
    ) -> None:
        """`model` is a `CausalDecoder` or a HF config of a supported family (random weights, to
        be replaced by `load_weights`). `max_prefill_tokens` bounds the padded tokens of one
        prefill forward (admissions and KV recomputes are split into such chunks)."""
        if capacity < 1 or max_seq_len < 2:
            raise ValueError(f"need capacity >= 1 and max_seq_len >= 2, got {capacity} and {max_seq_len}")
        self.device = torch.device(device)
        self.dtype = dtype
        if not isinstance(model, CausalDecoder):
            model = CausalDecoder(model, device=self.device, dtype=dtype)
        self.model = model.to(device=self.device, dtype=dtype).eval().requires_grad_(False)
        self.version = 0
        self.recompute_kv_on_update = recompute_kv_on_update
        self.max_seq_len = max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.stats = EngineStats()
        self._capacity = capacity
        self._cache = KVCache(self.model.config, capacity, max_seq_len, self.device, dtype)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        self._queue: deque[GenerationRequest] = deque()
        # step() and weight updates exclude each other, so an update from another thread lands
        # between two steps.
        self._lock = threading.Lock()
        self._torn = False  # a weight update raised part-way through

        # Slot state. Slots 0..n-1 hold the active sequences, in no particular order.
        self._n = 0
        self._requests: list[GenerationRequest | None] = [None] * capacity
        dev = self.device
        self._tokens = torch.zeros(capacity, max_seq_len, dtype=torch.long, device=dev)  # prompt + generated
        self._logprobs = torch.zeros(capacity, max_seq_len, dtype=torch.float32, device=dev)
        self._versions = torch.zeros(capacity, max_seq_len, dtype=torch.long, device=dev)
        self._temperature = torch.ones(capacity, dtype=torch.float32, device=dev)
        self._top_k = torch.zeros(capacity, dtype=torch.long, device=dev)
        self._top_p = torch.ones(capacity, dtype=torch.float32, device=dev)
        self._stop_ids = torch.full((capacity, 1), -1, dtype=torch.long, device=dev)  # -1 pads
        # Host-side mirrors drive lengths and length limits without syncing with the device.
        self._len = torch.zeros(capacity, dtype=torch.long)  # tokens in the sequence; the last is not yet in the cache
        self._prompt_len = torch.zeros(capacity, dtype=torch.long)
        self._max_new = torch.zeros(capacity, dtype=torch.long)
        self._truncates = torch.zeros(capacity, dtype=torch.bool)  # uses top-k or top-p

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        capacity: int,
        max_seq_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        recompute_kv_on_update: bool = False,
        seed: int = 0,
        max_prefill_tokens: int = 8192,
    ) -> "TorchEngine":
        """Load a model from a local Hugging Face directory (safetensors weights); see
        `models.decoder.SUPPORTED_MODEL_TYPES` for the families."""
        return cls(
            load_pretrained(path, device=device, dtype=dtype),
            capacity=capacity,
            max_seq_len=max_seq_len,
            device=device,
            dtype=dtype,
            recompute_kv_on_update=recompute_kv_on_update,
            seed=seed,
            max_prefill_tokens=max_prefill_tokens,
        )

    @property
    def capacity(self) -> int:
        return self._capacity

    def num_active(self) -> int:
        """Requests accepted and not yet returned: running plus queued, so that an actor topping
        the engine up to `capacity` does not overfill the queue between two steps."""
        return self._n + len(self._queue)

    def num_running(self) -> int:
        return self._n

    def add_request(self, request: GenerationRequest) -> None:
        p, n = request.params, len(request.prompt_ids)
        if n == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if p.max_new_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: max_new_tokens={p.max_new_tokens} must be >= 1")
        if n + p.max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {n} tokens + max_new_tokens={p.max_new_tokens} "
                f"= {n + p.max_new_tokens} exceeds the engine's max_seq_len={self.max_seq_len}"
            )
        if p.temperature < 0 or not 0 < p.top_p <= 1 or p.top_k < 0:
            raise ValueError(
                f"request {request.request_id!r}: invalid sampling params temperature={p.temperature}, "
                f"top_p={p.top_p}, top_k={p.top_k} (need temperature >= 0, 0 < top_p <= 1, top_k >= 0)"
            )
        vocab = self.model.config.vocab_size
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab:
            raise ValueError(f"request {request.request_id!r}: prompt token ids outside [0, {vocab})")
        self._queue.append(request)

    def step(self) -> list[GenerationOutput]:
        """Admit queued requests into free slots (their first token comes from the prefill),
        then run one decode step over all active sequences; return those that finished."""
        with self._lock, torch.no_grad():
            if self._torn:
                raise RuntimeError("a weight update failed part-way: the engine holds a mix of two versions")
            finished: list[GenerationOutput] = []
            if self._queue and self._n < self._capacity:
                start = self._n
                self._admit()
                finished += self._collect_finished(start)
            if self._n:
                self._decode()
                finished += self._collect_finished(0)
            return finished

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        with self._lock:
            self.model.load_hf_weights(weights)  # checks every name and shape before copying
            self._mark_updated(version)

    def receive_weights(self, receive: ReceiveFn) -> int:
        """See `Engine.receive_weights`. The targets are the model's own parameters by HF name;
        with tied embeddings `lm_head.weight` and `model.embed_tokens.weight` are one tensor."""
        with self._lock:
            self._torn = True  # until `receive` returns: a failed copy may have been partial
            targets = {name: p.data for name, p in self.model.named_parameters(remove_duplicate=False)}
            version = receive(targets)
            self._torn = False
            self._mark_updated(version)
        return version

    # -- internals ---------------------------------------------------------------------------

    def _mark_updated(self, version: int) -> None:
        self.version = version
        self.stats.weight_updates += 1
        if self.recompute_kv_on_update and self._n:
            with torch.no_grad():
                # Everything but each sequence's last token (not yet fed) goes back in the cache.
                self._prefill(0, self._n, self._len[: self._n] - 1)
            self.stats.recomputed_tokens += int(self._len[: self._n].sum()) - self._n

    def _admit(self) -> None:
        start = self._n
        while self._queue and self._n < self._capacity:
            self._place(self._n, self._queue.popleft())
            self._n += 1
        lengths = self._len[start : self._n]
        self.stats.prefill_tokens += int(lengths.sum())
        self._sample_into(start, self._n, self._prefill(start, self._n, lengths))

    def _place(self, slot: int, request: GenerationRequest) -> None:
        p: SamplingParams = request.params
        n = len(request.prompt_ids)
        self._requests[slot] = request
        self._tokens[slot, :n] = torch.tensor(request.prompt_ids, dtype=torch.long)
        self._temperature[slot] = p.temperature
        self._top_k[slot] = p.top_k
        self._top_p[slot] = p.top_p
        stops = p.stop_token_ids
        if len(stops) > self._stop_ids.shape[1]:
            pad = torch.full((self._capacity, len(stops) - self._stop_ids.shape[1]), -1, dtype=torch.long, device=self.device)
            self._stop_ids = torch.cat([self._stop_ids, pad], dim=1)
        self._stop_ids[slot] = -1
        if stops:
            self._stop_ids[slot, : len(stops)] = torch.tensor(stops, dtype=torch.long)
        self._len[slot] = n
        self._prompt_len[slot] = n
        self._max_new[slot] = p.max_new_tokens
        self._truncates[slot] = p.temperature > 0 and (p.top_k > 0 or p.top_p < 1)

    def _prefill(self, start: int, end: int, lengths: torch.Tensor) -> torch.Tensor:
        """Prefill tokens [0, lengths[i]) of slots start..end-1 in chunks of at most
        `max_prefill_tokens` padded tokens; return last-position logits [end - start, V]."""
        logits = []
        lo = start
        while lo < end:
            hi, width = lo + 1, int(lengths[lo - start])
            while hi < end and (hi + 1 - lo) * max(width, int(lengths[hi - start])) <= self.max_prefill_tokens:
                width = max(width, int(lengths[hi - start]))
                hi += 1
            slots = torch.arange(lo, hi, device=self.device)
            chunk_lengths = lengths[lo - start : hi - start].to(self.device)
            logits.append(self.model.prefill(self._cache, self._tokens[lo:hi, :width], chunk_lengths, slots))
            self.stats.prefill_forwards += 1
            lo = hi
        return torch.cat(logits)

    def _decode(self) -> None:
        n = self._n
        positions = (self._len[:n] - 1).to(self.device)
        rows = torch.arange(n, device=self.device)
        logits = self.model.decode(self._cache, self._tokens[rows, positions], positions, int(self._len[:n].max()))
        self._sample_into(0, n, logits)
        self.stats.decode_steps += 1

    def _sample_into(self, start: int, end: int, logits: torch.Tensor) -> None:
        """Sample the next token of slots start..end-1 and append it with its log-prob/version."""
        tokens, logprobs = sample_tokens(
            logits.float(),
            self._temperature[start:end],
            self._top_k[start:end],
            self._top_p[start:end],
            self._generator,
            bool(self._truncates[start:end].any()),
        )
        rows = torch.arange(start, end, device=self.device)
        cols = self._len[start:end].to(self.device)
        self._tokens[rows, cols] = tokens
        self._logprobs[rows, cols] = logprobs
        self._versions[rows, cols] = self.version
        self._len[start:end] += 1
        self.stats.generated_tokens += end - start

    def _collect_finished(self, start: int) -> list[GenerationOutput]:
        """Return the sequences among slots start..n-1 whose last token is a stop token or that
        reached max_new_tokens, and free their slots (one device sync)."""
        n = self._n
        rows = torch.arange(start, n, device=self.device)
        last = self._tokens[rows, (self._len[start:n] - 1).to(self.device)]
        stopped = (last.unsqueeze(1) == self._stop_ids[start:n]).any(dim=1).cpu()
        full = self._len[start:n] - self._prompt_len[start:n] >= self._max_new[start:n]
        done = (stopped | full).nonzero().flatten()
        if not len(done):
            return []
        slots = (done + start).tolist()
        outputs = []
        # One transfer for the finished rows, then plain Python per finished sequence.
        width = int(self._len[slots].max())
        tokens = self._tokens[slots, :width].tolist()
        logprobs = self._logprobs[slots, :width].tolist()
        versions = self._versions[slots, :width].tolist()
        for i, slot in enumerate(slots):
            request = self._requests[slot]
            lo, hi = int(self._prompt_len[slot]), int(self._len[slot])
            outputs.append(
                GenerationOutput(
                    request_id=request.request_id,
                    prompt_ids=list(request.prompt_ids),
                    token_ids=tokens[i][lo:hi],
                    logprobs=logprobs[i][lo:hi],
                    versions=versions[i][lo:hi],
                    finish_reason="stop" if stopped[slot - start] else "length",
                )
            )
        self._release(slots)
        self.stats.finished_requests += len(outputs)
        return outputs

    def _release(self, slots: list[int]) -> None:
        """Free `slots` and keep the active ones packed at the front by moving the last active
        sequences into the holes."""
        freed = set(slots)
        n_new = self._n - len(freed)
        holes = [s for s in slots if s < n_new]
        movers = [s for s in range(n_new, self._n) if s not in freed]
        if holes:
            length = int(self._len[movers].max())
            src = torch.tensor(movers, device=self.device)
            dst = torch.tensor(holes, device=self.device)
            self._cache.move(src, dst, length)
            for t in (self._tokens, self._logprobs, self._versions):
                t[dst, :length] = t[src, :length]
            for t in (self._temperature, self._top_k, self._top_p, self._stop_ids):
                t[dst] = t[src]
            for t in (self._len, self._prompt_len, self._max_new, self._truncates):
                t[holes] = t[movers]
            for h, m in zip(holes, movers):
                self._requests[h] = self._requests[m]
        for s in range(n_new, self._n):
            self._requests[s] = None
        self._n = n_new
