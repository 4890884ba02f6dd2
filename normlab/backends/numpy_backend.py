"""The NumPy backend: cache-sized row blocks, in-place ufuncs, no full-size temporaries.

Each block of rows (about :data:`BLOCK_BYTES` of compute-dtype data) is normalized in a scratch
buffer that stays in cache, with the shifted, corrected two-pass formula::

    m    = x0 + mean(x - x0)         x0: the row's first element; m rounded to the compute dtype
    d    = x - m                     one rounding, exact near the mean (Sterbenz)
    mean = m + mean(d)               the correction: mean(x - x0) rounds at the scale of
    var  = mean(d^2) - mean(d)^2     |x0 - mean|, mean(d) at the row's spread; per-row dot products
    rstd = 1 / sqrt(var + eps)
    y    = (d - mean(d)) * rstd * weight + bias

so a small output in a row whose first element lies far from the mean is as accurate as its
own magnitude allows (float32 within 0.25x of a 1e-7 + 1.3e-6·|y| tolerance on 2048x768 randn
rows, like ``torch.nn.functional.layer_norm``).

float16 and bfloat16 are computed in float32 and rounded once when the block is stored.
A row longer than a block is normalized alone in column segments (:func:`_long_rows`): segment
moments merged with Chan's formula, so accuracy does not degrade with the row's length and
scratch stays one block.
RMSNorm runs the same loop without the centring: ``rstd = 1 / sqrt(mean(x^2) + eps)``.

Two rows-sized checks keep the fast path exact at the edges of the float range: a row whose
variance is not finite (float32 squares overflow past about 1.8e19, or x holds NaN/Inf), or,
with an eps too small to hide it, below the compute dtype's smallest normal number (squares
that underflow, float32 rows near 1e-20), is recomputed alone by :func:`_wide_rows`, in float64
scaled by a power of two;
and with ``eps > 0`` the factor applied to a row is capped at the compute dtype's largest
value, so a constant row (all deviations exactly 0) gives exactly ``bias`` even where
``1/sqrt(eps)`` overflows (eps below about 8.6e-78 in float32); its returned ``rstd`` is then
inf, the float32 rounding of the true value. In place (``out`` is x), the result does not
double as scratch: x must stay readable until its block is done.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Final

import numpy as np

from normlab.constants import ROW_CHUNK
from normlab.hookspecs import Plan

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "from_numpy",
    "layer_norm",
    "layer_norm_backward",
    "rms_norm",
    "rms_norm_backward",
    "to_numpy",
]

#: Bytes of compute-dtype scratch per block: small enough to stay in L2 on most CPUs.
BLOCK_BYTES: Final = 512 * 1024
#: Per compute dtype: its smallest normal number (a row's mean square below it has lost
#: precision) and the eps from which that loss is hidden (tiny / machine epsilon).
UNDERFLOW: Final = {
    name: (float(np.finfo(name).tiny), float(np.finfo(name).tiny / np.finfo(name).eps))
    for name in ("float32", "float64")
}
#: Rows recomputed by _wide_rows are scaled by 2^k, |k| at most this (float64 normal range).
SCALE_LIMIT: Final = 1000


def layer_norm(
    x: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    *,
    plan: Plan,
    out: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Normalize each row of the 2-D ``x`` (any strides); see :mod:`normlab.hookspecs`."""
    return _normalize(x, weight, bias, plan, out, centre=True)


def rms_norm(
    x: np.ndarray,
    weight: np.ndarray | None,
    *,
    plan: Plan,
    out: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """RMS-normalize each row of the 2-D ``x``: ``x / sqrt(mean(x^2) + eps) * weight``."""
    y, _, rstd = _normalize(x, weight, None, plan, out, centre=False)
    return y, rstd


def _normalize(
    x: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    plan: Plan,
    out: np.ndarray | None,
    centre: bool,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Both ops, block by block: ``centre`` subtracts the shifted two-pass mean (LayerNorm);
    without it the mean square is taken about zero (RMSNorm). NaN and Inf propagate quietly."""
    with np.errstate(all="ignore"):
        return _normalize_blocks(x, weight, bias, plan, out, centre)


def _normalize_blocks(
    x: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    plan: Plan,
    out: np.ndarray | None,
    centre: bool,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    compute = np.dtype(plan.compute_dtype)
    rows, cols = plan.rows, plan.cols
    y = out if out is not None else np.empty((rows, cols), dtype=x.dtype)
    w = None if weight is None else weight.astype(compute, copy=False)
    b = None if bias is None else bias.astype(compute, copy=False)
    means = np.empty(rows, compute) if plan.return_stats and centre else None
    rstds = np.empty(rows, compute) if plan.return_stats else None
    if cols * compute.itemsize > BLOCK_BYTES:
        _long_rows(x, y, w, b, plan, means, rstds, centre)
        return y, means, rstds
    block = max(1, BLOCK_BYTES // (cols * compute.itemsize))
    # The result block doubles as scratch when it already has the compute dtype and C layout,
    # and is not x's memory (in place): a row recomputed by _wide_rows reads x after the pass.
    y_is_scratch = y.dtype == compute and y.flags.c_contiguous and not np.may_share_memory(x, y)
    # eps > 0 but 1/sqrt(eps) beyond the compute dtype: cap the factor, so that the exact zeros
    # of a constant row stay 0 (not 0 * inf)
    cap = np.finfo(compute).max
    capped = plan.eps > 0 and 1.0 / np.sqrt(plan.eps) > cap
    # a mean square below the smallest normal number has lost precision; it matters only when
    # eps does not dwarf the error
    tiny, hidden_from = UNDERFLOW[plan.compute_dtype]
    eps_tiny = plan.eps < hidden_from
    scratch = None if y_is_scratch else np.empty((min(block, rows), cols), compute)
    ones = np.ones(cols, compute)  # row sums as dot products: vectorised, one row at a time
    for start in range(0, rows, block):
        stop = min(start + block, rows)
        xb = x[start:stop]
        yb = y[start:stop]
        t = yb if scratch is None else scratch[: stop - start]
        if centre:
            # shifted, then corrected: m = x0 + mean(x - x0); d = x - m (one rounding near the
            # mean); mean = m + mean(d), var = mean(d^2) - mean(d)^2 (see the module docstring)
            x0 = xb[:, :1].astype(compute)  # a copy: t may be x's own memory (in place)
            np.subtract(xb, x0, out=t, dtype=compute)
            shift = np.vecdot(t, ones)[:, None]
            shift /= cols
            shift += x0  # m, rounded to the compute dtype
            np.subtract(xb, shift, out=t, dtype=compute)
            residual = np.vecdot(t, ones)[:, None]
            residual /= cols
            var = np.vecdot(t, t)[:, None]
            var /= cols
            var -= residual * residual
            np.maximum(var, 0.0, out=var, where=var < 0)  # a near-constant row (NaN stays)
            t -= residual
        else:
            if t is not xb:
                np.copyto(t, xb, casting="unsafe")
            var = np.vecdot(t, t)[:, None]
            var /= cols
        # eps is added in float64: an eps below float32's range must not vanish
        rstd64 = 1.0 / np.sqrt(var.astype(np.float64) + plan.eps)
        rstd = rstd64.astype(compute)
        t *= np.minimum(rstd64, cap).astype(compute) if capped else rstd
        if w is not None:
            t *= w
        if b is not None:
            t += b
        wide = None
        # rows-sized: squares overflowed, or NaN; or (only with a tiny eps) squares underflowed
        overflow = not np.isfinite(np.add.reduce(var[:, 0]))
        if overflow or (eps_tiny and np.min(var) < tiny):
            bad_rows = ~np.isfinite(var[:, 0])
            if eps_tiny:
                bad_rows |= var[:, 0] < tiny
            bad = np.flatnonzero(bad_rows)
            if bad.size:
                wide = _wide_rows(xb[bad], weight, bias, plan.eps, centre)
        if t is not yb:
            yb[...] = t
        if means is not None:
            means[start:stop] = (shift + residual)[:, 0]
        if rstds is not None:
            rstds[start:stop] = rstd[:, 0]
        if wide is not None:
            yb[bad] = wide[0]
            if means is not None:
                means[start + bad] = wide[1]
            if rstds is not None:
                rstds[start + bad] = wide[2]
    return y, means, rstds


def add_layer_norm(
    x: np.ndarray,
    residual: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    *,
    plan: Plan,
    out: np.ndarray | None,
    residual_out: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """``h = x + residual`` (NumPy's add in x's dtype), then LayerNorm of ``h``, block by block
    (:func:`_add_normalize`); see :mod:`normlab.hookspecs`."""
    return _add_normalize(x, residual, weight, bias, plan, out, residual_out, centre=True)


def add_rms_norm(
    x: np.ndarray,
    residual: np.ndarray,
    weight: np.ndarray | None,
    *,
    plan: Plan,
    out: np.ndarray | None,
    residual_out: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """``h = x + residual``, then RMSNorm of ``h``; returns ``(y, h, rstd)``."""
    y, h, _, rstd = _add_normalize(x, residual, weight, None, plan, out, residual_out, False)
    return y, h, rstd


def _add_normalize(
    x: np.ndarray,
    residual: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    plan: Plan,
    out: np.ndarray | None,
    residual_out: np.ndarray | None,
    centre: bool,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """Both fused ops, in the row blocks of :func:`_normalize_blocks`: a block's h is added
    whole (into the h output, or, when h is not returned, a block-sized buffer), then the block
    is normalized from it by :func:`_normalize_blocks` itself, so y and the statistics are those
    of ``layer_norm(h)``. The block's x and residual are read before its y is written: ``out``
    may be the memory of x or residual, the h output that of residual or x."""
    rows, cols = plan.rows, plan.cols
    compute = np.dtype(plan.compute_dtype)
    block = max(1, BLOCK_BYTES // (cols * compute.itemsize))
    y = out if out is not None else np.empty((rows, cols), dtype=x.dtype)
    h = None
    if plan.return_residual:
        h = residual_out if residual_out is not None else np.empty((rows, cols), dtype=x.dtype)
    buffer = np.empty((min(block, rows) if h is None else 0, cols), x.dtype)  # h not returned
    means = np.empty(rows, compute) if plan.return_stats and centre else None
    rstds = np.empty(rows, compute) if plan.return_stats else None
    with np.errstate(all="ignore"):
        for start in range(0, rows, block):
            stop = min(start + block, rows)
            hb = h[start:stop] if h is not None else buffer[: stop - start]
            np.add(x[start:stop], residual[start:stop], out=hb)
            part = dataclasses.replace(plan, rows=stop - start)
            _, mean_b, rstd_b = _normalize_blocks(hb, weight, bias, part, y[start:stop], centre)
            if means is not None:
                means[start:stop] = mean_b
            if rstds is not None:
                rstds[start:stop] = rstd_b
    return y, h, means, rstds


def _long_rows(
    x: np.ndarray,
    y: np.ndarray,
    w: np.ndarray | None,
    b: np.ndarray | None,
    plan: Plan,
    means: np.ndarray | None,
    rstds: np.ndarray | None,
    centre: bool,
) -> None:
    """Rows longer than a block, one at a time, in column segments of :data:`BLOCK_BYTES`:
    each segment's (mean, M2) by the shifted two-pass in the compute dtype, merged in segment
    order in float64 with Chan's formula (``delta = mean_b - mean_a``, ``mean += delta * nb / n``,
    ``m2 += m2_b + delta^2 * na * nb / n``), then y segment by segment. Scratch is one segment,
    whatever the row's length: peak memory is y plus O(block). A row whose statistics do not
    hold (see :func:`_wide_rows`) is redone there, in float64 (a row-sized copy: rare)."""
    compute = np.dtype(plan.compute_dtype)
    cols = plan.cols
    segment = BLOCK_BYTES // compute.itemsize
    scratch = np.empty(segment, compute)
    ones = np.ones(segment, compute)
    tiny, hidden_from = UNDERFLOW[plan.compute_dtype]
    eps_tiny = plan.eps < hidden_from
    cap = np.finfo(compute).max
    for i in range(plan.rows):
        xr, yr = x[i], y[i]
        count, mean, m2 = 0, 0.0, 0.0
        for start in range(0, cols, segment):
            stop = min(start + segment, cols)
            n = stop - start
            t = scratch[:n]
            np.copyto(t, xr[start:stop], casting="unsafe")
            seg_mean = 0.0
            if centre:  # shifted, then corrected, as in _normalize_blocks
                x0 = t[0].copy()
                t -= x0
                shift = np.vecdot(t, ones[:n]) / compute.type(n) + x0
                np.subtract(xr[start:stop], shift, out=t, dtype=compute)
                residual = float(np.vecdot(t, ones[:n])) / n
                seg_mean = float(shift) + residual
                seg_m2 = max(float(np.vecdot(t, t)) - n * residual * residual, 0.0)
            else:
                seg_m2 = float(np.vecdot(t, t))
            if count == 0:  # the first segment: nothing to merge (delta^2 * 0 could be inf * 0)
                mean, m2, count = seg_mean, seg_m2, n
                continue
            total = count + n
            delta = seg_mean - mean
            mean += delta * (n / total)
            m2 += seg_m2 + delta * delta * (count * (n / total))
            count = total
        var = m2 / cols
        if not np.isfinite(var) or (eps_tiny and var < tiny):
            yw, mean_w, rstd_w = _wide_rows(xr[None], w, b, plan.eps, centre)
            yr[...] = yw[0]
            mean, rstd = float(mean_w[0]), float(rstd_w[0])
        else:
            rstd = 1.0 / math.sqrt(var + plan.eps) if var + plan.eps > 0 else math.inf
            mean_hi = compute.type(mean)
            mean_lo = compute.type(mean - float(mean_hi))
            factor = compute.type(min(rstd, cap) if plan.eps > 0 else rstd)
            for start in range(0, cols, segment):
                stop = min(start + segment, cols)
                t = scratch[: stop - start]
                np.copyto(t, xr[start:stop], casting="unsafe")
                t -= mean_hi
                t -= mean_lo
                t *= factor
                if w is not None:
                    t *= w[start:stop]
                if b is not None:
                    t += b[start:stop]
                yr[start:stop] = t
        if means is not None:
            means[i] = mean
        if rstds is not None:
            rstds[i] = rstd


def _wide_rows(
    x: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    eps: float,
    centre: bool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(y, mean, rstd)`` of a few rows in float64 (y 2-D; mean, rstd 1-D). Each row is divided
    by a power of two ``s`` first (its largest magnitude / s in [1, 2)), so that no square
    overflows or underflows anywhere in float64's range: ``(x/s - mean/s) / sqrt(var/s^2 +
    eps/s^2)`` is the same ``y``. A NaN or Inf in a row makes that row NaN; a constant row with
    eps = 0 gives NaN (0 / 0)."""
    x64 = x.astype(np.float64)
    s = _power_of_two_scale(x64)
    xs = x64 / s
    mean = np.zeros_like(s)
    if centre:
        x0 = xs[:, :1]
        mean = x0 + (xs - x0).mean(axis=1, keepdims=True)
    d = xs - mean
    rstd = _scaled_rstd(np.mean(d * d, axis=1, keepdims=True), eps, s)
    y = d * rstd
    if weight is not None:
        y *= weight.astype(np.float64)
    if bias is not None:
        y += bias.astype(np.float64)
    return y, (mean * s)[:, 0], (rstd / s)[:, 0]


def _power_of_two_scale(x64: np.ndarray) -> np.ndarray:
    """Per row of the 2-D ``x64``: ``2^k`` with the row's largest magnitude / 2^k in [1, 2)
    (k clamped to ±SCALE_LIMIT; 1 for a row of zeros or holding NaN/Inf), keepdims."""
    largest = np.max(np.abs(x64), axis=1, keepdims=True)
    largest = np.where(np.isfinite(largest), largest, 0.0)
    _, exponent = np.frexp(largest)
    k = np.clip(np.where(largest > 0, exponent - 1, 0), -SCALE_LIMIT, SCALE_LIMIT)
    s: np.ndarray = np.ldexp(1.0, k)
    return s


def _scaled_rstd(mean_square: np.ndarray, eps: float, s: np.ndarray) -> np.ndarray:
    """``rstd * s`` of rows scaled by ``s`` (``mean_square`` of the scaled values): ``1 /
    sqrt(mean_square + eps / s^2)``, or ``s / sqrt(eps)`` where ``eps / s^2`` overflows (eps
    dwarfs the variance of a tiny row)."""
    scaled_eps = eps / s / s
    with np.errstate(divide="ignore"):
        rstd: np.ndarray = np.where(
            np.isfinite(scaled_eps),
            1.0 / np.sqrt(mean_square + np.where(np.isfinite(scaled_eps), scaled_eps, 0.0)),
            s / np.sqrt(eps) if eps > 0 else 0.0,
        )
    return rstd


def to_numpy(a: np.ndarray) -> np.ndarray:
    """NumPy arrays are already NumPy."""
    return np.asarray(a)


def from_numpy(a: np.ndarray, like: Any = None) -> np.ndarray:
    """NumPy arrays stay NumPy (a copy, so tests may mutate it freely)."""
    return np.array(a, copy=True)


# --------------------------------------------------------------------------------------------
# Backward (see :mod:`normlab.hookspecs` for the contract).


def layer_norm_backward(
    dy: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    *,
    plan: Plan,
    needs: frozenset[str],
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """``dx = rstd * (g - mean(g) - x̂ * mean(g * x̂))``, ``dweight = Σ dy * x̂``, ``dbias = Σ dy``
    with ``x̂ = (x - mean) * rstd``, ``g = dy * weight``; see :mod:`normlab.hookspecs`."""
    return _backward(dy, x, mean, rstd, weight, plan, needs)


def rms_norm_backward(
    dy: np.ndarray,
    x: np.ndarray,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    *,
    plan: Plan,
    needs: frozenset[str],
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``dx = rstd * (g - x̂ * mean(g * x̂))``, ``dweight = Σ dy * x̂`` with ``x̂ = x * rstd``."""
    dx, dweight, _ = _backward(dy, x, None, rstd, weight, plan, needs - {"bias"})
    return dx, dweight


def _backward(
    dy: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray | None,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    plan: Plan,
    needs: frozenset[str],
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """Both backward ops, block by block (``mean`` None: RMSNorm, no centring).

    ``x̂ = (x - mean - r) * rstd`` with ``r = mean(x - mean)`` the residual of a rounded mean.
    Blocks are whole chunks of :data:`~normlab.constants.ROW_CHUNK` rows; each chunk's column
    sums (float64) are kept and added chunk after chunk at the end. NaN and Inf propagate
    quietly, as in the forward.
    """
    with np.errstate(all="ignore"):
        return _backward_blocks(dy, x, mean, rstd, weight, plan, needs)


def _backward_blocks(
    dy: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray | None,
    rstd: np.ndarray,
    weight: np.ndarray | None,
    plan: Plan,
    needs: frozenset[str],
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    compute = np.dtype(plan.compute_dtype)
    rows, cols = plan.rows, plan.cols
    chunks = -(-rows // ROW_CHUNK)
    block = max(1, BLOCK_BYTES // (cols * compute.itemsize * ROW_CHUNK)) * ROW_CHUNK
    dx = np.empty((rows, cols), x.dtype) if "x" in needs else None
    w = None if weight is None else weight.astype(compute, copy=False)
    dw_parts = np.empty((chunks, cols)) if "weight" in needs else None
    db_parts = np.empty((chunks, cols)) if "bias" in needs else None
    size = min(block, rows)
    xhat, g, t = (np.empty((size, cols), compute) for _ in range(3))
    ones = np.ones(cols, compute)
    for start in range(0, rows, block):
        stop = min(start + block, rows)
        n = stop - start
        xb, gb, tb = xhat[:n], g[:n], t[:n]
        np.copyto(xb, x[start:stop], casting="unsafe")
        if mean is not None:
            xb -= mean[start:stop, None]
            residual = np.vecdot(xb, ones)[:, None]
            residual /= cols
            xb -= residual
        r = rstd[start:stop, None]
        xb *= r
        np.copyto(gb, dy[start:stop], casting="unsafe")
        first = start // ROW_CHUNK
        if db_parts is not None:
            _chunk_sums(gb, db_parts[first:])
        if dw_parts is not None:
            np.multiply(gb, xb, out=tb)
            _chunk_sums(tb, dw_parts[first:])
        if dx is None:
            continue
        if w is not None:
            gb *= w
        np.multiply(gb, xb, out=tb)
        mean_gx = np.vecdot(tb, ones)[:, None]
        mean_gx /= cols
        np.multiply(xb, mean_gx, out=tb)
        np.subtract(gb, tb, out=tb)
        if mean is not None:
            mean_g = np.vecdot(gb, ones)[:, None]
            mean_g /= cols
            tb -= mean_g
        tb *= r
        dx[start:stop] = tb
    return dx, _sum_chunks(dw_parts, compute), _sum_chunks(db_parts, compute)


def _chunk_sums(t: np.ndarray, parts: np.ndarray) -> None:
    """Column sums (float64) of each ROW_CHUNK rows of ``t`` into the first rows of ``parts``."""
    n, cols = t.shape
    whole = n // ROW_CHUNK
    chunks = t[: whole * ROW_CHUNK].reshape(whole, ROW_CHUNK, cols)
    np.add.reduce(chunks, axis=1, dtype=np.float64, out=parts[:whole])
    if n > whole * ROW_CHUNK:
        np.add.reduce(t[whole * ROW_CHUNK :], axis=0, dtype=np.float64, out=parts[whole])


def _sum_chunks(parts: np.ndarray | None, compute: np.dtype[Any]) -> np.ndarray | None:
    """The chunks' partial sums added in chunk order, rounded once to ``compute``."""
    if parts is None:
        return None
    total: np.ndarray = np.add.reduce(parts, axis=0).astype(compute)
    return total
