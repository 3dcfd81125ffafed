"""The torch engine's model runner for decode steps: one forward of one token per running
sequence, eager or replayed from CUDA graphs.

A small model's decode step on a GPU is bound by kernel launches, not by the chip: the
Qwen2-0.5B shape cost 24.5-28.5 ms eager whatever the batch, 2.9-3.4 ms replayed as a CUDA
graph (docs/scaling.md). `GraphRunner` captures the decoder's `decode` once per (batch,
attention span) bucket over static inputs and replays it each step:
- batches are padded to the next bucket size (powers of two up to the capacity); a padding
  row feeds token 0 at the cache's scratch position (one column past `max_seq_len`, never
  attended to), so it writes into no sequence's cache, parked ones included;
- the attention span is padded to the next power of two (at least 64, at most max_seq_len):
  the mask hides the positions past each sequence, as in eager;
- weight updates copy in place into the parameters the graphs read (`load_hf_weights`, the
  weight receivers), so every graph computes with the newest weights without a new capture.
Sampling, prefill and extension stay eager: they vary in shape every call.

`capture=False` runs the same padding and buckets without CUDA (the CPU tests check the
logic against eager); the CPU engine itself runs `EagerRunner`, padding being pure waste there.
"""

from __future__ import annotations

import logging

import torch

from pipelinerl.models.decoder import CausalDecoder, KVCache

log = logging.getLogger(__name__)

MIN_SPAN = 64


class EagerRunner:
    """The decoder's decode forward, as is."""

    def __init__(self, model: CausalDecoder, cache: KVCache) -> None:
        self.model, self.cache = model, cache

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, attend_len: int) -> torch.Tensor:
        """Logits [n, V] of token `input_ids[i]` at `positions[i]` of slot i, i < n."""
        return self.model.decode(self.cache, input_ids, positions, attend_len)


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


class GraphRunner:
    """Decode steps replayed from graphs captured per (batch, span) bucket on first use.
    `cache` must have one position past `max_seq_len` (`KVCache(..., scratch=True)`)."""

    def __init__(self, model: CausalDecoder, cache: KVCache, capacity: int, max_seq_len: int,
                 capture: bool = True) -> None:
        if cache.k[0].shape[2] != max_seq_len + 1:
            raise ValueError("GraphRunner needs a KV cache with a scratch position")
        self.model, self.cache, self.max_seq_len, self.capture = model, cache, max_seq_len, capture
        self.batch_sizes = buckets(capacity)
        self.spans = buckets(max_seq_len, min(MIN_SPAN, max_seq_len))
        device = cache.k[0].device
        # Static inputs every graph reads (views of their first rows).
        self._ids = torch.zeros(capacity, dtype=torch.long, device=device)
        self._positions = torch.full((capacity,), max_seq_len, dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, attend_len: int) -> torch.Tensor:
        n = input_ids.shape[0]
        batch, span = bucket_of(n, self.batch_sizes), bucket_of(attend_len, self.spans)
        self._ids[:n].copy_(input_ids)
        self._positions[:n].copy_(positions)
        self._ids[n:batch].zero_()
        self._positions[n:batch].fill_(self.max_seq_len)  # the scratch position
        if not self.capture:
            return self._forward(batch, span)[:n]
        graph, out = self._graphs.get((batch, span), (None, None))
        if graph is None:
            try:
                graph, out = self._capture(batch, span)
            except RuntimeError as exc:  # a driver or op that cannot be captured: slower, right
                log.warning("decode step not captured as a CUDA graph (%s): eager from now on",
                            exc)
                self.capture = False
                return self._forward(batch, span)[:n]
            self._graphs[batch, span] = graph, out
        graph.replay()
        return out[:n]

    def _forward(self, batch: int, span: int) -> torch.Tensor:
        return self.model.decode(self.cache, self._ids[:batch], self._positions[:batch], span)

    def _capture(self, batch: int, span: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm-up on a side stream first, as CUDA graph capture requires (lazy inits, autotune).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(batch, span)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(batch, span)
        return graph, out
