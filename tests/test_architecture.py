"""The package's floors (docs/design/architecture.md) as a test: every import of a
pipelinerl module, at the top of a file or inside a function, runs down the floors or stays
in its own folder; no role imports another; the page lists the floors the test holds."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "pipelinerl"
PAGE = ROOT / "docs" / "design" / "architecture.md"

# Floor by floor from the bottom; a room may import its own folder and any lower floor,
# never a room beside it or above it.
FLOORS: list[list[str]] = [
    ["config.py", "types.py", "records.py", "_moved.py"],
    ["proc/", "sandbox/", "sync/"],
    ["streams/", "tasks/", "metrics/"],
    ["models/"],
    ["engine/"],
    ["rollouts/", "rl/"],
    ["run/"],
    ["envs/"],
    ["tools/"],
    ["roles/", "viewer/"],
    ["cli.py"],
]
# roles/wiring.py and roles/heldout.py are what they share, roles/actor_lockstep.py the actor's
# deterministic mode, roles/starting_model.py the launcher's warm start: machinery beside the
# roles, not roles
ROLES = {"actor", "trainer", "evaluator", "launch"}
FLOOR_OF = {room: i for i, rooms in enumerate(FLOORS) for room in rooms}


def room_of(module: str) -> str:
    """`pipelinerl.rl.step` -> "rl/", `pipelinerl.config` -> "config.py"."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__.py"
    if (PACKAGE / parts[0]).is_dir():
        return parts[0] + "/"
    return parts[0] + ".py"


def module_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (PACKAGE / rel).is_dir() or (PACKAGE / rel).with_suffix(".py").is_file()


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every pipelinerl import in the file."""
    here = module_of(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # `from pipelinerl.roles import trainer` imports the module roles.trainer
            found += [(node.lineno, f"{base}.{a.name}" if _is_module(f"{base}.{a.name}")
                       else base) for a in node.names]
    return [(line, m) for line, m in found if m.split(".")[0] == "pipelinerl"]


def violations() -> list[str]:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = module_of(path)
        room = room_of(here)
        if room == "__init__.py":  # the package's face: installs the moved-names finder
            continue
        for line, target in imported(path):
            other = room_of(target)
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            if other == room:
                if room == "roles/":
                    me, it = here.split(".")[2], target.split(".")[2]
                    if me in ROLES and it in ROLES and me != it:
                        wrong.append(f"{where}: a role imports another role")
                continue
            if other not in FLOOR_OF:
                wrong.append(f"{where}: {other} is on no floor (add it to FLOORS and the page)")
            elif FLOOR_OF[other] >= FLOOR_OF[room]:
                side = "beside" if FLOOR_OF[other] == FLOOR_OF[room] else "above"
                wrong.append(f"{where}: {other} is {side} {room} (floor {FLOOR_OF[other]} vs "
                             f"{FLOOR_OF[room]})")
    return wrong


def test_every_import_runs_down_the_floors() -> None:
    assert violations() == []


def test_every_room_is_on_a_floor() -> None:
    rooms = {p.name + "/" for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    rooms |= {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert rooms == set(FLOOR_OF)


def test_the_page_shows_the_floors_as_they_are() -> None:
    """The page's table, `| floor | `room` | ... |`, holds exactly the test's floors."""
    rows = re.findall(r"^\|\s*(\d+)\s*\|\s*`([^`]+)`", PAGE.read_text(), re.M)
    assert sorted((int(f), room) for f, room in rows) == sorted(
        (i, room) for i, rooms in enumerate(FLOORS) for room in rooms)


@pytest.mark.parametrize("source, bad", [
    ("from pipelinerl.roles.actor import Actor\n", "rl/"),  # up
    ("from pipelinerl.rollouts import scoring\n", "rl/"),  # beside
    ("from pipelinerl.roles import trainer\n", "roles/actor"),  # a role imports a role
])
def test_the_rule_catches_a_wrong_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         source: str, bad: str) -> None:
    """A copy of the package with one wrong import fails the check, naming the line."""
    import shutil

    copy = tmp_path / "src" / "pipelinerl"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.html"))
    target = copy / (bad + ".py" if not bad.endswith("/") else bad + "wrong.py")
    target.write_text(target.read_text() + source if target.exists() else source)
    here = sys.modules[__name__]
    monkeypatch.setattr(here, "PACKAGE", copy)
    monkeypatch.setattr(here, "ROOT", tmp_path)
    found = violations()
    assert len(found) == 1 and str(target.relative_to(tmp_path)) in found[0]


def test_old_module_names_still_import_with_a_warning() -> None:
    import importlib
    import sys

    sys.modules.pop("pipelinerl.samples", None)
    with pytest.warns(DeprecationWarning, match="pipelinerl.run.samples"):
        old = importlib.import_module("pipelinerl.samples")
    assert old is importlib.import_module("pipelinerl.run.samples")
    assert old.read_samples is importlib.import_module("pipelinerl.run.samples").read_samples
