"""The sandbox: one untrusted program run isolated, with limits, to a typed result.

`run_python(source)`, `run_file(path)`, `run_command(argv)` -> `Result` (status ok / error /
timeout / memory / output_limit / killed, exit code, signal, stdout, stderr, seconds).
`ForkServer` runs Python programs one at a time in one warm sandboxed interpreter (a child
forked per program; everything of it removed, and the server checked, before the next).
`check_isolation()` refuses at start where bubblewrap's isolation cannot be had, naming
`isolation='weak'`. Guarantees and limits: docs/code.md.
"""

from pipelinerl.sandbox.core import (
    Isolation,
    Limits,
    Result,
    SandboxUnavailable,
    Status,
    check_isolation,
    run_command,
    run_file,
    run_python,
)
from pipelinerl.sandbox.server import ForkServer

__all__ = ["ForkServer", "Isolation", "Limits", "Result", "SandboxUnavailable", "Status",
           "check_isolation", "run_command", "run_file", "run_python"]
