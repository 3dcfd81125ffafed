"""The decoder keeps its attention off cuDNN's SDPA backend.

On an H100 (torch 2.11, bf16) cuDNN is SDPA's first choice and plans a new graph for every new
shape: 3.4 ms of CPU per call, 80 of the 107 ms of a 0.5B decode step, because the attended
length grows by one every step (benchmarks/RESULTS.md, "GPU"). The backend choice happens
inside the CUDA kernel dispatch, so on CPU a spy around `scaled_dot_product_attention` records
which backends were enabled at each call instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipelinerl.models.decoder import CausalDecoder, KVCache

torch.set_num_threads(1)

from tiny_models import VOCAB, tiny_hf_model  # noqa: E402


def test_decoder_attention_runs_with_cudnn_sdpa_disabled_spy(monkeypatch) -> None:
    hf = tiny_hf_model("qwen2")
    model = CausalDecoder(hf.config)
    model.load_hf_weights(hf.state_dict())
    cudnn_enabled: list[bool] = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        cudnn_enabled.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    ids = torch.randint(VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    cache = KVCache(model.config, capacity=2, max_seq_len=8, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        model(ids)
        model.prefill(cache, ids, torch.tensor([5, 3]), torch.arange(2))
        model.decode(cache, ids[:, 0], torch.tensor([5, 3]), attend_len=6)
    layers = len(model.model.layers)
    assert len(cudnn_enabled) == 3 * layers
    assert not any(cudnn_enabled)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before  # restored for the process
