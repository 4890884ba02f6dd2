"""The import-layer contract in pyproject.toml (checked by import-linter in the ``lint`` session)
names every module of normlab: a new module must take its place in a layer, and the backends'
list of forbidden imports must grow with it. No import circle anywhere in normlab/,
benchmarks/ or plugins/, functions' imports counted."""

from __future__ import annotations

import ast
import pkgutil
import re
from pathlib import Path
from typing import Any, Final

import pytest

import normlab
from tests.support.paths import ROOT

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

#: What the backends may import besides ``normlab.backends.*``.
BACKENDS_MAY_IMPORT = {
    "normlab.errors",
    "normlab.scalars",
    "normlab.ops",
    "normlab.hookspecs",
    "normlab.constants",
}


def _contracts() -> dict[str, Any]:
    """The contracts by id (benchmarks/ has its own, which import-linter keeps exhaustive)."""
    pyproject = ROOT / "pyproject.toml"
    config = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]
    return {c["id"]: c for c in config["contracts"]}


def _modules() -> set[str]:
    return {f"normlab.{m.name}" for m in pkgutil.iter_modules(normlab.__path__)}


def test_every_module_has_a_layer() -> None:
    layers = _contracts()["normlab-layers"]["layers"]
    placed = [name for layer in layers for name in re.split(r"[:|]", layer.replace(" ", ""))]
    assert len(placed) == len(set(placed)), "a module is in two layers"
    assert set(placed) == _modules() - {"normlab.backends"}


def test_the_backends_may_import_nothing_else() -> None:
    forbidden = set(_contracts()["backends-forbidden"]["forbidden_modules"])
    assert forbidden == _modules() - BACKENDS_MAY_IMPORT - {"normlab.backends"}


# --------------------------------------------------------------------------------------------
# No import circle: import-linter's layers allow siblings of one layer to import each other


#: The source trees checked, each with its top-level packages.
TREES: Final = {
    ROOT: ("normlab", "benchmarks"),
    **{
        src: tuple(p.name for p in src.iterdir() if p.is_dir() and "." not in p.name)
        for src in (ROOT / "plugins").glob("*/src")
    },
}


def _graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Which module of ``packages`` imports which, at module level or inside functions; a
    submodule's import runs its package (not counted for the package's own submodules, nor
    for the top-level package, whose modules all run it)."""
    files = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {known(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                module_of = node.module
                targets |= {known(f"{module_of}.{a.name}") or known(module_of) for a in node.names}
        imported = {t for t in targets if t is not None and t != module}
        for target in list(imported):  # the packages between the top level and the target
            parts = target.split(".")
            imported |= {
                ".".join(parts[:k]) for k in range(2, len(parts))
                if not module.startswith(".".join(parts[:k]) + ".")
            }  # fmt: skip
        graph[module] = {t for t in imported if t in files and t != module}
    return graph


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph``, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)) is not None:
            return found
    return None


@pytest.mark.parametrize("root", list(TREES), ids=lambda p: str(p.relative_to(ROOT)) or ".")
def test_no_import_circle(root: Path) -> None:
    circle = _circle(_graph(root, TREES[root]))
    assert circle is None, " -> ".join(circle or ())


def test_the_circle_finder_finds_one() -> None:
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _circle({"a": {"b"}, "b": set()}) is None
