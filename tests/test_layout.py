"""The folders are the architecture: each folder of the package imports only the folders its
``__init__`` docstring allows, every folder says so in that docstring, and the public paths the
README documents still import after the move into folders."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import chameleon_swap as cs

PKG = Path(cs.__file__).resolve().parent

# What each top-level room of the package may import from the package (besides itself). Mirrors
# the "May import" line of each folder's docstring; a change here is a change of architecture.
ALLOWED = {
    "planning": set(),                                   # pure decisions: nothing of the package
    "copy": {"config"},
    "runtime": {"config", "copy", "planning"},
    "recompute": {"config", "runtime"},
    "policy": {"config", "runtime", "planning", "copy"},
    "engine": {"config", "copy", "policy", "recompute", "runtime", "_version"},
    "parallel": {"config", "copy", "engine", "recompute", "runtime", "planning", "policy"},
    "workloads": set(),
    "_version": set(),
    "bench": {"_version", "config", "copy", "engine", "workloads"},
    "sim": {"_version", "config", "copy", "planning", "runtime", "parallel", "bench", "workloads",
            "<package>"},
    "integrations": {"<package>"},
    "config": {"_version"},
    "cli": {"_version", "bench", "config", "copy", "sim"},
    # documented public paths kept after the move: re-exports only
    "pipeline": {"parallel"},
    "weights": {"parallel"},
    "elastic": {"parallel"},
}
FOLDERS = ("runtime", "planning", "policy", "recompute", "copy", "parallel", "sim", "bench",
           "workloads", "integrations")


def _room(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_rooms(path: Path, source: str | None = None) -> set[str]:
    rel = path.relative_to(PKG)
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            here = list(rel.parts[:-1])
            base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
            parts = base + (node.module.split(".") if node.module else [])
            if parts:
                rooms.add(parts[0])
            else:                                   # "from . import x" at the package's top
                rooms |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("chameleon_swap"):
            parts = node.module.split(".")
            rooms.add(parts[1] if len(parts) > 1 else "<package>")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "chameleon_swap":
                    parts = a.name.split(".")
                    rooms.add(parts[1] if len(parts) > 1 else "<package>")
    return rooms


def _modules():
    return sorted(p for p in PKG.rglob("*.py") if _room(p) not in ("__init__", "__main__"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_each_module_imports_only_what_its_room_allows(path):
    room = _room(path)
    assert room in ALLOWED, f"{room}: a new room needs its place in ALLOWED and a docstring"
    extra = _imported_rooms(path) - ALLOWED[room] - {room}
    assert not extra, f"{path.relative_to(PKG)} imports {sorted(extra)}, which {room} may not"


def test_planning_never_imports_torch():
    for path in (PKG / "planning").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            assert not any(n.split(".")[0] == "torch" for n in names), path.name


@pytest.mark.parametrize("folder", FOLDERS)
def test_each_folder_says_what_it_owns_and_its_dependencies(folder):
    doc = ast.get_docstring(ast.parse((PKG / folder / "__init__.py").read_text()))
    assert doc, folder
    assert "May import" in doc and "Imported by" in doc, folder


def test_the_rule_catches_an_arrow_back_up():
    # The checker itself must see a forbidden import, relative or absolute: planning importing
    # the runtime, as a module of planning/ would write it.
    probe = PKG / "planning" / "probe.py"
    for line in ("from ..runtime import records", "from chameleon_swap.runtime import records",
                 "import chameleon_swap.runtime.records"):
        assert _imported_rooms(probe, line) - ALLOWED["planning"] == {"runtime"}, line
    assert _imported_rooms(probe, "from .timeline import simulate") == {"planning"}


@pytest.mark.parametrize("path,name", [
    ("chameleon_swap", "Chameleon"), ("chameleon_swap", "StepStats"),
    ("chameleon_swap.pipeline", "PipelineChameleon"), ("chameleon_swap.pipeline", "ScheduleChronos"),
    ("chameleon_swap.weights", "WeightOffload"),
    ("chameleon_swap.integrations.transformers", None),
    ("chameleon_swap.integrations.lightning", None),
    ("chameleon_swap.cli", "main"),
    ("chameleon_swap.sim", "load"),
])
def test_documented_public_paths_still_import(path, name):
    if path.endswith((".transformers", ".lightning")):
        pytest.importorskip(path.rsplit(".", 1)[1])
    mod = importlib.import_module(path)
    if name:
        assert hasattr(mod, name), f"{path}.{name}"


def test_no_module_over_400_lines_without_a_reason():
    for path in _modules():
        lines = path.read_text().splitlines()
        if len(lines) > 400:
            head = "\n".join(lines[:40])
            assert "Why one file" in head, f"{path.relative_to(PKG)}: {len(lines)} lines, no reason"
