"""The hand-written decoder computes Hugging Face's logits, with and without its KV cache."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, MistralConfig

from pipelinerl.models.decoder import CausalDecoder, KVCache, load_pretrained

torch.set_num_threads(1)

from tiny_models import ARCHS, VOCAB, tiny_hf_model  # noqa: E402
ATOL = 1e-4


def decoder_from(hf: torch.nn.Module) -> CausalDecoder:
    model = CausalDecoder(hf.config)
    model.load_hf_weights(hf.state_dict())
    return model.eval()


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [(arch, {}) for arch in ARCHS]
    + [("qwen3", {"attention_bias": True}), ("llama", {"attention_bias": True, "mlp_bias": True})],
)
def test_logits_match_hf_prefill_and_decode(arch: str, overrides: dict) -> None:
    hf = tiny_hf_model(arch, **overrides)
    model = decoder_from(hf)
    tokens = torch.randint(0, VOCAB, (3, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
        torch.testing.assert_close(model(tokens), ref, atol=ATOL, rtol=0)

        # Batched prefill of different lengths into non-contiguous slots, then decode the rest
        # of each sequence one token at a time at its own position.
        cache = KVCache(model.config, capacity=5, max_seq_len=32, device="cpu", dtype=torch.float32)
        lengths = torch.tensor([6, 9, 3])
        slots = torch.tensor([0, 1, 2])
        logits = model.prefill(cache, tokens[:, :9], lengths, slots)
        torch.testing.assert_close(logits, ref[torch.arange(3), lengths - 1], atol=ATOL, rtol=0)
        positions = lengths.clone()
        while int(positions.max()) < tokens.shape[1]:
            positions = positions.clamp(max=tokens.shape[1] - 1)
            logits = model.decode(cache, tokens[torch.arange(3), positions], positions, int(positions.max()) + 1)
            torch.testing.assert_close(logits, ref[torch.arange(3), positions], atol=ATOL, rtol=0)
            positions = positions + 1


def test_decode_attends_only_to_the_first_n_slots_and_their_lengths() -> None:
    hf = tiny_hf_model("qwen2")
    model = decoder_from(hf)
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(tokens).logits
        cache = KVCache(model.config, capacity=4, max_seq_len=16, device="cpu", dtype=torch.float32)
        # Slots 2 and 3 hold another sequence; moving slot 3 into slot 0 must carry its cache.
        model.prefill(cache, tokens[:, :7], torch.tensor([7, 5]), torch.tensor([3, 1]))
        cache.k[0][2].fill_(1e4)  # a stale slot outside 0..n-1 must not leak into the result
        cache.move(torch.tensor([3]), torch.tensor([0]), 7)
        positions = torch.tensor([7, 5])
        logits = model.decode(cache, tokens[torch.arange(2), positions], positions, 8)
    torch.testing.assert_close(logits, ref[torch.arange(2), positions], atol=ATOL, rtol=0)


def test_bfloat16_decode_stays_close_to_fp32() -> None:
    hf = tiny_hf_model("llama")
    model = decoder_from(hf).to(torch.bfloat16)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(tokens).logits[:, -1]
        cache = KVCache(model.config, capacity=2, max_seq_len=8, device="cpu", dtype=torch.bfloat16)
        model.prefill(cache, tokens[:, :7], torch.tensor([7, 7]), torch.tensor([0, 1]))
        logits = model.decode(cache, tokens[:, 7], torch.tensor([7, 7]), 8).float()
    assert (logits - ref).abs().max() < 0.25 * ref.abs().max()


def test_fused_projections_take_weights_written_in_place_by_hf_name() -> None:
    """q/k/v and gate/up run as one matmul each over fused weights; the HF-named parameters are
    views of them, also after dtype conversions and a deepcopy, so an engine receiving
    weights in place by name (`receive_weights`) changes what the fused matmul computes."""
    hf = tiny_hf_model("qwen2")  # q/k/v biases
    model = copy.deepcopy(CausalDecoder(hf.config).to(torch.float64).to(torch.float32)).eval()
    targets = dict(model.named_parameters(remove_duplicate=False))
    for name, weight in hf.state_dict().items():
        if name in targets:
            targets[name].data.copy_(weight)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.k_proj.weight.data_ptr() == attn.qkv.weight[attn.q_proj.out_features:].data_ptr()
    assert attn.v_proj.bias.data_ptr() == attn.qkv.bias[-attn.v_proj.out_features:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == mlp.gate_up.weight[mlp.gate_proj.out_features:].data_ptr()
    assert "model.layers.0.self_attn.qkv.weight" not in targets  # names stay HF's
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=ATOL, rtol=0)


def test_load_pretrained_round_trip(tmp_path: Path) -> None:
    for arch in ARCHS:
        hf = tiny_hf_model(arch)
        hf.save_pretrained(tmp_path / arch)
        model = load_pretrained(tmp_path / arch)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == hf.config.tie_word_embeddings
        tokens = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=ATOL, rtol=0)


def test_load_pretrained_errors_name_the_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        load_pretrained(tmp_path / "empty")
    tiny_hf_model("llama").config.save_pretrained(tmp_path / "config_only")
    with pytest.raises(FileNotFoundError, match="config_only"):
        load_pretrained(tmp_path / "config_only")


def test_unsupported_configs_fail_clearly() -> None:
    with pytest.raises(ValueError, match="model_type 'gpt2'.*llama, mistral, qwen2, qwen3"):
        CausalDecoder(GPT2Config())
    scaled = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="RoPE type 'linear'"):
        CausalDecoder(scaled)


def test_load_hf_weights_rejects_missing_unknown_and_misshaped() -> None:
    hf = tiny_hf_model("llama")
    model = CausalDecoder(hf.config)
    weights = dict(hf.state_dict())
    with pytest.raises(KeyError, match="lm_head.weight"):
        model.load_hf_weights({k: v for k, v in weights.items() if k != "lm_head.weight"})
    with pytest.raises(KeyError, match="extra.weight"):
        model.load_hf_weights({**weights, "extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="model.norm.weight"):
        model.load_hf_weights({**weights, "model.norm.weight": torch.ones(3)})


@pytest.mark.parametrize(
    ("arch", "window_config"),
    [
        ("mistral", dict(sliding_window=12)),
        ("qwen2", dict(use_sliding_window=True, sliding_window=12, max_window_layers=1)),
        ("qwen3", dict(use_sliding_window=True, sliding_window=12, max_window_layers=1)),
    ],
)
def test_sliding_window_serves_sequences_within_it_and_refuses_longer(arch: str, window_config: dict) -> None:
    """Up to the window, sliding-window attention is plain causal attention: the decoder
    matches HF; a cache or a forward longer than the window is refused, naming both lengths."""
    hf = tiny_hf_model(arch, **window_config)
    model = decoder_from(hf)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens[:, :12]), hf(tokens[:, :12]).logits, atol=ATOL, rtol=0)
        KVCache(model.config, capacity=2, max_seq_len=12, device="cpu", dtype=torch.float32)
        # Beyond the window HF's attention differs from causal attention (the same weights
        # without a window): the decoder must refuse, not silently compute the latter.
        causal = tiny_hf_model(arch)(tokens).logits
        assert (hf(tokens).logits[:, 12:] - causal[:, 12:]).abs().max() > 10 * ATOL
        with pytest.raises(ValueError, match="sliding_window=12.*16 positions"):
            model(tokens)
    with pytest.raises(ValueError, match="sliding_window=12.*32 positions"):
        KVCache(model.config, capacity=2, max_seq_len=32, device="cpu", dtype=torch.float32)


def test_mistral_without_sliding_window() -> None:
    cfg = MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, sliding_window=None)
    assert CausalDecoder(cfg).config.sliding_window is None
