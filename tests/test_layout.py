"""The layout rules of docs/architecture.md, read from the source: the five layers import only downwards,
pretrain/'s top level stays at most 18 modules and subpackages, and no source module passes 500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.launchers import REPO

LAYERS = {"kernels": 1, "model": 2, "data_pipeline": 3, "pretrain": 4, "launch": 5, "experiments": 5, "benchmarks": 5}
MAX_PRETRAIN_ROOMS = 18
MAX_LINES = 500


def _sources() -> list[Path]:
    return sorted(p for package in LAYERS for p in (REPO / package).rglob("*.py"))


def _imported_packages(path: Path) -> set[str]:
    """The project's top-level packages `path` imports anywhere (module level or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found.update(name.split(".")[0] for name in names if name.split(".")[0] in LAYERS)
    return found


def test_no_module_imports_from_a_layer_above_it() -> None:
    upward = []
    for path in _sources():
        own = path.relative_to(REPO).parts[0]
        for package in _imported_packages(path):
            if LAYERS[package] > LAYERS[own]:
                upward.append(f"{path.relative_to(REPO)} imports {package} (layer {LAYERS[package]} > {LAYERS[own]})")
    assert not upward, "\n".join(upward)


def test_pretrain_top_level_holds_at_most_18_rooms() -> None:
    rooms = sorted(p.name for p in (REPO / "pretrain").iterdir()
                   if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file())
    assert len(rooms) <= MAX_PRETRAIN_ROOMS, rooms


def test_no_source_module_is_over_500_lines() -> None:
    long = [f"{p.relative_to(REPO)}: {n}" for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, long
