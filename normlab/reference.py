"""The float64 oracle the tests compare against. Not a backend: slow, simple, exact enough.

Every input is converted to float64 NumPy first; statistics use the shifted two-pass form
(``mean = x0 + mean(x - x0)``, then the centred sum of squares), so constant rows give exactly
``bias`` and large offsets stay accurate.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["layer_norm", "normalized_axes", "to_float64"]


def to_float64(a: Any) -> np.ndarray:
    """``a`` (any NumPy float array, bfloat16 included) as a float64 array."""
    return np.asarray(a).astype(np.float64)


def normalized_axes(ndim: int, normalized_shape: Any = None, axis: Any = None) -> tuple[int, ...]:
    """The sorted non-negative axes a call normalizes over (no validation: inputs are good)."""
    if axis is not None:
        given = (axis,) if isinstance(axis, int) else tuple(axis)
        return tuple(sorted(a % ndim for a in given))
    if normalized_shape is not None:
        k = 1 if isinstance(normalized_shape, int) else len(tuple(normalized_shape))
        return tuple(range(ndim - k, ndim))
    return (ndim - 1,)


def layer_norm(
    x: Any,
    normalized_shape: Any = None,
    weight: Any = None,
    bias: Any = None,
    eps: float = 1e-5,
    *,
    axis: Any = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(y, mean, rstd)`` in float64; mean and rstd keepdims-shaped.

    ``weight``/``bias`` have the normalized shape (``x.shape[a]`` for the sorted axes).
    """
    x64 = to_float64(x)
    axes = normalized_axes(x64.ndim, normalized_shape, axis)
    batch = tuple(a for a in range(x64.ndim) if a not in axes)
    rows = x64.transpose(batch + axes).reshape(
        int(np.prod([x64.shape[a] for a in batch], dtype=np.int64)), -1
    )
    x0 = rows[:, :1]
    shift = (rows - x0).mean(axis=1, keepdims=True)
    mean = x0 + shift
    centred = rows - mean
    var = np.mean(centred * centred, axis=1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + np.float64(eps))
    y = centred * rstd
    if weight is not None:
        y = y * to_float64(weight).reshape(1, -1)
    if bias is not None:
        y = y + to_float64(bias).reshape(1, -1)
    permuted_shape = tuple(x64.shape[a] for a in batch + axes)
    inverse = tuple(np.argsort(batch + axes))
    y_full = y.reshape(permuted_shape).transpose(inverse)
    stats_shape = tuple(1 if a in axes else n for a, n in enumerate(x64.shape))
    return (
        np.ascontiguousarray(y_full),
        mean.reshape(stats_shape),
        rstd.reshape(stats_shape),
    )
