"""The decode step's model runner (pipelinerl.engine.runner): the graph runner's buckets,
padding and scratch writes checked without CUDA (`capture=False` runs the very forward a
graph would capture), and the in-place weight updates captured graphs rely on."""

from __future__ import annotations

import torch

from pipelinerl.engine.runner import EagerRunner, GraphRunner, bucket_of, buckets
from pipelinerl.engine import EngineOptions
from pipelinerl.engine.torch_engine import TorchEngine
from pipelinerl.models.decoder import CausalDecoder, KVCache
from tiny_models import smollm2_layout

torch.set_num_threads(1)
CAPACITY, MAX_LEN = 8, 96


def test_buckets_cover_every_size_with_powers_of_two_then_the_limit() -> None:
    assert buckets(8) == [1, 2, 4, 8] and buckets(6) == [1, 2, 4, 6]
    assert buckets(96, 64) == [64, 96] and buckets(40, 40) == [40]
    sizes = buckets(100)
    assert [bucket_of(n, sizes) for n in (1, 3, 64, 65, 100)] == [1, 4, 64, 100, 100]


def _decoder() -> CausalDecoder:
    hf = smollm2_layout(2)
    model = CausalDecoder(hf.config).eval().requires_grad_(False)
    model.load_hf_weights(hf.state_dict())
    return model


def _filled_cache(model: CausalDecoder, scratch: bool) -> KVCache:
    """Every slot's cache holds distinct values, as running and parked sequences' would."""
    cache = KVCache(model.config, CAPACITY, MAX_LEN, "cpu", torch.float32, scratch=scratch)
    gen = torch.Generator().manual_seed(1)
    for t in (*cache.k, *cache.v):
        t[:, :, :MAX_LEN] = torch.randn(t[:, :, :MAX_LEN].shape, generator=gen)
    return cache


def test_a_padded_bucketed_step_equals_eager_and_writes_no_sequences_cache() -> None:
    """Batches of 1-7 padded to 1, 2, 4 or 8 rows and spans padded to 64 or 96: the running
    rows' logits are eager's, and the padding rows write only the scratch position, so slots
    beyond the running ones (parked sequences) keep their cache."""
    model = _decoder()
    for n, top in ((1, 5), (3, 40), (5, 70), (7, 95), (8, 20)):
        eager_cache, graph_cache = _filled_cache(model, False), _filled_cache(model, True)
        eager = EagerRunner(model, eager_cache)
        graph = GraphRunner(model, graph_cache, CAPACITY, MAX_LEN, capture=False)
        positions = torch.linspace(top // 2, top, n).long()
        ids = torch.arange(n) * 7 % 512
        want = eager.decode(ids, positions, top + 1)
        got = graph.decode(ids, positions, top + 1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        written = torch.zeros(CAPACITY, MAX_LEN, dtype=torch.bool)
        written[torch.arange(n), positions] = True
        for e, g in zip((*eager_cache.k, *eager_cache.v), (*graph_cache.k, *graph_cache.v)):
            g = g[:, :, :MAX_LEN].transpose(1, 2)  # (slot, position, heads, dim)
            e = e.transpose(1, 2)
            # The new tokens' K/V (a wider span sums in another order: rounding apart) ...
            torch.testing.assert_close(g[written], e[written], rtol=1e-5, atol=1e-5)
            # ... and nothing else of any slot, running or parked, touched.
            assert torch.equal(g[~written], e[~written]), f"n={n}: a sequence's cache changed"


def test_weight_updates_write_into_the_tensors_a_captured_graph_reads() -> None:
    """A graph replays the parameters' (and fused projections') storage as captured: a new
    version must be copied into it, never put in new tensors."""
    hf = smollm2_layout(2)
    engine = TorchEngine(hf.config, EngineOptions(capacity=CAPACITY, max_seq_len=MAX_LEN))
    model = engine.model
    storage = {name: p.data_ptr() for name, p in model.named_parameters()}
    fused = [f.weight.data_ptr() for layer in model.model.layers
             for f in (layer.self_attn.qkv, layer.mlp.gate_up)]
    engine.load_weights(smollm2_layout(2, seed=1).state_dict(), version=1)
    new = smollm2_layout(2, seed=2).state_dict()
    engine.receive_weights(lambda targets: [t.copy_(new[name]) for name, t in targets.items()
                                            if name in new] and 2)
    assert engine.version == 2
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == storage
    assert [f.weight.data_ptr() for layer in model.model.layers
            for f in (layer.self_attn.qkv, layer.mlp.gate_up)] == fused
    torch.testing.assert_close(model.model.layers[0].self_attn.qkv.weight[:96],
                               new["model.layers.0.self_attn.q_proj.weight"])


def test_the_cpu_engine_decodes_eagerly_and_needs_no_scratch() -> None:
    engine = TorchEngine(smollm2_layout(2).config, EngineOptions(capacity=CAPACITY, max_seq_len=MAX_LEN))
    assert isinstance(engine._runner, EagerRunner)
    assert engine._runner.cache.k[0].shape[2] == MAX_LEN
