"""Load and save Hugging Face causal LMs and tokenizers from local directories only.

Nothing here touches the hub: every call passes `local_files_only=True`, and a bad path fails
at once with the path and what is wrong instead of a download attempt or a deep traceback.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

# One list for engines and trainer: the families the torch engine computes exactly as
# transformers does (the vLLM engine and the trainer run them through their own code).
from pipelinerl.models.decoder import SUPPORTED_MODEL_TYPES, DecoderConfig


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


def check_engine_model(path: str | Path, backend: str, max_seq_len: int) -> None:
    """Refuse, before any role starts, a model that the actor's engine would refuse when it
    starts: a family outside SUPPORTED_MODEL_TYPES (any backend) and, for the torch engine,
    what its decoder lacks (scaled RoPE, another activation, a sliding window shorter than
    `max_seq_len`). Raises ModelPathError or ValueError naming what is wrong."""
    read_model_type(path)
    if backend == "torch":
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        DecoderConfig.from_hf(config).check_length(max_seq_len)


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """A causal LM from a local HF directory, in eval mode, on `device` in `dtype`.

    `device="meta"`: the model's structure alone, no weight read (a sharded trainer's ranks
    build it so, shard it, then load only their shards: `pipelinerl.rl.parallel.load_shards`).
    Its parameters are on the meta device (no memory); its buffers are real, computed on the
    CPU, since those the checkpoint lacks (rotary `inv_freq`) are not loaded later."""
    read_model_type(path)
    if torch.device(device).type == "meta":
        return _empty_model(Path(path), dtype).eval()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelPathError(f"could not load model weights from {str(path)!r}: {e}") from e
    return model.to(device).eval()


def _empty_model(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    from accelerate import init_empty_weights
    from transformers import GenerationConfig

    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        # Each parameter moves to the meta device as it is registered, before its
        # initialisation runs; buffers stay where they are computed (include_buffers=False).
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        # The patched registration gave each tied name a parameter of its own: tie them again
        # (lm_head = embed_tokens is one parameter, as in a loaded model).
        model.tie_weights()
        if (path / "generation_config.json").is_file():  # as from_pretrained would read it
            model.generation_config = GenerationConfig.from_pretrained(
                str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelPathError(f"could not build the model of {str(path)!r}: {e}") from e
    return model


_PLAIN_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizer_class(path: Path) -> str | None:
    config = path / "tokenizer_config.json"
    try:
        return json.loads(config.read_text()).get("tokenizer_class")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in a local directory. A tokenizer without a pad token gets its
    EOS as pad: batching needs a pad id, and padded positions are masked anyway."""
    p = _check_dir(path)
    # A plain `tokenizers` tokenizer (the char tokenizers built here, any hand-built one) is
    # loaded as saved: AutoTokenizer would pick the model family's class from config.json
    # (Qwen2Tokenizer for a qwen2 model), whose own pre-tokenizer drops spaces and newlines.
    loader = (PreTrainedTokenizerFast if _tokenizer_class(p) in _PLAIN_TOKENIZER_CLASSES
              else AutoTokenizer)
    try:
        tokenizer = loader.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise ModelPathError(f"could not load a tokenizer from {str(p)!r}: {e}") from e
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelPathError(f"tokenizer at {str(p)!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """A prompt's token ids as the model expects them, for the engine (and, through the
    sample's stored prompt_ids, the trainer): with the special tokens the tokenizer puts before
    a text (BOS for Llama and Mistral; none for Qwen or the char tokenizer), without those it
    appends (an EOS would end the prompt), and no second BOS when the text already starts with
    one (a chat template's output)."""
    plain = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.encode(text, add_special_tokens=True)
    prefix = next(
        (full[:k] for k in range(len(full) - len(plain) + 1) if full[k : k + len(plain)] == plain),
        [],
    )
    return plain if plain[: len(prefix)] == prefix else prefix + plain


def save_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | Path,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save model (safetensors; tied weights stored once) and tokenizer in HF format.

    Atomic: written to a temporary directory beside `out_dir`, then renamed into place (an
    existing `out_dir` is replaced as a whole), so an interrupted save leaves the previous
    `out_dir` (or none), never a partial one. `state_dict`: the weights to write in place of
    the model's own (a sharded model's, gathered).
    """
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        model.save_pretrained(str(tmp), state_dict=state_dict)
        tokenizer.save_pretrained(str(tmp))
    except BaseException:  # KeyboardInterrupt too: a stopped role leaves no partial copy
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():  # rename() cannot replace a non-empty directory: move it aside first
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        tmp.rename(out)
    return out
