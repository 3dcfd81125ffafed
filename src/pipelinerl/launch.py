"""Starts and supervises the roles of one run as separate OS processes.

If one role dies, every other is stopped and the dead one's error is shown; Ctrl-C stops all
cleanly. Each role is also a command of its own (`pipelinerl trainer|actor`), which is how a
multi-machine run starts them (docs/multinode.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from pipelinerl.config import Config, save_config

ERROR_FILE = "{role}.error"
# How long the trainer may keep running (saving its final weights) after every actor left.
ACTORS_GONE_GRACE_S = 120.0


@dataclass
class RoleProcess:
    role: str
    proc: subprocess.Popen
    log_path: Path | None
    log_file: IO | None = None


def role_env(threads: int) -> dict[str, str]:
    # Each role gets its own share of the cores: two roles with two threads each collapse
    # throughput on a 2-core machine (DESIGN.md).
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def prepare_run(cfg: Config, overwrite: bool) -> Config:
    """Create the run directory, resolve the starting model, write the resolved config."""
    run_dir = cfg.run_dir
    if (run_dir / "metrics.jsonl").exists() and not overwrite:
        raise SystemExit(
            f"run directory {run_dir} already holds a run; choose another `name=...` "
            "or pass --overwrite"
        )
    if overwrite and run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if not cfg.model.path:
        cfg = cfg.model_copy(deep=True)
        cfg.model.path = str(starting_model(cfg))
    if cfg.sync.backend == "broadcast" and not cfg.sync.init_method:
        cfg.sync.init_method = f"tcp://127.0.0.1:{_free_port()}"
    save_config(cfg, run_dir / "config.yaml")
    return cfg


def starting_model(cfg: Config) -> Path:
    """The warm-started tiny model for the task (built and cached on first use)."""
    from dataclasses import replace

    from pipelinerl.tasks import make_task
    from pipelinerl.warmstart import WarmStartConfig, warm_start

    if not cfg.warmstart.enabled:
        raise SystemExit("model.path is empty and warmstart.enabled=false: give model.path=DIR "
                         "(a local Hugging Face model directory)")
    ws = WarmStartConfig(preset=cfg.model.preset, seed=cfg.warmstart.seed)
    if cfg.warmstart.steps:
        ws = replace(ws, steps=cfg.warmstart.steps)
    if cfg.warmstart.step_error_prob >= 0:
        ws = replace(ws, step_error_prob=cfg.warmstart.step_error_prob)
    task = make_task(cfg.task.name, cfg.task.params)
    if not hasattr(task, "demonstration"):
        raise SystemExit(f"task {cfg.task.name!r} has no demonstrations to warm-start from: "
                         "give model.path=DIR")
    print(f"warm-start: building the starting policy (cached in {cfg.warmstart.cache_dir})",
          file=sys.stderr)
    return warm_start(task, ws, cache_dir=cfg.warmstart.cache_dir, progress=cfg.metrics.progress)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(role: str, args: list[str], cfg: Config, threads: int, to_log: bool) -> RoleProcess:
    log_path = cfg.run_dir / "logs" / f"{role}.log"
    log_file = log_path.open("w") if to_log else None
    if args[0] == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", *args[1:]]
    else:
        command = [sys.executable, "-m", "pipelinerl.cli", *args]
    proc = subprocess.Popen(
        command,
        env=role_env(threads),
        preexec_fn=_die_with_parent,
        stdout=log_file,
        stderr=subprocess.STDOUT if to_log else None,
    )
    return RoleProcess(role, proc, log_path if to_log else None, log_file)


def _die_with_parent() -> None:
    """Linux: a role gets SIGTERM when the launcher dies, even by SIGKILL: no orphans."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _failure_report(rp: RoleProcess, run_dir: Path) -> str:
    error_file = run_dir / "logs" / ERROR_FILE.format(role=rp.role)
    if error_file.exists():
        return error_file.read_text()
    if rp.log_path is not None and rp.log_path.exists():
        lines = rp.log_path.read_text().splitlines()[-30:]
        return "\n".join(lines)
    return "(no output captured; see above)"


def _stop_all(procs: list[RoleProcess], grace_s: float = 10.0) -> None:
    for rp in procs:
        if rp.proc.poll() is None:
            rp.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for rp in procs:
        remaining = max(deadline - time.monotonic(), 0.1)
        try:
            rp.proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            rp.proc.kill()
            rp.proc.wait()
    for rp in procs:
        if rp.log_file is not None:
            rp.log_file.close()


def launch(cfg: Config, overwrite: bool = False) -> int:
    """Run a whole job on this machine; returns the process exit code."""
    previous = signal.getsignal(signal.SIGTERM)
    install_role_signal_handlers()  # SIGTERM stops every role, like Ctrl-C
    try:
        return _launch(cfg, overwrite)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _launch(cfg: Config, overwrite: bool) -> int:
    cfg = prepare_run(cfg, overwrite)
    run_dir = cfg.run_dir
    config_path = str(run_dir / "config.yaml")
    redis = None
    if cfg.stream.backend == "redis" and not cfg.stream.redis_url:
        from pipelinerl.streams.redis_server import start_redis_server

        redis = start_redis_server(dir=run_dir / "redis")
        cfg.stream.redis_url = redis.url
        save_config(cfg, run_dir / "config.yaml")

    trainer_cmd = ["trainer", config_path]
    if cfg.trainer.num_procs > 1:
        # DDP ranks via torchrun; rank 0 reads the stream, shards groups, publishes weights.
        trainer_cmd = ["torchrun", "--standalone", f"--nproc-per-node={cfg.trainer.num_procs}",
                       "-m", "pipelinerl.cli", *trainer_cmd]
    procs = [_spawn("trainer", trainer_cmd, cfg, cfg.trainer.threads, to_log=False)]
    for i in range(cfg.actor.num_actors):
        procs.append(
            _spawn(f"actor_{i}", ["actor", config_path, "--actor-id", str(i)], cfg,
                   cfg.actor.threads, to_log=True)
        )
    trainer, actors = procs[0], procs[1:]
    actors_gone_at: float | None = None
    try:
        while True:
            time.sleep(0.2)
            failed = next((rp for rp in procs if rp.proc.poll() not in (None, 0)), None)
            if failed is not None:
                _stop_all(procs)
                print(f"\n{failed.role} failed with exit code {failed.proc.returncode}:\n"
                      f"{_failure_report(failed, run_dir)}", file=sys.stderr)
                return 1
            if trainer.proc.poll() == 0:
                # Actors see the trainer's stop record and leave on their own.
                _wait_then_stop(actors, grace_s=30.0)
                print(f"run finished: {run_dir}", file=sys.stderr)
                return 0
            # Actors leave cleanly once the trainer writes its stop record, a moment before
            # the trainer saves and exits; only a trainer left alone for long is an error.
            if all(rp.proc.poll() == 0 for rp in actors):
                actors_gone_at = actors_gone_at or time.monotonic()
                if time.monotonic() - actors_gone_at > ACTORS_GONE_GRACE_S:
                    _stop_all(procs)
                    print("\nevery actor exited while the trainer was still running",
                          file=sys.stderr)
                    return 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopping all roles", file=sys.stderr)
        _stop_all(procs)
        return 130
    finally:
        if redis is not None:
            redis.stop()


def _wait_then_stop(procs: list[RoleProcess], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(rp.proc.poll() is None for rp in procs):
        time.sleep(0.1)
    _stop_all(procs)


def install_role_signal_handlers() -> None:
    """SIGTERM from the launcher unwinds the role like Ctrl-C, so `finally` blocks run."""

    def _raise(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _raise)
