"""The decode step's model runner (pipelinerl.engine.runner): the graph runner's buckets,
padding and scratch writes checked without CUDA (`capture=False` runs the very forward and
sampling a graph would capture), and the in-place weight updates captured graphs rely on."""

from __future__ import annotations

import contextlib

import torch

from pipelinerl.engine import runner as runner_module
from pipelinerl.engine.runner import EagerRunner, GraphRunner, bucket_of, buckets
from pipelinerl.engine import EngineOptions
from pipelinerl.engine.sampling import SamplingPlan, SlotSampler
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


def _sampler(model: CausalDecoder) -> SlotSampler:
    """Every slot's tokens distinct, as running and parked sequences' would be; greedy."""
    sampler = SlotSampler(CAPACITY, MAX_LEN, model.config.vocab_size, torch.device("cpu"))
    sampler.tokens.copy_(torch.randint(0, model.config.vocab_size, sampler.tokens.shape,
                                       generator=torch.Generator().manual_seed(2)))
    sampler.temperature.zero_()
    return sampler


def test_a_padded_bucketed_step_equals_eager_and_writes_no_sequences_cache() -> None:
    """Batches of 1-7 padded to 1, 2, 4 or 8 rows and spans padded to 64 or 96: the running
    rows' logits and sampled tokens are eager's, and the padding rows write only the scratch
    position and the scratch token column, so slots beyond the running ones (parked
    sequences) keep their cache and tokens."""
    model = _decoder()
    for n, top in ((1, 5), (3, 40), (5, 70), (7, 95), (8, 20)):
        eager_cache, graph_cache = _filled_cache(model, False), _filled_cache(model, True)
        eager_sampler, graph_sampler = _sampler(model), _sampler(model)
        before = graph_sampler.tokens.clone()
        eager = EagerRunner(model, eager_cache, eager_sampler)
        graph = GraphRunner(model, graph_cache, graph_sampler, CAPACITY, MAX_LEN, capture=False)
        positions = torch.linspace(top // 2, top, n).long()
        ids = eager_sampler.tokens[torch.arange(n), positions]
        want = model.decode(_filled_cache(model, False), ids, positions, top + 1)
        want_out = eager.decode(positions, top + 1, SamplingPlan())
        got_out = graph.decode(positions, top + 1, SamplingPlan())
        torch.testing.assert_close(graph._logits[:n], want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got_out[:, 0], want_out[:, 0]) and torch.equal(got_out[:, 0], want.argmax(-1).float())
        torch.testing.assert_close(got_out[:, 1], want_out[:, 1], rtol=1e-5, atol=1e-5)
        # Eager writes each running row's next token at positions + 1 and nothing else; the
        # graph the same, and its padding rows theirs into the scratch column only.
        changed = eager_sampler.tokens != before
        changed[torch.arange(n), positions + 1] = False
        assert not changed.any(), f"n={n}: a token outside the step's columns changed"
        expect = eager_sampler.tokens.clone()
        batch = bucket_of(n, graph.batch_sizes)
        expect[n:batch, MAX_LEN] = graph_sampler.tokens[n:batch, MAX_LEN]
        assert torch.equal(graph_sampler.tokens, expect), f"n={n}"
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


class RecordingCuda:
    """A stand-in for `torch.cuda` in the runner (the CPU has no CUDA): records the device each
    call names and refuses a call that names none (on a GPU it would fall to whatever device is
    current: the capture on cuda:0 while the engine's kernels run on cuda:1). Captures run the
    forward on the CPU; `fail_capture` makes the forward inside the first capture raise."""

    def __init__(self, fail_capture: bool = False) -> None:
        fake = self
        self.devices: list[torch.device] = []
        self.routing_to_pool = False  # the allocator's state between capture_begin and _end
        self.captures = 0
        self.fail_capture = fail_capture

        class Stream:
            def __init__(self, device: torch.device) -> None:
                fake.devices.append(torch.device(device))

            def wait_stream(self, other: object) -> None:
                pass

            def synchronize(self) -> None:
                pass

        class CUDAGraph:
            def capture_begin(self, pool: object) -> None:
                assert pool is not None, "every graph shares the one pool"
                assert fake.streams[-1] is not fake.own, "capture on the thread's own stream"
                fake.routing_to_pool = True

            def capture_end(self) -> None:
                fake.routing_to_pool = False
                fake.captures += 1

            def replay(self) -> None:
                pass

        self.Stream, self.CUDAGraph = Stream, CUDAGraph
        self.own = object.__new__(Stream)  # the thread's own stream
        self.streams = [self.own]  # the thread's current stream, innermost last

    def device(self, device: torch.device):
        self.devices.append(torch.device(device))
        return contextlib.nullcontext()

    def current_stream(self, device: torch.device) -> object:
        self.devices.append(torch.device(device))
        return self.streams[-1]

    @contextlib.contextmanager
    def stream(self, stream: object):
        self.streams.append(stream)
        try:
            yield
        finally:
            self.streams.pop()

    def memory_reserved(self, device: torch.device) -> int:
        self.devices.append(torch.device(device))
        return 0

    def graph_pool_handle(self) -> tuple[int, int]:
        return (0, 1)


def _graph_runner(fake: RecordingCuda, monkeypatch) -> GraphRunner:
    model = _decoder()
    if fake.fail_capture:
        real = model.decode
        monkeypatch.setattr(model, "decode", lambda *a: (
            (_ for _ in ()).throw(RuntimeError("operation not permitted when stream is capturing"))
            if fake.routing_to_pool else real(*a)))
    monkeypatch.setattr(runner_module, "cuda", fake)
    return GraphRunner(model, _filled_cache(model, True), _sampler(model), CAPACITY, MAX_LEN)


def test_graph_capture_names_the_cache_device_in_every_cuda_call_recording_stand_in(monkeypatch) -> None:
    """Every bucket's forward and every batch's default sampling captured when the runner is
    built, each CUDA call naming the cache's device, the thread back on its own stream and the
    allocator out of the pool."""
    fake = RecordingCuda()
    runner = _graph_runner(fake, monkeypatch)
    assert fake.devices and set(fake.devices) == {runner.cache.k[0].device}
    assert len(runner._graphs) == len(runner.batch_sizes) * len(runner.spans)
    assert set(runner._sample_graphs) == {(b, SamplingPlan()) for b in runner.batch_sizes}
    assert fake.captures == len(runner._graphs) + len(runner._sample_graphs)
    assert fake.streams == [fake.own] and not fake.routing_to_pool
    # One static buffer for every bucket's sampled tokens: a step's are views of it.
    out = runner.decode(torch.tensor([4, 5, 6]), 7, SamplingPlan())
    assert out.shape == (3, 2) and out.data_ptr() == runner._out.data_ptr()


def test_a_plan_first_met_mid_run_is_captured_once_and_a_sized_one_never_recording_stand_in(
        monkeypatch) -> None:
    fake = RecordingCuda()
    runner = _graph_runner(fake, monkeypatch)
    captured = fake.captures
    penalised = SamplingPlan(penalise=True)
    for _ in range(3):
        runner.decode(torch.tensor([4, 5, 6]), 7, penalised)
    assert fake.captures == captured + 1 and runner._sample_graphs[4, penalised] is not None
    sized = SamplingPlan(truncate=True, top_p=True, sized=True)
    runner.decode(torch.tensor([4, 5, 6]), 7, sized)
    assert fake.captures == captured + 1 and (4, sized) not in runner._sample_graphs
    assert set(fake.devices) == {runner.cache.k[0].device} and fake.streams == [fake.own]


def test_a_failed_capture_leaves_the_thread_on_its_stream_and_the_engine_eager_recording_stand_in(
        monkeypatch) -> None:
    fake = RecordingCuda(fail_capture=True)
    runner = _graph_runner(fake, monkeypatch)
    assert fake.streams == [fake.own], "left on the capture stream"
    assert not fake.routing_to_pool, "the allocator still routes to the graph pool"
    assert not runner.capture and not runner._graphs and not runner._sample_graphs
    eager = EagerRunner(runner.model, _filled_cache(runner.model, False), _sampler(runner.model))
    positions = torch.tensor([10, 30])
    got, want = runner.decode(positions, 31, SamplingPlan()), eager.decode(positions, 31, SamplingPlan())
    assert torch.equal(got[:, 0], want[:, 0])
    torch.testing.assert_close(got[:, 1], want[:, 1], rtol=1e-5, atol=1e-5)
