"""Ctrl-C and SIGTERM, from the first line the CLI runs to the end of a run.

Only the standard library: the CLI installs `StopSignals` before its heavy imports. Python's
default handler raises KeyboardInterrupt wherever the interpreter is, and one raised inside a
`__del__` or a library's `except BaseException` is swallowed: seen here as a Ctrl-C 1 s after
start, landing in `regex`'s `Group.__del__` while transformers imported, after which the run
went on as if none came. A recorded signal cannot be lost: the launcher checks the record
before it starts anything, and a role before it runs.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """While installed, Ctrl-C and SIGTERM record themselves; the launcher's loop acts on them.
    In interrupting mode the first one also raises KeyboardInterrupt.

    Raising KeyboardInterrupt at an arbitrary point in the launcher's loop could land inside
    `Popen.poll()` and leave subprocess's internal wait lock held, after which `Popen.wait()`
    blocks for ever (or inside an import, which some libraries then re-raise as another error).
    """

    def __init__(self, interrupting: bool = False) -> None:
        self.received: list[int] = []
        self._interrupting = interrupting
        self._previous = {sig: signal.signal(sig, self._record) for sig in STOP_SIGNALS}

    def _record(self, signum: int, frame: object) -> None:
        self.received.append(signum)  # little else: the handler may interrupt any line
        if self._interrupting and len(self.received) == 1:
            raise KeyboardInterrupt

    @contextmanager
    def interrupting(self) -> Iterator[None]:
        """Within, the first signal also raises KeyboardInterrupt: for long computation
        before any role runs (the warm start), which has no loop to check the flag. A signal
        recorded before (its KeyboardInterrupt swallowed, or outside this mode) raises at
        entry. Record-only after it."""
        if self.stop:
            raise KeyboardInterrupt
        self._interrupting = True
        try:
            yield
        finally:
            self._interrupting = False

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def check(self) -> None:
        """Raise KeyboardInterrupt if a signal came (its own KeyboardInterrupt maybe lost)."""
        if self.stop:
            raise KeyboardInterrupt

    def hand_back(self) -> None:
        """Python's default handling from here on, for a command with no loop of its own."""
        self.restore()
        self.check()

    @property
    def stop(self) -> bool:
        return bool(self.received)

    @property
    def force(self) -> bool:
        """A second signal: kill every role at once."""
        return len(self.received) > 1

    @property
    def exit_code(self) -> int:
        return 128 + (self.received[0] if self.received else signal.SIGINT)


def install_role_signal_handlers() -> None:
    """In a role: the first Ctrl-C or SIGTERM unwinds it like Ctrl-C, so `finally` blocks run.

    A later SIGTERM (a terminal's Ctrl-C and a scheduler's SIGTERM often both arrive) is then
    ignored, so it cannot cut that cleanup short; a cleanup that hangs is the launcher's to
    kill. A second Ctrl-C still interrupts it, as a person typing it expects.
    """

    def _first(signum: int, frame: object) -> None:
        # A no-op handler, not SIG_IGN: that would survive exec into processes started later.
        signal.signal(signal.SIGTERM, lambda *_: None)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        raise KeyboardInterrupt

    for sig in STOP_SIGNALS:
        signal.signal(sig, _first)
