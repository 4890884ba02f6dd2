"""The JAX kernels: one ``jax.jit``-compiled function per static configuration.

Each row of the 2-D ``(plan.rows, plan.cols)`` input is normalized independently::

    x0   = x[:, :1]                  the row's first element
    d    = mean(x - x0)              mean = x0 + d  (shifted two-pass: no E[x²] - E[x]²)
    var  = mean((x - x0 - d)^2)      population variance
    rstd = rsqrt(var + eps)
    y    = (x - x0 - d) * rstd * weight + bias

RMSNorm skips the centring: ``rstd = rsqrt(mean(x^2) + eps)``, ``y = x * rstd * weight``.
Everything is computed in float32 (float64 for float64 ``x``); float16/bfloat16 results are
rounded to x's dtype once, at the end. Statistics are float32, or float64 for float64 ``x``.

Row sums are pairwise trees of element-wise adds (:func:`row_mean`), not ``jnp.sum``: XLA picks
a reduction order by the shape of the whole batch, so a row's ``jnp.sum`` changes in its last
bits with the number of rows; the tree's order depends on the row length only.

float64 exists in JAX only when ``jax_enable_x64`` is on. In JAX's default mode every float64
input is already float32 by the time it is a ``jax.Array`` (JAX converts it on creation), so
such a call computes and returns float32; :func:`from_numpy` refuses float64 in that mode
rather than convert silently.

The function compiled for a configuration (op, weight given, bias given, ``return_stats``,
``eps``) is cached here; ``jax.jit`` caches the compiled code per shape, dtype and device.
The kernels are plain JAX and trace under ``jax.jit``, ``jax.grad`` and ``jax.vmap``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, TypeAlias

import jax
import jax.numpy as jnp
import normlab
import numpy as np

if TYPE_CHECKING:
    from normlab.spec import Plan

__all__ = ["from_numpy", "kernel", "layer_norm", "rms_norm", "row_mean", "to_numpy"]

Result: TypeAlias = tuple[jax.Array, jax.Array | None, jax.Array | None]
Kernel: TypeAlias = Callable[..., Result]

#: Compiled configurations kept; a process rarely uses more than a handful.
_KERNELS: Final = 256


@functools.lru_cache(maxsize=_KERNELS)
def kernel(op: str, has_weight: bool, has_bias: bool, return_stats: bool, eps: float) -> Kernel:
    """The jitted ``(x, [weight], [bias]) -> (y, mean, rstd)`` of one static configuration.

    ``x`` is 2-D; weight and bias, when present, are 1-D and passed in that order. ``mean`` and
    ``rstd`` are 1-D when ``return_stats``, else None; ``mean`` is always None for rms_norm.
    """
    centre = op == "layer_norm"

    def normalize(x: jax.Array, *params: jax.Array) -> Result:
        compute = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
        given = iter(params)
        weight = next(given) if has_weight else None
        bias = next(given) if has_bias else None
        xc = x.astype(compute)
        mean = None
        if centre:
            x0 = xc[:, :1]
            d = row_mean(xc - x0)
            xc = xc - x0 - d
            mean = x0 + d
        rstd = jax.lax.rsqrt(row_mean(xc * xc) + jnp.asarray(eps, compute))
        y = xc * rstd
        if weight is not None:
            y = y * weight.astype(compute)
        if bias is not None:
            y = y + bias.astype(compute)
        if not return_stats:
            return y.astype(x.dtype), None, None
        return y.astype(x.dtype), None if mean is None else mean[:, 0], rstd[:, 0]

    return jax.jit(normalize)


def row_mean(a: jax.Array) -> jax.Array:
    """The mean of each row of the 2-D ``a``, keepdims-shaped ``(rows, 1)``.

    Summed as a pairwise tree (element ``i`` plus element ``i + half``, an odd last element
    carried up), so the rounding of a row depends only on its length and its values: bitwise
    the same alone or in any batch, and the error grows with ``log2(cols)``.
    """
    cols = a.shape[1]
    while a.shape[1] > 1:
        half = a.shape[1] // 2
        pairs = a[:, :half] + a[:, half : 2 * half]
        a = pairs if a.shape[1] % 2 == 0 else jnp.concatenate([pairs, a[:, 2 * half :]], axis=1)
    return a / cols


def layer_norm(
    x: jax.Array,
    weight: jax.Array | None,
    bias: jax.Array | None,
    *,
    plan: Plan,
    out: None,
) -> Result:
    """Normalize each row of the 2-D ``x``; see :mod:`normlab.hookspecs` (``out`` is never
    passed: the record does not claim it)."""
    params = tuple(p for p in (weight, bias) if p is not None)
    run = kernel("layer_norm", plan.has_weight, plan.has_bias, plan.return_stats, plan.eps)
    return run(x, *params)


def rms_norm(
    x: jax.Array,
    weight: jax.Array | None,
    bias: None,
    *,
    plan: Plan,
    out: None,
) -> Result:
    """RMS-normalize each row of the 2-D ``x``: ``x / sqrt(mean(x^2) + eps) * weight``."""
    params = () if weight is None else (weight,)
    return kernel("rms_norm", plan.has_weight, False, plan.return_stats, plan.eps)(x, *params)


def to_numpy(a: jax.Array) -> np.ndarray:
    """A NumPy copy of ``a`` (bfloat16 stays bfloat16, as an ml_dtypes array)."""
    return np.array(a)


def from_numpy(a: np.ndarray, like: Any = None) -> jax.Array:
    """A ``jax.Array`` copy of ``a``, on ``like``'s device when given (else JAX's default).

    Raises DtypeError for float64 when JAX's x64 mode is off (JAX would make it float32).
    """
    if a.dtype == np.float64 and jax.dtypes.canonicalize_dtype(np.float64) != np.float64:
        raise normlab.DtypeError(
            "JAX has no float64 arrays unless x64 mode is on "
            "(jax.config.update('jax_enable_x64', True) or JAX_ENABLE_X64=1)"
        )
    device = None if like is None else next(iter(like.devices()))
    return jnp.array(a, device=device)
