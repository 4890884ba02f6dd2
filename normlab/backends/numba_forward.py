"""The Numba forward kernels of LayerNorm and RMSNorm, and the element helpers the backward
kernels (:mod:`normlab.backends.numba_backward`) share: rows in parallel with ``prange``; short
rows read from memory once and swept three times in cache, long rows read twice (segments
merged). The backend functions that call them are in :mod:`normlab.backends.numba_arrays`.

One set of kernels serves both ops: ``centre`` (LayerNorm) subtracts the row mean; without it
(RMSNorm) the mean is 0, and ``rstd = 1 / sqrt(mean(x^2) + eps)``; the bias is zeros.

Element types and what the kernels compute in (the *compute dtype*, also the dtype of the
weight and bias arrays they are given):

=============  =========================  =============
x holds        element type in a kernel   compute dtype
=============  =========================  =============
float64        float64                    float64
float32        float32                    float32
float16        int16 (the bit patterns)   float32
bfloat16       uint16 (the bit patterns)  float32
=============  =========================  =============

Two integer types keep the two half formats apart, so Numba's type dispatch picks the
conversion (:mod:`normlab.backends.half_convert`) at compile time. A row (or, for long rows, a
segment) that is not contiguous compute-dtype data is first copied, converted, into a scratch
array of the thread; so the sums always run over contiguous memory. Row sums are blocked: each
block of :data:`BLOCK` elements is summed in the compute dtype (vectorised, a few terms per SIMD
lane), and block sums are added in float64; the error of a float32 sum stays a few float32
roundoffs, whatever the row length. Statistics and ``rstd`` are float64 scalars.

Every number these kernels read as a global is defined in this file: numba freezes a global's
value into the compiled kernel and keys its on-disk cache on the kernel's own file, so a number
from another file (:mod:`normlab.constants`) must reach a kernel as an argument, or a change to
it would leave stale cached kernels.

Long rows (more than :data:`LONG_ROW_BYTES` of compute dtype) are cut into segments of
:data:`SEGMENT` elements: each segment's (mean, M2) by the shifted two-pass while it is in L1,
merged in segment order with Chan's formula, then y in one more pass: x is read from memory
twice, and the segments of one row are shared out between threads. Never E[x²]-E[x]².

Range: a row whose block sums overflow (float32 values beyond about 1.8e19, float64 beyond
1e154) or, with an eps too small to hide it, underflow (a mean square below the compute dtype's
smallest normal number: float32 values near 1e-20), or whose rstd exceeds float32 (eps = 1e-80
on a constant row), is redone in float64 on its values scaled by a power of two
(``wide_stats``, ``write_wide``): accurate anywhere in the dtype's finite range. Other rows
never pay for it.

Fast-math flags are ``reassoc`` (to vectorise the sums), ``contract`` (FMA) and ``nsz``: none of
them assumes away NaN or Inf. Subtractions that must stay exact as written go through
:func:`sub_exact`, compiled without flags, so that ``(x - mean_hi) - mean_lo`` is never reassociated
into ``x - (mean_hi + mean_lo)``. A row is reduced in a fixed order (segments merged in order on
one thread), so its result does not depend on the other rows or on the number of threads.
"""

from __future__ import annotations

import math
from typing import Any, Final

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from normlab.backends import numba_cache  # noqa: F401  (places the kernels' cache; first)
from normlab.backends.half_convert import (
    bfloat16_to_float32,
    float16_to_float32,
    float32_to_bfloat16,
    float32_to_float16,
)

__all__ = [
    "BLOCK",
    "FASTMATH",
    "LONG_ROW_BYTES",
    "SEGMENT",
    "layer_norm_rows",
    "layer_norm_rows_parallel",
    "load",
    "long_rows_parallel",
    "merge_segments",
    "narrow",
    "row_moments",
    "segment_moments",
    "store",
    "sub_exact",
    "underflowed",
    "wide_stats",
    "write_row",
    "write_segments",
    "write_wide",
]

#: Fast-math flags that keep IEEE NaN and Inf behaviour (no ``nnan``, ``ninf``, ``afn``).
FASTMATH: Final = {"reassoc", "contract", "nsz"}
#: Elements per block of a row sum (summed in the compute dtype, then added in float64). A
#: constant the compiler folds: as an argument it cost 9% on rows of 768 float32.
BLOCK: Final = 256
#: Rows of more compute-dtype bytes than this take the segmented one-pass form
#: (long_rows_parallel): 2^18 float32 or 2^17 float64 elements. Up to it, a row's three
#: sweeps run in a core's L2 (1-2 MiB on current x86 server cores; the row must share it with
#: y), and the three-sweep form is the faster; beyond, its second and third sweeps come from L3
#: or memory. Measured on a 2 MiB-L2 core (one thread, float32, docs/numba.md): even at 2^18
#: elements, 7-13% in favour of the segmented form from 2^19 on, 12-30% in favour of the three
#: sweeps below 2^18.
LONG_ROW_BYTES: Final = 1 << 20
#: The smallest normal float32 and float64: a mean square below it has lost precision.
TINY_FLOAT32: Final = 2.0**-126
TINY_FLOAT64: Final = 2.0**-1022
#: A wide row's values are scaled by 2^k into [1, 2) before squaring, k clamped to this range.
SCALE_LIMIT: Final = 1000
#: Elements per segment of a long row (a multiple of BLOCK): 16 KiB of float32, 32 KiB of
#: float64, so that a segment's second sweep hits L1.
SEGMENT: Final = 4096


def source_row(xr: Any, scratch: Any) -> Any:
    """Row ``xr`` as a contiguous compute-dtype array: ``xr`` itself when it already is one,
    else ``scratch`` (same length, compute dtype) filled with its converted elements.

    A Numba overload (:func:`_source_row_typed`): callable from jitted code only."""
    raise NotImplementedError("source_row is a Numba overload; call it from jitted code")


def load(element: Any) -> Any:
    """An element of x as a compute-dtype value (float16/bfloat16 bits become float32).

    A Numba overload (:func:`_load_typed`): callable from jitted code only."""
    raise NotImplementedError("load is a Numba overload; call it from jitted code")


def store(value: Any, row: Any) -> Any:
    """A compute-dtype value as an element of ``row``'s type (rounded once, ties to even).

    A Numba overload (:func:`_store_typed`): callable from jitted code only."""
    raise NotImplementedError("store is a Numba overload; call it from jitted code")


def narrow(value: Any, like: Any) -> Any:
    """The float64 ``value`` in the dtype of the array ``like`` (the compute dtype).

    A Numba overload (:func:`_narrow_typed`): callable from jitted code only."""
    raise NotImplementedError("narrow is a Numba overload; call it from jitted code")


def underflowed(m2: float, n: int, eps: float, like: Any) -> bool:
    """Whether a row's sum of squares ``m2`` (of ``n`` terms, summed in the dtype of the array
    ``like``) is too small to be accurate in that dtype — the mean square is below its smallest
    normal number — while eps is too small to hide the error.

    A Numba overload (:func:`_underflowed_typed`): callable from jitted code only."""
    raise NotImplementedError("underflowed is a Numba overload; call it from jitted code")


def out_row(x: Any, y: Any, i: int) -> Any:
    """Row ``i`` of ``y``, or of ``x`` when ``y`` is None (in place).

    A Numba overload (:func:`_out_row_typed`): callable from jitted code only."""
    raise NotImplementedError("out_row is a Numba overload; call it from jitted code")


# The implementations of the overloads. Numba requires them to have the very parameter list of
# their typing function, annotations included: hence small named functions annotated ``Any``.


def _row_itself(xr: Any, scratch: Any) -> Any:
    return xr


def _row_gathered(xr: Any, scratch: Any) -> Any:
    for j in range(xr.shape[0]):
        scratch[j] = load(xr[j])
    return scratch


def _load_float16(element: Any) -> Any:
    return float16_to_float32(element)


def _load_bfloat16(element: Any) -> Any:
    return bfloat16_to_float32(element)


def _load_float(element: Any) -> Any:
    return element


def _store_float16(value: Any, row: Any) -> Any:
    return np.int16(float32_to_float16(value))


def _store_bfloat16(value: Any, row: Any) -> Any:
    return float32_to_bfloat16(value)


def _store_float32(value: Any, row: Any) -> Any:
    return np.float32(value)


def _store_float64(value: Any, row: Any) -> Any:
    return np.float64(value)


def _narrow_float32(value: Any, like: Any) -> Any:
    return np.float32(value)


def _narrow_float64(value: Any, like: Any) -> Any:
    return np.float64(value)


def _underflowed_float32(m2: Any, n: Any, eps: Any, like: Any) -> Any:
    return m2 < n * TINY_FLOAT32 and eps < TINY_FLOAT32 * 2.0**24


def _underflowed_float64(m2: Any, n: Any, eps: Any, like: Any) -> Any:
    return m2 < n * TINY_FLOAT64 and eps < TINY_FLOAT64 * 2.0**53


def _row_of_x(x: Any, y: Any, i: Any) -> Any:
    return x[i]


def _row_of_y(x: Any, y: Any, i: Any) -> Any:
    return y[i]


@overload(source_row)
def _source_row_typed(xr: Any, scratch: Any) -> Any:
    if isinstance(xr.dtype, types.Float) and xr.layout == "C":
        return _row_itself
    return _row_gathered  # half bits (decoded once, not in each pass) or a strided row


@overload(load)
def _load_typed(element: Any) -> Any:
    if element == types.int16:
        return _load_float16
    if element == types.uint16:
        return _load_bfloat16
    return _load_float if isinstance(element, types.Float) else None


@overload(store)
def _store_typed(value: Any, row: Any) -> Any:
    return {
        types.int16: _store_float16,
        types.uint16: _store_bfloat16,
        types.float32: _store_float32,
        types.float64: _store_float64,
    }.get(row.dtype)


@overload(narrow)
def _narrow_typed(value: Any, like: Any) -> Any:
    return {types.float32: _narrow_float32, types.float64: _narrow_float64}.get(like.dtype)


@overload(underflowed)
def _underflowed_typed(m2: Any, n: Any, eps: Any, like: Any) -> Any:
    return {types.float32: _underflowed_float32, types.float64: _underflowed_float64}.get(
        like.dtype
    )


@overload(out_row)
def _out_row_typed(x: Any, y: Any, i: Any) -> Any:
    return _row_of_x if isinstance(y, types.NoneType) else _row_of_y


@njit(cache=True, error_model="numpy")
def sub_exact(a: float, b: float) -> float:
    """``a - b``, rounded once and never reassociated with its neighbours (no fast-math)."""
    return a - b


@njit(fastmath=FASTMATH, error_model="numpy", cache=True, inline="always")
def row_moments(src: Any, w: Any, centre: bool) -> tuple[float, float]:
    # Shifted, corrected two-pass moments of a contiguous span, n = len(src) >= 1:
    #   m    = x0 + sum(x - x0) / n      x0 = src[0]: a constant span stays exact (LayerNorm)
    #   d    = x - m                     m split into m_hi + m_lo (compute dtype), so that d is
    #                                    one rounding of x - m wherever x is near m (Sterbenz)
    #   mean = m + sum(d) / n            the correction: sum(x - x0) rounds at the scale of
    #   m2   = sum(d^2) - sum(d)^2 / n   |x0 - mean| (an outlier x0 costs the mean 2e-7 of the
    #                                    row's spread in float32); sum(d) at the row's spread
    #   mean = 0, m2 = sum(x^2)          without centring (RMSNorm)
    # Never E[x²]-E[x]². src: compute dtype, contiguous (see source_row). w: any compute-dtype
    # array (for its dtype). Returns (mean, m2) as float64; m2 is inf or NaN when a float32
    # block sum overflowed.
    n = src.shape[0]
    if not centre:
        m2 = 0.0
        for start in range(0, n, BLOCK):
            block = src[start : start + BLOCK]
            part = narrow(0.0, w)
            for j in range(block.shape[0]):
                part += block[j] * block[j]
            m2 += part
        return 0.0, m2
    x0 = src[0]
    shift = 0.0
    for start in range(0, n, BLOCK):
        block = src[start : start + BLOCK]
        part = narrow(0.0, w)
        for j in range(block.shape[0]):
            part += sub_exact(block[j], x0)
        shift += part
    mean = x0 + shift / n
    mean_hi = narrow(mean, w)
    mean_lo = narrow(mean - mean_hi, w)
    m1 = 0.0
    m2 = 0.0
    for start in range(0, n, BLOCK):
        block = src[start : start + BLOCK]
        part1 = narrow(0.0, w)
        part2 = narrow(0.0, w)
        for j in range(block.shape[0]):
            d = sub_exact(sub_exact(block[j], mean_hi), mean_lo)
            part1 += d
            part2 += d * d
        m1 += part1
        m2 += part2
    correction = m1 / n
    m2 -= m1 * correction
    if m2 < 0.0:  # rounding of a near-constant span (NaN stays NaN)
        m2 = 0.0
    return mean + correction, m2


@njit(fastmath=FASTMATH, error_model="numpy", cache=True, inline="always")
def _wide_moments(xr: Any, inv_scale: float, centre: bool) -> tuple[float, float]:
    # row_moments of a whole row in float64 throughout, of the values x * inv_scale (a power of
    # two: exact), for rows whose compute-dtype sums overflow or underflow. xr: a row of x, any
    # element type and stride.
    n = xr.shape[0]
    mean = 0.0
    if centre:
        x0 = np.float64(load(xr[0])) * inv_scale
        shift = 0.0
        for j in range(n):
            shift += np.float64(load(xr[j])) * inv_scale - x0
        mean = x0 + shift / n
    m2 = 0.0
    for j in range(n):
        d = np.float64(load(xr[j])) * inv_scale - mean
        m2 += d * d
    return mean, m2


@njit(error_model="numpy", cache=True)
def wide_stats(xr: Any, eps: float, centre: bool) -> tuple[float, float, float]:
    # A row's statistics when its compute-dtype ones do not hold (the caller's test, `wide`:
    # m2 is inf or NaN or underflowed, or rstd is beyond the compute dtype), recomputed from xr
    # in float64 on the values scaled by a power of two s (x / s in [1, 2) for the row's
    # largest |x|), so that no square overflows or underflows: returns (mean / s, rstd * s, s),
    # and y = (x / s - mean / s) * (rstd * s) (write_wide) is the same y, even for a row
    # spanning float64's whole range. A NaN or Inf in the row gives NaN (s = 1). eps = 1e-80 on
    # a constant float32 row gives (x - mean) * rstd = 0 * 1e40 = 0, never 0 * inf = NaN; eps =
    # 0 on a constant row gives NaN (0 / 0), as IEEE arithmetic does. Not inlined: rare.
    n = xr.shape[0]
    largest = 0.0
    for j in range(n):
        largest = max(largest, abs(np.float64(load(xr[j]))))
    scale = 1.0
    if np.isfinite(largest) and largest > 0.0:
        exponent = math.frexp(largest)[1] - 1
        scale = math.ldexp(1.0, min(max(exponent, -SCALE_LIMIT), SCALE_LIMIT))
    mean, m2 = _wide_moments(xr, 1.0 / scale, centre)
    scaled_eps = eps / scale / scale
    # where eps / s^2 overflows, eps dwarfs the variance of a tiny row
    finite = np.isfinite(scaled_eps)
    rstd = 1.0 / np.sqrt(m2 / n + scaled_eps) if finite else scale / np.sqrt(eps)
    return mean, rstd, scale


@njit(fastmath=FASTMATH, error_model="numpy", cache=True, inline="always")
def write_row(xr: Any, yr: Any, w: Any, b: Any, mean: float, rstd: float) -> None:
    # y = (x - mean) * rstd * w + b over a span, in the compute dtype, rounded once to y's type.
    # xr: the span of x (any element type, any stride). yr: the span of y to write; may be the
    # memory xr is read from (in place): each element is read before it is written.
    # w, b: the span's weight and bias (compute dtype, contiguous). mean, rstd: float64.
    mean_hi = narrow(mean, w)
    mean_lo = narrow(mean - mean_hi, w)
    scale = narrow(rstd, w)
    for j in range(xr.shape[0]):
        yr[j] = store(sub_exact(sub_exact(load(xr[j]), mean_hi), mean_lo) * scale * w[j] + b[j], yr)


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def write_wide(xr: Any, yr: Any, w: Any, b: Any, mean: float, rstd: float, scale: float) -> None:
    # write_row in float64 on the scaled values, for a span whose row is wide: mean, rstd, scale
    # as wide_stats returns them. y is rounded to the compute dtype and then to y's type.
    # Not inlined: rare.
    inv_scale = 1.0 / scale
    for j in range(xr.shape[0]):
        d = np.float64(load(xr[j])) * inv_scale - mean
        yr[j] = store(narrow(d * rstd * w[j] + b[j], w), yr)


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def _wide_rows(
    x: Any,
    y: Any,
    w: Any,
    b: Any,
    eps: float,
    mean: Any,
    rstd: Any,
    centre: bool,
    start: int,
    wide: Any,
) -> None:
    # Rows start + k for which wide[k] is set (layer_norm_rows left them unwritten, so x is
    # intact even in place): statistics redone by wide_stats, y by write_wide. Other
    # arguments as in layer_norm_rows.
    scratch = np.empty(x.shape[1], w.dtype)
    for k in range(wide.shape[0]):
        if not wide[k]:
            continue
        i = start + k
        src = source_row(x[i], scratch)
        m, r, s = wide_stats(src, eps, centre)
        write_wide(src, out_row(x, y, i), w, b, m, r, s)
        if mean.shape[0] != 0:
            mean[i] = m * s
        if rstd.shape[0] != 0:
            rstd[i] = r / s


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def layer_norm_rows(
    x: Any,
    y: Any,
    w: Any,
    b: Any,
    eps: float,
    mean: Any,
    rstd: Any,
    centre: bool,
    start: int,
    stop: int,
) -> None:
    # LayerNorm (centre) or RMSNorm of rows start..stop-1 of x, on this thread, three sweeps of
    # each row in cache: row_moments (two), then write_row. rstd = 1 / sqrt(m2 / n + eps).
    # x: 2-D (rows, cols), any strides (negative and zero included); elements as in the table.
    # y: 2-D like x (any strides), or None to normalize x in place.
    # w, b: compute dtype, contiguous, length cols (b: zeros for RMSNorm). eps: float64.
    # mean, rstd: 1-D (rows,) float32 or float64 to receive the statistics, or empty (none).
    # A row that is not contiguous compute-dtype data is first copied into one scratch row.
    # A wide row (see wide_stats) is left unwritten here (an empty span, not a branch: a call
    # or a branch around write_row in this loop costs 5-40% per row) and redone by _wide_rows.
    scratch = np.empty(x.shape[1], w.dtype)
    wide = np.empty(max(stop - start, 0), np.bool_)
    any_wide = False
    for i in range(start, stop):
        src = source_row(x[i], scratch)
        m, m2 = row_moments(src, w, centre)
        r = 1.0 / np.sqrt(m2 / src.shape[0] + eps)  # eps added in float64
        ok = np.isfinite(m2) and np.isfinite(narrow(r, w))
        ok = ok and not underflowed(m2, src.shape[0], eps, w)
        wide[i - start] = not ok
        any_wide |= not ok
        k = src.shape[0] if ok else 0
        write_row(src[:k], out_row(x, y, i)[:k], w, b, m, r)
        if mean.shape[0] != 0:
            mean[i] = m
        if rstd.shape[0] != 0:
            rstd[i] = r
    if any_wide:
        _wide_rows(x, y, w, b, eps, mean, rstd, centre, start, wide)


@njit(parallel=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def layer_norm_rows_parallel(
    x: Any, y: Any, w: Any, b: Any, eps: float, mean: Any, rstd: Any, centre: bool, chunks: int
) -> None:
    # layer_norm_rows over all rows, split into `chunks` equal ranges that run in parallel on
    # numba's threads (chunks: the thread count at call time; other arguments as there).
    rows = x.shape[0]
    for c in prange(chunks):
        start, stop = rows * c // chunks, rows * (c + 1) // chunks
        layer_norm_rows(x, y, w, b, eps, mean, rstd, centre, start, stop)


# --------------------------------------------------------------------------------------------
# Long rows: one pass over memory for the statistics, one for y. A row is cut into segments of
# SEGMENT elements; the work items are the segments of all rows (item k: row k // S, segment
# k % S, S segments per row), so that threads share out one long row as well as many.


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def segment_moments(x: Any, w: Any, centre: bool, moments: Any, first: int, last: int) -> None:
    # row_moments of each segment of items first..last-1: moments[row, segment] = (mean, m2).
    # The segment is read from memory once and swept a second time in L1 (16-32 KiB).
    # x: as in layer_norm_rows. moments: (rows, S, 2) float64.
    cols = x.shape[1]
    segments = moments.shape[1]
    scratch = np.empty(min(cols, SEGMENT), w.dtype)
    for k in range(first, last):
        i, s = k // segments, k % segments
        a = s * SEGMENT
        e = min(cols, a + SEGMENT)
        src = source_row(x[i, a:e], scratch[: e - a])
        m, m2 = row_moments(src, w, centre)
        moments[i, s, 0] = m
        moments[i, s, 1] = m2


@njit(error_model="numpy", cache=True)
def merge_segments(
    x: Any,
    w: Any,
    eps: float,
    centre: bool,
    moments: Any,
    stats: Any,
    wide: Any,
    mean: Any,
    rstd: Any,
) -> None:
    # Each row's moments from its segments', merged in segment order (Chan, Golub & LeVeque):
    #   n = na + nb;  delta = mean_b - mean_a
    #   mean = mean_a + delta * nb / n;  m2 = m2_a + m2_b + delta^2 * na * nb / n
    # then rstd (and wide_stats when wide) as in layer_norm_rows, into stats[row] = (mean,
    # rstd) and wide[row]; mean and rstd (1-D, or empty) receive the statistics.
    # No fast-math: the order is the one written, whatever the thread count.
    cols = x.shape[1]
    for i in range(moments.shape[0]):  # x's rows (none: a call that only loads the kernel)
        count = min(cols, SEGMENT)
        m = moments[i, 0, 0]
        m2 = moments[i, 0, 1]
        for s in range(1, moments.shape[1]):
            nb = min(cols - s * SEGMENT, SEGMENT)
            total = count + nb
            delta = moments[i, s, 0] - m
            m = m + delta * (nb / total)
            m2 = m2 + moments[i, s, 1] + delta * delta * (count * (nb / total))
            count = total
        r = 1.0 / np.sqrt(m2 / cols + eps)
        ok = np.isfinite(m2) and np.isfinite(narrow(r, w))
        wide[i] = not (ok and not underflowed(m2, cols, eps, w))
        scale = 1.0
        if wide[i]:
            m, r, scale = wide_stats(x[i], eps, centre)
        stats[i, 0] = m
        stats[i, 1] = r
        stats[i, 2] = scale
        if mean.shape[0] != 0:
            mean[i] = m * scale
        if rstd.shape[0] != 0:
            rstd[i] = r / scale


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def write_segments(
    x: Any, y: Any, w: Any, b: Any, stats: Any, wide: Any, first: int, last: int
) -> None:
    # write_row of each segment of items first..last-1, reading x once more from memory.
    # stats, wide: as merge_segments filled them; w, b: length cols, or (a weight or bias the
    # caller did not give: ones, zeros) length SEGMENT, the same span for every segment; other
    # arguments as in layer_norm_rows.
    cols = x.shape[1]
    segments = -(-cols // SEGMENT)
    for k in range(first, last):
        i, s = k // segments, k % segments
        a = s * SEGMENT
        e = min(cols, a + SEGMENT)
        yr = out_row(x, y, i)
        ws = w[a:e] if w.shape[0] == cols else w[: e - a]
        bs = b[a:e] if b.shape[0] == cols else b[: e - a]
        if wide[i]:
            write_wide(x[i, a:e], yr[a:e], ws, bs, stats[i, 0], stats[i, 1], stats[i, 2])
        else:
            write_row(x[i, a:e], yr[a:e], ws, bs, stats[i, 0], stats[i, 1])


@njit(parallel=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def long_rows_parallel(
    x: Any, y: Any, w: Any, b: Any, eps: float, mean: Any, rstd: Any, centre: bool, chunks: int
) -> None:
    # LayerNorm or RMSNorm of every row of x in the segmented one-pass form (arguments as in
    # layer_norm_rows, but w and b may be SEGMENT long: see write_segments): the segments of all
    # rows split into `chunks` equal ranges of items, for the moments and again for y, in
    # parallel; the merge runs on the calling thread. On one thread the numba backend calls the
    # same three kernels in turn (a fused serial kernel would carry its own copies of them,
    # optimized apart and rounded differently).
    rows, cols = x.shape
    segments = -(-cols // SEGMENT)
    items = rows * segments
    moments = np.empty((rows, segments, 2))
    stats = np.empty((rows, 3))
    wide = np.empty(rows, np.bool_)
    for c in prange(chunks):
        segment_moments(x, w, centre, moments, items * c // chunks, items * (c + 1) // chunks)
    merge_segments(x, w, eps, centre, moments, stats, wide, mean, rstd)
    for c in prange(chunks):
        write_segments(x, y, w, b, stats, wide, items * c // chunks, items * (c + 1) // chunks)
