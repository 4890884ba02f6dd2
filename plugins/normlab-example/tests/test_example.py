"""The example plugin, installed: normlab lists it and it passes the conformance suite."""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest

import normlab
import normlab.testing
from normlab import reference
from normlab.testing.tolerances import assert_close, conditioning


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


@pytest.mark.parametrize(
    ("magnitude", "eps"),
    [(1e300, 1e-5), (1e-305, 0.0), (1e-300, 1e-5)],
    ids=["squares_overflow", "squares_underflow", "eps_dwarfs_the_row"],
)
def test_float64_rows_anywhere_in_the_finite_range(magnitude: float, eps: float) -> None:
    """Rows are scaled by a power of two: float64 squares neither overflow nor underflow, and a
    constant row (the last, with eps > 0) gives exactly bias and rstd = 1/sqrt(eps), however
    large or small its values."""
    rng = np.random.default_rng(3)
    x = magnitude * rng.uniform(0.5, 2.5, (5, 40)) * np.resize([1.0, -1.0, 1.0], 40)
    bias = np.linspace(-1.0, 1.0, 40)
    if eps > 0:
        x[4] = x[4, 0]
    y, mean, rstd = normlab.layer_norm(x, bias=bias, eps=eps, return_stats=True, backend="example")
    want_y, want_mean, want_rstd = reference.layer_norm(x, bias=bias, eps=eps)
    cond = conditioning(want_mean, want_rstd)
    assert_close(y, want_y, "float64", cond, what="y", cols=40)
    assert_close(mean, want_mean, "float64", cond, what="mean", cols=40, scale=1 / want_rstd)
    assert_close(rstd, want_rstd, "float64", cond, what="rstd", cols=40, scale=want_rstd)
    if eps > 0:
        np.testing.assert_array_equal(y[4], bias)
        assert mean[4, 0] == x[4, 0] and rstd[4, 0] == pytest.approx(1 / np.sqrt(eps))
