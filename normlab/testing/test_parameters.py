"""Parameters as real models give them, on every op: an offset weight (``weight_offset``: the
weight used as ``weight_offset + weight``, Gemma's RMSNorm, Transformer Engine's
``zero_centered_gamma``) and a weight or bias of any float dtype beside any x.

Each call must give the bits of the plain call whose parameters were formed beforehand in the
compute dtype (float32; float64 for float64 x): ``float32(weight) + weight_offset``, a bfloat16
weight converted to float32... That is what the core does for a backend without the
``"weight_offset"`` capability, and what one with it must match; the plain calls themselves are
checked against the float64 reference by the rest of the suite. The parameter gradients of the
backward ops come in each parameter's own dtype: the formed call's, rounded once to it.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import pytest

import normlab
from normlab import reference
from normlab.constants import FLOAT_DTYPES
from normlab.ops import OPS as TABLE
from normlab.testing.bitwise import same_bits
from normlab.testing.conversions import numpy_dtype
from normlab.testing.subject import Subject
from normlab.testing.tolerances import TOLERANCES

#: The ops with a weight, forward and backward.
OPS: Final = tuple(TABLE)
#: Offsets models use (Gemma, TE: 1), and one that is not a power of two.
OFFSETS: Final = (1.0, -0.375)
#: (weight dtype, bias dtype) pairs: each float dtype as the weight's, beside another as the
#: bias's (mixed pairs included; a bias of x's own dtype is covered by the offset test).
PARAMETER_DTYPES: Final = tuple(
    (weight, FLOAT_DTYPES[(i + 1) % len(FLOAT_DTYPES)]) for i, weight in enumerate(FLOAT_DTYPES)
)
#: Rows and columns of every call: more than one block of columns, an odd row count.
ROWS, COLS = 37, 300


def _require(s: Subject, op: str, *dtypes: str) -> None:
    """Skip unless ``op`` reaches the subject and it serves every one of ``dtypes``."""
    if op in ("add_layer_norm", "add_rms_norm"):
        s.require_fused(op)
    else:
        s.require_op(op)
    for dtype in dict.fromkeys(dtypes):
        s.require_dtype(dtype)


def _compute(dtype: str) -> np.dtype[Any]:
    return numpy_dtype("float64" if dtype == "float64" else "float32")


def _inputs(dtype: str, seed: int) -> dict[str, np.ndarray]:
    """x (rows of varied offsets and scales), residual and dy, in ``dtype``."""
    rng = np.random.default_rng(seed)
    shape = (ROWS, COLS)
    x = rng.standard_normal(shape) * rng.uniform(0.5, 3, (ROWS, 1)) + rng.normal(0, 2, (ROWS, 1))
    values = {"x": x, "residual": rng.standard_normal(shape), "dy": rng.standard_normal(shape)}
    return {name: a.astype(numpy_dtype(dtype)) for name, a in values.items()}


def _parameters(seed: int) -> dict[str, np.ndarray]:
    """A weight near 0 (so that ``offset + weight`` needs more bits than the weight) and a bias,
    in float64."""
    rng = np.random.default_rng(seed)
    return {"weight": 0.1 * rng.standard_normal(COLS), "bias": rng.standard_normal(COLS)}


def _outputs(
    s: Subject, op: str, given: dict[str, np.ndarray], weight: Any, bias: Any, offset: float
) -> list[np.ndarray | None]:
    """Every output of ``op`` on the subject (host arrays; None where the op gives none), for
    the inputs ``given`` and the parameters (the subject's arrays) as passed."""
    table = TABLE[op]
    kwargs: dict[str, Any] = {"weight": weight, "weight_offset": offset, "backend": s.backend}
    if "bias" in table.index:
        kwargs["bias"] = bias
    x = s.from_numpy(given["x"])
    if table.gradients:  # statistics of a plain forward call: the backward takes them as given
        assert table.base is None
        forward = "layer_norm" if "mean" in table.stats else "rms_norm"
        stats = getattr(normlab, forward)(x, return_stats=True, backend=s.backend)[1:]
        result = getattr(normlab, op)(s.from_numpy(given["dy"]), x, *stats, **kwargs)
    elif table.base is not None:
        residual = s.from_numpy(given["residual"])
        result = getattr(normlab, op)(x, residual, return_stats=True, **kwargs)
    else:
        result = getattr(normlab, op)(x, return_stats=True, **kwargs)
    return [None if r is None else s.to_numpy(r) for r in result]


def _assert_formed(
    got: list[np.ndarray | None],
    formed: list[np.ndarray | None],
    op: str,
    gradient_dtype: str,
    repro: str,
) -> None:
    """``got`` holds ``formed``'s bits, output by output; the parameter gradients (in the
    formed parameters' dtype there) rounded once to ``gradient_dtype``."""
    table = TABLE[op]
    for name, a, b in zip(table.outputs + table.stats_outputs, got, formed, strict=False):
        if b is not None and name in table.per_feature_outputs:
            b = b.astype(numpy_dtype(gradient_dtype))
        assert same_bits(a, b), (
            f"{name} differs from the call given the parameters formed in the compute dtype "
            f"(or has another dtype: {None if a is None else a.dtype}, expected "
            f"{None if b is None else b.dtype})\n{repro}"
        )


def _repro(s: Subject, op: str, dtype: str, parameters: str) -> str:
    return (
        f"reproduce: normlab.{op} on {ROWS}x{COLS} {dtype} rows, {parameters}, "
        f"backend={s.backend!r}"
    )


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_weight_offset(normlab_subject: Subject, op: str, dtype: str, offset: float) -> None:
    """``weight_offset=offset`` gives the bits of the call given ``float32(weight) + offset``
    (float64 for float64 x) as its weight: the offset is added in the compute dtype, never in
    a half dtype, and the gradients are those of the weight itself."""
    s = normlab_subject
    _require(s, op, dtype)
    given = _inputs(dtype, seed=11)
    params = _parameters(seed=12)
    weight, bias = (params[k].astype(numpy_dtype(dtype)) for k in ("weight", "bias"))
    compute = _compute(dtype)
    formed = weight.astype(compute) + compute.type(offset)
    got = _outputs(s, op, given, s.from_numpy(weight), s.from_numpy(bias), offset)
    want = _outputs(s, op, given, s.from_numpy(formed), s.from_numpy(bias), 0.0)
    repro = _repro(s, op, dtype, f"{dtype} weight and bias, weight_offset={offset}")
    _assert_formed(got, want, op, dtype, repro)


@pytest.mark.parametrize(("weight_dtype", "bias_dtype"), PARAMETER_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_parameters_of_any_float_dtype(
    normlab_subject: Subject, op: str, dtype: str, weight_dtype: str, bias_dtype: str
) -> None:
    """A weight and bias of any float dtypes (each its own) give the bits of the call given
    them converted to the compute dtype; y keeps x's dtype, dweight and dbias come in the
    weight's."""
    s = normlab_subject
    _require(s, op, dtype, weight_dtype, bias_dtype)
    given = _inputs(dtype, seed=13)
    params = _parameters(seed=14)
    weight = params["weight"].astype(numpy_dtype(weight_dtype))
    bias = params["bias"].astype(numpy_dtype(bias_dtype))
    compute = _compute(dtype)
    got = _outputs(s, op, given, s.from_numpy(weight), s.from_numpy(bias), 0.0)
    want = _outputs(
        s, op, given, s.from_numpy(weight.astype(compute)), s.from_numpy(bias.astype(compute)), 0.0
    )
    repro = _repro(s, op, dtype, f"{weight_dtype} weight, {bias_dtype} bias")
    _assert_formed(got, want, op, weight_dtype, repro)
    if got[0] is not None:
        assert got[0].dtype == numpy_dtype(dtype), f"y is {got[0].dtype}, not x's {dtype}\n{repro}"


#: Significand bits of each dtype (a unit in the last place is 2**(1 - bits) relative).
_BITS: Final = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53}


@pytest.mark.parametrize("casting", ["llama", "t5"])
@pytest.mark.parametrize("weight_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
def test_casting_orders(
    normlab_subject: Subject, op: str, dtype: str, weight_dtype: str, casting: str
) -> None:
    """``casting="llama"``: x̂ rounded to x's dtype, then ``weight * x̂`` in torch's promotion
    of the two dtypes (HF Llama); ``"t5"``: x̂ rounded to the weight's dtype when that is half
    (else float32, float64 for float64 x), then the multiply (HF T5). y has that promotion's
    dtype and is within the arithmetic of x̂ and one rounding of each step of the float64
    reference: x̂ rounded to its dtype (a unit of it, times the weight), the product to y's. A
    row's bits are the same alone and in the batch."""
    s = normlab_subject
    _require(s, op, dtype, weight_dtype)
    given = _inputs(dtype, seed=15)
    weight = _parameters(seed=16)["weight"].astype(numpy_dtype(weight_dtype)) * 10
    x = given["x"]
    rounded_to = (
        dtype
        if casting == "llama"
        else weight_dtype
        if weight_dtype in ("float16", "bfloat16")
        else ("float64" if dtype == "float64" else "float32")
    )
    y_dtype = _promoted(rounded_to, weight_dtype)
    args = [s.from_numpy(x)]
    h = x
    if op == "add_rms_norm":
        args.append(s.from_numpy(given["residual"]))
        h = (x + given["residual"]).astype(x.dtype)  # the fused op's h, rounded to x's dtype
    function = getattr(normlab, op)
    result = function(*args, weight=s.from_numpy(weight), casting=casting, backend=s.backend)
    y = s.to_numpy(result[0] if op == "add_rms_norm" else result)
    repro = _repro(s, op, dtype, f"{weight_dtype} weight, casting={casting!r}")
    assert y.dtype == numpy_dtype(y_dtype), f"y is {y.dtype}, expected {y_dtype}\n{repro}"
    xhat = reference.rms_norm(h)[0]
    w64 = weight.astype(np.float64)
    want = (xhat.astype(numpy_dtype(rounded_to)).astype(np.float64) * w64).astype(y.dtype)
    # x̂'s own arithmetic (the RMSNorm tolerance of the compute dtype), then a unit of the dtype
    # it is rounded to (the two roundings may fall on either side of a midpoint), then y's
    arithmetic = TOLERANCES[dtype].compute * (1 + np.sqrt(COLS))
    allowed = (arithmetic + 2.0 ** (1 - _BITS[rounded_to])) * np.abs(xhat * w64) * 1.01
    allowed += 2.0 ** (1 - _BITS[y_dtype]) * np.abs(want.astype(np.float64)) * 1.01
    allowed += np.finfo(numpy_dtype(y_dtype)).smallest_subnormal
    error = np.abs(y.astype(np.float64) - want.astype(np.float64))
    bad = error > allowed
    assert not bad.any(), (
        f"{int(bad.sum())} elements of y off by more than one rounding of x̂ and one of y; "
        f"worst {float(error.max())!r}\n{repro}"
    )
    rows = (a[3:9, ...] for a in args)
    part = function(*rows, weight=s.from_numpy(weight), casting=casting, backend=s.backend)
    part_y = s.to_numpy(part[0] if op == "add_rms_norm" else part)
    assert same_bits(part_y, y[3:9]), f"rows 3..8 alone give other bits\n{repro}"


def _promoted(a: str, b: str) -> str:
    """torch's promotion of two float dtypes."""
    if a == b:
        return a
    if {a, b} == {"float16", "bfloat16"}:
        return "float32"
    width = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
    return a if width[a] > width[b] else b
