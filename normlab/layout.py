"""Memory layout: the 2-D rows a backend reads, made from the caller's arrays, and back.

A backend sees ``x`` as a 2-D ``(rows, cols)`` array: batch axes first, normalized axes last.
That view exists without a copy when the batch axes collapse into one stride and the normalized
axes into another (:func:`row_view_strides`); whether a backend reads such strides is its
record's ``strided``/``row_strided`` capability (:func:`reads`). These functions are geometry
only: which copies a call makes is :mod:`normlab.route`'s decision.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from normlab import arrays

__all__ = ["flat", "from_rows", "native", "reads", "row_view_strides", "to_rows"]


def row_view_strides(
    shape: tuple[int, ...],
    strides: tuple[int, ...] | None,
    batch_axes: tuple[int, ...],
    axes: tuple[int, ...],
) -> tuple[int, int] | None:
    """Element strides ``(row, col)`` of a 2-D ``(rows, cols)`` view, or ``None`` if none exists.

    The batch axes must collapse into one stride and the normalized axes into another (axes of
    size 1 do not matter). A size-1 side gets the stride that a C-contiguous array would have.
    """
    if strides is None:
        return None
    cols_stride = _collapsed_stride([(shape[a], strides[a]) for a in axes], default=1)
    if cols_stride is None:
        return None
    cols = math.prod(shape[a] for a in axes)
    rows_stride = _collapsed_stride([(shape[a], strides[a]) for a in batch_axes], default=cols)
    if rows_stride is None:
        return None
    return rows_stride, cols_stride


def _collapsed_stride(dims: list[tuple[int, int]], default: int) -> int | None:
    dims = [(n, s) for n, s in dims if n != 1]
    if not dims:
        return default
    for (_, outer), (inner_n, inner) in itertools.pairwise(dims):
        if outer != inner * inner_n:
            return None
    return dims[-1][1]


def reads(
    capabilities: frozenset[str], strides: tuple[int, int] | None, rows: int, cols: int
) -> bool:
    """Whether a backend with ``capabilities`` reads (or writes) a 2-D ``(rows, cols)`` view of
    ``strides`` as it is (None: no such view)."""
    if strides is None:
        return False
    row, col = strides
    if "strided" in capabilities:
        return True
    unit_cols = col == 1 or cols == 1
    if "row_strided" in capabilities:
        return unit_cols
    return unit_cols and (row == cols or rows == 1)


def native(a: Any) -> Any:
    """``a`` in native byte order: a converted copy when its dtype is byte-swapped, else ``a``
    itself."""
    if a is None or getattr(a.dtype, "isnative", True):
        return a
    return a.astype(a.dtype.newbyteorder("="))


def to_rows(a: Any, permutation: tuple[int, ...] | None, rows: int, cols: int, copy: bool) -> Any:
    """The x-like array ``a`` (x, dy, out, …) as the 2-D ``(rows, cols)`` view a backend reads:
    permuted so that the batch axes come first, a C-contiguous copy when ``copy``."""
    if permutation is not None:
        a = arrays.permute(a, permutation)
    if copy:
        a = arrays.contiguous(a)
    return arrays.reshape(a, (rows, cols))


def from_rows(a: Any, shape: tuple[int, ...], inverse: tuple[int, ...] | None) -> Any:
    """A backend's 2-D result back in the caller's axes: reshaped to ``shape`` (the permuted
    shape) and permuted by ``inverse``."""
    a = arrays.reshape(a, shape)
    if inverse is not None:
        a = arrays.permute(a, inverse)
    return a


def flat(p: Any, normalized_shape: tuple[int, ...]) -> Any:
    """A per-feature array (weight, bias) as the 1-D ``(cols,)`` array a backend reads."""
    if p is None or len(normalized_shape) == 1:
        return p
    return arrays.reshape(arrays.contiguous(p), (math.prod(normalized_shape),))
