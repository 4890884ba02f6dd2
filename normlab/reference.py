"""The float64 oracles the tests compare against. Not a backend: slow, simple, exact enough.

Every input is converted to float64 NumPy first; statistics use the shifted two-pass form
(``mean = x0 + mean(x - x0)``, then the centred sum of squares), so constant rows give exactly
``bias`` and large offsets stay accurate. Each row is divided by a power of two ``s`` (its
largest magnitude / s in [1, 2)) before it is squared, which is exact and changes nothing but
the range: ``y = (x/s - mean/s) / sqrt(var/s^2 + eps/s^2)``, so rows anywhere in float64's
finite range (1e-300 as 1e300) are accurate. A constant row with eps = 0 gives NaN (0 / 0).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from normlab.constants import MACHINE_EPS, stats_dtype_for

__all__ = ["layer_norm", "normalized_axes", "rms_norm", "to_float64"]


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
    rows, restore = _rows(to_float64(x), normalized_shape, axis)
    s = _scale(rows)
    scaled = rows / s
    x0 = scaled[:, :1]
    mean = x0 + (scaled - x0).mean(axis=1, keepdims=True)
    centred = scaled - mean
    var = np.mean(centred * centred, axis=1, keepdims=True)
    rstd = _rstd(var, float(eps), s)
    with np.errstate(invalid="ignore"):  # 0 * inf: a constant row with eps = 0 is NaN
        y = centred * rstd
    if weight is not None:
        y = y * to_float64(weight).reshape(1, -1)
    if bias is not None:
        y = y + to_float64(bias).reshape(1, -1)
    result: tuple[np.ndarray, np.ndarray, np.ndarray] = restore(y, mean * s, rstd / s)
    return result


def rms_norm(
    x: Any,
    normalized_shape: Any = None,
    weight: Any = None,
    eps: float | None = None,
    *,
    axis: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(y, rstd)`` in float64, ``y = x / sqrt(mean(x^2) + eps) * weight``; rstd keepdims.

    ``eps=None`` means ``finfo(compute dtype).eps``: float32's for float16, bfloat16 and
    float32 x, float64's for float64 (as ``torch.nn.functional.rms_norm``).
    """
    if eps is None:
        eps = MACHINE_EPS[stats_dtype_for(np.asarray(x).dtype.name)]
    rows, restore = _rows(to_float64(x), normalized_shape, axis)
    s = _scale(rows)
    scaled = rows / s
    rstd = _rstd(np.mean(scaled * scaled, axis=1, keepdims=True), float(eps), s)
    with np.errstate(invalid="ignore"):  # 0 * inf: a row of zeros with eps = 0 is NaN
        y = scaled * rstd
    if weight is not None:
        y = y * to_float64(weight).reshape(1, -1)
    y_full, _, rstd_full = restore(y, rstd, rstd / s)
    return y_full, rstd_full


def _scale(rows: np.ndarray) -> np.ndarray:
    """Per row: ``2^k`` with the row's largest magnitude / 2^k in [1, 2), keepdims (1 for a row
    of zeros or holding NaN/Inf; |k| <= 1000, so that 1/2^k is finite)."""
    if rows.shape[1] == 0:
        return np.ones((rows.shape[0], 1))
    largest = np.max(np.abs(rows), axis=1, keepdims=True)
    largest = np.where(np.isfinite(largest), largest, 0.0)
    _, exponent = np.frexp(largest)
    s: np.ndarray = np.ldexp(1.0, np.clip(np.where(largest > 0, exponent - 1, 0), -1000, 1000))
    return s


def _rstd(mean_square: np.ndarray, eps: float, s: np.ndarray) -> np.ndarray:
    """``rstd * s`` for rows scaled by ``s``: ``1 / sqrt(mean_square + eps / s^2)``; where
    ``eps / s^2`` overflows, eps dwarfs the variance, and where it underflows beside a zero
    variance (a constant row of huge values), eps alone counts: ``s / sqrt(eps)`` for both."""
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        scaled_eps = eps / s / s
        finite = np.isfinite(scaled_eps) & ~((mean_square + scaled_eps == 0) & (eps > 0))
        wide = s / np.sqrt(eps) if eps > 0 else s
        rstd: np.ndarray = np.where(
            finite, 1.0 / np.sqrt(mean_square + np.where(finite, scaled_eps, 0.0)), wide
        )
    return rstd


def _rows(x64: np.ndarray, normalized_shape: Any, axis: Any) -> tuple[np.ndarray, Any]:
    """x64 as 2-D rows (batch axes first), and a function restoring results to x's layout."""
    axes = normalized_axes(x64.ndim, normalized_shape, axis)
    batch = tuple(a for a in range(x64.ndim) if a not in axes)
    n_rows = int(np.prod([x64.shape[a] for a in batch], dtype=np.int64))
    n_cols = int(np.prod([x64.shape[a] for a in axes], dtype=np.int64))
    rows = x64.transpose(batch + axes).reshape(n_rows, n_cols)
    permuted_shape = tuple(x64.shape[a] for a in batch + axes)
    inverse = tuple(int(i) for i in np.argsort(batch + axes))
    stats_shape = tuple(1 if a in axes else n for a, n in enumerate(x64.shape))

    def restore(
        y: np.ndarray, mean: np.ndarray, rstd: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        y_full = np.ascontiguousarray(y.reshape(permuted_shape).transpose(inverse))
        return y_full, mean.reshape(stats_shape), rstd.reshape(stats_shape)

    return rows, restore
