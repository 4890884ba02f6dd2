"""The ``example`` backend's functions: ``layer_norm`` and the two NumPy converters.

normlab hands ``layer_norm`` a validated plan and ``x`` as C-contiguous 2-D rows (the record
claims no capabilities, so normlab copies any other layout and writes ``out`` itself)::

    x0   = x[:, 0]                        the row's first element
    d    = mean(x - x0)                   mean = x0 + d
    var  = mean((x - x0 - d)^2)           population variance
    rstd = 1 / sqrt(var + eps)
    y    = (x - mean) * rstd * weight + bias

Everything is computed in float64 and rounded to x's dtype once at the end: float32 and half
rows then have sums and squares that neither overflow nor underflow, anywhere in their dtype's
finite range (which binds every backend, see normlab's docs/contract.md). The statistics are
returned in ``plan.stats_dtype``.
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
    centred = x.astype(compute)  # a fresh copy: x is never modified
    x0 = centred[:, :1].copy()
    centred -= x0
    shift = centred.mean(axis=1, keepdims=True)
    centred -= shift
    var = np.mean(centred * centred, axis=1, keepdims=True)
    rstd = 1 / np.sqrt(var + compute.type(plan.eps))
    y = centred * rstd
    if weight is not None:
        y *= weight.astype(compute)
    if bias is not None:
        y += bias.astype(compute)
    if not plan.return_stats:
        return y.astype(x.dtype), None, None
    stats = np.dtype(plan.stats_dtype)
    return y.astype(x.dtype), (x0 + shift)[:, 0].astype(stats), rstd[:, 0].astype(stats)


def to_numpy(a: np.ndarray) -> np.ndarray:
    """This backend's arrays are NumPy arrays."""
    return np.asarray(a)


def from_numpy(a: np.ndarray, like: Any = None) -> np.ndarray:
    """A copy, so that callers may change it freely."""
    return np.array(a, copy=True)
