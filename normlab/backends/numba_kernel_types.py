"""What the numba forward kernels take for one call's dtype, statistics dtype and row length.

:func:`kernel_types` answers a :class:`KernelTypes` (cached: a repeated call reads one entry):
the compute dtype, the integer type of half bit patterns, the stand-ins of an absent weight and
bias (cached arrays of ones and zeros: ``cols`` long for short rows, one segment long for long
rows, whose kernels reuse it for every segment; so a call without weight or bias allocates no
row-sized stand-in), the empty statistics array the kernels skip writing, and the empty arrays
whose types the address entries (:mod:`normlab.backends.numba_addressed`) take, with the entry
points already taken for them. Every family's calls read the same one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from normlab.backends.numba_forward import LONG_ROW_BYTES, SEGMENT

__all__ = ["BITS", "KernelTypes", "constant", "kernel_types", "no_stats", "stand_in"]

#: The integer type whose values are a half type's bit patterns, as the kernels read them.
BITS: Final = {"float16": np.int16, "bfloat16": np.uint16}


@dataclass(frozen=True, slots=True)
class KernelTypes:
    """What the forward kernels take for one (dtype, stats dtype, cols): the compute dtype, the
    integer type of half bit patterns (None: x's own), the stand-ins of an absent weight and
    bias and their addresses, the empty statistics array, whether rows take the segmented
    (long) form, and empty arrays of the kernels' element type of x (``element``) and of the
    compute dtype (``compute_like``): the types of :mod:`numba_addressed`'s entries, with the
    entry points of those already run (``entries``, by name; see
    :func:`normlab.backends.numba_tensors._entry_point`; their serial kernels were loaded first,
    see :func:`normlab.backends.numba_pool.load_serial_first`), and the stand-ins of tensor
    parameters stored in other float dtypes (``stored``, by torch dtype; see
    :func:`normlab.backends.numba_tensors._stored_stand_ins`)."""

    compute: np.dtype[Any]
    bits: type | None
    stats: np.dtype[Any]
    long: bool
    ones: np.ndarray
    zeros: np.ndarray
    no_stats: np.ndarray
    element: np.ndarray
    compute_like: np.ndarray
    ones_at: int
    zeros_at: int
    half_ones: np.ndarray | None
    half_zeros: np.ndarray | None
    half_ones_at: int
    half_zeros_at: int
    entries: dict[str, Any]
    stored: dict[Any, Any]


@functools.lru_cache(maxsize=16)
def kernel_types(dtype: str, stats_dtype: str, cols: int) -> KernelTypes:
    """The :class:`KernelTypes` of a call (cached: a repeated call reads one entry). The 16
    entries keep at most 32 stand-ins alive besides :func:`constant`'s: 32 MiB at most."""
    compute: type = np.float64 if dtype == "float64" else np.float32
    stats: type = np.float64 if stats_dtype == "float64" else np.float32
    long = cols * np.dtype(compute).itemsize > LONG_ROW_BYTES
    stand_in = SEGMENT if long else cols  # the length of an absent weight or bias
    bits = BITS.get(dtype)
    ones, zeros = constant(stand_in, compute, 1.0), constant(stand_in, compute, 0.0)
    half_ones = None if bits is None else _half_constant(stand_in, dtype, 1.0)
    half_zeros = None if bits is None else _half_constant(stand_in, dtype, 0.0)
    return KernelTypes(
        compute=np.dtype(compute),
        bits=bits,
        stats=np.dtype(stats),
        long=long,
        ones=ones,
        zeros=zeros,
        no_stats=no_stats(stats),
        element=np.empty((0, 0), bits or np.dtype(dtype)),
        compute_like=np.empty(0, compute),
        ones_at=ones.ctypes.data,
        zeros_at=zeros.ctypes.data,
        half_ones=half_ones,
        half_zeros=half_zeros,
        half_ones_at=0 if half_ones is None else half_ones.ctypes.data,
        half_zeros_at=0 if half_zeros is None else half_zeros.ctypes.data,
        entries={},
        stored={},
    )


@functools.lru_cache(maxsize=2)
def no_stats(dtype: type) -> np.ndarray:
    """An empty statistics array: the kernels skip writing statistics into it."""
    return np.empty(0, dtype)


@functools.lru_cache(maxsize=32)
def constant(length: int, compute: type, fill: float) -> np.ndarray:
    """A cached array of ``length`` times ``fill`` (the weight or bias of a call without one):
    at most LONG_ROW_BYTES each, so the cache holds at most 32 MiB."""
    return np.full(length, fill, dtype=compute)


def stand_in(length: int, dtype: str, fill: float) -> np.ndarray:
    """:func:`constant` stored as the float ``dtype`` is (half types as their bit patterns): the
    weight or bias a call lacks beside one stored in ``dtype``."""
    if dtype in BITS:
        return _half_constant(length, dtype, fill)
    return constant(length, np.float64 if dtype == "float64" else np.float32, fill)


@functools.lru_cache(maxsize=32)
def _half_constant(length: int, dtype: str, fill: float) -> np.ndarray:
    """:func:`constant` in the bit patterns of the half ``dtype`` (``fill`` is exact in it)."""
    wide = np.full(length, fill, np.float32)
    if dtype == "float16":
        return wide.astype(np.float16).view(np.int16)
    return (wide.view(np.uint32) >> 16).astype(np.uint16)  # bfloat16: float32's upper half
