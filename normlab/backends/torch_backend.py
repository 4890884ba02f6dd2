"""The PyTorch backend: ``torch.nn.functional.layer_norm`` on CPU and CUDA, autograd kept.

Statistics for ``return_stats`` come from ``torch.native_layer_norm`` (the values that produced
``y``); where torch returns them in a half type they are recomputed from x in float32.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from normlab.spec import Plan

__all__ = ["from_numpy", "layer_norm", "rms_norm", "to_numpy"]

_TORCH_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, *, plan: Plan,
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
    if mean.dtype != stats_dtype:
        var, mean = torch.var_mean(x.detach().to(stats_dtype), dim=1, correction=0)
        rstd = torch.rsqrt(var + plan.eps)
    return y, mean.reshape(plan.rows), rstd.reshape(plan.rows)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: None, *, plan: Plan, out: Any = None,
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

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()


def from_numpy(a: np.ndarray, like: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor copy of a NumPy array, on ``like``'s device (bfloat16 via ml_dtypes)."""
    a = np.array(a, copy=True, order="C")
    if a.dtype.name == "bfloat16":
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t if like is None else t.to(like.device)
