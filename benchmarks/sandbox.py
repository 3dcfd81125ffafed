"""Sandboxed executions per second against a plain subprocess, measured in the same run.

The program has ten asserts (what a code reward runs). Each mode runs it as many times as it
can in `--seconds` from `--workers` threads at once (two: the two cores), the modes taking
turns in rounds so drifting machine load hits them alike:
- sandbox: `pipelinerl.sandbox.run_python` (bubblewrap, limits, capped output; `-I -S`);
- sandbox fork server: `ForkServer.run_python`, one server per worker thread (started on
  its first run; its start counted in the first round);
- subprocess: `subprocess.run([python, file])`, what an unsandboxed reward does;
- subprocess -I -S: the same interpreter flags as the sandbox's, no isolation: the floor the
  sandbox's per-run interpreter start sets.
Writes the "sandbox" section of benchmarks/RESULTS.md (`--out DIR`: DIR/RESULTS.md).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import environment, load_average, results_file, table, write_section  # noqa: E402

from pipelinerl.sandbox import ForkServer, Limits, run_python  # noqa: E402

PROGRAM = """\
def add(a, b):
    return a + b

""" + "".join(f"assert add({i}, {i + 1}) == {2 * i + 1}\n" for i in range(10))


def runs_per_second(run_once: Callable[[], bool], workers: int, seconds: float) -> float:
    """Completed runs per second from `workers` threads calling `run_once` for `seconds`;
    a run that does not succeed stops the benchmark (the figures would be of failures)."""
    done = [0] * workers
    failures: list[str] = []
    stop_at = time.perf_counter() + seconds

    def loop(slot: int) -> None:
        while time.perf_counter() < stop_at and not failures:
            try:
                if not run_once():
                    failures.append(f"worker {slot}: a run failed")
            except Exception as error:  # noqa: BLE001 - reported by the main thread
                failures.append(f"worker {slot}: {error!r}")
            done[slot] += 1

    start = time.perf_counter()
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise RuntimeError(failures[0])
    return sum(done) / (time.perf_counter() - start)


def modes(program_file: Path, servers: threading.local, started: list[ForkServer]
          ) -> dict[str, Callable[[], bool]]:
    limits = Limits(timeout_s=10)

    def fork_server() -> bool:
        if not hasattr(servers, "server"):  # one per worker thread, started on its first run
            servers.server = ForkServer()
            started.append(servers.server)
        return servers.server.run_python(PROGRAM, limits=limits).ok

    return {
        "sandbox (bubblewrap)": lambda: run_python(PROGRAM, limits=limits).ok,
        "sandbox fork server": fork_server,
        "subprocess.run([python, file])": lambda: subprocess.run(
            [sys.executable, str(program_file)]).returncode == 0,
        "subprocess.run([python, -I, -S, file])": lambda: subprocess.run(
            [sys.executable, "-I", "-S", str(program_file)]).returncode == 0,
    }


def verdict(rates: dict[str, list[float]]) -> str:
    """The aims (issue 42), stated as measured."""
    plain = rates["subprocess.run([python, file])"]
    lines = []
    for name in ("sandbox (bubblewrap)", "sandbox fork server"):
        mean = sum(rates[name]) / len(rates[name])
        never_slower = all(s >= p for s, p in zip(rates[name], plain))
        lines.append(f"{name}: aim >= 100 runs/s on two cores "
                     f"{'met' if mean >= 100 else 'not met'} ({mean:.1f}); never slower than "
                     f"the plain subprocess in any round: {'met' if never_slower else 'not met'}.")
    return ("\n".join(f"- {line}" for line in lines) + "\n\nA `run_python` run is one "
            "bubblewrap start and one interpreter start: the `-I -S` row, no isolation at all, "
            "bounds it. The fork server starts neither per run: a fork, the program's limits, "
            "and the clean-up after it.\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="per mode and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    load = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        program_file = Path(tmp) / "program.py"
        program_file.write_text(PROGRAM)
        servers, started = threading.local(), []
        rates: dict[str, list[float]] = {name: [] for name in modes(program_file, servers,
                                                                    started)}
        try:
            for _ in range(args.rounds):
                for name, run_once in modes(program_file, servers, started).items():
                    run_once()  # warm the page cache and the sandbox's isolation check
                    rates[name].append(runs_per_second(run_once, args.workers, args.seconds))
        finally:
            for server in started:
                server.close()
    baseline = sum(rates["subprocess.run([python, file])"]) / args.rounds
    rows = []
    for name, per_round in rates.items():
        mean = sum(per_round) / len(per_round)
        rows.append([name, f"**{mean:.1f}**", " / ".join(f"{r:.1f}" for r in per_round),
                     f"{1000 * args.workers / mean:.1f}", f"{mean / baseline:.2f}x"])
    text = (
        "## Sandbox: executions per second (`benchmarks/sandbox.py`)\n\n"
        + environment(load)
        + f"\nA ten-assert program, {args.workers} threads running it back to back for "
        f"{args.seconds:g} s per mode, {args.rounds} rounds (modes in turn). ms/run = "
        "wall time per run of one worker; ratio = runs/s against the plain subprocess.\n\n"
        + table(["mode", "runs/s", "per round", "ms/run", "vs subprocess"], rows)
        + "\n" + verdict(rates))
    write_section("sandbox", text, results_file(args.out))
    print(text)


if __name__ == "__main__":
    main()
