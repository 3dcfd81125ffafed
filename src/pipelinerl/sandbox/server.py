"""A fork server: one warm interpreter in one sandbox, forking a child per Python program.

`run_python` starts a sandbox and an interpreter per program; most of a short program's cost
is that start. A `ForkServer` starts both once: its interpreter (pid 1 of the sandbox's PID
namespace) forks a child per program, in a fresh scratch subdirectory, with the program's
limits. Programs run one at a time; after each, the server kills every other process in the
namespace, removes the scratch subdirectory, the System V IPC objects and the user keyring's
keys, so the next program finds nothing of it. A program that passes its deadline or output
cap takes the whole sandbox down (as with `run_python`); the next run starts a new one.

The server is pid 2 under bubblewrap's init: a program can kill it (same uid), which ends
its own run as `killed` and the sandbox with it. The server never reads a program, its input
or its output: the caller passes them as file descriptors the server hands to the child. It
is not dumpable, so a program (same uid) cannot ptrace it or read its memory or file
descriptors. docs/code.md, "Fork server".
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

from pipelinerl.sandbox.core import (
    Limits,
    Result,
    _interpreter,
    _kill,
    _memfd,
    _program_path,
    _read_capped,
    _result,
    _sandbox_argv,
    check_isolation,
)

_SERVER = r'''
import atexit, ctypes, json, linecache, os, resource, shutil, signal, socket, sys
import threading, traceback, types
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: programs (same uid) cannot ptrace this server
signal.signal(signal.SIGINT, signal.SIG_IGN)
control = socket.socket(fileno=int(sys.argv[1]))
LIMITS = {"cpu": resource.RLIMIT_CPU, "as": resource.RLIMIT_AS, "nproc": resource.RLIMIT_NPROC,
          "nofile": resource.RLIMIT_NOFILE, "fsize": resource.RLIMIT_FSIZE,
          "core": resource.RLIMIT_CORE, "msgqueue": resource.RLIMIT_MSGQUEUE}
KEYCTL = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)  # the syscall's number

def run_child(request, fds, scratch):
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    with open(fds[3], "rb") as f:
        source = f.read()
    os.closerange(3, 1 << 16)
    os.chdir(scratch)
    os.environ.update(HOME=scratch, TMPDIR=scratch, PWD=scratch)
    for name, value in request["limits"].items():
        resource.setrlimit(LIMITS[name], tuple(value))
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

def clean():
    try:
        os.kill(-1, signal.SIGKILL)  # every process of the namespace this one may signal
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    try:  # owned by this uid where bubblewrap made the user namespace (a caller not root)
        os.chmod("/scratch", 0o777)
    except PermissionError:
        pass
    for root, dirs, _files in os.walk("/scratch"):
        for name in dirs:  # a program's chmod 000 must not keep its files for the next
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), 0o700)
    for name in os.listdir("/scratch"):
        path = os.path.join("/scratch", name)
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
    if KEYCTL is not None:
        libc.syscall(KEYCTL, 7, -4)  # keyctl(KEYCTL_CLEAR, KEY_SPEC_USER_KEYRING)

count = 0
while True:
    message, fds, _flags, _addr = socket.recv_fds(control, 1 << 16, 4)
    if not message:
        break
    request = json.loads(message)
    count += 1
    scratch = f"/scratch/run{count}"
    os.mkdir(scratch, 0o700)
    pid = os.fork()
    if pid == 0:
        control.close()
        child(request, fds, scratch)
    for fd in fds:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    clean()
    control.sendall(json.dumps({"status": status}).encode() + b"\n")
'''


class ForkServer:
    """One warm sandboxed interpreter running Python programs one at a time. Not shared
    between threads: give each worker its own. `limits.scratch_mb` sizes its scratch tmpfs
    (shared by its programs in turn); each run's other limits are its own."""

    def __init__(self, limits: Limits = Limits()) -> None:
        check_isolation("full")
        self.scratch_limits = limits
        self._proc: subprocess.Popen | None = None
        self._control: socket.socket | None = None

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the server: its sandbox, and everything in it, ends."""
        if self._proc is not None:
            _kill(self._proc, weak=False)
            self._proc.wait()
            self._control.close()
            self._proc = self._control = None

    def _start(self) -> None:
        host_end, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = _sandbox_argv([_interpreter(), "-I", "-S", "-c", _SERVER,
                              str(server_end.fileno())], {}, self.scratch_limits,
                             apply_limits=False)
        self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env={},
                                      pass_fds=[server_end.fileno()], start_new_session=True)
        server_end.close()
        self._control = host_end

    def run_python(self, source: str, *, stdin: str | bytes = b"",
                   limits: Limits = Limits(), filename: str = "main.py") -> Result:
        """As `pipelinerl.sandbox.run_python`, in this server's warm interpreter."""
        request = {"path": _program_path(filename), "limits": _rlimits(limits)}
        if self._proc is None or self._proc.poll() is not None:
            self.close()
            self._start()
        start = time.monotonic()
        stdin_fd = _memfd("stdin", stdin.encode() if isinstance(stdin, str) else bytes(stdin))
        program_fd = _memfd("program", source.encode())
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        message = json.dumps(request).encode()
        try:
            try:
                socket.send_fds(self._control, [message], [stdin_fd, out_w, err_w, program_fd])
            except OSError:  # the server died since the last run (its program killed it)
                self.close()
                self._start()
                socket.send_fds(self._control, [message], [stdin_fd, out_w, err_w, program_fd])
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            for fd in (stdin_fd, program_fd, out_w, err_w):
                os.close(fd)
        with open(out_r, "rb") as out, open(err_r, "rb") as err:
            cap = limits.max_output_kb << 10
            stdout, stderr, over, timed_out = _read_capped(out, err, cap,
                                                           start + limits.timeout_s)
        status = None if over or timed_out else self._status(start + limits.timeout_s + 2.0)
        if status is None:
            self.close()  # the deadline or the cap: the whole sandbox goes, as in run_python
            code = -9
        else:
            code = os.waitstatus_to_exitcode(status)
        return _result(code, stdout[:cap].decode(errors="replace"),
                       stderr[:cap].decode(errors="replace"), time.monotonic() - start, over,
                       timed_out)

    def _status(self, deadline: float) -> int | None:
        """The child's wait status the server sends once it has cleaned up, or None when it
        does not come by `deadline`."""
        self._control.settimeout(max(0.0, deadline - time.monotonic()))
        try:
            line = b""
            while not line.endswith(b"\n"):
                chunk = self._control.recv(256)
                if not chunk:
                    return None
                line += chunk
        except OSError:  # TimeoutError, or the server was killed (by the program: same uid)
            return None
        return json.loads(line)["status"]


def _rlimits(limits: Limits) -> dict[str, tuple[int, int]]:
    cpu = limits.cpu_limit_s
    return {"cpu": (cpu, cpu + 1), "as": (limits.memory_mb << 20,) * 2,
            "nproc": (limits.max_procs + 1,) * 2,  # the server counts: same uid, same namespace
            "nofile": (limits.max_files,) * 2, "fsize": (limits.max_file_mb << 20,) * 2,
            "core": (0, 0), "msgqueue": (0, 0)}
