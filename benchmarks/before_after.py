"""SmolLM2-135M-Instruct on one CPU core, this source tree against an earlier commit's: the torch
engine's decode tokens/s and the trainer's step tokens/s, measured alternately in one run so
the machine's speed of the day cancels out (a figure in RESULTS.md from another day does not:
the same commit can run 2x slower on another host).

Engine: `make_engine` (fp32, capacity 32) on 32 chat-templated prompts of the numbers task
(~45 tokens) in groups of 8, 32 new tokens each (no stop): tokens / wall seconds. Trainer: one
`rl_step` of 32 samples (those prompts, completions of 8-32 random tokens) with the trainer's
own optimizer and attention, float32: input tokens / wall seconds, median of 3 steps after one
warm-up. Each measurement is a fresh process with PYTHONPATH at the tree's src/; the trees
alternate, `--reps` times; the medians and their ratio (this tree / base) go to RESULTS.md.

    python benchmarks/before_after.py --base 7d10d67          # ~5 minutes, RESULTS.md section
    python benchmarks/before_after.py --base HEAD --quick --out /tmp/ba   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _results import environment, load_average, results_file, table, write_section

REPO = Path(__file__).resolve().parents[1]

# Runs in the measured tree's interpreter: only APIs both trees have.
MEASURE = r'''
import json, random, sys, time
import torch
torch.set_num_threads(1)
from pipelinerl.config import load_config
from pipelinerl.engine import make_engine
from pipelinerl.models.hf import encode_prompt, load_model, load_tokenizer
from pipelinerl.models.sources import KNOWN_MODELS, prepared_dir
from pipelinerl.rl.attention import set_packed_attention
from pipelinerl.rl.step import rl_step
from pipelinerl.tasks.numbers import NumbersTask
from pipelinerl.types import GenerationRequest, Group, Sample, SamplingParams

what, quick = sys.argv[1], sys.argv[2] == "1"
path = str(prepared_dir(KNOWN_MODELS[0]))
tokenizer = load_tokenizer(path)
rng = random.Random(0)
task = NumbersTask()
n_prompts, new = (8, 8) if quick else (32, 32)
prompts = []
for _ in range(n_prompts // 8):
    text = tokenizer.apply_chat_template([{"role": "user", "content": task.sample_problem(rng).prompt}],
                                         tokenize=False, add_generation_prompt=True)
    prompts += [encode_prompt(tokenizer, text)] * 8
cfg = load_config(overrides=[f"model.path={path}", "engine.capacity=32", "engine.max_seq_len=128",
                             "trainer.batch_size=32", "actor.group_size=8"])
if what == "engine":
    engine = make_engine(cfg.engine, path)
    params = SamplingParams(max_new_tokens=new, temperature=1.0)
    def run(tag):
        for i, p in enumerate(prompts):
            engine.add_request(GenerationRequest(f"{tag}{i}", list(p), params))
        done = 0
        while engine.num_active():
            done += sum(len(o.token_ids) for o in engine.step())
        return done
    run("w")
    t0 = time.perf_counter()
    tokens = run("t")
    print(json.dumps(tokens / (time.perf_counter() - t0)))
else:
    model = load_model(path).train()
    set_packed_attention(model, cfg.trainer)
    try:
        from pipelinerl.roles.trainer import make_optimizer  # the trainer's own, where the tree has it
        optimizer = make_optimizer(model, cfg.trainer)
    except ImportError:  # what the trainer built before make_optimizer
        tc = cfg.trainer
        optimizer = torch.optim.AdamW(model.parameters(), lr=tc.lr, betas=tc.betas,
                                      weight_decay=tc.weight_decay)
    def groups():
        out = []
        for g in range(4):
            samples = []
            for i in range(8):
                n = rng.randint(8, 32)
                samples.append(Sample(prompt_ids=list(prompts[(8 * g) % len(prompts)]),
                                      token_ids=[rng.randrange(49152) for _ in range(n)],
                                      logprobs=[-5.0] * n, versions=[0] * n, reward=float(i % 2),
                                      success=bool(i % 2), finish_reason="stop", group_id=f"g{g}",
                                      actor_id=0))
            out.append(Group(f"g{g}", "p", samples, actor_id=0))
        return out
    rl_step(model, optimizer, groups(), cfg, 0)
    rates = []
    for _ in range(1 if quick else 3):
        gs = groups()
        t0 = time.perf_counter()
        m = rl_step(model, optimizer, gs, cfg, 0)
        rates.append(m["input_tokens"] / (time.perf_counter() - t0))
    print(json.dumps(sorted(rates)[len(rates) // 2]))
'''


def worktree(commit: str) -> Path:
    """A checkout of `commit` in a temporary directory."""
    path = Path(tempfile.mkdtemp(prefix="before-after-")) / "tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(path), commit],
                   check=True, capture_output=True)
    return path


def measure(tree: Path, what: str, quick: bool) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", MEASURE, what, "1" if quick else "0"], env=env,
                         capture_output=True, text=True, check=True, cwd=tree)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the earlier commit")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="smoke: a few tokens, into --out only")
    p.add_argument("--out", type=Path, help="a directory: write the section to its RESULTS.md")
    args = p.parse_args()
    if args.quick and args.out is None:
        p.error("--quick writes only into --out")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          check=True, capture_output=True, text=True).stdout.strip()
    load = load_average()
    base = worktree(args.base)
    trees = {"base": base, "this": REPO}
    rates: dict[tuple[str, str], list[float]] = {}
    reps = 1 if args.quick else args.reps
    try:
        for _ in range(reps):
            for what in ("engine", "trainer"):
                for name, tree in trees.items():
                    rates.setdefault((what, name), []).append(measure(tree, what, args.quick))
                    print(what, name, f"{rates[what, name][-1]:.1f} tokens/s", flush=True)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)],
                       check=False, capture_output=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    rows = [[what, f"{med[what, 'base']:.1f}", f"{med[what, 'this']:.1f}",
             f"{med[what, 'this'] / med[what, 'base']:.2f}x",
             ", ".join(f"{x:.1f}" for x in rates[what, "this"])] for what in ("engine", "trainer")]
    text = "\n".join([
        "## Before and after: SmolLM2 on one core, this tree against an earlier commit "
        "(`benchmarks/before_after.py`)",
        "",
        environment(load).rstrip("\n"),
        f"- trees: base `{args.base}`, this `{head}` plus the working tree; "
        f"{reps} alternating repetition(s), median",
        "",
        table(["", "base tokens/s", "this tokens/s", "this / base", "this, each repetition"],
              rows),
        "Engine: decode tokens/s, fp32, capacity 32, 32 prompts in groups of 8, 32 new tokens "
        "each. Trainer: input tokens/s of one 32-sample `rl_step` (float32, the trainer's own "
        "optimizer and attention).",
    ])
    print(text)
    write_section("before_after", text, results_file(args.out))


if __name__ == "__main__":
    main()
