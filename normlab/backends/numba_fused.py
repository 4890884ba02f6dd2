"""The Numba kernels of the fused residual-add ops ``add_layer_norm`` and ``add_rms_norm``: per
row, ``h = x + residual`` rounded to the residual's dtype (x's; float32 for a float32 residual
stream beside half x), then LayerNorm (``centre``) or RMSNorm of that rounded ``h``. The
backend functions that call them are in :mod:`normlab.backends.numba_arrays`.

A row is processed in this order, which is what lets the outputs be the very memory of the
inputs (``out`` that of x or residual, the ``h`` output that of residual or x, never both the
same): one sweep reads x and residual and writes h, element by element, into the h output
(when h is returned) or else into a contiguous compute-dtype scratch row of the thread; the
row's statistics and y then come from that h alone (for an h row that is not contiguous
compute-dtype data — half bits, strided — the same sweep also puts the rounded h, converted,
into the scratch row), by the forward kernels'
own row code (:mod:`normlab.backends.numba_forward`: ``row_moments``, ``write_row``, and
``wide_stats`` / ``write_wide`` for a row whose compute-dtype sums do not hold). So y and the
statistics are, bit for bit, those ``layer_norm_rows`` gives for the rounded h, and h those of
the unfused add.

The add: float32 and float64 add in their own dtype; float16 and bfloat16 (bit patterns, as in
the forward kernels) are widened to float32, added, and rounded once to the residual's type
(a float32 stream: h is the float32 sum itself, and y that of the unrounded h), as NumPy
(float16), ml_dtypes and torch (bfloat16) add them. It is compiled without fast-math
(:func:`add_exact`), so it is never merged with the sums that follow: y is always that of the
rounded h.

Long rows (more than ``numba_forward.LONG_ROW_BYTES``) are not fused: :func:`add_rows` writes h,
and the backend normalizes it with the forward's segmented kernels.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from normlab.backends.numba_forward import (
    FASTMATH,
    load,
    narrow,
    row_moments,
    source_row,
    store,
    underflowed,
    wide_stats,
    write_row,
    write_wide,
)

__all__ = [
    "add_exact",
    "add_norm_rows",
    "add_norm_rows_parallel",
    "add_rows",
    "add_rows_parallel",
]


def add_row(xr: Any, rr: Any, hr: Any, scratch: Any) -> Any:
    """``h = xr + rr`` rounded to rr's element type (h's), written into ``hr``, or (``hr`` None, h
    not returned) as compute-dtype values into ``scratch``; returns h as a contiguous
    compute-dtype row: ``hr`` itself where it is one (``source_row``), else ``scratch``. Each
    element of ``hr`` is written after the same element of ``xr`` and ``rr`` is read: ``hr``
    may be either's memory.

    A Numba overload (:func:`_add_row_typed`): callable from jitted code only."""
    raise NotImplementedError("add_row is a Numba overload; call it from jitted code")


def h_source(x: Any, r: Any, h: Any, i: int, scratch: Any) -> Any:
    """Row ``i`` of h, already computed, as a contiguous compute-dtype row: read from ``h``
    (``source_row``), or, ``h`` None, added again from x and r into ``scratch``.

    A Numba overload (:func:`_h_source_typed`): callable from jitted code only."""
    raise NotImplementedError("h_source is a Numba overload; call it from jitted code")


def h_row(h: Any, i: int) -> Any:
    """Row ``i`` of ``h``, or None when ``h`` is None (h not returned).

    A Numba overload (:func:`_h_row_typed`): callable from jitted code only."""
    raise NotImplementedError("h_row is a Numba overload; call it from jitted code")


@njit(cache=True, error_model="numpy")
def add_exact(a: float, b: float) -> float:
    """``a + b``, rounded once and never reassociated with its neighbours (no fast-math)."""
    return a + b


def _add_kept(xr: Any, rr: Any, hr: Any, scratch: Any) -> Any:
    # h stored once, into hr, then read back (from L1) as the row's source: storing it into
    # scratch as well cost 25% on rows of 768 float32
    for j in range(xr.shape[0]):
        hr[j] = store(add_exact(load(xr[j]), load(rr[j])), rr)
    return source_row(hr, scratch)


def _add_kept_gathered(xr: Any, rr: Any, hr: Any, scratch: Any) -> Any:
    # an hr row that is not contiguous compute-dtype data (half bits, strided): its source row
    # is gathered into scratch in the same sweep, from the rounded value just stored (a second
    # sweep converting hr back cost about a tenth of a float16 call)
    for j in range(xr.shape[0]):
        rounded = store(add_exact(load(xr[j]), load(rr[j])), rr)
        hr[j] = rounded
        scratch[j] = load(rounded)
    return scratch


def _add_dropped(xr: Any, rr: Any, hr: Any, scratch: Any) -> Any:
    for j in range(xr.shape[0]):
        scratch[j] = load(store(add_exact(load(xr[j]), load(rr[j])), rr))
    return scratch


def _no_row(h: Any, i: Any) -> Any:
    return None


def _row(h: Any, i: Any) -> Any:
    return h[i]


@overload(add_row, inline="always")
def _add_row_typed(xr: Any, rr: Any, hr: Any, scratch: Any) -> Any:
    if isinstance(hr, types.NoneType):
        return _add_dropped
    if isinstance(hr.dtype, types.Float) and hr.layout == "C":  # source_row: hr itself
        return _add_kept
    return _add_kept_gathered


def _h_added(x: Any, r: Any, h: Any, i: Any, scratch: Any) -> Any:
    return add_row(x[i], r[i], None, scratch)


def _h_read(x: Any, r: Any, h: Any, i: Any, scratch: Any) -> Any:
    return source_row(h[i], scratch)


@overload(h_source)
def _h_source_typed(x: Any, r: Any, h: Any, i: Any, scratch: Any) -> Any:
    return _h_added if isinstance(h, types.NoneType) else _h_read


@overload(h_row, inline="always")
def _h_row_typed(h: Any, i: Any) -> Any:
    return _no_row if isinstance(h, types.NoneType) else _row


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def add_norm_rows(
    x: Any,
    r: Any,
    y: Any,
    h: Any,
    w: Any,
    b: Any,
    eps: float,
    mean: Any,
    rstd: Any,
    centre: bool,
    start: int,
    stop: int,
) -> None:
    # Fused add + LayerNorm (centre) or RMSNorm of rows start..stop-1, on this thread.
    # x, r: 2-D (rows, cols), any strides; elements as in numba_forward's table (r of x's
    # type, or float32 beside half x: a float32 stream). y: 2-D like x, to receive y; may be
    # x's or r's memory. h: 2-D like r to receive h (may be r's or x's memory, never y's), or
    # None (h not returned: it lives in the scratch row).
    # w, b, eps, mean, rstd, centre: as in numba_forward.layer_norm_rows.
    # A wide row is left unwritten, as layer_norm_rows leaves it (an empty span, not a branch:
    # a branch in this loop cost 11% on rows of 768 float32), and redone by _wide_add_rows.
    cols = x.shape[1]
    scratch = np.empty(cols, w.dtype)
    wide = np.empty(max(stop - start, 0), np.bool_)
    any_wide = False
    for i in range(start, stop):
        src = add_row(x[i], r[i], h_row(h, i), scratch)
        m, m2 = row_moments(src, w, centre)
        s = 1.0 / np.sqrt(m2 / cols + eps)  # eps added in float64
        ok = np.isfinite(m2) and np.isfinite(narrow(s, w))
        ok = ok and not underflowed(m2, cols, eps, w)
        wide[i - start] = not ok
        any_wide |= not ok
        k = cols if ok else 0
        write_row(src[:k], y[i, :k], w, b, m, s)
        if mean.shape[0] != 0:
            mean[i] = m
        if rstd.shape[0] != 0:
            rstd[i] = s
    if any_wide:
        _wide_add_rows(x, r, y, h, w, b, eps, mean, rstd, centre, start, wide)


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def _wide_add_rows(
    x: Any,
    r: Any,
    y: Any,
    h: Any,
    w: Any,
    b: Any,
    eps: float,
    mean: Any,
    rstd: Any,
    centre: bool,
    start: int,
    wide: Any,
) -> None:
    # Rows start + k for which wide[k] is set, as numba_forward's _wide_rows redoes them: their
    # y was left unwritten, so h is still in h's row, or (h not returned) x and r are intact
    # and h is added again. Other arguments as in add_norm_rows. Not inlined: rare.
    scratch = np.empty(x.shape[1], w.dtype)
    for k in range(wide.shape[0]):
        if not wide[k]:
            continue
        i = start + k
        src = h_source(x, r, h, i, scratch)
        m, s, scale = wide_stats(src, eps, centre)
        write_wide(src, y[i], w, b, m, s, scale)
        if mean.shape[0] != 0:
            mean[i] = m * scale
        if rstd.shape[0] != 0:
            rstd[i] = s / scale


@njit(parallel=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def add_norm_rows_parallel(
    x: Any,
    r: Any,
    y: Any,
    h: Any,
    w: Any,
    b: Any,
    eps: float,
    mean: Any,
    rstd: Any,
    centre: bool,
    chunks: int,
) -> None:
    # add_norm_rows over all rows, split into `chunks` equal ranges that run in parallel on
    # numba's threads (chunks: the thread count at call time; other arguments as there).
    rows = x.shape[0]
    for c in prange(chunks):
        start, stop = rows * c // chunks, rows * (c + 1) // chunks
        add_norm_rows(x, r, y, h, w, b, eps, mean, rstd, centre, start, stop)


@njit(error_model="numpy", cache=True)
def add_rows(x: Any, r: Any, h: Any, start: int, stop: int) -> None:
    # h = x + r, rounded to r's element type, for rows start..stop-1 (the long rows' add).
    # x, r, h: 2-D, any strides, r and h of one type (x's, or float32 beside half x: a float32
    # stream); h may be x's or r's memory.
    for i in range(start, stop):
        xr, rr, hr = x[i], r[i], h[i]
        for j in range(xr.shape[0]):
            hr[j] = store(add_exact(load(xr[j]), load(rr[j])), rr)


@njit(parallel=True, error_model="numpy", cache=True)
def add_rows_parallel(x: Any, r: Any, h: Any, chunks: int) -> None:
    # add_rows over all rows in `chunks` parallel ranges.
    rows = x.shape[0]
    for c in prange(chunks):
        add_rows(x, r, h, rows * c // chunks, rows * (c + 1) // chunks)
