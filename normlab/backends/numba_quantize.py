"""The Numba kernels of quantized outputs (:mod:`normlab.quantize`): each row's y in float32,
its scale and q, with y never in memory.

A row (short rows: at most ``numba_forward.LONG_ROW_BYTES`` of compute dtype) is read once:
its statistics by the forward kernels' own row code (``row_moments``; ``wide_stats`` for a row
whose compute-dtype sums do not hold), y written by ``write_row``/``write_wide`` into a float32
scratch row of the thread (so y is, bit for bit, what ``layer_norm_rows`` writes into a float32
y), then the row's largest magnitude and q from that scratch row, in cache. The fused ops add
h first, as :mod:`normlab.backends.numba_fused` does (``add_row``). Long rows take the
forward's segmented kernels for a float32 y and :func:`quantize_rows` after them.

The quantizer: ``s`` = the static scale or ``max|y| / limit`` (float32 division; a NaN in the
row makes it NaN), ``v = y / s`` (float32 division, 0 where ``s`` is 0); int8:
``clip(rint(v), ±127)``, NaN to 0; float8 e4m3fn: ``clip(v, ±448)`` rounded to nearest even
from its float32 bits (:func:`e4m3_from_bits`). Division and rounding are not affected by the
fast-math flags used (``reassoc``, ``contract``, ``nsz``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

from normlab.backends.numba_forward import (
    FASTMATH,
    load,
    narrow,
    row_moments,
    source_row,
    underflowed,
    wide_stats,
    write_row,
    write_wide,
)
from normlab.backends.numba_fused import add_row, h_row

__all__ = [
    "add_norm_quantize_rows",
    "add_norm_quantize_rows_parallel",
    "e4m3_from_bits",
    "norm_quantize_rows",
    "norm_quantize_rows_parallel",
    "norm_row_float32",
    "quantize_rows",
    "quantize_rows_parallel",
]


@njit(error_model="numpy", cache=True, inline="always")
def e4m3_from_bits(v: Any, u: Any) -> Any:
    """The float8 e4m3fn bits (uint8) of the float32 ``v`` (within ±448, or NaN) whose bits are
    ``u`` (uint32), rounded to nearest even."""
    sign = (u >> np.uint32(24)) & np.uint32(0x80)
    a = u & np.uint32(0x7FFFFFFF)
    if a > np.uint32(0x7F800000):  # NaN
        return np.uint8(sign | np.uint32(0x7F))
    if a >= np.uint32(121 << 23):  # e4m3's normal range (from 2**-6): keep 3 mantissa bits
        kept = (a + np.uint32(0x7FFFF) + ((a >> np.uint32(20)) & np.uint32(1))) >> np.uint32(20)
        return np.uint8(sign | (kept - np.uint32(120 << 3)))
    # subnormal: units of 2**-9, exact in float32 (8 units: the smallest normal, bits 8 too)
    return np.uint8(sign | np.uint32(np.rint(abs(v) * np.float32(512.0))))


@njit(fastmath=FASTMATH, error_model="numpy", cache=True, inline="always")
def quantize_row(y: Any, q: Any, static: float, limit: float, fp8: bool) -> Any:
    """q of one float32 row ``y`` (contiguous; overwritten by v for fp8) and its scale
    (returned, float32): the static scale when ``static`` > 0, else ``max|y| / limit``."""
    if static > 0.0:
        s = np.float32(static)
    else:
        amax = np.float32(0.0)
        for j in range(y.shape[0]):
            a = abs(y[j])
            if a > amax or a != a:
                amax = a
            if amax != amax:
                break
        s = amax / np.float32(limit)
    if fp8:
        for j in range(y.shape[0]):
            v = y[j] / s if s != 0.0 else np.float32(0.0)
            y[j] = min(max(v, np.float32(-448.0)), np.float32(448.0)) if v == v else v
        bits = y.view(np.uint32)
        for j in range(y.shape[0]):
            q[j] = e4m3_from_bits(y[j], bits[j])
    else:
        for j in range(y.shape[0]):
            v = np.rint(y[j] / s) if s != 0.0 else np.float32(0.0)
            v = min(max(v, np.float32(-127.0)), np.float32(127.0)) if v == v else np.float32(0.0)
            q[j] = np.int8(v)
    return s


@njit(fastmath=FASTMATH, error_model="numpy", cache=True, inline="always")
def norm_row_float32(src: Any, y: Any, w: Any, b: Any, eps: float, centre: bool) -> None:
    """y (a float32 row) of the contiguous compute-dtype row ``src``, as ``layer_norm_rows``
    writes it: ``write_row``, or for a wide row ``wide_stats`` and ``write_wide``."""
    n = src.shape[0]
    m, m2 = row_moments(src, w, centre)
    r = 1.0 / np.sqrt(m2 / n + eps)  # eps added in float64
    ok = np.isfinite(m2) and np.isfinite(narrow(r, w)) and not underflowed(m2, n, eps, w)
    if ok:
        write_row(src, y, w, b, m, r)
    else:
        wm, wr, ws = wide_stats(src, eps, centre)
        write_wide(src, y, w, b, wm, wr, ws)


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def norm_quantize_rows(
    x: Any,
    q: Any,
    scale: Any,
    w: Any,
    b: Any,
    eps: float,
    centre: bool,
    static: float,
    limit: float,
    fp8: bool,
    start: int,
    stop: int,
) -> None:
    # LayerNorm (centre) or RMSNorm of rows start..stop-1 of x, quantized: q[i] and scale[i].
    # x: 2-D (rows, cols), elements as in numba_forward's table; q: 2-D int8, or uint8 (e4m3fn
    # bits) with fp8; scale: 1-D float32; w, b, eps: as in numba_forward.layer_norm_rows;
    # static: the static scale, or 0 (dynamic: max|y| / limit).
    scratch = np.empty(x.shape[1], w.dtype)
    y = np.empty(x.shape[1], np.float32)
    for i in range(start, stop):
        norm_row_float32(source_row(x[i], scratch), y, w, b, eps, centre)
        scale[i] = quantize_row(y, q[i], static, limit, fp8)


@njit(parallel=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def norm_quantize_rows_parallel(
    x: Any,
    q: Any,
    scale: Any,
    w: Any,
    b: Any,
    eps: float,
    centre: bool,
    static: float,
    limit: float,
    fp8: bool,
    chunks: int,
) -> None:
    # norm_quantize_rows over all rows in `chunks` equal ranges run in parallel.
    rows = x.shape[0]
    for c in prange(chunks):
        start, stop = rows * c // chunks, rows * (c + 1) // chunks
        norm_quantize_rows(x, q, scale, w, b, eps, centre, static, limit, fp8, start, stop)


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def add_norm_quantize_rows(
    x: Any,
    r: Any,
    h: Any,
    q: Any,
    scale: Any,
    w: Any,
    b: Any,
    eps: float,
    centre: bool,
    static: float,
    limit: float,
    fp8: bool,
    start: int,
    stop: int,
) -> None:
    # The fused ops quantized: h = x + r as numba_fused.add_norm_rows adds it (into h's row, or
    # h None: a scratch row), then norm_quantize_rows's work on that h. x, r, h as in
    # add_norm_rows; the other arguments as in norm_quantize_rows.
    scratch = np.empty(x.shape[1], w.dtype)
    y = np.empty(x.shape[1], np.float32)
    for i in range(start, stop):
        src = add_row(x[i], r[i], h_row(h, i), scratch)
        norm_row_float32(src, y, w, b, eps, centre)
        scale[i] = quantize_row(y, q[i], static, limit, fp8)


@njit(parallel=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def add_norm_quantize_rows_parallel(
    x: Any,
    r: Any,
    h: Any,
    q: Any,
    scale: Any,
    w: Any,
    b: Any,
    eps: float,
    centre: bool,
    static: float,
    limit: float,
    fp8: bool,
    chunks: int,
) -> None:
    # add_norm_quantize_rows over all rows in `chunks` equal ranges run in parallel.
    rows = x.shape[0]
    for c in prange(chunks):
        start, stop = rows * c // chunks, rows * (c + 1) // chunks
        add_norm_quantize_rows(
            x, r, h, q, scale, w, b, eps, centre, static, limit, fp8, start, stop
        )


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def quantize_rows(
    y: Any, q: Any, scale: Any, static: float, limit: float, fp8: bool, start: int, stop: int
) -> None:
    # q and scale of rows start..stop-1 of a y already in memory (2-D, any strides, elements as
    # in numba_forward's table: long rows' float32 y after the segmented forward kernels, or
    # the unfused pair of the benchmarks, whose y is in x's dtype). Each row is read into a
    # float32 scratch row first (converted; float64 rounded): y is left as it was.
    row = np.empty(y.shape[1], np.float32)
    for i in range(start, stop):
        yi = y[i]
        for j in range(row.shape[0]):
            row[j] = load(yi[j])
        scale[i] = quantize_row(row, q[i], static, limit, fp8)


@njit(parallel=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def quantize_rows_parallel(
    y: Any, q: Any, scale: Any, static: float, limit: float, fp8: bool, chunks: int
) -> None:
    # quantize_rows over all rows in `chunks` equal ranges run in parallel.
    rows = y.shape[0]
    for c in prange(chunks):
        quantize_rows(y, q, scale, static, limit, fp8, rows * c // chunks, rows * (c + 1) // chunks)
