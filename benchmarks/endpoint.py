"""What the actor's generate endpoint costs against its in-process path, on one workload.

SmolLM2-135M-Instruct (fp32, one torch thread), the torch engine at capacity 32, the real-model
benchmark's workload (chat-templated numbers questions in groups of 8, imposed long-tailed
completion lengths, temperature 1). In process: every request added to the engine, stepped to
the end (what the actor does for its own groups). Endpoint: the same requests POSTed to
`/inference/v1/generate` by as many client threads as the engine has slots, while a loop like
the actor's takes them between decode steps and answers finished ones (`pipelinerl.rollouts.endpoint`);
clients, server and engine share one process, as verifiers' episodes would share the actor's.
Both on fresh engines with the same seed; tokens/s is wall-clock.

Needs the prepared model (`pipelinerl prepare smollm2`). Run: `python benchmarks/endpoint.py`
(writes the `endpoint` section of RESULTS.md) or `--quick` (seconds, no RESULTS.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its thread pool

import argparse
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _results
import requests
import torch
from engine import Workload, run_engine
from real_model import make_workload

from pipelinerl.engine import EngineOptions
from pipelinerl.engine.torch_engine import TorchEngine
from pipelinerl.rollouts.endpoint import GenerateEndpoint


def _engine(path: Path, capacity: int, max_seq_len: int) -> TorchEngine:
    return TorchEngine.from_pretrained(path, EngineOptions(capacity=capacity, max_seq_len=max_seq_len))


def run_endpoint(engine: TorchEngine, wl: Workload, model: str) -> tuple[float, int]:
    """(wall seconds, tokens) of the workload sent through the endpoint."""
    endpoint = GenerateEndpoint(model=model, max_model_len=wl.max_seq_len, vocab_size=10**9,
                                default_max_tokens=max(wl.max_new))
    stop = threading.Event()

    def actor_loop() -> None:
        while not stop.is_set():
            for request in endpoint.take(engine.capacity - engine.num_active()):
                engine.add_request(request)
            if not engine.num_active():
                stop.wait(0.0005)
                continue
            for out in engine.step():
                endpoint.finish(out)

    def post(i: int) -> int:
        answer = requests.post(f"{endpoint.url}/inference/v1/generate", timeout=600, json={
            "model": model, "token_ids": wl.prompts[i],
            "sampling_params": {"max_tokens": wl.max_new[i], "temperature": 1.0,
                                "stop_token_ids": [], "logprobs": 1}})
        answer.raise_for_status()
        return len(answer.json()["choices"][0]["token_ids"])

    loop = threading.Thread(target=actor_loop, daemon=True)
    loop.start()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(engine.capacity) as pool:
        tokens = sum(pool.map(post, range(len(wl.prompts))))
    seconds = time.perf_counter() - t0
    stop.set()
    loop.join()
    endpoint.close()
    return seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few prompts, seconds")
    parser.add_argument("--out", type=Path, default=_results.RESULTS)
    args = parser.parse_args()
    load = _results.load_average()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from pipelinerl.models.prompts import PromptEncoder
    from pipelinerl.models.sources import resolve_model_path

    path = Path(resolve_model_path("smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    encode = PromptEncoder(tokenizer)
    n_prompts, capacity, max_new, reps = (16, 8, 16, 1) if args.quick else (96, 32, 64, 2)
    wl = make_workload(encode, n_prompts, max_new)
    rows = []
    for rep in range(reps):
        direct = run_engine(_engine(path, capacity, wl.max_seq_len), wl)
        wall, tokens = run_endpoint(_engine(path, capacity, wl.max_seq_len), wl, str(path))
        assert tokens == wl.useful_tokens, (tokens, wl.useful_tokens)
        in_process = wl.useful_tokens / direct.seconds[0]
        served = tokens / wall
        rows.append([str(rep + 1), f"{in_process:.1f}", f"{served:.1f}",
                     f"{served / in_process:.3f}"])
    headers = ["repeat", "in-process tok/s", "endpoint tok/s", "endpoint / in-process"]
    table = _results.table(headers, rows)
    print(table)
    if not args.quick or args.out != _results.RESULTS:
        _results.write_section("endpoint", (
            "## The actor's generate endpoint against its in-process path\n\n"
            + _results.environment(load) + "\n"
            + f"SmolLM2-135M-Instruct fp32, torch engine capacity {capacity}, {n_prompts} "
            f"requests (groups of 8 numbers questions, imposed lengths up to {max_new} new "
            "tokens, temperature 1), one torch thread; endpoint: as many client threads as "
            "slots, in the same process (benchmarks/endpoint.py).\n\n" + table), args.out)


if __name__ == "__main__":
    main()
