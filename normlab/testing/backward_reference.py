"""The float64 oracles of the backward ops (:mod:`normlab.reference` holds the forward ones).

:func:`gradients` evaluates the closed-form gradients (the formula of :mod:`normlab.hookspecs`)
from exact float64 statistics, with the scales the tolerances need; :func:`autograd` gets the
same gradients independently, by torch.autograd through a float64 forward written out in torch
operations (None when torch is not installed). The suite checks both against central
differences of the backend's forward.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import numpy as np

from normlab import reference
from normlab.constants import MACHINE_EPS, stats_dtype_for
from normlab.testing.tolerances import gradient_scales

__all__ = ["Expected", "autograd", "gradients"]


@dataclass(frozen=True)
class Expected:
    """Exact gradients of one backward call and what their tolerances scale with.

    ``gradients`` and ``scales``: ``"x"`` in x's shape, ``"weight"`` and ``"bias"`` in the
    normalized shape (RMSNorm has no ``"bias"``). ``conditioning``: per element of x, its
    row's ``1 + |mean| * rstd`` (1 for RMSNorm).
    """

    gradients: dict[str, np.ndarray]
    scales: dict[str, np.ndarray]
    conditioning: np.ndarray


def _eps(op: str, x: np.ndarray, eps: float | None) -> float:
    """eps as the forward used it: rms_norm's None is finfo(compute dtype).eps."""
    if eps is None:
        if op != "rms_norm":
            raise ValueError("layer_norm needs an eps")
        return MACHINE_EPS[stats_dtype_for(x.dtype.name)]
    return eps


def _rows(a: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """``a`` as float64 2-D rows: batch axes first, then the normalized ``axes``."""
    batch = tuple(i for i in range(a.ndim) if i not in axes)
    cols = int(np.prod([a.shape[i] for i in axes], dtype=np.int64))
    return reference.to_float64(a).transpose(batch + axes).reshape(-1, cols)


def _unrows(rows: np.ndarray, shape: tuple[int, ...], axes: tuple[int, ...]) -> np.ndarray:
    """2-D ``rows`` (as :func:`_rows` made them) back in an array of ``shape``."""
    batch = tuple(i for i in range(len(shape)) if i not in axes)
    order = batch + axes
    permuted = rows.reshape(tuple(shape[i] for i in order))
    return np.ascontiguousarray(permuted.transpose(np.argsort(order)))


def gradients(
    op: str,
    x: np.ndarray,
    dy: np.ndarray,
    weight: np.ndarray | None,
    eps: float | None,
    axes: tuple[int, ...],
) -> Expected:
    """The gradients of ``op`` (``"layer_norm"`` or ``"rms_norm"``) at ``x`` for the upstream
    ``dy``, in float64, with their tolerance scales.

    ``axes``: the sorted normalized axes; ``weight`` has their shape, or is None (ones).
    ``eps`` as given to the forward (None: rms_norm's default). dweight and dbias are the
    gradients with respect to the weight and bias parameters, present or not.
    """
    eps = _eps(op, x, eps)
    x2, dy2 = _rows(x, axes), _rows(dy, axes)
    norm_shape = tuple(x.shape[a] for a in axes)
    w = np.ones(x2.shape[1]) if weight is None else reference.to_float64(weight).reshape(-1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if op == "rms_norm":
            _, rstd = reference.rms_norm(x2, None, None, eps)
            mean = np.zeros_like(rstd)
        else:
            _, mean, rstd = reference.layer_norm(x2, None, None, None, eps)
        xhat = (x2 - mean) * rstd
        g = dy2 * w
        mean_g = 0.0 if op == "rms_norm" else g.mean(axis=1, keepdims=True)
        dx = rstd * (g - mean_g - xhat * (g * xhat).mean(axis=1, keepdims=True))
        exact = {"x": dx, "weight": (dy2 * xhat).sum(axis=0), "bias": dy2.sum(axis=0)}
        scales = gradient_scales(op, dy2, xhat, g, rstd)
        cond = np.broadcast_to(1.0 + np.abs(mean) * rstd, x2.shape)
    names = ("x", "weight") if op == "rms_norm" else ("x", "weight", "bias")

    def shaped(name: str, a: np.ndarray) -> np.ndarray:
        return _unrows(a, x.shape, axes) if name == "x" else a.reshape(norm_shape)

    return Expected(
        gradients={n: shaped(n, exact[n]) for n in names},
        scales={n: shaped(n, scales[n]) for n in names},
        conditioning=_unrows(cond, x.shape, axes),
    )


def autograd(
    op: str,
    x: np.ndarray,
    dy: np.ndarray,
    weight: np.ndarray | None,
    eps: float | None,
    axes: tuple[int, ...],
) -> dict[str, np.ndarray] | None:
    """The gradients of :func:`gradients` by torch.autograd in float64, through the forward
    written with torch's elementwise operations and reductions; None without torch."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    eps = _eps(op, x, eps)
    norm_shape = tuple(x.shape[a] for a in axes)
    shape = tuple(n if a in axes else 1 for a, n in enumerate(x.shape))
    tx = torch.tensor(reference.to_float64(x), requires_grad=True)
    w64 = np.ones(norm_shape) if weight is None else reference.to_float64(weight)
    tw = torch.tensor(w64, requires_grad=True)
    tb = torch.zeros(norm_shape, dtype=torch.float64, requires_grad=True)
    if op == "rms_norm":
        z = tx * torch.rsqrt((tx * tx).mean(dim=axes, keepdim=True) + eps)
    else:
        centred = tx - tx.mean(dim=axes, keepdim=True)
        z = centred * torch.rsqrt((centred * centred).mean(dim=axes, keepdim=True) + eps)
    y: Any = z * tw.reshape(shape)
    params = [tx, tw]
    if op == "layer_norm":
        y = y + tb.reshape(shape)
        params.append(tb)
    grads = torch.autograd.grad(y, params, torch.tensor(reference.to_float64(dy)))
    names = ("x", "weight", "bias")
    return {n: g.detach().numpy() for n, g in zip(names, grads, strict=False)}
