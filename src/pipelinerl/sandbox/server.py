"""A fork server: one warm interpreter in one sandbox, forking a child per Python program.

`run_python` starts a sandbox and an interpreter per program; most of a short program's cost
is that start. A `ForkServer` starts both once: its interpreter, pid 1 of the sandbox's PID
namespace, forks a child per program, in a fresh scratch subdirectory, a session and an
empty session keyring of its own, with every resource limit set. Programs run one at a time.

What one program could leave for the next is checked after each: the server kills every
other process, empties the scratch directory, removes System V IPC objects and clears the
keyrings its uid reaches, then compares itself with its start (priority, scheduling,
affinity, every resource limit, keyrings) and looks for a socket something still holds; on
any difference it reports why and exits, and the caller starts a new sandbox before the next
run. As pid 1 it receives no signal from a program (no handler: the kernel drops them), and
it is not dumpable (no ptrace, no reading its memory or descriptors, which are /dev/null). It
never reads a program, its input or its output: the caller passes them as descriptors the
server hands to the child. A program that passes its deadline or output cap takes the whole
sandbox down (as with `run_python`). docs/code.md, "Fork server".
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import time
from collections import Counter

from pipelinerl.sandbox.core import (
    KEYCTL,
    PYTHON_FLAGS,
    RLIMIT_NUMBERS,
    SCRATCH,
    Limits,
    Result,
    _interpreter,
    _kill,
    _memfd,
    _program_path,
    _sandbox_argv,
    acquire_uid,
    check_isolation,
    Spawned,
    release_uid,
    result,
    rlimits,
)

_CLEAN_GRACE_S = 5.0  # after the program's exit, for the server to clean up (not the program's)

_SERVER = r'''
import atexit, ctypes, json, linecache, os, resource, select, shutil, signal, socket, sys
import threading, time, traceback, types
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: programs (same uid) cannot ptrace this server
signal.signal(signal.SIGINT, signal.SIG_IGN)
control = socket.socket(fileno=int(sys.argv[1]))
SCRATCH = sys.argv[2]
KEYCTL = json.loads(sys.argv[3])
SYSCALLS = {"x86_64": {"ioprio_get": 252, "sched_getattr": 315},
            "aarch64": {"ioprio_get": 31, "sched_getattr": 275}}.get(os.uname().machine, {})
KEY_SPEC = {"user": -4, "user-session": -5}
TICK_S = 0.01  # how often the scratch directory's files are counted while a program runs

def run_child(request, fds, scratch):
    os.setsid()  # its own session and process group: kill(0) and killpg reach only its own
    if KEYCTL is not None:
        libc.syscall(KEYCTL, 1, None)  # JOIN_SESSION_KEYRING: a new, empty one of its own
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    with open(fds[3], "rb") as f:
        source = f.read()
    os.closerange(3, 1 << 16)
    os.chdir(scratch)
    os.environ.update(HOME=scratch, TMPDIR=scratch, PWD=scratch)
    for number, soft, hard in request["limits"]:
        resource.setrlimit(number, (soft, hard))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main = types.ModuleType("__main__")
    main.__file__ = request["path"]
    sys.modules["__main__"] = main
    sys.argv = [request["path"]]
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    linecache.cache[request["path"]] = (len(source), None,
                                         source.decode(errors="replace").splitlines(True),
                                         request["path"])  # its tracebacks quote its lines
    code = compile(source, request["path"], "exec")
    exec(code, main.__dict__)

def child(request, fds, scratch):
    try:
        run_child(request, fds, scratch)
        code = 0
    except SystemExit as error:
        code = exit_code(error.code)
    except BaseException as error:
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":
            tb = tb.tb_next  # the server's own frames: the traceback starts in the program
        traceback.print_exception(type(error), error, tb)
        code = 1
    finish(code)

def exit_code(code):
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1

def finish(code):
    """What the interpreter's exit does for a program (non-daemon threads joined, atexit
    handlers, streams flushed) without its finalization, ~10 ms a run."""
    try:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(code)

def reap(pid):
    """Reap every exited process (orphans come to pid 1: this server); the program's wait
    status once it has exited or was killed. A program that made this server its tracer
    (PTRACE_TRACEME) is let go at each stop, as if it had none."""
    status = None
    while True:
        try:
            found, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if found == 0:
            return status
        if found == pid and os.WIFSTOPPED(st):
            sig = os.WSTOPSIG(st)
            libc.ptrace(17, pid, None, ctypes.c_void_p(0 if sig == signal.SIGTRAP else sig))
        elif found == pid:
            status = st

def scratch_files():
    stats = os.statvfs(SCRATCH)
    return stats.f_files - stats.f_ffree

def wait_program(pid, err_fd, max_files):
    """The program's wait status; it is killed, with a line on its stderr saying why, once
    the scratch directory holds more than `max_files` files (tmpfs here has no inode bound)."""
    pidfd = os.pidfd_open(pid)
    over = False
    try:
        while True:
            ready, _, _ = select.select([pidfd, control], [], [], TICK_S)
            if control in ready and not control.recv(1, socket.MSG_PEEK):
                os.kill(-1, signal.SIGKILL)  # the caller is gone (or gave up on this run)
                os._exit(1)
            status = reap(pid)
            if status is not None:
                return status
            if not over and scratch_files() > max_files:
                over = True
                try:
                    os.write(err_fd, f"\nsandbox: killed: more than {max_files} files in "
                                     f"the scratch directory (Limits.scratch_files)\n".encode())
                except OSError:
                    pass
                os.kill(-1, signal.SIGKILL)  # the program and all it started; not pid 1
    finally:
        os.close(pidfd)

def others():
    return [p for p in os.listdir("/proc") if p.isdigit() and p != str(os.getpid())]

def clean():
    deadline = time.monotonic() + 2.0
    while True:
        try:
            os.kill(-1, signal.SIGKILL)  # every process of the namespace but pid 1, this one
        except ProcessLookupError:
            pass
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
        if not others() or time.monotonic() > deadline:
            break
        time.sleep(0.001)  # one dying: its children come to pid 1 once it is gone
    try:  # owned by this uid where bubblewrap made the user namespace (a caller not root)
        os.chmod(SCRATCH, 0o777)
    except PermissionError:
        pass
    for name in os.listxattr(SCRATCH):
        os.removexattr(SCRATCH, name)
    for root, dirs, _files in os.walk(SCRATCH):
        for name in dirs:  # a program's chmod 000 must not keep its files for the next
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o700)
    for name in os.listdir(SCRATCH):
        path = os.path.join(SCRATCH, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    for kind, remove in (("shm", lambda i: libc.shmctl(i, 0, None)),  # 0: IPC_RMID
                         ("msg", lambda i: libc.msgctl(i, 0, None)),
                         ("sem", lambda i: libc.semctl(i, 0, 0))):
        with open(f"/proc/sysvipc/{kind}") as table:
            for line in list(table)[1:]:
                remove(int(line.split()[1]))
    for keyring in keyrings():
        libc.syscall(KEYCTL, 7, keyring)  # KEYCTL_CLEAR

def keyrings():
    """The keyrings every program of this server can reach: its uid's user and user-session
    keyrings and its persistent one (each program has a session keyring of its own)."""
    if KEYCTL is None:
        return []
    found = [libc.syscall(KEYCTL, 0, spec, 1) for spec in KEY_SPEC.values()]  # GET_KEYRING_ID
    persistent = libc.syscall(KEYCTL, 22, -1, -2)  # GET_PERSISTENT, linked to the process's
    return [k for k in found + [persistent] if k > 0]

def keyring_state():
    """Each keyring's description (type, owner, permissions) and payload size: 0 keys."""
    if KEYCTL is None:
        return []
    buffer = ctypes.create_string_buffer(512)
    state = []
    for keyring in keyrings():
        size = libc.syscall(KEYCTL, 6, keyring, buffer, 512)  # DESCRIBE
        state.append((size, buffer.value, libc.syscall(KEYCTL, 11, keyring, None, 0)))  # READ
    return state

def scheduling():
    """What a program of the same uid could change of this server and its next children
    inherit: priority, scheduling policy and attributes, affinity, I/O priority, timer
    slack, and every resource limit."""
    attr = ctypes.create_string_buffer(56)
    if "sched_getattr" in SYSCALLS:
        libc.syscall(SYSCALLS["sched_getattr"], 0, attr, 56, 0)
    return (os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0),
            os.sched_getparam(0).sched_priority, sorted(os.sched_getaffinity(0)), attr.raw,
            libc.syscall(SYSCALLS["ioprio_get"], 1, 0) if SYSCALLS else None,
            libc.prctl(30, 0, 0, 0, 0),  # PR_GET_TIMERSLACK
            [resource.getrlimit(n) for n in range(16)])

def socket_left():
    """A socket of this network namespace that something still holds (in flight in a unix
    socket's queue, say: it outlives the processes until the kernel's collector runs)."""
    with open("/proc/net/sockstat") as stats:  # "sockets: used N": every socket of this netns
        if stats.readline().split()[-1] == "0":
            return None  # the common case, in 0.04 ms; reading /proc/net/tcp costs 4 ms
    for name in ("tcp", "tcp6", "udp", "udp6", "udplite", "udplite6", "raw", "raw6", "icmp",
                 "icmp6", "unix", "packet"):
        try:
            with open(f"/proc/net/{name}") as table:
                rows = [line.split() for line in list(table)[1:]]
        except FileNotFoundError:
            continue
        inode = 6 if name == "unix" else 8 if name == "packet" else 9
        if any(len(row) > inode and row[inode] != "0" for row in rows):
            return name
    return None

def taint():
    """Why this server must not run another program, or None."""
    if others():
        return "a process outlived its program"
    if scheduling() != SCHEDULING:
        return "its priority, scheduling, affinity or resource limits were changed"
    name = socket_left()
    if name:
        return f"a socket outlived its program (/proc/net/{name})"
    if keyring_state() != KEYRINGS:
        return "a keyring kept keys or had its permissions changed"
    if os.listdir(SCRATCH) or os.listxattr(SCRATCH):
        return "the scratch directory could not be emptied"
    return None

def send(message):
    control.sendall(json.dumps(message).encode() + b"\n")

clean()
SCHEDULING, KEYRINGS = scheduling(), keyring_state()
count = 0
while True:
    message, fds, _flags, _addr = socket.recv_fds(control, 1 << 16, 4)
    if not message:
        break
    request = json.loads(message)
    count += 1
    scratch = f"{SCRATCH}/run{count}"
    os.mkdir(scratch, 0o700)
    pid = os.fork()
    if pid == 0:
        control.close()
        child(request, fds, scratch)
    for fd in fds[:2] + fds[3:]:
        os.close(fd)
    status = wait_program(pid, fds[2], request["scratch_files"])
    os.close(fds[2])
    send({"exit": status})
    try:
        clean()
        reason = taint()
    except BaseException as error:
        reason = f"its clean-up failed: {error!r}"
    send({"tainted": reason})
    if reason:
        break
'''


class ForkServer:
    """One warm sandboxed interpreter running Python programs one at a time. Not shared
    between threads: give each worker its own. `limits.scratch_mb` sizes its scratch tmpfs
    (shared by its programs in turn); each run's other limits are its own."""

    def __init__(self, limits: Limits = Limits()) -> None:
        check_isolation("full")
        self.scratch_limits = limits
        self.restarts: Counter[str] = Counter()  # why the server was started again, how often
        self._down_because: str | None = None
        self._proc: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        self._uid: int | None = None
        self._spawned: Spawned | None = None

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the server: its sandbox, and everything in it, ends."""
        if self._proc is not None:
            _kill(self._proc, weak=False)
            self._proc.wait()
            self._spawned.release()
            self._control.close()
            release_uid(self._uid)
            self._proc = self._control = self._uid = self._spawned = None

    def _start(self) -> None:
        host_end, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._uid = acquire_uid()
        argv = _sandbox_argv([_interpreter(), *PYTHON_FLAGS, "-c", _SERVER,
                              str(server_end.fileno()), SCRATCH, json.dumps(KEYCTL)], {},
                             self.scratch_limits, self._uid, apply_limits=False, as_pid_1=True)
        # Its descriptors lead nowhere of the caller's: a program that reached them (through
        # /proc/1/fd) would find /dev/null, not the actor's log or terminal.
        # The server (pid 1: its death ends the sandbox) lives while its control socket is
        # open: bubblewrap's death signal does not reach it across setpriv's change of uid, so
        # the end of the thread that asked for it closes the socket instead.
        self._spawned = Spawned(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={}, pass_fds=[server_end.fileno()],
            start_new_session=True, on_owner_end=lambda: host_end.shutdown(socket.SHUT_RDWR))
        self._proc = self._spawned.proc
        server_end.close()
        self._control = host_end

    def _take_down(self, reason: str) -> None:
        self.close()
        self._down_because = reason

    def _ensure_running(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            self._take_down("died")
        if self._proc is None:
            if self._down_because is not None:
                self.restarts[self._down_because] += 1
            self._start()

    def run_python(self, source: str, *, stdin: str | bytes = b"",
                   limits: Limits = Limits(), filename: str = "main.py") -> Result:
        """As `pipelinerl.sandbox.run_python`, in this server's warm interpreter."""
        request = {"path": _program_path(filename), "scratch_files": limits.scratch_files,
                   "limits": [[RLIMIT_NUMBERS[name], soft, hard] for name, (soft, hard)
                              in _program_rlimits(limits).items()]}
        self._ensure_running()
        start = time.monotonic()
        stdin_fd = _memfd("stdin", stdin.encode() if isinstance(stdin, str) else bytes(stdin))
        program_fd = _memfd("program", source.encode())
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        message = json.dumps(request).encode()
        try:
            try:
                socket.send_fds(self._control, [message], [stdin_fd, out_w, err_w, program_fd])
            except OSError:  # the server died since the last run
                self._take_down("died")
                self._ensure_running()
                socket.send_fds(self._control, [message], [stdin_fd, out_w, err_w, program_fd])
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            for fd in (stdin_fd, program_fd, out_w, err_w):
                os.close(fd)
        cap = limits.max_output_kb << 10
        with open(out_r, "rb") as out, open(err_r, "rb") as err:
            ended = _Ending(out, err, self._control, cap, start + limits.timeout_s)
        if ended.status is None:  # the deadline or the cap: the sandbox goes, as in run_python
            self._take_down("the deadline or the output cap")
        elif ended.tainted is False:
            self._take_down("no report of its clean-up")
        elif ended.tainted:
            self._take_down(ended.tainted)  # what a program changed: the next run gets a new one
        exit_code, signum = _decode(ended.status)
        return result(exit_code, signum, ended.stdout[:cap].decode(errors="replace"),
                      ended.stderr[:cap].decode(errors="replace"), ended.seconds - start,
                      ended.over, ended.timed_out)


class _Ending:
    """How one fork-server run ended, read from its output pipes and the control socket:
    stdout and stderr until both close, the program's wait status (`status`, None when the
    cap or the deadline came first), and the server's report after its clean-up
    (`tainted`: None clean, a reason, or False when it did not come within the grace)."""

    def __init__(self, out, err, control: socket.socket, cap: int, deadline: float) -> None:
        self.stdout, self.stderr = bytearray(), bytearray()
        self.status: int | None = None
        self.tainted: str | None | bool = False
        self.over = self.timed_out = False
        self.seconds = deadline
        self._lines = b""
        self._collect(out, err, control, cap, deadline)
        if self.status is None:  # the cap, the deadline, or the server gone: now is the end
            self.seconds = time.monotonic()

    def _collect(self, out, err, control: socket.socket, cap: int, deadline: float) -> None:
        buffers = {out: self.stdout, err: self.stderr}
        with selectors.DefaultSelector() as selector:
            for stream in (out, err):
                selector.register(stream, selectors.EVENT_READ)
            selector.register(control, selectors.EVENT_READ)
            until = deadline
            open_pipes = {out, err}
            while True:
                if self.status is not None and not open_pipes and self.tainted is not False:
                    return
                left = until - time.monotonic()
                if left <= 0:
                    self.timed_out = self.status is None
                    return
                for key, _events in selector.select(timeout=left):
                    if key.fileobj is control:
                        if not self._read_control(control):
                            selector.unregister(control)
                            if self.status is None:
                                return  # the server is gone before the program's end
                        if self.status is not None and until == deadline:
                            self.seconds = time.monotonic()
                            until = self.seconds + _CLEAN_GRACE_S
                        continue
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        open_pipes.discard(key.fileobj)
                        continue
                    buffers[key.fileobj] += chunk
                    if len(buffers[key.fileobj]) > cap:
                        self.over = True
                        self.status = None
                        return

    def _read_control(self, control: socket.socket) -> bool:
        """Take the server's lines (its report of the exit, then of its clean-up); False once
        it closed."""
        try:
            chunk = control.recv(4096)
        except OSError:
            chunk = b""
        if not chunk:
            return False
        self._lines += chunk
        while b"\n" in self._lines:
            line, self._lines = self._lines.split(b"\n", 1)
            message = json.loads(line)
            if "exit" in message:
                self.status = message["exit"]
            else:
                self.tainted = message["tainted"]
        return True


def _decode(status: int | None) -> tuple[int | None, int | None]:
    """(exit code, signal) from the child's real wait status (None: killed at the deadline or
    the cap); unlike bubblewrap's exit code, an exit code of 139 stays an exit code."""
    if status is None:
        return None, int(signal.SIGKILL)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status), None
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    return None, int(signal.SIGKILL)


def _program_rlimits(limits: Limits) -> dict[str, tuple[int, int]]:
    """The program's limits; one process more than the program's own, since the server
    counts (the same uid in the same user namespace)."""
    limits_by_name = rlimits(limits)
    procs = limits_by_name["nproc"][1] + 1
    return dict(limits_by_name, nproc=(procs, procs))
