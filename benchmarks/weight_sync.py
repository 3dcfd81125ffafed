"""Weight-sync time per update vs model size, through each channel, to a receiver process.

Channels (`pipelinerl.sync`): the shared-memory file (`ShmWeightSender.publish`, then
`ShmWeightReceiver.receive_into` in the other process), and the gloo broadcast with 16 MB and
64 MB buckets and per parameter (`BroadcastWeightSender` to one `BroadcastWeightReceiver`).
Reference: a plain in-process `copy_` of the same bytes as one flat buffer.

The receiver is one process holding every channel's receiver at once, so the channels are
measured interleaved, round-robin, under the same load. Per update: the parent notes t0, runs
its side, the receiver notes when its copy is done; end-to-end = receiver done - t0 (both clocks
are CLOCK_MONOTONIC). Weights are fp32, Qwen2-shaped (q/k/v/o, gate/up/down, norms,
embedding and head), at ~1M, ~10M and ~50M parameters.

Run: `python benchmarks/weight_sync.py` (writes the `weight_sync` section of RESULTS.md) or
`--quick`. `--cast`: instead, a float32 trainer's weights to a bfloat16 engine through shm and
gloo, sent as float32 and cast on receipt against cast by the sender (`CastWeights`, what the
trainer publishes since), at SmolLM2's size (the `weight_sync_cast` section).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool; inherited

import argparse
import multiprocessing as mp
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import _results
import torch


@dataclass(frozen=True)
class Shape:
    """A Qwen2-like decoder: enough real-sized tensors that per-tensor costs show."""

    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int = 256

    def shapes(self) -> dict[str, tuple[int, ...]]:
        h, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out |= {
                p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
                p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (self.intermediate, h),
                p + "mlp.up_proj.weight": (self.intermediate, h),
                p + "mlp.down_proj.weight": (h, self.intermediate),
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            }
        out |= {"model.norm.weight": (h,), "lm_head.weight": (self.vocab, h)}
        return out

    def tensors(self, fill: bool) -> dict[str, torch.Tensor]:
        return {n: torch.randn(s) if fill else torch.empty(s) for n, s in self.shapes().items()}

    @property
    def numel(self) -> int:
        return sum(torch.Size(s).numel() for s in self.shapes().values())


SIZES = {
    "1M": Shape(128, 5, 384, 4, 2),
    "10M": Shape(384, 6, 1152, 6, 2),
    "50M": Shape(768, 7, 2304, 12, 4),
}
SMOLLM2 = Shape(576, 30, 1536, 9, 3, vocab=49152)  # its shapes (plus q/k/v biases)
# (channel, cast by the sender): float32 weights to a bfloat16 engine
CASTS = {"shm, float32 (cast on receipt)": ("shm", False), "shm, bfloat16 (CastWeights)": ("shm", True),
         "gloo 64 MB buckets, float32 (cast on receipt)": ("gloo", False),
         "gloo 64 MB buckets, bfloat16 (CastWeights)": ("gloo", True)}
BROADCASTS = {"gloo 16 MB buckets": (16.0, False), "gloo 64 MB buckets": (64.0, False),
              "gloo per parameter": (64.0, True)}
CHANNELS = ["shm", *BROADCASTS]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def receiver_main(conn: Connection, shape: Shape, shm_dir: str, run_ids: dict[str, str],
                  ports: dict[str, int], dtype: torch.dtype, tied: bool) -> None:
    """The receiving process: one receiver per channel (shm by run id, broadcast by port),
    all filling the same target tensors, in `dtype` (the engine's)."""
    from pipelinerl.sync.broadcast import BroadcastWeightReceiver
    from pipelinerl.sync.shm import ShmWeightReceiver

    torch.set_num_threads(1)
    targets = {n: t.to(dtype) for n, t in shape.tensors(fill=False).items()}
    if tied:
        targets["lm_head.weight"] = targets["model.embed_tokens.weight"]
    receivers: dict[str, Any] = {name: ShmWeightReceiver(run_id, shm_dir)
                                 for name, run_id in run_ids.items()}
    for name, port in ports.items():  # the parent builds the matching sender meanwhile
        receivers[name] = BroadcastWeightReceiver(f"tcp://127.0.0.1:{port}", 0, 1)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        name, version = msg
        receiver = receivers[name]
        while receiver.poll() != version:  # an actor polls between two decode steps
            time.sleep(0.0002)
        t0 = time.perf_counter()
        receiver.receive_into(targets)
        done = time.perf_counter()
        conn.send((done, done - t0))
    for receiver in receivers.values():
        receiver.close()


def timed_update(parent: Connection, name: str, sender: Any, weights: Any, version: int,
                 shm: bool) -> tuple[float, float, float]:
    """One update through channel `name`: (end-to-end, the sender's publish call, the
    receiver's receive_into) in seconds. shm: publish, then tell the receiver; a broadcast:
    tell the receiver first (it must join the transfer)."""
    if shm:
        t0 = time.perf_counter()
        sender.publish(weights, version)
        published = time.perf_counter()
        parent.send((name, version))
    else:
        parent.send((name, version))
        t0 = time.perf_counter()
        sender.publish(weights, version)
        published = time.perf_counter()
    done, receive_s = parent.recv()
    return max(done, published) - t0, published - t0, receive_s


def rotated(names: list[str], version: int) -> list[str]:
    """The channels in a round-robin order that moves on by one each update."""
    k = version % len(names)
    return names[k:] + names[:k]


def bench_size(shape: Shape, reps: int, shm_dir: str) -> dict[str, dict[str, list[float]]]:
    from pipelinerl.sync.broadcast import BroadcastWeightSender
    from pipelinerl.sync.shm import ShmWeightSender

    weights = shape.tensors(fill=True)
    src = torch.cat([t.reshape(-1) for t in weights.values()])
    dst = torch.empty_like(src)
    run_ids = {"shm": f"bench-sync-{os.getpid()}"}
    ports = {name: free_port() for name in BROADCASTS}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, daemon=True,
                       args=(child, shape, shm_dir, run_ids, ports, torch.float32, False))
    proc.start()
    senders: dict[str, Any] = {"shm": ShmWeightSender(run_ids["shm"], shm_dir)}
    senders |= {name: BroadcastWeightSender(f"tcp://127.0.0.1:{ports[name]}", 1, bucket_mb=mb,
                                            per_parameter=per_param)
                for name, (mb, per_param) in BROADCASTS.items()}  # in order: each waits for its peer
    # per channel: end-to-end, the sender's publish call, its broadcast alone, receive_into
    times: dict[str, dict[str, list[float]]] = {
        k: {"e2e": [], "publish": [], "transfer": [], "receive": []} for k in ["plain copy", *CHANNELS]}
    try:
        assert parent.recv() == "ready"
        for version in range(reps + 1):  # update 0 warms up buffers and mappings
            keep = version > 0
            t0 = time.perf_counter()
            dst.copy_(src)
            if keep:
                times["plain copy"]["e2e"].append(time.perf_counter() - t0)
            for name in rotated(CHANNELS, version):
                measured = timed_update(parent, name, senders[name], weights, version, name == "shm")
                if keep:
                    t = times[name]
                    for key, value in zip(("e2e", "publish", "receive"), measured):
                        t[key].append(value)
                    if name != "shm":
                        t["transfer"].append(senders[name].last_transfer_s)
        parent.send(None)
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.kill()
        for sender in senders.values():
            sender.close()
    return times


def bench_cast(shape: Shape, reps: int, shm_dir: str) -> dict[str, dict[str, list[float]]]:
    from pipelinerl.sync.base import CastWeights
    from pipelinerl.sync.broadcast import BroadcastWeightSender
    from pipelinerl.sync.shm import ShmWeightSender

    weights = shape.tensors(fill=True)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # tied, as in SmolLM2
    run_ids = {name: f"bench-cast-{i}-{os.getpid()}"
               for i, (name, (kind, _)) in enumerate(CASTS.items()) if kind == "shm"}
    ports = {name: free_port() for name, (kind, _) in CASTS.items() if kind == "gloo"}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main, daemon=True,
                       args=(child, shape, shm_dir, run_ids, ports, torch.bfloat16, True))
    proc.start()
    # In the receiver's order: the shm ones, then the broadcasts (each waits for its peer).
    senders: dict[str, Any] = {name: ShmWeightSender(run_id, shm_dir) for name, run_id in run_ids.items()}
    senders |= {name: BroadcastWeightSender(f"tcp://127.0.0.1:{port}", 1, bucket_mb=64.0)
                for name, port in ports.items()}
    times: dict[str, dict[str, list[float]]] = {
        k: {"e2e": [], "publish": [], "receive": []} for k in CASTS}
    try:
        assert parent.recv() == "ready"
        for version in range(reps + 1):  # update 0 warms up buffers and mappings
            for name in rotated(list(CASTS), version):
                kind, cast = CASTS[name]
                sent = CastWeights(weights, torch.bfloat16) if cast else weights
                measured = timed_update(parent, name, senders[name], sent, version, kind == "shm")
                if version:
                    for key, value in zip(("e2e", "publish", "receive"), measured):
                        times[name][key].append(value)
        parent.send(None)
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.kill()
        for sender in senders.values():
            sender.close()
    return times


def render_cast(load: tuple[float, float, float], shape: Shape, reps: int,
                times: dict[str, dict[str, list[float]]]) -> str:
    n = shape.numel - shape.vocab * shape.hidden  # the head is the embedding
    rows = []
    for name, t in times.items():
        kind, cast = CASTS[name]
        base = statistics.median(times[next(k for k, v in CASTS.items() if v == (kind, False))]["e2e"])
        e2e = statistics.median(t["e2e"])
        rows.append([f"{n / 1e6:.1f}M", name, f"{(2 if cast else 4) * n / 1e6:.0f}",
                     f"**{1e3 * e2e:.1f}**", f"{1e3 * statistics.median(t['publish']):.1f}",
                     f"{1e3 * statistics.median(t['receive']):.1f}", f"{base / e2e:.2f}x"])
    return (
        "## Weight sync into a bfloat16 engine: cast by the sender or on receipt "
        "(`benchmarks/weight_sync.py --cast`)\n\n"
        + _results.environment(load)
        + f"\nA float32 trainer's weights (SmolLM2-135M's shapes, head tied: {n / 1e6:.1f}M "
        "parameters) to an engine holding bfloat16: sent as float32 and cast by the engine on "
        "receipt, or cast by the sender as it copies into the channel (`CastWeights`, what the "
        "trainer does since). Sender in this process, receiver (bfloat16 targets) in another, "
        f"channels round-robin, median of {reps} updates after one warm-up. end-to-end = "
        "`publish` until the receiver's `receive_into` is done (gloo: from the announcement, "
        "handshake included). Either way the engine ends with the same values "
        "(tests/test_sync.py). Times in ms; speed-up against the same channel in float32.\n\n"
        + _results.table(["params", "channel", "MB sent and held", "end-to-end ms",
                          "publish ms", "receive_into ms", "speed-up"], rows)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, seconds; no RESULTS.md")
    parser.add_argument("--out", type=Path, help="write the section to this file instead")
    parser.add_argument("--cast", action="store_true",
                        help="float32 weights to a bfloat16 engine: cast by the sender or on receipt")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = _results.load_average()
    if args.cast:
        reps = 2 if args.quick else 10
        with tempfile.TemporaryDirectory(prefix="bench-sync-", dir="/dev/shm") as shm_dir:
            shape = SIZES["1M"] if args.quick else SMOLLM2
            section = render_cast(load, shape, reps, bench_cast(shape, reps, shm_dir))
        print(section)
        if args.out or not args.quick:
            _results.write_section("weight_sync_cast", section, args.out or _results.RESULTS)
        return
    reps = {"1M": 3} if args.quick else {"1M": 30, "10M": 15, "50M": 8}
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-sync-", dir="/dev/shm") as shm_dir:
        for size, n in reps.items():
            results[size] = bench_size(SIZES[size], n, shm_dir)
            print(f"{size}: " + ", ".join(f"{k} {1e3 * statistics.median(v['e2e']):.2f} ms"
                                          for k, v in results[size].items()), file=sys.stderr)
    section = render(load, reps, results)
    print(section)
    if args.out:
        _results.write_section("weight_sync", section, args.out)
    elif not args.quick:
        _results.write_section("weight_sync", section)


def render(load: tuple[float, float, float], reps: dict[str, int],
           results: dict[str, dict[str, dict[str, list[float]]]]) -> str:
    rows = []
    for size, times in results.items():
        shape = SIZES[size]
        mb = 4 * shape.numel / 1e6

        copy_s = statistics.median(times["plain copy"]["e2e"])
        for name, t in times.items():
            e2e = statistics.median(t["e2e"])
            rows.append([f"{shape.numel / 1e6:.1f}M", f"{mb:.0f}", name, f"**{1e3 * e2e:.2f}**",
                         *(f"{1e3 * statistics.median(t[k]):.2f}" if t[k] else "-"
                           for k in ("publish", "transfer", "receive")),
                         f"{mb / 1e3 / e2e:.2f}", f"{e2e / copy_s:.1f}x"])
    return (
        "## Weight sync: time per update vs size (`benchmarks/weight_sync.py`)\n\n"
        + _results.environment(load)
        + "\nfp32 Qwen2-shaped weights (12 tensors per layer, embedding and head), sender in this "
        "process, one receiver process that holds every channel's receiver at once; channels are "
        "measured round-robin, median of " + ", ".join(f"{n} ({s})" for s, n in reps.items())
        + " updates after one warm-up. end-to-end: shm = `publish` into the shared-memory file, "
        "a pipe message, and the receiver's `receive_into` (seqlock-checked copy out) done; gloo "
        "= `publish` (announce the version, wait for the receiver to be ready, broadcast) until "
        "the receiver's `receive_into` returns. publish = the sender's call; broadcast = the "
        "sender's `last_transfer_s` (the broadcast alone, after the handshake); receive_into = "
        "the receiver's call (for gloo it includes waiting for the sender's go). plain copy = "
        "one in-process `copy_` of the same bytes as a flat buffer. Times in ms.\n\n"
        + _results.table(["params", "MB", "channel", "end-to-end ms", "publish ms", "broadcast ms",
                          "receive_into ms", "GB/s", "/ plain copy"], rows)
    )


if __name__ == "__main__":
    main()
