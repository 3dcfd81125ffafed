"""Run one untrusted program under bubblewrap, with limits, and read back a typed result.

The program sees a read-only /usr (and /lib*, the interpreter's prefix), its own /proc, a
minimal read-only /dev, and one writable tmpfs scratch directory (its cwd, HOME and TMPDIR)
that vanishes with it. It runs in its own PID, network (loopback only), IPC, UTS and mount
namespaces, as uid/gid 65534 with no capabilities, in a clean environment. Its limits are
set by util-linux's `prlimit` inside the sandbox, after its user namespace exists, so the
process count (RLIMIT_NPROC, counted per uid *per user namespace* since Linux 5.14) is this
sandbox's own and not shared with concurrent ones. docs/code.md.
"""

from __future__ import annotations

import fcntl
import math
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import BinaryIO, Literal

Isolation = Literal["full", "weak"]
Status = Literal["ok", "error", "timeout", "memory", "output_limit", "killed"]

SANDBOX_UID = 65534  # "nobody": owns nothing on the host
SCRATCH = "/scratch"
PROGRAM_DIR = "/program"
_SIGNALLED = 128  # bwrap (and a shell) report death by signal N as exit code 128 + N
_GRACE_S = 2.0  # after the deadline, for the kill to land and the pipes to close


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot be had on this machine."""


@dataclass(frozen=True)
class Limits:
    """What one program may use. `cpu_seconds` None: as many as `timeout_s`, rounded up."""

    timeout_s: float = 10.0
    cpu_seconds: float | None = None
    memory_mb: int = 512
    max_procs: int = 64
    max_files: int = 64
    max_file_mb: int = 16
    max_output_kb: int = 1024
    scratch_mb: int = 64

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_mb", "max_procs", "max_files", "max_file_mb",
                     "max_output_kb", "scratch_mb"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive number, got {value!r}")
        if self.cpu_seconds is not None and not self.cpu_seconds > 0:
            raise ValueError(f"Limits.cpu_seconds must be positive or None, "
                             f"got {self.cpu_seconds!r}")

    @property
    def cpu_limit_s(self) -> int:
        return math.ceil(self.cpu_seconds if self.cpu_seconds is not None else self.timeout_s)


@dataclass(frozen=True)
class Result:
    """How a sandboxed program ended. `signal` is set when it was killed by one."""

    status: Status
    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_python(source: str, *, stdin: str | bytes = b"", limits: Limits = Limits(),
               isolation: Isolation = "full", filename: str = "main.py") -> Result:
    """Run Python `source` under this machine's interpreter (`-I -S`: isolated, standard
    library only) in the sandbox, as /program/`filename` (the name its tracebacks show)."""
    program = _program_path(filename)
    argv = [_interpreter(), "-I", "-S", "-X", "utf8", program]
    return _run(argv, {program: (source.encode(), 0o444)}, stdin, limits, isolation)


def _program_path(filename: str) -> str:
    """Where a Python program appears in the sandbox (its tracebacks name it)."""
    if not re.fullmatch(r"[\w.-]+\.py", filename):
        raise ValueError(f"filename must be a plain name ending in .py, got {filename!r}")
    return f"{PROGRAM_DIR}/{filename}"


def run_file(path: str | Path, *, stdin: str | bytes = b"", limits: Limits = Limits(),
             isolation: Isolation = "full") -> Result:
    """Run the program in `path`: a .py file under Python, any other as a command (its
    first line names its interpreter, `#!/usr/bin/...`, or it is a binary)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no program file {str(path)!r}")
    if path.suffix == ".py":
        return run_python(path.read_text(), stdin=stdin, limits=limits, isolation=isolation,
                          filename=path.name)
    program = f"{PROGRAM_DIR}/{path.name}"
    return _run([program], {program: (path.read_bytes(), 0o555)}, stdin, limits, isolation)


def run_command(argv: list[str], *, stdin: str | bytes = b"", limits: Limits = Limits(),
                isolation: Isolation = "full") -> Result:
    """Run `argv` (a program the sandbox sees: under /usr or the interpreter's prefix)."""
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}")
    return _run(list(argv), {}, stdin, limits, isolation)


def check_isolation(isolation: Isolation = "full") -> None:
    """Raise SandboxUnavailable, naming the setting that accepts a weaker mode, where the
    full isolation cannot be had; a ValueError for an unknown mode."""
    if isolation not in ("full", "weak"):
        raise ValueError(f"isolation must be 'full' or 'weak', got {isolation!r}")
    if isolation == "full":
        problem = _full_isolation_problem()
        if problem:
            raise SandboxUnavailable(
                f"the sandbox cannot isolate programs here: {problem}. Install bubblewrap "
                f"(`make sandbox`), or accept the weaker mode with isolation='weak' (CLI: "
                f"--isolation weak; it keeps the limits, the clean environment and the "
                f"scratch directory, but not the namespaces: docs/code.md)")


@cache
def _full_isolation_problem() -> str:
    """Why full isolation is impossible here, or '' (tried once: a real sandbox runs /bin/true)."""
    if not sys.platform.startswith("linux"):
        return f"it needs Linux namespaces, and this is {sys.platform}"
    for tool in ("bwrap", "prlimit") + (("setpriv", "unshare") if os.getuid() == 0 else ()):
        if shutil.which(tool) is None:
            return f"{tool!r} is not on PATH"
    trial = subprocess.run(_bwrap_argv({}) + ["/bin/true"], capture_output=True, text=True,
                           timeout=30)
    if trial.returncode != 0:
        return (f"bubblewrap failed ({trial.stderr.strip() or trial.returncode}); user "
                f"namespaces may be off (sysctl user.max_user_namespaces, "
                f"kernel.unprivileged_userns_clone) or blocked by a container's seccomp")
    return ""


def _interpreter() -> str:
    return os.path.realpath(sys.executable)


def _readonly_roots() -> list[str]:
    """Host directories bound read-only: /usr and the interpreter's prefix (its libraries)."""
    roots = ["/usr"]
    for path in (os.path.realpath(sys.base_prefix), os.path.dirname(_interpreter())):
        if not any(path == r or path.startswith(r + "/") for r in roots):
            roots.append(path)
    return roots


def _bwrap_argv(program_fds: dict[str, tuple[int, int]]) -> list[str]:
    """bubblewrap's arguments up to the command; `program_fds` maps a sandbox path to the fd
    its read-only contents are copied from and its mode."""
    # Resolved here: the sandbox is started with an empty environment, hence no PATH.
    argv = [shutil.which("bwrap") or "bwrap", "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session"]
    as_root = os.getuid() == 0
    if as_root:
        # bwrap as root maps the sandbox's uid back to root; instead it keeps the host's user
        # namespace and `setpriv` drops to uid 65534 before the program's own user namespace.
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--disable-userns", "--uid", str(SANDBOX_UID),
                 "--gid", str(SANDBOX_UID)]
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(name):
            argv += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            argv += ["--ro-bind", name, name]
    for root in _readonly_roots():
        argv += _parents_traversable(root) + ["--ro-bind", root, root]
    for dest, (fd, mode) in program_fds.items():
        argv += ["--perms", f"{mode:04o}", "--ro-bind-data", str(fd), dest]
    argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
    return argv


def _parents_traversable(path: str) -> list[str]:
    """--dir entries making `path`'s parents 0755 in the sandbox (bwrap copies the host's
    modes, and /root is 0700: uid 65534 could not reach an interpreter under it)."""
    parts = Path(path).parents
    return [arg for parent in reversed(list(parts)[:-1])
            for arg in ("--perms", "0755", "--dir", str(parent))]


def _sandbox_argv(argv: list[str], program_fds: dict[str, tuple[int, int]],
                  limits: Limits, apply_limits: bool = True) -> list[str]:
    """The whole command; `apply_limits` False leaves the limits (but the scratch size) to
    the command itself (the fork server sets each program's)."""
    scratch_bytes = limits.scratch_mb << 20
    full = _bwrap_argv(program_fds) + [
        "--perms", "0777", "--size", str(scratch_bytes), "--tmpfs", SCRATCH,
        "--remount-ro", "/", "--chdir", SCRATCH, "--clearenv"]
    for key, value in _environment().items():
        full += ["--setenv", key, value]
    if os.getuid() == 0:
        full += ["setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}",
                 "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs",
                 "unshare", "--user", "--"]
    return full + (_prlimit_argv(limits) if apply_limits else []) + argv


def _environment() -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SCRATCH, "TMPDIR": SCRATCH,
            "LANG": "C.UTF-8"}


def _prlimit_argv(limits: Limits) -> list[str]:
    cpu = limits.cpu_limit_s
    memory = limits.memory_mb << 20
    file_size = limits.max_file_mb << 20
    # The soft CPU limit sends SIGXCPU; the hard one, a second later, SIGKILL.
    return ["prlimit", f"--cpu={cpu}:{cpu + 1}", f"--as={memory}", f"--nproc={limits.max_procs}",
            f"--nofile={limits.max_files}", f"--fsize={file_size}", "--core=0", "--"]


def _memfd(name: str, data: bytes) -> int:
    """An anonymous in-memory file holding `data`, positioned at its start: nothing on disk;
    sealed, so the program given it as stdin can neither change nor grow it."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    _write_all(fd, data)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW
                | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _run(argv: list[str], programs: dict[str, tuple[bytes, int]], stdin: str | bytes,
         limits: Limits, isolation: Isolation) -> Result:
    check_isolation(isolation)
    stdin_fd = _memfd("stdin", stdin.encode() if isinstance(stdin, str) else bytes(stdin))
    fds = {dest: (_memfd("program", data), mode) for dest, (data, mode) in programs.items()}
    try:
        if isolation == "full":
            return _execute(_sandbox_argv(argv, fds, limits), stdin_fd,
                            [fd for fd, _mode in fds.values()], limits, cwd=None, weak=False)
        with tempfile.TemporaryDirectory(prefix="pipelinerl-sandbox-") as scratch:
            weak_argv = _weak_argv(argv, programs, scratch, limits)
            return _execute(weak_argv, stdin_fd, [], limits, cwd=scratch, weak=True)
    finally:
        for fd in [stdin_fd, *(fd for fd, _mode in fds.values())]:
            os.close(fd)


def _weak_argv(argv: list[str], programs: dict[str, tuple[bytes, int]], scratch: str,
               limits: Limits) -> list[str]:
    """The weak mode's command: the programs copied into the scratch directory, the limits
    still applied by prlimit; no namespaces."""
    moved = {}
    for dest, (data, mode) in programs.items():
        local = Path(scratch) / Path(dest).name
        local.write_bytes(data)
        local.chmod(mode)
        moved[dest] = str(local)
    return _prlimit_argv(limits) + [moved.get(a, a) for a in argv]


def _execute(argv: list[str], stdin_fd: int, pass_fds: list[int], limits: Limits,
             cwd: str | None, weak: bool) -> Result:
    start = time.monotonic()
    env = dict(_environment(), HOME=cwd, TMPDIR=cwd) if weak else {}
    proc = subprocess.Popen(argv, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            pass_fds=pass_fds, cwd=cwd, env=env, start_new_session=True)
    cap = limits.max_output_kb << 10
    try:
        out, err, over, timed_out = _read_capped(proc.stdout, proc.stderr, cap,
                                                 start + limits.timeout_s)
        if over or timed_out:
            _kill(proc, weak)
        try:
            code = proc.wait(timeout=_GRACE_S)
        except subprocess.TimeoutExpired:
            _kill(proc, weak)
            code = proc.wait()
    finally:
        if weak:
            _kill(proc, weak)  # whatever the program left in its session
        proc.stdout.close()
        proc.stderr.close()
    seconds = time.monotonic() - start
    stdout = out[:cap].decode(errors="replace")
    stderr = err[:cap].decode(errors="replace")
    return _result(code, stdout, stderr, seconds, over, timed_out)


def _read_capped(stdout: BinaryIO, stderr: BinaryIO, cap: int, deadline: float
                 ) -> tuple[bytearray, bytearray, bool, bool]:
    """Read stdout and stderr until both close, one passes `cap` bytes (over) or the
    deadline passes (timed out); past the cap nothing more is read."""
    buffers = {stdout: bytearray(), stderr: bytearray()}
    with selectors.DefaultSelector() as selector:
        for stream in buffers:
            os.set_blocking(stream.fileno(), False)
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return buffers[stdout], buffers[stderr], False, True
            for key, _ in selector.select(timeout=remaining):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = buffers[key.fileobj]
                buffer += chunk
                if len(buffer) > cap:
                    return buffers[stdout], buffers[stderr], True, False
    return buffers[stdout], buffers[stderr], False, False


def _kill(proc: subprocess.Popen, weak: bool) -> None:
    """End the program and all it started: bubblewrap's death takes its PID namespace with
    it; the weak mode can only kill the program's session (its process group)."""
    try:
        if weak:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except ProcessLookupError:
        pass


def _result(code: int, stdout: str, stderr: str, seconds: float, over: bool,
            timed_out: bool) -> Result:
    signum = -code if code < 0 else (code - _SIGNALLED if _SIGNALLED < code < _SIGNALLED + 65
                                     else None)
    exit_code = None if code < 0 else code
    status = _status(exit_code, signum, stderr, over, timed_out)
    return Result(status, exit_code, signum, stdout, stderr, round(seconds, 4))


def _status(exit_code: int | None, signum: int | None, stderr: str, over: bool,
            timed_out: bool) -> Status:
    if over:
        return "output_limit"
    if timed_out or signum == signal.SIGXCPU:
        return "timeout"
    if exit_code == 0:
        return "ok"
    if _last_line(stderr).startswith("MemoryError"):
        return "memory"
    return "killed" if signum is not None else "error"


def _last_line(text: str) -> str:
    lines = text.rstrip().splitlines()
    return lines[-1] if lines else ""
