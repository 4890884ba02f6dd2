"""The ``example`` backend's functions: ``layer_norm`` and the two NumPy converters.

normlab hands ``layer_norm`` a validated plan and ``x`` as C-contiguous 2-D rows (the record
claims no capabilities, so normlab copies any other layout and writes ``out`` itself)::

    x0   = x[:, 0]                        the row's first element
    d    = mean(x - x0)                   mean = x0 + d
    var  = mean((x - x0 - d)^2)           population variance
    rstd = 1 / sqrt(var + eps)
    y    = (x - mean) * rstd * weight + bias

Everything is computed in ``plan.compute_dtype`` (float32 for float16/bfloat16, else x's dtype)
and rounded to x's dtype once at the end.
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
    compute = np.dtype(plan.compute_dtype)
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
    return y.astype(x.dtype), (x0 + shift)[:, 0], rstd[:, 0]


def to_numpy(a: np.ndarray) -> np.ndarray:
    """This backend's arrays are NumPy arrays."""
    return np.asarray(a)


def from_numpy(a: np.ndarray, like: Any = None) -> np.ndarray:
    """A copy, so that callers may change it freely."""
    return np.array(a, copy=True)
