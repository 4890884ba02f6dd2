"""The NumPy backend: cache-sized row blocks, in-place ufuncs, no full-size temporaries.

Each block of rows (about :data:`BLOCK_BYTES` of compute-dtype data) is normalized in a scratch
buffer that stays in cache, with the shifted two-pass formula::

    d    = mean(x - x0)              x0: the row's first element; mean = x0 + d
    var  = mean((x - x0 - d)^2)      population variance; row sums by BLAS matrix-vector products
    rstd = 1 / sqrt(var + eps)
    y    = (x - mean) * rstd * weight + bias

float16 and bfloat16 are computed in float32 and rounded once when the block is stored.
RMSNorm runs the same loop without the centring: ``rstd = 1 / sqrt(mean(x^2) + eps)``.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from normlab.spec import Plan

__all__ = ["from_numpy", "layer_norm", "rms_norm", "to_numpy"]

#: Bytes of compute-dtype scratch per block (two buffers): small enough for L2 on most CPUs.
BLOCK_BYTES: Final = 512 * 1024


def layer_norm(
    x: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None, *, plan: Plan,
    out: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Normalize each row of the 2-D ``x`` (any strides); see :mod:`normlab.hookspecs`."""
    return _normalize(x, weight, bias, plan, out, centre=True)


def rms_norm(
    x: np.ndarray, weight: np.ndarray | None, bias: None, *, plan: Plan, out: np.ndarray | None,
) -> tuple[np.ndarray, None, np.ndarray | None]:
    """RMS-normalize each row of the 2-D ``x``: ``x / sqrt(mean(x^2) + eps) * weight``."""
    y, _, rstd = _normalize(x, weight, None, plan, out, centre=False)
    return y, None, rstd


def _normalize(
    x: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None, plan: Plan,
    out: np.ndarray | None, centre: bool,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Both ops, block by block: ``centre`` subtracts the shifted two-pass mean (LayerNorm);
    without it the mean square is taken about zero (RMSNorm)."""
    compute = np.dtype(plan.compute_dtype)
    rows, cols = plan.rows, plan.cols
    y = out if out is not None else np.empty((rows, cols), dtype=x.dtype)
    w = None if weight is None else weight.astype(compute, copy=False)
    b = None if bias is None else bias.astype(compute, copy=False)
    eps = compute.type(plan.eps)
    means = np.empty(rows, compute) if plan.return_stats and centre else None
    rstds = np.empty(rows, compute) if plan.return_stats else None
    block = max(1, BLOCK_BYTES // (cols * compute.itemsize))
    # The result block doubles as scratch when it already has the compute dtype and C layout.
    y_is_scratch = y.dtype == compute and y.flags.c_contiguous
    scratch = None if y_is_scratch else np.empty((min(block, rows), cols), compute)
    squares = np.empty((min(block, rows), cols), compute)
    ones = np.ones(cols, compute)  # row sums as a matrix-vector product: blocked, vectorised
    for start in range(0, rows, block):
        stop = min(start + block, rows)
        xb = x[start:stop]
        yb = y[start:stop]
        t = yb if scratch is None else scratch[: stop - start]
        sq = squares[: stop - start]
        if centre:
            x0 = xb[:, :1].astype(compute)  # a copy: t may be x's own memory (in place)
            np.subtract(xb, x0, out=t, dtype=compute)
            shift = np.matmul(t, ones)[:, None]
            shift /= cols
            t -= shift
        elif t is not xb:
            np.copyto(t, xb, casting="unsafe")
        np.multiply(t, t, out=sq)
        var = np.matmul(sq, ones)[:, None]
        var /= cols
        var += eps
        rstd = np.sqrt(var, out=var)
        np.divide(1, rstd, out=rstd)
        t *= rstd
        if w is not None:
            t *= w
        if b is not None:
            t += b
        if t is not yb:
            yb[...] = t
        if means is not None:
            means[start:stop] = (x0 + shift)[:, 0]
        if rstds is not None:
            rstds[start:stop] = rstd[:, 0]
    return y, means, rstds


def to_numpy(a: np.ndarray) -> np.ndarray:
    """NumPy arrays are already NumPy."""
    return np.asarray(a)


def from_numpy(a: np.ndarray, like: Any = None) -> np.ndarray:
    """NumPy arrays stay NumPy (a copy, so tests may mutate it freely)."""
    return np.array(a, copy=True)
