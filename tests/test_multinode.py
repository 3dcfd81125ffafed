"""Issue 45 part 3: the multi-machine rehearsal. docs/multinode.md's commands, each role on a
"machine" of its own (a network namespace on one bridge, its host name on loopback as on
Debian), with the CPU demo's tiny model: redis-server and the trainer (two ranks under
torchrun, gloo) on host 0, actor 0 on host 1, actor 1 on host 2, the evaluator on host 3.

Traffic stays inside the namespaces made here (tests/netns.py). Without root or iproute2 the
tests are skipped with that reason.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from netns import Lan, lan

from pipelinerl.config import load_config
from pipelinerl.roles.launch import starting_model

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "arithmetic.yaml"
AUDIT_LINE = re.compile(r"published (\d+) trained (\d+) dropped (\d+) lost (\d+) duplicated (\d+)")
REDIS_PORT, RDZV_PORT, STORE_PORT = 6379, 29400, 29500
# One thread per process, as the launcher gives each role (docs/multinode.md): 2 cores here.
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
ROLE_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def hosts() -> Iterator[Lan]:
    with lan(4) as made:
        yield made


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The warm-started tiny model every machine reads (docs/multinode.md: the same model on
    every machine), built once into the session's warm-start cache."""
    cache = tmp_path_factory.getbasetemp() / "warmstart-cache"
    cache.mkdir(exist_ok=True)
    cfg = load_config(EXAMPLE, [f"warmstart.cache_dir={cache}", "warmstart.steps=20"])
    return starting_model(cfg)


def _write_config(path: Path, hosts: Lan, model: Path, name: str, **sections: dict) -> Path:
    """docs/multinode.md's run.yaml: the demo's settings, Redis and the weight store on host 0."""
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg.pop("warmstart")
    cfg.update(name=name, output_dir=str(path.parent / "runs"))
    cfg["model"] = {"path": str(model)}
    cfg["engine"].update(capacity=8)
    cfg["actor"].update(num_actors=2, group_size=4, max_lag=1)
    cfg["trainer"].update(batch_size=16, max_time_s=0)
    cfg["stream"] = {"backend": "redis", "redis_url": f"redis://{hosts.addrs[0]}:{REDIS_PORT}/0",
                     "keep_all": True}
    cfg["sync"] = {"backend": "broadcast", "init_method": f"tcp://{hosts.addrs[0]}:{STORE_PORT}",
                   "timeout_s": 60}
    cfg["metrics"] = {"progress": False, "plot": False}
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(cfg))
    return path


class Run:
    """docs/multinode.md's commands, started on their hosts, each role's output in a log."""

    def __init__(self, hosts: Lan, config: Path, run_id: str) -> None:
        self.hosts, self.config, self.run_id = hosts, config, run_id
        self.logs = config.parent / f"logs-{run_id}"
        self.logs.mkdir()
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, role: str, host: int, argv: list[str], python: bool = True) -> None:
        log = (self.logs / f"{role}.log").open("a")
        start = self.hosts.python if python else self.hosts.popen
        self.procs[role] = start(host, argv, THREADS, stdout=log, stderr=subprocess.STDOUT)

    def redis(self) -> None:
        self.start("redis", 0, ["redis-server", "--bind", self.hosts.addrs[0], "--port",
                                str(REDIS_PORT), "--protected-mode", "no", "--save", "",
                                "--appendonly", "no"], python=False)

    def trainer(self, nnodes: int = 1, nproc: int = 2, node: int = 0) -> None:
        self.start(f"trainer{node}", node, [
            "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.hosts.addrs[0]}:{RDZV_PORT}",
            # The endpoint's host serves the rendezvous: torchrun guesses it from the host
            # name, which here (as on Debian) resolves to loopback (docs/multinode.md).
            "--rdzv-conf", f"is_host={int(node == 0)}",
            "-m", "pipelinerl.cli", "trainer", str(self.config), f"run_id={self.run_id}"])

    def actor(self, actor_id: int, host: int) -> None:
        self.start(f"actor{actor_id}", host, ["-m", "pipelinerl.cli", "actor", str(self.config),
                                              f"run_id={self.run_id}", "--actor-id", str(actor_id)])

    def evaluator(self, host: int) -> None:
        self.start("evaluator", host, ["-m", "pipelinerl.cli", "evaluator", str(self.config),
                                       f"run_id={self.run_id}"])

    def log(self, role: str) -> str:
        return (self.logs / f"{role}.log").read_text(errors="replace")

    def wait(self, role: str, timeout_s: float = ROLE_TIMEOUT_S) -> None:
        proc = self.procs[role]
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{role} still running after {timeout_s} s:\n"
                                 f"{self.log(role)[-4000:]}") from None
        assert proc.returncode == 0, f"{role} exited {proc.returncode}:\n{self.log(role)[-4000:]}"

    def kill(self, role: str) -> None:
        """SIGKILL the role's processes (its session: the role and anything it started)."""
        os.killpg(self.procs[role].pid, signal.SIGKILL)
        self.procs[role].wait(timeout=30)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    made: list[Run] = []
    yield made
    for run in made:
        run.stop_all()


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def _steps(run_dir: Path) -> list[int]:
    """The training steps logged (evaluations are logged there too, under eval/ keys)."""
    return [m["step"] for m in _metrics(run_dir) if "samples_trained" in m]


def _wait_for_step(run: Run, run_dir: Path, step: int, timeout_s: float = ROLE_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while len(_steps(run_dir)) < step:
        trainer = run.procs["trainer0"]
        assert trainer.poll() is None, f"trainer exited {trainer.returncode}:\n{run.log('trainer0')}"
        assert time.monotonic() < deadline, f"no step {step} in {timeout_s} s"
        time.sleep(0.5)


def _audit(run: Run, run_dir: Path) -> tuple[list[int], str]:
    """`pipelinerl audit RUN_DIR` on the Redis host. It reads the run's config (with its run
    id) from the run directory, which roles started by hand do not write: docs/multinode.md
    has it copied there."""
    cfg = yaml.safe_load(run.config.read_text()) | {"run_id": run.run_id}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    audit = run.hosts.python(0, ["-m", "pipelinerl.cli", "audit", str(run_dir)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = audit.communicate(timeout=120)
    match = AUDIT_LINE.search(out)
    assert match and audit.returncode == 0, out + err
    return [int(x) for x in match.groups()], out


def test_roles_on_four_hosts_train_and_a_killed_actor_restarted_by_hand_loses_nothing(
        tmp_path: Path, hosts: Lan, model_dir: Path, runs: list[Run]) -> None:
    steps = 6
    config = _write_config(tmp_path / "run.yaml", hosts, model_dir, "multinode",
                           trainer={"max_steps": steps},
                           eval={"enabled": True, "num_problems": 8, "every_steps": 3,
                                 "every_s": 0, "temperature": 0.0})
    run_dir = tmp_path / "runs" / "multinode"
    run = Run(hosts, config, run_id="job-4501")
    runs.append(run)
    run.redis()
    run.trainer()
    run.actor(0, host=1)
    run.actor(1, host=2)
    run.evaluator(host=3)
    _wait_for_step(run, run_dir, 2)
    run.kill("actor1")
    run.actor(1, host=2)  # again by hand, the same command (docs/multinode.md)
    for role in ("trainer0", "actor0", "actor1", "evaluator"):
        run.wait(role)

    assert _steps(run_dir) == list(range(1, steps + 1))
    (_, trained, _, lost, duplicated), table = _audit(run, run_dir)
    assert (trained, lost, duplicated) == (steps * 16 // 4, 0, 0), table
    # The weight group reached every host over its bridge, not over loopback.
    assert f"weight group interface {hosts.ifnames[0]}" in run.log("trainer0")
    for role, host in (("actor0", 1), ("actor1", 2), ("evaluator", 3)):
        assert f"weight group interface {hosts.ifnames[host]}" in run.log(role), run.log(role)
    assert "weight-sync group formed again" in run.log("trainer0")
    assert "actor 1 continues after" in run.log("actor1")
    # The evaluator, on a host of its own, evaluated the final weights.
    evaluated = [m["eval/version"] for m in _metrics(run_dir) if "eval/version" in m]
    assert evaluated[-1] == steps, evaluated



def test_fsdp2_trainer_trains_with_actors_on_other_hosts(
        tmp_path: Path, hosts: Lan, model_dir: Path, runs: list[Run]) -> None:
    """FSDP2 (two ranks under torchrun on host 0) gathers its shards and broadcasts them to
    actors on hosts 1 and 2 over the bridge."""
    steps = 3
    config = _write_config(tmp_path / "run.yaml", hosts, model_dir, "fsdp2",
                           trainer={"max_steps": steps, "strategy": "fsdp2",
                                    "fsdp": {"param_dtype": "float32",
                                             "reduce_dtype": "float32"}},
                           eval={"enabled": False})
    run_dir = tmp_path / "runs" / "fsdp2"
    run = Run(hosts, config, run_id="job-4502")
    runs.append(run)
    run.redis()
    run.trainer()
    run.actor(0, host=1)
    run.actor(1, host=2)
    for role in ("trainer0", "actor0", "actor1"):
        run.wait(role)

    assert _steps(run_dir) == list(range(1, steps + 1))
    (_, trained, _, lost, duplicated), table = _audit(run, run_dir)
    assert (trained, lost, duplicated) == (steps * 16 // 4, 0, 0), table
    assert "broadcast weights version 3" in run.log("trainer0")
    for role, host in (("actor0", 1), ("actor1", 2)):
        assert f"weight group interface {hosts.ifnames[host]}" in run.log(role), run.log(role)


NODE_SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "pipelinerl-node.sh"
MANIFEST = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes" / "pipelinerl.yaml"


def test_slurm_node_script_with_addresses_standing_in_for_node_names_and_no_scontrol(
        tmp_path: Path, hosts: Lan, model_dir: Path) -> None:
    """deploy/slurm/pipelinerl.sbatch's per-node step (deploy/pipelinerl-node.sh) on three
    hosts, with the variables Slurm sets for a 3-node job. Stand-ins: the node list holds the
    hosts' addresses (the namespaces have no names of their own), plain and comma-separated
    as the script takes it where scontrol is absent. Redis and the weight store come from the
    script alone: the config names neither."""
    steps = 3
    config = _write_config(tmp_path / "run.yaml", hosts, model_dir, "slurm",
                           trainer={"max_steps": steps}, eval={"enabled": False})
    cfg = yaml.safe_load(config.read_text())
    del cfg["stream"]["redis_url"], cfg["sync"]["init_method"]
    config.write_text(yaml.safe_dump(cfg))
    slurm = {"SLURM_JOB_ID": "4503", "SLURM_NNODES": "3", "SLURM_GPUS_ON_NODE": "2",
             "SLURM_JOB_NODELIST": ",".join(hosts.addrs[:3]), **THREADS}
    nodes: list[subprocess.Popen] = []
    logs = [tmp_path / f"node{i}.log" for i in range(3)]
    try:
        for i in range(3):
            nodes.append(hosts.popen(i, ["bash", str(NODE_SCRIPT), str(config)],
                                     {**slurm, "SLURM_NODEID": str(i), "SLURM_PROCID": str(i)},
                                     stdout=logs[i].open("w"), stderr=subprocess.STDOUT))
        for i, node in enumerate(nodes):
            try:
                code = node.wait(timeout=ROLE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                code = None
            assert code == 0, f"node {i} exit {code}:\n{logs[i].read_text()[-4000:]}"
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait(timeout=30)

    text = [log.read_text() for log in logs]
    assert "redis-server on port 6379" in text[0] and "trainer node 0 of 1, 2 rank(s)" in text[0]
    assert "actor 0" in text[1] and "actor 1" in text[2]
    run_dir = tmp_path / "runs" / "slurm"
    assert _steps(run_dir) == list(range(1, steps + 1))
    trained = [g for line in (run_dir / "trained.jsonl").read_text().splitlines()
               for g in json.loads(line)["trained"]]
    assert len(trained) == len(set(trained)) == steps * 16 // 4
    assert f"weight group interface {hosts.ifnames[1]}" in text[1]


def test_kubernetes_manifest_gives_the_node_script_what_it_reads() -> None:
    """No cluster here: the manifest's own consistency. The headless Service names the
    Job's pods, so HEAD_HOST (index 0) resolves; NNODES matches the Job's completions."""
    service, job = yaml.safe_load_all(MANIFEST.read_text())
    assert service["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert int(env["NNODES"]) == spec["completions"] == spec["parallelism"]
    assert env["HEAD_HOST"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert "RUN_ID" in env and Path(container["command"][0]).name == NODE_SCRIPT.name
    script = NODE_SCRIPT.read_text()
    for name in ("JOB_COMPLETION_INDEX", *env):
        assert f"${{{name}" in script or f"{name}=${{{name}" in script, name
