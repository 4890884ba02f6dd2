"""The Numba kernels of the fused residual-add ops ``add_layer_norm`` and ``add_rms_norm``: per
row, ``h = x + residual`` rounded to x's dtype, then LayerNorm (``centre``) or RMSNorm of that
rounded ``h``. The backend functions that call them are in :mod:`normlab.backends.numba_backend`.

A row is processed in this order, which is what lets the outputs be the very memory of the
inputs (``out`` that of x or residual, the ``h`` output that of residual or x, never both the
same): one sweep reads x and residual and writes h, element by element, into a contiguous
compute-dtype scratch row of the thread (and, when h is returned, into the h output); the row's
statistics and y then come from the scratch row alone, by the forward kernels' own row code
(:mod:`normlab.backends.numba_forward`: ``row_moments``, ``write_row``, and ``wide_stats`` /
``write_wide`` for a row whose compute-dtype sums do not hold). So y and the statistics are, bit
for bit, those ``layer_norm_rows`` gives for the rounded h, and h those of the unfused add.

The add: float32 and float64 add in their own dtype; float16 and bfloat16 (bit patterns, as in
the forward kernels) are widened to float32, added, and rounded once to their type, as NumPy
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


def add_row(xr: Any, rr: Any, hr: Any, scratch: Any) -> None:
    """``h = xr + rr`` rounded to xr's element type, as compute-dtype values into ``scratch``
    and, unless ``hr`` is None, as elements into ``hr``. Each element of ``hr`` is written
    after the same element of ``xr`` and ``rr`` is read: ``hr`` may be either's memory.

    A Numba overload (:func:`_add_row_typed`): callable from jitted code only."""
    raise NotImplementedError("add_row is a Numba overload; call it from jitted code")


def h_row(h: Any, i: int) -> Any:
    """Row ``i`` of ``h``, or None when ``h`` is None (h not returned).

    A Numba overload (:func:`_h_row_typed`): callable from jitted code only."""
    raise NotImplementedError("h_row is a Numba overload; call it from jitted code")


@njit(cache=True, error_model="numpy")
def add_exact(a: float, b: float) -> float:
    """``a + b``, rounded once and never reassociated with its neighbours (no fast-math)."""
    return a + b


def _add_kept(xr: Any, rr: Any, hr: Any, scratch: Any) -> None:
    for j in range(xr.shape[0]):
        element = store(add_exact(load(xr[j]), load(rr[j])), xr)
        hr[j] = element
        scratch[j] = load(element)


def _add_dropped(xr: Any, rr: Any, hr: Any, scratch: Any) -> None:
    for j in range(xr.shape[0]):
        scratch[j] = load(store(add_exact(load(xr[j]), load(rr[j])), xr))


def _no_row(h: Any, i: Any) -> Any:
    return None


def _row(h: Any, i: Any) -> Any:
    return h[i]


@overload(add_row)
def _add_row_typed(xr: Any, rr: Any, hr: Any, scratch: Any) -> Any:
    return _add_dropped if isinstance(hr, types.NoneType) else _add_kept


@overload(h_row)
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
    # x, r: 2-D (rows, cols), any strides; elements as in numba_forward's table (same type).
    # y: 2-D like x, to receive y; may be x's or r's memory. h: 2-D like x to receive h (may
    # be r's or x's memory, never y's), or None (h not returned: it lives in the scratch row).
    # w, b, eps, mean, rstd, centre: as in numba_forward.layer_norm_rows.
    # A wide row is written by write_row as an empty span (no branch around it: see
    # layer_norm_rows), then redone from the scratch row, which is all that holds its h.
    cols = x.shape[1]
    scratch = np.empty(cols, w.dtype)
    for i in range(start, stop):
        add_row(x[i], r[i], h_row(h, i), scratch)
        m, m2 = row_moments(scratch, w, centre)
        s = 1.0 / np.sqrt(m2 / cols + eps)  # eps added in float64
        ok = np.isfinite(m2) and np.isfinite(narrow(s, w))
        ok = ok and not underflowed(m2, cols, eps, w)
        k = cols if ok else 0
        write_row(scratch[:k], y[i, :k], w, b, m, s)
        if not ok:
            m, s = _wide_row(scratch, y[i], w, b, eps, centre)
        if mean.shape[0] != 0:
            mean[i] = m
        if rstd.shape[0] != 0:
            rstd[i] = s


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def _wide_row(src: Any, yr: Any, w: Any, b: Any, eps: float, centre: bool) -> tuple[float, float]:
    # y of a wide row from its compute-dtype values src, as numba_forward's _wide_rows writes
    # it; returns the row's (mean, rstd). Not inlined: rare.
    m, s, scale = wide_stats(src, eps, centre)
    write_wide(src, yr, w, b, m, s, scale)
    return m * scale, s / scale


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
    # h = x + r, rounded to x's element type, for rows start..stop-1 (the long rows' add).
    # x, r, h: 2-D like x, any strides; h may be x's or r's memory.
    for i in range(start, stop):
        xr, rr, hr = x[i], r[i], h[i]
        for j in range(xr.shape[0]):
            hr[j] = store(add_exact(load(xr[j]), load(rr[j])), xr)


@njit(parallel=True, error_model="numpy", cache=True)
def add_rows_parallel(x: Any, r: Any, h: Any, chunks: int) -> None:
    # add_rows over all rows in `chunks` parallel ranges.
    rows = x.shape[0]
    for c in prange(chunks):
        add_rows(x, r, h, rows * c // chunks, rows * (c + 1) // chunks)
