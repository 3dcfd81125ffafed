"""The GPU checklist (shared/GPU.md) in one script: each check guarded, results as they come.

Checks (`--checks`, default 1-5):
  1 correctness: the torch engine on the device vs HF `generate` (greedy tokens) and vs HF
    teacher-forced log_softmax (per-token log-prob gap), fp32 and bf16 (+ an fp32 lm_head).
  2 engine: RL-shaped workload (varied prompt and completion lengths, refill as sequences
    finish) at a Qwen2-0.5B shape in bf16: torch engine vs HF `generate` on static batches,
    decode step time, and what a CUDA graph of the decode forward would save.
  3 pause: an in-flight weight update through the shm channel into the running engine,
    against one decode step and against the host-to-device bandwidth.
  4 trainer: `rl_step` (packing, REINFORCE-TIS, AdamW) at the 0.5B shape: tokens/s and MFU.
  5 pipeline: `pipelinerl train` with actor and trainer sharing the device, pipeline vs
    conventional G=1.
  6 engine profile: where one decode step's time goes (torch.profiler), small-copy costs.
  7 step profile: a 32-sample SmolLM2-shaped `rl_step`: ms, kernels launched, host syncs.
  8 smollm2: examples/smollm2.yaml on the device from its GGUF, pipeline vs conventional G=2,
    held-out pass@1 over time.
  9 trainer profile: check 4's 0.5B step under trainer.precision tf32 and bfloat16, profiled.
  10 step options (issue 54): the SmolLM2 and 0.5B steps under trainer.compute_dtype,
    tokens_per_microbatch, compile and liger: ms, launches, waits, device busy, MFU, log-prob gap.

`--plan issue35` runs 7,2,4,8 in one call of at most 9 minutes; benchmarks/gpu_session.sh
prepares its carriage (wheels the GPU machine lacks, the GGUF in two parts) and runs it there.
`--plan issue54` runs 10,7 (no GGUF needed: `gpu_session.sh run54`).

Models are random-initialised from `transformers` configs (no download). Results go to
`<out>/gpu.json` and `<out>/gpu.md` after every check, so a run cut short keeps what it did.

Run on a GPU: `PYTHONPATH=src python benchmarks/gpu.py --out $OUT`; a CPU smoke test at tiny
shapes: `python benchmarks/gpu.py --device cpu --quick --out /tmp/gpu-quick`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

H100_BF16_DENSE_FLOPS = 989e12  # H100 SXM datasheet, dense bf16

# Qwen2-0.5B's architecture (its real vocabulary; tied embeddings, q/k/v bias, GQA 14/2).
DEFAULT_CAPACITIES, QUICK_CAPACITIES = (64, 128, 256), (8, 16)  # check 2's engine capacities
QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                 rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768)
QUICK = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=1000, tie_word_embeddings=True, rope_theta=1e6,
             rms_norm_eps=1e-6, max_position_embeddings=4096)
# A small model with large weights: peaked distributions, so fp32 greedy decoding has no
# near-ties and token equality tests the arithmetic, not rounding luck.
PEAKED = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=256, vocab_size=512, tie_word_embeddings=True, rope_theta=1e4,
              rms_norm_eps=1e-6, max_position_embeddings=4096)


@dataclass
class Ctx:
    device: torch.device
    quick: bool
    out: Path
    results: dict[str, Any]
    pipeline_seconds: int = 75
    capacities: tuple[int, ...] = DEFAULT_CAPACITIES
    hf: bool = True  # check 2 also times HF generate
    brief: bool = False  # check 4 times only the trainer's own settings (the one-call plan)
    gguf: Path = Path("/tmp/smol.gguf")  # check 8's model
    smollm2_seconds: int = 150  # check 8: trainer.max_time_s of each run
    deadline: float | None = None  # perf_counter() by which every check must have ended

    def seconds_left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.perf_counter()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def save(self) -> None:
        (self.out / "gpu.json").write_text(json.dumps(self.results, indent=1, default=str))
        (self.out / "gpu.md").write_text(render(self.results))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- models and workloads ------------------------------------------------------------------------

def build_hf(shape: dict[str, Any], device: torch.device, dtype: torch.dtype = torch.float32,
             seed: int = 0, peaked: bool = False) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    if peaked:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.15 * torch.randn_like(p))
    model.generation_config.eos_token_id = None  # lengths are imposed: never stop early
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval().requires_grad_(False)


def build_engine(hf: Any, capacity: int, max_seq_len: int, device: torch.device, dtype: torch.dtype,
                 seed: int = 0, cuda_graphs: bool = True) -> Any:
    from pipelinerl.engine import EngineOptions
    from pipelinerl.engine.torch_engine import TorchEngine

    engine = TorchEngine(hf.config, EngineOptions(
        capacity=capacity, max_seq_len=max_seq_len, device=str(device),
        dtype=str(dtype).removeprefix("torch."), seed=seed, cuda_graphs=cuda_graphs))
    engine.load_weights(hf.state_dict(), version=0)
    return engine


def make_requests(prompts: list[list[int]], max_new: list[int], temperature: float, tag: str = "r") -> list[Any]:
    from pipelinerl.types import GenerationRequest, SamplingParams

    return [GenerationRequest(f"{tag}{i}", list(p), SamplingParams(max_new_tokens=n, temperature=temperature))
            for i, (p, n) in enumerate(zip(prompts, max_new))]


def run_to_end(engine: Any, reqs: list[Any]) -> dict[str, Any]:
    for r in reqs:
        engine.add_request(r)
    out: dict[str, Any] = {}
    while engine.num_active():
        out.update((o.request_id, o) for o in engine.step())
    return out


def rl_lengths(n: int, vocab: int, rng: random.Random, quick: bool) -> tuple[list[list[int]], list[int]]:
    """Prompts of 32-256 random tokens; completion lengths log-normal (median 96) in [16, 256]:
    a long tail, as RL generations have. Quick: a tenth."""
    lo, hi, median, top = (4, 24, 10, 24) if quick else (32, 256, 96, 256)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    max_new = [min(top, max(lo // 2 or 1, round(math.exp(rng.gauss(math.log(median), 0.7))))) for _ in range(n)]
    return prompts, max_new


@torch.no_grad()
def hf_generate(model: Any, prompts: list[list[int]], max_new: int, greedy: bool, device: torch.device) -> torch.Tensor:
    """HF generate over one left-padded batch; returns the new tokens [B, max_new]."""
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=None, top_p=None)
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new,
                         **sampling)
    return out[:, width:]


@torch.no_grad()
def teacher_forced(model: Any, outputs: list[Any], device: torch.device, batch: int = 16) -> list[torch.Tensor]:
    """HF log_softmax (fp32) of each output's generated tokens, teacher-forced, right-padded."""
    result = []
    for lo in range(0, len(outputs), batch):
        chunk = outputs[lo:lo + batch]
        seqs = [o.prompt_ids + o.token_ids for o in chunk]
        width = max(map(len, seqs))
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
        for i, o in enumerate(chunk):
            start = len(o.prompt_ids) - 1
            rows = logits[i, start:start + len(o.token_ids)].float().log_softmax(-1)
            result.append(rows.gather(1, torch.tensor(o.token_ids, device=device)[:, None]).squeeze(1).cpu())
    return result


def gap(reference: list[torch.Tensor], outputs: list[Any]) -> dict[str, float]:
    d = torch.cat([(r - torch.tensor(o.logprobs)).abs() for r, o in zip(reference, outputs)])
    return {"max": float(d.max()), "mean": float(d.mean()), "tokens": d.numel()}


def fp32_head(engine: Any) -> None:
    """Make the engine's final norm + lm_head run in fp32 (fp32 copies of their weights)."""
    model = engine.model
    norm_w = model.model.norm.weight.detach().float()
    head_w = model.lm_head.weight.detach().float()
    eps = model.model.norm.eps

    def logits(h: torch.Tensor) -> torch.Tensor:
        h = h.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return F.linear(norm_w * h, head_w)

    model._logits = logits


# -- 1. correctness -------------------------------------------------------------------------------

def check_correctness(ctx: Ctx) -> dict[str, Any]:
    dev, res = ctx.device, {}
    rng = random.Random(1)
    n_new = 12 if ctx.quick else 32

    # (a) greedy token equality on a peaked model, fp32 and bf16 (HF in the same dtype).
    peaked = build_hf(PEAKED, dev, peaked=True)
    prompts = [[rng.randrange(PEAKED["vocab_size"]) for _ in range(rng.randint(3, 40))] for _ in range(8)]
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        hf = peaked.to(dtype)
        engine = build_engine(hf, 8, max(map(len, prompts)) + n_new, dev, dtype)
        got = run_to_end(engine, make_requests(prompts, [n_new] * len(prompts), 0.0))
        equal, tokens_equal = 0, 0
        for i, p in enumerate(prompts):  # batch 1: no padding in the reference
            want = hf_generate(hf, [p], n_new, True, dev)[0].tolist()
            have = got[f"r{i}"].token_ids
            equal += want == have
            tokens_equal += next((j for j, (a, b) in enumerate(zip(want, have)) if a != b), n_new)
        res[f"peaked_greedy_{name}"] = {"sequences_equal": equal, "sequences": len(prompts),
                                        "tokens_before_first_difference": tokens_equal,
                                        "tokens": n_new * len(prompts)}
        log(f"  peaked greedy {name}: {equal}/{len(prompts)} sequences equal")
    del peaked, hf, engine

    # (b) at the 0.5B shape: sampled log-probs vs teacher-forced, greedy tokens, fp32 and bf16.
    shape = QUICK if ctx.quick else QWEN2_05B
    hf32 = build_hf(shape, dev)
    prompts, max_new = rl_lengths(16, shape["vocab_size"], rng, ctx.quick)
    max_new = [min(n, 64) for n in max_new]
    max_len = max(len(p) + n for p, n in zip(prompts, max_new))
    ref32_cache: dict[str, list[torch.Tensor]] = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("bf16_fp32_head", torch.bfloat16)):
        engine = build_engine(hf32, 16, max_len, dev, dtype, seed=2)
        if name.endswith("fp32_head"):
            fp32_head(engine)
        outs = list(run_to_end(engine, make_requests(prompts, max_new, 1.0)).values())
        entry = {"vs_hf_fp32": gap(teacher_forced(hf32, outs, dev), outs)}
        if dtype == torch.bfloat16:
            hf16 = build_hf(shape, dev, torch.bfloat16)  # same seed: the same weights, rounded
            entry["vs_hf_bf16"] = gap(teacher_forced(hf16, outs, dev), outs)
            del hf16
        res[f"logprob_gap_{name}"] = entry
        log(f"  log-prob gap {name}: {entry}")
        # Greedy at this shape: random init gives near-flat distributions, so report where the
        # sequences part and HF's top-2 logit margin there (a near-tie means rounding decided).
        if name != "bf16_fp32_head":
            engine = build_engine(hf32, 16, max_len, dev, dtype)
            greedy_prompts = prompts[:4]
            got = run_to_end(engine, make_requests(greedy_prompts, [n_new] * 4, 0.0))
            hf_ref = hf32 if dtype == torch.float32 else build_hf(shape, dev, torch.bfloat16)
            rows = []
            for i, p in enumerate(greedy_prompts):
                want = hf_generate(hf_ref, [p], n_new, True, dev)[0].tolist()
                have = got[f"r{i}"].token_ids
                j = next((j for j, (a, b) in enumerate(zip(want, have)) if a != b), None)
                margin = None
                if j is not None:
                    with torch.no_grad():
                        ids = torch.tensor([p + want[:j]], device=dev)
                        top = hf_ref(input_ids=ids).logits[0, -1].float().topk(2).values
                    margin = float(top[0] - top[1])
                rows.append({"equal": j is None, "first_difference": j, "hf_top2_margin_there": margin})
            res[f"greedy_05b_{name}"] = rows
            log(f"  greedy 0.5B {name}: {rows}")
        del engine
    return res


# -- 2. engine speed ------------------------------------------------------------------------------

def timed(ctx: Ctx, fn: Callable[[], Any]) -> tuple[float, Any]:
    ctx.sync()
    t0 = time.perf_counter()
    out = fn()
    ctx.sync()
    return time.perf_counter() - t0, out


def decode_step_ms(ctx: Ctx, engine: Any, n: int, prompt_len: int, steps: int) -> dict[str, float]:
    """ms per engine.step() and per bare model.decode with `n` sequences running (none ends)."""
    vocab = engine.model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(vocab, (prompt_len,), generator=g).tolist() for _ in range(n)]
    requests = make_requests(prompts, [engine.max_seq_len - prompt_len] * n, 1.0, tag="d")
    for r in requests:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    step_s, _ = timed(ctx, lambda: [engine.step() for _ in range(steps)])
    cache, model = engine._runner.cache, engine.model
    length = int(engine._len[:n].max())
    ids = torch.randint(vocab, (n,), device=ctx.device)
    pos = torch.full((n,), length - 1, device=ctx.device)
    with torch.no_grad():
        model.decode(cache, ids, pos, length)
        fwd_s, _ = timed(ctx, lambda: [model.decode(cache, ids, pos, length) for _ in range(steps)])
    result = {"n": n, "attend_len": length, "step_ms": 1e3 * step_s / steps, "forward_ms": 1e3 * fwd_s / steps}
    if ctx.device.type == "cuda":
        result |= graph_forward_ms(ctx, model, cache, ids, pos, length, steps)
    for r in requests:  # none ended: each is dropped and its slot freed for the next size
        engine.abort(r.request_id)
    return result


def graph_forward_ms(ctx: Ctx, model: Any, cache: Any, ids: torch.Tensor, pos: torch.Tensor, length: int,
                     steps: int) -> dict[str, Any]:
    """The same decode forward captured once in a CUDA graph and replayed (fixed n and length:
    what a padded, graph-captured decode step would cost at best)."""
    try:
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    model.decode(cache, ids, pos, length)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = model.decode(cache, ids, pos, length)
            eager = model.decode(cache, ids, pos, length)
            graph.replay()
            ctx.sync()
            agree = float((static_out.float() - eager.float()).abs().max())
            replay_s, _ = timed(ctx, lambda: [graph.replay() for _ in range(steps)])
        return {"graph_ms": 1e3 * replay_s / steps, "graph_vs_eager_max_diff": agree}
    except Exception as exc:  # noqa: BLE001 - report why capture failed, keep the rest
        return {"graph_error": repr(exc)[:300]}


def check_engine(ctx: Ctx) -> dict[str, Any]:
    dev, res = ctx.device, {}
    shape = QUICK if ctx.quick else QWEN2_05B
    hf = build_hf(shape, dev, torch.bfloat16)
    rng = random.Random(5)
    # Drawn for the default capacities first, then any other asked for: a subset of the
    # defaults runs the same requests as the defaults do.
    workloads = {}
    defaults = QUICK_CAPACITIES if ctx.quick else DEFAULT_CAPACITIES
    for cap in dict.fromkeys((*defaults, *ctx.capacities)):
        workloads[cap] = rl_lengths(4 * cap if cap <= 64 else 2 * cap, shape["vocab_size"], rng, ctx.quick)
    for cap in ctx.capacities:
        prompts, max_new = workloads[cap]
        n_req = len(prompts)
        max_len = max(len(p) + n for p, n in zip(prompts, max_new))
        useful = sum(max_new)
        engine = build_engine(hf, cap, max_len, dev, torch.bfloat16, seed=cap)
        runner = engine._runner  # what its start-up capture cost
        capture = {"graphs": len(getattr(runner, "_graphs", ())), "capture_s": getattr(runner, "capture_s", 0.0),
                   "graph_mib": getattr(runner, "graph_bytes", 0) / 2**20}
        run_to_end(engine, make_requests(prompts[:cap], [8] * cap, 1.0, tag="w"))  # warm-up
        hf_generate(hf, prompts[:cap], 8, False, dev)
        steps0 = engine.stats.decode_steps
        engine_s, outs = timed(ctx, lambda: run_to_end(engine, make_requests(prompts, max_new, 1.0)))
        assert sum(len(o.token_ids) for o in outs.values()) == useful
        decode_steps = engine.stats.decode_steps - steps0
        hf_s, hf_steps = 0.0, 0
        for lo in range(0, n_req, cap) if ctx.hf else ():  # static batches, each to its longest request
            batch_new = max(max_new[lo:lo + cap])
            s, _ = timed(ctx, lambda: hf_generate(hf, prompts[lo:lo + cap], batch_new, False, dev))
            hf_s += s
            hf_steps += batch_new
        entry = {
            "requests": n_req, "useful_tokens": useful, "mean_new": useful / n_req,
            "engine_s": engine_s, "engine_tok_s": useful / engine_s, "engine_decode_steps": decode_steps,
            "engine_ms_per_step": 1e3 * engine_s / decode_steps, **capture,
        }
        if hf_steps:
            entry |= {"hf_s": hf_s, "hf_tok_s": useful / hf_s, "hf_steps": hf_steps,
                      "hf_ms_per_step": 1e3 * hf_s / hf_steps, "speedup": hf_s / engine_s}
        entry["decode"] = decode_step_ms(ctx, engine, cap, 16 if ctx.quick else 128, 5 if ctx.quick else 20)
        # The same requests with the decode step eager (engine.cuda_graphs=false), and greedy
        # completions of both: graphs must change the speed, not the tokens.
        eager = build_engine(hf, cap, max_len, dev, torch.bfloat16, seed=cap, cuda_graphs=False)
        run_to_end(eager, make_requests(prompts[:cap], [8] * cap, 1.0, tag="w"))
        eager_s, _ = timed(ctx, lambda: run_to_end(eager, make_requests(prompts, max_new, 1.0)))
        entry |= {"eager_tok_s": useful / eager_s, "graphs_vs_eager": eager_s / engine_s}
        greedy = [run_to_end(e, make_requests(prompts[:cap], max_new[:cap], 0.0, tag="g"))
                  for e in (engine, eager)]
        entry["greedy_same_tokens"] = sum(greedy[0][k].token_ids == greedy[1][k].token_ids
                                          for k in greedy[0]) / len(greedy[0])
        del eager
        res[f"capacity_{cap}"] = entry
        log(f"  capacity {cap}: {entry}")
        del engine
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return res


def check_profile(ctx: Ctx) -> dict[str, Any]:
    """Where an engine step's time goes at the 0.5B shape (bf16, capacity 64, all running):
    torch.profiler over a few steps, and the cost of the small host<->device copies a step
    makes (pageable vs pinned)."""
    from torch.profiler import ProfilerActivity, profile

    dev, res = ctx.device, {}
    shape = QUICK if ctx.quick else QWEN2_05B
    engine = build_engine(build_hf(shape, dev, torch.bfloat16), 64, 512, dev, torch.bfloat16)
    prompts = [[random.Random(i).randrange(shape["vocab_size"]) for _ in range(128)] for i in range(64)]
    for r in make_requests(prompts, [300] * 64, 1.0, tag="p"):
        engine.add_request(r)
    for _ in range(5):
        engine.step()
    steps = 3 if ctx.quick else 10
    res["step_ms"] = 1e3 * timed(ctx, lambda: [engine.step() for _ in range(steps)])[0] / steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        ctx.sync()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    (ctx.out / "profile.txt").write_text(table)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    res["top_self_cpu"] = {e.key: f"{e.self_cpu_time_total / 1e3 / steps:.2f} ms/step ({e.count // steps}/step)"
                           for e in events[:12]}
    res["profiled_cpu_ms_per_step"] = total / 1e3 / steps
    small = torch.arange(64)
    pinned = small.pin_memory() if dev.type == "cuda" else small
    on_dev = small.to(dev)
    for name, fn in (("h2d_pageable_64", lambda: small.to(dev)), ("h2d_pinned_64", lambda: pinned.to(dev, non_blocking=True)),
                     ("d2h_64", lambda: on_dev.cpu()), ("sync", ctx.sync)):
        res[f"{name}_us"] = 1e6 * timed(ctx, lambda: [fn() for _ in range(200)])[0] / 200
    log(f"  profile: {res}")
    return res


# -- 3. in-flight update pause --------------------------------------------------------------------

def check_pause(ctx: Ctx) -> dict[str, Any]:
    from pipelinerl.roles.trainer import trainer_weights
    from pipelinerl.sync.shm import ShmWeightReceiver, ShmWeightSender

    dev, res = ctx.device, {}
    shape = QUICK if ctx.quick else QWEN2_05B
    trainer = build_hf(shape, dev)  # the trainer holds fp32 weights on the device
    weights = trainer_weights(trainer)
    nbytes = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in weights.values()}.values())
    res["bytes"] = nbytes
    shm_dir = "/dev/shm" if shutil.disk_usage("/dev/shm").free > 2 * nbytes else tempfile.gettempdir()
    res["shm_dir"] = shm_dir
    res["torch_threads"] = torch.get_num_threads()

    # Reference bandwidths: one flat host buffer of the same bytes to the device.
    flat = torch.randn(nbytes // 4)
    dst = torch.empty_like(flat, device=dev)
    for name, src in (("pageable", flat), ("pinned", flat.pin_memory() if dev.type == "cuda" else flat)):
        dst.copy_(src)
        s = statistics.median(timed(ctx, lambda: dst.copy_(src))[0] for _ in range(3))
        res[f"h2d_{name}_ms"] = 1e3 * s
        res[f"h2d_{name}_gb_s"] = nbytes / s / 1e9
    del flat, dst

    vocab = shape["vocab_size"]
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(vocab, (64,), generator=g).tolist() for _ in range(64)]
    sender = ShmWeightSender("gpu-bench", shm_dir)
    receiver = ShmWeightReceiver("gpu-bench", shm_dir)
    version = 0
    try:
        for name, dtype in (("bf16_engine", torch.bfloat16), ("fp32_engine", torch.float32)):
            engine = build_engine(trainer, 64, 512, dev, dtype)
            for r in make_requests(prompts, [400] * 64, 1.0, tag=name):
                engine.add_request(r)
            for _ in range(3):
                engine.step()
            rows: dict[str, list[float]] = {"decode_step_ms": [], "publish_ms": [], "pause_ms": [],
                                            "upload_then_cast_ms": []}
            for _ in range(3):
                rows["decode_step_ms"].append(1e3 * timed(ctx, engine.step)[0])
                version += 1
                rows["publish_ms"].append(1e3 * timed(ctx, lambda: sender.publish(weights, version))[0])
                engine.step()

                def receive() -> None:  # what the actor does between two steps
                    assert receiver.poll() == version
                    engine.receive_weights(receiver.receive_into)

                rows["pause_ms"].append(1e3 * timed(ctx, receive)[0])
                assert engine.version == version
                engine.step()
                rows["upload_then_cast_ms"].append(1e3 * timed(
                    ctx, lambda: engine.receive_weights(lambda targets: upload_then_cast(receiver, targets, version)))[0])
            entry = {k: statistics.median(v) for k, v in rows.items()}
            entry["pause_over_step"] = entry["pause_ms"] / entry["decode_step_ms"]
            entry["pause_gb_s"] = nbytes / (entry["pause_ms"] / 1e3) / 1e9
            res[name] = entry
            log(f"  pause {name}: {entry}")
            del engine
    finally:
        receiver.close()
        sender.close()
    return res


def upload_then_cast(receiver: Any, targets: dict[str, torch.Tensor], version: int) -> int:
    """The alternative receive: each shm tensor goes to the device in its own dtype and is cast
    there (`copy_` across devices with a dtype change casts on the host first)."""
    dests = receiver._layout.bind(targets)
    for view, tensors in zip(receiver._views, dests, strict=True):
        on_device = view.to(tensors[0].device)
        for t in tensors:
            t.copy_(on_device)
    return version


# -- 4. trainer -----------------------------------------------------------------------------------

def make_groups(n_groups: int, group_size: int, vocab: int, rng: random.Random, quick: bool) -> list[Any]:
    from pipelinerl.types import Group, Sample

    groups = []
    flat = -math.log(vocab)  # a random-init model's log-probs are close to uniform
    for gi in range(n_groups):
        prompts, max_new = rl_lengths(group_size, vocab, rng, quick)
        prompt = prompts[0]
        samples = []
        for n in max_new:
            reward = float(rng.random() < 0.5)
            samples.append(Sample(prompt, [rng.randrange(vocab) for _ in range(n)],
                                  [flat + rng.gauss(0, 0.05) for _ in range(n)], [0] * n, reward,
                                  reward > 0, "stop", f"g{gi}"))
        groups.append(Group(f"g{gi}", "", samples))
    return groups


def packing_agrees(model: Any, groups: list[Any], device: torch.device) -> float:
    """max |packed - one sequence per forward| of the trainer's log-probs (fp32): transformers
    must see the packed sequences apart (block-diagonal attention from position_ids)."""
    from pipelinerl.rl.packing import pack, pad
    from pipelinerl.rl.scores import score_tokens

    samples = [s for g in groups for s in g.samples][:8]
    adv = torch.zeros(len(samples))
    with torch.no_grad():
        packed = pack(samples, adv, 1 << 20)
        assert len(packed) == 1
        lp_packed = score_tokens(model, packed[0].to(device)).logprobs
        lp_single = torch.cat([score_tokens(model, b.to(device)).logprobs for b in pad(samples, adv, 1)])
    order = packed[0].seq_idx.argsort(stable=True).to(device)  # pad keeps sample order
    return float((lp_packed[order] - lp_single).abs().max())


def check_trainer(ctx: Ctx) -> dict[str, Any]:
    from pipelinerl.config import Config
    from pipelinerl.rl.attention import use_per_sequence_attention
    from pipelinerl.rl.step import rl_step
    from pipelinerl.roles.trainer import make_optimizer

    dev, res = ctx.device, {}
    shape = QUICK if ctx.quick else QWEN2_05B
    model = build_hf(shape, dev).train().requires_grad_(True)
    params = sum(p.numel() for p in model.parameters())
    res["params"] = params
    rng = random.Random(6)
    group_size, batch = 8, 64
    steps = 2 if ctx.quick else 3
    batches = [make_groups(batch // group_size, group_size, shape["vocab_size"], rng, ctx.quick)
               for _ in range(steps + 1)]
    res["packing_max_diff"] = packing_agrees(model.eval(), batches[0], dev)
    # The trainer's own attention (trainer.packed_attention=per_sequence): on CUDA in bf16,
    # one varlen flash-attention call per layer; packed must equal one sequence at a time.
    use_per_sequence_attention(model)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        res["packing_max_diff_per_sequence_bf16"] = packing_agrees(model, batches[0], dev)
    model.set_attn_implementation("sdpa")
    model.train()
    log(f"  packed vs unpacked log-prob max diff: {res['packing_max_diff']:.2e} (sdpa, fp32), "
        f"{res['packing_max_diff_per_sequence_bf16']:.2e} (per_sequence, bf16)")
    # (name, row tokens, trainer.precision, attention): the precision goes through the config,
    # as the trainer sets it (an autocast around rl_step would be switched off inside it by
    # precision=float32's disabled autocast: the GPU run of 2026-11-28 timed fp32 as "bf16").
    variants = [("fp32", 256, "float32", "sdpa"), ("fp32", 1024, "float32", "sdpa"),
                ("fp32", 4096, "float32", "sdpa"), ("tf32", 4096, "tf32", "sdpa"),
                ("bf16", 4096, "bfloat16", "sdpa"), ("bf16", 4096, "bfloat16", "per_sequence")]
    if dev.type != "cuda":  # TF32 is a tensor-core format
        variants = [v for v in variants if v[2] != "tf32"]
    if ctx.brief:  # the trainer's own settings on CUDA, and the tf32 figure of the last GPU run
        variants = variants[-3::2]
    for name, rows, precision, attention in variants:
        model.set_attn_implementation(attention)
        if attention == "per_sequence":
            name = f"{name} per_sequence"
        cfg = Config.model_validate({"trainer": {"batch_size": batch, "max_tokens_per_row": rows,
                                                 "precision": precision, "device": str(dev)},
                                     "actor": {"group_size": group_size}})
        optimizer = make_optimizer(model, cfg.trainer)  # the trainer's own (fused on CUDA)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        times, tokens, metrics = [], 0, {}
        for i, groups in enumerate(batches):
            s, metrics = timed(ctx, lambda: rl_step(model, optimizer, groups, cfg, trainer_version=0))
            if i:  # the first step warms up allocator and kernels
                times.append(s)
                tokens += metrics["input_tokens"]
        rate = tokens / sum(times)
        entry = {"row_tokens": rows, "step_s": statistics.median(times), "tokens_per_step": tokens / steps,
                 "tokens_per_s": rate, "mfu_vs_989T": 6 * params * rate / H100_BF16_DENSE_FLOPS,
                 "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "ess": metrics.get("ess")}
        if dev.type == "cuda":
            entry["peak_mem_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        res[f"{name} rows {rows}"] = entry
        log(f"  trainer {name} rows {rows}: {entry}")
        del optimizer
    model.set_attn_implementation("sdpa")
    return res


# -- 5. pipeline on one device --------------------------------------------------------------------

def warm_start_on_device(ctx: Ctx, out_dir: Path, steps: int) -> dict[str, Any]:
    """The `small` preset warm-started on the device (the launcher's warm-start runs on CPU)."""
    from pipelinerl.models.hf import save_model
    from pipelinerl.models.tiny import build_char_tokenizer, init_tiny_model
    from pipelinerl.models.warmstart import WarmStartConfig, demo_batches
    from pipelinerl.tasks.arithmetic import ChainArithmeticTask

    task = ChainArithmeticTask()
    cfg = WarmStartConfig(preset="tiny" if ctx.quick else "small")
    tokenizer = build_char_tokenizer(task.alphabet, out_dir)
    model = init_tiny_model(tokenizer, cfg.preset).to(ctx.device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / steps))))
    batches = demo_batches(task, tokenizer, cfg, random.Random("warmstart-0"))
    t0 = time.perf_counter()
    losses = []
    for _ in range(steps):
        ids, labels = next(batches)
        loss = model(input_ids=ids.to(ctx.device), labels=labels.to(ctx.device)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    save_model(model.cpu().eval(), tokenizer, out_dir)
    return {"preset": cfg.preset, "steps": steps, "seconds": time.perf_counter() - t0,
            "loss_first": losses[0], "loss_last": statistics.mean(losses[-20:])}


def summarise_run(run_dir: Path) -> dict[str, Any]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if "eval/version" not in r]  # optimizer steps only
    if len(records) < 3:
        return {"steps": len(records)}
    first, last = records[1], records[-1]  # from the second step: past start-up
    keys = ("success", "success_ema", "reward", "ess", "clip_frac", "mismatch_abs", "mismatch_abs_lag0",
            "lag_mean", "lag_max", "grad_norm", "loss", "completion_len_mean", "trainer_tokens_per_s",
            "trainer_wait_frac", "publish_s", "actor_tokens_per_s", "actor_mean_update_pause_s",
            "actor_idle_frac")
    tail = records[len(records) // 2:]
    finite = all(math.isfinite(v) for r in records for v in r.values() if isinstance(v, float))
    return {
        "steps": last["step"], "time_s": last["time_s"], "samples_trained": last["samples_trained"],
        "samples_per_s": (last["samples_trained"] - first["samples_trained"]) / (last["time_s"] - first["time_s"]),
        "all_finite": finite, "first_success": records[0].get("success"),
        **{f"tail_mean_{k}": statistics.mean(r[k] for r in tail if k in r) for k in keys if any(k in r for r in tail)},
    }


def run_cli(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run `pipelinerl train` in its own process group; past `timeout` the whole group (launcher,
    actor, trainer) is killed, and what the run recorded so far stays on disk."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        err += f"\nkilled after {timeout:.0f} s"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def check_pipeline(ctx: Ctx) -> dict[str, Any]:
    res: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="gpu-pipeline-"))
    model_dir = work / "model"
    res["warm_start"] = warm_start_on_device(ctx, model_dir, 100 if ctx.quick else 800)
    log(f"  warm-start: {res['warm_start']}")
    seconds = 20 if ctx.quick else ctx.pipeline_seconds
    dev = ctx.device.type
    common = [f"model.path={model_dir}", f"engine.device={dev}",
              f"trainer.device={dev}", "stream.backend=local", "sync.backend=shm", "metrics.progress=false",
              "metrics.plot=false", f"trainer.max_time_s={seconds}", "trainer.max_steps=100000",
              "actor.threads=2", "trainer.threads=2", "engine.capacity=128"]
    config = work / "arithmetic.yaml"  # examples/arithmetic.yaml's settings, minus its time budget
    config.write_text("task: {name: arithmetic}\nengine: {backend: torch, max_new_tokens: 96, temperature: 1.0}\n"
                      "actor: {group_size: 8, max_lag: 4}\ntrainer: {batch_size: 64, lr: 2.0e-4}\n")
    runs = {
        "pipeline_bf16": ["mode=pipeline", "engine.dtype=bfloat16"],
        "conventional_g1_bf16": ["mode=conventional", "conventional_g=1", "engine.dtype=bfloat16"],
    }
    train_runs(ctx, "pipeline", res, config, runs, common, work / "runs", lambda: seconds + 240,
               summarise_run)
    shutil.rmtree(work, ignore_errors=True)
    return res


def train_runs(ctx: Ctx, key: str, res: dict[str, Any], config: Path, runs: dict[str, list[str]],
               common: list[str], runs_dir: Path, timeout_s: Callable[[], float],
               summary: Callable[[Path], dict[str, Any]]) -> None:
    """`pipelinerl train config` once per run (name -> its overrides) on this script's source
    tree; each run's `summary` into res and ctx.results[key], saved as it ends."""
    import pipelinerl  # the roles import the same source tree as this script

    src = str(Path(pipelinerl.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    for name, extra in runs.items():
        cmd = [sys.executable, "-m", "pipelinerl.cli", "train", str(config), f"name={name}",
               f"output_dir={runs_dir}", *common, *extra]
        t0 = time.perf_counter()
        proc = run_cli(cmd, env, timeout_s())
        entry: dict[str, Any] = {"rc": proc.returncode, "wall_s": time.perf_counter() - t0,
                                 "overrides": extra}
        run_dir = runs_dir / name
        if (run_dir / "metrics.jsonl").exists():
            entry |= summary(run_dir)
        if proc.returncode:
            entry["stderr_tail"] = proc.stderr[-3000:]
            for f in sorted((run_dir / "logs").glob("*")) if (run_dir / "logs").exists() else []:
                entry[f"log_{f.name}"] = f.read_text()[-2000:]
        res[name] = entry
        log(f"  {name}: {entry}")
        ctx.results[key] = res
        ctx.save()


# -- report ---------------------------------------------------------------------------------------

def fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"
    return str(x)


def render(results: dict[str, Any]) -> str:
    """Flat markdown tables of whatever the checks produced."""
    lines = [f"# GPU checklist results\n\n- {results.get('environment')}\n"]
    for check, value in results.items():
        if check == "environment":
            continue
        lines.append(f"\n## {check}\n")
        if not isinstance(value, dict) or "error" in value:
            lines.append(f"```\n{value.get('error') if isinstance(value, dict) else value}\n```\n")
            continue
        for key, item in value.items():
            if isinstance(item, dict):
                flat = {k: v for k, v in item.items() if not isinstance(v, (dict, list)) and not str(k).startswith("log_")}
                nested = {k: v for k, v in item.items() if isinstance(v, dict)}
                lines.append(f"- **{key}**: " + ", ".join(f"{k} {fmt(v)}" for k, v in flat.items()))
                lines += [f"  - {k}: " + ", ".join(f"{kk} {fmt(vv)}" for kk, vv in v.items()) for k, v in nested.items()]
            else:
                lines.append(f"- **{key}**: {fmt(item)}")
    return "\n".join(lines) + "\n"


# -- 7. the SmolLM2 training step, profiled ---------------------------------------------------

# SmolLM2-135M-Instruct's layout (Llama; random weights: the profile needs no checkpoint).
SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rope_theta=1e5,
               rms_norm_eps=1e-5, max_position_embeddings=2048)
# Names of the profiler's runtime events that launch a kernel or wait for the device.
_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def check_step_profile(ctx: Ctx) -> dict[str, Any]:
    """A 32-sample SmolLM2 step as the trainer takes it (per_sequence attention, fused AdamW,
    trainer.precision=bfloat16 on CUDA): ms a step, and per step the kernels launched, the host waits for the
    device and the device-to-host reads of values (aten::_local_scalar_dense), from
    torch.profiler; the top ops by device time go to $OUT/step_profile.txt. Aim (issue 35): a
    step of 32 samples <= 100 ms on an H100/H200."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipelinerl.config import Config
    from pipelinerl.rl.attention import use_per_sequence_attention
    from pipelinerl.rl.step import rl_step
    from pipelinerl.roles.trainer import make_optimizer

    dev, res = ctx.device, {}
    shape = {**QUICK, "tie_word_embeddings": True} if ctx.quick else SMOLLM2
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(LlamaConfig(**shape)).train()
    use_per_sequence_attention(model)
    precision = "bfloat16" if dev.type == "cuda" else "float32"
    cfg = Config.model_validate({"trainer": {"batch_size": 32, "precision": precision,
                                             "device": str(dev)}, "actor": {"group_size": 8}})
    optimizer = make_optimizer(model, cfg.trainer)
    rng = random.Random(7)
    batches = [make_groups(4, 8, shape["vocab_size"], rng, True) for _ in range(6)]
    res["precision"] = precision

    def step(groups: list[Any]) -> dict[str, Any]:
        return rl_step(model, optimizer, groups, cfg, trainer_version=0)

    step(batches[0])  # warm-up: allocator, kernels, Adam's state
    times, tokens = [], 0
    for groups in batches[1:5]:
        seconds, metrics = timed(ctx, lambda: step(groups))
        times.append(seconds)
        tokens += metrics["input_tokens"]
    res |= {"step_ms": 1e3 * statistics.median(times), "tokens_per_step": tokens / len(times),
            "tokens_per_s": tokens / sum(times)}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step(batches[5])
        ctx.sync()
    events = prof.key_averages()
    count = lambda names: sum(e.count for e in events if e.key in names)  # noqa: E731
    res |= {"kernel_launches": count(_LAUNCHES), "device_waits": count(_WAITS),
            "value_reads": count(("aten::_local_scalar_dense",)),
            "aten_ops": sum(e.count for e in events if e.key.startswith("aten::"))}
    sort = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    (ctx.out / "step_profile.txt").write_text(events.table(sort_by=sort, row_limit=30))
    log(f"  step profile: {res}")
    return res


# -- 9. the 0.5B training step, profiled --------------------------------------------------------

def check_trainer_profile(ctx: Ctx) -> dict[str, Any]:
    """Check 4's 0.5B step (64 samples, rows of 4096 tokens) under `trainer.precision` tf32 with
    sdpa and bfloat16 with per_sequence attention (the trainer's default on CUDA): ms a step,
    kernels launched, host waits and value reads, and the top ops by device time of one
    profiled step to $OUT/trainer_profile_<precision>.txt: where a bf16 step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    from pipelinerl.config import Config
    from pipelinerl.rl.attention import set_packed_attention
    from pipelinerl.rl.step import rl_step
    from pipelinerl.roles.trainer import make_optimizer

    dev, res = ctx.device, {}
    shape = QUICK if ctx.quick else QWEN2_05B
    rng = random.Random(6)
    batches = [make_groups(8, 8, shape["vocab_size"], rng, ctx.quick) for _ in range(3)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    first = "tf32" if dev.type == "cuda" else "float32"  # TF32 is a tensor-core format
    for precision, attention in ((first, "masked_row"), ("bfloat16", "per_sequence")):
        model = build_hf(shape, dev).train().requires_grad_(True)
        cfg = Config.model_validate({"trainer": {"batch_size": 64, "max_tokens_per_row": 4096,
                                                 "precision": precision, "packed_attention": attention,
                                                 "device": str(dev)}, "actor": {"group_size": 8}})
        set_packed_attention(model, cfg.trainer)
        optimizer = make_optimizer(model, cfg.trainer)
        rl_step(model, optimizer, batches[0], cfg, trainer_version=0)  # warm-up, Adam's state
        seconds, metrics = timed(ctx, lambda: rl_step(model, optimizer, batches[1], cfg, trainer_version=0))
        with profile(activities=activities) as prof:
            rl_step(model, optimizer, batches[2], cfg, trainer_version=0)
            ctx.sync()
        events = prof.key_averages()
        count = lambda names: sum(e.count for e in events if e.key in names)  # noqa: E731
        params = sum(p.numel() for p in model.parameters())
        entry = {"step_s": seconds, "tokens": metrics["input_tokens"],
                 "mfu_vs_989T": 6 * params * metrics["input_tokens"] / seconds / H100_BF16_DENSE_FLOPS,
                 "kernel_launches": count(_LAUNCHES), "device_waits": count(_WAITS),
                 "value_reads": count(("aten::_local_scalar_dense",)),
                 "copies": count(("aten::copy_",)), "aten_ops": sum(e.count for e in events if e.key.startswith("aten::"))}
        sort = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        (ctx.out / f"trainer_profile_{precision}.txt").write_text(events.table(sort_by=sort, row_limit=30))
        res[f"{precision} {attention}"] = entry
        log(f"  trainer profile {precision} {attention}: {entry}")
        del model, optimizer
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return res


# -- 10. the training step's options (issue 54 part 1) -----------------------------------------

# (name, trainer overrides): today's bf16 step, then issue 54's options one by one and together.
STEP_OPTIONS = (
    ("autocast", {"precision": "bfloat16"}),
    ("bf16_weights", {"compute_dtype": "bfloat16"}),
    ("bf16_weights+tokens", {"compute_dtype": "bfloat16", "tokens_per_microbatch": 16384}),
    ("bf16_weights+tokens+compile", {"compute_dtype": "bfloat16", "tokens_per_microbatch": 16384,
                                     "compile": True}),
    ("bf16_weights+tokens+liger", {"compute_dtype": "bfloat16", "tokens_per_microbatch": 16384,
                                   "liger": True}),
)


def check_step_options(ctx: Ctx) -> dict[str, Any]:
    """Issue 54 part 1 on the chip: the SmolLM2 step of 32 samples and the 0.5B step of 64
    (rows of 4096 tokens by default) under each of `STEP_OPTIONS`: ms a step (median of 3 after
    a warm-up step that also compiles), kernel launches, host waits and the device's busy time
    of one profiled step, MFU at 0.5B; and, on the warm-up step's weights (the same seed for
    every option), the mean |log-prob - float32's| of its tokens. Aims: SmolLM2 <= 50 ms, 0.5B
    >= 30% MFU. An option that fails (liger-kernel absent, a compile error) records its error."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipelinerl.config import Config
    from pipelinerl.rl.attention import set_packed_attention
    from pipelinerl.rl.fused import use_liger
    from pipelinerl.rl.step import rl_step
    from pipelinerl.roles.trainer import make_optimizer

    dev, res = ctx.device, {}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    shapes = {"smollm2": ({**QUICK, "tie_word_embeddings": True} if ctx.quick else SMOLLM2, 32, "llama"),
              "qwen2_0.5b": (QUICK if ctx.quick else QWEN2_05B, 64, "qwen2")}
    for shape_name, (shape, batch, family) in shapes.items():
        rng = random.Random(10)
        batches = [make_groups(batch // 8, 8, shape["vocab_size"], rng, ctx.quick) for _ in range(5)]
        reference: torch.Tensor | None = None
        for name, options in (("float32", {}),) + STEP_OPTIONS:
            if ctx.seconds_left() < 60:
                res[f"{shape_name} {name}"] = {"error": "not run: the deadline is near"}
                continue
            try:
                torch.manual_seed(0)
                with torch.device(dev):
                    if family == "llama":
                        model = LlamaForCausalLM(LlamaConfig(**shape)).train()
                    else:
                        model = build_hf(shape, dev).train().requires_grad_(True)
                cfg = Config.model_validate({"trainer": {"batch_size": batch, "max_tokens_per_row": 4096,
                                                         "device": str(dev), **options},
                                             "actor": {"group_size": 8}, "metrics": {"samples_per_step": 0}})
                set_packed_attention(model, cfg.trainer)
                if cfg.trainer.liger:
                    use_liger(model, dev)
                optimizer = make_optimizer(model, cfg.trainer)
                t0 = time.perf_counter()
                warm = rl_step(model, optimizer, batches[0], cfg, 0, keep_groups=len(batches[0]))
                first_s = time.perf_counter() - t0
                logprobs = torch.tensor([lp for s in warm["scored"] for lp in s.logprobs])
                times, tokens = [], 0
                for groups in batches[1:4]:
                    seconds, metrics = timed(ctx, lambda: rl_step(model, optimizer, groups, cfg, 0))
                    times.append(seconds)
                    tokens += metrics["input_tokens"]
                with profile(activities=activities) as prof:
                    rl_step(model, optimizer, batches[4], cfg, 0)
                    ctx.sync()
                events = prof.key_averages()
                count = lambda names: sum(e.count for e in events if e.key in names)  # noqa: E731
                params = sum(p.numel() for p in model.parameters())
                entry = {"step_ms": 1e3 * statistics.median(times), "first_step_s": first_s,
                         "tokens_per_step": tokens / len(times),
                         "mfu_vs_989T": 6 * params * tokens / sum(times) / H100_BF16_DENSE_FLOPS,
                         "kernel_launches": count(_LAUNCHES), "device_waits": count(_WAITS),
                         "value_reads": count(("aten::_local_scalar_dense",)),
                         "device_busy_ms": sum(e.self_device_time_total for e in events) / 1e3
                         if dev.type == "cuda" else None}
                if reference is None:
                    reference = logprobs
                elif len(logprobs) == len(reference):
                    entry["logprob_gap_mean"] = float((logprobs - reference).abs().mean())
                    entry["logprob_gap_max"] = float((logprobs - reference).abs().max())
                if dev.type == "cuda":
                    entry["peak_mem_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
                    torch.cuda.reset_peak_memory_stats(dev)
                res[f"{shape_name} {name}"] = entry
                log(f"  step options {shape_name} {name}: {entry}")
            except Exception:  # noqa: BLE001 - one option failing must not stop the others
                res[f"{shape_name} {name}"] = {"error": traceback.format_exc()[-1500:]}
                log(f"  step options {shape_name} {name} FAILED: {res[f'{shape_name} {name}']['error'][-300:]}")
            finally:
                model = optimizer = None
                torch._dynamo.reset()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    return res


# -- 8. SmolLM2 learning: pipeline vs conventional G=2 ---------------------------------------

SMOLLM2_OVERHEAD_S = 60
SMOLLM2_RUNS = {"pipeline": ["mode=pipeline"], "conventional_g2": ["mode=conventional", "conventional_g=2"]}


def held_out_curve(run_dir: Path) -> list[tuple[float, float]]:
    """(seconds, held-out pass@1 at T=1) of each evaluation pass of a run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["time_s"], r["eval/sampled/pass@1"]) for r in rows if "eval/sampled/pass@1" in r]


def first_time_at(curve: list[tuple[float, float]], level: float) -> float | None:
    return next((t for t, v in curve if v >= level), None)


def check_smollm2(ctx: Ctx) -> dict[str, Any]:
    """examples/smollm2.yaml on the device (bf16 engine and trainer, capacity 128, two threads a role,
    held-out pass of 200 problems every 30 s), the pipeline and conventional RL G=2 for
    `--smollm2-seconds` of training each: the held-out curve and the time to 0.9. The model is
    the GGUF at `--gguf` (carried as benchmarks/gpu_session.sh does). Aim (issue 35): the
    pipeline reaches 0.9 in <= 30 s."""
    res: dict[str, Any] = {}
    if not ctx.gguf.is_file():
        raise FileNotFoundError(f"{ctx.gguf}: SmolLM2's GGUF, carried as benchmarks/gpu_session.sh says")
    wanted = 20 if ctx.quick else ctx.smollm2_seconds
    # Each run also starts, converts the GGUF (first run) and evaluates at the end: ~60 s.
    seconds = int(min(wanted, (ctx.seconds_left() - 2 * SMOLLM2_OVERHEAD_S) / 2))
    if seconds < min(wanted, 30):
        raise TimeoutError(f"{ctx.seconds_left():.0f} s left before the deadline: too few for two runs")
    res["seconds_each"] = seconds
    dev = ctx.device.type
    work = Path(tempfile.mkdtemp(prefix="gpu-smollm2-"))
    example = Path(__file__).resolve().parents[1] / "examples" / "smollm2.yaml"
    common = [f"model.path={ctx.gguf}", f"engine.device={dev}", f"trainer.device={dev}",
              *(["engine.dtype=bfloat16", "trainer.precision=bfloat16"] if dev == "cuda" else []),
              "engine.capacity=128", "actor.threads=2", "trainer.threads=2",
              f"trainer.max_time_s={seconds}", "metrics.progress=false", "metrics.plot=false",
              *(["eval.num_problems=20", "eval.every_s=10"] if ctx.quick else ["eval.every_s=30"])]

    def summary(run_dir: Path) -> dict[str, Any]:
        curve = held_out_curve(run_dir)
        return summarise_run(run_dir) | {"held_out": ", ".join(f"{v:.3f}@{t:.0f}s" for t, v in curve),
                                         "seconds_to_0.9": first_time_at(curve, 0.9)}

    train_runs(ctx, "smollm2", res, example, SMOLLM2_RUNS, common, work,
               lambda: min(seconds + 240, max(ctx.seconds_left(), 1)), summary)
    shutil.rmtree(work, ignore_errors=True)
    return res


CHECKS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "1": check_correctness, "2": check_engine, "3": check_pause, "4": check_trainer, "5": check_pipeline,
    "6": check_profile, "7": check_step_profile, "8": check_smollm2, "9": check_trainer_profile,
    "10": check_step_options,
}
NAMES = {"1": "correctness", "2": "engine", "3": "pause", "4": "trainer", "5": "pipeline",
         "6": "engine_profile", "7": "step_profile", "8": "smollm2", "9": "trainer_profile",
         "10": "step_options"}


PLANS: dict[str, dict[str, Any]] = {
    "issue35": {"doc": "what issue 35 measures, in one call of at most 9 minutes: checks 7,2,4,8, "
                       "capacities 64,256 without HF, two trainer settings, all ended by 510 s",
                "args": {"checks": "7,2,4,8", "capacities": "64,256", "no_hf": True, "deadline_s": 510}},
    "issue54": {"doc": "issue 54 part 1, in one call of at most 9 minutes: check 10 (the training "
                       "step's options at the SmolLM2 and 0.5B shapes), then check 7 to compare with "
                       "issue 35's profile, all ended by 510 s",
                "args": {"checks": "10,7", "deadline_s": 510}},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and short runs (smoke test)")
    parser.add_argument("--checks", default="1,2,3,4,5", help="comma-separated check numbers")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-out")))
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (the actor's default is 1)")
    parser.add_argument("--capacities", default="",
                        help="engine capacities of check 2 (default 64,128,256; --quick 8,16)")
    parser.add_argument("--no-hf", action="store_true", help="check 2 without the HF generate baseline")
    parser.add_argument("--pipeline-seconds", type=int, default=75, help="trainer.max_time_s of each run")
    parser.add_argument("--gguf", type=Path, default=Path("/tmp/smol.gguf"), help="check 8's SmolLM2 GGUF")
    parser.add_argument("--smollm2-seconds", type=int, default=150, help="check 8: trainer.max_time_s of each run")
    parser.add_argument("--deadline-s", type=float, default=0,
                        help="seconds from start by which every check ends (check 8 shortens its runs to fit)")
    parser.add_argument("--plan", choices=sorted(PLANS), help="a preset of the above: " + "; ".join(
        f"{k}: {v['doc']}" for k, v in PLANS.items()))
    args = parser.parse_args()
    for key, value in PLANS[args.plan]["args"].items() if args.plan else ():
        setattr(args, key, value)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    import transformers

    env = (f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; torch "
           f"{torch.__version__}; transformers {transformers.__version__}; python {sys.version.split()[0]}; "
           f"{os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M')}")
    ctx = Ctx(device, args.quick, args.out, {"environment": env}, args.pipeline_seconds,
              tuple(int(c) for c in args.capacities.split(",")) if args.capacities
              else QUICK_CAPACITIES if args.quick else DEFAULT_CAPACITIES, not args.no_hf,
              brief=bool(args.plan), gguf=args.gguf, smollm2_seconds=args.smollm2_seconds,
              deadline=time.perf_counter() + args.deadline_s if args.deadline_s else None)
    log(env)
    for number in args.checks.split(","):
        name = NAMES[number]
        if ctx.seconds_left() <= 0:
            ctx.results[name] = {"error": "not run: the deadline had passed"}
            continue
        log(f"check {number}: {name}")
        t0 = time.perf_counter()
        try:
            ctx.results[name] = CHECKS[number](ctx)
        except Exception:  # noqa: BLE001 - one failed check must not stop the others
            ctx.results[name] = {"error": traceback.format_exc()[-4000:]}
            log(f"check {number} FAILED:\n{ctx.results[name]['error']}")
        ctx.results[name]["seconds"] = time.perf_counter() - t0
        ctx.save()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(render(ctx.results))


if __name__ == "__main__":
    main()
