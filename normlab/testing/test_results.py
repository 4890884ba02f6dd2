"""What a call returns: x's kind of array for y, keepdims statistics in the statistics dtype
(``mean`` and ``rstd`` for layer_norm, ``rstd`` for rms_norm)."""

from __future__ import annotations

from typing import Any

import pytest

from normlab.constants import FLOAT_DTYPES
from normlab.ops import OPS as TABLE
from normlab.testing.bitwise import same_bits
from normlab.testing.cases import OPS, Case
from normlab.testing.conversions import numpy_dtype
from normlab.testing.subject import Subject

#: (normalized_shape, axis) on x of shape (3, 5, 7).
AXES: dict[str, tuple[Any, Any]] = {
    "default": (None, None),
    "shape(5,7)": ((5, 7), None),
    "shape7": (7, None),
    "axis(0,2)": (None, (0, 2)),
    "axis1": (None, 1),
    "axis(-1,-3)": (None, (-1, -3)),
    "both": ((7,), -1),
}


@pytest.mark.parametrize("axes", AXES)
@pytest.mark.parametrize(
    ("op", "return_stats"),
    # rms_norm's y goes the same way as layer_norm's: its statistics are what differ.
    [("layer_norm", False), ("layer_norm", True), ("rms_norm", True)],
)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_result_kinds(
    normlab_subject: Subject, op: str, dtype: str, return_stats: bool, axes: str
) -> None:
    """y has x's type, shape, dtype and device (checked by ``Case.run``); the statistics are
    keepdims-shaped (1 on the normalized axes) and float32 (float64 for float64 x)."""
    normlab_subject.require_op(op)
    normlab_subject.require_dtype(dtype)
    normalized_shape, axis = AXES[axes]
    case = Case(
        (3, 5, 7),
        dtype,
        normalized_shape=normalized_shape,
        axis=axis,
        return_stats=return_stats,
        op=op,
    )
    y, mean, rstd = case.run(normlab_subject.name)
    if return_stats:
        shape = tuple(1 if a in case.axes else n for a, n in enumerate(case.shape))
        want = numpy_dtype("float64" if dtype == "float64" else "float32")
        stats = {"mean": mean, "rstd": rstd}
        for what in TABLE[op].stats_outputs:
            got = stats[what]
            assert got is not None, f"{what} is missing"
            assert (got.shape, got.dtype) == (shape, want), (
                f"{what} has shape {got.shape} and dtype {got.dtype}; expected {shape} and "
                f"{want}\n{case.snippet(normlab_subject.name)}"
            )
    case.compare(y, mean, rstd, backend=normlab_subject.name)


@pytest.mark.parametrize(
    ("shape", "normalized_shape", "axis"),
    [
        ((3, 7), None, None),
        ((1, 7), (1, 7), None),
        ((1, 7), None, (0, 1)),
        ((2, 3), (2, 3), None),
        ((3, 5, 7), (5, 7), None),
    ],
    ids=["last", "shape(1,7)", "axis(0,1)", "shape(2,3)", "shape(5,7)"],
)
@pytest.mark.parametrize("op", OPS)
def test_repeated_call(
    normlab_subject: Subject, op: str, shape: tuple[int, ...], normalized_shape: Any, axis: Any
) -> None:
    """A second identical call — its plan and route now served from normlab's caches — gives
    the same bits as the first."""
    normlab_subject.require_op(op)
    dtype = normlab_subject.dtype
    case = Case(
        shape,
        dtype,
        "rowwise",
        seed=14,
        normalized_shape=normalized_shape,
        axis=axis,
        weight=dtype,
        bias=dtype if op == "layer_norm" else None,
        return_stats=False,
        op=op,
    )
    first = case.run(normlab_subject.name)[0]
    case.compare(first, None, None, backend=normlab_subject.name)
    second = case.run(normlab_subject.name)[0]
    assert same_bits(first, second), (
        f"the second call differs\n{case.snippet(normlab_subject.name)}"
    )
