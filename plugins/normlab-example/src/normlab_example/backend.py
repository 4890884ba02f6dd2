"""The ``example`` backend's functions: ``layer_norm`` and the two NumPy converters.

normlab hands ``layer_norm`` a validated plan and ``x`` as C-contiguous 2-D rows (the record
claims no capabilities, so normlab copies any other layout and writes ``out`` itself). Each row
is first divided by a power of two ``s`` (exact), its largest magnitude / s in [1, 2)::

    xs   = x / s
    x0   = xs[:, 0]                       the row's first element
    d    = mean(xs - x0)                  mean = (x0 + d) * s
    v    = mean((xs - x0 - d)^2)          population variance / s^2
    rstd = 1 / sqrt(v + eps / s^2) / s
    y    = (xs - x0 - d) * rstd * s * weight + bias

Everything is computed in float64 and rounded to x's dtype once at the end; with the scaling,
no sum or square overflows or underflows anywhere in x's finite range (which binds every
backend, see normlab's docs/contract.md). Constant rows (v exactly 0) and rows so tiny that
``eps / s^2`` overflows take ``rstd = 1 / sqrt(eps)`` directly. The statistics are returned in
``plan.stats_dtype``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from normlab.hookspecs import Plan

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
    s = _power_of_two(x)
    centred = x.astype(compute) / s  # a fresh copy: x is never modified
    x0 = centred[:, :1].copy()
    centred -= x0
    shift = centred.mean(axis=1, keepdims=True)
    centred -= shift
    v = np.mean(centred * centred, axis=1, keepdims=True)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        eps_scaled = plan.eps / s / s  # inf: the row is so tiny that eps dwarfs its variance
        direct = (v == 0) | np.isinf(eps_scaled)  # rstd = 1 / sqrt(eps)
        factor = 1 / np.sqrt(v + np.where(direct, 0.0, eps_scaled))  # rstd * s
        rstd = np.where(direct, 1 / np.sqrt(compute.type(plan.eps)), factor / s)
        y = np.where(direct, centred * s * rstd, centred * factor)
    if weight is not None:
        y *= weight.astype(compute)
    if bias is not None:
        y += bias.astype(compute)
    if not plan.return_stats:
        return y.astype(x.dtype), None, None
    stats = np.dtype(plan.stats_dtype)
    return y.astype(x.dtype), ((x0 + shift) * s)[:, 0].astype(stats), rstd[:, 0].astype(stats)


def _power_of_two(x: np.ndarray) -> np.ndarray:
    """Per row of ``x``, keepdims: the power of two with the row's largest magnitude divided by
    it in [1, 2); 1 for a row of zeros or one holding NaN or Inf."""
    largest = np.max(np.abs(x.astype(np.float64)), axis=1, keepdims=True)
    _, exponent = np.frexp(np.where(np.isfinite(largest) & (largest > 0), largest, 1.0))
    s: np.ndarray = np.ldexp(1.0, exponent - 1)
    return s


def to_numpy(a: np.ndarray) -> np.ndarray:
    """This backend's arrays are NumPy arrays."""
    return np.asarray(a)


def from_numpy(a: np.ndarray, like: Any = None) -> np.ndarray:
    """A copy, so that callers may change it freely."""
    return np.array(a, copy=True)
