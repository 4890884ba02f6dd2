"""The PyTorch backend: ``torch.nn.functional.layer_norm`` on CPU and CUDA, autograd kept.

float16/bfloat16 rows are widened to float32 before torch's kernel (torch's own half-precision
CPU kernel does not give exactly ``bias`` on constant rows) and rounded once at the end.
Statistics for ``return_stats`` come from ``torch.native_layer_norm`` (the values that produced
``y``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

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
    compute = _TORCH_DTYPES[plan.compute_dtype]
    wide = x.to(compute)
    weight = None if weight is None else weight.to(compute)
    bias = None if bias is None else bias.to(compute)
    shape = (plan.cols,)
    if not plan.return_stats:
        y = torch.nn.functional.layer_norm(wide, shape, weight, bias, plan.eps)
        return y.to(x.dtype), None, None
    y, mean, rstd = torch.native_layer_norm(wide, shape, weight, bias, plan.eps)
    return y.to(x.dtype), mean.reshape(plan.rows), rstd.reshape(plan.rows)


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
# again, on CPU and CUDA. Column sums are pairwise trees of elementwise additions (no torch
# reduction kernel, whose split of the work may follow the thread count): bitwise repeatable.


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
    """Both backward ops (``mean`` None: RMSNorm); ``x̂ = (x - mean - r) * rstd`` with
    ``r = mean(x - mean)``, the residual of a rounded mean."""
    compute = _TORCH_DTYPES[plan.compute_dtype]
    r = rstd.to(compute)[:, None]
    xhat = x.to(compute)
    if mean is not None:
        xhat = xhat - mean.to(compute)[:, None]
        xhat = xhat - xhat.mean(dim=1, keepdim=True)
    xhat = xhat * r
    dyc = dy.to(compute)
    dx = None
    if "x" in needs:
        g = dyc if weight is None else dyc * weight.to(compute)
        t = g - xhat * (g * xhat).mean(dim=1, keepdim=True)
        if mean is not None:
            t = t - g.mean(dim=1, keepdim=True)
        dx = (t * r).to(x.dtype)
    dweight = _column_sum(dyc * xhat) if "weight" in needs else None
    dbias = _column_sum(dyc) if "bias" in needs else None
    return dx, dweight, dbias


def _column_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of the rows of the 2-D ``t`` (a new tensor): the first ``n // 2`` rows are added
    to the last ``n // 2`` (an odd middle row carried along) until one row is left; the order
    depends on the shape alone."""
    if t.shape[0] == 1:
        return t[0].clone()
    while t.shape[0] > 1:
        half = t.shape[0] // 2
        head = t[:half] + t[t.shape[0] - half :]
        t = torch.cat((head, t[half : t.shape[0] - half])) if t.shape[0] % 2 else head
    return t[0]
