"""pipelinerl.sandbox: programs that behave, and programs that misbehave in every way listed in
docs/reliability.md ("Sandbox: misbehaving programs"). Each hostile program must end within
its limit with a clear status, leave no process and no file behind, and leave the machine
(this process, its services, the next sandbox) as it was."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from pipelinerl.sandbox import Limits, Result, SandboxUnavailable, check_isolation, run_command
from pipelinerl.sandbox import run_file, run_python
from pipelinerl.sandbox import core
from pipelinerl.sandbox.server import ForkServer

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap (bwrap) is not installed: `make sandbox`")

CHECKOUT = Path(__file__).resolve().parents[1]
Run = Callable[..., Result]


@pytest.fixture(params=["bwrap per run", "fork server"])
def run(request) -> Iterator[Run]:
    """Each misbehaving program runs both ways: a sandbox of its own, and a warm fork server
    (started before the program, so its processes are the test's services)."""
    if request.param == "bwrap per run":
        yield run_python
        return
    with ForkServer() as server:
        assert server.run_python("pass").ok
        yield server.run_python
GRACE_S = 3.0  # startup on a loaded two-core machine, and the kill landing


def hostile(run: Run, source: str, limits: Limits = Limits(timeout_s=3)) -> tuple[Result, str]:
    """Run `source` with `run` under a unique file name; check it left no process behind and
    that the next program still runs. Returns the result and the token (its file's stem)."""
    token = f"hostile_{uuid.uuid4().hex[:12]}"
    before = {c.pid for c in psutil.Process().children(recursive=True)}  # the test's services
    result = run(source.replace("TOKEN", token), limits=limits, filename=f"{token}.py")
    assert result.seconds <= limits.timeout_s + GRACE_S, result
    assert_no_leftovers(token, before)
    assert run("print('next')").stdout == "next\n"
    return result, token


def assert_no_leftovers(token: str, services: set[int] = frozenset()) -> None:
    """No process whose command line names `token`, and no child of this process but the
    test's own `services`."""
    deadline = time.monotonic() + 2.0
    while True:
        left = [p for p in psutil.process_iter(["cmdline"])
                if any(token in part for part in p.info["cmdline"] or [])]
        children = [c for c in psutil.Process().children(recursive=True)
                    if c.pid not in services]
        if not left and not children:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"left behind: {left} children {children}")
        time.sleep(0.1)


# -- programs that behave -----------------------------------------------------------------------
def test_program_with_asserts_runs_ok_and_reads_stdin() -> None:
    source = ("import sys\nfor i in range(10):\n    assert i * 2 == i + i\n"
              "print(sys.stdin.read()[::-1])")
    result = run_python(source, stdin="abc")
    assert (result.status, result.exit_code, result.signal) == ("ok", 0, None)
    assert result.stdout == "cba\n" and result.stderr == ""


def test_stdin_cannot_be_changed_by_the_program() -> None:
    source = ("import os\ntry:\n    os.write(0, b'x')\nexcept OSError as e:\n"
              "    print(type(e).__name__)\nprint(repr(os.read(0, 100)))\n")
    result = run_python(source, stdin="given")
    assert result.stdout == "PermissionError\nb'given'\n", result


def test_failing_assert_and_exit_code_are_errors() -> None:
    failed = run_python("assert 1 == 2, 'one is not two'")
    assert failed.status == "error" and failed.exit_code == 1
    assert "AssertionError: one is not two" in failed.stderr
    assert run_python("raise SystemExit(7)").exit_code == 7
    assert run_python("def f(:\n").status == "error"


def test_runs_as_nobody_without_capabilities_network_or_environment(monkeypatch) -> None:
    monkeypatch.setenv("PIPELINERL_TEST_SECRET", "hunter2")
    source = ("import os, socket\n"
              "print(os.getuid(), os.getgid(), os.getcwd())\n"
              "caps = [l for l in open('/proc/self/status') if l.startswith('CapEff')]\n"
              "print(caps[0].split()[1])\n"
              "print(sorted(n for _, n in socket.if_nameindex()))\n"
              "print(sorted(os.environ))\n")
    result = run_python(source)
    lines = result.stdout.splitlines()
    assert lines[0] == "65534 65534 /scratch"
    assert int(lines[1], 16) == 0
    assert lines[2] == "['lo']"
    assert lines[3] == "['HOME', 'LANG', 'PATH', 'PWD', 'PYTHONHASHSEED', 'TMPDIR']"
    assert "hunter2" not in result.stdout


def test_a_caller_that_is_not_root_gets_the_same_isolation() -> None:
    """bubblewrap's own user namespace (the path of callers that are not root): as root, this
    test runs the sandbox from a process of uid 1000 (Debian's python3: the pyenv interpreter
    under /root is out of its reach)."""
    python, prefix = sys.executable, []
    if os.getuid() == 0:
        python = shutil.which("python3", path="/usr/bin") or sys.executable
        prefix = ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups"]
    script = textwrap.dedent("""
        from pipelinerl.sandbox import Limits, run_python
        who = run_python("import os\\nprint(os.getuid(), os.getgid())\\n"
                         "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])")
        print(who.status, who.stdout.split())
        bomb = run_python("import os\\nwhile True:\\n  try: os.fork()\\n  except OSError: pass",
                          limits=Limits(timeout_s=2, max_procs=10))
        print(bomb.status)
        """)
    env = ["env", "-i", "PATH=/usr/bin:/bin", f"PYTHONPATH={CHECKOUT / 'src'}"]
    done = subprocess.run(prefix + env + [python, "-c", script], capture_output=True, text=True,
                          timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["ok ['65534', '65534', '0000000000000000']", "timeout"]


def test_scratch_is_fresh_for_each_run() -> None:
    first = run_python("open('kept.txt', 'w').write('x'); import os; print(os.listdir('.'))")
    assert first.stdout == "['kept.txt']\n"
    assert run_python("import os; print(os.listdir('.'))").stdout == "[]\n"


def test_any_command_runs_from_a_file_and_by_name(tmp_path: Path) -> None:
    script = tmp_path / "hello.sh"
    script.write_text("#!/bin/sh\nread name\necho \"hello $name from $(id -u)\"\n")
    result = run_file(script, stdin="you\n")
    assert (result.status, result.stdout) == ("ok", "hello you from 65534\n")
    assert run_command(["/bin/sh", "-c", "exit 3"]).exit_code == 3


def test_bad_limits_and_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="Limits.memory_mb"):
        Limits(memory_mb=0)
    with pytest.raises(ValueError, match="Limits.cpu_seconds"):
        Limits(cpu_seconds=-1)
    with pytest.raises(ValueError, match="isolation must be"):
        run_python("pass", isolation="none")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="filename"):
        run_python("pass", filename="../x.py")
    with pytest.raises(FileNotFoundError, match="no program file"):
        run_file("/nonexistent/program.py")


def test_refuses_without_bubblewrap_naming_the_weak_setting(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no bwrap on PATH
    core._full_isolation_problem.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="isolation='weak'.*--isolation weak"):
            check_isolation()
        with pytest.raises(SandboxUnavailable, match="'bwrap' is not on PATH"):
            run_python("print('never ran')")
    finally:
        core._full_isolation_problem.cache_clear()


def test_weak_mode_keeps_limits_scratch_and_clean_environment(monkeypatch) -> None:
    monkeypatch.setenv("PIPELINERL_TEST_SECRET", "hunter2")
    source = "import os\nopen('f', 'w').write('x')\nprint(os.getcwd(), sorted(os.environ))"
    result = run_python(source, isolation="weak")
    cwd = result.stdout.split()[0]
    assert result.status == "ok" and "hunter2" not in result.stdout
    assert not os.path.exists(cwd), "the weak mode's scratch directory is removed after"
    slow = run_python("while True: pass", isolation="weak", limits=Limits(timeout_s=1))
    assert slow.status == "timeout" and slow.seconds < 1 + GRACE_S


def test_cli_prints_the_result(tmp_path: Path) -> None:
    program = tmp_path / "shout.py"
    program.write_text("import sys\nprint(sys.stdin.read().upper())\nraise SystemExit(4)\n")
    given = tmp_path / "in.txt"
    given.write_text("hello")
    done = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "sandbox", str(program),
                           "--stdin", str(given), "--timeout", "5", "--memory-mb", "256"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "status:    error" in done.stdout and "exit code: 4" in done.stdout
    assert "HELLO" in done.stdout and "memory_mb=256" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "sandbox", str(program),
                          "--max-procs", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Limits.max_procs" in bad.stderr


# -- programs that misbehave --------------------------------------------------------------------
def test_fork_bomb_is_bounded_and_ends_at_the_deadline(run: Run) -> None:
    source = ("import os\ncount = 0\nwhile True:\n    try:\n        os.fork()\n"
              "    except OSError:\n        pass\n")
    result, _ = hostile(run, source, Limits(timeout_s=2, max_procs=16))
    assert result.status == "timeout"


def test_fork_bomb_does_not_take_another_sandboxs_processes() -> None:
    """RLIMIT_NPROC counts per uid per user namespace: each sandbox has its own count."""
    bomb = ("import os\nwhile True:\n    try:\n        os.fork()\n"
            "    except OSError:\n        pass\n")
    thread = threading.Thread(target=hostile,
                              args=(run_python, bomb, Limits(timeout_s=4, max_procs=16)))
    thread.start()
    time.sleep(1.0)
    spawner = ("import subprocess\nprocs = [subprocess.Popen(['/bin/sleep', '0.2']) "
               "for _ in range(10)]\nprint(sum(p.wait() == 0 for p in procs))")
    result = run_python(spawner, limits=Limits(timeout_s=10, max_procs=16))
    thread.join()
    assert (result.status, result.stdout) == ("ok", "10\n"), result


def test_memory_hog_gets_memory_status(run: Run) -> None:
    source = "blocks = []\nwhile True:\n    blocks.append(bytearray(10 ** 7))\n"
    result, _ = hostile(run, source, Limits(timeout_s=5, memory_mb=200))
    assert result.status == "memory" and result.stderr.rstrip().endswith("MemoryError")


def test_busy_loop_ends_at_its_cpu_limit(run: Run) -> None:
    result, _ = hostile(run, "while True:\n    pass\n", Limits(timeout_s=5, cpu_seconds=1))
    assert result.status == "timeout" and result.signal == signal.SIGXCPU
    assert result.seconds < 4


def test_sleeper_ignoring_sigterm_ends_at_the_deadline(run: Run) -> None:
    source = ("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "time.sleep(1000)\n")
    result, _ = hostile(run, source, Limits(timeout_s=1.5))
    assert result.status == "timeout" and result.seconds >= 1.5


def test_double_forked_daemon_dies_with_the_program(run: Run) -> None:
    marker = f"{time.time() % 1000 + 100:.6f}"  # sleep's argument: this daemon's command line
    source = ("import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
              f"        os.execv('/bin/sleep', ['sleep', '{marker}'])\n    os._exit(0)\n"
              "os.wait()\nprint('parent done')\n")
    result, _ = hostile(run, source)
    assert (result.status, result.stdout) == ("ok", "parent done\n")
    server = {c.pid for c in psutil.Process().children(recursive=True)}  # a fork server's
    assert_no_leftovers(marker, server)  # the daemon: named by its marker


def test_writes_outside_scratch_fail_and_leave_nothing(run: Run, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    targets = [Path.home(), Path("/tmp"), Path("/dev/shm"), run_dir, CHECKOUT, Path("/usr"),
               Path(sys.base_prefix)]
    source = ("import sys\nfor d in sys.argv[1:] or DIRS:\n    try:\n"
              "        open(f'{d}/TOKEN', 'w').write('x')\n        print('WROTE', d)\n"
              "    except OSError as e:\n        print('denied', d, type(e).__name__)\n")
    result, token = hostile(run, source.replace("DIRS", repr([str(t) for t in targets])))
    assert result.status == "ok"
    assert "WROTE" not in result.stdout and result.stdout.count("denied") == len(targets)
    assert not [t for t in targets if (t / token).exists()]


def test_secrets_are_out_of_reach(run: Run, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("PIPELINERL_TEST_TOKEN", "s3cr3t-env")
    config = tmp_path / "run" / "config.yaml"
    config.parent.mkdir()
    config.write_text("wandb_key: s3cr3t-config\n")
    source = ("import os\nprint(dict(os.environ))\n"
              "for path in ['/proc/1/environ', os.path.expanduser('~/.ssh/id_rsa'), "
              f"'/root/.ssh/id_rsa', {str(config)!r}, '/proc/{os.getpid()}/environ']:\n"
              "    try:\n        print(path, open(path, 'rb').read())\n"
              "    except OSError as e:\n        print(path, type(e).__name__)\n"
              "try:\n    print(sorted(os.listdir('/root')))\n"
              "except OSError as e:\n    print(type(e).__name__)\n")
    result, _ = hostile(run, source)
    assert result.status == "ok"
    assert "s3cr3t" not in result.stdout
    assert "/root/.ssh/id_rsa FileNotFoundError" in result.stdout
    assert f"{config} FileNotFoundError" in result.stdout
    # /root holds only the path to an interpreter under it (pyenv's), if any
    prefix = Path(sys.base_prefix).resolve().parts
    shown = f"['{prefix[2]}']" if prefix[1] == "root" else "FileNotFoundError"
    assert result.stdout.rstrip().endswith(shown)


def test_services_on_loopback_are_unreachable(run: Run) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.3)
    port = listener.getsockname()[1]
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"\0pipelinerl-test-{uuid.uuid4().hex}"
    abstract.bind(name)
    abstract.listen()
    source = ("import socket\ntry:\n"
              f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
              "    print('TCP IN')\n"
              "except OSError as e:\n    print('tcp', type(e).__name__)\n"
              "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\ntry:\n"
              f"    s.connect({name!r})\n    print('UNIX IN')\n"
              "except OSError as e:\n    print('unix', type(e).__name__)\n")
    try:
        result, _ = hostile(run, source)
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()
        abstract.close()
    assert result.stdout == "tcp ConnectionRefusedError\nunix ConnectionRefusedError\n"


def test_redis_on_loopback_is_unreachable_and_keeps_serving(run: Run, tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                             stdout=subprocess.DEVNULL)
    try:
        assert _redis_ping(port, wait_s=10)
        source = ("import socket\ntry:\n"
                  f"    s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                  "    s.sendall(b'FLUSHALL\\r\\n')\n    print('REACHED', s.recv(100))\n"
                  "except OSError as e:\n    print(type(e).__name__)\n")
        result, _ = hostile(run, source)
        assert result.stdout == "ConnectionRefusedError\n"
        assert _redis_ping(port, wait_s=1)
    finally:
        redis.terminate()
        redis.wait(timeout=10)


def _redis_ping(port: int, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16) == b"+PONG\r\n"
        except OSError:
            time.sleep(0.1)
    return False


def test_signals_to_its_parent_and_everyone_reach_nobody_outside(run: Run) -> None:
    source = ("import os, signal\nfor target in (os.getppid(), 1, -1):\n    try:\n"
              "        os.kill(target, signal.SIGKILL)\n        print(target, 'sent')\n"
              "    except OSError as e:\n        print(target, type(e).__name__)\n")
    canary = subprocess.Popen(["sleep", "60"])  # a host process of the caller's uid
    try:
        result, _ = hostile(run, source)
        assert canary.poll() is None, "a host process was killed"
    finally:
        canary.kill()
        canary.wait()
    # Under a fork server its parent is the server, pid 1 of the sandbox: a signal it has no
    # handler for does not reach it from inside, so the run goes on.
    assert result.status == "ok", result
    assert len(result.stdout.splitlines()) == 3, result  # all three tried


def test_segfault_through_ctypes_is_killed_by_sigsegv(run: Run) -> None:
    result, _ = hostile(run, "import ctypes\nctypes.string_at(0)\n")
    assert (result.status, result.signal) == ("killed", signal.SIGSEGV)


def test_unbounded_recursion_ends_as_error_or_crash(run: Run) -> None:
    plain, _ = hostile(run, "def f():\n    return f()\nf()\n")
    assert plain.status == "error" and "RecursionError" in plain.stderr
    deep, _ = hostile(run, "import sys\nsys.setrecursionlimit(10 ** 8)\n"
                      "def f(n):\n    return f(n + 1)\nf(0)\n",
                      Limits(timeout_s=30, memory_mb=128))
    # Python 3.11's frames live on the heap: the address-space limit ends it, not the stack
    # nor the deadline. Filling 128 MB with frames takes 1-3 s alone, over 8 s on the two
    # cores under CI's load (seen: a timeout at 8 s): the deadline leaves room for that.
    assert deep.status in ("error", "memory", "killed") and deep.seconds < 30, deep


def test_thread_bomb_is_bounded(run: Run) -> None:
    source = ("import threading, time\nn = 0\ntry:\n    while True:\n"
              "        threading.Thread(target=time.sleep, args=(100,), daemon=True).start()\n"
              "        n += 1\nexcept RuntimeError as e:\n    print(n, e)\n    raise\n")
    result, _ = hostile(run, source, Limits(timeout_s=3, max_procs=32))
    assert result.status == "error" and "can't start new thread" in result.stderr
    assert int(result.stdout.split()[0]) < 32


def test_output_flood_is_cut_at_the_cap(run: Run) -> None:
    result, _ = hostile(run, "while True:\n    print('x' * 1000)\n",
                        Limits(timeout_s=5, max_output_kb=64))
    assert result.status == "output_limit" and len(result.stdout) == 64 << 10
    assert result.seconds < 5


def test_one_huge_file_hits_the_file_size_limit(run: Run) -> None:
    source = "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * (1 << 20))\n"
    result, _ = hostile(run, source, Limits(timeout_s=5, max_file_mb=4))
    assert result.status == "error" and "File too large" in result.stderr


def test_disk_fill_hits_the_scratch_size(run: Run) -> None:
    source = ("i = 0\nwhile True:\n    with open(f'part{i}', 'wb') as f:\n"
              "        f.write(b'x' * (1 << 20))\n    i += 1\n")
    result, _ = hostile(run, source, Limits(timeout_s=5, max_file_mb=4, scratch_mb=8))
    assert result.status == "error" and "No space left on device" in result.stderr


def test_many_open_files_hit_the_limit(run: Run) -> None:
    source = "files = []\nwhile True:\n    files.append(open('/dev/null'))\n"
    result, _ = hostile(run, source, Limits(timeout_s=5, max_files=32))
    assert result.status == "error" and "Too many open files" in result.stderr


# -- the fork server ----------------------------------------------------------------------------
def test_fork_server_leaves_the_next_program_nothing() -> None:
    """Files (a 000 directory, one beside the scratch directory, a link to /dev), a System V
    shared memory segment and message queue, and a background process: all gone before the
    next program."""
    leave = ("import ctypes, os, subprocess\nlibc = ctypes.CDLL(None)\n"
             "assert libc.shmget(1234, 4096, 0o1600) >= 0\nassert libc.msgget(99, 0o1600) >= 0\n"
             "os.makedirs('locked/inner')\nopen('locked/inner/f', 'w').write('x')\n"
             "os.chmod('locked', 0)\nopen('/scratch/beside', 'w').write('x')\n"
             "os.symlink('/dev', 'to_dev')\n"
             "subprocess.Popen(['/bin/sleep', '100'], start_new_session=True)\n"
             "print(len(open('/proc/sysvipc/shm').readlines()) - 1)\n")
    look = ("import os\nprint(os.listdir('/scratch'), os.listdir('.'))\n"
            "print(sum(1 for line in open('/proc/sysvipc/shm')) - 1, "
            "sum(1 for line in open('/proc/sysvipc/msg')) - 1)\n"
            "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
            "print(pids == sorted({1, os.getppid(), os.getpid()}))\n")
    with ForkServer() as server:
        first = server.run_python(leave)
        assert (first.status, first.stdout) == ("ok", "1\n"), first
        second = server.run_python(look)
    assert second.status == "ok", second
    scratch, shm_msg, only_us = second.stdout.splitlines()
    assert scratch == "['run2'] []" and shm_msg == "0 0" and only_us == "True"


def _server_pid(server: ForkServer) -> int:
    """The fork server's own process: pid 1 of its sandbox, bubblewrap's only child."""
    (child,) = psutil.Process(server._proc.pid).children()
    return child.pid


def _gone(pid: int, within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_fork_server_ends_with_its_deadline_and_with_its_thread() -> None:
    """The server is pid 1 and outlives bubblewrap's death signal (setpriv changes its uid):
    a run past its deadline, and the end of the thread that started the server while the
    object lives on, must still end every process of its sandbox."""
    with ForkServer() as server:
        assert server.run_python("pass").ok
        first = _server_pid(server)
        assert server.run_python("import time\ntime.sleep(100)",
                                 limits=Limits(timeout_s=1)).status == "timeout"
        assert _gone(first), "the sandbox outlived its deadline"
    kept: list[ForkServer] = []
    started: list[int] = []

    def own_thread() -> None:
        server = ForkServer()
        assert server.run_python("pass").ok
        started.append(_server_pid(server))
        kept.append(server)  # alive after its thread: only the thread's end can stop it

    thread = threading.Thread(target=own_thread)
    thread.start()
    thread.join()
    assert started and _gone(started[0]), "the sandbox outlived the thread that started it"


def test_fork_server_memory_and_descriptors_are_out_of_a_programs_reach() -> None:
    source = ("import os\nfor path in (f'/proc/{os.getppid()}/mem', f'/proc/{os.getppid()}/fd'):\n"
              "    try:\n        os.listdir(path) if path.endswith('fd') else open(path, 'rb')\n"
              "        print(path, 'OPEN')\n"
              "    except OSError as e:\n        print(type(e).__name__)\n")
    with ForkServer() as server:
        result = server.run_python(source)
    assert result.stdout == "PermissionError\nPermissionError\n", result


def test_fork_server_runs_programs_as_plain_python_would() -> None:
    with ForkServer() as server:
        crash = server.run_python("x = 1\nraise KeyError(x)\n")
        exits = server.run_python("import atexit, sys\natexit.register(print, 'bye')\n"
                                  "sys.exit(5)\n")
        syntax = server.run_python("def f(:\n")
        echo = server.run_python("import sys\nprint(__name__, sys.argv, sys.stdin.read())",
                                 stdin="in", filename="solution.py")
    assert crash.status == "error" and crash.stderr.splitlines()[-3:] == [
        '  File "/program/main.py", line 2, in <module>', "    raise KeyError(x)",
        "KeyError: 1"]
    assert (exits.exit_code, exits.stdout) == (5, "bye\n")
    assert syntax.status == "error" and "SyntaxError" in syntax.stderr
    assert echo.stdout == "__main__ ['/program/solution.py'] in\n"


# -- programs that reach for the next program ---------------------------------------------------
# Each hostile program runs between two runs of an innocent one, whose result must not change:
# what one rollout's program does must not change the reward of the next.
INNOCENT = textwrap.dedent("""
    import os, resource, socket
    print(os.getpriority(os.PRIO_PROCESS, 0), os.sched_getscheduler(0),
          sorted(os.sched_getaffinity(0)))
    print([resource.getrlimit(n) for n in range(16)])
    with open(f"/proc/{os.getppid()}/limits") as parent:  # the fork server's, in its sandbox
        print(parent.read())
    block = bytearray(200 << 20)  # within memory_mb=512, whatever RLIMIT_DATA the server had
    files = [open(f"f{i}", "w") for i in range(40)]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 8765))
    print(len(block) >> 20, len(files), len(os.listdir("/scratch")), len(os.listdir(".")))
    """)


def innocent_unchanged(run: Run, hostile_source: str, limits: Limits = Limits(timeout_s=5)
                       ) -> Result:
    """The innocent program's result before and after `hostile_source`, which must be equal
    (stdout, status); returns the hostile program's result."""
    before = run(INNOCENT)
    assert before.status == "ok", before
    attack, _ = hostile(run, hostile_source, limits)
    after = run(INNOCENT)
    assert (after.status, after.stdout) == (before.status, before.stdout), (attack, after)
    return attack


SERVER_TAMPERING = {
    "renice": "os.setpriority(os.PRIO_PROCESS, os.getppid(), 19)",
    "sched_idle": "os.sched_setscheduler(os.getppid(), os.SCHED_IDLE, os.sched_param(0))",
    "pinned": "os.sched_setaffinity(os.getppid(), {0})",
    "data_limit": "resource.prlimit(os.getppid(), resource.RLIMIT_DATA, (100 << 20,) * 2)",
    "cpu_limit": "resource.prlimit(os.getppid(), resource.RLIMIT_CPU, (3000, 3000))",
    "open_files": "resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE, (8, 8))",
    "stack_limit": "resource.prlimit(os.getppid(), resource.RLIMIT_STACK, (1 << 20,) * 2)",
}


@pytest.mark.parametrize("tamper", sorted(SERVER_TAMPERING))
def test_a_program_cannot_change_the_priority_or_limits_the_next_one_gets(run: Run,
                                                                          tamper: str) -> None:
    """Cause 1: a program runs as the fork server's uid, so it can renice it, pin it or lower
    its limits; the server checks itself after each program and is started again if so, and
    every limit of a program is set explicitly."""
    source = "import os, resource\ntry:\n    " + SERVER_TAMPERING[tamper] + \
             "\nexcept OSError as e:\n    print(type(e).__name__)\n"
    innocent_unchanged(run, source)


def test_a_socket_held_in_flight_does_not_outlive_its_program(run: Run) -> None:
    """Cause 2: a listener sent through a unix socket pair in a cycle outlives the kill of
    its processes until the kernel's collector runs; the next program must bind its port."""
    source = textwrap.dedent("""
        import socket
        listener = socket.socket()
        listener.bind(("127.0.0.1", 8765))
        listener.listen()
        a, b = socket.socketpair()
        socket.send_fds(a, [b"x"], [listener.fileno(), a.fileno(), b.fileno()])
        socket.send_fds(b, [b"x"], [a.fileno(), b.fileno()])
        """)
    attack = innocent_unchanged(run, source)
    assert attack.status == "ok", attack


KEYS = textwrap.dedent("""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    import os
    KEYCTL, ADD_KEY = {"x86_64": (250, 248), "aarch64": (219, 217)}[os.uname().machine]
    persistent = libc.syscall(KEYCTL, 22, -1, -3)  # GET_PERSISTENT, linked to the session's
    rings = {"session": -3, "user": -4, "user-session": -5, "persistent": persistent}
    def search(description):
        return sorted(n for n, r in rings.items()
                      if libc.syscall(KEYCTL, 10, r, b"user", description, 0) > 0)
    """)


@pytest.mark.skipif(core.KEYCTL is None, reason="keyctl's number is known on x86-64, aarch64")
def test_keyrings_are_fresh_for_each_program(run: Run) -> None:
    """Cause 3: the caller's session keyring (an ssh login's, a service's) holds a secret; no
    program reads it, and keys a program adds to any keyring it can reach are gone for the
    next program (in the fork server, the user and user-session keyrings are cleared, and a
    program that locks them gets the server started again)."""
    libc = __import__("ctypes").CDLL(None, use_errno=True)
    secret = libc.syscall(248 if core.KEYCTL == 250 else 217, b"user",
                          b"pipelinerl-test-secret", b"hunter2", 7, -3)
    assert secret > 0
    try:
        looked = run(KEYS + "print(search(b'pipelinerl-test-secret'))\n")
        assert (looked.status, looked.stdout) == ("ok", "[]\n"), looked
        plant = KEYS + ("print([libc.syscall(ADD_KEY, b'user', b'planted', b'x', 1, r) > 0 "
                        "for r in rings.values()])\n"
                        "print(libc.syscall(KEYCTL, 5, -4, 0x01010000))\n")  # SETPERM: locked
        planted = run(plant)
        assert planted.stdout.splitlines()[0] == "[True, True, True, True]", planted
        after = run(KEYS + "print(search(b'planted'))\n"
                    "print(libc.syscall(ADD_KEY, b'user', b'mine', b'x', 1, -4) > 0)\n")
        assert (after.status, after.stdout) == ("ok", "[]\nTrue\n"), after
    finally:
        libc.syscall(core.KEYCTL, 3, secret)  # KEYCTL_REVOKE


@pytest.mark.parametrize("how", ["sleeps", "forks a sleeper"])
def test_closed_output_does_not_move_the_deadline(run: Run, how: str) -> None:
    """Cause 4 (and the review's exit statuses): a program that closes its stdout and stderr
    ends `timeout` at its limit on both paths, not `ok` or `killed` up to 2 s later."""
    rest = "time.sleep(3.5)" if how == "sleeps" else \
        "pid = os.fork()\nif pid == 0:\n    time.sleep(3.5)\nelse:\n    os.waitpid(pid, 0)"
    result, _ = hostile(run, f"import os, time\nos.close(1)\nos.close(2)\n{rest}\n",
                        Limits(timeout_s=2))
    assert result.status == "timeout" and result.seconds < 2.5, result


def test_a_program_that_makes_the_server_its_tracer_gets_a_plain_status(run: Run) -> None:
    """Cause 5: PTRACE_TRACEME made the server pass a stopped status on, and the caller
    raised; now the tracee is let go at each stop, and ends as it would untraced."""
    source = ("import ctypes, os, signal\nctypes.CDLL(None).ptrace(0, 0, None, None)\n"
              "signal.signal(signal.SIGUSR1, lambda *a: os.write(1, b'handled\\n'))\n"
              "os.kill(os.getpid(), signal.SIGUSR1)\nos.kill(os.getpid(), signal.SIGUSR2)\n")
    result = innocent_unchanged(run, source)
    assert (result.status, result.signal, result.stdout) == ("killed", signal.SIGUSR2,
                                                            "handled\n"), result


@pytest.mark.skipif(os.getuid() != 0, reason="a uid per sandbox needs a root caller: one that "
                    "is not root has its own uid only (docs/code.md)")
@pytest.mark.parametrize("kind", ["inotify instances", "keys"])
def test_concurrent_sandboxes_do_not_starve_each_other(kind: str) -> None:
    """Cause 6: what the kernel counts per uid (inotify instances, the key quota) was shared by
    every sandbox, all uid 65534; a root caller now runs each concurrent one as a uid of its
    own. One sandbox holds all it can while another, started after, makes ten."""
    make = {"inotify instances": "libc.inotify_init() >= 0",
            "keys": "libc.syscall(ADD_KEY, b'user', f'{os.getpid()}-{i}'.encode(), "
                    "b'x' * 64, 64, -3) > 0"}[kind]
    body = KEYS + f"def make(i):\n    return {make}\n"
    hog = body + textwrap.dedent("""
        import os, sys, time
        for _ in range(40):
            if os.fork() == 0:
                break
        made = 0
        while made < 2000 and make(made):
            made += 1
        print(made, flush=True)
        time.sleep(6)
        """)
    with ForkServer() as hog_server, ForkServer() as other:
        assert other.run_python("pass").ok
        holding = threading.Thread(target=hog_server.run_python, args=(hog,),
                                   kwargs={"limits": Limits(timeout_s=5)})
        holding.start()
        try:
            time.sleep(2.0)
            result = other.run_python(body + "print(all(make(i) for i in range(10)))\n")
        finally:
            holding.join()
    assert (result.status, result.stdout) == ("ok", "True\n"), result


def test_the_cli_shows_control_characters_escaped(tmp_path: Path) -> None:
    """Cause 7: a program's escape sequences must not rewrite what a person reads on the
    terminal (`status: ok` printed over the real status)."""
    program = tmp_path / "spoof.py"
    program.write_text("import sys\nprint('\\x1b[2K\\rstatus:    ok\\x1b]0;title\\x07')\n"
                       "print('\\u202eevil', file=sys.stderr)\nsys.exit(3)\n")
    done = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "sandbox", str(program)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout and "\u202e" not in done.stdout
    assert "\\x1b[2K\\rstatus:    ok\\x1b]0;title\\x07" in done.stdout
    assert "\\u202eevil" in done.stdout and done.stdout.startswith("status:    error\n")


def test_many_empty_files_hit_the_scratch_file_bound(run: Run) -> None:
    """The review's scratch inodes: 383k empty files used 381 MiB of kernel memory beyond a
    64 MB scratch_mb; a program past `scratch_files` is killed, told why, and the next
    program's scratch directory is empty."""
    source = "for i in range(400_000):\n    open(f'f{i}', 'w').close()\nprint('all made')\n"
    result, _ = hostile(run, source, Limits(timeout_s=10, scratch_files=2000))
    assert (result.status, result.signal, result.stdout) == ("killed", signal.SIGKILL, ""), result
    assert "more than 2000 files in the scratch directory" in result.stderr
    assert result.seconds < 2, result
    after = run("import os\nprint(os.listdir('.'))")  # its cwd: /scratch or the server's run<N>
    assert after.stdout == "[]\n", after


def test_exit_codes_above_128_stay_exit_codes_in_the_fork_server() -> None:
    """The review's exit statuses: the fork server has the real wait status, so a program's
    exit code 139 is not read as SIGSEGV (bubblewrap's 128 + N convention, run_python only)."""
    with ForkServer() as server:
        exited = server.run_python("raise SystemExit(139)")
        crashed = server.run_python("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
    assert (exited.status, exited.exit_code, exited.signal) == ("error", 139, None)
    assert (crashed.status, crashed.exit_code, crashed.signal) == ("killed", None, 11)


def test_string_hashes_are_the_same_in_every_run() -> None:
    """The review's determinism: each interpreter had a random hash seed (`-I` ignores
    PYTHONHASHSEED), so set order, and a reward that depends on it, changed between runs."""
    source = "print(hash('pipelinerl'), list({'a', 'b', 'c', 'd', 'e'}))"
    seen = {run_python(source).stdout for _ in range(2)}
    for _ in range(2):
        with ForkServer() as server:
            seen.add(server.run_python(source).stdout)
    assert len(seen) == 1, seen


def test_a_fork_server_started_by_a_caller_that_is_not_root_leaves_it_nothing(tmp_path) -> None:
    """The review's descriptors: bubblewrap got the caller's stdout and stderr (the actor's
    log), which a program reached through /proc/1/fd as the sandbox's uid. As uid 1000, a
    program tries them and the server's priority; the caller's log and the next program's
    result must be untouched."""
    python, prefix = sys.executable, []
    if os.getuid() == 0:
        python = shutil.which("python3", path="/usr/bin") or sys.executable
        prefix = ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups"]
    script = textwrap.dedent("""
        import sys
        from pipelinerl.sandbox import ForkServer
        print("caller's log line", flush=True)
        with ForkServer() as server:
            before = server.run_python("import os\\nprint(os.getpriority(os.PRIO_PROCESS, 0))")
            reach = server.run_python(
                "import os\\nfor fd in (0, 1, 2):\\n    try:\\n"
                "        f = open(f'/proc/1/fd/{fd}', 'r+')\\n        f.write('PLANTED')\\n"
                "        print(fd, 'OPEN')\\n    except OSError as e:\\n"
                "        print(fd, type(e).__name__)\\n"
                "os.setpriority(os.PRIO_PROCESS, 1, 19)\\n")
            after = server.run_python("import os\\nprint(os.getpriority(os.PRIO_PROCESS, 0))")
        sys.stderr.write(repr((before.stdout, reach.stdout, after.stdout)))
        """)
    log = tmp_path / "actor.log"
    log.touch(mode=0o666)
    env = ["env", "-i", "PATH=/usr/bin:/bin", f"PYTHONPATH={CHECKOUT / 'src'}"]
    with open(log, "a") as out:
        done = subprocess.run(prefix + env + [python, "-c", script], stdout=out,
                              stderr=subprocess.PIPE, text=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    before, reach, after = eval(done.stderr)  # noqa: S307 - our own repr
    assert reach == "0 PermissionError\n1 PermissionError\n2 PermissionError\n"
    assert before == after == "0\n"
    assert log.read_text() == "caller's log line\n"
