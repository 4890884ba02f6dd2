"""The Numba LayerNorm kernels: each row read from memory once and swept three times in cache,
rows in parallel with ``prange``.

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
conversion (:mod:`normlab.backends.half_bits`) at compile time. A row that is not contiguous
compute-dtype data (half bits, or any stride but one element) is first copied, converted, into
a scratch row of the thread; so the sweeps always run over contiguous memory, and a half value
is converted once each way. Row sums are blocked: each block of :data:`BLOCK` elements is summed
in the compute dtype (vectorised, a few terms per SIMD lane), and block sums are added in
float64; the error of a float32 sum stays a few float32 roundoffs, whatever the row length.
Statistics and ``rstd`` are float64 scalars.

Fast-math flags are ``reassoc`` (to vectorise the sums), ``contract`` (FMA) and ``nsz``: none of
them assumes away NaN or Inf. Subtractions that must stay exact as written go through
:func:`_sub`, compiled without flags, so that ``(x - mean_hi) - mean_lo`` is never reassociated
into ``x - (mean_hi + mean_lo)``. A row is reduced by one thread in a fixed order, so its result
does not depend on the other rows or on the number of threads.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from normlab.backends.half_bits import (
    bfloat16_to_float32,
    float16_to_float32,
    float32_to_bfloat16,
    float32_to_float16,
)

__all__ = ["BLOCK", "FASTMATH", "layer_norm_rows", "layer_norm_rows_parallel"]

#: Fast-math flags that keep IEEE NaN and Inf behaviour (no ``nnan``, ``ninf``, ``afn``).
FASTMATH: Final = {"reassoc", "contract", "nsz"}
#: Elements per block of a row sum (summed in the compute dtype, then added in float64).
BLOCK: Final = 256


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


@overload(out_row)
def _out_row_typed(x: Any, y: Any, i: Any) -> Any:
    return _row_of_x if isinstance(y, types.NoneType) else _row_of_y


@njit(cache=True, error_model="numpy")
def _sub(a: float, b: float) -> float:
    """``a - b``, rounded once and never reassociated with its neighbours (no fast-math)."""
    return a - b


@njit(fastmath=FASTMATH, error_model="numpy", cache=True, inline="always")
def _normalize_row(src: Any, yr: Any, w: Any, b: Any, eps: float) -> tuple[float, float]:
    # Shifted two-pass LayerNorm of one row, n = len(src):
    #   mean = x0 + sum(x - x0) / n                      x0 = src[0]: constant rows stay exact
    #   var  = sum((x - mean)^2) / n                     population variance, never E[x²]-E[x]²
    #   rstd = 1 / sqrt(var + eps)                       eps added in float64
    #   y    = (x - mean) * rstd * w + b                 rounded once to y's element type
    # mean is split into mean_hi + mean_lo (compute dtype) so that x - mean is accurate in float32.
    # src: the row of x, contiguous, in the compute dtype (see source_row).
    # yr: the row of y to write (elements as in the module table; any stride); may be the memory
    #     src was read from (in place): each element is read before it is written.
    # w, b: weight and bias (compute dtype, contiguous, length n; ones and zeros when absent).
    # eps: float64. Returns (mean, rstd) as float64.
    n = src.shape[0]
    x0 = src[0]
    shift = 0.0
    for start in range(0, n, BLOCK):
        block = src[start : start + BLOCK]
        part = narrow(0.0, w)
        for j in range(block.shape[0]):
            part += _sub(block[j], x0)
        shift += part
    mean = x0 + shift / n
    mean_hi = narrow(mean, w)
    mean_lo = narrow(mean - mean_hi, w)
    squares = 0.0
    for start in range(0, n, BLOCK):
        block = src[start : start + BLOCK]
        part = narrow(0.0, w)
        for j in range(block.shape[0]):
            d = _sub(_sub(block[j], mean_hi), mean_lo)
            part += d * d
        squares += part
    rstd = 1.0 / np.sqrt(squares / n + eps)
    scale = narrow(rstd, w)
    for j in range(n):
        yr[j] = store(_sub(_sub(src[j], mean_hi), mean_lo) * scale * w[j] + b[j], yr)
    return mean, rstd


@njit(fastmath=FASTMATH, error_model="numpy", cache=True)
def layer_norm_rows(
    x: Any, y: Any, w: Any, b: Any, eps: float, mean: Any, rstd: Any, start: int, stop: int
) -> None:
    # LayerNorm of rows start..stop-1 of x, on this thread (see _normalize_row for the formula).
    # x: 2-D (rows, cols), any strides (negative and zero included); elements as in the table.
    # y: 2-D like x (any strides), or None to normalize x in place.
    # w, b: compute dtype, contiguous, length cols. eps: float64.
    # mean, rstd: 1-D (rows,) float32 or float64 to receive the statistics, or both empty.
    # A row that is not contiguous compute-dtype data is first copied into one scratch row.
    scratch = np.empty(x.shape[1], w.dtype)
    for i in range(start, stop):
        src = source_row(x[i], scratch)
        m, r = _normalize_row(src, out_row(x, y, i), w, b, eps)
        if mean.shape[0] != 0:
            mean[i] = m
            rstd[i] = r


@njit(parallel=True, fastmath=FASTMATH, error_model="numpy", cache=True)
def layer_norm_rows_parallel(
    x: Any, y: Any, w: Any, b: Any, eps: float, mean: Any, rstd: Any, chunks: int
) -> None:
    # layer_norm_rows over all rows, split into `chunks` equal ranges that run in parallel on
    # numba's threads (chunks: numba.get_num_threads() at call time; other arguments as there).
    rows = x.shape[0]
    for c in prange(chunks):
        layer_norm_rows(x, y, w, b, eps, mean, rstd, rows * c // chunks, rows * (c + 1) // chunks)
