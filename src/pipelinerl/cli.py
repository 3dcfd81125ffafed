"""`pipelinerl` command line: `train` runs a whole job; `trainer` / `actor` run one role."""

from __future__ import annotations

# Only the standard library at module level: everything else is imported inside `main`'s
# `try`, so a Ctrl-C while it loads exits like any other (130), not with a traceback or -2.
import argparse
import gc
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from pipelinerl.proc.stop_signals import StopSignals, install_role_signal_handlers

if TYPE_CHECKING:
    from pipelinerl.config import Config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipelinerl", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run a whole job: warm-start if needed, actor(s), trainer")
    train.add_argument("config", help="YAML config file")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=1e-5")
    mode = train.add_mutually_exclusive_group()
    mode.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    train.add_argument("--replay-tools", metavar="RUN_DIR", default=None,
                       help="take the tool replies recorded in RUN_DIR instead of calling "
                       "(tools.replay_from; with deterministic.enabled a rerun is bit for bit)")
    mode.add_argument("--resume", action="store_true",
                      help="continue the run in its directory from its newest checkpoint")
    train.add_argument("--auto-resume", action="store_true",
                       help="resume by itself when the trainer dies (trainer.max_restarts=3 "
                            "unless set)")

    trainer = sub.add_parser("trainer", help="run the trainer role only")
    trainer.add_argument("config")
    trainer.add_argument("overrides", nargs="*")

    actor = sub.add_parser("actor", help="run one actor role only")
    actor.add_argument("config")
    actor.add_argument("overrides", nargs="*")
    actor.add_argument("--actor-id", type=int, default=0)

    evaluator = sub.add_parser("evaluator", help="run the held-out evaluator role only")
    evaluator.add_argument("config")
    evaluator.add_argument("overrides", nargs="*")

    audit = sub.add_parser("audit", help="count a run's groups: published, trained, dropped, "
                                          "lost, duplicated")
    audit.add_argument("run_dir", help="the run directory (output_dir/name)")

    view = sub.add_parser("view", help="browse a run's samples, per-token provenance, held-out "
                                       "completions and health panel in a local page")
    from pipelinerl.viewer.command import add_arguments as view_arguments

    view_arguments(view)

    prepare = sub.add_parser("prepare", help="fetch a known model (or dequantize a .gguf file) "
                                             "into the user cache, once; prints its directory")
    prepare.add_argument("model", help="a known model's name (smollm2) or a .gguf file")

    tools = sub.add_parser("tools", help="list the tools a config offers the model, or call one "
                           "(--call NAME JSON)")
    from pipelinerl.tools.command import add_arguments as tools_arguments

    tools_arguments(tools)

    evaluate = sub.add_parser("eval", help="evaluate a saved model on the task's held-out set")
    evaluate.add_argument("model_dir", help="a local Hugging Face model directory (e.g. RUN/final)")
    evaluate.add_argument("config", help="the YAML config naming the task and the eval section")
    evaluate.add_argument("overrides", nargs="*")

    sandbox = sub.add_parser("sandbox", help="run one program in the sandbox and print its "
                                             "result (status, exit code, output, seconds)")
    sandbox.add_argument("file", help="the program (a .py file runs under python; any other "
                                      "file runs as a command)")
    sandbox.add_argument("--stdin", metavar="FILE", default=None, help="file fed to its stdin")
    sandbox.add_argument("--timeout", type=float, default=None, help="wall-clock seconds")
    sandbox.add_argument("--cpu-seconds", type=float, default=None, help="CPU seconds")
    sandbox.add_argument("--memory-mb", type=int, default=None, help="address space, MiB")
    sandbox.add_argument("--max-procs", type=int, default=None, help="processes and threads")
    sandbox.add_argument("--max-files", type=int, default=None, help="open files")
    sandbox.add_argument("--max-file-mb", type=int, default=None, help="size of a written file")
    sandbox.add_argument("--max-output-kb", type=int, default=None,
                         help="stdout and stderr kept, each")
    sandbox.add_argument("--isolation", default=None,
                         help="'full' (default; refuses where it cannot be had) or 'weak'")
    return p


def _run_role(role: str, cfg: Config, signals: StopSignals, fn, *args) -> int:
    """Run a role; on failure write its traceback where the launcher shows it from."""
    from pipelinerl.roles.launch import ERROR_FILE

    install_role_signal_handlers()
    error_file = cfg.run_dir / "logs" / ERROR_FILE.format(role=role)
    error_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        signals.check()  # a SIGTERM while the role imported, its interrupt swallowed
        fn(cfg, *args)
    except KeyboardInterrupt:
        return 130
    except Exception:
        error_file.write_text(traceback.format_exc())
        if role.startswith("trainer") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            _leave_now(1)
        raise
    return 0


def _leave_now(code: int) -> None:
    """A trainer rank of several, its error written, exits without the interpreter's teardown.
    Its traceback keeps what the failed step's frames held (the DDP model, and through it the
    process group: `destroy_process_group` frees no group still referenced) until that
    teardown; one that waits for the other ranks (an NCCL communicator, a collective in
    flight) would hold this rank, and the others waiting for it in a collective, for the
    collective timeout (30 min), unseen by torchrun, which stops the others once one exited."""
    traceback.print_exc()
    _exit_now(code)


def _exit_now(code: int) -> None:
    """Exit with `code` at once, logs and output flushed, no interpreter teardown."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    # Installed before any heavy import, record-only: a Ctrl-C during an import is acted on
    # once the imports are done. A KeyboardInterrupt raised inside one can abort the process
    # (in torch's import, through pybind11: SIGABRT), or come back as another error
    # (transformers' lazy modules), or be swallowed (stop_signals.py).
    signals = StopSignals()
    try:
        return _main(argv, signals)
    except KeyboardInterrupt:
        # Ctrl-C before the launcher took over its signals (while importing, say): the same
        # quiet exit as after, never a traceback.
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        if not signals.stop:  # after one, the process is exiting: a further Ctrl-C stays quiet
            signals.restore()


def _main(argv: list[str] | None, signals: StopSignals) -> int:
    parser = _parser()
    # Overrides may follow an option (`train CONFIG --overwrite key=value`): argparse leaves
    # those unparsed, and they join the others.
    args, rest = parser.parse_known_args(argv)
    unknown = [item for item in rest if item.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if rest:
        args.overrides = [*args.overrides, *rest]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "audit":
        from pipelinerl.run.audit import main as audit_main

        signals.hand_back()
        return audit_main(args.run_dir)
    if args.command == "view":
        from pipelinerl.viewer.command import main as view_main

        signals.hand_back()
        return view_main(args)
    if args.command == "sandbox":
        from pipelinerl.sandbox.command import main as sandbox_main

        signals.hand_back()
        return sandbox_main(args)
    from pipelinerl.models.hf import ModelPathError
    from pipelinerl.models.sources import prepare, resolve_model_path

    signals.check()  # a Ctrl-C while torch and transformers imported
    if args.command in ("prepare", "eval"):
        signals.hand_back()
    if args.command == "prepare":
        try:
            print(prepare(args.model))
        except ModelPathError as err:
            print(f"pipelinerl prepare: {err}", file=sys.stderr)
            return 2
        return 0
    from pipelinerl.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
        # Every role loads the HF directory a .gguf file or a prepared model's name stands for.
        cfg.model.path = resolve_model_path(cfg.model.path)
        if args.command == "eval":
            args.model_dir = resolve_model_path(args.model_dir)
        if args.command == "train" and args.replay_tools:
            replay = Path(args.replay_tools).absolute()
            if not (replay / "tool_replies").is_dir():
                print(f"pipelinerl: --replay-tools {args.replay_tools}: no tool_replies/ there "
                      "(a run directory of a run with tools)", file=sys.stderr)
                return 2
            cfg.tools.replay_from = str(replay)
    except ConfigError as err:
        print(f"pipelinerl: {err}", file=sys.stderr)
        return 2
    except ModelPathError as err:
        print(f"pipelinerl: {err}", file=sys.stderr)
        return 2
    if args.command == "train":
        import shlex

        from pipelinerl.roles.launch import launch

        again = shlex.join(["pipelinerl", "train", args.config, *args.overrides, "--resume"])
        if args.auto_resume and not cfg.trainer.max_restarts:
            cfg.trainer.max_restarts = 3
        return launch(cfg, overwrite=args.overwrite, resume=args.resume, resume_command=again,
                      signals=signals)
    if args.command == "tools":
        from pipelinerl.tools.command import main as tools_main

        signals.hand_back()
        return tools_main(cfg, args.call)
    if args.command == "eval":
        from pipelinerl.roles.heldout import evaluate_saved_model

        return evaluate_saved_model(args.model_dir, cfg)
    if not cfg.run_id:
        from pipelinerl.roles.wiring import MISSING_RUN_ID

        print(f"pipelinerl {args.command}: {MISSING_RUN_ID}", file=sys.stderr)
        return 2
    if args.command == "evaluator":
        from pipelinerl.roles.evaluator import run_evaluator

        return _run_role("evaluator", cfg, signals, run_evaluator)
    if args.command == "trainer":
        from pipelinerl.roles.trainer import run_trainer

        rank = os.environ.get("RANK", "0")
        role = "trainer" if rank == "0" else f"trainer_rank{rank}"
        return _run_role(role, cfg, signals, run_trainer)
    from pipelinerl.roles.actor import run_actor

    return _run_role(f"actor_{args.actor_id}", cfg, signals, run_actor, args.actor_id)


def run() -> None:
    """The process's entry (the `pipelinerl` script, `python -m pipelinerl.cli`)."""
    try:
        code = main()
    except BaseException:
        gc.freeze()  # as below: a role that failed ends as soon as one that finished
        raise
    if code in (130, 143):  # 128 + SIGINT, 128 + SIGTERM: interrupted, everything cleaned up
        # CPython ends a process by SIGINT at exit (code -2) once a KeyboardInterrupt crossed
        # an embedded PyRun call (pybind11's exec while torch imports), even one handled since:
        # seen in 3 of 30 Ctrl-Cs 1-2 s after start. The code is set directly instead.
        _exit_now(code)
    # The process is ending: the interpreter's last collections over torch's and transformers'
    # objects would take 2-3 s (5 s and more on a loaded machine) after a launcher or a role
    # is done, and the OS frees that memory anyway. atexit handlers and threads are kept.
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
