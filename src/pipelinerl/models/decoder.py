"""A hand-written decoder for the Llama, Mistral, Qwen2 and Qwen3 families, with a per-slot
static KV cache.

Module names mirror Hugging Face's (`model.layers.N.self_attn.q_proj`, ..., `lm_head`), so a
HF state dict loads directly. Two cached paths serve a continuous-batching engine:

- `prefill` writes whole prompts into chosen cache slots and returns last-position logits;
- `decode` feeds one token to each of the first `n` slots at its own position. The caller keeps
  its active sequences packed into slots `0..n-1` (`KVCache.move` compacts them), so a decode
  step costs O(active slots x longest active length), never O(capacity x max_seq_len);
- `extend` appends several tokens to sequences already in the cache (a multi-turn rollout's
  environment reply): only the new tokens are computed, attending to the cached ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# The families this decoder computes exactly as transformers does (tests/test_decoder.py).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# Every SDPA backend but cuDNN's, which on Hopper (bf16) plans a new graph for each new shape:
# 3.4 ms of CPU per call, and the decode shape changes every step (benchmarks/RESULTS.md, GPU).
# Applied once per forward, not per layer: entering the context costs ~30 us on a CPU. The
# switch is process-wide: engines decoding in two threads of one process (tests do; roles are
# processes) may leave it off after both exit, which only keeps cuDNN's SDPA off.
_no_cudnn_sdpa = sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


@dataclass(frozen=True)
class DecoderConfig:
    """The architecture fields we use, normalised from a HF config of a supported family."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head's q and k, before RoPE
    tie_word_embeddings: bool
    # Span of the sliding-window layers, if any. Within it they equal causal attention, so the
    # decoder serves sequences up to that length and refuses longer ones (`check_length`).
    sliding_window: int | None

    @classmethod
    def from_hf(cls, config: PretrainedConfig) -> "DecoderConfig":
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}: the torch decoder implements "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}: expected 'silu'")
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        # Biases as transformers builds them: Qwen2 has q/k/v bias and no o_proj bias; Mistral
        # none; Llama's and Qwen3's attention_bias covers all four; only Llama has mlp_bias.
        attention_bias = bool(getattr(config, "attention_bias", False)) and model_type in ("llama", "qwen3")
        is_qwen2 = model_type == "qwen2"
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=_default_rope_theta(config),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias,
            mlp_bias=model_type == "llama" and bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_window=_sliding_window(config),
        )

    def check_length(self, positions: int) -> None:
        """Refuse sequences of more than `sliding_window` positions, where sliding-window
        layers would stop attending to the earliest tokens and this decoder would not."""
        if self.sliding_window is not None and positions > self.sliding_window:
            raise ValueError(
                f"{self.model_type} model with sliding_window={self.sliding_window}: the torch "
                f"decoder implements sequences of at most that many positions, asked for "
                f"{positions} positions (lower engine.max_seq_len, or use engine.backend=vllm)"
            )


def _sliding_window(config: PretrainedConfig) -> int | None:
    """The window of the config's sliding-window layers, None if no layer slides. Mistral
    slides in every layer when `sliding_window` is set; Qwen2/Qwen3 only in the layers that
    `layer_types` marks (with `use_sliding_window`)."""
    window = getattr(config, "sliding_window", None)
    if config.model_type == "mistral":
        return window
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return window
    return None


def _default_rope_theta(config: PretrainedConfig) -> float:
    """rope_theta of a default (unscaled) RoPE; transformers >= 5 keeps it in `rope_parameters`,
    older versions in `rope_theta` + `rope_scaling`."""
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = {"rope_theta": config.rope_theta, **(getattr(config, "rope_scaling", None) or {})}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"unsupported RoPE type {rope_type!r} (rope parameters {params}): the torch decoder "
            "implements default RoPE only"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"partial rotary embeddings are not supported (rope parameters {params})")
    return float(params["rope_theta"])


class KVCache:
    """Static per-slot cache: per layer, K and V of shape [capacity, kv_heads, max_seq_len, head_dim]."""

    def __init__(
        self,
        config: DecoderConfig,
        capacity: int,
        max_seq_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
        scratch: bool = False,
    ) -> None:
        """`scratch`: one position more, which no sequence reaches, for the padding rows of a
        graph-captured decode step to write into (engine.runner.GraphRunner)."""
        config.check_length(max_seq_len)
        self.capacity = capacity
        self.max_seq_len = max_seq_len
        shape = (capacity, config.num_key_value_heads, max_seq_len + scratch, config.head_dim)
        # Zeros, not empty: masked-out positions still enter the attention matmul with weight 0,
        # and 0 * NaN from uninitialised memory would poison the output.
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_hidden_layers)]

    def move(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy positions [0, length) of slots `src` into slots `dst` (to keep active slots packed)."""
        for cache in (*self.k, *self.v):
            cache[dst, :, :length] = cache[src, :, :length]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, **factory: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, **factory))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as HF: normalise in fp32, cast back, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Default RoPE. cos/sin are computed per call from the positions in fp32 (as HF does), so
    per-sequence positions need no table and a dtype cast of the model cannot degrade them."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float, device=positions.device) / self.head_dim
            inv_freq = self._inv_freq[positions.device] = 1.0 / (self.theta**exponent)
        freqs = positions[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class FusedLinears:
    """Linears on one input computed by one matmul: their weights (and biases) become row
    blocks of one fused tensor, and the module's HF-named parameters (`q_proj.weight`, ...)
    views of those blocks, so writes by name (`load_hf_weights`, an engine receiving weights in
    place) land in the fused tensor. A conversion (`to`, `to_empty`, `half`) gives each
    parameter its own storage again: `FusingModule._apply` then fuses anew."""

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self.sizes = [linear.out_features for linear in linears]
        self.fuse()

    def fuse(self) -> None:
        weight = torch.cat([linear.weight.detach() for linear in self.linears])
        bias = None
        if self.linears[0].bias is not None:
            bias = torch.cat([linear.bias.detach() for linear in self.linears])
        biases = bias.split(self.sizes) if bias is not None else [None] * len(self.linears)
        for linear, w, b in zip(self.linears, weight.split(self.sizes), biases):
            linear.weight = nn.Parameter(w, requires_grad=linear.weight.requires_grad)
            if b is not None:
                linear.bias = nn.Parameter(b, requires_grad=linear.bias.requires_grad)
        self.weight, self.bias = weight, bias

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The linears' outputs side by side: [..., sum of out_features]."""
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each linear's output: views of one matmul's."""
        return self.matmul(x).split(self.sizes, dim=-1)


class FusingModule(nn.Module):
    """A module whose `fused` projections are fused again after every conversion and after a
    copy or unpickling (which clone each parameter on its own)."""

    fused: tuple[FusedLinears, ...] = ()

    def _apply(self, fn: Any, recurse: bool = True) -> "FusingModule":
        super()._apply(fn, recurse)
        self._refuse()
        return self

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._refuse()

    def _refuse(self) -> None:
        for fused in self.fused:
            fused.fuse()


class Attention(FusingModule):
    def __init__(self, config: DecoderConfig, **factory: Any) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=config.qkv_bias, **factory)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias, **factory)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias, **factory)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_bias, **factory)
        self.qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)
        self.fused = (self.qkv,)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **factory)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, **factory)
        self.qk_norm = config.qk_norm

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 *lead: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of x [*lead, D] as [*lead, heads, head_dim] from one matmul, q and k
        rotated (cos, sin: [*lead, head_dim]). Qwen3 first RMS-normalises each head of q and k
        (as transformers does); without that norm q and k lie side by side in the matmul's
        output and are rotated as one tensor."""
        h, kv = self.num_heads, self.num_kv_heads
        heads = self.qkv.matmul(x).view(*lead, h + 2 * kv, self.head_dim)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        v = heads[..., h + kv:, :]
        if self.qk_norm:
            q, k = self.q_norm(heads[..., :h, :]), self.k_norm(heads[..., h:h + kv, :])
            return _apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v
        qk = _apply_rope(heads[..., :h + kv, :], cos, sin)
        return qk[..., :h, :], qk[..., h:, :], v

    def prefill(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor | None,
        v_cache: torch.Tensor | None,
        slots: torch.Tensor | None,
    ) -> torch.Tensor:
        """Causal attention over a right-padded batch [B, T, D]; writes K/V into `slots` if given.
        Right padding needs no extra mask: a real token never attends to a later (pad) position."""
        b, t, _ = x.shape
        q, k, v = (y.transpose(1, 2) for y in self._project(x, cos, sin, b, t))
        if k_cache is not None:
            k_cache[slots, :, :t] = k
            v_cache[slots, :, :t] = v
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def extend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
               written: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """New tokens x: [m, T, D] at `positions` [m, T] of `slots`, attending to the cache up
        to each one's position; only the real (not padding) entries `written` = (rows, cols)
        are stored. mask: [m, 1, T, L] (True = attend)."""
        m, t, _ = x.shape
        q, k, v = self._project(x, cos, sin, m, t)
        rows, cols = written
        k_cache[slots[rows], :, positions[rows, cols]] = k[rows, cols]
        v_cache[slots[rows], :, positions[rows, cols]] = v[rows, cols]
        length = mask.shape[-1]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k_cache[slots, :, :length], v_cache[slots, :, :length],
            attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(m, t, -1))

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """One token per sequence, x: [n, D] for slots 0..n-1; mask: [n, 1, 1, L] (True = attend)."""
        n = x.shape[0]
        group = self.num_heads // self.num_kv_heads
        q, k, v = self._project(x, cos, sin, n)
        k_cache[rows, :, positions] = k
        v_cache[rows, :, positions] = v
        length = mask.shape[-1]
        # GQA without repeating K/V: the `group` query heads sharing a KV head act as the query
        # length of one attention call over that head's cached keys.
        out = F.scaled_dot_product_attention(
            q.view(n, self.num_kv_heads, group, self.head_dim),
            k_cache[:n, :, :length],
            v_cache[:n, :, :length],
            attn_mask=mask,
        )
        return self.o_proj(out.reshape(n, -1))


class MLP(FusingModule):
    def __init__(self, config: DecoderConfig, **factory: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias, **factory)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias, **factory)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias, **factory)
        self.gate_up = FusedLinears(self.gate_proj, self.up_proj)
        self.fused = (self.gate_up,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, **factory: Any) -> None:
        super().__init__()
        self.self_attn = Attention(config, **factory)
        self.mlp = MLP(config, **factory)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)

    def prefill(self, x: torch.Tensor, *attn_args: Any) -> torch.Tensor:
        x = x + self.self_attn.prefill(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode(self, x: torch.Tensor, *attn_args: Any) -> torch.Tensor:
        x = x + self.self_attn.decode(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))

    def extend(self, x: torch.Tensor, *attn_args: Any) -> torch.Tensor:
        x = x + self.self_attn.extend(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config: DecoderConfig, **factory: Any) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(config, **factory) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **factory)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)


class CausalDecoder(nn.Module):
    """Causal LM of a supported family; `load_hf_weights(hf_model.state_dict())` makes it
    compute the same logits as the HF model."""

    def __init__(
        self,
        hf_config: PretrainedConfig,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = DecoderConfig.from_hf(hf_config)
        self.model = DecoderModel(self.config, device=device, dtype=dtype)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False, device=device, dtype=dtype)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(h))

    @_no_cudnn_sdpa
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Uncached causal forward over [B, T] tokens; returns logits [B, T, V] (teacher forcing)."""
        self.config.check_length(input_ids.shape[1])
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, h.dtype)
        for layer in self.model.layers:
            h = layer.prefill(h, cos, sin, None, None, None)
        return self._logits(h)

    @_no_cudnn_sdpa
    def prefill(
        self,
        cache: KVCache,
        input_ids: torch.Tensor,
        lengths: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """Write right-padded prompts [m, T] (true lengths `lengths`) into cache `slots` from
        position 0; return the logits [m, V] at each prompt's last token. Cache positions
        >= length hold padding garbage that later decode steps overwrite before reading."""
        t = input_ids.shape[1]
        positions = torch.arange(t, device=input_ids.device).expand(input_ids.shape)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, h.dtype)
        for layer, k_cache, v_cache in zip(self.model.layers, cache.k, cache.v):
            h = layer.prefill(h, cos, sin, k_cache, v_cache, slots)
        last = h[torch.arange(h.shape[0], device=h.device), lengths - 1]
        return self._logits(last)

    @_no_cudnn_sdpa
    def extend(
        self,
        cache: KVCache,
        input_ids: torch.Tensor,
        starts: torch.Tensor,
        lengths: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """Append right-padded tokens [m, T] (true lengths `lengths`) to cache `slots`, whose
        positions [0, starts[i]) hold the sequence so far; return the logits [m, V] at each
        one's last new token. Same result as a `prefill` of the whole sequence, computing only
        the new tokens."""
        m, t = input_ids.shape
        offsets = torch.arange(t, device=input_ids.device)
        positions = starts[:, None] + offsets
        real = offsets[None, :] < lengths[:, None]
        attend_len = int((starts + lengths).max())
        span = torch.arange(attend_len, device=input_ids.device)
        mask = (span[None, None, :] <= positions[:, :, None]).unsqueeze(1)
        written = real.nonzero(as_tuple=True)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, h.dtype)
        for layer, k_cache, v_cache in zip(self.model.layers, cache.k, cache.v):
            h = layer.extend(h, cos, sin, k_cache, v_cache, slots, positions, written, mask)
        last = h[torch.arange(m, device=h.device), lengths - 1]
        return self._logits(last)

    @_no_cudnn_sdpa
    def decode(
        self,
        cache: KVCache,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend_len: int,
    ) -> torch.Tensor:
        """Feed token `input_ids[i]` at `positions[i]` of slot i for i < n; return logits [n, V].
        `attend_len` (> every position, passed by the caller to avoid a device sync) bounds
        the attention span."""
        n = input_ids.shape[0]
        rows = torch.arange(n, device=input_ids.device)
        span = torch.arange(attend_len, device=input_ids.device)
        mask = (span[None, :] <= positions[:, None]).view(n, 1, 1, attend_len)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, h.dtype)
        for layer, k_cache, v_cache in zip(self.model.layers, cache.k, cache.v):
            h = layer.decode(h, cos, sin, k_cache, v_cache, rows, positions, mask)
        return self._logits(h)

    @torch.no_grad()
    def load_hf_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in place (casting dtype/device). Every parameter must be given;
        for tied embeddings `lm_head.weight` may be absent and is ignored if present (the
        embedding is the one tensor behind both names)."""
        params = dict(self.named_parameters())
        skip = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        # Older HF checkpoints store the (recomputable) rotary inverse frequencies.
        unknown = [n for n in weights if n not in params and n not in skip and not n.endswith("rotary_emb.inv_freq")]
        if unknown:
            raise KeyError(f"weights not in the {self.config.model_type} decoder: {sorted(unknown)[:10]}")
        missing = [n for n in params if n not in weights]
        if missing:
            raise KeyError(f"weights missing for decoder parameters: {sorted(missing)[:10]}")
        # Every check before the first copy, so a rejected update leaves the weights whole.
        for name, param in params.items():
            if weights[name].shape != param.shape:
                raise ValueError(
                    f"shape mismatch for {name}: got {tuple(weights[name].shape)}, expected {tuple(param.shape)}"
                )
        for name, param in params.items():
            param.copy_(weights[name])


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(str(path / name)))
    return weights


def load_pretrained(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> CausalDecoder:
    """Build a decoder from a local HF model directory (config.json + safetensors weights)."""
    from transformers import AutoConfig

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    try:
        hf_config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read a Hugging Face config from {path}: {e}") from e
    # Allocate without random init (meta), then materialise and fill from the checkpoint.
    model = CausalDecoder(hf_config, device="meta", dtype=dtype).to_empty(device=device)
    model.tie_weights()
    model.load_hf_weights(_read_safetensors(path))
    return model
