"""The Numba backward kernels of LayerNorm and RMSNorm (the backend functions that call them:
:mod:`normlab.backends.numba_arrays`).

Per row (see :mod:`normlab.hookspecs`)::

    x̂  = (x - mean - res) * rstd      res = mean(x - mean): the residual of a rounded mean
    g  = dy * w
    dx = rstd * (g - mean(g) - x̂ * mean(g * x̂))
    dweight, dbias = Σ_rows dy * x̂, Σ_rows dy

RMSNorm is the same kernel with ``mean = res = 0`` and without the ``mean(g)`` term. Elements are
read and written as in :mod:`normlab.backends.numba_forward` (float16/bfloat16 as bit patterns,
computed in float32), whose ``load``/``store``/``narrow`` helpers these kernels use: a row of x
or dy that is not contiguous compute-dtype data (half bits, strided) is decoded once, during the
first sweep, into a scratch row of the thread, which the second sweep reads; dx is rounded once
as it is written. Row sums are blocked as in the forward (compute dtype within a block of
:data:`BLOCK` elements, float64 across blocks). Without weight the kernels are compiled without the
multiply (``w`` is None), so no row of ones is made.

dweight and dbias are reduced without atomics or locks: the rows are cut into chunks of ``chunk``
rows (:data:`~normlab.constants.ROW_CHUNK`); each chunk's column sums of ``dy * x̂`` and ``dy`` (in
the compute dtype: at most ``chunk`` terms each) go to its own row of a partial-sums array, and the
chunks are added in chunk order, in float64, at the end. Threads take whole chunks, so the result
does not depend on the number of threads, bit for bit. ``chunk`` is an argument, never a global (see
:mod:`normlab.backends.numba_forward`: numba would freeze it into its cache). The entry points
are in :mod:`normlab.backends.numba_backend` (NumPy arrays: :mod:`~normlab.backends.numba_arrays`;
CPU tensors, through NumPy views: :mod:`~normlab.backends.numba_tensors`).
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from normlab.backends.numba_forward import FASTMATH, load, narrow, store, sub_exact

#: Elements per block of a row sum (compute dtype within, float64 across blocks). This module's
#: own constant, not the forward's: numba would freeze another file's value into these kernels'
#: cache (see :mod:`normlab.backends.numba_forward`).
BLOCK: Final = 256
#: Elements per tile of a row's second sweep: dx, then the tile's partial sums while its x and
#: dy are still in L1.
TILE: Final = 1024

__all__ = [
    "BLOCK",
    "TILE",
    "backward_chunks",
    "backward_chunks_parallel",
    "sum_chunks",
]


def weight_span(w: Any, start: int, stop: int) -> Any:
    """``w[start:stop]``, or None when ``w`` is None (no weight).

    A Numba overload (:func:`_weight_span_typed`): callable from jitted code only."""
    raise NotImplementedError("weight_span is a Numba overload; call it from jitted code")


def weighted(value: Any, w: Any, j: int) -> Any:
    """``value * w[j]``, or ``value`` itself when ``w`` is None (no weight: no multiply).

    A Numba overload (:func:`_weighted_typed`): callable from jitted code only."""
    raise NotImplementedError("weighted is a Numba overload; call it from jitted code")


def _span_of(w: Any, start: Any, stop: Any) -> Any:
    return w[start:stop]


def _no_span(w: Any, start: Any, stop: Any) -> Any:
    return None


def _times_weight(value: Any, w: Any, j: Any) -> Any:
    return value * w[j]


def _unweighted(value: Any, w: Any, j: Any) -> Any:
    return value


def kept_row(row: Any, scratch: Any) -> Any:
    """``row`` itself when it is contiguous compute-dtype data, else ``scratch``: the row
    decoded by :func:`keep` during the first sweep.

    A Numba overload (:func:`_kept_row_typed`): callable from jitted code only."""
    raise NotImplementedError("kept_row is a Numba overload; call it from jitted code")


def keep(scratch: Any, j: int, value: Any, row: Any) -> None:
    """``scratch[j] = value`` (an element of ``row``, decoded), unless ``row`` is read where it
    is (contiguous compute-dtype data): then nothing.

    A Numba overload (:func:`_keep_typed`): callable from jitted code only."""
    raise NotImplementedError("keep is a Numba overload; call it from jitted code")


def _the_row(row: Any, scratch: Any) -> Any:
    return row


def _the_scratch(row: Any, scratch: Any) -> Any:
    return scratch


def _keep_value(scratch: Any, j: Any, value: Any, row: Any) -> None:
    scratch[j] = value


def _keep_nothing(scratch: Any, j: Any, value: Any, row: Any) -> None:
    return None


def _read_in_place(row: Any) -> bool:
    """Whether the kernels read ``row`` (a Numba array type) where it is."""
    return isinstance(row.dtype, types.Float) and row.layout == "C"


@overload(kept_row)
def _kept_row_typed(row: Any, scratch: Any) -> Any:
    return _the_row if _read_in_place(row) else _the_scratch


@overload(keep)
def _keep_typed(scratch: Any, j: Any, value: Any, row: Any) -> Any:
    return _keep_nothing if _read_in_place(row) else _keep_value


@overload(weight_span)
def _weight_span_typed(w: Any, start: Any, stop: Any) -> Any:
    return _no_span if isinstance(w, types.NoneType) else _span_of


@overload(weighted)
def _weighted_typed(value: Any, w: Any, j: Any) -> Any:
    return _unweighted if isinstance(w, types.NoneType) else _times_weight


@njit(fastmath=FASTMATH, error_model="numpy", cache=True, inline="always")
def _backward_row(
    dyr: Any,
    xr: Any,
    dys: Any,
    xs: Any,
    m: float,
    r: float,
    w: Any,
    dxr: Any,
    pw: Any,
    pb: Any,
    centre: bool,
) -> None:
    # One row (formula in the module docstring), n = len(xr):
    #   pass 1: d = x - m, g = dy * w; sums of d, g and g * d (blocked, float64 across blocks);
    #           a row of x or dy that is not contiguous compute-dtype data is decoded on the way
    #           into xs or dys (see keep), which the next pass reads instead
    #   res = sum(d) / n; mean(g * x̂) = rstd * (sum(g * d) - res * sum(g)) / n
    #   pass 2, tile by tile (TILE elements): x̂ = (d - res) * rstd;
    #           dx = rstd * (g - mean(g) - x̂ * mean(g * x̂)); then pw += dy * x̂, pb += dy
    # (Two loops per tile, the second reading x and dy from L1: LLVM vectorises a loop only when
    # it can check cheaply at run time that its arrays do not overlap, which a loop writing dx,
    # pw and pb besides three inputs exceeds.)
    # dyr, xr: one row of dy and x (elements as in numba_forward; any stride).
    # dys, xs: scratch rows (compute dtype, length n) of the thread.
    # m, r: the row's mean (0 for RMSNorm) and rstd, float64. w: weight, compute dtype, length
    # n, or None (no weight: g = dy). dxr: the row of dx to write (x's element type).
    # pw, pb: this chunk's partial sums of dweight and dbias (compute dtype, length n).
    # centre: LayerNorm (else RMSNorm).
    # Loops index from 0 (slices for the blocks): a start that may be negative would stop Numba's
    # index wraparound from being proved away, and the loop from vectorising.
    n = xr.shape[0]
    mc = narrow(m, pw)
    sum_d = 0.0
    sum_g = 0.0
    sum_gd = 0.0
    for start in range(0, n, BLOCK):
        xb = xr[start : start + BLOCK]
        dyb = dyr[start : start + BLOCK]
        xsb = xs[start : start + BLOCK]
        dysb = dys[start : start + BLOCK]
        wb = weight_span(w, start, start + BLOCK)
        part_d = narrow(0.0, pw)
        part_g = narrow(0.0, pw)
        part_gd = narrow(0.0, pw)
        for j in range(xb.shape[0]):
            xv = load(xb[j])
            dyv = load(dyb[j])
            keep(xsb, j, xv, xr)
            keep(dysb, j, dyv, dyr)
            d = sub_exact(xv, mc)
            g = weighted(dyv, wb, j)
            part_d += d
            part_g += g
            part_gd += g * d
        sum_d += part_d
        sum_g += part_g
        sum_gd += part_gd
    res = sum_d / n if centre else 0.0
    mean_g = sum_g / n if centre else 0.0
    mean_gx = r * (sum_gd - res * sum_g) / n
    rc = narrow(r, pw)
    resc = narrow(res, pw)
    mean_gc = narrow(mean_g, pw)
    mean_gxc = narrow(mean_gx, pw)
    xc = kept_row(xr, xs)
    dyc = kept_row(dyr, dys)
    for start in range(0, n, TILE):
        xt = xc[start : start + TILE]
        dyt = dyc[start : start + TILE]
        wt = weight_span(w, start, start + TILE)
        dxt = dxr[start : start + TILE]
        for j in range(xt.shape[0]):
            xhat = sub_exact(sub_exact(xt[j], mc), resc) * rc
            dxt[j] = store(rc * (weighted(dyt[j], wt, j) - mean_gc - xhat * mean_gxc), dxt)
        pwt = pw[start : start + TILE]
        pbt = pb[start : start + TILE]
        for j in range(xt.shape[0]):
            pwt[j] += dyt[j] * (sub_exact(sub_exact(xt[j], mc), resc) * rc)
            pbt[j] += dyt[j]


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def backward_chunks(
    dy: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    w: Any,
    dx: Any,
    dw_parts: Any,
    db_parts: Any,
    chunk: int,
    first: int,
    last: int,
) -> None:
    # The backward of chunks first..last-1 (rows c*chunk .. (c+1)*chunk-1 of chunk c), on this
    # thread. dy, x: 2-D (rows, cols), any strides, elements as in numba_forward; a row that is
    # not contiguous compute-dtype data (float16/bfloat16 bits, strided) is decoded into a
    # scratch row of the thread during its first sweep (_backward_row). mean: 1-D (rows,)
    # float32/float64, or empty for RMSNorm. rstd: 1-D (rows,). w: compute dtype, contiguous,
    # length cols, or None (no weight). dx: 2-D like x to write, or None.
    # dw_parts, db_parts: (chunks, cols), compute dtype; row c receives chunk c's column sums
    # (summed in two scratch rows of the thread, which the compiler knows overlap nothing).
    # chunk: rows per chunk (normlab.constants.ROW_CHUNK, an argument: see the module docstring).
    rows, cols = x.shape
    centre = mean.shape[0] != 0
    x_scratch = np.empty(cols, rstd.dtype)
    dy_scratch = np.empty(cols, rstd.dtype)
    pw = np.empty(cols, rstd.dtype)
    pb = np.empty(cols, rstd.dtype)
    # Without dx, each row's dx still goes somewhere: a scratch row like dx's rows, so the row
    # code is the very code of the full call and dweight the same bits (with the dx terms dead,
    # LLVM compiled the row sums' fast-math loop differently; an AMD EPYC gave another
    # dweight in up to a third of its elements).
    dx_scratch = np.empty(cols, x.dtype)
    for c in range(first, last):
        pw[:] = 0
        pb[:] = 0
        for i in range(c * chunk, min(rows, (c + 1) * chunk)):
            m = mean[i] if centre else 0.0
            if dx is None:  # resolved when compiling: one call or the other
                _backward_row(
                    dy[i], x[i], dy_scratch, x_scratch, m, rstd[i], w, dx_scratch, pw, pb, centre
                )
            else:
                _backward_row(
                    dy[i], x[i], dy_scratch, x_scratch, m, rstd[i], w, dx[i], pw, pb, centre
                )
        for j in range(cols):  # not dw_parts[c] = pw: its shape check compiles string code
            dw_parts[c, j] = pw[j]
            db_parts[c, j] = pb[j]


@njit(parallel=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def backward_chunks_parallel(
    dy: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    w: Any,
    dx: Any,
    dw_parts: Any,
    db_parts: Any,
    chunk: int,
    threads: int,
) -> None:
    # backward_chunks over every chunk, the chunks split into `threads` equal ranges that run in
    # parallel (threads: numba.get_num_threads() at call time; other arguments as there).
    chunks = dw_parts.shape[0]
    for t in prange(threads):
        backward_chunks(
            dy, x, mean, rstd, w, dx, dw_parts, db_parts, chunk,
            chunks * t // threads, chunks * (t + 1) // threads,
        )  # fmt: skip


@njit(error_model="numpy", cache=True)
def sum_chunks(parts: Any, out: Any) -> None:
    # out[j] = the sum of parts[c, j] over c, added in chunk order (no fast-math: the order is
    # the one written), rounded once to out's dtype.
    # parts: (chunks, cols), compute dtype; added in float64. out: (cols,) compute dtype.
    total = np.zeros(parts.shape[1])
    for c in range(parts.shape[0]):
        for j in range(parts.shape[1]):
            total[j] += np.float64(parts[c, j])
    for j in range(parts.shape[1]):
        out[j] = total[j]
