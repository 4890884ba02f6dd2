"""Batch invariance: a row's results are bitwise the same whatever the batch around it.

For one backend (or the default choice), op, dtype, row length, eps and parameters, a row's y,
statistics, h (fused ops) and dx (backward ops) do not depend on the number of rows, the row's
position, its neighbours' values, x's strides, ``out=`` or allocating, or the call route (a
layout's first call, then its later, direct calls). Parameter gradients sum over rows: they
are bitwise the same from run to run. The batches cross the row counts at which backends change
how they work (one thread or several, blocks of rows) and at which a choice by size would
change backend (1, 64, 1024, 2048 rows at 768 columns); serving engines promise exactly this
(a request's tokens get the same bits whatever else is batched with them).

A backend whose record declares ``batch_invariant=False`` has this area skipped, saying so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import numpy as np
import pytest

import normlab
from normlab.constants import FLOAT_DTYPES
from normlab.ops import OPS as TABLE
from normlab.ops import names
from normlab.testing.backward_cases import BACKWARD_OPS
from normlab.testing.bitwise import same_bits
from normlab.testing.cases import OPS, Case, LayoutUnavailable, arrange
from normlab.testing.conversions import dtype_name, numpy_dtype
from normlab.testing.fused_cases import FUSED_OPS
from normlab.testing.subject import Subject

#: Rows of the whole batch each part is compared with.
ROWS: Final = 2048
#: The parts: (first row, number of rows); a row alone at the start, inside and at the end,
#: and batches across the thresholds of threads, blocks and choices by size.
PARTS: Final = (
    (0, 1),
    (ROWS // 2 + 3, 1),
    (ROWS - 1, 1),
    (0, 2),
    (5, 7),
    (0, 64),
    (ROWS - 64, 64),
    (100, 333),
    (0, 1024),
    (ROWS - 1024, 1024),
    (1, ROWS - 1),
)
#: Row lengths: a hidden size, and one that fits no vector width.
COLS: Final = (768, 1000)


def _params(op: str, dtype: str, cols: int) -> tuple[np.ndarray, np.ndarray | None]:
    """weight and bias (None for rms_norm) in x's dtype, as a model holds them."""
    rng = np.random.default_rng(cols)
    weight = rng.standard_normal(cols).astype(numpy_dtype(dtype))
    bias = rng.standard_normal(cols).astype(numpy_dtype(dtype)) if op == "layer_norm" else None
    return weight, bias


def _rows(dtype: str, cols: int, seed: int, rows: int = ROWS) -> np.ndarray:
    """``rows`` rows of each its own mean and spread (the "rowwise" values of the suite)."""
    return Case((rows, cols), dtype, "rowwise", seed=seed).numpy_inputs()[0]


def _results(s: Subject, result: Any) -> list[np.ndarray]:
    """The arrays of an op's result (a tuple, or one array), as NumPy."""
    parts = result if isinstance(result, tuple) else (result,)
    return [s.to_numpy(a) for a in parts if a is not None]


def _assert_rows_equal(
    got: list[np.ndarray], want: list[np.ndarray], rows: slice, names: tuple[str, ...], what: str
) -> None:
    """Each result of a part bitwise the same rows of the whole batch's result."""
    for name, part, whole in zip(names, got, want, strict=True):
        expected = np.ascontiguousarray(whole[rows])
        part = np.ascontiguousarray(part)
        if part.shape != expected.shape or part.tobytes() != expected.tobytes():
            differ = (
                int(np.sum(part.view(np.uint8) != expected.view(np.uint8)))
                if part.shape == expected.shape
                else "all"
            )
            raise AssertionError(
                f"{name} of rows {rows.start}..{rows.stop - 1} {what} differs bitwise from the "
                f"same rows of the whole batch of {ROWS} ({differ} bytes differ)"
            )


def _each_part(
    s: Subject,
    call: Callable[[slice], Any],
    names: tuple[str, ...],
    repro: str,
) -> None:
    """Every part of :data:`PARTS` called alone against the whole batch's call."""
    whole = _results(s, call(slice(0, ROWS)))
    for start, count in PARTS:
        rows = slice(start, start + count)
        try:
            _assert_rows_equal(_results(s, call(rows)), whole, rows, names, "called alone")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{repro}") from None


def _snippet(s: Subject, op: str, dtype: str, cols: int) -> str:
    return (
        "Reproduce with:\n"
        "    import normlab\n"
        "    from normlab.testing.test_batch_invariance import _rows, _params\n"
        f"    x, (weight, bias) = _rows({dtype!r}, {cols}, seed={cols}), "
        f"_params({op!r}, {dtype!r}, {cols})\n"
        f"    whole = normlab.{op}(x, weight=weight, ..., backend={s.backend!r})\n"
        f"    part = normlab.{op}(x[start:stop], ..., backend={s.backend!r})\n"
        "    # part differs bitwise from whole[start:stop]\n"
    )


@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_a_row_alone_and_in_any_batch(s: Subject, op: str, dtype: str, cols: int) -> None:
    """y and the statistics of rows called alone or in batches of 1 … 2047 rows, at the start,
    inside and at the end of the batch, bitwise those of the whole batch of 2048."""
    s.require_op(op)
    s.require_dtype(dtype)
    x = _rows(dtype, cols, seed=cols)
    weight, bias = (None if p is None else s.from_numpy(p) for p in _params(op, dtype, cols))
    kwargs: dict[str, Any] = {"weight": weight, "backend": s.backend, "return_stats": True}
    if op == "layer_norm":
        kwargs["bias"] = bias
    function = getattr(normlab, op)
    _each_part(
        s,
        lambda rows: function(s.from_numpy(x[rows]), **kwargs),
        ("y", *TABLE[op].stats_outputs),
        _snippet(s, op, dtype, cols),
    )


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_a_row_among_other_neighbours(s: Subject, op: str, dtype: str) -> None:
    """A row's y is bitwise the same whatever rows surround it: each row of a batch of 64,
    put among 63 other rows of other values (before and after it), gives its own y."""
    s.require_op(op)
    s.require_dtype(dtype)
    cols = COLS[0]
    x = _rows(dtype, cols, seed=1, rows=64)
    others = _rows(dtype, cols, seed=2, rows=128)
    function = getattr(normlab, op)
    whole = s.to_numpy(function(s.from_numpy(x), backend=s.backend))
    for i in (0, 31, 63):
        mixed = np.concatenate([others[:i], x[i : i + 1], others[i : 63 + i]])
        got = s.to_numpy(function(s.from_numpy(mixed), backend=s.backend))
        assert same_bits(got[i], whole[i]), (
            f"row {i} of a batch gives other bits among other neighbours\n"
            f"{_snippet(s, op, dtype, cols)}"
        )


#: How a batch may be laid out in memory besides C order, and what that takes.
STRIDED: Final = ("sliced", "padded", "transposed")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_strides_out_and_later_calls_give_the_same_rows(s: Subject, op: str, dtype: str) -> None:
    """The whole batch's y, bitwise: x strided (rows sliced, padded, transposed in memory),
    written into ``out=`` (C-ordered and strided), in place, and on the second and third call
    of each layout (the direct route) as on the first."""
    s.require_op(op)
    s.require_dtype(dtype)
    cols = COLS[1]
    x = _rows(dtype, cols, seed=3, rows=300)
    function = getattr(normlab, op)
    want = s.to_numpy(function(s.from_numpy(x), backend=s.backend)).tobytes()
    repro = _snippet(s, op, dtype, cols)

    def same(y: Any, how: str) -> None:
        got = np.ascontiguousarray(s.to_numpy(y)).tobytes()
        assert same_bits(got, want), f"y {how} differs bitwise from the C-ordered call's\n{repro}"

    for call in range(3):
        same(function(s.from_numpy(x), backend=s.backend), f"on call {call + 1}")
    for layout in STRIDED:
        try:
            strided = arrange(x, layout, s)
        except LayoutUnavailable:
            continue
        for call in range(2):
            same(function(strided, backend=s.backend), f"of x {layout}, call {call + 1}")
    if not s.addressable:
        return
    for layout in ("c", "sliced"):
        try:
            out = arrange(np.zeros_like(x), layout, s)
        except LayoutUnavailable:
            continue
        for _call in range(2):
            same(function(s.from_numpy(x), out=out, backend=s.backend), f"into out= {layout}")
    inplace = s.from_numpy(x)
    same(function(inplace, out=inplace, backend=s.backend), "in place")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", list(FUSED_OPS.values()))
def test_fused_rows_alone_and_in_any_batch(s: Subject, op: str, dtype: str) -> None:
    """y, h and the statistics of the fused ops' rows alone or in batches, bitwise those of
    the whole batch."""
    s.require_fused(op)
    s.require_dtype(dtype)
    cols = COLS[0]
    base = "layer_norm" if op == "add_layer_norm" else "rms_norm"
    x = _rows(dtype, cols, seed=4)
    residual = _rows(dtype, cols, seed=5)
    weight, bias = (None if p is None else s.from_numpy(p) for p in _params(base, dtype, cols))
    kwargs: dict[str, Any] = {"weight": weight, "backend": s.backend, "return_stats": True}
    if op == "add_layer_norm":
        kwargs["bias"] = bias
    function = getattr(normlab, op)
    _each_part(
        s,
        lambda rows: function(s.from_numpy(x[rows]), s.from_numpy(residual[rows]), **kwargs),
        ("y", "h", *TABLE[base].stats_outputs),
        _snippet(s, op, dtype, cols),
    )


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_backward_rows_alone_and_in_any_batch(s: Subject, op: str, dtype: str) -> None:
    """dx of rows alone or in batches, bitwise that of the whole batch (mean and rstd from
    the whole batch's forward); dweight and dbias of the whole batch bitwise the same on a
    second call (they sum over rows: run-to-run determinism is their promise)."""
    backward = BACKWARD_OPS[op]
    s.require_op(backward)
    s.require_dtype(dtype)
    cols = COLS[0]
    x = _rows(dtype, cols, seed=6)
    dy = _rows(dtype, cols, seed=7)
    weight, _ = _params(op, dtype, cols)
    stats = _reference_stats(op, x)
    function = getattr(normlab, backward)

    def call(rows: slice, needs: tuple[str, ...] = ("x",)) -> Any:
        parts = [s.from_numpy(a[rows]) for a in (dy, x, *stats)]
        return function(*parts, s.from_numpy(weight), backend=s.backend, needs=needs)

    _each_part(s, lambda rows: call(rows)[0], ("dx",), _snippet(s, backward, dtype, cols))
    every = BACKWARD_NEEDS[backward]
    first, second = ([s.to_numpy(a) for a in call(slice(0, ROWS), every)] for _ in range(2))
    for name, a, b in zip(every, first, second, strict=True):
        assert same_bits(a, b), (
            f"d{name} of the same batch differs bitwise between two calls\n"
            f"{_snippet(s, backward, dtype, cols)}"
        )


#: Every gradient of each backward op.
BACKWARD_NEEDS: Final = {op: TABLE[op].gradients for op in names(direction="backward")}


def _reference_stats(op: str, x: np.ndarray) -> tuple[np.ndarray, ...]:
    """The float64 reference's statistics of x's rows, rounded as a forward returns them."""
    case = Case(x.shape, dtype_name(x), op=op)
    _, mean, rstd = case.expected((x, None, None))
    stats_dtype = np.float64 if x.dtype == np.float64 else np.float32
    kept = (rstd,) if mean is None else (mean, rstd)
    return tuple(a.astype(stats_dtype) for a in kept)


@pytest.fixture
def s(normlab_subject: Subject) -> Subject:
    """The subject, skipped where its record declares that it cannot promise batch invariance."""
    normlab_subject.require_batch_invariance()
    return normlab_subject
