"""`pipelinerl sandbox FILE [--stdin F] [limits]`: run one program in the sandbox and print
how it ended, so a user can see what the limits do to their own code."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipelinerl.sandbox.core import Limits, Result

_LIMIT_OPTIONS = {  # argparse destination -> Limits field
    "timeout": "timeout_s",
    "cpu_seconds": "cpu_seconds",
    "memory_mb": "memory_mb",
    "max_procs": "max_procs",
    "max_files": "max_files",
    "max_file_mb": "max_file_mb",
    "max_output_kb": "max_output_kb",
}


def main(args: argparse.Namespace) -> int:
    """Run `args.file`; print its result. 0 when it ended ok, 1 otherwise, 2 on bad input."""
    from pipelinerl.sandbox import Limits, SandboxUnavailable, run_file

    try:
        limits = Limits(**{field: getattr(args, dest) for dest, field in _LIMIT_OPTIONS.items()
                           if getattr(args, dest) is not None})
        stdin = _read_stdin(args.stdin)
        result = run_file(args.file, stdin=stdin, limits=limits,
                          isolation=args.isolation or "full")
    except (ValueError, OSError, SandboxUnavailable) as err:
        print(f"pipelinerl sandbox: {err}", file=sys.stderr)
        return 2
    print(format_result(result, limits))
    return 0 if result.ok else 1


def _read_stdin(path: str | None) -> bytes:
    if path is None:
        return b""
    with open(path, "rb") as f:
        return f.read()


def format_result(result: Result, limits: Limits) -> str:
    """The result as a few labelled lines, then stdout and stderr in full (as captured)."""
    ended = result.status if result.signal is None else f"{result.status} (signal " \
        f"{result.signal})"
    limit_text = ", ".join(f"{f.name}={getattr(limits, f.name)}" for f in fields(limits))
    lines = [f"status:    {ended}",
             f"exit code: {result.exit_code if result.exit_code is not None else '-'}",
             f"seconds:   {result.seconds:.3f}",
             f"limits:    {limit_text}",
             "--- stdout ---", escape_controls(result.stdout.rstrip("\n")),
             "--- stderr ---", escape_controls(result.stderr.rstrip("\n"))]
    return "\n".join(lines)


# Control characters but newline and tab, and the bidirectional overrides: what a program
# could print to rewrite the lines above it on a person's terminal (`status: ok`).
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e"
                       "\u2066-\u2069]")


def escape_controls(text: str) -> str:
    """`text` with each control character shown as its escape (`\\x1b`, `\\u202e`)."""
    return _CONTROLS.sub(lambda m: repr(m.group())[1:-1], text)
