"""The sandbox: one untrusted program run isolated, with limits, to a typed result.

`run_python(source)`, `run_file(path)`, `run_command(argv)` -> `Result` (status ok / error /
timeout / memory / output_limit / killed, exit code, signal, stdout, stderr, seconds).
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

__all__ = ["Isolation", "Limits", "Result", "SandboxUnavailable", "Status", "check_isolation",
           "run_command", "run_file", "run_python"]
