"""Memory layouts, ``out=``, in place, x left untouched, and empty inputs, for each op."""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import pytest

import normlab
from normlab.ops import OPS as TABLE
from normlab.testing.bitwise import same_bits
from normlab.testing.cases import OPS, Case, same_kind
from normlab.testing.conversions import LAYOUTS, arrange, numpy_dtype
from normlab.testing.subject import Subject

#: x's shape and normalized axes: trailing, non-trailing, split; 2-D ones collapse to row views
#: of every layout, so strided backends read them without a copy.
SHAPES = {
    "2d-last": ((7, 33), None, None),
    "2d-axis0": ((33, 7), None, 0),
    "3d-last": ((5, 6, 17), None, None),
    "3d-trailing2": ((5, 6, 17), (6, 17), None),
    "3d-axis0": ((5, 6, 17), None, 0),
    "3d-axes0,2": ((5, 6, 17), None, (0, -1)),
}


def _bias(op: str, dtype: str) -> str | None:
    """A bias of ``dtype`` for layer_norm; none for rms_norm."""
    return dtype if op == "layer_norm" else None


#: The SHAPES rms_norm is tested on (its layouts are resolved by the same core as layer_norm's).
RMS_NORM_SHAPES: Final = ("2d-last", "3d-axis0", "3d-axes0,2")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    ("op", "shape"),
    [*(("layer_norm", s) for s in SHAPES), *(("rms_norm", s) for s in RMS_NORM_SHAPES)],
)
def test_layout(normlab_subject: Subject, op: str, layout: str, shape: str) -> None:
    """Every layout gives the reference result; backends that do not read strides get a copy
    from the core, so this holds for them too."""
    normlab_subject.require_op(op)
    normlab_subject.require_layout(layout)
    dtype = normlab_subject.dtype
    dims, normalized_shape, axis = SHAPES[shape]
    case = Case(
        dims,
        dtype,
        "rowwise",
        seed=9,
        normalized_shape=normalized_shape,
        axis=axis,
        weight=dtype,
        bias=_bias(op, dtype),
        layout=layout,
        op=op,
    )
    case.check(normlab_subject.name)


@pytest.mark.parametrize(
    ("capability", "layout"), [("strided", "sliced"), ("row_strided", "padded")]
)
@pytest.mark.parametrize("op", OPS)
def test_strided_view_reaches_backend(
    normlab_subject: Subject, op: str, capability: str, layout: str
) -> None:
    """A backend claiming ``strided`` (``row_strided``) is handed the strided 2-D view itself,
    without a copy (test_layout checks its results)."""
    claims = normlab_subject.capabilities
    if capability == "row_strided" and "strided" in claims:
        capability = "strided"
    normlab_subject.require_capability(
        capability,
        "the core copies such x to C order before calling it (test_layout checks "
        "the results either way)",
    )
    normlab_subject.require_op(op)
    normlab_subject.require_layout(layout)
    case = Case((4, 33), normlab_subject.dtype, layout=layout, op=op)
    x, kwargs = case.inputs(normlab_subject.name)
    text = normlab.explain(x, **kwargs, backend=normlab_subject.backend, op=op)
    assert "no copy of x" in text, text


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", OPS)
def test_x_never_modified(normlab_subject: Subject, op: str, layout: str) -> None:
    """x, weight and bias hold the same bits after the call."""
    normlab_subject.require_op(op)
    normlab_subject.require_layout(layout)
    case = Case(
        (4, 5, 9),
        normlab_subject.dtype,
        "rowwise",
        seed=10,
        axis=(0, 2),
        weight=normlab_subject.dtype,
        bias=_bias(op, normlab_subject.dtype),
        layout=layout,
        op=op,
    )
    x, kwargs = case.inputs(normlab_subject.name)
    arrays: dict[str, Any] = {"x": x, **{k: kwargs[k] for k in ("weight", "bias") if k in kwargs}}
    before = {what: normlab_subject.to_numpy(a).tobytes() for what, a in arrays.items()}
    result = case.call(x, **kwargs, backend=normlab_subject.backend, return_stats=True)
    for what, a in arrays.items():
        assert same_bits(normlab_subject.to_numpy(a).tobytes(), before[what]), (
            f"{what} was modified\n{case.snippet(normlab_subject.name)}"
        )
    y, mean, rstd = (
        None if a is None else normlab_subject.to_numpy(a) for a in case.unpack(result)
    )
    assert y is not None
    case.compare(y, mean, rstd, backend=normlab_subject.name)


@pytest.mark.parametrize("return_stats", [False, True])
@pytest.mark.parametrize("op", OPS)
def test_x_never_modified_on_the_direct_path(
    normlab_subject: Subject, op: str, return_stats: bool
) -> None:
    """A 2-D C-contiguous x normalized over its last axis reaches the backend itself, without a
    copy (on the second call, the cached direct path, through the backend's ``prepare`` where
    it has one): x, weight and bias keep their bits, and the second call returns the first's."""
    normlab_subject.require_op(op)
    dtype = normlab_subject.dtype
    case = Case(
        (8, 40),
        dtype,
        "rowwise",
        seed=14,
        weight=dtype,
        bias=_bias(op, dtype),
        return_stats=return_stats,
        op=op,
    )
    x, kwargs = case.inputs(normlab_subject.name)
    arrays: dict[str, Any] = {"x": x, **{k: kwargs[k] for k in ("weight", "bias") if k in kwargs}}
    before = {what: normlab_subject.to_numpy(a).tobytes() for what, a in arrays.items()}
    results = []
    for call in ("first", "second"):
        result = case.call(x, **kwargs, backend=normlab_subject.backend, return_stats=return_stats)
        for what, a in arrays.items():
            assert same_bits(normlab_subject.to_numpy(a).tobytes(), before[what]), (
                f"{what} was modified by the {call} call\n{case.snippet(normlab_subject.name)}"
            )
        y, mean, rstd = (
            None if a is None else normlab_subject.to_numpy(a) for a in case.unpack(result)
        )
        assert y is not None
        case.compare(y, mean, rstd, backend=normlab_subject.name)
        results.append([None if a is None else a.tobytes() for a in (y, mean, rstd)])
    assert all(map(same_bits, results[1], results[0])), (
        "the second call (the cached direct route) returned other bits than the first\n"
        + case.snippet(normlab_subject.name)
    )


@pytest.mark.parametrize(
    ("shape", "axis"),
    [((0, 8), None), ((2, 0, 8), None), ((3, 0), None), ((0, 4, 5), 1), ((4, 0, 5), (0, 2))],
)
@pytest.mark.parametrize("op", OPS)
def test_empty(normlab_subject: Subject, op: str, shape: tuple[int, ...], axis: Any) -> None:
    """An empty x (no rows, or empty rows) gives an empty y of x's kind, and statistics of the
    keepdims shape and statistics dtype."""
    normlab_subject.require_op(op)
    dtype = normlab_subject.dtype
    case = Case(shape, dtype, axis=axis, op=op)
    x, kwargs = case.inputs(normlab_subject.name)
    result = case.call(x, **kwargs, backend=normlab_subject.backend, return_stats=True)
    y, *stats = result
    same_kind(y, x, case.snippet(normlab_subject.name))
    stats_shape = tuple(1 if a in case.axes else n for a, n in enumerate(shape))
    assert len(stats) == len(TABLE[op].stats_outputs), f"{op} returned {len(result)} arrays"
    for got in (normlab_subject.to_numpy(a) for a in stats):
        assert got.shape == stats_shape and got.dtype == numpy_dtype(dtype), (got.shape, got.dtype)
    same_kind(case.call(x, **kwargs, backend=normlab_subject.backend), x)


# --------------------------------------------------------------------------------------------
# out= and in place


def _require_out(subject: Subject) -> None:
    subject.require_capability(
        "out", "out= is then written by the core through a temporary, not by the backend"
    )


def _check_y(y: Any, case: Case, subject: Subject) -> None:
    case.compare(subject.to_numpy(y), None, None, backend=subject.name)


@pytest.mark.parametrize("out_layout", ["c", "fortran", "sliced"])
@pytest.mark.parametrize("layout", ["c", "transposed"])
@pytest.mark.parametrize("op", OPS)
def test_out(normlab_subject: Subject, op: str, layout: str, out_layout: str) -> None:
    """``out=`` is written and returned (itself), in any writable layout; x is untouched."""
    normlab_subject.require_op(op)
    _require_out(normlab_subject)
    normlab_subject.require_layout(layout)
    normlab_subject.require_layout(out_layout)
    case = Case((6, 33), normlab_subject.dtype, "rowwise", seed=11, layout=layout, op=op)
    x, kwargs = case.inputs(normlab_subject.name)
    x_before = normlab_subject.to_numpy(x).tobytes()
    out = arrange(
        np.zeros(case.shape, numpy_dtype(case.dtype)),
        out_layout,
        normlab_subject,
    )
    y = case.call(x, **kwargs, backend=normlab_subject.backend, out=out)
    assert y is out, f"{op}(..., out=out) must return out itself"
    _check_y(out, case, normlab_subject)
    assert same_bits(normlab_subject.to_numpy(x).tobytes(), x_before), "x was modified"


@pytest.mark.parametrize(
    ("op", "given"),
    [
        *(("layer_norm", g) for g in ("y", "mean", "rstd", "all")),
        *(("rms_norm", g) for g in ("y", "rstd", "all")),
    ],
)
def test_out_with_stats(normlab_subject: Subject, op: str, given: str) -> None:
    """With return_stats, ``out=(y, mean, rstd)`` (rms_norm: ``(y, rstd)``) fills the entries
    given and allocates the ones that are None."""
    normlab_subject.require_op(op)
    _require_out(normlab_subject)
    dtype = normlab_subject.dtype
    stats_dtype = numpy_dtype("float64" if dtype == "float64" else "float32")
    case = Case((6, 33), dtype, "rowwise", seed=12, op=op)
    x, kwargs = case.inputs(normlab_subject.name)
    entries = {"y": np.zeros(case.shape, numpy_dtype(dtype))}
    entries.update({what: np.zeros((6, 1), stats_dtype) for what in TABLE[op].stats_outputs})
    out = tuple(
        normlab_subject.from_numpy(a) if given in (what, "all") else None
        for what, a in entries.items()
    )
    result = case.call(x, **kwargs, backend=normlab_subject.backend, return_stats=True, out=out)
    for got, passed in zip(result, out, strict=True):
        assert passed is None or got is passed, "an out entry given must be returned itself"
    y, mean, rstd = (
        None if a is None else normlab_subject.to_numpy(a) for a in case.unpack(result)
    )
    assert y is not None
    case.compare(y, mean, rstd, backend=normlab_subject.name)


@pytest.mark.parametrize("layout", ["c", "fortran", "sliced"])
@pytest.mark.parametrize("op", OPS)
def test_in_place(normlab_subject: Subject, op: str, layout: str) -> None:
    """``out=x`` normalizes x in place and returns x."""
    normlab_subject.require_op(op)
    _require_out(normlab_subject)
    normlab_subject.require_capability(
        "inplace", "out=x is then computed into a temporary and copied back by the core"
    )
    normlab_subject.require_layout(layout)
    case = Case(
        (6, 5, 17),
        normlab_subject.dtype,
        "rowwise",
        seed=13,
        axis=(0, 2),
        weight=normlab_subject.dtype,
        layout=layout,
        op=op,
    )
    x, kwargs = case.inputs(normlab_subject.name)
    y = case.call(x, **kwargs, backend=normlab_subject.backend, out=x)
    assert y is x, f"{op}(x, out=x) must return x itself"
    _check_y(x, case, normlab_subject)


@pytest.mark.parametrize("stats", [False, True])
@pytest.mark.parametrize("layout", ["c", "padded"])
@pytest.mark.parametrize("op", OPS)
def test_in_place_row_views(normlab_subject: Subject, op: str, layout: str, stats: bool) -> None:
    """``out=x`` (with return_stats: ``out=(x, None, None)``, rms_norm ``(x, None)``) on a 2-D
    row view (C-contiguous; row-strided): a backend claiming ``inplace`` gets ``out`` sharing
    x's memory, so it must read each row before writing it. y and the statistics compared."""
    normlab_subject.require_op(op)
    _require_out(normlab_subject)
    normlab_subject.require_capability(
        "inplace", "out=x is then computed into a temporary and copied back by the core"
    )
    normlab_subject.require_layout(layout)
    dtype = normlab_subject.dtype
    case = Case(
        (9, 40),
        dtype,
        "rowwise",
        seed=15,
        weight=dtype,
        bias=_bias(op, dtype),
        layout=layout,
        return_stats=stats,
        op=op,
    )
    x, kwargs = case.inputs(normlab_subject.name)
    out: Any = x
    if stats:
        out = (x, *(None for _ in TABLE[op].stats_outputs))
    result = case.call(x, **kwargs, backend=normlab_subject.backend, return_stats=stats, out=out)
    y, mean, rstd = case.unpack(result)
    assert y is x, f"{op}(x, out=x) must return x itself\n{case.snippet(normlab_subject.name)}"
    case.compare(
        normlab_subject.to_numpy(x),
        None if mean is None else normlab_subject.to_numpy(mean),
        None if rstd is None else normlab_subject.to_numpy(rstd),
        backend=normlab_subject.name,
    )
