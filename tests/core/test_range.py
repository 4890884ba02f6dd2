"""Rows anywhere in the dtype's finite range: every built-in CPU backend and the reference are
accurate for rows whose squares overflow (float64 beyond 1e154) or underflow (float32 near
1e-25 with eps = 0), and a constant row with eps = 0 is NaN everywhere (0 / 0). Below, the
range bugs the API fuzzer found: tiny eps on constant rows, rows of huge spread (and their
gradients), quiet overflow in the backward, rows whose mean is not representable (torch)."""

from __future__ import annotations

import math
import warnings
from typing import Any, Final

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


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


#: Where the torch backend keeps torch's own numerics: CUDA, on which no check of the statistics
#: runs (it would wait for the device). Skipped without a CUDA device; strict where torch's
#: float32 arithmetic must fail (squares past 3.4e38), not where it was never measured.
NO_CUDA: Final = pytest.mark.skipif(not _cuda_available(), reason="no CUDA device")
ON_CUDA: Final = pytest.param(
    "cuda", marks=[NO_CUDA, pytest.mark.xfail(strict=True, reason="torch's numerics on CUDA")]
)
ON_CUDA_UNMEASURED: Final = pytest.param(
    "cuda",
    marks=[NO_CUDA, pytest.mark.xfail(strict=False, reason="torch's numerics, not measured")],
)


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


# --------------------------------------------------------------------------------------------
# Found by the API fuzzer (tests/core/test_fuzz_api.py)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("eps", [1e-80, 1e-40])
def test_constant_rows_with_a_tiny_positive_eps_give_bias(backend: str, eps: float) -> None:
    """eps > 0, so a constant row gives exactly bias, and rstd = 1/sqrt(eps) rounded to float32
    (inf at 1e-80); in float32, eps rounds to 0 or a subnormal, and 1/sqrt(1e-80) overflows."""
    x: Any = np.full((2, 4), 3.0, np.float32)
    bias = np.arange(4, dtype=np.float32)
    if backend == "torch":
        import torch

        x, bias = torch.from_numpy(x), torch.from_numpy(bias)
    y, mean, rstd = normlab.layer_norm(x, bias=bias, eps=eps, backend=backend, return_stats=True)
    np.testing.assert_array_equal(np.asarray(y), np.tile(np.arange(4.0), (2, 1)))
    np.testing.assert_array_equal(np.asarray(mean), 3.0)
    with np.errstate(over="ignore"):  # 1e40 is inf in float32
        np.testing.assert_array_equal(np.asarray(rstd), np.float32(1 / math.sqrt(eps)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_rows_with_a_tiny_positive_eps_give_zero_in_rms_norm(backend: str) -> None:
    x: Any = np.zeros((2, 4), np.float32)
    if backend == "torch":
        import torch

        x = torch.from_numpy(x)
    y, rstd = normlab.rms_norm(x, eps=1e-80, backend=backend, return_stats=True)
    np.testing.assert_array_equal(np.asarray(y), 0.0)
    np.testing.assert_array_equal(np.asarray(rstd), np.inf)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA_UNMEASURED])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("eps", [1e-5, 1e-9, 1e-12, 1e-30, 1e-80])
def test_torch_half_constant_rows_give_bias(device: str, dtype: str, eps: float) -> None:
    """A constant row gives exactly ``bias`` when eps > 0. torch's CPU kernel for half x misses
    it by its float32 rounding of ``mean * rstd``: -1.6e-5 at eps=1e-5 on rows of 3.1, -0.125 at
    1e-12, -inf at 1e-30; the backend recomputes those (eps-dominated) rows."""
    torch = pytest.importorskip("torch")
    x = torch.full((2, 8), 3.1, dtype=getattr(torch, dtype), device=device)
    bias = torch.arange(8.0, device=device)
    y = normlab.layer_norm(x, weight=torch.full((8,), 2.0, device=device), bias=bias, eps=eps)
    assert torch.equal(y.float(), bias.expand(2, 8)), y[0, 0]


def test_numpy_backward_is_quiet_about_overflow_as_the_forward_is() -> None:
    """The forward lets NaN and Inf propagate quietly; so does the backward (no RuntimeWarning,
    which would be an exception under ``-W error``)."""
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    _, mean, rstd = normlab.layer_norm(x, return_stats=True, backend="numpy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        huge = np.tile(np.array([3e38, -3e38], np.float32), (2, 2))
        normlab.layer_norm(huge, backend="numpy")
        dx, _, _ = normlab.layer_norm_backward(
            np.full_like(x, 3e38), x, mean, rstd, backend="numpy"
        )
    assert not np.isfinite(dx).all()  # the overflow happened, quietly


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spread", [1e20, 1e38, 3e38])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_float32_rows_of_huge_spread(backend: str, spread: float, op: str) -> None:
    """Rows of +-spread normalize to +-1 (the float64 reference), whatever the other rows; in
    float32 the squares (or the differences, or their sums) overflow."""
    x: Any = np.tile(np.array([spread, -spread], np.float32), (3, 2))
    x[1] = np.arange(4, dtype=np.float32)  # an ordinary row between two huge ones
    if backend == "torch":
        import torch

        x = torch.from_numpy(x)
    y, *stats = getattr(normlab, op)(x, backend=backend, return_stats=True)
    want, *want_stats = getattr(reference, op)(x)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5)
    for got, expected in zip(stats, want_stats, strict=True):
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5)


def test_torch_rms_norm_without_the_private_fused_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU row check reads rstd from ``torch._fused_rms_norm`` (private, present in the
    pinned torch); a torch without it gets ``F.rms_norm``'s results, unchecked."""
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32))
    monkeypatch.delattr(torch, "_fused_rms_norm")
    y, rstd = normlab.rms_norm(x, backend="torch", return_stats=True)
    want, want_rstd = reference.rms_norm(x)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5)
    np.testing.assert_allclose(rstd.numpy(), want_rstd, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_float64_rows_of_huge_spread(backend: str, op: str) -> None:
    """float64 squares overflow past 1.3e154: such rows are recomputed scaled by a power of two."""
    x: Any = np.array([[1e300, -1e300, 1e300, -1e300], [1.0, 2.0, 3.0, 4.0]])
    if backend == "torch":
        import torch

        x = torch.from_numpy(x)
    y, *stats = getattr(normlab, op)(x, backend=backend, return_stats=True)
    np.testing.assert_allclose(np.asarray(y)[0], [1.0, -1.0, 1.0, -1.0], rtol=1e-12)
    np.testing.assert_allclose(np.asarray(stats[-1])[0], 1e-300, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(y)[1], getattr(reference, op)(x[1:])[0][0], rtol=1e-12)


@pytest.mark.parametrize("layout", ["c", "fortran"])
def test_numpy_in_place_rows_of_huge_spread(layout: str) -> None:
    """In place (out=x), a row recomputed after the pass still reads x, not the result."""
    x = np.tile(np.array([3e38, -3e38], np.float32), (3, 2))
    x[1] = [1.0, 2.0, 3.0, 5.0]
    x = np.asfortranarray(x) if layout == "fortran" else x
    want = reference.layer_norm(x)[0]
    y = normlab.layer_norm(x, backend="numpy", out=x)
    assert y is x
    np.testing.assert_allclose(x, want, rtol=1e-5)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_torch_rows_recomputed_keep_their_gradients(device: str, op: str) -> None:
    """Rows that the torch backend recomputes (here spread over 1e20, beside ordinary rows) get
    the gradients of the float64 formula, for x, weight and bias; the other rows keep torch's."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x64 = rng.standard_normal((4, 6))
    x64[1] = np.tile([1e20, -1e20, 3e19], 2)
    dy = torch.from_numpy(rng.standard_normal((4, 6)))
    leaves = [torch.from_numpy(a).to(device) for a in (x64, rng.random(6), rng.random(6))]
    wide = [t.clone().requires_grad_() for t in leaves]
    narrow = [t.float().requires_grad_() for t in leaves]
    names = ("x", "weight", "bias") if op == "layer_norm" else ("x", "weight")
    y = getattr(normlab, op)(**dict(zip(names, narrow, strict=False)), eps=1e-5)
    (y.double() * dy.to(device)).sum().backward()
    # the float64 reference: torch's own, in whose float64 squares 1e20 does not overflow
    want = getattr(torch.nn.functional, op)(wide[0], (6,), *wide[1 : len(names)], eps=1e-5)
    (want * dy.to(device)).sum().backward()
    np.testing.assert_allclose(y.detach().double().cpu(), want.detach().cpu(), atol=1e-5)
    for got, ref in zip(narrow[: len(names)], wide[: len(names)], strict=True):
        assert got.grad is not None and ref.grad is not None
        np.testing.assert_allclose(got.grad.double().cpu(), ref.grad.cpu(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("rows", [1, 2, 16, 17, 40])
def test_torch_cpu_check_finds_one_bad_row_among_few_or_many(op: str, rows: int) -> None:
    """The torch backend's CPU check reads up to ``FEW_ROWS`` rstd values as Python floats and
    more by a torch reduction: either way the one row whose float32 squares overflow (the last)
    is found and recomputed, and the other rows keep torch's results."""
    torch = pytest.importorskip("torch")
    from normlab.backends import torch_backend

    assert torch_backend.FEW_ROWS == 16  # the rows above straddle it
    x = RNG.standard_normal((rows, 6)).astype(np.float32)
    x[-1] = np.array([3e38, -3e38] * 3, np.float32)
    y, *stats = getattr(normlab, op)(torch.from_numpy(x), backend="torch", return_stats=True)
    want, *want_stats = getattr(reference, op)(x)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-6)
    for got, expected in zip(stats, want_stats, strict=True):
        np.testing.assert_allclose(got.numpy(), expected.reshape(got.shape), rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_torch_rows_of_unrepresentable_mean_are_recomputed(dtype: str) -> None:
    """x = [C + 6, C + 4] where the dtype's spacing is 2 (C = 2**24 in float32, 2**53 in
    float64): torch's CPU layer_norm (torch 2.13) finds variance 0 for such a row (y = 2 /
    sqrt(eps) = 632); the torch backend's row check flags its eps-dominated rstd and recomputes
    the row, and the ordinary row beside it keeps torch's result. (Found by the fused ops'
    fuzzer: tests/fused/test_fused.py::test_rows_of_unrepresentable_mean_on_torch.)"""
    torch = pytest.importorskip("torch")
    big = 2.0**24 if dtype == "float32" else 2.0**53
    x = torch.tensor([[big + 6, big + 4], [1.0, 2.0]], dtype=getattr(torch, dtype))
    y = normlab.layer_norm(x, backend="torch")
    torch.testing.assert_close(y[1], torch.nn.functional.layer_norm(x[1:], (2,))[0])
    assert y[0].abs().max() < 2  # [1, -1] up to the row's conditioning; torch alone: 632
