"""Run one untrusted program under bubblewrap, with limits, and read back a typed result.

The program sees a read-only /usr (and /lib*, the interpreter's prefix), its own /proc, a
minimal read-only /dev, and one writable tmpfs scratch directory (its cwd, HOME and TMPDIR)
that vanishes with it. It runs in its own PID, network (loopback only), IPC, UTS and mount
namespaces, as uid/gid 65534 with no capabilities, in a clean environment, under an empty
session keyring of its own. A root caller gives each concurrent sandbox a host uid of its own
(`UidSlots`), so that what the kernel counts per uid (processes, inotify instances, keys,
queued signals) is not shared between sandboxes. Every resource limit is set explicitly by
util-linux's `prlimit` inside the sandbox, after its user namespace exists. docs/code.md.
"""

from __future__ import annotations

import ctypes
import fcntl
import math
import os
import re
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import cache
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Literal

Isolation = Literal["full", "weak"]
Status = Literal["ok", "error", "timeout", "memory", "output_limit", "killed"]

SANDBOX_UID = 65534  # "nobody", the uid a program sees; a caller that is not root maps it
# A root caller runs each concurrent sandbox as host uid UID_BASE + slot (UidSlots): below
# 2^31 and systemd's "foreign" range, above every range Debian or systemd hands out.
UID_BASE = 2_147_000_000
UID_SLOTS = 4096
SCRATCH = "/scratch"
PROGRAM_DIR = "/program"
# A Python program's str hashes (set order, dict order of hashed keys) are the same in every
# run: `-I` would ignore PYTHONHASHSEED, so the flags are its parts but -E (the environment is
# the sandbox's own, cleared: nothing of the caller's is read).
PYTHON_FLAGS = ["-s", "-S", "-P", "-X", "utf8"]
HASH_SEED = "0"
_SIGNALLED = 128  # bwrap (and a shell) report death by signal N as exit code 128 + N
_GRACE_S = 2.0  # after the deadline, for the kill to land and the pipes to close
TICK_S = 0.01  # how often the scratch directory's files are counted while a program runs
# keyctl(2)'s syscall number, where known: without it the caller's session keyring is shared.
KEYCTL = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)
_KEYCTL_JOIN_SESSION_KEYRING = 1


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
    scratch_files: int = 10_000

    def __post_init__(self) -> None:
        for name in ("timeout_s", "memory_mb", "max_procs", "max_files", "max_file_mb",
                     "max_output_kb", "scratch_mb", "scratch_files"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive number, got {value!r}")
        if self.cpu_seconds is not None and not self.cpu_seconds > 0:
            raise ValueError(f"Limits.cpu_seconds must be positive or None, "
                             f"got {self.cpu_seconds!r}")

    @property
    def cpu_limit_s(self) -> int:
        return math.ceil(self.cpu_seconds if self.cpu_seconds is not None else self.timeout_s)


def rlimits(limits: Limits) -> dict[str, tuple[int, int]]:
    """Every resource limit a program runs under (soft, hard), by `prlimit`'s option name: all
    sixteen, so nothing is inherited from whoever started the sandbox. None is above this
    process's own hard limit (a limit cannot be raised without privilege)."""
    cpu = limits.cpu_limit_s
    memory = limits.memory_mb << 20
    wanted = {
        "cpu": (cpu, cpu + 1),  # soft: SIGXCPU; hard, a second later: SIGKILL
        "fsize": (limits.max_file_mb << 20,) * 2,
        "data": (memory,) * 2,
        "stack": (8 << 20,) * 2,
        "core": (0, 0),
        "rss": (resource.RLIM_INFINITY,) * 2,  # not enforced by Linux; set so it is not inherited
        "nproc": (limits.max_procs,) * 2,
        "nofile": (limits.max_files,) * 2,
        "memlock": (64 << 10,) * 2,
        "as": (memory,) * 2,
        "locks": (limits.max_files,) * 2,
        "sigpending": (256,) * 2,
        "msgqueue": (0, 0),  # no POSIX message queues: they would outlive the program
        "nice": (0, 0),
        "rtprio": (0, 0),
        "rttime": (cpu * 1_000_000,) * 2,
    }
    return {name: _within_hard(RLIMIT_NUMBERS[name], soft, hard)
            for name, (soft, hard) in wanted.items()}


# Linux's resource numbers (asm-generic/resource.h), by prlimit's option name.
RLIMIT_NUMBERS = {"cpu": 0, "fsize": 1, "data": 2, "stack": 3, "core": 4, "rss": 5, "nproc": 6,
                  "nofile": 7, "memlock": 8, "as": 9, "locks": 10, "sigpending": 11,
                  "msgqueue": 12, "nice": 13, "rtprio": 14, "rttime": 15}


def _within_hard(number: int, soft: int, hard: int) -> tuple[int, int]:
    own_hard = resource.getrlimit(number)[1]
    if own_hard == resource.RLIM_INFINITY:
        return soft, hard
    capped_hard = own_hard if hard == resource.RLIM_INFINITY else min(hard, own_hard)
    capped_soft = capped_hard if soft == resource.RLIM_INFINITY else min(soft, capped_hard)
    return capped_soft, capped_hard


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
    """Run Python `source` under this machine's interpreter (`-s -S -P`: isolated, standard
    library only, a fixed hash seed) in the sandbox, as /program/`filename` (the name its
    tracebacks show)."""
    program = _program_path(filename)
    argv = [_interpreter(), *PYTHON_FLAGS, program]
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
    if os.getuid() == 0:
        try:
            release_uid(acquire_uid())
        except OSError as error:
            return f"no sandbox uid could be held in {UID_SLOTS_DIR} ({error})"
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
                  limits: Limits, uid: int | None, apply_limits: bool = True,
                  as_pid_1: bool = False) -> list[str]:
    """The whole command. `uid`: the host uid a root caller runs the program as (None for a
    caller that is not root: bubblewrap maps 65534 to the caller). `apply_limits` False
    leaves the limits (but the scratch size) to the command itself (the fork server sets
    each program's); `as_pid_1` makes the command pid 1 of the sandbox (the fork server)."""
    scratch_bytes = limits.scratch_mb << 20
    full = _bwrap_argv(program_fds) + (["--as-pid-1"] if as_pid_1 else []) + [
        "--perms", "0777", "--size", str(scratch_bytes), "--tmpfs", SCRATCH,
        "--remount-ro", "/", "--chdir", SCRATCH, "--clearenv"]
    for key, value in _environment().items():
        full += ["--setenv", key, value]
    if os.getuid() == 0:
        if uid is None:
            raise ValueError("a root caller runs each sandbox as a uid of its own (UidSlots)")
        full += ["setpriv", f"--reuid={uid}", f"--regid={uid}",
                 "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs",
                 "unshare", "--user", "--"]
    return full + (_prlimit_argv(limits) if apply_limits else []) + argv


def _environment() -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SCRATCH, "TMPDIR": SCRATCH,
            "LANG": "C.UTF-8", "PYTHONHASHSEED": HASH_SEED}


def _prlimit_argv(limits: Limits) -> list[str]:
    return ["prlimit", *(f"--{name}={soft}:{hard}" for name, (soft, hard)
                         in rlimits(limits).items()), "--"]


class UidSlots:
    """Host uids for a root caller's sandboxes, one per sandbox alive at a time on the
    machine: slot k is uid UID_BASE + k, held by an flock on a file of its own (so that other
    processes' sandboxes take other slots), and reused within this process once freed."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._free: list[int] = []
        self._held: dict[int, int] = {}  # slot -> its lock file's descriptor
        self._lock = threading.Lock()

    def acquire(self) -> int:
        with self._lock:
            if self._free:
                return UID_BASE + self._free.pop()
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            for slot in range(UID_SLOTS):
                if slot in self._held:
                    continue
                fd = os.open(os.path.join(self.directory, f"{slot}.lock"),
                             os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self._held[slot] = fd
                return UID_BASE + slot
        raise SandboxUnavailable(f"all {UID_SLOTS} sandbox uids are in use "
                                 f"(locks in {self.directory})")

    def release(self, uid: int) -> None:
        with self._lock:
            self._free.append(uid - UID_BASE)


UID_SLOTS_DIR = "/run/pipelinerl-sandbox-uids"
_uid_slots = UidSlots(UID_SLOTS_DIR)


def acquire_uid() -> int | None:
    """A host uid for one sandbox (None for a caller that is not root: it has only its own)."""
    return _uid_slots.acquire() if os.getuid() == 0 else None


def release_uid(uid: int | None) -> None:
    if uid is not None:
        _uid_slots.release(uid)


class Spawned:
    """A sandbox's bubblewrap, started from a thread of its own that first joined a new,
    empty session keyring: the sandbox inherits that one, not the caller's (which holds
    whatever an ssh login or a systemd service put there; a session keyring belongs to a
    thread, so the caller's own is untouched). bubblewrap dies with the thread that started
    it (--die-with-parent), so that thread lives until `release()` or until the thread that
    asked for the sandbox ends (`on_owner_end` is called then)."""

    def __init__(self, argv: list[str], on_owner_end: Callable[[], object] | None = None,
                 **popen_kwargs) -> None:
        owner = threading.current_thread()
        self._released = threading.Event()
        started = threading.Event()
        outcome: dict[str, object] = {}

        def spawn() -> None:
            try:
                _join_new_session_keyring()
                outcome["proc"] = subprocess.Popen(argv, **popen_kwargs)
            except BaseException as error:  # noqa: BLE001 - raised again in the caller's thread
                outcome["error"] = error
            started.set()
            while not self._released.wait(0.5):
                if not owner.is_alive():
                    if on_owner_end is not None:
                        on_owner_end()
                    return

        threading.Thread(target=spawn, name="sandbox-spawn", daemon=True).start()
        started.wait()
        if "error" in outcome:
            raise outcome["error"]  # type: ignore[misc]
        self.proc: subprocess.Popen = outcome["proc"]  # type: ignore[assignment]

    def release(self) -> None:
        """The sandbox is over (or being killed): its thread may end."""
        self._released.set()


@cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _join_new_session_keyring() -> None:
    if KEYCTL is None:
        return
    if _libc().syscall(KEYCTL, _KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        raise OSError(ctypes.get_errno(), "keyctl(JOIN_SESSION_KEYRING) failed")


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
            uid = acquire_uid()
            try:
                return _execute(_sandbox_argv(argv, fds, limits, uid), stdin_fd,
                                [fd for fd, _mode in fds.values()], limits, cwd=None,
                                weak=False)
            finally:
                release_uid(uid)
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
    deadline = start + limits.timeout_s
    env = dict(_environment(), HOME=cwd, TMPDIR=cwd) if weak else {}
    spawned = Spawned(argv, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      pass_fds=pass_fds, cwd=cwd, env=env, start_new_session=True)
    proc = spawned.proc
    cap = limits.max_output_kb << 10
    watch = (lambda: False) if weak else ScratchWatch(proc.pid, limits)
    try:
        out, err, over, timed_out, files_over = _read_capped(proc.stdout, proc.stderr, cap,
                                                             deadline, watch)
        if files_over:
            err += _too_many_files(limits.scratch_files)
            _kill(proc, weak)
        elif not (over or timed_out):
            try:  # a program that closed its stdout and stderr still ends at the deadline
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
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
        spawned.release()
    seconds = time.monotonic() - start
    stdout = out[:cap].decode(errors="replace")
    stderr = err[:cap].decode(errors="replace")
    exit_code, signum = _from_exit_code(code)
    return result(exit_code, signum, stdout, stderr, seconds, over, timed_out)


def _read_capped(stdout: BinaryIO, stderr: BinaryIO, cap: int, deadline: float,
                 files_over: Callable[[], bool] = lambda: False
                 ) -> tuple[bytearray, bytearray, bool, bool, bool]:
    """Read stdout and stderr until both close, one passes `cap` bytes (over), the deadline
    passes (timed out) or, checked every TICK_S, `files_over()`; past the cap nothing more
    is read. Returns (stdout, stderr, over, timed out, files over)."""
    buffers = {stdout: bytearray(), stderr: bytearray()}
    with selectors.DefaultSelector() as selector:
        for stream in buffers:
            os.set_blocking(stream.fileno(), False)
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return buffers[stdout], buffers[stderr], False, True, False
            for key, _ in selector.select(timeout=min(remaining, TICK_S)):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = buffers[key.fileobj]
                buffer += chunk
                if len(buffer) > cap:
                    return buffers[stdout], buffers[stderr], True, False, False
            if files_over():
                return buffers[stdout], buffers[stderr], False, False, True
    return buffers[stdout], buffers[stderr], False, False, False


class ScratchWatch:
    """Whether a bubblewrap sandbox's scratch tmpfs holds more than `limit` files, read from
    the host through its init's root (/proc/PID/root); bubblewrap's tmpfs has no inode bound.
    Only a file system of the scratch's exact size counts (before bubblewrap mounts it, the
    path leads to the host's). Where the host cannot look (no permission), never over."""

    def __init__(self, bwrap_pid: int, limits: Limits) -> None:
        self.bwrap_pid, self.limit = bwrap_pid, limits.scratch_files
        self.size = limits.scratch_mb << 20
        self._scratch: str | None = None

    def __call__(self) -> bool:
        try:
            if self._scratch is None:
                with open(f"/proc/{self.bwrap_pid}/task/{self.bwrap_pid}/children") as kids:
                    first = kids.read().split()[:1]
                if not first:
                    return False
                self._scratch = f"/proc/{first[0]}/root{SCRATCH}"
            stats = os.statvfs(self._scratch)
        except OSError:  # not started yet, ended, or not ours to look into
            return False
        return (stats.f_blocks * stats.f_frsize == self.size
                and stats.f_files - stats.f_ffree > self.limit)


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


def _too_many_files(limit: int) -> bytes:
    return (f"\nsandbox: killed: more than {limit} files in the scratch directory "
            f"(Limits.scratch_files)\n").encode()


def _from_exit_code(code: int) -> tuple[int | None, int | None]:
    """(exit code, signal) from a Popen return code: negative for a signal; bubblewrap (and a
    shell) report a signal N of their child as 128 + N, so a program's own exit codes 129-192
    read as signals here (the fork server has the real wait status)."""
    if code < 0:
        return None, -code
    if _SIGNALLED < code < _SIGNALLED + 65:
        return code, code - _SIGNALLED
    return code, None


def result(exit_code: int | None, signum: int | None, stdout: str, stderr: str,
           seconds: float, over: bool, timed_out: bool) -> Result:
    """A Result from how the program ended: one rule for every path (status: `_status`)."""
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
