"""The PyTorch backend: ``torch.nn.functional.layer_norm`` on CPU and CUDA, autograd kept.

This backend is torch's own kernel, with torch's numerics: for float16/bfloat16 it accumulates
in float32 and rounds once, but a constant half-precision row gives ``bias`` only to within a
float16 rounding (torch's vectorised statistics), not exactly as normlab's own kernels do;
the conformance run records that deviation. Statistics for ``return_stats`` come from
``torch.native_layer_norm`` (the values that produced ``y``), recomputed in float32 where a
device returns them in a half type.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from normlab.backward import ROW_CHUNK
from normlab.spec import Plan

__all__ = [
    "from_numpy",
    "layer_norm",
    "layer_norm_backward",
    "rms_norm",
    "rms_norm_backward",
    "to_numpy",
]

_TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    plan: Plan,
    out: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Normalize each row of the 2-D tensor ``x``; see :mod:`normlab.hookspecs`."""
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        weight, bias = weight.float(), bias.float()  # torch wants one parameter dtype
    shape = (plan.cols,)
    if not plan.return_stats:
        return torch.nn.functional.layer_norm(x, shape, weight, bias, plan.eps), None, None
    y, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, plan.eps)
    stats_dtype = _TORCH_DTYPES[plan.stats_dtype]
    if mean.dtype != stats_dtype:  # a half-precision result on some devices: recompute
        var, mean = torch.var_mean(x.detach().to(stats_dtype), dim=1, correction=0)
        rstd = torch.rsqrt(var + plan.eps)
    return y, mean.reshape(plan.rows), rstd.reshape(plan.rows)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: None,
    *,
    plan: Plan,
    out: Any = None,
) -> tuple[torch.Tensor, None, torch.Tensor | None]:
    """``torch.nn.functional.rms_norm`` on the 2-D ``x``; rstd recomputed in float32/64."""
    if weight is not None and weight.dtype != x.dtype:  # float32 weight, half x: widen x
        y = torch.nn.functional.rms_norm(x.float(), (plan.cols,), weight, plan.eps).to(x.dtype)
    else:
        y = torch.nn.functional.rms_norm(x, (plan.cols,), weight, plan.eps)
    if not plan.return_stats:
        return y, None, None
    wide = x.detach().to(_TORCH_DTYPES[plan.stats_dtype])
    rstd = torch.rsqrt(wide.square().mean(dim=1) + plan.eps)
    return y, None, rstd


def to_numpy(a: torch.Tensor) -> np.ndarray:
    """A NumPy copy of a tensor (bfloat16 via ml_dtypes)."""
    t = a.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        bits: np.ndarray = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
        return bits
    values: np.ndarray = t.numpy().copy()
    return values


def from_numpy(a: np.ndarray, like: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor copy of a NumPy array, on ``like``'s device (bfloat16 via ml_dtypes)."""
    a = np.array(a, copy=True, order="C")
    if a.dtype.name == "bfloat16":
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t if like is None else t.to(like.device)


# --------------------------------------------------------------------------------------------
# Backward (see :mod:`normlab.backward` for the contract), in torch operations: differentiable
# again, on CPU and CUDA. Column sums are bitwise repeatable: fixed chunks of ROW_CHUNK rows
# (each chunk's sum is one output of a torch reduction, computed by one thread), then a pairwise
# tree of elementwise float64 additions over the chunks; nothing depends on the thread count.
# On CPU this is the portable path, not the fast one (numba is): every operation allocates.


def layer_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    *,
    plan: Plan,
    needs: frozenset[str],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``dx = rstd * (g - mean(g) - x̂ * mean(g * x̂))``, ``dweight = Σ dy * x̂``, ``dbias = Σ dy``
    with ``x̂ = (x - mean) * rstd``, ``g = dy * weight``; see :mod:`normlab.backward`."""
    return _backward(dy, x, mean, rstd, weight, plan, needs)


def rms_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    *,
    plan: Plan,
    needs: frozenset[str],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``dx = rstd * (g - x̂ * mean(g * x̂))``, ``dweight = Σ dy * x̂`` with ``x̂ = x * rstd``."""
    dx, dweight, _ = _backward(dy, x, None, rstd, weight, plan, needs - {"bias"})
    return dx, dweight


def _backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    weight: torch.Tensor | None,
    plan: Plan,
    needs: frozenset[str],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Both backward ops (``mean`` None: RMSNorm), with ``d = x - mean`` and its residual
    ``res = mean(d)`` (the rounding of a float32 mean), so that ``x̂ = (d - res) * r``::

        mean(g * x̂) = r * (mean(g * d) - res * mean(g))
        dx = r * g + b * d + c     b = -r^2 * mean(g * x̂),  c = -b * res - r * mean(g)

    (RMSNorm: ``d = x``, ``res = 0``, no ``mean(g)``): two full-size passes for dx."""
    compute = _TORCH_DTYPES[plan.compute_dtype]
    r = rstd.to(compute)[:, None]
    d = x.to(compute)
    res = None
    if mean is not None:
        d = d - mean.to(compute)[:, None]
        res = d.mean(dim=1, keepdim=True)
    dyc = dy.to(compute)
    dx = None
    if "x" in needs:
        g = dyc if weight is None else dyc * weight.to(compute)
        mean_gd = (g * d).mean(dim=1, keepdim=True)
        if res is None:
            b = -r * r * (r * mean_gd)
            dx = torch.addcmul(b * d, r, g)
        else:
            mean_g = g.mean(dim=1, keepdim=True)
            b = -r * r * (r * (mean_gd - res * mean_g))
            dx = torch.addcmul(torch.addcmul(-b * res - r * mean_g, b, d), r, g)
        dx = dx.to(x.dtype)
    dweight = dbias = None
    if "weight" in needs:
        xhat = d * r if res is None else torch.addcmul(-res * r, d, r)
        dweight = _column_sum(dyc * xhat)
    if "bias" in needs:
        dbias = _column_sum(dyc)
    return dx, dweight, dbias


def _column_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of the rows of the 2-D ``t``, in ``t``'s dtype: sums of chunks of ROW_CHUNK rows,
    then pairwise in float64 over the chunks (the first half added to the second half, an odd
    middle chunk carried along, until one is left)."""
    rows, cols = t.shape
    whole = rows - rows % ROW_CHUNK
    parts = [t[:whole].reshape(-1, ROW_CHUNK, cols).sum(dim=1)]
    if whole < rows:
        parts.append(t[whole:].sum(dim=0, keepdim=True))
    total = torch.cat(parts).to(torch.float64)
    while total.shape[0] > 1:
        n, half = total.shape[0], total.shape[0] // 2
        head = total[:half] + total[n - half :]
        total = torch.cat((head, total[half : n - half])) if n % 2 else head
    return total[0].to(t.dtype)
