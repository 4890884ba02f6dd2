"""Rows anywhere in the dtype's finite range: every built-in CPU backend and the reference are
accurate for rows whose squares overflow (float64 beyond 1e154) or underflow (float32 near
1e-25 with eps = 0), and a constant row with eps = 0 is NaN everywhere (0 / 0)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import normlab
from normlab import reference, registry

#: The built-in CPU backends; one whose library is not installed is skipped with the reason.
BACKENDS = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(
            not registry.get(name).available, reason=f"{name}: {registry.get(name).reason}"
        ),
    )
    for name in ("numpy", "numba", "torch")
]
RNG = np.random.default_rng(11)


def _call(op: str, x: np.ndarray, backend: str, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """``(y, rstd)`` of ``op`` on ``backend``, as NumPy arrays."""
    xx: Any = x.copy()
    if backend == "torch":
        import torch

        xx = torch.from_numpy(xx)
    result = getattr(normlab, op)(xx, eps=eps, backend=backend, return_stats=True)
    return np.asarray(result[0]), np.asarray(result[-1])


def _exact(op: str, x: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """The float64 result computed on rows scaled by hand to unit size (no overflow there)."""
    ys, rstds = [], []
    for row in x.astype(np.float64):
        s = 2.0 ** np.floor(np.log2(np.max(np.abs(row))))
        with np.errstate(over="ignore"):
            scaled_eps = eps / s / s
        if op == "layer_norm":
            y, _, rstd = reference.layer_norm(row[None] / s, eps=scaled_eps)
        else:
            y, rstd = reference.rms_norm(row[None] / s, eps=scaled_eps)
        ys.append(y[0])
        rstds.append(rstd[0] / s)
    return np.array(ys), np.array(rstds)


def _rows(scale: float, dtype: Any, shape: tuple[int, int] = (3, 257)) -> np.ndarray:
    return (RNG.uniform(-1.0, 1.0, shape) * scale).astype(dtype)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("scale", "dtype", "eps"),
    [
        (1e200, np.float64, 1e-5),  # squares overflow float64
        (1.7e308, np.float64, 0.0),  # the whole float64 range: x - mean overflows unscaled
        (1e-160, np.float64, 0.0),  # squares underflow float64
        (1e-25, np.float32, 0.0),  # squares underflow float32
        (1e-25, np.float32, 1e-60),
        (1e-40, np.float32, 0.0),  # subnormal float32 values
    ],
)
def test_rows_at_the_edges_of_the_range(
    op: str, backend: str, scale: float, dtype: Any, eps: float
) -> None:
    x = _rows(scale, dtype)
    y, rstd = _call(op, x, backend, eps)
    expected_y, expected_rstd = _exact(op, x, eps)
    tolerance = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(y, expected_y, rtol=tolerance, atol=tolerance)
    with np.errstate(over="ignore"):  # 1e-40 rows: rstd beyond float32 is inf
        expected_rstd = expected_rstd.astype(rstd.dtype)
    np.testing.assert_allclose(rstd, expected_rstd.reshape(rstd.shape), rtol=tolerance)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("scale", [1e200, 1e-160])
def test_long_rows_at_the_edges_of_the_float64_range(op: str, scale: float) -> None:
    """numba's segmented form (rows beyond LONG_ROW_BYTES) takes the same repair."""
    kernels = pytest.importorskip("normlab.backends.numba_forward", reason="needs numba")
    x = _rows(scale, np.float64, (1, kernels.LONG_ROW_BYTES // 8 + 5))
    y, rstd = _call(op, x, "numba", 0.0)
    expected_y, expected_rstd = _exact(op, x, 0.0)
    np.testing.assert_allclose(y, expected_y, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(rstd, expected_rstd.reshape(rstd.shape), rtol=1e-11)


@pytest.mark.parametrize("scale", [1e200, 1.7e308, 1e-300])
def test_reference_is_accurate_anywhere_in_float64(scale: float) -> None:
    x = _rows(scale, np.float64)
    y, _, rstd = reference.layer_norm(x, eps=0.0)
    unit = x / scale
    expected = (unit - unit.mean(-1, keepdims=True)) / unit.std(-1, keepdims=True)
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(rstd * scale, 1 / unit.std(-1, keepdims=True), rtol=1e-12)
    y_rms, _ = reference.rms_norm(x, eps=0.0)
    expected_rms = unit / np.sqrt((unit * unit).mean(-1, keepdims=True))
    np.testing.assert_allclose(y_rms, expected_rms, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_constant_rows_with_eps_zero_are_nan(backend: str, dtype: Any) -> None:
    x = np.full((2, 8), 3.25, dtype)
    x[1] = np.arange(8)  # another row stays finite
    y, _ = _call("layer_norm", x, backend, 0.0)
    assert np.isnan(y[0]).all()
    assert np.isfinite(y[1]).all()
    expected, _, _ = reference.layer_norm(x[:1], eps=0.0)
    assert np.isnan(expected).all()


@pytest.mark.parametrize("value", [1e300, -1.7e308, 1e-300, 5e-324])
def test_reference_constant_rows_give_bias_anywhere_in_float64(value: float) -> None:
    """eps / s^2 underflows beside the zero variance of a constant row of huge values: eps
    alone counts, y is exactly bias and rstd 1/sqrt(eps) (it was NaN, 0 * inf)."""
    x = np.full((1, 16), value)
    bias = np.linspace(-1.0, 1.0, 16)
    y, mean, rstd = reference.layer_norm(x, bias=bias, eps=1e-5)
    np.testing.assert_array_equal(y[0], bias)
    assert mean[0, 0] == value and rstd[0, 0] == pytest.approx(1 / np.sqrt(1e-5))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [1e300, -1.7e308])
def test_constant_rows_of_huge_values_give_bias_and_rstd(backend: str, value: float) -> None:
    """eps / s^2 underflows beside the zero variance: eps alone counts, y is bias and rstd is
    1/sqrt(eps) (the torch repair path returned rstd = inf)."""
    x = np.full((2, 16), value)
    y, rstd = _call("layer_norm", x, backend, 1e-5)
    np.testing.assert_array_equal(y, 0.0)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(1e-5), rtol=1e-12)
