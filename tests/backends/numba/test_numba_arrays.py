"""The Numba backend on NumPy arrays (:mod:`normlab.backends.numba_arrays`), driven directly (a
Plan from ``spec.plan``, then its layer_norm or rms_norm): values against the float64 reference,
layouts, ``out=`` and in place, RMSNorm, the float32 range and long rows.

Results are compared with the float64 reference within the tolerance table of
:mod:`normlab.testing.tolerances`. Arrays stay small: these tests check correctness, never speed.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
import pytest

pytest.importorskip("numba")

from normlab.backends import numba_forward, output_pool
from tests.support.numba_direct import (
    DTYPES,
    check,
    check_rms,
    dtype_of,
    long_cols,
    numba_call,
    randn,
)

# --------------------------------------------------------------------------------------------
# Values


@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype: str, affine: str) -> None:
    x = randn((37, 300), dtype, loc=3.0)
    weight = randn((300,), dtype, seed=1) if affine in ("both", "weight") else None
    bias = randn((300,), dtype, seed=2) if affine in ("both", "bias") else None
    check(x, weight, bias, 1e-5, numba_call(x, weight, bias))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_x_with_float32_parameters(dtype: str) -> None:
    x = randn((9, 64), dtype)
    weight, bias = randn((64,), "float32", seed=1), randn((64,), "float32", seed=2)
    check(x, weight, bias, 1e-5, numba_call(x, weight, bias))


@pytest.mark.parametrize("cols", [1, 3, 17, 127, 1000, 4097])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_awkward_row_lengths(dtype: str, cols: int) -> None:
    x = randn((5, cols), dtype, loc=-2.0)
    weight, bias = randn((cols,), dtype, seed=1), randn((cols,), dtype, seed=2)
    check(x, weight, bias, 1e-5, numba_call(x, weight, bias))


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_rows_give_bias_exactly(dtype: str) -> None:
    x = np.repeat(np.array([[0.0], [1.5], [-3.25], [1000.0]]), 513, axis=1).astype(dtype_of(dtype))
    weight, bias = randn((513,), dtype, seed=1), randn((513,), dtype, seed=2)
    y, mean, _ = numba_call(x, weight, bias)
    assert np.array_equal(y, np.broadcast_to(bias, y.shape))
    assert np.array_equal(mean, x[:, 0].astype(mean.dtype))
    y, _, _ = numba_call(x, weight)
    assert not y.astype(np.float64).any()


def test_large_offset_float32() -> None:
    x = randn((16, 1024), "float64", seed=3)
    x = (100 + 0.01 * x).astype(np.float32)
    check(x, None, None, 1e-5, numba_call(x))


def test_float16_zeros_with_tiny_eps() -> None:
    x = np.zeros((4, 100), np.float16)
    y, _, rstd = numba_call(x, eps=1e-12)
    assert not np.isnan(y).any() and not y.astype(np.float64).any()
    assert np.all(rstd == np.float32(1e6))


def test_float16_near_max_does_not_overflow() -> None:
    rng = np.random.default_rng(4)
    magnitudes = rng.uniform(55000, 65000, (6, 777))
    x = (magnitudes * rng.choice([-1.0, 1.0], magnitudes.shape)).astype(np.float16)
    x[0] = np.float16(60000) + rng.integers(0, 3, 777).astype(np.float16) * 32
    result = numba_call(x)
    assert np.isfinite(result[0].astype(np.float64)).all()
    check(x, None, None, 1e-5, result)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nan_and_inf_stay_in_their_rows(dtype: str) -> None:
    x = randn((8, 50), dtype)
    clean, _, _ = numba_call(x)
    poisoned = x.copy()
    poisoned[1, 7], poisoned[2, 0], poisoned[5, 49] = np.nan, np.inf, -np.inf
    y, mean, _ = numba_call(poisoned)
    bad = [1, 2, 5]
    assert np.isnan(y[bad].astype(np.float64)).all() and not np.isfinite(mean[bad]).any()
    good = [0, 3, 4, 6, 7]
    assert y[good].tobytes() == clean[good].tobytes()


# --------------------------------------------------------------------------------------------
# Layouts, out= and in place


def _layouts(x: np.ndarray) -> dict[str, np.ndarray]:
    """Views of (copies of) x's values with the same shape and other strides."""
    rows, cols = x.shape
    wide = np.full((2 * rows, 2 * cols), np.nan, x.dtype)
    wide[::2, ::2] = x
    padded = np.full((rows, cols + 5), np.nan, x.dtype)
    padded[:, :cols] = x
    return {
        "transposed": np.ascontiguousarray(x.T).T,
        "fortran": np.asfortranarray(x),
        "sliced": wide[::2, ::2],
        "padded": padded[:, :cols],
        "reversed": np.ascontiguousarray(x[::-1, ::-1])[::-1, ::-1],
        "rows_broadcast": np.broadcast_to(x[:1], x.shape),
        "cols_broadcast": np.broadcast_to(x[:, :1], x.shape),
    }


@pytest.mark.parametrize(
    "layout",
    ["transposed", "fortran", "sliced", "padded", "reversed", "rows_broadcast", "cols_broadcast"],
)
def test_float32_layouts_without_copy(layout: str) -> None:
    x = _layouts(randn((23, 130), "float32", loc=2.0))[layout]
    weight, bias = randn((130,), "float32", seed=1), randn((130,), "float32", seed=2)
    check(x, weight, bias, 1e-5, numba_call(x, weight, bias))


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
def test_other_dtypes_strided(dtype: str) -> None:
    x = _layouts(randn((11, 70), dtype, loc=2.0))["reversed"][:, ::3]
    weight, bias = randn((x.shape[1],), dtype, seed=1), randn((x.shape[1],), dtype, seed=2)
    check(x, weight, bias, 1e-5, numba_call(x, weight, bias))


@pytest.mark.parametrize("layout", ["c", "fortran", "reversed"])
def test_out(layout: str) -> None:
    x = randn((19, 96), "float32")
    out = {
        "c": np.empty_like(x),
        "fortran": np.empty_like(x, order="F"),
        "reversed": np.empty_like(x)[::-1, ::-1],
    }[layout]
    result = numba_call(x, out=out)
    assert result[0] is out
    check(x, None, None, 1e-5, result)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_in_place(dtype: str) -> None:
    x = randn((21, 333), dtype, loc=4.0)
    weight = randn((333,), dtype, seed=1)
    expected, _, _ = numba_call(x, weight)
    original = x.copy()
    y, mean, rstd = numba_call(x, weight, out=x)
    assert y is x
    assert x.tobytes() == expected.tobytes()
    check(original, weight, None, 1e-5, (x, mean, rstd))


def test_in_place_through_another_view() -> None:
    x = randn((64, 48), "float32")
    original, view = x.copy(), x.T.T
    y, _, _ = numba_call(x, out=view)
    assert y is view
    assert x.tobytes() == numba_call(original)[0].tobytes()


def test_without_stats_and_input_untouched() -> None:
    x = randn((7, 40), "bfloat16")
    before = x.tobytes()
    y, mean, rstd = numba_call(x, stats=False)
    assert mean is None and rstd is None
    assert x.tobytes() == before and y.tobytes() == numba_call(x)[0].tobytes()


# --------------------------------------------------------------------------------------------
# RMSNorm: the same kernels without the centring


@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "no-weight"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype: str, weighted: bool) -> None:
    x = randn((37, 300), dtype, loc=0.5)
    weight = randn((300,), dtype, seed=1) if weighted else None
    check_rms(x, weight, 1e-5, numba_call(x, weight, op="rms_norm"))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_rms_norm_layouts_out_and_in_place_give_the_same_bits(dtype: str) -> None:
    x = randn((23, 130), dtype)
    weight = randn((130,), dtype, seed=1)
    y, _, rstd = numba_call(x, weight, op="rms_norm")
    for layout, view in _layouts(x).items():
        if layout.endswith("broadcast"):
            continue  # other values
        y2, _, rstd2 = numba_call(view, weight, op="rms_norm")
        assert y2.tobytes() == y.tobytes() and rstd2.tobytes() == rstd.tobytes(), layout
    out = np.empty_like(x)[::-1, ::-1]
    assert numba_call(x, weight, out=out, op="rms_norm")[0] is out
    assert np.ascontiguousarray(out).tobytes() == y.tobytes()
    inplace = x.copy()
    assert numba_call(inplace, weight, out=inplace, op="rms_norm")[0] is inplace
    assert inplace.tobytes() == y.tobytes()
    y3, mean3, rstd3 = numba_call(x, weight, op="rms_norm", stats=False)
    assert mean3 is None and rstd3 is None and y3.tobytes() == y.tobytes()


def test_rms_norm_of_zero_rows_is_zero() -> None:
    x = np.zeros((3, 40), np.float16)
    y, _, rstd = numba_call(x, eps=1e-12, op="rms_norm")
    assert not y.astype(np.float64).any() and np.all(rstd == np.float32(1e6))


# --------------------------------------------------------------------------------------------
# The float32 range: sums that overflow, rstd beyond float32


@pytest.mark.parametrize("cols", [4, 1001, "long"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("spread", [1e20, 1e38, 3.4e38])
def test_float32_rows_of_huge_spread(spread: float, op: str, cols: Any) -> None:
    """The squares (and, at 3.4e38, the differences) overflow float32: such a row is redone in
    float64, and normalizes to +-1 as the float64 reference does."""
    n = long_cols() if cols == "long" else cols
    x = np.tile(np.array([spread, -spread], np.float32), (2, n // 2))
    normal = randn((1, x.shape[1]), "float32")
    batch = np.concatenate([x, normal])
    y, _, rstd = numba_call(batch, op=op)
    np.testing.assert_allclose(y[:2], np.tile([1.0, -1.0], (2, n // 2)), rtol=1e-6)
    np.testing.assert_allclose(rstd[:2], np.float32(1 / spread), rtol=1e-6)
    assert y[2:].tobytes() == numba_call(normal, op=op)[0].tobytes()  # the other rows: unchanged


@pytest.mark.parametrize("cols", [4, "long"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_constant_rows_with_a_tiny_positive_eps_give_bias(dtype: str, cols: Any) -> None:
    """eps = 1e-80 > 0: rstd = 1e40 exceeds float32, and (x - mean) * rstd must be 0, not
    0 * inf = NaN. rstd itself is reported as float32's rounding of 1e40: inf."""
    n = long_cols() if cols == "long" else cols
    x = np.full((2, n), 3.0).astype(dtype_of(dtype))
    bias = randn((n,), dtype, seed=2)
    y, mean, rstd = numba_call(x, None, bias, eps=1e-80)
    assert y.tobytes() == np.broadcast_to(bias, y.shape).tobytes()
    assert np.all(mean == 3.0) and np.all(rstd == np.inf)
    y, _, _ = numba_call(np.zeros_like(x), eps=1e-80, op="rms_norm")
    assert not np.isnan(y.astype(np.float64)).any() and not y.astype(np.float64).any()


@pytest.mark.parametrize("cols", [6, "long"])
def test_in_place_with_wide_rows_equals_out_of_place(cols: Any) -> None:
    """Wide rows are redone after the others: in place, only they, from x as it was."""
    n = long_cols() if cols == "long" else cols
    x = randn((4, n), "float32", seed=9)
    x[1] = np.resize(np.array([3e38, -3e38], np.float32), n)
    x[3, 0] = np.nan
    weight = randn((n,), "float32", seed=1)
    weight[2] = np.nan  # one NaN column in every row, and no more
    expected = numba_call(x, weight)
    y = x.copy()
    result = numba_call(y, weight, out=y)
    assert result[0] is y and y.tobytes() == expected[0].tobytes()
    assert np.isnan(y[[0, 2]]).sum() == 2 and np.isnan(y[3]).all()
    assert result[1].tobytes() == expected[1].tobytes()


def test_a_tiny_eps_on_a_varying_row_is_unaffected() -> None:
    x = randn((4, 64), "float32", loc=2.0)
    check(x, None, None, 1e-80, numba_call(x, eps=1e-80))


# --------------------------------------------------------------------------------------------
# Long rows: segment moments merged (Chan), x read twice from memory, threads share a row


def test_long_row_threshold() -> None:
    """Long means more compute-dtype bytes than LONG_ROW_BYTES, whole segments of blocks."""
    assert numba_forward.SEGMENT % numba_forward.BLOCK == 0
    assert numba_forward.LONG_ROW_BYTES // 4 > numba_forward.SEGMENT


def test_long_row_with_a_large_offset_is_exact() -> None:
    """1e4 + N(0, 1) over 2^22 float32 columns: a one-pass E[x²]-E[x]² would lose every digit."""
    x = randn((1, 1 << 22), "float64", seed=5, loc=1e4).astype(np.float32)
    weight, bias = randn((1 << 22,), "float32", seed=1), randn((1 << 22,), "float32", seed=2)
    check(x, weight, bias, 1e-5, numba_call(x, weight, bias))


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_rows_match_reference(dtype: str) -> None:
    cols = long_cols() if dtype != "float64" else numba_forward.LONG_ROW_BYTES // 8 + 1000
    x = randn((3, cols), dtype, seed=6, loc=100.0)
    x[1] = x[1, 0]  # a constant row: exactly bias
    weight, bias = randn((cols,), dtype, seed=1), randn((cols,), dtype, seed=2)
    result = numba_call(x, weight, bias)
    check(x, weight, bias, 1e-5, result)
    assert result[0][1].tobytes() == bias.tobytes()
    check_rms(x, weight, 1e-5, numba_call(x, weight, op="rms_norm"))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_long_rows_strided_out_and_in_place(dtype: str) -> None:
    cols = long_cols()
    x = randn((2, cols), dtype, seed=8, loc=3.0)
    weight = randn((cols,), dtype, seed=1)
    """Every layout reads the same values; y is written by code specialised per layout (so the
    bits may differ where the compiler vectorises one and not another, as with bounds checks)."""
    before = x.tobytes()
    y, mean, rstd = numba_call(x, weight)
    check(x, weight, None, 1e-5, (y, mean, rstd))
    out = np.empty_like(x)[:, ::-1]
    inplace = x.copy()
    results = {
        layout: numba_call(_layouts(x)[layout], weight) for layout in ("reversed", "fortran")
    }
    results["out"] = numba_call(x, weight, out=out)
    results["in place"] = numba_call(inplace, weight, out=inplace)
    assert results["out"][0] is out and results["in place"][0] is inplace
    for layout, result in results.items():
        check(x, weight, None, 1e-5, result)
        same_stats = result[1].tobytes() == mean.tobytes() and result[2].tobytes() == rstd.tobytes()
        assert same_stats, layout
    assert x.tobytes() == before  # only the copy was normalized in place


def test_long_rows_without_weight_or_bias_allocate_no_row_sized_stand_in() -> None:
    """A 1 x 2^22 float32 call without weight or bias allocates y, and nothing else row-sized
    (traced NumPy allocations; a stand-in of ones and zeros would add two rows)."""
    cols = 1 << 22
    x = randn((1, cols), "float32", seed=10)
    numba_call(x, stats=False)  # compiled (or loaded) and the segment stand-ins cached
    capacity, output_pool.POOL.capacity = output_pool.POOL.capacity, 0  # y: a fresh array
    tracemalloc.start()
    try:
        y, _, _ = numba_call(x, stats=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        output_pool.POOL.capacity = capacity
    assert y.nbytes <= peak < y.nbytes + (1 << 20)
