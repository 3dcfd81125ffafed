"""Liger's fused kernels in the trainer (`trainer.liger`, CUDA only, optional extra `gpu`).

Liger-Kernel (linkedin/Liger-Kernel, Triton) has, for the families the trainer trains:
- RMSNorm, SwiGLU and rotary embedding kernels, patched into the model's modules
  (`use_liger`; its rotary patch replaces the family's `apply_rotary_pos_emb` for the whole
  process, as Liger does it);
- a fused linear + cross-entropy: the head's projection and the log-softmax of each trained
  token's row computed chunk by chunk over the tokens, never the (tokens, vocab) logits in
  memory (`fused_logprobs`; its per-token loss, reduction "none", is -log pi(a_t)).

The eager path (`rl.scores.score_tokens` with mode "eager") is the reference: the GPU check
(benchmarks/gpu.py, plan issue54) compares the two. The fused head scores untruncated
distributions only (engine.top_k 0, top_p 1) and gives no entropy: the `entropy` metric is
absent and an entropy bonus is refused.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from pipelinerl.rl.packing import PackedBatch

GPU_EXTRA = "pip install 'pipelinerl[gpu]' (liger-kernel, which needs triton and CUDA)"


def _liger() -> object:
    """The liger_kernel package, or an error saying how to get it."""
    try:
        import liger_kernel.transformers as liger
    except ImportError as e:
        raise RuntimeError(f"trainer.liger=true needs liger-kernel: {GPU_EXTRA}") from e
    return liger


def use_liger(model: nn.Module, device: torch.device | str) -> None:
    """Liger's RMSNorm, SwiGLU and rotary kernels in `model` (a Hugging Face causal LM), in
    place. Refused off CUDA (Triton kernels) and for a family Liger does not cover."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"trainer.liger=true needs a CUDA trainer.device, not {str(device)!r}: "
                         "Liger's kernels are Triton kernels for GPUs; the eager path is the "
                         "CPU's")
    _liger()
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    model_type = model.config.model_type
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        raise ValueError(f"trainer.liger=true: liger-kernel has no kernels for model_type "
                         f"{model_type!r}")
    # The head stays ours: `fused_logprobs` calls the fused linear + cross-entropy itself.
    apply(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
          fused_linear_cross_entropy=False)


def fused_logprobs(model: nn.Module, batch: PackedBatch, temperature: float,
                   truncation: tuple[int, float] | None, entropy_grad: bool) -> Tensor:
    """log pi(a_t) of the batch's trained tokens through Liger's fused linear + cross-entropy:
    the decoder's hidden state at each trained token's position, divided by the temperature
    (logits / T = (h / T) W^T), projected and normalised chunk by chunk."""
    if truncation is not None:
        raise ValueError("trainer.liger=true scores untruncated distributions only: engine.top_k"
                         f"={truncation[0]}, engine.top_p={truncation[1]} need the eager head")
    if entropy_grad:
        raise ValueError("trainer.liger=true computes no entropy: trainer.loss.entropy_coef "
                         "must be 0")
    _liger()
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    hidden = model.get_decoder()(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask,
        position_ids=batch.position_ids, use_cache=False, **batch.attention_kwargs(),
    ).last_hidden_state  # (R, L, hidden)
    rows = hidden[:, batch.logit_cols].reshape(-1, hidden.shape[-1])[batch.logit_index]
    head = model.get_output_embeddings()
    nll = liger_fused_linear_cross_entropy(rows / temperature, head.weight, batch.target_ids,
                                           bias=head.bias, reduction="none")
    return -nll.float()
