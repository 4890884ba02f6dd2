"""The JAX kernels: one ``jax.jit``-compiled function per static configuration.

Each row of the 2-D ``(plan.rows, plan.cols)`` input is normalized independently, on the
row divided by a power of two ``s`` (:func:`row_scale`: its largest magnitude / s in [1, 2)),
so that no sum or square overflows, whatever the row's magnitude::

    xs   = x / s                     exact: a power of two
    x0   = xs[:, :1]                 the row's first element
    m    = x0 + mean(xs - x0)        shifted estimate (a constant row: exactly x0)
    m    = m + mean(xs - m)          corrected two-pass mean / s, rounded once
    v    = mean((xs - m)^2)          population variance / s^2
    rstd = rsqrt(v + eps / s^2) / s
    y    = (xs - m) * rsqrt(v + eps / s^2) * weight + bias

``xs - m`` is rounded once, at the scale of the output: a small output is as accurate as its
own magnitude allows. The correction is needed: the shifted estimate alone puts small outputs
up to 3.9 times the suite's float32 tolerance off (2048 standard normal rows of 768) where a
row's first element lies far from its mean, as the sum of ``xs - x0`` rounds at that scale.

RMSNorm skips the centring: ``v = mean(xs^2)``, ``y = xs * rsqrt(v + eps / s^2) * weight``.
Two kinds of row take ``rstd = rsqrt(eps)`` directly (:func:`_factors`): a constant row
(``v`` exactly 0: its ``y`` is exactly ``bias`` when eps > 0, NaN when eps = 0), and a row so
tiny that ``eps / s^2`` overflows (eps dwarfs its variance).
Everything is computed in float32 (float64 for float64 ``x``); float16/bfloat16 results are
rounded to x's dtype once, at the end. Statistics are float32, or float64 for float64 ``x``.

XLA on the CPU flushes subnormal inputs and results to zero, whatever its flags
(``--xla_cpu_ftz=false`` and ``--xla_cpu_enable_fast_math=false`` leave the processor's
flush-to-zero mode on); the record therefore declares ``flushes_subnormals``. Scaling keeps
every row of normal values accurate, rows near the dtype's max included.

Batch invariance (a row's bits alone and in any batch) rests on two rules:

- Row sums are pairwise trees of element-wise adds (:func:`row_mean`), not ``jnp.sum``: XLA
  picks a reduction order by the shape of the whole batch, so a row's ``jnp.sum`` changes in its
  last bits with the number of rows; the tree's order depends on the row length only.
- Every product that rounds is added to an exact zero XLA cannot fold (:func:`rounded`) before
  an add or a subtraction uses it. XLA compiles with fused multiply-add contraction on: LLVM
  turns ``a * b + c`` into one ``fma`` (one rounding instead of two) wherever the product and
  the add end up in one basic block, and that follows XLA's fusion and LLVM's hoisting, which
  follow the batch's shape (a statistic recomputed inside several fusions, a loop-invariant
  product hoisted out of a one-row kernel). Unguarded, the corrected mean came out an ulp
  apart for about one float32 row in four called alone (2048 rows of 768). ``a * b + 0``
  contracts to ``fma(a, b, 0)``, the product rounded: the same bits either way. Products by
  powers of two (``x / s``, ``eps / s^2``, ``rstd``) are exact and need no guard.

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
    from normlab.hookspecs import Plan

__all__ = [
    "from_numpy",
    "kernel",
    "layer_norm",
    "rms_norm",
    "rounded",
    "row_mean",
    "row_scale",
    "to_numpy",
]

Result: TypeAlias = tuple[jax.Array, jax.Array | None, jax.Array | None]
Kernel: TypeAlias = Callable[..., Result]

#: Compiled configurations kept; a process rarely uses more than a handful.
_KERNELS: Final = 256
#: Per compute dtype: the integer type of its bits, its mantissa bits, its exponent bias.
_BITS: Final = {"float32": (jnp.int32, 23, 127), "float64": (jnp.int64, 52, 1023)}


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
        s, inv = row_scale(xc)
        zero = s * 0  # an exact zero per row (s is a finite power of two) XLA cannot fold
        xs = xc * inv
        mean = None
        if centre:
            x0 = xs[:, :1]
            m = x0 + row_mean(xs - x0, zero)
            m = m + row_mean(xs - m, zero)
            xs = xs - m
            mean = m * s
        v = row_mean(rounded(xs * xs, zero), zero)
        factor, rstd = _factors(v, jnp.asarray(eps, compute), s, inv)
        y = xs * factor
        if weight is not None:
            y = y * weight.astype(compute)
        if bias is not None:
            y = rounded(y, zero) + bias.astype(compute)
        if not return_stats:
            return y.astype(x.dtype), None, None
        return y.astype(x.dtype), None if mean is None else mean[:, 0], rstd[:, 0]

    return jax.jit(normalize)


def row_scale(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(s, 1/s)`` per row of the 2-D float32 or float64 ``x``, keepdims: the power of two
    ``s = 2^k`` with the row's largest magnitude / s in [1, 2), k clamped to the dtype's normal
    exponents (so that s and 1/s are normal numbers); s = 1 for a row of zeros.

    k is read from the bits of the largest magnitude, and s built from bits: exact, and cheap
    (one max per row)."""
    ints, mantissa, bias = _BITS[x.dtype.name]
    largest = jax.lax.bitcast_convert_type(jnp.max(jnp.abs(x), axis=1, keepdims=True), ints)
    k = jnp.clip((largest >> mantissa) - bias, 1 - bias, bias - 1)  # Inf/NaN: the top clamp
    k = jnp.where(largest == 0, 0, k)

    def power_of_two(e: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type((e + bias) << mantissa, x.dtype)

    return power_of_two(k), power_of_two(-k)


def _factors(
    v: jax.Array, eps: jax.Array, s: jax.Array, inv: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``(factor, rstd)`` per row, from ``v`` (the variance of the row divided by ``s``) and eps:
    ``y = (x - mean) / s * factor``; ``rstd = 1 / sqrt(v * s^2 + eps)``, the row's own."""
    eps_scaled = eps * inv * inv
    dwarfed = ~jnp.isfinite(eps_scaled)  # the row is so tiny that eps / s^2 overflows
    flat = v == 0  # a constant row: variance exactly 0, rstd = 1/sqrt(eps)
    rstd_eps = jax.lax.rsqrt(eps)
    scaled = jax.lax.rsqrt(v + jnp.where(dwarfed, 0, eps_scaled))
    factor = jnp.where(flat, rstd_eps, jnp.where(dwarfed, s * rstd_eps, scaled))
    rstd = jnp.where(flat | dwarfed, rstd_eps, scaled * inv)
    return factor, rstd


def row_mean(a: jax.Array, zero: jax.Array) -> jax.Array:
    """The mean of each row of the 2-D ``a``, keepdims-shaped ``(rows, 1)``, :func:`rounded`
    with ``zero``.

    Summed as a pairwise tree (element ``i`` plus element ``i + half``, an odd last element
    carried up), so the rounding of a row depends only on its length and its values: bitwise
    the same alone or in any batch, and the error grows with ``log2(cols)``.
    """
    cols = a.shape[1]
    while a.shape[1] > 1:
        half = a.shape[1] // 2
        pairs = a[:, :half] + a[:, half : 2 * half]
        a = pairs if a.shape[1] % 2 == 0 else jnp.concatenate([pairs, a[:, 2 * half :]], axis=1)
    return rounded(a / cols, zero)  # XLA divides by a constant through its reciprocal


def rounded(product: jax.Array, zero: jax.Array) -> jax.Array:
    """``product`` (a result that rounds) plus ``zero``, an exact zero XLA cannot fold: the same
    bits whether or not LLVM contracts the two into ``fma``, and no longer a product that it
    could contract with the add or subtraction that uses it."""
    return product + zero


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
