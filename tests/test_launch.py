"""The launcher's life cycle: signals at any moment, the final save, a role's cleanup."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pipelinerl.roles.launch as launch_module
from pipelinerl.config import load_config
from pipelinerl.models.hf import save_model
from pipelinerl.roles.launch import launch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arithmetic.yaml"

# A stand-in for `python -m pipelinerl.cli trainer|actor CONFIG`: it marks itself started,
# the trainer "trains" for FAKE_TRAIN_S and leaves a stop file, actors leave once it is there;
# each spends FAKE_CLEANUP_S in its `finally`, as a real role closes its streams and channels.
_FAKE_ROLE = """
import os, sys, time
from pathlib import Path
from pipelinerl.proc.stop_signals import install_role_signal_handlers

install_role_signal_handlers()
role = next(a for a in sys.argv if a in ("trainer", "actor"))
run_dir = Path(sys.argv[sys.argv.index(role) + 1]).parent
(run_dir / f"{os.getpid()}.started").touch()
try:
    if role == "trainer":
        time.sleep(float(os.environ["FAKE_TRAIN_S"]))
        (run_dir / "fake-stop").touch()
    else:
        while not (run_dir / "fake-stop").exists():
            time.sleep(0.02)
except KeyboardInterrupt:
    sys.exit(130)
finally:
    time.sleep(float(os.environ["FAKE_CLEANUP_S"]))
"""

# The launcher as `pipelinerl train` runs it (through the script's entry, which skips the
# interpreter's teardown after a stop: 2-3 s with torch and transformers loaded, twice that on
# a loaded machine), except that every role it spawns with `sys.executable -m pipelinerl.cli
# ...` runs the fake role above.
_LAUNCHER = """
import sys
from pipelinerl.cli import run

sys.executable = sys.argv[1]
sys.argv = ["pipelinerl", *sys.argv[2:]]
run()
"""

# Moments to press Ctrl-C at: a random time (up to the jitter) after what marks the start of
# each phase, and how soon the launcher must then be gone. Before any role starts, an import
# in C code (the model check imports torch) delays Python's handling of a signal by seconds
# (the CLI acts on a Ctrl-C once its imports are done: stop_signals.py), so there the bound
# is at least twice what those imports take on this machine at this moment (8.5 s quiet
# here, about twice that beside two SmolLM2 runs);
# once roles run, a role stops on SIGTERM well inside its 10 s grace, and a second Ctrl-C
# does not wait for the 30 s cleanup of roles that would not stop.
_PHASES = {
    "launcher imports": (None, 0.6, 15.0),
    "launcher start-up": ("config.yaml", 0.5, 15.0),  # run directory made, model checked next
    "roles start": ("logs/actor_1.log", 0.3, 5.0),  # the last role was just spawned
    "roles run": ("*.started", 1.0, 5.0),
    "run ends by itself": ("fake-stop", 0.4, 5.0),
}


def _leftover(marker: Path) -> str:
    found = subprocess.run(["pgrep", "-af", str(marker)], capture_output=True, text=True)
    return found.stdout.strip()


def _await_phase(proc: subprocess.Popen, run_dir: Path, pattern: str | None) -> None:
    deadline = time.monotonic() + 60
    while pattern is not None and not any(run_dir.glob(pattern)):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no {pattern} in {run_dir}: {proc.communicate()[1]}")
        time.sleep(0.01)


def _import_seconds(code: str) -> float:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.monotonic() - t0


@pytest.mark.slow
def test_fake_roles_launcher_exits_promptly_after_sigint_at_random_moments(tmp_path: Path):
    from transformers import Qwen2Config

    model = tmp_path / "model"  # a config is all the launcher reads; the fake roles load nothing
    Qwen2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, intermediate_size=32, vocab_size=20).save_pretrained(model)
    fake_role = tmp_path / "fake_role.py"
    fake_role.write_text(_FAKE_ROLE)
    fake_python = tmp_path / "fake_python"
    fake_python.write_text(f'#!/bin/sh\nexec {sys.executable} {fake_role} "$@"\n')
    fake_python.chmod(0o755)
    rng = random.Random(13)
    imports_s = _import_seconds("import pipelinerl.cli, pipelinerl.roles.launch, pipelinerl.models.hf")
    for trial in range(2 * len(_PHASES)):  # each phase twice
        phase = list(_PHASES)[trial % len(_PHASES)]
        pattern, jitter, bound_s = _PHASES[phase]
        if phase.startswith("launcher"):
            bound_s = max(bound_s, 2 * imports_s)
        # A third of the trials press Ctrl-C twice, with roles whose cleanup would otherwise
        # take 30 s; half signal the whole foreground group, as a terminal does.
        twice = rng.random() < 1 / 3
        to_group = rng.random() < 0.5
        # Every other run has the launcher start its own redis-server, which must go too.
        stream = "redis" if trial % 2 and shutil.which("redis-server") else "local"
        out = tmp_path / f"runs{trial}"
        env = {**os.environ, "FAKE_TRAIN_S": "1.0", "FAKE_CLEANUP_S": "30" if twice else "0.3"}
        proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, str(fake_python), "train", str(EXAMPLE),
             f"output_dir={out}", f"model.path={model}", "actor.num_actors=2",
             f"stream.backend={stream}", "metrics.progress=false", "eval.enabled=false"],
            env=env, start_new_session=True, stderr=subprocess.PIPE, text=True,
        )
        _await_phase(proc, out / "arithmetic", pattern)
        delay = rng.uniform(0.0, jitter)
        what = f"trial {trial}: SIGINT {delay:.2f} s into {phase}{' twice' if twice else ''}"
        time.sleep(delay)
        send = (lambda: os.killpg(proc.pid, signal.SIGINT)) if to_group else (
            lambda: os.kill(proc.pid, signal.SIGINT))
        send()
        if twice:
            time.sleep(rng.uniform(0.0, 0.5))
            send()
        sent_at = time.monotonic()
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"{what}: the launcher hung\n{_leftover(out)}")
        took, code = time.monotonic() - sent_at, proc.returncode
        # Dying of SIGINT (-2) is how Python ends on Ctrl-C while it starts or winds down; a
        # shell reports 130 for both. A KeyboardInterrupt escaping the launcher once the run
        # directory exists is what must never happen: it leaves roles unsupervised.
        escaped = 'File "<string>"' in err  # a traceback through the launcher script
        assert code in (0, 130, -signal.SIGINT), f"{what}: exit code {code}\n{err}"
        assert not (escaped and out.exists()), f"{what}: interrupt escaped\n{err}"
        assert took < bound_s, f"{what}: took {took:.1f} s to exit"
        assert _leftover(out) == "", f"{what}: roles left running"


_CLEANUP_SCRIPT = """
import sys, time
from pathlib import Path
from pipelinerl.proc.stop_signals import install_role_signal_handlers

install_role_signal_handlers()
done = Path(sys.argv[1])
try:
    Path(str(done) + ".ready").touch()
    time.sleep(60)
except KeyboardInterrupt:
    pass
finally:
    time.sleep(1.0)  # closing streams, writing the stop record...
    done.write_text("cleaned up")
"""


def test_role_cleanup_survives_a_sigterm_after_the_first_sigint(tmp_path: Path):
    # A terminal's Ctrl-C reaches a hand-started role, then its scheduler's SIGTERM follows:
    # the second signal must not cut the first one's cleanup short.
    done = tmp_path / "done"
    proc = subprocess.Popen([sys.executable, "-c", _CLEANUP_SCRIPT, str(done)])
    deadline = time.monotonic() + 30
    while not Path(str(done) + ".ready").exists():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert done.read_text() == "cleaned up"


class _FailingTokenizer:
    """Fails half-way through a save, after the model's files are written."""

    def save_pretrained(self, path: str) -> None:
        raise OSError("disk full")


class _Tokenizer:
    def save_pretrained(self, path: str) -> None:
        (Path(path) / "tokenizer.json").write_text("{}")


def test_fake_failing_tokenizer_save_leaves_no_partial_final_directory(tmp_path: Path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(hidden_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         intermediate_size=32, vocab_size=20))
    final = tmp_path / "final"
    with pytest.raises(OSError, match="disk full"):
        save_model(model, _FailingTokenizer(), final)
    assert list(tmp_path.iterdir()) == []  # neither final/ nor a temporary directory
    save_model(model, _Tokenizer(), final)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    save_model(model, _Tokenizer(), final)  # replaces the previous final/ as a whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert (final / "tokenizer.json").exists() and (final / "config.json").exists()


# Installed through PYTHONPATH: Ctrl-C lands (the process SIGINTs itself) as FAKE_SIGINT_AT
# starts importing, inside the import machinery as a real Ctrl-C during start-up does; a
# KeyboardInterrupt raised there is noted in FAKE_SIGINT_RAISED.
_SIGINT_IN_IMPORT = """
import importlib.abc, os, signal, sys, time

class _Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["FAKE_SIGINT_AT"]:
            sys.meta_path.remove(self)
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.5)  # the handler runs in here, inside the import
            except KeyboardInterrupt:
                open(os.environ["FAKE_SIGINT_RAISED"], "w").close()
                raise
        return None

sys.meta_path.insert(0, _Interrupt())
"""


@pytest.mark.parametrize("module", ["torch.functional", "transformers.modeling_utils"])
def test_a_ctrl_c_inside_a_library_import_exits_130_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str
):
    """No KeyboardInterrupt is raised inside an import: one raised in torch's aborted the
    process (through pybind11: -6) and one in transformers' lazy modules came back as
    another error (exit 1), by chance, in 2 of 40 Ctrl-Cs; the CLI records it and acts
    once the imports are done."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_SIGINT_IN_IMPORT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path / "site"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("FAKE_SIGINT_AT", module)
    monkeypatch.setenv("FAKE_SIGINT_RAISED", str(tmp_path / "raised"))
    proc = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "train", str(EXAMPLE),
                           "name=imports", f"output_dir={tmp_path / 'runs'}",
                           f"warmstart.cache_dir={tmp_path / 'cache'}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stderr.strip() == "interrupted"
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()
    assert not (tmp_path / "raised").exists(), f"a KeyboardInterrupt was raised inside {module}"


# Installed into every role through PYTHONPATH: the trainer's tokenizer save (the end of
# `save_model`, after the weights are written) takes FAKE_SLOW_SAVE_S longer.
_SLOW_SAVE = """
import os, time
import transformers

_save = transformers.PreTrainedTokenizerBase.save_pretrained

def _slow_save(self, *args, **kwargs):
    time.sleep(float(os.environ["FAKE_SLOW_SAVE_S"]))
    return _save(self, *args, **kwargs)

transformers.PreTrainedTokenizerBase.save_pretrained = _slow_save
"""


@pytest.mark.slow
def test_fake_slow_final_save_completes_before_the_actors_are_told_to_stop(
    tmp_path: Path, warm_cache: Path, monkeypatch: pytest.MonkeyPatch
):
    from transformers import AutoTokenizer

    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_SLOW_SAVE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path / "site"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("FAKE_SLOW_SAVE_S", "8")
    monkeypatch.setattr(launch_module, "ACTORS_GONE_GRACE_S", 2.0)
    cfg = load_config(EXAMPLE, [
        "name=slowsave", f"output_dir={tmp_path / 'runs'}",
        f"warmstart.cache_dir={warm_cache}", "warmstart.steps=20", "eval.enabled=false",
        "engine.capacity=16", "actor.group_size=4", "trainer.batch_size=16",
        "trainer.max_steps=2", "metrics.progress=false", "metrics.plot=false",
    ])
    assert launch(cfg) == 0
    tok = AutoTokenizer.from_pretrained(cfg.run_dir / "final", local_files_only=True)
    assert tok.eos_token_id is not None


def _sleeper(seconds: float) -> subprocess.Popen:
    # Its own process group, as the launcher starts roles (the stop signals go to the group).
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"],
                            start_new_session=True)


def test_a_trainer_waiting_on_a_slow_deferred_evaluation_is_not_called_stranded_fake_roles(
        tmp_path: Path):
    """Deferred evaluation goes on long after the actors left; the run ends when the trainer
    does, however long that takes (on main the launcher failed it `grace` after the actors
    left). Roles are stand-in processes that sleep."""
    procs = [launch_module.RoleProcess("trainer", _sleeper(4.0), None),
             launch_module.RoleProcess("actor_0", _sleeper(0.0), None),
             launch_module.RoleProcess("evaluator", _sleeper(3.0), None)]
    try:
        code, failed = launch_module._supervise(procs, launch_module.StopSignals(), tmp_path,
                                                actors_gone_grace_s=1.5)
        assert (code, failed) == (0, None)
    finally:
        launch_module._stop_all(procs, launch_module.StopSignals())


def test_a_trainer_left_alone_is_stopped_after_the_grace_fake_roles(tmp_path: Path, capsys):
    procs = [launch_module.RoleProcess("trainer", _sleeper(60.0), None),
             launch_module.RoleProcess("actor_0", _sleeper(0.0), None),
             launch_module.RoleProcess("evaluator", _sleeper(0.5), None)]
    try:
        t0 = time.monotonic()
        code, failed = launch_module._supervise(procs, launch_module.StopSignals(), tmp_path,
                                                actors_gone_grace_s=1.0)
        assert (code, failed) == (1, None) and time.monotonic() - t0 < 10
        assert "exited while the trainer was still running" in capsys.readouterr().err
    finally:
        launch_module._stop_all(procs, launch_module.StopSignals())


_LEADER_WITH_HUNG_CHILD = """
import signal, subprocess, sys, time
# A child in the leader's process group that ignores SIGTERM, as a rank stuck in native code.
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"],
    stdout=subprocess.PIPE)
child.stdout.readline()
print(child.pid, flush=True)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))  # the leader leaves on SIGTERM, as torchrun
time.sleep(600)
"""


def test_stop_all_kills_a_hung_child_of_a_leader_that_already_left_fake_role(monkeypatch):
    proc = subprocess.Popen([sys.executable, "-c", _LEADER_WITH_HUNG_CHILD],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    child_pid = int(proc.stdout.readline())
    rp = launch_module.RoleProcess("trainer", proc, None)
    monkeypatch.setattr(launch_module, "STOP_GRACE_S", 1.0)
    launch_module._stop_all([rp], launch_module.StopSignals())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(child_pid, 0)
        except ProcessLookupError:
            break
        # A zombie (already killed, not yet reaped by init) also counts as gone.
        if Path(f"/proc/{child_pid}/stat").read_text().split()[2] == "Z":
            break
        time.sleep(0.05)
    else:
        os.kill(child_pid, signal.SIGKILL)
        pytest.fail("the leader's hung child outlived _stop_all")


class _SwallowsInterrupts:
    """As `regex`'s Group.__del__ did: a Ctrl-C landing in a `__del__` raises there, and
    Python prints 'Exception ignored' and goes on."""

    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)  # the handler runs (and raises) in here


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_ctrl_c_swallowed_during_start_up_still_stops_the_launcher(tmp_path: Path):
    from pipelinerl.proc.stop_signals import StopSignals

    signals = StopSignals()  # what the CLI installs at its first line
    try:
        _SwallowsInterrupts()  # collected at once: its __del__ runs and swallows the interrupt
        assert signals.stop
        cfg = load_config(EXAMPLE, ["name=swallowed", f"output_dir={tmp_path / 'runs'}",
                                    f"warmstart.cache_dir={tmp_path / 'cache'}"])
        assert launch(cfg, signals=signals) == 130
        assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()
    finally:
        signals.restore()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_role_whose_stop_signal_was_swallowed_runs_nothing(tmp_path: Path):
    from pipelinerl.cli import _run_role
    from pipelinerl.proc.stop_signals import StopSignals

    ran: list[bool] = []
    signals = StopSignals()
    try:
        _SwallowsInterrupts()
        cfg = load_config(EXAMPLE, ["name=role", f"output_dir={tmp_path / 'runs'}"])
        assert _run_role("actor_0", cfg, signals, lambda cfg: ran.append(True)) == 130
        assert ran == []
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
