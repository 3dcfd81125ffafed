"""LoRA through peft: the trainer trains low-rank adapters only (AdamW state for them alone),
and every engine receives merged weights, W + (alpha / rank) B A, under the base model's
names, so the engines need no adapter support and sample from exactly the trainer's policy.

Saved: `final/` and each checkpoint's `model/` hold the merged model (a plain HF directory any
role or tool loads); `adapter/` beside them holds the adapter alone (peft's layout), which a
resume loads back.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

ADAPTER_DIR = "adapter"


def apply_lora(model: torch.nn.Module, settings: Any) -> torch.nn.Module:
    """`model` with adapters on `settings.target_modules` (a `LoraSettings`), every other
    parameter frozen. A target that matches no module is refused, naming the modules there are."""
    from peft import LoraConfig, get_peft_model

    _check_targets(model, settings)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha,
                        target_modules=list(settings.target_modules),
                        lora_dropout=settings.dropout, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def _check_targets(model: torch.nn.Module, settings: Any) -> None:
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    unknown = sorted(set(settings.target_modules) - names)
    if unknown:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"model.lora.target_modules {unknown} match no module of the model; "
                         f"its linear layers: {linear}")


def check_targets(model_path: str | Path, settings: Any) -> None:
    """`apply_lora`'s check at launch, on the model built without weights (meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_path), local_files_only=True)
    with torch.device("meta"):
        _check_targets(AutoModelForCausalLM.from_config(config), settings)


def is_lora(model: torch.nn.Module) -> bool:
    # Without peft imported no model can be a PeftModel: full fine-tuning never imports it.
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(getattr(model, "module", model), peft.PeftModel)


@torch.no_grad()
def merged_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's weights as a plain model's state dict: each adapted layer's base weight
    plus its adapter's delta, under the base model's names."""
    from peft.tuners.lora import LoraLayer

    base = getattr(model, "module", model).get_base_model()
    out = {name.replace(".base_layer.", "."): t.detach() for name, t in base.state_dict().items()
           if ".lora_" not in name}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            key = f"{name}.weight"
            out[key] = out[key] + module.get_delta_weight(module.active_adapters[0])
    return out


def merged_model(model: torch.nn.Module) -> torch.nn.Module:
    """A plain model holding the merged weights (a copy: `model` keeps its adapters)."""
    import copy

    return copy.deepcopy(getattr(model, "module", model)).merge_and_unload()


def to_save(model: torch.nn.Module, adapter_dir: Path) -> torch.nn.Module:
    """The plain HF model to save for `model`: itself, or with LoRA a merged copy, after the
    adapter alone was written to `adapter_dir` (peft's layout)."""
    target = getattr(model, "module", model)
    if not is_lora(target):
        return target
    target.save_pretrained(str(adapter_dir))
    return merged_model(target)


def load_adapter(model: torch.nn.Module, adapter_dir: Path) -> None:
    """Adapter weights written by `to_save` back into `model`'s adapters."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(getattr(model, "module", model), weights)
    if result.unexpected_keys:
        raise ValueError(f"adapter {adapter_dir} does not fit the model: unexpected "
                         f"{result.unexpected_keys}")
