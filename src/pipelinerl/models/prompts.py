"""How a task's prompt text becomes the model's input ids, and which tokens end a completion.

An instruct model expects its chat template around the prompt and may end a turn with any of
several tokens (Qwen2.5 Instruct: `<|im_end|>` and `<|endoftext|>`); a base model expects the
text as is. `task.chat_template` (default: when the tokenizer carries one) and
`task.system_prompt` choose; every role encodes the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from transformers import PreTrainedTokenizerBase

from pipelinerl.config import Config
from pipelinerl.models.hf import encode_prompt, load_tokenizer


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, model_path: str | Path) -> tuple[int, ...]:
    """Every EOS id of the tokenizer, the model's config and its generation config, tokenizer's
    first (the one demonstrations and padding use)."""
    ids: list[int] = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    for name in ("generation_config.json", "config.json"):
        path = Path(model_path) / name
        if not path.is_file():
            continue
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not ids:
        raise ValueError(f"the tokenizer and configs at {model_path} name no EOS token: the "
                         "engine needs a stop token")
    return tuple(dict.fromkeys(int(i) for i in ids))


class PromptEncoder:
    """Prompt text -> input ids, through the chat template when one is used."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: bool | None = None,
                 system_prompt: str = "") -> None:
        has_template = bool(getattr(tokenizer, "chat_template", None))
        self.use_template = has_template if chat_template is None else chat_template
        if self.use_template and not has_template:
            raise ValueError("task.chat_template=true, but the tokenizer has no chat template")
        if system_prompt and not self.use_template:
            raise ValueError("task.system_prompt is given, but no chat template is used "
                             "(task.chat_template=false, or the tokenizer has none)")
        self.tokenizer, self.system_prompt = tokenizer, system_prompt

    def text(self, prompt: str) -> str:
        """What the model reads, as text."""
        if not self.use_template:
            return prompt
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)

    def __call__(self, prompt: str) -> list[int]:
        return encode_prompt(self.tokenizer, self.text(prompt))


def prompt_format(cfg: Config, model_path: str | Path
                  ) -> tuple[PromptEncoder, tuple[int, ...], PreTrainedTokenizerBase]:
    """The run's prompt encoder and stop tokens for the model at `model_path`, and its
    tokenizer."""
    tokenizer = load_tokenizer(model_path)
    return (PromptEncoder(tokenizer, cfg.task.chat_template, cfg.task.system_prompt),
            stop_token_ids(tokenizer, model_path), tokenizer)


@dataclass(frozen=True)
class Codec:
    """A role's text <-> token ids: prompts through the chat template, completions decoded
    without special tokens, an environment's text tokenised plainly; the model's end tokens."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    encode_text: Callable[[str], list[int]]
    stop_ids: tuple[int, ...]
    # One token's text, special tokens included (a tool reply follows the stop token's).
    token_text: Callable[[int], str] = lambda token: ""


def text_codec(cfg: Config, model_path: str | Path) -> tuple[Codec, PreTrainedTokenizerBase]:
    """The run's codec for the model at `model_path`, and its tokenizer."""
    encode, stop_ids, tokenizer = prompt_format(cfg, model_path)
    return Codec(encode=encode,
                 decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                 encode_text=lambda text: tokenizer.encode(text, add_special_tokens=False),
                 stop_ids=stop_ids,
                 token_text=lambda token: tokenizer.decode([token])), tokenizer
