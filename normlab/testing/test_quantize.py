"""Quantized outputs (``quantize=``, ``quantize_scale=``) on the forward and fused ops.

The contract (:mod:`normlab.quantize`): ``(q, scale)`` are bitwise the subject's own float32 y
— the op of float32 x (float64 x: its y rounded to float32; a fused op: the base op of float32
h, h the op's own) — quantized by normlab's reference quantizer: a per-row scale
``max|y| / 127`` (int8) or ``/ 448`` (float8 e4m3fn), or the static one given;
``v = y / scale`` in float32, rounded half to even, saturated at ±127 / ±448. The plain calls
are checked against the float64 reference by the rest of the suite; here q·scale is checked
against that reference too, within one quantization step, so a backend cannot pass by making
its float32 y and its q wrong alike. Rows alone give the bits they give in the batch.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import pytest

import normlab
from normlab import arrays, reference
from normlab.constants import FLOAT_DTYPES
from normlab.ops import names
from normlab.quantize import reference as quantized_reference
from normlab.spec.quantize import LIMITS, MODES, q_dtype
from normlab.testing.bitwise import same_bits
from normlab.testing.conversions import numpy_dtype
from normlab.testing.subject import Subject
from normlab.testing.tolerances import TOLERANCES

OPS: Final = names(direction="forward")
#: Static scales: None (dynamic), one inside the range, one so small most values saturate.
STATICS: Final = (None, 0.03125, 1e-4)
#: Rows and columns of the calls: an odd row count, more than one block of columns. Row 5 is
#: zeros (RMSNorm: y = 0, a scale of 0), row 7 is one value (LayerNorm: y = bias).
ROWS, COLS = 37, 300
#: Rows longer than a GPU kernel holds in registers (16,384 float32 elements), and how many.
LONG_ROWS, LONG_COLS = 9, 20_000


def _require(s: Subject, op: str, dtype: str, mode: str = "int8") -> None:
    """Skip unless ``op`` reaches the subject, it serves ``dtype`` and float32, and its family
    has q's dtype for ``mode``."""
    if mode == "fp8_e4m3" and s.family not in ("numpy", "torch", "cupy", "jax"):
        pytest.skip(f"{s.family} arrays have no float8 dtype (a DtypeError names it)")
    if mode == "fp8_e4m3":
        pytest.importorskip("ml_dtypes")
    if op.startswith("add_"):
        s.require_fused(op)
    else:
        s.require_op(op)
    s.require_dtype(dtype)
    if "float32" not in s.dtypes:
        pytest.skip(f"backend {s.name!r} serves no float32: the contract's y is a float32 one")


def _inputs(dtype: str, seed: int, rows: int = ROWS, cols: int = COLS) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (rows, cols)
    x = rng.standard_normal(shape) * rng.uniform(0.5, 3, (rows, 1)) + rng.normal(0, 2, (rows, 1))
    x[5] = 0.0
    x[7] = 1.5
    residual = rng.standard_normal(shape)
    residual[5] = 0.0
    values = {
        "x": x.astype(numpy_dtype(dtype)),
        "residual": residual.astype(numpy_dtype(dtype)),
        "weight": rng.standard_normal(cols).astype(np.float32),
        "bias": rng.standard_normal(cols).astype(np.float32),
    }
    return values


def _call(s: Subject, op: str, given: dict[str, np.ndarray], **kwargs: Any) -> Any:
    """``op`` on the subject's arrays of ``given`` (x, residual for fused ops, weight, bias)."""
    args = [s.from_numpy(given["x"])]
    if op.startswith("add_"):
        args.append(s.from_numpy(given["residual"]))
    kwargs["weight"] = s.from_numpy(given["weight"])
    if "layer" in op:
        kwargs["bias"] = s.from_numpy(given["bias"])
    return getattr(normlab, op)(*args, backend=s.backend, **kwargs)


def _bits(s: Subject, a: Any) -> np.ndarray:
    """The subject's array ``a`` on the host; float8 as its uint8 bits."""
    if arrays.info(a).dtype == "float8_e4m3fn":
        a = a.view(np.uint8) if isinstance(a, np.ndarray) else a.view(_uint8_of(a))
    return s.to_numpy(a)


def _uint8_of(a: Any) -> Any:
    """The uint8 dtype of ``a``'s library (a float8 array viewed as its bits)."""
    import array_api_compat

    return array_api_compat.array_namespace(a).uint8


def _float32_y(s: Subject, op: str, given: dict[str, np.ndarray], h: np.ndarray | None) -> Any:
    """The subject's float32 y the contract quantizes (host array)."""
    base = op.removeprefix("add_")
    source = given["x"] if h is None else h
    wide = source if source.dtype == np.float64 else source.astype(np.float32)
    y = s.to_numpy(_call(s, base, {**given, "x": wide}))
    return y.astype(np.float32)


def _repro(
    s: Subject, op: str, dtype: str, mode: str, static: float | None, shape: Any = (ROWS, COLS)
) -> str:
    return (
        f"reproduce: normlab.{op} on {shape[0]}x{shape[1]} {dtype} rows, quantize={mode!r}, "
        f"quantize_scale={static!r}, backend={s.backend!r}"
    )


@pytest.mark.parametrize("static", STATICS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_quantized_outputs(
    normlab_subject: Subject, op: str, dtype: str, mode: str, static: float | None
) -> None:
    """q and scale are the subject's float32 y quantized by the reference quantizer (bits); q
    of the mode's dtype and x's shape, scale float32 of the statistics' shape; a fused op's h is
    its plain call's; rows 3..8 alone give the bits they give in the batch."""
    s = normlab_subject
    _require(s, op, dtype, mode)
    given = _inputs(dtype, seed=21)
    repro = _repro(s, op, dtype, mode, static)
    result = _call(s, op, given, quantize=mode, quantize_scale=static)
    fused = op.startswith("add_")
    assert len(result) == (3 if fused else 2), f"{len(result)} results, not (q, scale[, h])"
    q, scale = result[0], result[1]
    q_info, scale_info = arrays.info(q), arrays.info(scale)
    assert q_info.dtype == q_dtype(mode, q_info.family), f"q is {q_info.dtype}\n{repro}"
    assert q_info.shape == (ROWS, COLS), f"q has shape {q_info.shape}\n{repro}"
    assert scale_info.dtype == "float32", f"scale is {scale_info.dtype}\n{repro}"
    assert scale_info.shape == (ROWS, 1), f"scale has shape {scale_info.shape}\n{repro}"
    _same_bits_as_the_float32_y_quantized(s, op, given, mode, static, result, repro)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("op", OPS)
def test_quantized_long_rows(normlab_subject: Subject, op: str, dtype: str, mode: str) -> None:
    """Rows of 20,000 elements (beyond a GPU kernel's registers: its kernel that reads the row
    again for max|y|) are the subject's float32 y quantized, bit for bit, and alone as in the
    batch."""
    s = normlab_subject
    _require(s, op, dtype, mode)
    given = _inputs(dtype, seed=23, rows=LONG_ROWS, cols=LONG_COLS)
    repro = _repro(s, op, dtype, mode, None, (LONG_ROWS, LONG_COLS))
    result = _call(s, op, given, quantize=mode)
    _same_bits_as_the_float32_y_quantized(s, op, given, mode, None, result, repro)


#: Extremes of the quantizer, by name: the static scale (None: dynamic) and the weight's
#: magnitude. A subnormal scale saturates every q; a weight near float32's largest makes y
#: overflow to ±inf (a dynamic scale of inf; v = inf / inf is NaN); rows 3 and 4 hold an inf
#: and a NaN.
EXTREMES: Final = {
    "subnormal-static-scale": (1e-40, 1.0),
    "overflowing-y-dynamic": (None, 3e38),
    "overflowing-y-static": (0.5, 3e38),
}


@pytest.mark.parametrize("extreme", EXTREMES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_quantized_extremes(
    normlab_subject: Subject, op: str, dtype: str, mode: str, extreme: str
) -> None:
    """At the quantizer's extremes q and scale are still the subject's float32 y quantized,
    bit for bit (saturated, NaN and inf as the formulas give them). (The project's tests run
    the numpy backend's and the default NumPy call's suite with NumPy's warnings as errors:
    overflow to inf and inf / inf are the formulas' own results, not warnings.)"""
    s = normlab_subject
    _require(s, op, dtype, mode)
    static, magnitude = EXTREMES[extreme]
    if static is not None and static < 2.0**-126 and s.flushes_subnormals:
        pytest.skip(f"backend {s.name!r} declares flushes_subnormals=True: a subnormal scale is 0")
    given = _inputs(dtype, seed=24)
    given["x"][3, 10] = np.inf
    given["x"][4, 20] = np.nan
    given["weight"] = (given["weight"] / np.abs(given["weight"]).max() * magnitude).astype(
        np.float32
    )
    repro = _repro(s, op, dtype, mode, static) + f", weights up to {magnitude!r}, inf, NaN"
    result = _call(s, op, given, quantize=mode, quantize_scale=static)
    with np.errstate(all="ignore"):  # the expected y overflows as the subject's
        _same_bits_as_the_float32_y_quantized(s, op, given, mode, static, result, repro)


def _same_bits_as_the_float32_y_quantized(
    s: Subject,
    op: str,
    given: dict[str, np.ndarray],
    mode: str,
    static: float | None,
    result: Any,
    repro: str,
) -> None:
    """q and scale of ``result`` are the subject's float32 y of ``given`` quantized by the
    reference quantizer (a fused op's h, ``result[2]``, is its plain call's), and rows 3..8
    alone give the same bits."""
    q, scale = result[0], result[1]
    h = None
    if op.startswith("add_"):
        h = s.to_numpy(result[2])
        plain_h = s.to_numpy(_call(s, op, given)[1])
        assert same_bits(h, plain_h), f"h differs from the plain call's h\n{repro}"
    y = _float32_y(s, op, given, h)
    want_q, want_scale = quantized_reference(y, mode, static, (1,))
    got_q, got_scale = _bits(s, q), s.to_numpy(scale)
    if want_q.dtype != got_q.dtype:
        want_q = want_q.view(got_q.dtype)
    assert same_bits(got_scale, want_scale), (
        f"scale differs from {'max|y| / ' + str(LIMITS[mode]) if static is None else 'the static'}"
        f" of the float32 y in rows {np.flatnonzero(got_scale != want_scale)[:8]}\n{repro}"
    )
    wrong = np.flatnonzero((got_q != want_q).any(axis=1))
    assert same_bits(got_q, want_q), (
        f"q differs from the float32 y quantized (rounded half to even, saturated) in rows "
        f"{wrong[:8]}\n{repro}"
    )
    part = {name: a[3:9] if a.ndim == 2 else a for name, a in given.items()}
    alone = _call(s, op, part, quantize=mode, quantize_scale=static)
    assert same_bits(_bits(s, alone[0]), got_q[3:9]), f"rows 3..8 alone give other q\n{repro}"
    assert same_bits(s.to_numpy(alone[1]), got_scale[3:9]), f"rows 3..8 alone: scale\n{repro}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_quantized_against_the_reference(
    normlab_subject: Subject, op: str, dtype: str, mode: str
) -> None:
    """With a dynamic scale, scale is within y's float32 arithmetic of ``max|y| / limit`` of
    the float64 reference's y, and q · scale within one quantization step of that y (int8:
    half the scale; e4m3fn: 2**-4 relatively, 2**-10 · scale near zero) and that arithmetic."""
    s = normlab_subject
    _require(s, op, dtype, mode)
    given = _inputs(dtype, seed=22)
    x = given["x"].astype(np.float64)
    weight = given["weight"].astype(np.float64)
    if op == "layer_norm":
        y_ref = reference.layer_norm(x, None, weight, given["bias"].astype(np.float64), 1e-5)[0]
    else:
        y_ref = reference.rms_norm(x, None, weight, float(np.finfo(np.float32).eps))[0]
    q, scale = _call(s, op, given, quantize=mode)
    got_q = _bits(s, q)
    if mode == "fp8_e4m3":
        import ml_dtypes

        got_q = got_q.view(ml_dtypes.float8_e4m3fn)
    values = got_q.astype(np.float64)
    got_scale = s.to_numpy(scale).astype(np.float64)
    compute = "float64" if dtype == "float64" else "float32"
    magnitude = np.abs(y_ref).max(axis=1, keepdims=True) * (np.abs(weight).max() + 1)
    arithmetic = TOLERANCES[compute].compute * (1 + np.sqrt(COLS)) * magnitude
    limit = LIMITS[mode]
    want_scale = np.abs(y_ref).max(axis=1, keepdims=True) / limit
    repro = _repro(s, op, dtype, mode, None)
    # scale and (float64 x) y are float32: a rounding of each beside the arithmetic
    arithmetic += 2.0**-24 * magnitude
    assert (np.abs(got_scale - want_scale) <= arithmetic / limit + 1e-45).all(), (
        f"scale off max|y| / {limit} of the reference's y by "
        f"{float(np.abs(got_scale - want_scale).max())!r}\n{repro}"
    )
    if mode == "int8":
        step = 0.5 * got_scale
    else:
        step = 2.0**-4 * np.abs(y_ref) + 2.0**-10 * got_scale
    error = np.abs(values * got_scale - y_ref)
    bad = error > step * 1.0001 + arithmetic * 2
    assert not bad.any(), (
        f"{int(bad.sum())} elements of q · scale off the reference's y by more than a "
        f"quantization step; worst {float(error.max())!r}\n{repro}"
    )


#: The static scale of the ties test, and the half-integer multiples of it the weights hold.
_TIE_SCALE: Final = 2.0**-6


def _ties(mode: str) -> np.ndarray:
    """Values v for which ``v · _TIE_SCALE`` divided by the scale is a tie of the mode's
    rounding: half-integers (int8), midpoints between neighbouring e4m3fn numbers (fp8);
    negative ones too, and values past the saturation bound."""
    if mode == "int8":
        v = np.arange(-127, 127) + 0.5
    else:
        v = np.array([(1 + (2 * k + 1) / 16) * 2.0**e for e in range(-6, 8) for k in (0, 3)])
        v = np.concatenate([v, [2.0**-10, 3 * 2.0**-10, 456.0, 500.0]])
        v = np.concatenate([v, -v])
    return np.resize(v, 256)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_quantized_ties_round_half_to_even(
    normlab_subject: Subject, op: str, dtype: str, mode: str
) -> None:
    """Rows of ±2 (eps 0: x̂ = ±1 exactly) times weights that make ``y / scale`` a tie: q is
    rounded half to even (never half away from zero) and saturated."""
    s = normlab_subject
    _require(s, op, dtype, mode)
    ties = _ties(mode)
    cols = ties.shape[0]
    sign = np.where(np.arange(cols) % 2 == 0, 1.0, -1.0)
    x = np.stack([2.0 * sign, -2.0 * sign]).astype(numpy_dtype(dtype))
    weight = (ties * sign * _TIE_SCALE).astype(np.float32)
    args = [s.from_numpy(x)]
    kwargs: dict[str, Any] = {"weight": s.from_numpy(weight), "eps": 0.0}
    q = getattr(normlab, op)(
        *args, quantize=mode, quantize_scale=_TIE_SCALE, backend=s.backend, **kwargs
    )[0]
    y = (np.stack([ties, -ties]) * _TIE_SCALE).astype(np.float32)  # exact: x̂ = ±1 times w
    want, _ = quantized_reference(y, mode, _TIE_SCALE, (1,))
    got = _bits(s, q)
    repro = _repro(s, op, dtype, mode, _TIE_SCALE)
    want = want.view(got.dtype)
    wrong = np.flatnonzero((got != want)[0])
    assert same_bits(got, want), (
        f"q of ties y / scale = {ties[wrong[:4]]} is {got[0, wrong[:4]]}, not rounded half to "
        f"even ({want[0, wrong[:4]]})\n{repro}"
    )


@pytest.mark.parametrize("op", OPS)
def test_quantized_into_out(normlab_subject: Subject, op: str) -> None:
    """``out=(q, scale)`` receives the results and is returned; a bare ``out=q`` too."""
    s = normlab_subject
    _require(s, op, "float32")
    s.require_writable()
    given = _inputs("float32", seed=23)
    want = _call(s, op, given, quantize="int8")
    q_out = s.from_numpy(np.zeros((ROWS, COLS), np.int8))
    scale_out = s.from_numpy(np.zeros((ROWS, 1), np.float32))
    got = _call(s, op, given, quantize="int8", out=(q_out, scale_out))
    assert got[0] is q_out and got[1] is scale_out, "out's arrays are not the ones returned"
    assert same_bits(s.to_numpy(q_out), s.to_numpy(want[0])), "q written into out differs"
    assert same_bits(s.to_numpy(scale_out), s.to_numpy(want[1])), "scale in out differs"
    bare = s.from_numpy(np.zeros((ROWS, COLS), np.int8))
    got = _call(s, op, given, quantize="int8", out=bare)
    assert got[0] is bare and same_bits(s.to_numpy(bare), s.to_numpy(want[0])), "out=q"
