"""Numerics: random calls against the float64 reference, and the named numerical cases, for
layer_norm and (where the record lists it) rms_norm."""

from __future__ import annotations

from typing import Final

import numpy as np
import pytest
from hypothesis import given, settings

import normlab.testing.strategies as strategies
from normlab.constants import FLOAT_DTYPES, HALF_DTYPES, MACHINE_EPS, stats_dtype_for
from normlab.testing.cases import AWKWARD_COLS, OPS, Case
from normlab.testing.subject import Subject
from normlab.testing.tolerances import assert_close


def _affine_params(op: str) -> list[tuple[str, str | None, str | None]]:
    """(x dtype, weight dtype, bias dtype): each parameter absent, in x's dtype, or float32
    (for float16/bfloat16 x); rms_norm has no bias."""
    combos: list[tuple[str, str | None, str | None]] = []
    for dtype in FLOAT_DTYPES:
        choices = [None, dtype, "float32"] if dtype in HALF_DTYPES else [None, dtype]
        biases = choices if op == "layer_norm" else [None]
        combos.extend((dtype, w, b) for w in choices for b in biases)
    return combos


_SHORT = {None: "none", "float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}

#: (x dtype, weight dtype, bias dtype), with ids like ``float16-weight_f32-bias_none``.
AFFINE = [
    pytest.param(x, w, b, id=f"{x}-weight_{_SHORT[w]}-bias_{_SHORT[b]}")
    for x, w, b in _affine_params("layer_norm")
]

#: (x dtype, weight dtype) of rms_norm, with ids like ``float16-weight_f32``.
RMS_WEIGHTS = [
    pytest.param(x, w, id=f"{x}-weight_{_SHORT[w]}") for x, w, _ in _affine_params("rms_norm")
]

#: (op, x dtype, weight dtype, bias dtype) of both ops.
OP_AFFINE = [
    pytest.param(op, x, w, b, id=f"{op}-{x}-weight_{_SHORT[w]}-bias_{_SHORT[b]}")
    for op in OPS
    for x, w, b in _affine_params(op)
]


@pytest.mark.parametrize("op", OPS)
def test_matches_reference(normlab_subject: Subject, normlab_settings: settings, op: str) -> None:
    """Random shapes, axes, dtypes, affine parameters, eps, values and layouts."""
    normlab_subject.require_op(op)
    name = normlab_subject.name
    drawn = strategies.cases(normlab_subject.dtypes, normlab_subject.usable_layouts, op)

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
    snippet = case.snippet(name)
    assert np.allclose(y.astype(np.float64), expected, atol=atol), (
        f"y of [1, 3, 5, 7] is {y[0].tolist()}, not [-1.342, -0.447, 0.447, 1.342]\n{snippet}"
    )
    assert np.all(mean == 4.0), f"mean of [1, 3, 5, 7] is {mean.ravel().tolist()}, not 4\n{snippet}"
    assert np.allclose(rstd, 1 / np.sqrt(5.0 + eps), rtol=1e-6), (
        f"rstd of [1, 3, 5, 7] is {rstd.ravel().tolist()}, not 1/sqrt(5 + eps) = "
        f"{1 / np.sqrt(5.0 + eps):.7f}\n{snippet}"
    )
    case.check(name)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("eps", [None, 0.0])
def test_rms_norm_worked_example(normlab_subject: Subject, dtype: str, eps: float | None) -> None:
    """[1, 3, 5, 7] has mean square 21: rms_norm gives x / sqrt(21 + eps) =
    [0.218, 0.655, 1.091, 1.528] (eps None: finfo(compute dtype).eps)."""
    normlab_subject.require_op("rms_norm")
    normlab_subject.require_dtype(dtype)
    name = normlab_subject.name
    case = Case((2, 4), dtype, "worked", eps=eps, op="rms_norm")
    y, _, rstd = case.run(name)
    assert rstd is not None
    root = np.sqrt(21.0 + (MACHINE_EPS[stats_dtype_for(dtype)] if eps is None else eps))
    expected = np.array([[1.0, 3.0, 5.0, 7.0]] * 2) / root
    atol = {"bfloat16": 1e-2, "float16": 2e-3}.get(dtype, 1e-6)
    assert np.allclose(y.astype(np.float64), expected, atol=atol), f"{y}\n{case.snippet(name)}"
    assert np.allclose(rstd, 1 / root, rtol=1e-6), f"rstd {rstd}\n{case.snippet(name)}"
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


@pytest.mark.parametrize("cols", [1, 1000])
@pytest.mark.parametrize(("dtype", "weight"), RMS_WEIGHTS)
def test_rms_norm_constant_rows_give_weight_times_sign(
    normlab_subject: Subject, dtype: str, weight: str | None, cols: int
) -> None:
    """A constant row c with eps = 0 gives ``weight * sign(c)``: c / sqrt(c²) = ±1, whatever
    the value (within the tolerance: the mean of n equal squares is not exact)."""
    normlab_subject.require_op("rms_norm")
    normlab_subject.require_dtype(dtype)
    case = Case((6, cols), dtype, "constant", seed=2, weight=weight, eps=0.0, op="rms_norm")
    y, _, rstd = case.run(normlab_subject.name)
    x, w, _ = case.numpy_inputs()
    want = np.sign(x.astype(np.float64)) * (1.0 if w is None else w.astype(np.float64))
    assert_close(
        y,
        want,
        dtype,
        1.0,
        what="y",
        cols=cols,
        scale=np.abs(want),
        repro=case.snippet(normlab_subject.name),
    )
    case.compare(y, None, rstd, backend=normlab_subject.name)


@pytest.mark.parametrize(
    ("op", "dtype", "weight", "bias"),
    [
        p
        for p in OP_AFFINE
        if p.values[1] in HALF_DTYPES and (p.values[0] == "rms_norm" or p.values[2] == p.values[3])
    ],
)
def test_half_zeros_tiny_eps(
    normlab_subject: Subject, op: str, dtype: str, weight: str | None, bias: str | None
) -> None:
    """Zeros with eps=1e-12: rstd is 1e6 and y is exactly bias (0 without), never NaN — eps
    must be added in float32, where it does not underflow."""
    normlab_subject.require_op(op)
    normlab_subject.require_dtype(dtype)
    case = Case((4, 64), dtype, "zeros", weight=weight, bias=bias, eps=1e-12, op=op)
    y, _, rstd = case.run(normlab_subject.name)
    repro = case.snippet(normlab_subject.name)
    b = case.numpy_inputs()[2]
    want = np.zeros(y.shape) if b is None else np.broadcast_to(b.astype(y.dtype), y.shape)
    assert np.array_equal(y.astype(np.float64), want.astype(np.float64)), f"{y}\n{repro}"
    assert rstd is not None and np.allclose(rstd, 1e6, rtol=1e-6), f"rstd {rstd}\n{repro}"


@pytest.mark.parametrize("cols", [3, 1000, 4097])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_near_float16_max(normlab_subject: Subject, op: str, dtype: str, cols: int) -> None:
    """Values of magnitude 55000..65000: in float16 the sum of squares overflows unless it is
    accumulated in float32."""
    normlab_subject.require_op(op)
    normlab_subject.require_dtype(dtype)
    Case((8, cols), dtype, "near_max", seed=3, op=op).check(normlab_subject.name)


@pytest.mark.parametrize("cols", AWKWARD_COLS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_awkward_row_lengths(normlab_subject: Subject, op: str, dtype: str, cols: int) -> None:
    """Rows of 1, 3, 17, 127, 1000 and 4097 elements (tails of vector loops and blocks)."""
    normlab_subject.require_op(op)
    normlab_subject.require_dtype(dtype)
    param = "float32" if dtype in HALF_DTYPES else dtype
    bias = dtype if op == "layer_norm" else None
    Case((5, cols), dtype, "rowwise", seed=4, weight=param, bias=bias, op=op).check(
        normlab_subject.name
    )


@pytest.mark.parametrize("eps", [1e-6, 1e-4, 1e-2])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_eps_inside_the_root(normlab_subject: Subject, op: str, dtype: str, eps: float) -> None:
    """Rows with variance (and mean square) 1e-6: eps is not negligible, and
    ``sqrt(var + eps)`` differs from ``sqrt(var) + eps``."""
    normlab_subject.require_op(op)
    normlab_subject.require_dtype(dtype)
    Case((8, 64), dtype, "tiny", seed=5, eps=eps, op=op).check(normlab_subject.name)


@pytest.mark.parametrize(("op", "dtype", "weight", "bias"), OP_AFFINE)
def test_affine_combinations(
    normlab_subject: Subject, op: str, dtype: str, weight: str | None, bias: str | None
) -> None:
    """weight and bias are independent: either, both or neither, in x's dtype or float32
    (rms_norm: weight or none)."""
    normlab_subject.require_op(op)
    normlab_subject.require_dtype(dtype)
    Case((4, 33), dtype, "rowwise", seed=6, weight=weight, bias=bias, op=op).check(
        normlab_subject.name
    )


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rms_norm_default_eps(normlab_subject: Subject, dtype: str) -> None:
    """rms_norm's eps defaults to the machine epsilon of the compute dtype (float32's for half
    x), as torch's rms_norm: omitted, None and that number give the same bits."""
    normlab_subject.require_op("rms_norm")
    normlab_subject.require_dtype(dtype)
    case = Case((3, 40), dtype, "tiny", seed=15, weight=dtype, eps=None, op="rms_norm")
    x, kwargs = case.inputs(normlab_subject.name)
    del kwargs["eps"]
    results = {
        label: normlab_subject.to_numpy(
            case.call(x, **kwargs, **given, backend=normlab_subject.backend)
        ).tobytes()
        for label, given in (
            ("omitted", {}),
            ("None", {"eps": None}),
            ("finfo eps", {"eps": MACHINE_EPS[stats_dtype_for(dtype)]}),
        )
    }
    differ = [label for label, bits in results.items() if bits != results["omitted"]]
    assert not differ, f"eps {differ} differ from eps omitted\n{case.snippet(normlab_subject.name)}"
    case.check(normlab_subject.name)


@pytest.mark.parametrize("magnitude", ["subnormal", "dtype_max"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_magnitudes(normlab_subject: Subject, op: str, dtype: str, magnitude: str) -> None:
    """The whole finite range binds every backend (docs/contract.md): rows of subnormal values
    (eps = 0, so each row is standardized by its own tiny variance: squares must not flush to
    zero) and rows of both signs at a quarter to a half of the dtype's max (sums and squares
    must not overflow); statistics compared. A backend whose record declares
    ``flushes_subnormals`` skips the subnormal rows, saying so."""
    normlab_subject.require_op(op)
    normlab_subject.require_dtype(dtype)
    normlab_subject.require_values(magnitude)
    param = "float32" if dtype in HALF_DTYPES else dtype
    bias = param if op == "layer_norm" else None
    case = Case((8, 64), dtype, magnitude, seed=21, weight=param, bias=bias, eps=0.0, op=op)
    y, _, rstd = case.expected()
    assert np.isfinite(y).all() and np.all((rstd > 0) & np.isfinite(rstd)), "the reference fails"
    case.check(normlab_subject.name)


#: Transformer Engine's float32 accuracy case (2048 tokens x 768 hidden) and tolerance: an
#: element may differ from the float64 reference by ``ATOL + RTOL * |reference|`` (torch's
#: float32 rtol and an atol of about one float32 ulp of 1): a small output must be as accurate
#: as its own magnitude allows, not as the row's spread allows.
ACCURACY_SHAPE: Final = (2048, 768)
ACCURACY_ATOL: Final = 1e-7
ACCURACY_RTOL: Final = 1.3e-6


@pytest.mark.parametrize("eps", [1e-3, 1e-7])
@pytest.mark.parametrize("op", OPS)
def test_float32_small_outputs_as_accurate_as_torch(
    normlab_subject: Subject, op: str, eps: float
) -> None:
    """float32 rows of standard normal values, without weight and bias: every element of y
    within 1e-7 + 1.3e-6 * |reference| (``torch.nn.functional.layer_norm`` stays within 0.25
    of it). A kernel forming y from ``x - x0`` and then the mean's remainder (two roundings at
    the scale of the row's first element), or from a mean that rounds at that scale, errs by
    2-4 times as much on the small outputs of rows whose first element lies far from the mean."""
    normlab_subject.require_op(op)
    normlab_subject.require_dtype("float32")
    case = Case(ACCURACY_SHAPE, "float32", "normal", seed=1234, eps=eps, op=op)
    y, _, _ = case.replace(return_stats=False).run(normlab_subject.name)
    want = case.expected()[0]
    error = np.abs(y.astype(np.float64) - want)
    allowed = ACCURACY_ATOL + ACCURACY_RTOL * np.abs(want)
    worst = np.unravel_index(np.argmax(error / allowed), want.shape)
    assert (error <= allowed).all(), (
        f"y: {int((error > allowed).sum())} elements beyond 1e-7 + 1.3e-6 * |reference|; worst "
        f"at {tuple(int(i) for i in worst)}: got {float(y[worst])!r}, expected "
        f"{float(want[worst])!r}, {float(error[worst] / allowed[worst]):.2f} times the "
        f"tolerance\n{case.snippet(normlab_subject.name)}"
    )
