"""The torch engine's model runner: every forward over the engine's KV cache (prefill, extend,
decode), the decode step's sampling, and the cache's slot moves. The engine (`torch_engine`)
is the scheduler: which requests run, in which slots, their lengths, stops and versions; it
hands the runner token and slot tensors and gets logits (prefill, extend) or sampled tokens
(decode) back, and never touches the cache itself.

A small model's decode step on a GPU is bound by kernel launches, not by the chip: the
Qwen2-0.5B shape cost 24.5-28.5 ms eager whatever the batch, 2.9-3.4 ms replayed as a CUDA
graph (docs/scaling.md). `GraphRunner` captures the decoder's `decode` once per (batch,
attention span) bucket over static inputs, and the sampling (`SlotSampler.sample`: penalty,
temperature, min-p, top-k, top-p, the draw, the log-prob, the token written into the
engine's token buffer) once per (batch, sampling plan), and replays both each step:
- batches are padded to the next bucket size (powers of two up to the capacity); a padding
  row feeds its slot's scratch-column token at the cache's scratch position (one column past
  `max_seq_len`, never attended to), so it writes into no sequence's cache, parked ones
  included, and its sampled token goes to the scratch column of the token buffer;
- the attention span is padded to the next power of two (at least 64, at most max_seq_len):
  the mask hides the positions past each sequence, as in eager;
- every forward graph writes its logits into one static buffer (capacity x vocabulary) that
  the sampling graphs read, and all draw their intermediates from one shared memory pool, so
  the graphs together hold about one step's activations plus that buffer, not one set of
  logits each (capacity 256 x max_seq_len 4096 is 63 forward graphs: ~1.1 GB of bf16 logits
  apart, 78 MB shared);
- the sampling parameters are the engine's per-slot device tensors, written in place when a
  request takes a slot; the noise is drawn into a static buffer before the replay (so no
  graph holds a random generator, and a request's own seed draws as in eager);
- weight updates copy in place into the parameters the graphs read (`load_hf_weights`, the
  weight receivers), so every graph computes with the newest weights without a new capture.
Prefill and extension stay eager: they vary in shape every call. Every CUDA call names the
cache's device (streams, capture, the device guard), so an engine on cuda:1 captures on cuda:1
whatever device is current; a capture that fails leaves the thread on its own stream, the
allocator out of the graph pool, and the engine on the padded eager path.

`capture=False` runs the same padding, buckets and sampling without CUDA (the CPU tests check
the logic against eager); the CPU engine itself runs `EagerRunner`, padding being pure waste
there.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch
from torch import cuda

from pipelinerl.engine.sampling import SamplingPlan, SlotSampler
from pipelinerl.models.decoder import CausalDecoder, KVCache

log = logging.getLogger(__name__)

MIN_SPAN = 64


def make_runner(model: CausalDecoder, sampler: SlotSampler, capacity: int, max_seq_len: int,
                graphs: bool) -> EagerRunner:
    """A runner over a new KV cache of `capacity` slots: `GraphRunner` if `graphs` (CUDA)."""
    weight = model.lm_head.weight  # the cache's device and dtype are the model's
    cache = KVCache(model.config, capacity, max_seq_len, weight.device, weight.dtype, scratch=graphs)
    if graphs:
        return GraphRunner(model, cache, sampler, capacity, max_seq_len)
    return EagerRunner(model, cache, sampler)


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device` without the host waiting: through pinned memory to a GPU (the
    caching host allocator keeps the pinned block until the copy has run)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class EagerRunner:
    """The decoder's forwards over `cache`, as they are, and the decode step's sampling by
    `sampler`."""

    def __init__(self, model: CausalDecoder, cache: KVCache, sampler: SlotSampler) -> None:
        self.model, self.cache, self.sampler = model, cache, sampler

    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Write the K/V of tokens [0, lengths[i]) of right-padded `input_ids[i]` into slot
        `slots[i]`; return the logits [m, V] at each one's last token."""
        return self.model.prefill(self.cache, input_ids, lengths, slots)

    def extend(self, input_ids: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
        """As `prefill`, the tokens going in at positions starts[i].. after the cached ones."""
        return self.model.extend(self.cache, input_ids, starts, lengths, slots)

    def decode(self, positions: torch.Tensor, attend_len: int, plan: SamplingPlan) -> torch.Tensor:
        """One decode step over slots 0..n-1: feed slot i's token at host `positions[i]`
        (`attend_len` > every position), sample its next one under `plan` from the noise
        drawn for it, written at positions[i] + 1 of the sampler's tokens; return (n, 2)
        float32 on the device: each token and its log-prob (`SlotSampler.sample`)."""
        positions = to_device(positions, self.cache.k[0].device)
        n = positions.shape[0]
        tokens = self.sampler.tokens
        logits = self.model.decode(self.cache, tokens[torch.arange(n, device=tokens.device), positions],
                                   positions, attend_len)
        return self.sampler.sample(logits.float(), 0, n, positions + 1, plan, attend_len)

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy positions [0, length) of slots `src` into slots `dst` (the scheduler's swaps)."""
        self.cache.move(src, dst, length)


def buckets(limit: int, smallest: int = 1) -> list[int]:
    """Powers of two from `smallest` below `limit`, then `limit`."""
    sizes, size = [], smallest
    while size < limit:
        sizes.append(size)
        size *= 2
    return [*sizes, limit]


def bucket_of(value: int, sizes: list[int]) -> int:
    """The smallest bucket that holds `value`."""
    return next(size for size in sizes if size >= value)


class GraphRunner(EagerRunner):
    """Decode steps replayed from graphs: the forward captured per (batch, span) bucket and
    the sampling per (batch, plan) when built (the plan of requests at their defaults; any
    other the first time a step needs it), the other forwards eager. `cache` must have one
    position past `max_seq_len` (`KVCache(..., scratch=True)`)."""

    def __init__(self, model: CausalDecoder, cache: KVCache, sampler: SlotSampler, capacity: int,
                 max_seq_len: int, capture: bool = True) -> None:
        if cache.k[0].shape[2] != max_seq_len + 1:
            raise ValueError("GraphRunner needs a KV cache with a scratch position")
        super().__init__(model, cache, sampler)
        self.max_seq_len, self.capture = max_seq_len, capture
        self.batch_sizes = buckets(capacity)
        self.spans = buckets(max_seq_len, min(MIN_SPAN, max_seq_len))
        self.device = cache.k[0].device
        # Static inputs every graph reads (views of their first rows), the logits buffer every
        # forward graph writes into and the sampling graphs read, and the sampled tokens with
        # their log-probs that the sampling graphs write.
        self._positions = torch.full((capacity,), max_seq_len, dtype=torch.long, device=self.device)
        self._logits = torch.empty(capacity, model.config.vocab_size,
                                   dtype=model.lm_head.weight.dtype, device=self.device)
        self._out = torch.zeros(capacity, 2, dtype=torch.float32, device=self.device)
        self._running = capacity  # rows whose positions are not the scratch one (all, unknown)
        self._graphs: dict[tuple[int, int], cuda.CUDAGraph] = {}
        # None: a plan whose capture failed, sampled eagerly after the forward's replay.
        self._sample_graphs: dict[tuple[int, SamplingPlan], cuda.CUDAGraph | None] = {}
        self._pool: tuple[int, int] | None = None
        self.capture_s, self.graph_bytes = 0.0, 0  # what capturing cost: seconds, pool memory
        if capture:
            self._capture_all()

    def decode(self, positions: torch.Tensor, attend_len: int, plan: SamplingPlan) -> torch.Tensor:
        n = positions.shape[0]
        batch, span = bucket_of(n, self.batch_sizes), bucket_of(attend_len, self.spans)
        self._positions[:n].copy_(positions.pin_memory() if self.device.type == "cuda" else positions,
                                  non_blocking=True)
        if n < self._running:  # rows that ran before are padding now: the scratch position
            self._positions[n : self._running].fill_(self.max_seq_len)
        self._running = n
        if not self.capture:
            self._forward(batch, span)
            self._sample(batch, plan)
            return self._out[:n]
        self._graphs[batch, span].replay()  # launches on the capture device (graph's own guard)
        if plan.sized:  # its candidates are sized on the host: never captured
            self._sample(batch, plan)
            return self._out[:n]
        if (batch, plan) not in self._sample_graphs:
            self._capture_sampling(batch, plan)
        graph = self._sample_graphs[batch, plan]
        if graph is None:
            self._sample(batch, plan)
        else:
            graph.replay()
        return self._out[:n]

    def _forward(self, batch: int, span: int) -> None:
        positions = self._positions[:batch]
        tokens = self.sampler.tokens  # column max_seq_len (a padding row's) is its scratch one
        ids = tokens[torch.arange(batch, device=self.device), positions]
        self._logits[:batch].copy_(self.model.decode(self.cache, ids, positions, span))

    def _sample(self, batch: int, plan: SamplingPlan) -> None:
        # A padding row (at the scratch position) writes its token into the scratch column.
        cols = (self._positions[:batch] + 1).clamp(max=self.max_seq_len)
        self._out[:batch].copy_(self.sampler.sample(self._logits[:batch].float(), 0, batch, cols,
                                                    plan, self.max_seq_len + 1))

    def _capture_all(self) -> None:
        """Every (batch, span) bucket's forward and every batch's sampling at the default
        plan, smallest first, into one memory pool: the engine's steps then never stop for a
        capture (each synchronizes and empties the caches) unless a request asks for more. A
        capture that fails logs why and leaves the engine eager (slower, right)."""
        t0, device = time.perf_counter(), self.device
        default = SamplingPlan()
        with cuda.device(device):
            before = cuda.memory_reserved(device)
            self._pool = cuda.graph_pool_handle()
            try:
                for batch in self.batch_sizes:
                    for span in self.spans:
                        self._graphs[batch, span] = self._capture(lambda: self._forward(batch, span))
                    self._sample_graphs[batch, default] = self._capture(
                        lambda: self._sample(batch, default))
            except RuntimeError as exc:  # a driver or op that cannot be captured
                log.warning("decode step not captured as CUDA graphs (%s): eager from now on", exc)
                self._graphs.clear()
                self._sample_graphs.clear()
                self.capture = False
                return
            self.graph_bytes = cuda.memory_reserved(device) - before
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d decode graphs on %s in %.1f s; they hold %.0f MiB (static logits "
                 "%.0f MiB)", len(self._graphs) + len(self._sample_graphs), device, self.capture_s,
                 self.graph_bytes / 2**20, self._logits.nbytes / 2**20)

    def _capture_sampling(self, batch: int, plan: SamplingPlan) -> None:
        """The sampling of a plan first met mid-run, into the shared pool. Its warm-up writes
        the very tokens the replay then writes again (the noise is drawn already). A capture
        that fails leaves this plan eager."""
        with cuda.device(self.device):
            try:
                self._sample_graphs[batch, plan] = self._capture(lambda: self._sample(batch, plan))
            except RuntimeError as exc:
                log.warning("sampling plan %s not captured (%s): sampled eagerly", plan, exc)
                self._sample_graphs[batch, plan] = None

    def _capture(self, body: Callable[[], None]) -> cuda.CUDAGraph:
        # Warm-up on a side stream first, as CUDA graph capture requires (lazy inits,
        # autotune); then capture there, ending the capture whatever the body raised, so the
        # allocator stops routing to the pool and the thread returns to its own stream.
        side = cuda.Stream(device=self.device)
        side.wait_stream(cuda.current_stream(self.device))
        graph = cuda.CUDAGraph()
        with cuda.stream(side):
            body()
            side.synchronize()
            graph.capture_begin(pool=self._pool)
            try:
                body()
            except BaseException:
                try:
                    graph.capture_end()
                except RuntimeError:  # the capture is invalid: what the body raised says why
                    pass
                raise
            graph.capture_end()
        cuda.current_stream(self.device).wait_stream(side)
        return graph
