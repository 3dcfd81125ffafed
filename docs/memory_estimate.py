"""Trainer memory per GPU by arithmetic (docs/scaling.md): `python docs/memory_estimate.py`
prints the table that docs/scaling.md shows (a test keeps the two equal).

Bytes counted (P parameters, N trainer ranks, h hidden, i MLP width, k key/value width, L
layers, V vocabulary, T tokens in one packed micro-batch):
  state       DDP: 16 P (fp32 weights 4, gradients 4, AdamW moments 8) on every rank.
              FSDP2: 16 P / N (the same, sharded); with CPU offload it is in host memory.
  gathered    FSDP2 only: bf16 weights and gradients of the units in flight: the root
              (embeddings, head) and two decoder layers (the one running, the one prefetched).
  activations per layer and token (6 h + 2 k + 4 i) saved values, bf16 under FSDP2, fp32 under
              DDP (its trainer computes in fp32); with activation checkpointing only each
              layer's input (h) plus one layer's full set.
  logits      T x V float32, twice (log-softmax and its gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
TOKENS = 4096  # tokens in one packed micro-batch (trainer.max_tokens_per_row)


@dataclass(frozen=True)
class Shape:
    """Qwen2.5 shapes, from each model's config.json."""

    name: str
    hidden: int
    layers: int
    mlp: int
    kv: int  # num_key_value_heads x head_dim
    vocab: int
    tied: bool

    @property
    def layer_params(self) -> int:
        h = self.hidden
        return 2 * h * h + 2 * h * self.kv + h + 2 * self.kv + 3 * h * self.mlp + 2 * h

    @property
    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params


MODELS = (
    Shape("0.5B", 896, 24, 4864, 128, 151936, True),
    Shape("1.5B", 1536, 28, 8960, 256, 151936, True),
    Shape("7B", 3584, 28, 18944, 512, 152064, False),
    Shape("32B", 5120, 64, 27648, 1024, 152064, False),
)


def activations(m: Shape, bytes_per: int, checkpointing: bool) -> float:
    per_token_layer = 6 * m.hidden + 2 * m.kv + 4 * m.mlp
    if checkpointing:
        saved = TOKENS * (m.layers * m.hidden + per_token_layer)
    else:
        saved = TOKENS * m.layers * per_token_layer
    return saved * bytes_per + 2 * TOKENS * m.vocab * 4


def per_gpu(m: Shape, strategy: str, ranks: int, offload: bool = False,
            checkpointing: bool = False) -> float:
    if strategy == "ddp":
        return 16 * m.params + activations(m, 4, checkpointing)
    state = 0 if offload else 16 * m.params / ranks
    gathered = 2 * 2 * (m.root_params + 2 * m.layer_params)
    return state + gathered + activations(m, 2, checkpointing)


COLUMNS = (
    ("DDP", dict(strategy="ddp", ranks=1)),
    ("DDP + AC", dict(strategy="ddp", ranks=1, checkpointing=True)),
    ("FSDP2 x8", dict(strategy="fsdp2", ranks=8)),
    ("FSDP2 x8 + AC", dict(strategy="fsdp2", ranks=8, checkpointing=True)),
    ("FSDP2 x64 + AC", dict(strategy="fsdp2", ranks=64, checkpointing=True)),
    ("FSDP2 x8 + offload + AC", dict(strategy="fsdp2", ranks=8, offload=True, checkpointing=True)),
)


def table() -> str:
    lines = ["| model | params | " + " | ".join(name for name, _ in COLUMNS) + " |",
             "| --- | --- |" + " --- |" * len(COLUMNS)]
    for m in MODELS:
        cells = [f"{per_gpu(m, **kw) / GB:.1f}" for _, kw in COLUMNS]
        lines.append(f"| {m.name} | {m.params / GB:.2f} B | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
