"""deploy/pipelinerl-node.sh forwards a stop to the role it started (stand-in commands on PATH)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

NODE_SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "pipelinerl-node.sh"


def _stand_in(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)


def test_sigterm_to_the_node_script_stops_its_role_and_exits_with_its_code(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    started, stopped = tmp_path / "started", tmp_path / "stopped"
    _stand_in(bin_dir, "redis-cli", "echo PONG")
    # The actor stand-in stops on SIGTERM with a role's stop code (130), noting it heard it.
    _stand_in(bin_dir, "pipelinerl", f"trap 'touch {stopped}; exit 130' TERM\ntouch {started}\n"
                                      "while :; do sleep 0.05; done")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "NODE_RANK": "1",
           "NNODES": "2", "RUN_ID": "x", "HEAD_HOST": "127.0.0.1"}
    node = subprocess.Popen(["bash", str(NODE_SCRIPT), "run.yaml"], env=env,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not started.exists():
            assert time.monotonic() < deadline and node.poll() is None, node.stderr.read()
            time.sleep(0.05)
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=10) == 130
        assert stopped.exists()
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
