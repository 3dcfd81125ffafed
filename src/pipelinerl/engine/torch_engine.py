"""The `torch` engine's scheduler: continuous batching over our hand-written decoder, CPU or
CUDA. It decides which requests run in which slots, tracks their lengths, stops and versions,
and samples; every forward over the KV cache runs in its model runner (`engine.runner`).

Running sequences live packed in slots 0..num_running-1; a finished sequence's slot is refilled
by swapping the last running one into it, so each decode step is one batched forward over
exactly the running sequences. The tokens the model reads and the sampling parameters sit in
per-slot tensors on the device (`SlotSampler`); what the host decides by (lengths, stops, the
tokens, log-probs and versions an output returns) in host tensors, filled from one copy per
step of the sampled tokens and their log-probs. The hot loop touches Python per sequence
only when one finishes.

The stop check (stop tokens, stop sequences, stop strings, max_new_tokens) reads that copy.
On CUDA it reads it one step late (`late_stop_check`): a step launches the next decode before
it reads the previous one's tokens, so the host never waits for the device in steady state. A
sequence found finished then has decoded one token too many; that token is dropped (never
returned, counted or stamped), so the outputs are what reading at once gives: the same tokens,
log-probs and versions for greedy and seeded requests, the same distribution for the others
(the extra row draws noise from the engine's generator).

Multi-turn (held requests): a sequence whose turn ends is parked in a slot beyond the running
ones with its KV cache, decoded no more, until `extend` appends the environment's tokens (a
prefill of only those, attending to the cache) and generation resumes, or `release` frees it.
A weight update may land while it waits: its cache is then kept, or, with
`recompute_kv_on_update`, recomputed when it resumes.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

import torch

from pipelinerl.engine.base import EngineOptions, ReceiveFn, torch_dtype
from pipelinerl.engine.runner import make_runner
from pipelinerl.engine.sampling import SamplingPlan, SlotSampler, StopMatcher
from pipelinerl.models.decoder import CausalDecoder, load_pretrained
from pipelinerl.types import GenerationOutput, GenerationRequest, SamplingParams

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass
class EngineStats:
    """Cumulative counters for metrics."""

    generated_tokens: int = 0
    decode_steps: int = 0
    prefill_forwards: int = 0
    prefill_tokens: int = 0  # prompt tokens computed into the cache (padding excluded)
    shared_prefill_tokens: int = 0  # prompt tokens copied from an identical prompt's cache
    extended_tokens: int = 0  # environment tokens appended to held sequences
    finished_requests: int = 0
    weight_updates: int = 0
    recomputed_tokens: int = 0  # tokens whose K/V were recomputed after weight updates


@dataclass
class _Sampled:
    """Tokens sampled for slots start..end-1, on their way to the host: `values` (rows, 2)
    float32 (token, log-prob), filled by a copy that has run once `event` has (None: a copy
    that ran at once, on the CPU)."""

    values: torch.Tensor
    event: torch.cuda.Event | None
    version: int  # of the weights that sampled them
    start: int
    end: int
    # Per slot (capacity,): the row of `values` holding the token of the sequence now in that
    # slot; -1 for none, or for a token dropped (its sequence finished before it was read).
    # Moved with the slots; None while row i is still slot start + i (steady state).
    rows: torch.Tensor | None = None
    # By id: a request's own generator and its state before this step drew from it, to undo
    # the draw of a token dropped (so that its next turn draws what reading at once would).
    drawn: dict[int, tuple[torch.Generator, torch.Tensor]] = field(default_factory=dict)

    def slot_rows(self, capacity: int) -> torch.Tensor:
        """`rows`, made first if it is not yet, for a change."""
        if self.rows is None:
            self.rows = torch.full((capacity,), -1, dtype=torch.long)
            self.rows[self.start : self.end] = torch.arange(self.end - self.start)
        return self.rows

    def drop(self, slots: torch.Tensor, generators: list[torch.Generator | None], capacity: int) -> None:
        """Drop the tokens of the sequences in `slots` (host), undoing their own draws."""
        rows = self.slot_rows(capacity)
        for slot in slots[rows[slots] >= 0].tolist():
            own = generators[slot]
            if own is not None and id(own) in self.drawn:
                own.set_state(self.drawn[id(own)][1])
        rows[slots] = -1


class TorchEngine:
    """Continuous-batching generation engine implementing `pipelinerl.engine.base.Engine`."""

    def __init__(self, model: CausalDecoder | PretrainedConfig, options: EngineOptions) -> None:
        """`model` is a `CausalDecoder` or a HF config of a supported family (random weights, to
        be replaced by `load_weights`). Prefills and KV recomputes are split into forwards of at
        most `options.max_prefill_tokens` padded tokens; every forward runs in `engine.runner`."""
        capacity, max_seq_len = options.capacity, options.max_seq_len
        if capacity < 1 or max_seq_len < 2:
            raise ValueError(f"need capacity >= 1 and max_seq_len >= 2, got {capacity} and {max_seq_len}")
        self.device = torch.device(options.device)
        self.dtype = torch_dtype(options.dtype)
        if not isinstance(model, CausalDecoder):
            model = CausalDecoder(model, device=self.device, dtype=self.dtype)
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.version = 0
        self.recompute_kv_on_update = options.recompute_kv_on_update
        self.max_seq_len = max_seq_len
        self.max_prefill_tokens = options.max_prefill_tokens
        self.stats = EngineStats()
        self._capacity = capacity
        vocab = self.model.config.vocab_size
        self._sampler = SlotSampler(capacity, max_seq_len, vocab, self.device)
        self._runner = make_runner(self.model, self._sampler, capacity, max_seq_len,
                                   options.cuda_graphs and self.device.type == "cuda")
        self._late = (self.device.type == "cuda" if options.late_stop_check is None
                      else options.late_stop_check)
        self._in_flight: _Sampled | None = None  # the decode step launched, not read yet
        self._ready: list[GenerationOutput] = []  # found finished between two steps
        # The running batch's (size, plan, longest length), kept while it only decodes, so
        # that a steady-state step reads nothing to launch; None when it changes.
        self._batch: tuple[int, SamplingPlan, int] | None = None
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(options.seed)
        self._queue: deque[GenerationRequest] = deque()
        self._extends: deque[tuple[str, list[int], SamplingParams]] = deque()
        # step() and weight updates exclude each other, so an update from another thread lands
        # between two steps.
        self._lock = threading.Lock()
        self._update_failed = False  # a weight update raised part-way through: mixed weights

        # Slot state. Slots 0.._num_running-1 hold the running sequences, in no particular
        # order; parked (held, between two turns) and free slots follow.
        self._num_running = 0
        self._requests: list[GenerationRequest | None] = [None] * capacity
        self._tokens = self._sampler.tokens  # on the device: prompt + generated, what the model reads
        # On the host: what the stop check and the outputs read. The tokens, log-probs and
        # versions of positions [0, _known) (the prompt, then each sampled token once its
        # copy has arrived); positions [_known, _len) are sampled, still on their way.
        self._host_tokens = torch.zeros(capacity, max_seq_len, dtype=torch.long)
        self._host_logprobs = torch.zeros(capacity, max_seq_len, dtype=torch.float32)
        self._host_versions = torch.zeros(capacity, max_seq_len, dtype=torch.long)
        self._known = torch.zeros(capacity, dtype=torch.long)
        self._stop_ids = torch.full((capacity, 1), -1, dtype=torch.long)  # -1 pads
        # Stop sequences, right-aligned, -1 on the left matches anything: (capacity, S, W).
        self._stop_seqs = torch.full((capacity, 0, 0), -1, dtype=torch.long)
        # Host-side mirrors drive lengths, length limits and the sampling plan without syncing
        # with the device.
        self._len = torch.zeros(capacity, dtype=torch.long)  # tokens in the sequence; the last is not yet in the cache
        self._temperature = torch.ones(capacity, dtype=torch.float32)
        self._top_k = torch.zeros(capacity, dtype=torch.long)
        self._top_p = torch.ones(capacity, dtype=torch.float32)
        self._turn_start = torch.zeros(capacity, dtype=torch.long)  # where this turn's generated tokens begin
        self._max_new = torch.zeros(capacity, dtype=torch.long)
        self._truncates = torch.zeros(capacity, dtype=torch.bool)  # uses top-k, top-p or min-p
        self._penalised = torch.zeros(capacity, dtype=torch.bool)  # repetition penalty != 1
        self._uses_min_p = torch.zeros(capacity, dtype=torch.bool)  # min_p > 0
        # A request's own sampler (its seed) and its stop strings' matcher, per slot.
        self._generators: list[torch.Generator | None] = [None] * capacity
        self._matchers: list[StopMatcher | None] = [None] * capacity
        self._parked = torch.zeros(capacity, dtype=torch.bool)
        self._stale = torch.zeros(capacity, dtype=torch.bool)  # parked across a recomputing update

    @classmethod
    def from_pretrained(cls, path: str | Path, options: EngineOptions) -> "TorchEngine":
        """Load a model from a local Hugging Face directory (safetensors weights); see
        `models.decoder.SUPPORTED_MODEL_TYPES` for the families."""
        return cls(load_pretrained(path, device=options.device, dtype=torch_dtype(options.dtype)),
                   options)

    @property
    def capacity(self) -> int:
        return self._capacity

    def num_active(self) -> int:
        """Requests accepted and not yet returned or released: running, parked and queued, so
        that an actor topping the engine up to `capacity` does not overfill it."""
        return self._num_running + self.num_parked() + len(self._queue) + len(self._ready)

    def num_running(self) -> int:
        return self._num_running

    def num_parked(self) -> int:
        """Held sequences between two turns: they keep a slot and decode nothing."""
        return int(self._parked.sum())

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
        if (p.temperature < 0 or not 0 < p.top_p <= 1 or p.top_k < 0 or not 0 <= p.min_p <= 1
                or p.repetition_penalty <= 0):
            raise ValueError(
                f"request {request.request_id!r}: invalid sampling params temperature={p.temperature}, "
                f"top_p={p.top_p}, top_k={p.top_k}, min_p={p.min_p}, repetition_penalty="
                f"{p.repetition_penalty} (need temperature >= 0, 0 < top_p <= 1, top_k >= 0, "
                f"0 <= min_p <= 1, repetition_penalty > 0)"
            )
        vocab = self.model.config.vocab_size
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab:
            raise ValueError(f"request {request.request_id!r}: prompt token ids outside [0, {vocab})")
        if any(not seq for seq in p.stop_sequences) or (p.stop and not all(p.stop.strings)):
            raise ValueError(f"request {request.request_id!r}: an empty stop sequence or string")
        self._queue.append(request)

    def extend(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        """Continue a held request parked after its turn: append `token_ids` (the environment's
        reply; may be empty) and generate the next turn under `params`, whose
        `max_new_tokens` counts from here. Runs at the next `step()`."""
        with self._lock:
            slot = self._parked_slot(request_id)
            if any(rid == request_id for rid, _, _ in self._extends):
                raise ValueError(f"request {request_id!r} is already being extended")
            vocab = self.model.config.vocab_size
            if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):
                raise ValueError(f"request {request_id!r}: token ids outside [0, {vocab})")
            needed = int(self._len[slot]) + len(token_ids) + params.max_new_tokens
            if params.max_new_tokens < 1 or needed > self.max_seq_len:
                raise ValueError(
                    f"request {request_id!r}: {int(self._len[slot])} tokens so far + "
                    f"{len(token_ids)} new + max_new_tokens={params.max_new_tokens} = {needed} "
                    f"exceeds the engine's max_seq_len={self.max_seq_len} (or max_new_tokens < 1)"
                )
            self._extends.append((request_id, list(token_ids), params))

    def release(self, request_id: str) -> None:
        """Free the slot of a held request parked after its turn (its rollout is over)."""
        with self._lock:
            slot = self._parked_slot(request_id)
            if any(rid == request_id for rid, _, _ in self._extends):
                raise ValueError(f"request {request_id!r} is being extended")
            self._free([slot])

    def abort(self, request_id: str) -> bool:
        """Drop `request_id` wherever it is (queued, decoding, parked, waiting to be
        extended): no output comes back for it and its slot is freed. False if the engine
        does not hold it (it finished, or was never added)."""
        with self._lock:
            queued = next((r for r in self._queue if r.request_id == request_id), None)
            if queued is not None:
                self._queue.remove(queued)
                return True
            self._extends = deque(e for e in self._extends if e[0] != request_id)
            slot = next((s for s, r in enumerate(self._requests)
                         if r is not None and r.request_id == request_id), None)
            if slot is None:
                return False
            if slot < self._num_running:  # decoding: out of the active slots first
                slot, = self._deactivate([slot])
            self._free([slot])
            return True

    def _parked_slot(self, request_id: str) -> int:
        for slot in self._parked.nonzero().flatten().tolist():
            if self._requests[slot].request_id == request_id:
                return slot
        raise ValueError(f"request {request_id!r} is not held after a finished turn")

    def step(self) -> list[GenerationOutput]:
        """Admit queued requests into free slots (their first token comes from the prefill),
        then run one decode step over all active sequences; return those that finished."""
        with self._lock, torch.no_grad():
            if self._update_failed:
                raise RuntimeError("a weight update failed part-way: the engine holds a mix of two versions")
            finished, self._ready = self._ready, []
            if self._extends:
                finished += self._resume()
            if self._queue and self._num_running + self.num_parked() < self._capacity:
                finished += self._admit()
            if self._num_running:
                finished += self._decode()
            elif self._in_flight is not None:  # every sequence it decoded has finished since
                finished += self._take(self._in_flight)
            return finished

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        with self._lock:
            self._settle()
            self.model.load_hf_weights(weights)  # checks every name and shape before copying
            self._mark_updated(version)

    def receive_weights(self, receive: ReceiveFn) -> int:
        """See `Engine.receive_weights`. The targets are the model's own parameters by HF name;
        with tied embeddings `lm_head.weight` and `model.embed_tokens.weight` are one tensor."""
        with self._lock:
            self._settle()
            self._update_failed = True  # until `receive` returns: a failed copy may have been partial
            targets = {name: p.data for name, p in self.model.named_parameters(remove_duplicate=False)}
            version = receive(targets)
            self._update_failed = False
            self._mark_updated(version)
        return version

    # -- internals ---------------------------------------------------------------------------

    def _settle(self) -> None:
        """Read the decode step still on its way before new weights land: it ran with the old
        ones (which the device must be done with before they are overwritten, whatever stream
        the new ones come on), and a sequence it finished must not decode under the new."""
        if self._in_flight is not None:
            self._ready += self._take(self._in_flight)

    def _mark_updated(self, version: int) -> None:
        self.version = version
        self.stats.weight_updates += 1
        if self.recompute_kv_on_update:
            self._stale |= self._parked  # recomputed when they resume
        if self.recompute_kv_on_update and self._num_running:
            with torch.no_grad():
                # Everything but each sequence's last token (not yet fed) goes back in the cache.
                self._prefill(0, self._num_running, self._len[: self._num_running] - 1)
            self.stats.recomputed_tokens += int(self._len[: self._num_running].sum()) - self._num_running

    def _admit(self) -> list[GenerationOutput]:
        """Move queued requests into free slots and prefill them; return those their first
        token finishes. Requests admitted together with the same prompt (a group's attempts)
        share one prefill: the first is computed, the others get a copy of its K/V and its last
        logits, which is what computing each would give (same tokens at the same positions)."""
        start = self._num_running
        free = [s for s in range(start, self._capacity)
                if self._requests[s] is None][: len(self._queue)]
        self._move_after_running(free)
        admitted = [self._queue.popleft() for _ in free]
        first: dict[tuple[int, ...], int] = {}  # prompt -> its slot
        copies: list[GenerationRequest] = []
        for request in admitted:  # each distinct prompt first, the copies after them
            key = tuple(request.prompt_ids)
            if key in first:
                copies.append(request)
                continue
            first[key] = self._num_running
            self._place(self._num_running, request)
            self._num_running += 1
        computed = self._num_running
        for request in copies:
            self._place(self._num_running, request)
            self._num_running += 1
        lengths = self._len[start : self._num_running]
        self.stats.prefill_tokens += int(lengths[: computed - start].sum())
        self.stats.shared_prefill_tokens += int(lengths[computed - start :].sum())
        logits = self._prefill(start, computed, lengths[: computed - start])
        if copies:
            src = torch.tensor([first[tuple(r.prompt_ids)] for r in copies], device=self.device)
            self._runner.move_kv(src, torch.arange(computed, self._num_running, device=self.device),
                             int(lengths[computed - start :].max()))
            logits = torch.cat([logits, logits[src - start]])
        return self._sample_into(start, self._num_running, logits)

    def _place(self, slot: int, request: GenerationRequest) -> None:
        p: SamplingParams = request.params
        n = len(request.prompt_ids)
        self._requests[slot] = request
        prompt = torch.tensor(request.prompt_ids, dtype=torch.long)
        self._tokens[slot, :n] = prompt
        self._host_tokens[slot, :n] = prompt
        self._known[slot] = n
        sampler = self._sampler
        sampler.temperature[slot] = self._temperature[slot] = p.temperature
        sampler.top_k[slot] = self._top_k[slot] = p.top_k
        sampler.top_p[slot] = self._top_p[slot] = p.top_p
        sampler.min_p[slot] = p.min_p
        self._uses_min_p[slot] = p.min_p > 0
        sampler.penalty[slot] = p.repetition_penalty
        self._penalised[slot] = p.repetition_penalty != 1
        self._generators[slot] = None
        if p.seed is not None:
            self._generators[slot] = torch.Generator(device=self.device)
            self._generators[slot].manual_seed(p.seed)
        stops = p.stop_token_ids
        if len(stops) > self._stop_ids.shape[1]:
            pad = torch.full((self._capacity, len(stops) - self._stop_ids.shape[1]), -1, dtype=torch.long)
            self._stop_ids = torch.cat([self._stop_ids, pad], dim=1)
        self._stop_ids[slot] = -1
        if stops:
            self._stop_ids[slot, : len(stops)] = torch.tensor(stops, dtype=torch.long)
        self._len[slot] = n
        self._set_turn(slot, p)

    def _set_turn(self, slot: int, p: SamplingParams) -> None:
        """A turn starts at the slot's current length, generating under `p`."""
        self._batch = None
        self._turn_start[slot] = self._len[slot]
        self._max_new[slot] = p.max_new_tokens
        self._truncates[slot] = p.temperature > 0 and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0)
        self._matchers[slot] = (StopMatcher(p.stop, self._host_tokens[slot, : int(self._len[slot])].tolist())
                                if p.stop else None)
        seqs = p.stop_sequences
        width = max((len(q) for q in seqs), default=0)
        if len(seqs) > self._stop_seqs.shape[1] or width > self._stop_seqs.shape[2]:
            grown = torch.full((self._capacity, max(len(seqs), self._stop_seqs.shape[1]),
                                max(width, self._stop_seqs.shape[2])), -1, dtype=torch.long)
            old = self._stop_seqs
            grown[:, : old.shape[1], grown.shape[2] - old.shape[2]:] = old
            self._stop_seqs = grown
        self._stop_seqs[slot] = -1
        w = self._stop_seqs.shape[2]
        for i, q in enumerate(seqs):
            self._stop_seqs[slot, i, w - len(q):] = torch.tensor(q, dtype=torch.long)

    def _resume(self) -> list[GenerationOutput]:
        """Start the next turn of the held sequences `extend` asked for: bring them back into
        the active slots, append the environment's tokens and compute only those (all of the
        sequence if a weight update asked for recomputed K/V while it waited), then sample
        the turn's first token; return those it finishes."""
        start = self._num_running
        items = list(self._extends)
        self._extends.clear()
        self._move_after_running([self._parked_slot(rid) for rid, _, _ in items])
        feed_from = torch.zeros(len(items), dtype=torch.long)
        for i, (_, token_ids, params) in enumerate(items):
            slot = start + i
            length, k = int(self._len[slot]), len(token_ids)
            if k:
                new = torch.tensor(token_ids, dtype=torch.long)
                self._tokens[slot, length : length + k] = new
                self._host_tokens[slot, length : length + k] = new
            # The turn's last token was never fed: it goes in with the new ones.
            feed_from[i] = 0 if self._stale[slot] else length - 1
            self._len[slot] = self._known[slot] = length + k
            self._set_turn(slot, params)
            self._parked[slot] = self._stale[slot] = False
            self.stats.extended_tokens += k
        self._num_running += len(items)
        lengths = self._len[start : self._num_running] - feed_from
        return self._sample_into(start, self._num_running, self._extend_cache(start, feed_from, lengths))

    def _extend_cache(self, start: int, feed_from: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Feed tokens [feed_from[i], feed_from[i] + lengths[i]) of slots start.. into the
        cache, whose earlier positions are kept; return the logits at each one's last token."""
        slots = torch.arange(start, start + len(lengths), device=self.device)
        width = int(lengths.max())
        cols = (feed_from[:, None] + torch.arange(width)).clamp(max=self.max_seq_len - 1).to(self.device)
        tokens = self._tokens[slots[:, None], cols]
        self.stats.prefill_forwards += 1
        return self._runner.extend(tokens, feed_from.to(self.device), lengths.to(self.device), slots)

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
            logits.append(self._runner.prefill(self._tokens[lo:hi, :width], chunk_lengths, slots))
            self.stats.prefill_forwards += 1
            lo = hi
        return torch.cat(logits)

    def _decode(self) -> list[GenerationOutput]:
        """Launch a decode step over the running sequences; return those finished by the
        tokens it reads: its own, or, reading late, the previous step's (launched before it, so
        the device has the new step queued while the host reads)."""
        n = self._num_running
        if self._batch is None or self._batch[0] != n:
            self._batch = (n, self._plan(0, n), int(self._len[:n].max()))
        _, plan, longest = self._batch
        drawn = self._draw(0, n, keep_states=self._late)
        out = self._runner.decode(self._len[:n] - 1, longest, plan)
        self._len[:n] += 1
        self._batch = (n, plan, longest + 1)
        self.stats.decode_steps += 1
        sampled = self._send(out, 0, n, drawn)
        if not self._late:
            return self._take(sampled)
        previous, self._in_flight = self._in_flight, sampled
        return self._take(previous) if previous is not None else []

    def _sample_into(self, start: int, end: int, logits: torch.Tensor) -> list[GenerationOutput]:
        """Sample the next token of slots start..end-1 from their `logits` (a prefill's or an
        extension's: read at once) and return the sequences it finishes."""
        cols = self._len[start:end]
        self._draw(start, end)
        out = self._sampler.sample(logits.float(), start, end, cols.to(self.device),
                                   self._plan(start, end), int(cols.max()))
        self._len[start:end] += 1
        return self._take(self._send(out, start, end))

    def _plan(self, start: int, end: int) -> SamplingPlan:
        return SamplingPlan.of(self._temperature[start:end], self._top_k[start:end],
                               self._top_p[start:end], self._truncates[start:end],
                               self._penalised[start:end], self._uses_min_p[start:end],
                               self.model.config.vocab_size)

    def _draw(self, start: int, end: int, keep_states: bool = False
              ) -> dict[int, tuple[torch.Generator, torch.Tensor]]:
        """The noise of slots start..end-1: the engine's generator, a request's own for its
        row; with `keep_states`, return each own generator's state before (`_Sampled.drawn`)."""
        own = ([(i, g) for i, g in enumerate(self._generators[start:end]) if g is not None]
               if any(self._generators[start:end]) else ())
        states = {id(g): (g, g.get_state()) for _, g in own} if keep_states else {}
        self._sampler.draw(start, end, self._generator, own)
        return states

    def _send(self, out: torch.Tensor, start: int, end: int,
              drawn: dict[int, tuple[torch.Generator, torch.Tensor]] | None = None) -> _Sampled:
        """Start the copy of `out` (slots start..end-1's tokens and log-probs) to the host."""
        cuda = self.device.type == "cuda"
        values = torch.empty(out.shape, dtype=out.dtype, pin_memory=cuda)
        values.copy_(out, non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        return _Sampled(values, event, self.version, start, end, drawn=drawn or {})

    def _take(self, sampled: _Sampled) -> list[GenerationOutput]:
        """Append the tokens of `sampled` to the host's copy of their sequences (waiting for
        its copy if it has not arrived) and return the sequences they finish."""
        if sampled is self._in_flight:
            self._in_flight = None
        if sampled.event is not None:
            sampled.event.synchronize()
        if sampled.rows is None:
            slots, values = torch.arange(sampled.start, sampled.end), sampled.values
        else:
            slots = (sampled.rows >= 0).nonzero().flatten()
            values = sampled.values[sampled.rows[slots]]
        tokens = values[:, 0].long()
        cols = self._known[slots]
        self._host_tokens[slots, cols] = tokens
        self._host_logprobs[slots, cols] = values[:, 1].float()
        self._host_versions[slots, cols] = sampled.version
        self._known[slots] += 1
        self.stats.generated_tokens += len(slots)
        return self._collect_finished(slots, tokens)

    def _collect_finished(self, slots: torch.Tensor, last: torch.Tensor) -> list[GenerationOutput]:
        """Return the sequences in `slots` (running, host) whose last token `last` is a stop
        token, that end with a stop sequence or stop string, or that reached their turn's
        max_new_tokens; free their slots or, for held requests, park them. Whatever was
        sampled past their end (reading late: the step launched since) is dropped."""
        stopped = (last.unsqueeze(1) == self._stop_ids[slots]).any(dim=1)
        if self._stop_seqs.shape[1]:
            stopped |= self._ends_with_stop_sequence(slots)
        if any(self._matchers):
            lasts = last.tolist()
            for i, slot in enumerate(slots.tolist()):
                matcher = self._matchers[slot]
                if matcher is not None and matcher.feed(lasts[i]) is not None:
                    stopped[i] = True
        full = self._known[slots] - self._turn_start[slots] >= self._max_new[slots]
        done = (stopped | full).nonzero().flatten()
        if not len(done):
            return []
        finished, stopped = slots[done], stopped[done].tolist()
        self._len[finished] = self._known[finished]
        if self._in_flight is not None:
            self._in_flight.drop(finished, self._generators, self._capacity)
        self._batch = None
        slots = finished.tolist()
        outputs = []
        # One slice of the host copies for the finished rows, then plain Python per sequence.
        width = int(self._len[finished].max())
        tokens = self._host_tokens[finished, :width].tolist()
        logprobs = self._host_logprobs[finished, :width].tolist()
        versions = self._host_versions[finished, :width].tolist()
        for i, slot in enumerate(slots):
            request = self._requests[slot]
            lo, hi = int(self._turn_start[slot]), int(self._len[slot])
            outputs.append(
                GenerationOutput(
                    request_id=request.request_id,
                    prompt_ids=list(request.prompt_ids),
                    token_ids=tokens[i][lo:hi],
                    logprobs=logprobs[i][lo:hi],
                    versions=versions[i][lo:hi],
                    finish_reason="stop" if stopped[i] else "length",
                )
            )
        held = [bool(self._requests[slot].hold) for slot in slots]
        parked = self._deactivate(slots, held)
        self._free([s for s, h in zip(parked, held) if not h])
        self._parked[[s for s, h in zip(parked, held) if h]] = True
        self.stats.finished_requests += len(outputs)
        return outputs

    def _ends_with_stop_sequence(self, slots: torch.Tensor) -> torch.Tensor:
        """Per slot of `slots`: its turn's tokens (on the host) end with one of its stop
        sequences."""
        seqs = self._stop_seqs[slots]  # (m, S, W)
        width = seqs.shape[2]
        known = self._known[slots, None]
        cols = known - width + torch.arange(width)
        in_turn = cols >= self._turn_start[slots, None]
        tail = self._host_tokens[slots[:, None], cols.clamp(min=0)]
        equal = (tail[:, None, :] == seqs) & in_turn[:, None, :]
        return ((equal | (seqs == -1)).all(-1) & (seqs != -1).any(-1)).any(-1)

    def _slot_state(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The per-slot tensors (rows indexed by slot): per position, and per slot."""
        per_position = [self._tokens, self._host_tokens, self._host_logprobs, self._host_versions]
        per_slot = [*self._sampler.params(), self._temperature, self._top_k, self._top_p,
                    self._stop_ids, self._stop_seqs, self._len, self._known, self._turn_start,
                    self._max_new, self._truncates, self._penalised, self._uses_min_p,
                    self._parked, self._stale]
        if self._in_flight is not None:
            per_slot.append(self._in_flight.slot_rows(self._capacity))
        return per_position, per_slot

    def _copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy everything slot src[i] holds, cache included, into slot dst[i]. Every read
        happens before any write (advanced indexing reads a copy), so src and dst may
        overlap: `_copy_slots(a + b, b + a)` swaps."""
        if not src:
            return
        self._batch = None
        length = int(self._len[src].max())
        self._runner.move_kv(torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device),
                             length)
        per_position, per_slot = self._slot_state()
        for t in per_position:
            t[dst, :length] = t[src, :length]
        for t in per_slot:
            t[dst] = t[src]
        for objects in (self._requests, self._generators, self._matchers):
            moved = [objects[s] for s in src]
            for d, o in zip(dst, moved):
                objects[d] = o

    def _deactivate(self, slots: list[int], keep: list[bool] | None = None) -> list[int]:
        """Take `slots` out of the running ones, keeping those packed at the front: the last
        running sequences move into the holes, and the taken ones that `keep` marks (parked,
        held) move to where those were; return where the taken ones now are (for the others,
        a slot to free)."""
        kept = {s for s, k in zip(slots, keep or [False] * len(slots)) if k}
        freed = set(slots)
        remaining = self._num_running - len(freed)
        holes = [s for s in slots if s < remaining]
        movers = [s for s in range(remaining, self._num_running) if s not in freed]
        swapped = [i for i, h in enumerate(holes) if h in kept]
        self._copy_slots(movers + [holes[i] for i in swapped], holes + [movers[i] for i in swapped])
        self._num_running = remaining
        return [movers[holes.index(s)] if s in holes else s for s in slots]

    def _move_after_running(self, slots: list[int]) -> None:
        """Move `slots` that are not running (parked or free) to the slots right after the
        running ones, in order, by swaps; the caller then counts them as running."""
        target = list(range(self._num_running, self._num_running + len(slots)))
        if slots == target:
            return
        # One swap at a time: whatever stood at the target moves to where the slot was, and
        # is followed there if it is wanted later.
        for i in range(len(slots)):
            current = slots[i]
            if current != target[i]:
                self._copy_slots([current, target[i]], [target[i], current])
                slots = [current if s == target[i] else s for s in slots]

    def _free(self, slots: list[int]) -> None:
        for s in slots:
            self._requests[s] = self._generators[s] = self._matchers[s] = None
        self._batch = None
        self._len[slots] = self._known[slots] = 0
        if self._in_flight is not None:
            self._in_flight.slot_rows(self._capacity)[slots] = -1
        self._parked[slots] = False
        self._stale[slots] = False
