"""The ``example`` backend's functions: ``layer_norm`` and the two NumPy converters.

normlab hands ``layer_norm`` a validated plan and ``x`` as C-contiguous 2-D rows (the record
claims no capabilities, so normlab copies any other layout and writes ``out`` itself)::

    s    = 2^k <= max |x| < 2^(k+1)       per row: dividing by s is exact
    u    = x / s                          values in (-2, 2)
    u0   = u[:, 0]                        the row's first element
    d    = mean(u - u0)                   mean = (u0 + d) * s
    v    = mean((u - u0 - d)^2)           population variance of u (var = v * s^2)
    rstd = 1 / sqrt(v * s^2 + eps)        computed as (1 / sqrt(v + eps / s^2)) / s
    y    = (u - u0 - d) * (s * rstd) * weight + bias

Everything is computed in float64 and rounded to x's dtype once at the end. Scaling each row
by a power of two keeps its squares from overflowing or underflowing anywhere in the dtype's
finite range, float64 included (which binds every backend, see normlab's docs/contract.md).
The statistics are returned in ``plan.stats_dtype``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from normlab.spec import Plan

__all__ = ["from_numpy", "layer_norm", "to_numpy"]


def layer_norm(
    x: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    *,
    plan: Plan,
    out: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Normalize each row of the 2-D ``x``; returns ``(y, mean, rstd)``."""
    compute = np.dtype(np.float64)
    x64 = x.astype(compute)  # a fresh copy: x is never modified
    scale = _power_of_two_scale(x64)
    centred = x64 / scale
    u0 = centred[:, :1].copy()
    centred -= u0
    shift = centred.mean(axis=1, keepdims=True)
    centred -= shift
    var = np.mean(centred * centred, axis=1, keepdims=True)
    with np.errstate(over="ignore", divide="ignore"):
        scaled_eps = plan.eps / scale / scale  # inf where eps dwarfs a row of tiny values
        factor = np.where(  # s * rstd; where eps / s^2 overflows, v * s^2 is nothing beside eps
            np.isfinite(scaled_eps), 1 / np.sqrt(var + scaled_eps), scale / np.sqrt(plan.eps)
        )
    y = centred * factor
    if weight is not None:
        y *= weight.astype(compute)
    if bias is not None:
        y += bias.astype(compute)
    if not plan.return_stats:
        return y.astype(x.dtype), None, None
    stats = np.dtype(plan.stats_dtype)
    mean, rstd = (u0 + shift) * scale, factor / scale
    return y.astype(x.dtype), mean[:, 0].astype(stats), rstd[:, 0].astype(stats)


def _power_of_two_scale(x: np.ndarray) -> np.ndarray:
    """Per row of the float64 ``x``, the power of two ``s <= max |x| < 2 s`` (1 for a row of
    zeros or with a NaN or Inf), as a column."""
    largest = np.max(np.abs(x), axis=1, keepdims=True)
    usable = np.isfinite(largest) & (largest > 0)
    return np.ldexp(1.0, np.frexp(np.where(usable, largest, 1.0))[1] - 1)


def to_numpy(a: np.ndarray) -> np.ndarray:
    """This backend's arrays are NumPy arrays."""
    return np.asarray(a)


def from_numpy(a: np.ndarray, like: Any = None) -> np.ndarray:
    """A copy, so that callers may change it freely."""
    return np.array(a, copy=True)
