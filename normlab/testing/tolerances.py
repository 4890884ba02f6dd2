"""How close a backend's result must be to the float64 reference: one table, per dtype.

An element of ``y`` may differ from the reference by::

    compute * (conditioning + sqrt(cols)) * (|weight| * (1 + |z|) + |bias|)    the arithmetic
    + rounding * |y_ref|                                     one rounding to x's dtype at the end
    + floor                                                  half a subnormal step, at least

(For a backend whose record declares ``flushes_subnormals`` the floor is the dtype's smallest
normal number instead: a subnormal result may come back as zero.)

where ``z = (x - mean) * rstd`` is the normalized value and ``conditioning = 1 + |mean| * rstd``
is the row's condition number (``rstd = 1/sqrt(var + eps)``): a kernel works with ``x - mean``,
whose rounding error grows with ``|mean|`` relative to the spread of the row. ``sqrt(cols)``
allows for the growth of rounding error in sums: the typical growth of sequential or Welford
accumulation (pairwise and blocked sums grow more slowly). ``mean`` may differ by
``compute * (conditioning + sqrt(cols)) / rstd``, ``rstd`` relatively by
``compute * (conditioning + sqrt(cols))``. ``compute`` is about 8 units of roundoff of the
accumulation dtype (float32 for float16, bfloat16 and float32; float64 for float64): a correct
float32 kernel errs near 1e-3 on ``100 + 0.01·randn`` (conditioning 1e4), and is allowed 5e-3.

RMSNorm (``y = x * rstd * weight``, ``rstd = 1/sqrt(mean(x^2) + eps)``) uses the same table with
``conditioning = 1`` and no bias, and its error is relative to the element itself: the scale is
``|weight| * |z|`` with ``z = x * rstd``, not ``|weight| * (1 + |z|)``. The derivation:

- ``mean(x^2)`` sums non-negative terms, so its rounding error is relative to the sum itself
  (condition number 1, whatever the values): each square and each addition rounds once, and the
  error grows like ``sqrt(cols)`` roundoffs of the accumulation dtype (the same growth as above);
  nothing cancels, so there is no ``|mean| * rstd`` term.
- ``rstd`` takes half of that relative error through the square root, plus an ulp or two for
  adding eps, the root and the quotient: within ``compute * (1 + sqrt(cols))`` relatively.
- ``y = x * rstd * weight`` adds two products' roundings, relative to ``|y|``, then the one
  rounding to x's dtype. No term is absolute: an element's error vanishes with the element
  (LayerNorm's ``1 +`` comes from the error of the mean, shared by a whole row; RMSNorm has none).

The backward uses the same table (:func:`gradient_scales`). With ``x̂`` the normalized value and
``g = dy * weight``, ``dx = rstd * (g - mean(g) - x̂ * mean(g * x̂))`` (RMSNorm: no ``mean(g)``)
is allowed ``compute * (conditioning + sqrt(cols))`` times::

    rstd * (|g| + mean(|g|) + (1 + |x̂|) * mean(|g| * (1 + |x̂|)))     RMSNorm: |x̂| for 1 + |x̂|

— the row means are bounded by the means of absolute values, since their sums may cancel — plus
one rounding to x's dtype. ``dweight = Σ dy * x̂`` and ``dbias = Σ dy`` sum over rows terms whose
``x̂`` carries its row's error: their scales are ``Σ |dy| * (1 + |x̂|)`` (RMSNorm ``Σ |dy| * |x̂|``)
and ``Σ |dy|``, the conditioning that of the worst row, and the growth
``sqrt(cols) + sqrt(rows)`` (the sum over rows adds its own); then one rounding to the dtype of
the gradient (weight's, or x's without weight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from normlab.reference import to_float64

__all__ = [
    "TOLERANCES",
    "Tolerance",
    "allowed_error",
    "assert_close",
    "conditioning",
    "gradient_scales",
    "y_scale",
]


@dataclass(frozen=True, slots=True)
class Tolerance:
    """The error allowed for inputs of one dtype (see the module docstring for the formula)."""

    compute: float  # per unit of (conditioning + sqrt(cols)); 8 roundoffs of the accumulation
    rounding: float  # unit roundoff of the result dtype: y is rounded once, at the end
    floor: float  # absolute: the smallest subnormal of the result dtype
    normal: float  # the floor where subnormals flush to zero: the smallest normal number


TOLERANCES: Final[dict[str, Tolerance]] = {
    # dtype:             compute        rounding   floor       normal
    "float16": Tolerance(8 * 2.0**-24, 2.0**-11, 2.0**-24, 2.0**-14),
    "bfloat16": Tolerance(8 * 2.0**-24, 2.0**-8, 2.0**-133, 2.0**-126),
    "float32": Tolerance(8 * 2.0**-24, 2.0**-24, 2.0**-149, 2.0**-126),
    "float64": Tolerance(8 * 2.0**-53, 2.0**-53, 2.0**-1074, 2.0**-1022),
}

#: Statistics are float32 (float64 for float64 x): they are never rounded to a half type.
_STATS_DTYPE: Final = {"float16": "float32", "bfloat16": "float32"}
_STATISTICS: Final = frozenset({"mean", "rstd"})


def conditioning(mean: Any, rstd: Any) -> np.ndarray:
    """``1 + |mean| * rstd`` per row, from the reference statistics (keepdims-shaped); 1 for
    RMSNorm, which subtracts no mean (``mean=None``)."""
    rstd64 = to_float64(rstd)
    if mean is None:
        return np.ones_like(rstd64)
    result: np.ndarray = 1.0 + np.abs(to_float64(mean)) * rstd64
    return result


def y_scale(op: str, z: Any, weight: Any = None, bias: Any = None) -> np.ndarray:
    """What the arithmetic error of an element of y is proportional to (``scale`` of
    :func:`allowed_error`): ``|weight| * (1 + |z|) + |bias|`` for ``"layer_norm"`` and
    ``|weight| * |z|`` for ``"rms_norm"`` (see the module docstring). ``z`` is the reference's
    normalized value; ``weight``/``bias`` broadcast against it (None: absent)."""
    magnitude = np.abs(to_float64(z))
    w = 1.0 if weight is None else np.abs(to_float64(weight))
    if op == "rms_norm":
        rms_scale: np.ndarray = w * magnitude
        return rms_scale
    b = 0.0 if bias is None else np.abs(to_float64(bias))
    scale: np.ndarray = w * (1.0 + magnitude) + b
    return scale


def gradient_scales(
    op: str, dy: np.ndarray, xhat: np.ndarray, g: np.ndarray, rstd: np.ndarray
) -> dict[str, np.ndarray]:
    """What the arithmetic errors of the gradients are proportional to (see the module
    docstring): ``{"x": (rows, cols), "weight": (cols,), "bias": (cols,)}`` from the float64
    rows ``dy``, ``xhat``, ``g`` (``(rows, cols)``) and ``rstd`` (``(rows, 1)``); ``op`` is
    ``"layer_norm"`` or ``"rms_norm"``."""
    spread = np.abs(xhat) if op == "rms_norm" else 1.0 + np.abs(xhat)
    size = np.abs(g)
    row_mean = 0.0 if op == "rms_norm" else size.mean(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", over="ignore"):
        dx = rstd * (size + row_mean + spread * (size * spread).mean(axis=1, keepdims=True))
        return {
            "x": dx,
            "weight": (np.abs(dy) * spread).sum(axis=0),
            "bias": np.abs(dy).sum(axis=0),
        }


def allowed_error(
    expected: Any,
    dtype: str,
    conditioning: Any,
    *,
    what: str,
    cols: int,
    scale: Any = None,
    rows: int = 0,
    flushed: bool = False,
) -> np.ndarray:
    """The largest error allowed per element (see the module docstring).

    ``what`` is ``"y"``, ``"mean"`` or ``"rstd"``, or a gradient (``"dx"``, ``"dweight"``,
    ``"dbias"``); the statistics are rounded to float32 (or float64), the others to ``dtype``.
    ``scale`` is what the arithmetic error of an element is proportional to: :func:`y_scale`
    for ``y``, ``1/rstd`` for ``mean``, ``rstd`` for ``rstd``, :func:`gradient_scales` for the
    gradients; by default ``1 + |expected|``. ``rows``: the number of rows summed into each
    element (dweight, dbias), which adds ``sqrt(rows)`` to the growth. ``flushed``: the
    backend flushes subnormals to zero (its record's ``flushes_subnormals``), so the absolute
    floor is the smallest normal number.
    """
    expected64 = to_float64(expected)
    tol = TOLERANCES[_STATS_DTYPE.get(dtype, dtype) if what in _STATISTICS else dtype]
    compute = TOLERANCES[dtype].compute
    magnitude = 1.0 + np.abs(expected64) if scale is None else to_float64(scale)
    growth = math.sqrt(cols) + math.sqrt(rows)
    with np.errstate(invalid="ignore", over="ignore"):
        allowed: np.ndarray = (
            compute * (to_float64(conditioning) + growth) * magnitude
            + tol.rounding * np.abs(expected64)
            + (tol.normal if flushed else tol.floor)
        )
    return allowed


def assert_close(
    actual: Any,
    expected: Any,
    dtype: str,
    conditioning: Any,
    *,
    what: str,
    cols: int,
    scale: Any = None,
    rows: int = 0,
    flushed: bool = False,
    repro: str = "",
) -> None:
    """Assert ``actual`` (NumPy) is within :func:`allowed_error` of the float64 ``expected``.

    NaN must meet NaN and an infinity the same infinity. The failure message shows the worst
    element, how many are off, and ``repro`` (a runnable snippet reproducing the case).
    """
    got = to_float64(actual)
    want = to_float64(expected)
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {got.shape}, expected {want.shape}\n{repro}")
    allowed = np.broadcast_to(
        allowed_error(
            want, dtype, conditioning, what=what, cols=cols, scale=scale, rows=rows, flushed=flushed
        ),
        want.shape,
    )
    with np.errstate(invalid="ignore"):
        error = np.abs(got - want)
        same_special = (np.isnan(got) & np.isnan(want)) | (np.isinf(want) & (got == want))
        bad = ~same_special & ~(error <= allowed)
    if not bad.any():
        return
    where = np.argwhere(bad)
    worst = tuple(int(i) for i in where[np.argmax(np.nan_to_num(error[bad], nan=np.inf))])
    cond = float(np.broadcast_to(to_float64(conditioning), want.shape)[worst])
    raise AssertionError(
        f"{what} ({dtype}): {int(bad.sum())} of {bad.size} elements off; worst at index "
        f"{worst}: got {float(got[worst])!r}, expected {float(want[worst])!r}, error "
        f"{error[worst]:.3g}, allowed {allowed[worst]:.3g} (conditioning {cond:.3g})\n{repro}"
    )
