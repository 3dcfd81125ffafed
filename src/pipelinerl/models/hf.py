"""Load and save Hugging Face causal LMs and tokenizers from local directories only.

Nothing here touches the hub: every call passes `local_files_only=True`, and a bad path fails
at once with the path and what is wrong instead of a download attempt or a deep traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

# Decoder-only architectures the project's engines and trainer handle (Llama-style blocks).
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")


class ModelPathError(ValueError):
    """A model or tokenizer directory is missing, incomplete or of an unsupported kind."""


def _check_dir(path: str | Path) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelPathError(f"model path {str(p)!r} does not exist")
    if not p.is_dir():
        raise ModelPathError(f"model path {str(p)!r} is not a directory")
    return p


def read_model_type(path: str | Path) -> str:
    """The `model_type` in `path`/config.json, checked against SUPPORTED_MODEL_TYPES."""
    p = _check_dir(path)
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise ModelPathError(f"model path {str(p)!r} has no config.json (not a HF model dir)")
    try:
        model_type = json.loads(cfg_file.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ModelPathError(f"{str(cfg_file)!r} is not a valid JSON config: {e}") from e
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelPathError(
            f"model at {str(p)!r} has unsupported model_type {model_type!r}; "
            f"supported: {list(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """A causal LM from a local HF directory, in eval mode, on `device` in `dtype`."""
    read_model_type(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelPathError(f"could not load model weights from {str(path)!r}: {e}") from e
    return model.to(device).eval()


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in a local directory. A tokenizer without a pad token gets its
    EOS as pad: batching needs a pad id, and padded positions are masked anyway."""
    p = _check_dir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ModelPathError(f"could not load a tokenizer from {str(p)!r}: {e}") from e
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelPathError(f"tokenizer at {str(p)!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def save_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | Path
) -> Path:
    """Save model (safetensors; tied weights stored once) and tokenizer in HF format."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out
