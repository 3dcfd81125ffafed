"""Starts and supervises the roles of one run as separate OS processes.

If one role dies, every other is stopped and the dead one's error is shown. Ctrl-C (or SIGTERM)
stops all cleanly: each role is asked to stop and given time to close its streams; a second
Ctrl-C kills them at once. Each role is also a command of its own (`pipelinerl trainer|actor`),
which is how a multi-machine run starts them (docs/multinode.md).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from pipelinerl.config import Config, load_config, save_config
from pipelinerl.proc.ports import free_port
from pipelinerl.proc.stop_signals import StopSignals
from pipelinerl.roles.starting_model import resumed_model, starting_model
from pipelinerl.rollouts.scoring import check_sendable
from pipelinerl.streams.redis_server import start_redis_server
from pipelinerl.tasks import make_train_task

ERROR_FILE = "{role}.error"
# How long the trainer may keep running after every actor left. Actors leave on the trainer's
# stop record, which it writes once its final weights are saved: this covers closing channels.
ACTORS_GONE_GRACE_S = 120.0
ACTORS_LEAVE_S = 30.0  # for actors to see the stop record and leave on their own
STOP_GRACE_S = 10.0  # for a role to stop on SIGTERM before it is killed
POLL_S = 0.1


@dataclass
class RoleProcess:
    role: str
    proc: subprocess.Popen
    log_path: Path | None
    log_file: IO | None = None


def role_env(threads: int, progress: bool = True) -> dict[str, str]:
    # Each role gets its own share of the cores: two roles with two threads each collapse
    # throughput on a 2-core machine (DESIGN.md).
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(threads)
    env["MKL_NUM_THREADS"] = str(threads)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if not progress:  # metrics.progress=false: transformers' bars and notices stay out of logs
        env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return env


def new_run_id() -> str:
    """Sortable by start time, unique across launches (docs/multinode.md)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


# What a resumed run may not change (docs/reliability.md): the model, the task and the shape of
# the batches its checkpoint, streams and admission counts were made for; and whether (and how)
# it replays, which its actor snapshots were taken under (docs/determinism.md).
RESUME_FIXED = ("model.path", "model.preset", "model.lora", "task", "mode", "conventional_g",
                "trainer.batch_size", "actor.group_size", "actor.num_actors", "stream.backend",
                "deterministic")


def prepare_run(cfg: Config, overwrite: bool, resume: bool = False) -> Config:
    """Create the run directory, resolve the starting model and the run id, write the resolved
    config every role reads. `resume`: the next attempt of the run already there."""
    if resume:
        return prepare_resume(cfg)
    cfg = cfg.model_copy(deep=True)
    if not cfg.run_id:
        cfg.run_id = new_run_id()
    run_dir = cfg.run_dir
    if (run_dir / "metrics.jsonl").exists() and not overwrite:
        raise SystemExit(
            f"run directory {run_dir} already holds a run; choose another `name=...` "
            "or pass --overwrite"
        )
    if overwrite and run_dir.exists():
        shutil.rmtree(run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if not cfg.model.path or cfg.warmstart.given_model:
        cfg.model.path = str(starting_model(cfg))
    if cfg.sync.backend == "broadcast" and not cfg.sync.init_method:
        cfg.sync.init_method = f"tcp://127.0.0.1:{free_port()}"
    save_config(cfg, run_dir / "config.yaml")
    return cfg


def prepare_resume(cfg: Config) -> Config:
    """The run in cfg.run_dir, continued as its next attempt with `cfg`'s settings; refused if
    `cfg` changes a RESUME_FIXED key (named). The earlier attempt's logs move to
    logs/attempt<N>/."""

    run_dir = cfg.run_dir
    saved_path = run_dir / "config.yaml"
    if not saved_path.exists():
        raise SystemExit(f"--resume: {run_dir} holds no run (no config.yaml): start it without "
                         "--resume")
    saved = load_config(saved_path)
    cfg = cfg.model_copy(deep=True)
    if not cfg.model.path or cfg.warmstart.given_model:  # the model the run began from
        cfg.model.path, changed = resumed_model(cfg, saved)
        changed += _changed(saved, cfg, ("warmstart",))
    else:
        changed = []
    changed += _changed(saved, cfg, RESUME_FIXED)
    if changed:
        raise SystemExit("--resume: the run in " + str(run_dir) + " was made with other values "
                         "of " + "; ".join(changed) + ". A resumed run keeps its model, task "
                         "and batch shape; start a new run (another name=) to change them")
    cfg.run_id, cfg.attempt = saved.run_id, saved.attempt + 1
    if cfg.sync.backend == "broadcast" and not cfg.sync.init_method:
        cfg.sync.init_method = f"tcp://127.0.0.1:{free_port()}"
    logs = run_dir / "logs"
    earlier = logs / f"attempt{saved.attempt}"
    earlier.mkdir(parents=True, exist_ok=True)
    for f in logs.iterdir():
        if f.is_file():
            f.rename(earlier / f.name)
    save_config(cfg, saved_path)
    if cfg.deterministic.enabled:
        choose_deterministic_resume(cfg)
    return cfg


def choose_deterministic_resume(cfg: Config) -> None:
    """Pair the trainer's newest checkpoint that has every actor's snapshot with them and
    record it for every role, before any starts (docs/determinism.md)."""
    from pipelinerl.run.replay import (  # torch
        choose_resume_point,
        eval_schedule,
        record_resume_point,
    )

    due = eval_schedule(cfg)
    point = choose_resume_point(cfg.run_dir, cfg.attempt, cfg.actor.num_actors, due)
    record_resume_point(cfg.run_dir, point)
    snapshots = ("the actor's snapshot after {} groups" if len(point.seqs) == 1 else
                 "the actors' snapshots after {} groups")
    where = (f"step {point.step}'s checkpoint and "
             + snapshots.format(", ".join(map(str, point.seqs)))
             if point.snapshots else "the run's start (no checkpoint has "
             + ("an actor snapshot" if len(point.seqs) == 1 else "every actor's snapshot")
             + (" and every scheduled evaluation up to its step done)" if due else ")"))
    print(f"deterministic resume (attempt {cfg.attempt}) from {where}", file=sys.stderr)


def _changed(saved: Config, cfg: Config, keys: tuple[str, ...]) -> list[str]:
    def value(c: Config, dotted: str) -> object:
        node: object = c
        for part in dotted.split("."):
            node = getattr(node, part)
        return node.model_dump(mode="json") if hasattr(node, "model_dump") else node

    return [f"{k}: {value(saved, k)!r} then, {value(cfg, k)!r} now" for k in keys
            if value(saved, k) != value(cfg, k)]


def _spawn(role: str, args: list[str], cfg: Config, threads: int, to_log: bool,
           append: bool = False) -> RoleProcess:
    """`append`: a restarted role continues its predecessor's log."""
    log_path = cfg.run_dir / "logs" / f"{role}.log"
    log_file = log_path.open("a" if append else "w") if to_log else None
    if args[0] == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", *args[1:]]
    else:
        command = [sys.executable, "-m", "pipelinerl.cli", *args]
    proc = subprocess.Popen(
        command,
        env=role_env(threads, progress=cfg.metrics.progress),
        preexec_fn=_die_with_parent,
        # A session of its own: a terminal's Ctrl-C reaches only the launcher, which stops the
        # roles in order, and signalling the role's group reaches its children (torchrun's).
        start_new_session=True,
        stdout=log_file,
        stderr=subprocess.STDOUT if to_log else None,
    )
    return RoleProcess(role, proc, log_path if to_log else None, log_file)


def _die_with_parent() -> None:
    """Linux: a role (or the run's redis) gets SIGTERM when the launcher dies, even by SIGKILL:
    no orphans."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _failure_report(rp: RoleProcess, run_dir: Path) -> str:
    """The role's traceback, else its last log lines, else what ended it: never empty. The
    trainer's ranks each write their own (trainer.error, trainer_rank<N>.error): the first
    written is the cause, shown whole (a rank whose peer died fails after it, in a collective:
    'Connection closed by peer'); the others' last lines follow."""
    logs = run_dir / "logs"
    errors = [logs / ERROR_FILE.format(role=rp.role)]
    if rp.role == "trainer":
        errors += logs.glob(ERROR_FILE.format(role="trainer_rank*"))
    errors = sorted((f for f in errors if f.exists()), key=lambda f: f.stat().st_mtime_ns)
    text = ""
    if errors:
        text = errors[0].read_text().strip()
        if len(errors) > 1:
            text = f"{errors[0].stem} failed first:\n{text}"
        for later in errors[1:]:
            last = (later.read_text().strip().splitlines() or ["(empty)"])[-1]
            text += f"\nthen {later.stem}: {last}"
    elif rp.log_path is not None and rp.log_path.exists():
        text = "\n".join(rp.log_path.read_text(errors="replace").splitlines()[-30:])
    code = rp.proc.returncode
    ended = (f"killed by signal {-code} ({signal.Signals(-code).name})"
             if code is not None and code < 0 else f"exit code {code}")
    return text or f"(it wrote nothing; {ended})"


def _signal_role(rp: RoleProcess, sig: int, reaped_too: bool = False) -> None:
    # Normally only while the role is unreaped, so its process group id cannot have been
    # reused. `reaped_too`: within the stop grace, the group of a leader that already left
    # (torchrun, after forwarding SIGTERM) may still hold a hung child: kill it as well.
    if rp.proc.poll() is None or reaped_too:
        try:
            os.killpg(rp.proc.pid, sig)
        except ProcessLookupError:
            pass


def _any_running(procs: list[RoleProcess]) -> bool:
    return any(rp.proc.poll() is None for rp in procs)


def _stop_all(procs: list[RoleProcess], signals: StopSignals) -> None:
    """SIGTERM every role, wait up to STOP_GRACE_S (a second Ctrl-C cuts it short), SIGKILL."""
    for rp in procs:
        _signal_role(rp, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while _any_running(procs) and time.monotonic() < deadline and not signals.force:
        time.sleep(POLL_S / 2)
    if signals.force and _any_running(procs):
        print("second interrupt: killing every role", file=sys.stderr)
    for rp in procs:
        _signal_role(rp, signal.SIGKILL, reaped_too=True)
        rp.proc.wait()
        if rp.log_file is not None:
            rp.log_file.close()


def launch(cfg: Config, overwrite: bool = False, resume: bool = False,
           resume_command: str = "", signals: StopSignals | None = None) -> int:
    """Run a whole job on this machine; returns the process exit code. `resume`: continue the
    run in cfg.run_dir from its newest checkpoint; `resume_command` is shown after a failure.

    After a stop signal the handlers stay installed: the process is exiting, and a further
    Ctrl-C must not turn into a traceback on its way out. `signals`: the CLI's, installed at its
    first line, so a Ctrl-C that came before is acted on here.
    """
    signals = signals or StopSignals()
    try:
        try:
            # The checks import libraries: record-only there (cli.py's main says why).
            check_task(cfg)
            given_model = bool(cfg.model.path)
            if given_model:  # refused before the run directory is touched
                check_model(cfg)
            check_tools(cfg)
            with signals.interrupting():  # the warm start: minutes with no loop to check
                cfg = prepare_run(cfg, overwrite, resume)
            if not given_model:  # the warm-started one, or the resumed run's
                check_model(cfg)
            signals.check()
        except BaseException:
            if not signals.stop:
                raise
            # No role was started. Not only KeyboardInterrupt: a library interrupted in an
            # import may re-raise it as another error.
            print("\ninterrupted", file=sys.stderr)
            return signals.exit_code
        # Starts no role once a stop signal came.
        code, failed = _run(cfg, signals, resume_command)
        for restart in range(1, cfg.trainer.max_restarts + 1):
            if not _resumes_the_run(cfg, failed) or signals.stop:
                break
            print(f"\nthe {'trainer' if failed.startswith('trainer') else failed} died: resuming "
                  f"the run from its newest checkpoint (restart {restart} of "
                  f"trainer.max_restarts={cfg.trainer.max_restarts})", file=sys.stderr)
            cfg = prepare_resume(cfg)
            code, failed = _run(cfg, signals, resume_command)
        return code
    finally:
        if not signals.stop:
            signals.restore()


def _resumes_the_run(cfg: Config, failed: str | None) -> bool:
    """Whether the death of role `failed` resumes the whole run (under trainer.max_restarts):
    the trainer's; in deterministic mode an actor's or the evaluator's too, which are never
    restarted alone (an actor's groups after its snapshot are published again, and the
    trainer may have trained them; the versions the evaluator held are made again)."""
    if failed is None:
        return False
    return failed.startswith("trainer") or (cfg.deterministic.enabled
                                            and (failed.startswith("actor")
                                                 or failed == "evaluator"))


def check_task(cfg: Config) -> None:
    """Build the task as the roles will, so that a module that does not import, a class that
    is not a Task, bad params or a task the verifier workers cannot receive are reported now,
    before any process starts, rather than as a role's traceback."""
    try:
        task = make_train_task(cfg.task.name, cfg.task.params, cfg.task.heldout_frac)
        check_sendable(task)
        if cfg.deterministic.enabled:
            from pipelinerl.run.replay import (
                check_deterministic_task,  # torch: deterministic runs only
            )

            check_deterministic_task(cfg, task)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"pipelinerl: {e}") from e
    if getattr(task, "episodic", False):
        from pipelinerl.models.hf import load_tokenizer

        if not cfg.model.path or not getattr(load_tokenizer(cfg.model.path), "chat_template",
                                             None):
            raise SystemExit(f"pipelinerl: task {cfg.task.name!r} renders chat messages: "
                             "model.path must name a model with a chat template (the warm-started "
                             f"char model has none; model.path={cfg.model.path!r})")


def check_tools(cfg: Config) -> None:
    """Start the config's tools once as the roles will (functions imported, each MCP server
    started and listed, the chat template able to render them), so that a server that does not
    start, answers nothing or lists no tools stops the launch in one line naming it."""
    if not cfg.tools.enabled:
        return
    if not cfg.model.path:
        raise SystemExit("pipelinerl: tools need model.path, a model with a chat template (the "
                         "warm-started char model has none)")
    from pipelinerl.models.hf import load_tokenizer
    from pipelinerl.tasks import make_task
    from pipelinerl.tools.task import open_tools, refuse_unsupported

    try:
        refuse_unsupported(cfg, make_task(cfg.task.name, cfg.task.params))
        host, *_ = open_tools(cfg, load_tokenizer(cfg.model.path))
    except (ValueError, RuntimeError, TimeoutError) as e:
        raise SystemExit(f"pipelinerl: {e}") from e
    host.close()


def check_model(cfg: Config) -> None:
    """Refuse, before any role starts, a model that the actor's engine would refuse later
    (an unsupported family, or a feature the torch engine lacks), or whose tokenizer cannot
    format the prompts as asked (no chat template, no EOS token)."""
    # transformers (~8 s to import): the launcher imports it only once it checks a model.
    from pipelinerl.models.hf import check_engine_model
    from pipelinerl.models.prompts import prompt_format

    try:
        check_engine_model(cfg.model.path, cfg.engine.backend, cfg.engine.max_seq_len)
        prompt_format(cfg, cfg.model.path)
        if cfg.model.lora is not None:
            from pipelinerl.models.lora import (
                check_targets,  # peft: ~3 s more, LoRA runs only
            )

            check_targets(cfg.model.path, cfg.model.lora)
    except ValueError as e:
        raise SystemExit(f"model.path={cfg.model.path}: {e}") from e


def _run(cfg: Config, signals: StopSignals, resume_command: str = "") -> tuple[int, str | None]:
    """The run's exit code, and the role whose failure ended it (None if none did)."""

    run_dir = cfg.run_dir
    config_path = str(run_dir / "config.yaml")
    procs: list[RoleProcess] = []
    redis = None
    try:
        if cfg.stream.backend == "redis" and not cfg.stream.redis_url:
            redis = start_redis_server(dir=run_dir / "redis", preexec_fn=_die_with_parent)
            cfg.stream.redis_url = redis.url
            save_config(cfg, run_dir / "config.yaml")
        specs = {spec[0]: spec for spec in _role_specs(cfg, config_path)}
        for role, args, threads, to_log in specs.values():
            if signals.stop:
                break
            procs.append(_spawn(role, args, cfg, threads, to_log))

        def respawn(role: str) -> RoleProcess:
            _, args, threads, to_log = specs[role]
            return _spawn(role, args, cfg, threads, to_log, append=True)

        # Actors and the evaluator are restarted (a broadcast channel forms its group again to
        # take the new process); the trainer's death ends this attempt.
        restarts = cfg.actor.max_restarts
        # After the stop record the actors leave while the trainer may still wait for the
        # evaluation of its final weights.
        grace = ACTORS_GONE_GRACE_S + (cfg.eval.final_timeout_s if cfg.eval.enabled else 0.0)
        def keep_redis() -> None:
            # The run's own server died: start it again on its port, over its append-only
            # file; writers and readers reconnect within their retries.
            nonlocal redis
            if redis is not None and redis.proc.poll() is not None:
                print(f"\nredis-server exited (code {redis.proc.returncode}); restarting it on "
                      f"port {redis.port}", file=sys.stderr)
                redis = start_redis_server(dir=run_dir / "redis", port=redis.port,
                                           preexec_fn=_die_with_parent)

        code, failed = (None, None) if signals.stop else _supervise(
            procs, signals, run_dir, grace, Restarts(restarts, respawn), keep_redis)
        if code and resume_command:
            print(f"\nthe run can continue from its newest checkpoint: {resume_command}",
                  file=sys.stderr)
        if code is None:
            print("\ninterrupted: stopping all roles (Ctrl-C again to kill them)", file=sys.stderr)
            return signals.exit_code, None
        return code, failed
    finally:
        _stop_all(procs, signals)  # a no-op for roles already stopped
        if redis is not None:
            redis.stop()


def _role_specs(cfg: Config, config_path: str) -> list[tuple[str, list[str], int, bool]]:
    """(role, command arguments, threads, output to a log file) for every role to start."""
    trainer_cmd = ["trainer", config_path]
    if cfg.trainer.num_procs > 1:
        # DDP ranks via torchrun; rank 0 reads the stream, shards groups, publishes weights.
        trainer_cmd = ["torchrun", "--standalone", f"--nproc-per-node={cfg.trainer.num_procs}",
                       "-m", "pipelinerl.cli", *trainer_cmd]
    specs = [("trainer", trainer_cmd, cfg.trainer.threads, False)]
    for i in range(cfg.actor.num_actors):
        specs.append((f"actor_{i}", ["actor", config_path, "--actor-id", str(i)],
                      cfg.actor.threads, True))
    if cfg.eval.enabled:
        specs.append(("evaluator", ["evaluator", config_path], cfg.eval.threads, True))
    return specs


@dataclass
class Restarts:
    """Restarts dead actors and a dead evaluator, each up to `limit` times, with a doubling
    backoff: neither holds state the run cannot rebuild (docs/reliability.md)."""

    limit: int
    respawn: Callable[[str], RoleProcess]
    done: Counter = field(default_factory=Counter)

    def try_restart(self, dead: RoleProcess, run_dir: Path, signals: StopSignals) -> RoleProcess | None:
        restartable = dead.role.startswith("actor") or dead.role == "evaluator"
        if not restartable or self.done[dead.role] >= self.limit:
            return None
        if dead.log_file is not None:
            dead.log_file.close()
        backoff = 2.0 ** self.done[dead.role]
        self.done[dead.role] += 1
        print(f"\n{dead.role} died (exit code {dead.proc.returncode}); restarting it in "
              f"{backoff:.0f} s (restart {self.done[dead.role]} of {self.limit}). Its last "
              f"lines:\n{_failure_report(dead, run_dir)}", file=sys.stderr)
        deadline = time.monotonic() + backoff
        while time.monotonic() < deadline and not signals.stop:
            time.sleep(POLL_S)
        return None if signals.stop else self.respawn(dead.role)


def _supervise(procs: list[RoleProcess], signals: StopSignals, run_dir: Path,
               actors_gone_grace_s: float = ACTORS_GONE_GRACE_S,
               restarts: Restarts | None = None,
               tick: Callable[[], None] = lambda: None) -> tuple[int | None, str | None]:
    """The run's exit code once it ends by itself (None once a stop signal arrives), and the
    role whose failure ended it. procs[0] is the trainer; a dead actor is replaced in `procs`
    when `restarts` allows; `tick` runs every poll (keeps the run's redis alive)."""
    trainer = procs[0]
    actors_gone_at: float | None = None
    while not signals.stop:
        tick()
        failed = next((rp for rp in procs if rp.proc.poll() not in (None, 0)), None)
        if failed is not None:
            again = restarts.try_restart(failed, run_dir, signals) if restarts else None
            if again is not None:
                procs[procs.index(failed)] = again
                continue
            _stop_all(procs, signals)
            print(f"\n{failed.role} failed with exit code {failed.proc.returncode}:\n"
                  f"{_failure_report(failed, run_dir)}", file=sys.stderr)
            return 1, failed.role
        if trainer.proc.poll() == 0:
            # The final weights are saved (and evaluated); the other roles see the stop record
            # and leave on their own.
            _wait_for_exit(procs[1:], ACTORS_LEAVE_S, signals)
            _stop_all(procs, signals)
            print(f"run finished: {run_dir}", file=sys.stderr)
            return 0, None
        # A live evaluator is one the trainer may be waiting on (deferred evaluation works
        # through every snapshot after the actors left); the trainer's own final_timeout_s
        # bounds that wait, so only a trainer left with no other role is stranded.
        if all(rp.proc.poll() == 0 for rp in procs[1:]):
            actors_gone_at = actors_gone_at or time.monotonic()
            if time.monotonic() - actors_gone_at > actors_gone_grace_s:
                _stop_all(procs, signals)
                print("\nevery actor (and the evaluator) exited while the trainer was still "
                      "running", file=sys.stderr)
                return 1, None
        time.sleep(POLL_S)
    return None, None


def _wait_for_exit(procs: list[RoleProcess], timeout_s: float, signals: StopSignals) -> None:
    deadline = time.monotonic() + timeout_s
    while _any_running(procs) and time.monotonic() < deadline and not signals.stop:
        time.sleep(POLL_S)
