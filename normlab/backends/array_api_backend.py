"""The Array API backend: any library whose arrays expose ``__array_namespace__``, computed with
that namespace's own functions only (nothing else is imported), on the array's own device.

Its record lists the pseudo-family :data:`~normlab.hookspecs.ARRAY_API` at the lowest priority:
it serves the arrays of libraries that no other backend serves, never NumPy, PyTorch, CuPy, JAX
or Dask arrays. Statistics are computed in ``plan.compute_dtype`` (float32 for float16) and the
rows-sized quantities in float64 where the array's device has it.

Forward, per row, with ``s`` a power of two (``x / s`` is exact)::

    s    = 2^floor(log2(max|x|))        1 for a row of zeros, or one holding NaN or Inf
    xs   = x / s                         the row's largest magnitude lies in [1, 2)
    d    = mean(xs - xs0)                xs0: the row's first element; mean = (xs0 + d) * s
    var  = mean((xs - xs0 - d)^2)        population variance of xs: no square over- or underflows
    f    = 1 / sqrt(var + eps / s^2)     the factor on xs's deviations; rstd = f / s
    y    = (xs - xs0 - d) * f * weight + bias

so a row anywhere in the dtype's finite range (subnormal values, values near its largest) is
normalized as a row of values near 1 would be. A row of equal values has deviations exactly 0:
with ``eps > 0`` it gives exactly ``bias`` and ``rstd = 1/sqrt(eps)``; with ``eps = 0`` its
result is NaN (``0 * inf``), as the contract says. RMSNorm runs the same without the centring.
NaN and Inf stay in their row. The backward ops follow :mod:`normlab.hookspecs`'s formulas, the
column sums of ``dweight``/``dbias`` taken in float64 (where the device has it).
"""

from __future__ import annotations

import math
from typing import Any, Final

from normlab.errors import DtypeError
from normlab.hookspecs import Plan

__all__ = [
    "from_numpy",
    "layer_norm",
    "layer_norm_backward",
    "rms_norm",
    "rms_norm_backward",
    "to_numpy",
]

#: Per compute dtype: the range of k in the row scale 2^k (its smallest subnormal to its
#: largest power of two), so that the scale itself is a finite, exact value of that dtype.
SCALE_EXPONENTS: Final = {"float32": (-149, 127), "float64": (-1074, 1023)}


def layer_norm(
    x: Any, weight: Any, bias: Any, *, plan: Plan, out: None
) -> tuple[Any, Any | None, Any | None]:
    """Normalize each row of the 2-D ``x``; see :mod:`normlab.hookspecs`."""
    return _normalize(x, weight, bias, plan, centre=True)


def rms_norm(x: Any, weight: Any, *, plan: Plan, out: None) -> tuple[Any, Any]:
    """RMS-normalize each row of the 2-D ``x``: ``x / sqrt(mean(x^2) + eps) * weight``."""
    y, _, rstd = _normalize(x, weight, None, plan, centre=False)
    return y, rstd


def _normalize(
    x: Any, weight: Any, bias: Any, plan: Plan, centre: bool
) -> tuple[Any, Any | None, Any | None]:
    """Both forward ops (``centre``: subtract the shifted, corrected two-pass mean, LayerNorm:
    ``m = x0 + mean(x - x0)`` rounded to the compute dtype, ``d = x - m``, ``mean = m +
    mean(d)``, ``var = mean(d^2) - mean(d)^2``, y from ``d - mean(d)``: the mean's error is
    at the scale of the row's spread, not of ``|x0 - mean|``)."""
    xp = x.__array_namespace__()
    compute = getattr(xp, plan.compute_dtype)
    wide = _wide_dtype(xp, x, compute)
    xs = xp.astype(x, compute)  # a copy: x is never written
    s = _row_scale(xp, xs, plan.compute_dtype, wide)
    xs = xs / xp.astype(s, compute)
    if centre:
        x0 = xs[:, :1]
        shift = x0 + xp.mean(xs - x0, axis=1, keepdims=True)
        t = xs - shift
        residual = xp.mean(t, axis=1, keepdims=True)
        square = xp.astype(xp.mean(t * t, axis=1, keepdims=True), wide)
        var = square - xp.astype(residual, wide) ** 2
        var = xp.where(var < 0, xp.zeros_like(var), var)  # a near-constant row (NaN stays)
        t = t - residual
    else:
        t = xs
        var = xp.astype(xp.mean(t * t, axis=1, keepdims=True), wide)
    factor, rstd = _factor_and_rstd(xp, var, s, plan.eps)
    y = t * xp.astype(factor, compute)
    if weight is not None:
        y = y * xp.astype(weight, compute)
    if bias is not None:
        y = y + xp.astype(bias, compute)
    y = xp.astype(y, x.dtype)
    if not plan.return_stats:
        return y, None, None
    stats = getattr(xp, plan.stats_dtype)
    mean = None
    if centre:
        mean = xp.astype((xp.astype(shift, wide) + xp.astype(residual, wide)) * s, stats)
        mean = xp.reshape(mean, (plan.rows,))
    return y, mean, xp.reshape(xp.astype(rstd, stats), (plan.rows,))


def _wide_dtype(xp: Any, x: Any, compute: Any) -> Any:
    """float64 where ``x``'s device has it, else the compute dtype."""
    try:
        floats = xp.__array_namespace_info__().dtypes(device=x.device, kind="real floating")
    except (AttributeError, TypeError):  # a namespace older than the 2023.12 standard
        floats = {"float64": xp.float64} if hasattr(xp, "float64") else {}
    return floats.get("float64", compute)


def _row_scale(xp: Any, xs: Any, compute_name: str, wide: Any) -> Any:
    """Per row of the 2-D ``xs`` (keepdims, in ``wide``): ``2^k`` with the row's largest
    magnitude / 2^k in about [1, 2), k within :data:`SCALE_EXPONENTS`; 1 for a row of zeros or
    one holding NaN or Inf."""
    largest = xp.astype(xp.max(xp.abs(xs), axis=1, keepdims=True), wide)
    ones = xp.ones_like(largest)
    usable = xp.isfinite(largest) & (largest > 0)
    low, high = SCALE_EXPONENTS[compute_name]
    k = xp.floor(xp.log2(xp.where(usable, largest, ones)))
    k = xp.minimum(xp.maximum(k, ones * low), ones * high)
    return xp.where(usable, xp.pow(ones * 2.0, k), ones)


def _factor_and_rstd(xp: Any, var: Any, s: Any, eps: float) -> tuple[Any, Any]:
    """The factor ``f = 1/sqrt(var + eps/s^2)`` on a row's scaled deviations, and ``rstd =
    f / s``, both in ``var``'s dtype (keepdims). A row with ``var = 0`` has deviations exactly
    0: its factor is 1 when ``eps > 0`` (so ``y = bias``), inf when ``eps = 0`` (``y`` NaN), and
    its ``rstd`` is ``1/sqrt(eps)``. Where ``eps/s^2`` would overflow, the variance is
    negligible beside it: ``f = s/sqrt(eps)``."""
    if eps == 0:
        factor = 1 / xp.sqrt(var)
        return factor, factor / s
    info = xp.finfo(var.dtype)
    ones = xp.ones_like(var)
    s_min = math.sqrt(eps / float(info.max)) * 2  # below it, eps / s^2 would overflow
    small = s < s_min
    s_clamped = xp.maximum(s, ones * s_min)
    total = var + eps / s_clamped / s_clamped
    total = xp.where(total == 0, ones, total)  # var = 0 and eps/s^2 underflowed: y = bias
    factor = xp.where(small, s * (1 / math.sqrt(eps)), 1 / xp.sqrt(total))
    rstd = xp.where(var == 0, ones * (1 / math.sqrt(eps)), factor / s)
    return factor, rstd


# --------------------------------------------------------------------------------------------
# Backward (see :mod:`normlab.hookspecs` for the contract).


def layer_norm_backward(
    dy: Any, x: Any, mean: Any, rstd: Any, weight: Any, *, plan: Plan, needs: frozenset[str]
) -> tuple[Any | None, Any | None, Any | None]:
    """``dx = rstd * (g - mean(g) - x̂ * mean(g * x̂))``, ``dweight = Σ dy * x̂``, ``dbias = Σ dy``
    with ``x̂ = (x - mean) * rstd``, ``g = dy * weight``."""
    return _backward(dy, x, mean, rstd, weight, plan, needs)


def rms_norm_backward(
    dy: Any, x: Any, rstd: Any, weight: Any, *, plan: Plan, needs: frozenset[str]
) -> tuple[Any | None, Any | None]:
    """``dx = rstd * (g - x̂ * mean(g * x̂))``, ``dweight = Σ dy * x̂`` with ``x̂ = x * rstd``."""
    dx, dweight, _ = _backward(dy, x, None, rstd, weight, plan, needs - {"bias"})
    return dx, dweight


def _backward(
    dy: Any,
    x: Any,
    mean: Any | None,
    rstd: Any,
    weight: Any,
    plan: Plan,
    needs: frozenset[str],
) -> tuple[Any | None, Any | None, Any | None]:
    """Both backward ops (``mean`` None: RMSNorm). ``x̂ = (x - mean - r) * rstd`` with ``r =
    mean(x - mean)``, the residual of a rounded mean."""
    xp = x.__array_namespace__()
    compute = getattr(xp, plan.compute_dtype)
    wide = _wide_dtype(xp, x, compute)
    rows = (plan.rows, 1)
    xhat = xp.astype(x, compute)
    if mean is not None:
        xhat = xhat - xp.reshape(xp.astype(mean, compute), rows)
        xhat = xhat - xp.mean(xhat, axis=1, keepdims=True)
    r = xp.reshape(xp.astype(rstd, compute), rows)
    xhat = xhat * r
    g = xp.astype(dy, compute)
    dbias = _column_sums(xp, g, compute, wide) if "bias" in needs else None
    dweight = _column_sums(xp, g * xhat, compute, wide) if "weight" in needs else None
    if "x" not in needs:
        return None, dweight, dbias
    if weight is not None:
        g = g * xp.astype(weight, compute)
    t = g - xhat * xp.mean(g * xhat, axis=1, keepdims=True)
    if mean is not None:
        t = t - xp.mean(g, axis=1, keepdims=True)
    return xp.astype(t * r, x.dtype), dweight, dbias


def _column_sums(xp: Any, a: Any, compute: Any, wide: Any) -> Any:
    """The sums over the rows of ``a``, taken in ``wide`` and rounded once to ``compute``."""
    return xp.astype(xp.sum(a, axis=0, dtype=wide), compute)


# --------------------------------------------------------------------------------------------
# The conformance suite's converters: it drives this backend with array_api_strict arrays.


def to_numpy(a: Any) -> Any:
    """``a`` as a NumPy array (through DLPack)."""
    import numpy as np

    return np.from_dlpack(a).copy()


def from_numpy(a: Any, like: Any = None) -> Any:
    """A copy of the NumPy array ``a`` in ``like``'s namespace, on its device; without ``like``
    an ``array_api_strict`` array (the Array API's reference client). A dtype the namespace
    lacks (array_api_strict has no float16) is a :class:`DtypeError`."""
    if like is None:
        try:
            import array_api_strict
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(
                "the array_api backend's test arrays are array_api_strict arrays: "
                "pip install array-api-strict"
            ) from exc
    try:
        if like is not None:
            return like.__array_namespace__().asarray(a, device=like.device, copy=True)
        return array_api_strict.asarray(a, copy=True)
    except TypeError as exc:  # the namespace has no such dtype
        raise DtypeError(f"cannot make {a.dtype} arrays of this Array API library: {exc}") from exc
