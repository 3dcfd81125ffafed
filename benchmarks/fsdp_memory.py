"""Peak host memory per FSDP2 trainer rank while the model loads, the old way and the new.

before: every rank loads the whole model in float32 (`load_model(path, device="cpu")`), then
        shards it (`wrap_model`): what `run_trainer` did.
after:  every rank builds the model on the meta device (`load_model(path, device="meta")`),
        shards it, then receives its shards from rank 0 (`parallel.load_shards`), which reads
        the checkpoint a chunk at a time (by default the checkpoint's size over the ranks, at
        most 1 GiB; `--chunk-mb` adds other sizes).

Each (model, way) runs in fresh processes: `world` gloo ranks on the CPU (2 by default). Per
rank: RSS after imports, the process group and the same load of the `tiny` preset (the
baseline, then the peak is reset through /proc/self/clear_refs), the peak RSS (VmHWM) during
the load, what is held after it, and the load's time. Then each rank walks one publish
(`GatheredWeights`, every tensor gathered and dropped) in float32 (before) and in bf16 (after,
with engine.dtype=bfloat16): the bytes one update sends.

Models: the `small` preset (`model.preset=small`, ~10M parameters, saved in float32 as the
warm-start saves it) and a wider Qwen2 (~165M, saved in bf16 as released checkpoints are), so
the difference stands out of the ~0.5 GB that torch and transformers take before any model.

Run: `python benchmarks/fsdp_memory.py` (prints the table; RESULTS.md is written by hand), or
`--quick` (the small preset only).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool; inherited

import argparse
import gc
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import torch

MB = 1 << 20


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def _load(path: str, way: str, tc, world: int, chunk_bytes: int | None) -> torch.nn.Module:
    from pipelinerl.models.hf import load_model
    from pipelinerl.rl.parallel import load_shards, wrap_model

    if way == "before":
        return wrap_model(load_model(path, device="cpu").train(), tc, "cpu", world)
    model = wrap_model(load_model(path, device="meta").train(), tc, "cpu", world)
    return load_shards(model, path, tc.fsdp, "cpu", chunk_bytes=chunk_bytes)


def _rank(rank: int, world: int, init: str, path: str, warmup: str, way: str,
          chunk_bytes: int | None, q: mp.Queue) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    from pipelinerl.config import load_config
    from pipelinerl.rl.parallel import GatheredWeights

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        tc = load_config(overrides=["trainer.strategy=fsdp2"]).trainer
        # The same way on a tiny model of the same class first: the baseline then includes
        # every module the load imports and the allocator's warm arenas, not only the model.
        warm = _load(warmup, way, tc, world, chunk_bytes)
        for _ in GatheredWeights(warm, dtype=torch.bfloat16).tensors():
            pass
        del warm
        gc.collect()
        dist.barrier()
        base = _status("VmRSS")
        _reset_peak()
        t0 = time.perf_counter()
        model = _load(path, way, tc, world, chunk_bytes)
        gc.collect()
        load_s = time.perf_counter() - t0
        peak, loaded = _status("VmHWM"), _status("VmRSS")
        publish = {name: sum(t.nbytes for t in GatheredWeights(model, dtype=dtype).tensors())
                   for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
        params = sum(p.numel() for p in model.parameters())
        q.put((rank, dict(base=base, peak=peak, loaded=loaded, load_s=load_s,
                          publish=publish, params=params)))
    finally:
        dist.destroy_process_group()


def measure(path: str, warmup: str, way: str, world: int, chunk_bytes: int | None
            ) -> list[dict]:
    from pipelinerl.proc.ports import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, world, init, path, warmup, way, chunk_bytes, q))
             for r in range(world)]
    for p in procs:
        p.start()
    results = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
        assert p.exitcode == 0, f"a rank of {way} on {path} failed"
    return [results[r] for r in range(world)]


def build_models(root: Path, quick: bool) -> dict[str, tuple[str, str]]:
    """name -> (directory, checkpoint dtype)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pipelinerl.models.tiny import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer("0123456789+-*/=() abcdefghijklmnopqrstuvwxyz\n",
                                     root / "tokenizer")
    models = {"tiny preset": (str(build_tiny_model(root / "tiny", tokenizer, "tiny")), "float32"),
              "small preset": (str(build_tiny_model(root / "small", tokenizer, "small")),
                               "float32")}
    if not quick:
        config = Qwen2Config(vocab_size=32000, hidden_size=1024, num_hidden_layers=12,
                             num_attention_heads=16, num_key_value_heads=2,
                             intermediate_size=2816, tie_word_embeddings=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(root / "wide")
        del model
        models["qwen2 1024x12"] = (str(root / "wide"), "bfloat16")
    return models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the small preset only")
    parser.add_argument("--chunk-mb", type=float, nargs="*", default=[],
                        help="load_shards chunk sizes to measure besides the trainer's default "
                        "(the checkpoint's size over the ranks, at most 1 GiB)")
    args = parser.parse_args()

    from pipelinerl.metrics.tables import markdown_table

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        models = build_models(Path(tmp), args.quick)
        warmup = models.pop("tiny preset")[0]
        ways = [("before", None), ("after", None)] + [("after", int(mb * MB))
                                                      for mb in args.chunk_mb]
        for name, (path, stored) in models.items():
            for way, chunk in ways:
                label = way if chunk is None else f"{way}, {chunk / MB:g} MB chunks"
                for rank, r in enumerate(measure(path, warmup, way, args.ranks, chunk)):
                    rows.append([
                        name, f"{r['params'] / 1e6:.1f} M", stored, label, str(rank),
                        f"{r['base'] / MB:.0f}", f"{r['peak'] / MB:.0f}",
                        f"{(r['peak'] - r['base']) / MB:.1f}",
                        f"{(r['peak'] - r['base']) / r['params']:.2f}",
                        f"{(r['loaded'] - r['base']) / MB:.1f}", f"{r['load_s']:.2f}",
                        f"{r['publish']['float32'] / MB:.1f} / "
                        f"{r['publish']['bfloat16'] / MB:.1f}"])
    print(f"{args.ranks} gloo ranks on the CPU, torch {torch.__version__}; MB = 2^20 bytes")
    print(markdown_table(
        ["model", "params", "checkpoint", "load", "rank", "RSS before load (MB)",
         "peak RSS (MB)", "peak - before (MB)", "bytes / param", "held after load (MB)",
         "load s", "one update fp32 / bf16 (MB)"], rows))


if __name__ == "__main__":
    main()
