"""The import-layer contract in pyproject.toml (checked by import-linter in the ``lint`` session)
names every module of normlab: a new module must take its place in a layer, and the backends'
list of forbidden imports must grow with it."""

from __future__ import annotations

import pkgutil
import re
from pathlib import Path
from typing import Any

import pytest

import normlab

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

#: What the backends may import besides ``normlab.backends.*``.
BACKENDS_MAY_IMPORT = {"normlab.errors", "normlab.hookspecs", "normlab.constants"}


def _contracts() -> dict[str, Any]:
    pyproject = Path(__file__).parents[1] / "pyproject.toml"
    config = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]
    return {c["type"]: c for c in config["contracts"]}


def _modules() -> set[str]:
    return {f"normlab.{m.name}" for m in pkgutil.iter_modules(normlab.__path__)}


def test_every_module_has_a_layer() -> None:
    layers = _contracts()["layers"]["layers"]
    placed = [name for layer in layers for name in re.split(r"[:|]", layer.replace(" ", ""))]
    assert len(placed) == len(set(placed)), "a module is in two layers"
    assert set(placed) == _modules() - {"normlab.backends"}


def test_the_backends_may_import_nothing_else() -> None:
    forbidden = set(_contracts()["forbidden"]["forbidden_modules"])
    assert forbidden == _modules() - BACKENDS_MAY_IMPORT - {"normlab.backends"}
