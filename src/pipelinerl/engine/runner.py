"""The torch engine's model runner: every forward over the engine's KV cache (prefill, extend,
decode) and the cache's slot moves. The engine (`torch_engine`) is the scheduler: which
requests run, in which slots, their lengths, stops and versions; it hands the runner token
and slot tensors and gets logits back, and never touches the cache itself.

A small model's decode step on a GPU is bound by kernel launches, not by the chip: the
Qwen2-0.5B shape cost 24.5-28.5 ms eager whatever the batch, 2.9-3.4 ms replayed as a CUDA
graph (docs/scaling.md). `GraphRunner` captures the decoder's `decode` once per (batch,
attention span) bucket over static inputs, all at start-up, and replays it each step:
- batches are padded to the next bucket size (powers of two up to the capacity); a padding
  row feeds token 0 at the cache's scratch position (one column past `max_seq_len`, never
  attended to), so it writes into no sequence's cache, parked ones included;
- the attention span is padded to the next power of two (at least 64, at most max_seq_len):
  the mask hides the positions past each sequence, as in eager;
- every graph writes its logits into one static buffer (capacity x vocabulary) and draws its
  intermediates from one shared memory pool, so the graphs together hold about one step's
  activations plus that buffer, not one set of logits each (capacity 256 x max_seq_len 4096
  is 63 graphs: ~1.1 GB of bf16 logits apart, 78 MB shared);
- weight updates copy in place into the parameters the graphs read (`load_hf_weights`, the
  weight receivers), so every graph computes with the newest weights without a new capture.
Prefill and extension stay eager: they vary in shape every call. Every CUDA call names the
cache's device (streams, capture, the device guard), so an engine on cuda:1 captures on cuda:1
whatever device is current; a capture that fails leaves the thread on its own stream, the
allocator out of the graph pool, and the engine on the padded eager path.

`capture=False` runs the same padding and buckets without CUDA (the CPU tests check the
logic against eager); the CPU engine itself runs `EagerRunner`, padding being pure waste there.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import cuda

from pipelinerl.models.decoder import CausalDecoder, KVCache

log = logging.getLogger(__name__)

MIN_SPAN = 64


def make_runner(model: CausalDecoder, capacity: int, max_seq_len: int, graphs: bool) -> EagerRunner:
    """A runner over a new KV cache of `capacity` slots: `GraphRunner` if `graphs` (CUDA)."""
    weight = model.lm_head.weight  # the cache's device and dtype are the model's
    cache = KVCache(model.config, capacity, max_seq_len, weight.device, weight.dtype, scratch=graphs)
    return GraphRunner(model, cache, capacity, max_seq_len) if graphs else EagerRunner(model, cache)


class EagerRunner:
    """The decoder's forwards over `cache`, as they are."""

    def __init__(self, model: CausalDecoder, cache: KVCache) -> None:
        self.model, self.cache = model, cache

    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Write the K/V of tokens [0, lengths[i]) of right-padded `input_ids[i]` into slot
        `slots[i]`; return the logits [m, V] at each one's last token."""
        return self.model.prefill(self.cache, input_ids, lengths, slots)

    def extend(self, input_ids: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
        """As `prefill`, the tokens going in at positions starts[i].. after the cached ones."""
        return self.model.extend(self.cache, input_ids, starts, lengths, slots)

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, attend_len: int) -> torch.Tensor:
        """Logits [n, V] of token `input_ids[i]` at `positions[i]` of slot i, i < n."""
        return self.model.decode(self.cache, input_ids, positions, attend_len)

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
    """Decode steps replayed from graphs captured per (batch, span) bucket when built; the
    other forwards eager. `cache` must have one position past `max_seq_len`
    (`KVCache(..., scratch=True)`)."""

    def __init__(self, model: CausalDecoder, cache: KVCache, capacity: int, max_seq_len: int,
                 capture: bool = True) -> None:
        if cache.k[0].shape[2] != max_seq_len + 1:
            raise ValueError("GraphRunner needs a KV cache with a scratch position")
        super().__init__(model, cache)
        self.max_seq_len, self.capture = max_seq_len, capture
        self.batch_sizes = buckets(capacity)
        self.spans = buckets(max_seq_len, min(MIN_SPAN, max_seq_len))
        self.device = cache.k[0].device
        # Static inputs every graph reads (views of their first rows), and the logits buffer
        # every graph writes into.
        self._ids = torch.zeros(capacity, dtype=torch.long, device=self.device)
        self._positions = torch.full((capacity,), max_seq_len, dtype=torch.long, device=self.device)
        self._logits = torch.empty(capacity, model.config.vocab_size,
                                   dtype=model.lm_head.weight.dtype, device=self.device)
        self._graphs: dict[tuple[int, int], cuda.CUDAGraph] = {}
        self.capture_s, self.graph_bytes = 0.0, 0  # what capturing cost: seconds, pool memory
        if capture:
            self._capture_all()

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, attend_len: int) -> torch.Tensor:
        n = input_ids.shape[0]
        batch, span = bucket_of(n, self.batch_sizes), bucket_of(attend_len, self.spans)
        self._ids[:n].copy_(input_ids)
        self._positions[:n].copy_(positions)
        self._ids[n:batch].zero_()
        self._positions[n:batch].fill_(self.max_seq_len)  # the scratch position
        if not self.capture:
            return self._forward(batch, span)[:n]
        self._graphs[batch, span].replay()  # launches on the capture device (graph's own guard)
        return self._logits[:n]

    def _forward(self, batch: int, span: int) -> torch.Tensor:
        logits = self.model.decode(self.cache, self._ids[:batch], self._positions[:batch], span)
        return self._logits[:batch].copy_(logits)

    def _capture_all(self) -> None:
        """Every (batch, span) bucket, smallest first, into one memory pool: the engine's steps
        then never stop for a capture (each synchronizes and empties the caches). A capture that
        fails logs why and leaves the engine eager (slower, right)."""
        t0, device = time.perf_counter(), self.device
        with cuda.device(device):
            before = cuda.memory_reserved(device)
            pool = cuda.graph_pool_handle()
            side = cuda.Stream(device=device)
            try:
                for batch in self.batch_sizes:
                    for span in self.spans:
                        self._graphs[batch, span] = self._capture(batch, span, side, pool)
            except RuntimeError as exc:  # a driver or op that cannot be captured
                log.warning("decode step not captured as CUDA graphs (%s): eager from now on", exc)
                self._graphs.clear()
                self.capture = False
                return
            self.graph_bytes = cuda.memory_reserved(device) - before
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d decode graphs on %s in %.1f s; they hold %.0f MiB (static logits "
                 "%.0f MiB)", len(self._graphs), device, self.capture_s, self.graph_bytes / 2**20,
                 self._logits.nbytes / 2**20)

    def _capture(self, batch: int, span: int, side: cuda.Stream, pool: tuple[int, int]) -> cuda.CUDAGraph:
        # Warm-up on the side stream first, as CUDA graph capture requires (lazy inits,
        # autotune); then capture there, ending the capture whatever the forward raised, so the
        # allocator stops routing to the pool and the thread returns to its own stream.
        side.wait_stream(cuda.current_stream(self.device))
        graph = cuda.CUDAGraph()
        with cuda.stream(side):
            self._forward(batch, span)
            side.synchronize()
            graph.capture_begin(pool=pool)
            try:
                self._forward(batch, span)
            except BaseException:
                try:
                    graph.capture_end()
                except RuntimeError:  # the capture is invalid: what the forward raised says why
                    pass
                raise
            graph.capture_end()
        cuda.current_stream(self.device).wait_stream(side)
        return graph
