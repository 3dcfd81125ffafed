"""Trainer step with sequence packing vs a padded plain PyTorch/HF loop, same samples, same loss.

Target (issue): the trainer with packing trains >= 1.5x the useful tokens/s of a padded loop.

Samples are RL-shaped: arithmetic prompts, completions = the task's noisy worked
demonstrations + EOS (lengths 13-61 with a thin tail), groups of 8 attempts per prompt,
advantages = reward - group mean, behaviour log-probs = the initial model's + noise (so the
importance weights are not all 1), batch 64 sequences per optimizer step.

- packed: `pack()` (first-fit decreasing into rows of `max_tokens_per_row` tokens) +
  `score_tokens` + `reinforce_tis_loss`, backward per row, grad clip, AdamW: what
  `pipelinerl.rl.step.rl_step` does, minus its metrics.
- padded: one right-padded batch of 64 rows with attention_mask, full logits, log_softmax,
  gather, the same REINFORCE-TIS loss written out, backward, grad clip, AdamW.
- packed N per-seq: the packed path with `trainer.packed_attention=per_sequence` (one causal
  SDPA per packed sequence instead of the whole row under a block-diagonal mask).

Both paths start from copies of the same model and take the same batches, step by step
interleaved; the losses are checked equal on the same weights before timing. Useful tokens =
real input tokens (prompt + completion - 1 per sequence); padding does not count.

Run: `python benchmarks/trainer.py` (writes the `trainer` section of RESULTS.md) or `--quick`.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool

import argparse
import copy
import random
import statistics
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import _results
import torch

GROUP_SIZE = 8
IS_CLIP = 5.0
GRAD_CLIP = 1.0


def make_batches(tokenizer: Any, model: Any, n_batches: int, batch_size: int,
                 seed: int = 0) -> list[tuple[list[Any], torch.Tensor]]:
    """`n_batches` lists of samples with their advantages."""
    from pipelinerl.models.hf import encode_prompt
    from pipelinerl.rl.advantages import group_advantages
    from pipelinerl.tasks.arithmetic import ChainArithmeticTask
    from pipelinerl.types import Sample

    task, rng = ChainArithmeticTask(), random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    eos = tokenizer.eos_token_id
    batches = []
    for _ in range(n_batches):
        samples, advantages = [], []
        for _ in range(batch_size // GROUP_SIZE):
            problem = task.sample_problem(rng)
            prompt = encode_prompt(tokenizer, problem.prompt)
            group = []
            for _ in range(GROUP_SIZE):
                text = task.demonstration(problem, rng, step_error_prob=0.3)
                tokens = tokenizer.encode(text, add_special_tokens=False) + [eos]
                reward = task.score(problem, text).reward
                group.append(Sample(prompt, tokens, [0.0] * len(tokens), [0] * len(tokens), reward,
                                    reward > 0, "stop"))
            samples += group
            advantages.append(group_advantages([s.reward for s in group]))
        with torch.no_grad():
            grid = padded_token_logprobs(model, samples)[0]
        for i, s in enumerate(samples):
            first, n = len(s.prompt_ids) - 1, len(s.token_ids)
            s.logprobs = (grid[i, first:first + n] + 0.05 * torch.randn(n, generator=gen)).tolist()
        batches.append((samples, torch.cat(advantages)))
    return batches


def padded_token_logprobs(model: Any, samples: list[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plain way: right-padded grid with attention_mask, full logits, log_softmax, gather.
    Returns the next-token log-prob grid, the completion-token mask and the behaviour log-probs
    on the same grid."""
    seqs = [s.prompt_ids + s.token_ids for s in samples]
    shape = (len(seqs), max(map(len, seqs)) - 1)
    ids, attn = torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long)
    targets, trained = torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.bool)
    old = torch.zeros(shape)
    for i, (s, seq) in enumerate(zip(samples, seqs)):
        n, first = len(seq) - 1, len(s.prompt_ids) - 1
        ids[i, :n] = torch.tensor(seq[:-1])
        attn[i, :n] = 1
        targets[i, :n] = torch.tensor(seq[1:])
        trained[i, first:n] = True
        old[i, first:n] = torch.tensor(s.logprobs)
    # use_cache=False: a plain loop that forgets it also pays for building a KV cache.
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
    new = logits.float().log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    return new, trained, old


def padded_loss(model: Any, samples: list[Any], advantages: torch.Tensor) -> float:
    """Forward + backward of the padded loop; the REINFORCE-TIS loss written out on the grid."""
    new, trained, old = padded_token_logprobs(model, samples)
    rho = torch.exp(new.detach() - old).clamp(max=IS_CLIP)
    per_token = rho * advantages[:, None] * new
    loss = -torch.where(trained, per_token, torch.zeros_like(per_token)).sum() / len(samples)
    loss.backward()
    return loss.item()


def packed_loss(model: Any, samples: list[Any], advantages: torch.Tensor, row_tokens: int) -> float:
    """Forward + backward through the project's path: pack, score_tokens, reinforce_tis_loss."""
    from pipelinerl.rl.losses import reinforce_tis_loss
    from pipelinerl.rl.packing import pack
    from pipelinerl.rl.scores import score_tokens

    total = 0.0
    for batch in pack(samples, advantages, row_tokens):
        new = score_tokens(model, batch).logprobs
        loss = reinforce_tis_loss(new, batch.old_logprobs, batch.advantages,
                                  normalizer=len(samples), clip_c=IS_CLIP)
        loss.backward()
        total += loss.item()
    return total


def optimizer_step(model: Any, optimizer: torch.optim.Optimizer,
                   loss_fn: Callable[[], float]) -> tuple[float, float]:
    """One optimizer step; returns (loss, grad norm)."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
    optimizer.step()
    return loss, float(grad_norm)


def useful_tokens(samples: list[Any]) -> int:
    return sum(len(s.prompt_ids) + len(s.token_ids) - 1 for s in samples)


def profile_shares(fn: Callable[[], object]) -> tuple[float, dict[str, float]]:
    """CPU ms of one call of `fn` under torch.profiler, and the shares of attention (SDPA,
    forward and backward), matmuls and everything else in its self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        timer = _results.Timer()
        fn()
        cpu = timer.elapsed()[1]
    shares = {"attention": 0.0, "matmul": 0.0, "other": 0.0}
    total = 0.0
    for e in prof.key_averages():
        name = e.key.removeprefix("aten::")
        kind = ("attention" if "scaled_dot_product" in name else
                "matmul" if name in ("mm", "addmm", "bmm") else "other")
        shares[kind] += e.self_cpu_time_total
        total += e.self_cpu_time_total
    return 1e3 * cpu, {k: v / total for k, v in shares.items()}


def bench_preset(preset: str, tokenizer: Any, n_steps: int, batch_size: int,
                 row_sizes: list[int], profile: bool) -> dict[str, Any]:
    from pipelinerl.models.tiny import init_tiny_model
    from pipelinerl.rl.attention import use_per_sequence_attention
    from pipelinerl.rl.packing import pack

    base = init_tiny_model(tokenizer, preset).train()
    batches = make_batches(tokenizer, base, n_steps + 1, batch_size)
    methods: dict[str, Callable[[Any, list[Any], torch.Tensor], float]] = {"padded": padded_loss}
    for n in row_sizes:
        methods[f"packed {n}"] = partial(packed_loss, row_tokens=n)
        methods[f"packed {n} per-seq"] = partial(packed_loss, row_tokens=n)

    def model_for(name: str) -> Any:
        model = copy.deepcopy(base)
        if name.endswith("per-seq"):
            use_per_sequence_attention(model)
        return model

    # Sanity: on the same weights every path computes the same loss and gradient.
    samples, adv = batches[0]
    check = {}
    for name, fn in methods.items():
        model = model_for(name)
        loss = fn(model, samples, adv)
        check[name] = (loss, float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
    ref_loss, ref_norm = check["padded"]
    for name, (loss, norm) in check.items():
        if abs(loss - ref_loss) > 1e-4 * max(1.0, abs(ref_loss)) or abs(norm - ref_norm) > 1e-3 * ref_norm:
            raise RuntimeError(f"{name} disagrees with padded: loss {loss} vs {ref_loss}, "
                               f"grad norm {norm} vs {ref_norm}")

    models = {name: model_for(name) for name in methods}
    optims = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    seconds: dict[str, list[tuple[float, float]]] = {name: [] for name in methods}
    losses: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for step, (samples, adv) in enumerate(batches):
        # Rotate the order each step so no path always runs right after another.
        for name in names[step % len(names):] + names[:step % len(names)]:
            timer = _results.Timer()
            loss, _ = optimizer_step(models[name], optims[name],
                                     partial(methods[name], models[name], samples, adv))
            if step:  # step 0 warms up allocators and caches
                seconds[name].append(timer.elapsed())
                losses[name].append(loss)
    timed = batches[1:]
    tokens = [useful_tokens(s) for s, _ in timed]
    cells_padded = sum(len(s) * (max(len(x.prompt_ids) + len(x.token_ids) for x in s) - 1) for s, _ in timed)
    samples, adv = timed[-1]
    profiles = {}
    for name, fn in methods.items() if profile else ():
        profiles[name] = profile_shares(partial(fn, model_for(name), samples, adv))
    med = statistics.median
    return {
        "params": sum(p.numel() for p in base.parameters()),
        "completion_lengths": sorted(len(x.token_ids) for s, _ in timed for x in s),
        # per clock (0 wall, 1 CPU)
        "rate": {name: [sum(tokens) / sum(t[c] for t in v) for c in (0, 1)] for name, v in seconds.items()},
        "ratio": {name: [med(p[c] / t[c] for p, t in zip(seconds["padded"], v)) for c in (0, 1)]
                  for name, v in seconds.items() if name != "padded"},
        "check": check,
        "loss_drift": max(abs(a - b) for name in names for a, b in zip(losses[name], losses["padded"])),
        "padding": 1 - sum(tokens) / cells_padded,
        "rows": {n: statistics.mean(len(pack(s, a, n)) for s, a in timed) for n in row_sizes},
        "profiles": profiles,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds; no RESULTS.md")
    parser.add_argument("--out", type=Path, help="write the section to this file instead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from pipelinerl.models.tiny import build_char_tokenizer
    from pipelinerl.tasks.arithmetic import ALPHABET

    load = _results.load_average()
    if args.quick:
        presets, n_steps, batch_size = ["tiny"], 1, 16
    else:
        presets, n_steps, batch_size = ["tiny", "small"], 4, 64
    row_sizes = [1024, 256]  # 1024: the trainer's default max_tokens_per_row
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        tokenizer = build_char_tokenizer(ALPHABET, Path(tmp) / "tokenizer")
        results = {}
        for preset in presets:
            results[preset] = bench_preset(preset, tokenizer, n_steps, batch_size, row_sizes,
                                           profile=not args.quick)
            print(f"{preset}: {results[preset]}", file=sys.stderr)
    section = render(load, n_steps, batch_size, row_sizes, results)
    print(section)
    if args.out:
        _results.write_section("trainer", section, args.out)
    elif not args.quick:
        _results.write_section("trainer", section)


def render(load: tuple[float, float, float], n_steps: int, batch_size: int, row_sizes: list[int],
           results: dict[str, Any]) -> str:
    head = ["model", "params", "path", "tok/s", "vs padded (target >= 1.5x)", "by CPU time"]
    rows, checks, profile, bounds = [], [], [], []
    for preset, r in results.items():
        params = f"{r['params'] / 1e6:.2f}M"
        rows.append([preset, params, "padded", f"{r['rate']['padded'][0]:.0f}", "1.00x", "1.00x"])
        for name, (wall, cpu) in r["ratio"].items():
            rows.append([preset, params, name, f"{r['rate'][name][0]:.0f}",
                         f"**{wall:.2f}x** ({'met' if wall >= 1.5 else 'missed'})", f"{cpu:.2f}x"])
        loss, norm = r["check"]["padded"]
        checks.append([preset, f"{loss:.6f}", f"{norm:.5f}",
                       ", ".join(f"{name}: {l:.6f} / {g:.5f}" for name, (l, g) in r["check"].items()
                                 if name != "padded"),
                       f"{r['loss_drift']:.1e}", f"{r['padding']:.0%}",
                       ", ".join(f"{n}: {r['rows'][n]:.1f}" for n in row_sizes)])
        for name, (ms, shares) in r["profiles"].items():
            profile.append([preset, name, f"{ms:.0f}", *(f"{shares[k]:.0%}" for k in ("attention", "matmul", "other"))])
        if max(v[0] for v in r["ratio"].values()) < 1.5:
            bounds.append(f"- {preset}: best " + max(
                (f"{v[0]:.2f}x ({k})" for k, v in r["ratio"].items()), key=lambda t: float(t.split("x")[0]))
                + f"; removing all the padding is worth at most "
                f"{1 / (1 - r['padding']):.2f}x of per-token work.")
    lengths = next(iter(results.values()))["completion_lengths"]
    return (
        "## Trainer: packing vs a padded loop (`benchmarks/trainer.py`)\n\n"
        + _results.environment(load)
        + f"\nSamples: arithmetic prompts with noisy worked demonstrations + EOS as completions "
        f"({lengths[0]}-{lengths[-1]} tokens, median {lengths[len(lengths) // 2]}), groups of "
        f"{GROUP_SIZE}, batch {batch_size} sequences per optimizer step, {n_steps} timed steps "
        "after 1 warm-up, each path on its own copy of the same model (fp32, HF Qwen2), steps "
        "interleaved across paths. Step = forward + backward + grad clip + AdamW, input building "
        "included. tok/s = useful (non-padding) input tokens / wall time; vs padded = median over "
        "steps of padded time / the path's time (wall; \"by CPU time\": from process CPU time, "
        "which waits for a core on a loaded machine do not inflate). Packed N = "
        "`pack(max_tokens_per_row=N)` + `score_tokens` + `reinforce_tis_loss`, attended as one "
        "masked row (transformers' sdpa, block-diagonal mask: `trainer.packed_attention="
        "masked_row`) or per sequence (`per_sequence`, one causal SDPA per packed sequence).\n\n"
        + _results.table(head, rows)
        + "\nSanity (before timing, same weights, one backward each): REINFORCE-TIS loss and "
        "gradient norm; loss drift = the largest difference between a packed path's and the "
        "padded path's loss at the same step while training (fp32 rounding only). Padding in the "
        "padded grid bounds what packing can save on per-token work.\n\n"
        + _results.table(["model", "padded loss", "padded grad norm", "packed loss / grad norm",
                          "loss drift", "padding in padded grid", "packed rows per step"], checks)
        + ("\nProfile (torch.profiler, forward + backward of one batch per path): CPU ms and the "
           "shares of self CPU time in attention (SDPA forward and backward), matmuls and the "
           "rest. A masked row is attended whole by the CPU SDPA kernel: its attention work "
           "grows with the square of the row length; per sequence it grows with the squares of "
           "the sequences' lengths.\n\n"
           + _results.table(["model", "path", "CPU ms", "attention", "matmul", "other"], profile)
           if profile else "")
        + ("\nWhat bounds it where the target is missed: packing removes only the padding (the "
           "grid's padding share above), and pays for it with more, smaller matmuls per step "
           "(one forward and backward per row) and, for masked rows, attention over whole rows.\n"
           + "\n".join(bounds) + "\n" if bounds else "")
    )


if __name__ == "__main__":
    main()
