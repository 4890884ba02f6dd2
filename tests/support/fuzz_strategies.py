"""Hypothesis strategies of the API fuzzers: calls of the six public ops (fuzz_model.py), each
argument drawn from valid values or, for at most two arguments, invalid ones.

:func:`forward_calls` draws ``layer_norm``/``rms_norm`` calls, :func:`backward_calls` their
backward ops', :func:`fused_calls` ``add_layer_norm``/``add_rms_norm`` calls;
:data:`INPUT_CLASSES` names the edges of the contract the forward strategy must reach (each
found a silent wrong answer once), and :func:`input_classes` tells them; :data:`FUSED_FORMS`
and :func:`fused_forms` likewise for the fused strategy.
"""

from __future__ import annotations

import dataclasses
import math
from decimal import Decimal
from fractions import Fraction
from typing import Any, Final

import numpy as np
import torch
from hypothesis import strategies as st

import normlab
from normlab.constants import MACHINE_EPS, stats_dtype_for
from normlab.testing import conversions
from tests.support.fuzz_model import (
    FLOATS,
    HALF,
    OVERLAPS,
    Backward,
    Forward,
    Fused,
    Param,
    is_array,
    same_elements,
)

NOT_FLOATS: Final = {
    "numpy": ("int32", "bool", "complex64", "longdouble", "object", "datetime64[s]"),
    "torch": ("int32", "bool", "complex64", "uint8"),
}
LAYOUTS: Final = {
    "numpy": (
        *(layout for layout in conversions.LAYOUTS if layout != "padded"),
        *conversions.NUMPY_LAYOUTS,
    ),
    "torch": ("c", "fortran", "transposed", "sliced", "broadcast"),
}
DIMS: Final = (0, 1, 2, 3, 5, 8, 17)
MAX_ELEMENTS: Final = 2000
#: Names for ``backend=``: built-ins (cupy has no device here), unknown names, not names at all.
NAMED: Final = ("numpy", "numba", "torch")
BACKEND_NAMES: Final = (None, *NAMED, "cupy", "no_such_backend", 3)
PREFERENCES: Final = (None, "numpy", "numba", "torch", "cupy")

#: The arguments a drawn call may get wrong (at most two per call; most calls get none wrong).
ARGUMENTS: Final = (
    "x",
    "rank",
    "normalized_shape",
    "axis",
    "weight",
    "bias",
    "eps",
    "return_stats",
    "out",
    "backend",
)
VALID_EPS: Final = (
    "default",
    1e-5,
    0.0,
    0,
    1e-12,
    1,
    0.5,
    1e30,
    1e300,
    1e-30,
    1e-40,  # a float32 subnormal
    1e-80,  # 1/sqrt(eps) overflows float32
    5e-324,  # the smallest float64 subnormal
    -0.0,
    np.float32(1e-3),
    np.float64(1e-6),
    np.float16(1e-2),
    Fraction(1, 1000),
)
INVALID_EPS: Final = (
    -1e-5,
    float("nan"),
    float("inf"),
    -float("inf"),
    True,
    None,
    "1e-5",
    Decimal("1e-5"),
    1j,
    np.bool_(False),
    -(10**30),
    10**400,  # an int too large for a float
)
VALID_OUT: Final = (None, None, "fresh", "fortran", "sliced", "swapped", "x", "tuple")
INVALID_OUT: Final = (
    "wrong_shape",
    "wrong_dtype",
    "other_family",
    "readonly",
    "broadcast",
    "overlap",
    "aliases_weight",  # thrice: few calls have an out, a weight and elements
    "aliases_weight",
    "aliases_weight",
    "list",
    "masked",
    "bad_tuple",
)
VALID_PARAMS: Final = (None, None, "ok", "ok", "float32", "strided", "broadcast")
INVALID_PARAMS: Final = ("wrong_shape", "wrong_dtype", "other_family", "list")


def _shape(draw: st.DrawFn, rank_ok: bool, elements: bool = False) -> tuple[int, ...]:
    """A shape of rank 1-4 (no dims if not ``rank_ok``); with ``elements``, no zero dim."""
    shape: list[int] = []
    for _ in range(draw(st.integers(1, 4)) if rank_ok else 0):
        most = MAX_ELEMENTS // max(1, math.prod(shape))
        dims = [d for d in DIMS if d <= most and (d or not elements)]
        shape.append(draw(st.sampled_from(dims)))
    return tuple(shape)


def _signed(draw: st.DrawFn, axes: list[int], ndim: int) -> int | tuple[int, ...]:
    """``axes`` written with some negative, as an int when there is one and a coin says so."""
    signed = [a - ndim if draw(st.booleans()) else a for a in axes]
    return signed[0] if len(signed) == 1 and draw(st.booleans()) else tuple(signed)


def _normalized_shape(draw: st.DrawFn, shape: tuple[int, ...], valid: bool) -> Any:
    """None or trailing dims in any accepted form; or (not valid) ints that may not match, or
    values of the wrong type."""
    ndim = len(shape)
    if not valid:
        ints = st.integers(-6, 20)
        wrong = st.sampled_from(["4", 4.0, True, (2.0,), [None], {3}, (), [], np.array([3])])
        return draw(st.one_of(ints, st.lists(ints, max_size=4).map(tuple), wrong))
    if not ndim or draw(st.booleans()):
        return None
    k = draw(st.integers(1, ndim))
    dims = shape[ndim - k :]
    form = draw(st.sampled_from(["tuple", "list", "int", "size", "np"]))
    if form in ("int", "np") and k == 1:
        return dims[0] if form == "int" else np.int64(dims[0])
    return {"list": list(dims), "size": torch.Size(dims)}.get(form, dims)


def _axis(draw: st.DrawFn, shape: tuple[int, ...], normalized_shape: Any, valid: bool) -> Any:
    """None or axes that agree with ``normalized_shape``; or (not valid) any ints or values."""
    ndim = len(shape)
    if not valid:
        ints = st.integers(-6, 6)
        wrong = st.sampled_from([1.0, True, (), "0", [None]])
        return draw(st.one_of(ints, st.lists(ints, max_size=4).map(tuple), wrong))
    if not ndim or draw(st.booleans()):
        return None
    if normalized_shape is not None:
        k = len(normalized_shape) if isinstance(normalized_shape, (tuple, list)) else 1
        return _signed(draw, list(range(ndim - k, ndim)), ndim)
    chosen = draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True))
    return _signed(draw, chosen, ndim)


def _param(draw: st.DrawFn, family: str, dtype: str, valid: bool) -> Param | None:
    kinds = list(VALID_PARAMS if valid else INVALID_PARAMS)
    if family == "numpy":
        kinds.append("swapped" if valid else "masked")
    elif valid:
        kinds.append("requires_grad")
    kind = draw(st.sampled_from(kinds))
    if kind == "float32" and dtype not in HALF:
        kind = "ok"  # float32 parameters are valid for half x only
    if kind is None:
        return None
    wrong = [d for d in (*FLOATS, "int32") if d not in (dtype, "float32")]
    return Param(kind, draw(st.sampled_from(wrong)) if kind == "wrong_dtype" else "float32")


@st.composite
def forward_calls(draw: st.DrawFn, max_wrong: int = 2) -> Forward:
    """A call with at most ``max_wrong`` arguments drawn from their invalid values, the rest
    valid. One call in :data:`EDGE_SHARE` aims at one of :data:`INPUT_CLASSES` (built to
    belong to it), so that every class is drawn in a run of a few hundred calls whatever
    sequence the run's seed gives."""
    edge = draw(st.sampled_from((None,) * (EDGE_SHARE - 1) * len(INPUT_CLASSES) + INPUT_CLASSES))
    wrong = draw(st.sets(st.sampled_from(ARGUMENTS), max_size=max_wrong)) if edge is None else set()
    if edge == "out sharing memory with weight":
        wrong = {"out"}
    op = draw(st.sampled_from(["layer_norm", "layer_norm", "rms_norm"]))
    family = draw(st.sampled_from(["numpy", "torch"]))
    floats = [*FLOATS] if "x" not in wrong else [*NOT_FLOATS[family], "not_an_array"]
    edge_dtypes = EDGE_DTYPES.get(edge, FLOATS)
    dtype = draw(st.sampled_from([d for d in floats if d in edge_dtypes] or floats))
    shape = _shape(draw, "rank" not in wrong, elements=edge is not None)
    out = draw(st.sampled_from(INVALID_OUT if "out" in wrong else VALID_OUT))
    if edge == "out sharing memory with weight":
        out = "aliases_weight"
    layout = draw(st.sampled_from(LAYOUTS[family]))
    if (out == "overlap" and not shape) or dtype == "not_an_array":
        out = None
    stats_kinds = ["wrong_dtype", "wrong_shape"] if out == "bad_tuple" else [None, "ok"]
    normalized_shape = _normalized_shape(draw, shape, "normalized_shape" not in wrong)
    eps_values = (
        INVALID_EPS if "eps" in wrong else VALID_EPS + ((None,) if op == "rms_norm" else ())
    )
    kinds = ["normal", "offset", "integers", "tiny", "spread", "huge", "minute", "constant"]
    backend = draw(
        st.sampled_from(
            ["cupy", "no_such_backend", 3, ["numpy"]]
            if "backend" in wrong
            else [None, None, *NAMED]
        )
    )
    preference = draw(st.sampled_from(PREFERENCES))
    values = draw(st.sampled_from(kinds)) if edge not in EDGE_VALUES else EDGE_VALUES[edge]
    if values in ("minute", "constant") and "eps" not in wrong:  # eps = 0 as often as not
        eps_values = (0.0,) * len(eps_values) + eps_values
    if edge == "constant rows, eps = 0":
        eps_values = (0.0, -0.0, 0)
    elif edge == "minute rows, eps too small to hide underflow":
        eps_values = (0.0, -0.0, 5e-324) + ((1e-40, 1e-80) if dtype == "float32" else ())
    return Forward(
        op=op,
        family=family,
        dtype=dtype,
        shape=shape,
        layout=layout,
        values=values,
        normalized_shape=normalized_shape,
        axis=_axis(draw, shape, normalized_shape, "axis" not in wrong),
        weight=_param(draw, family, dtype, "weight" not in wrong),
        bias=_param(draw, family, dtype, "bias" not in wrong) if op == "layer_norm" else None,
        eps=draw(st.sampled_from(eps_values)),
        return_stats=draw(
            st.sampled_from([1, None, np.True_] if "return_stats" in wrong else [False, True])
        ),
        out="tuple" if out == "bad_tuple" else out,
        out_stats=(draw(st.sampled_from(stats_kinds)), draw(st.sampled_from(stats_kinds))),
        backend=backend,
        preference=preference,
        requires_grad=family == "torch" and dtype in FLOATS and draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


#: The input classes at the edges of the contract that the fuzzer must generate (each found a
#: silent wrong answer once); their counts are asserted, see test_the_fuzzer_generates_...
INPUT_CLASSES: Final = (
    "huge float64 rows",
    "minute rows, eps too small to hide underflow",
    "constant rows, eps = 0",
    "out sharing memory with weight",
)


#: One forward call in this many aims at an input class (:func:`forward_calls`).
EDGE_SHARE: Final = 2
#: The float dtypes and value kinds that put a call in an input class (the eps of the
#: minute and constant classes: zero or below :func:`input_classes`'s bound).
EDGE_DTYPES: Final = {
    "huge float64 rows": ("float64",),
    "minute rows, eps too small to hide underflow": ("float32", "float64"),
}
EDGE_VALUES: Final = {
    "huge float64 rows": "huge",
    "minute rows, eps too small to hide underflow": "minute",
    "constant rows, eps = 0": "constant",
}


def input_classes(f: Forward, kwargs: dict[str, Any]) -> list[str]:
    """The :data:`INPUT_CLASSES` the call ``f`` (built as ``kwargs``) belongs to."""
    if f.dtype not in FLOATS or not f.shape:
        return []
    default = 1e-5 if f.op == "layer_norm" else MACHINE_EPS[stats_dtype_for(f.dtype)]
    eps = kwargs.get("eps", default)
    try:
        eps_value = float(eps)
    except (TypeError, ValueError, OverflowError):
        return []
    classes = []
    if f.values == "huge" and f.dtype == "float64":
        classes.append(INPUT_CLASSES[0])
    hidden_below = {"float32": 1e-31, "float64": 1e-292}.get(f.dtype)
    if f.values == "minute" and hidden_below is not None and 0 <= eps_value < hidden_below:
        classes.append(INPUT_CLASSES[1])
    if f.values == "constant" and eps_value == 0:
        classes.append(INPUT_CLASSES[2])
    if f.aliases_weight(f.norm_shape()):
        classes.append(INPUT_CLASSES[3])
    return classes


@st.composite
def backward_calls(draw: st.DrawFn) -> Backward:
    op = draw(st.sampled_from(["layer_norm_backward", "rms_norm_backward"]))
    family = draw(st.sampled_from(["numpy", "torch"]))
    shape = draw(st.lists(st.sampled_from(DIMS[:6]), min_size=1, max_size=3).map(tuple))
    ndim = len(shape)
    axis = tuple(
        sorted(draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True)))
    )
    names = ["dy", "weight", "rstd", "axis"] + (["mean"] if op == "layer_norm_backward" else [])
    hows = ["dtype", "shape", "family", "strided", "none", "list"]
    broken = draw(
        st.lists(
            st.tuples(st.sampled_from(names), st.sampled_from(hows)),
            max_size=2,
            unique_by=lambda t: t[0],
        )
    )
    broken = [(n, "axis" if n == "axis" else h) for n, h in broken]
    known = ["x", "weight", "bias"] if op == "layer_norm_backward" else ["x", "weight"]
    needs = draw(
        st.one_of(
            st.lists(st.sampled_from(known), unique=True).map(tuple),
            st.sampled_from([("x", "gamma"), "x", None, ["x"], {"weight"}]),
        )
    )
    return Backward(
        op=op,
        family=family,
        dtype=draw(st.sampled_from(FLOATS)),
        shape=shape,
        axis=axis,
        weight=draw(st.sampled_from([None, "x", "float32"])),
        broken=tuple(broken),
        needs=needs,
        backend=draw(st.sampled_from(BACKEND_NAMES)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


#: The fused ops' own forms of their arguments (fuzz_model.Fused), valid and invalid.
VALID_RESIDUALS: Final = ("ok", "ok", "ok", "ok", "x", "x_view", "overlaps_x")
INVALID_RESIDUALS: Final = ("wrong_shape", "wrong_dtype", "other_family", "list")
#: Residual values: as x's, cancelling x (h small, mostly its rounding), below x's spacing,
#: below half the spacing of x drawn a few spacings above a power of two (h rounds to x, and
#: y of the exact sum would differ by a large part of a standard deviation).
RESIDUAL_VALUES: Final = ("independent", "independent", "cancel", "small", "below_spacing")
INVALID_RETURN_RESIDUAL: Final = (1, None, np.True_, "yes")
#: ``out`` forms only the fused ops have (x's own is the base op's ``out="x"``).
FUSED_OUT: Final = ("residual", "residual_view", "x_view")
RESIDUAL_OUT_LAYOUTS: Final = {
    "numpy": ("c", "fortran", "transposed", "sliced", "reversed", "swapped", "unaligned"),
    "torch": ("c", "fortran", "transposed", "sliced"),
}
VALID_RESIDUAL_OUT: Final = ("residual", "residual_view", "x", "x_view")
INVALID_RESIDUAL_OUT: Final = (
    "out",
    "wrong_shape",
    "wrong_dtype",
    "other_family",
    "broadcast",
    "tuple",
    "list",
    "aliases_weight",
    "post_norm",  # a valid residual_out with return_residual=False
    "shared_pair",  # out and residual_out both x, or both the residual
    "with_grad",  # a valid residual_out while an input requires grad
)
#: Shapes beyond the small ones of :func:`forward_calls`, one call in 30: rows longer than the
#: backends' blocks (NumPy's 512 KiB, numba's 1 MiB long rows cut in segments), and rows that
#: span several of NumPy's row blocks (an in-place output written block by block).
LARGE_SHAPES: Final = ((1, 262_145), (40, 4_100))
#: (out, residual_out) pairs drawn together: the serving form and its mirror.
PAIRS: Final = (("x", "residual"), ("residual", "x"))
SHARED_PAIRS: Final = (("x", "x"), ("residual", "residual"))


@st.composite
def fused_calls(draw: st.DrawFn) -> Fused:
    """An ``add_layer_norm``/``add_rms_norm`` call: the base op's arguments as
    :func:`forward_calls` draws them (at most one invalid), and at most one of the fused
    arguments (residual, return_residual, residual_out, or outputs partly overlapping)
    invalid. One call in :data:`EDGE_SHARE` aims at one of :data:`FUSED_FORMS`, with a valid
    base call."""
    form = draw(st.sampled_from((None,) * (EDGE_SHARE - 1) * len(FUSED_FORMS) + FUSED_FORMS))
    # the fused arguments add their own wrong one
    call = draw(forward_calls(max_wrong=1) if form is None else forward_calls(max_wrong=0))
    family = call.family
    if call.shape and draw(st.integers(0, 29)) == 13:  # not a bound: hypothesis favours those
        large = draw(st.sampled_from(LARGE_SHAPES))
        call = dataclasses.replace(call, shape=large, normalized_shape=None, axis=None)
    if form == "outputs partly overlapping, refused" and not (
        call.shape[:1] >= (2,) and math.prod(call.shape) > 0
    ):
        call = dataclasses.replace(call, shape=(3, 8), normalized_shape=None, axis=None)
    wrong = draw(
        st.sampled_from(
            [None, None, None, "residual", "return_residual", "residual_out", "overlap"]
        )
    )
    if form is not None:  # aimed: every fused argument valid, but for the refused overlap
        wrong = "overlap" if form == "outputs partly overlapping, refused" else None
    residuals = INVALID_RESIDUALS if wrong == "residual" else VALID_RESIDUALS
    residuals += ("masked",) if family == "numpy" and wrong == "residual" else ()
    residuals += ("requires_grad",) if family == "torch" and wrong != "residual" else ()
    residual = draw(st.sampled_from(residuals))
    if form == "residual passed as x":
        residual = "x"
    elif form == "in-place serving form (out=x, residual_out=residual)":
        residual = "ok"
    return_residual = draw(
        st.sampled_from(
            INVALID_RETURN_RESIDUAL if wrong == "return_residual" else (True, True, False)
        )
    )
    if form == "post-norm form (return_residual=False)":
        return_residual = False
    out = residual_out = overlap = None
    post_norm = False
    if wrong == "residual_out":
        invalid = [*INVALID_RESIDUAL_OUT, "readonly" if family == "numpy" else "requires_grad"]
        residual_out = draw(st.sampled_from(invalid + (["masked"] if family == "numpy" else [])))
        post_norm = residual_out == "post_norm"
        if post_norm:
            residual_out = "c"
        elif residual_out == "shared_pair":
            out, residual_out = draw(st.sampled_from(SHARED_PAIRS))
        elif residual_out == "with_grad":
            residual_out = "c"
            if family == "torch" and not call.requires_grad:
                residual = "requires_grad"
    elif wrong == "overlap":  # outputs partly the memory of out, x or the residual
        overlap = draw(st.sampled_from([o for o in OVERLAPS if o != "residual~x"]))
    elif form == "in-place serving form (out=x, residual_out=residual)":
        out, residual_out = PAIRS[0]
    elif draw(st.integers(0, 5)) == 3:
        out, residual_out = draw(st.sampled_from(PAIRS))
    else:
        out = draw(st.sampled_from((None,) * 6 + FUSED_OUT))
        residual_out = draw(
            st.sampled_from((None,) * 6 + RESIDUAL_OUT_LAYOUTS[family] + VALID_RESIDUAL_OUT)
        )
        if form == "post-norm form (return_residual=False)":
            residual_out = None  # the post-norm form writes no h
    residual_values = draw(st.sampled_from(RESIDUAL_VALUES))
    if form == "h that rounds to x (a residual below half x's spacing)":
        residual_values = "below_spacing"
    if residual_values == "below_spacing":
        call = dataclasses.replace(call, values="spaced")
    if residual == "overlaps_x":
        residual, overlap = "ok", "residual~x"
    if residual_out is not None and wrong != "return_residual":
        return_residual = not post_norm  # residual_out with return_residual=False: post_norm
    if out is not None or overlap is not None or residual_out in ("out", "aliases_weight"):
        call = dataclasses.replace(call, out=None)  # the fused form replaces the base op's
    if wrong is None and (out is not None or residual_out is not None or call.out is not None):
        # outputs with an input that requires grad are drawn as wrong (with_grad)
        call = dataclasses.replace(call, requires_grad=False)
        residual = "ok" if residual == "requires_grad" else residual
    return Fused(
        call=call,
        residual=residual,
        residual_layout=draw(st.sampled_from(LAYOUTS[family])),
        residual_values=residual_values,
        return_residual=return_residual,
        out=out,
        residual_out=residual_out,
        overlap=overlap,
    )


#: Forms of the fused ops' contract the fuzzer must generate (valid unless said otherwise);
#: their counts are asserted, see test_the_fuzzer_generates_every_fused_form.
FUSED_FORMS: Final = (
    "in-place serving form (out=x, residual_out=residual)",
    "residual passed as x",
    "post-norm form (return_residual=False)",
    "h that rounds to x (a residual below half x's spacing)",
    "outputs partly overlapping, refused",
)


def fused_forms(fz: Fused, kwargs: dict[str, Any], expected: set[type[Exception]]) -> list[str]:
    """The :data:`FUSED_FORMS` the call ``fz`` (built as ``kwargs``, the model expecting
    ``expected``) belongs to."""
    x, residual = kwargs["x"], kwargs["residual"]
    out, residual_out = kwargs.get("out"), kwargs.get("residual_out")
    forms = []
    if expected:
        overlaps = fz.overlap not in (None, "residual~x") and fz.call.shape[:1] >= (2,)
        if overlaps and math.prod(fz.call.shape) > 0 and normlab.ArgumentError in expected:
            forms.append(FUSED_FORMS[4])
        return forms
    in_place = is_array(out) and is_array(residual_out) and same_elements(out, x)
    if in_place and same_elements(residual_out, residual):
        forms.append(FUSED_FORMS[0])
    if is_array(residual) and same_elements(residual, x):
        forms.append(FUSED_FORMS[1])
    if fz.return_residual is False:
        forms.append(FUSED_FORMS[2])
    if fz.residual_values == "below_spacing":
        forms.append(FUSED_FORMS[3])
    return forms
