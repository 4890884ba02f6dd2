"""The example plugin, installed: normlab lists it and it passes the conformance suite."""

from __future__ import annotations

import importlib.metadata

import numpy as np

import normlab
import normlab.testing


def _example() -> normlab.registry.Backend:
    return next(b for b in normlab.list_backends() if b.name == "example")


def test_listed_with_its_distribution() -> None:
    backend = _example()
    version = importlib.metadata.version("normlab-example")
    assert backend.provided_by == f"normlab-example {version}"
    assert backend.available
    assert backend.priority == 1
    assert not normlab.plugin_failures()


def test_never_chosen_by_default() -> None:
    x = np.zeros((2, 3), dtype=np.float32)
    assert "chosen: example" not in normlab.explain(x)
    assert "chosen: example" in normlab.explain(x, backend="example")


def test_worked_example() -> None:
    y = normlab.layer_norm(np.array([1.0, 3.0, 5.0, 7.0]), backend="example")
    np.testing.assert_allclose(y, [-1.3416, -0.4472, 0.4472, 1.3416], atol=1e-4)


def test_conformance_suite_passes() -> None:
    assert normlab.testing.check("example") == 0
