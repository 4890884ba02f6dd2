"""Numerics: random calls against the float64 reference, and the named numerical cases."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from normlab.spec import FLOAT_DTYPES, HALF_DTYPES
from normlab.testing import strategies
from normlab.testing.cases import AWKWARD_COLS, Case
from normlab.testing.subject import Subject


def _affine_params() -> list[tuple[str, str | None, str | None]]:
    """(x dtype, weight dtype, bias dtype): each parameter absent, in x's dtype, or float32
    (for float16/bfloat16 x)."""
    combos: list[tuple[str, str | None, str | None]] = []
    for dtype in FLOAT_DTYPES:
        choices = [None, dtype, "float32"] if dtype in HALF_DTYPES else [None, dtype]
        combos.extend((dtype, w, b) for w in choices for b in choices)
    return combos


_SHORT = {None: "none", "float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}

#: (x dtype, weight dtype, bias dtype), with ids like ``float16-weight_f32-bias_none``.
AFFINE = [
    pytest.param(x, w, b, id=f"{x}-weight_{_SHORT[w]}-bias_{_SHORT[b]}")
    for x, w, b in _affine_params()
]


def test_matches_reference(normlab_subject: Subject, normlab_settings: settings) -> None:
    """Random shapes, axes, dtypes, affine parameters, eps, values and layouts."""
    name = normlab_subject.name
    drawn = strategies.cases(normlab_subject.dtypes, normlab_subject.usable_layouts)

    @normlab_settings
    @given(case=drawn)
    def matches(case: Case) -> None:
        case.check(name)

    matches()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("eps", [1e-5, 0.0])
def test_worked_example(normlab_subject: Subject, dtype: str, eps: float) -> None:
    """The seed's example: [1, 3, 5, 7] has mean 4, variance 5 and normalizes to
    [-1.342, -0.447, 0.447, 1.342]."""
    normlab_subject.require_dtype(dtype)
    name = normlab_subject.name
    case = Case((2, 4), dtype, "worked", eps=eps)
    y, mean, rstd = case.run(name)
    assert mean is not None and rstd is not None
    atol = {"bfloat16": 1e-2, "float16": 2e-3}.get(dtype, 1e-3)
    expected = np.array([[-1.342, -0.447, 0.447, 1.342]] * 2)
    assert np.allclose(y.astype(np.float64), expected, atol=atol), f"{y}\n{case.snippet(name)}"
    assert np.all(mean == 4.0), mean
    assert np.allclose(rstd, 1 / np.sqrt(5.0 + eps), rtol=1e-6), rstd
    case.check(name)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_large_offsets(normlab_subject: Subject, dtype: str) -> None:
    """``100 + 0.01·randn``: E[x²]−E[x]² in float32 loses every digit; a shifted two-pass
    kernel errs near 1e-3 (the tolerance allows 5e-3 at this conditioning)."""
    normlab_subject.require_dtype(dtype)
    param = "float32" if dtype in HALF_DTYPES else dtype
    for weight, bias in ((None, None), (param, param)):
        Case((16, 1000), dtype, "offset", seed=1, weight=weight, bias=bias).check(
            normlab_subject.name
        )


@pytest.mark.parametrize("cols", [1, 17, 1000])
@pytest.mark.parametrize(("dtype", "weight", "bias"), AFFINE)
def test_constant_rows_give_bias(
    normlab_subject: Subject, dtype: str, weight: str | None, bias: str | None, cols: int
) -> None:
    """A constant row with eps > 0 gives exactly ``bias`` (0 without bias), whatever the
    value: the shifted two-pass mean makes ``x - mean`` exactly 0."""
    normlab_subject.require_dtype(dtype)
    case = Case((6, cols), dtype, "constant", seed=2, weight=weight, bias=bias)
    y = case.run(normlab_subject.name)[0]
    b = case.numpy_inputs()[2]
    want = np.zeros(y.shape) if b is None else np.broadcast_to(b.astype(y.dtype), y.shape)
    bad = y.astype(np.float64) != want.astype(np.float64)
    assert not bad.any(), (
        f"{int(bad.sum())} elements differ from {'bias' if b is not None else '0'}; first at "
        f"{tuple(np.argwhere(bad)[0])}: {y[bad][0]!r}\n{case.snippet(normlab_subject.name)}"
    )


@pytest.mark.parametrize(
    ("dtype", "weight", "bias"),
    [p for p in AFFINE if p.values[0] in HALF_DTYPES and p.values[1] == p.values[2]],
)
def test_half_zeros_tiny_eps(
    normlab_subject: Subject, dtype: str, weight: str | None, bias: str | None
) -> None:
    """Zeros with eps=1e-12: rstd is 1e6 and y is exactly bias (0 without), never NaN — eps
    must be added in float32, where it does not underflow."""
    normlab_subject.require_dtype(dtype)
    case = Case((4, 64), dtype, "zeros", weight=weight, bias=bias, eps=1e-12)
    y, _, rstd = case.run(normlab_subject.name)
    repro = case.snippet(normlab_subject.name)
    b = case.numpy_inputs()[2]
    want = np.zeros(y.shape) if b is None else np.broadcast_to(b.astype(y.dtype), y.shape)
    assert np.array_equal(y.astype(np.float64), want.astype(np.float64)), f"{y}\n{repro}"
    assert rstd is not None and np.allclose(rstd, 1e6, rtol=1e-6), f"rstd {rstd}\n{repro}"


@pytest.mark.parametrize("cols", [3, 1000, 4097])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_near_float16_max(normlab_subject: Subject, dtype: str, cols: int) -> None:
    """Values of magnitude 55000..65000: in float16 the sum of squares overflows unless it is
    accumulated in float32."""
    normlab_subject.require_dtype(dtype)
    Case((8, cols), dtype, "near_max", seed=3).check(normlab_subject.name)


@pytest.mark.parametrize("cols", AWKWARD_COLS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_awkward_row_lengths(normlab_subject: Subject, dtype: str, cols: int) -> None:
    """Rows of 1, 3, 17, 127, 1000 and 4097 elements (tails of vector loops and blocks)."""
    normlab_subject.require_dtype(dtype)
    param = "float32" if dtype in HALF_DTYPES else dtype
    Case((5, cols), dtype, "rowwise", seed=4, weight=param, bias=dtype).check(normlab_subject.name)


@pytest.mark.parametrize("eps", [1e-6, 1e-4, 1e-2])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_eps_inside_the_root(normlab_subject: Subject, dtype: str, eps: float) -> None:
    """Rows with variance 1e-6: eps is not negligible, and ``sqrt(var + eps)`` differs from
    ``sqrt(var) + eps``."""
    normlab_subject.require_dtype(dtype)
    Case((8, 64), dtype, "tiny", seed=5, eps=eps).check(normlab_subject.name)


@pytest.mark.parametrize(("dtype", "weight", "bias"), AFFINE)
def test_affine_combinations(
    normlab_subject: Subject, dtype: str, weight: str | None, bias: str | None
) -> None:
    """weight and bias are independent: either, both or neither, in x's dtype or float32."""
    normlab_subject.require_dtype(dtype)
    Case((4, 33), dtype, "rowwise", seed=6, weight=weight, bias=bias).check(normlab_subject.name)
