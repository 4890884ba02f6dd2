"""Gradients through autograd for the parameters real models give (normlab.parameters): an
offset weight and a weight or bias of a dtype other than x's. Each parameter's gradient comes in
its own dtype, within one rounding of the float64 gradient, on every backend serving CPU tensors
and on the default choice."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import normlab

torch = pytest.importorskip("torch")

#: The backends serving CPU tensors (None: the default choice).
BACKENDS = [None, "torch", "numba"]
ROWS, COLS = 64, 96


def _float64_gradients(
    op: str, x: Any, weight: Any, bias: Any, offset: float, dy: Any
) -> dict[str, np.ndarray]:
    """x's, weight's and bias's gradients of ``sum(y * dy)`` in float64 torch."""
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, weight))
    b64 = None if bias is None else bias.detach().double().requires_grad_()
    if op == "layer_norm":
        y = torch.nn.functional.layer_norm(x64, (COLS,), offset + w64, b64)
    else:
        y = torch.nn.functional.rms_norm(x64, (COLS,), offset + w64, eps=np.finfo(np.float32).eps)
    (y * dy.double()).sum().backward()
    grads = {"x": x64.grad, "weight": w64.grad, "bias": None if b64 is None else b64.grad}
    return {k: g.numpy() for k, g in grads.items() if g is not None}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize(
    ("op", "x_dtype", "weight_dtype", "bias_dtype"),
    [
        ("layer_norm", "float32", "bfloat16", "float16"),
        ("layer_norm", "bfloat16", "float16", "float64"),
        ("layer_norm", "float16", "float16", "bfloat16"),
        ("rms_norm", "float32", "bfloat16", None),
        ("rms_norm", "bfloat16", "bfloat16", None),
        ("rms_norm", "float64", "float32", None),
    ],
)
def test_parameter_gradients_in_their_own_dtype(
    op: str,
    x_dtype: str,
    weight_dtype: str,
    bias_dtype: str | None,
    offset: float,
    backend: str | None,
) -> None:
    """``weight.grad`` in the weight's dtype, ``bias.grad`` in the bias's, ``x.grad`` in x's;
    each within a few units of its dtype's rounding of the float64 gradient."""
    if backend == "numba":
        pytest.importorskip("numba")
    gen = torch.Generator().manual_seed(5)
    dtype = {name: getattr(torch, name) for name in ("float16", "bfloat16", "float32", "float64")}
    x = torch.randn(ROWS, COLS, generator=gen).to(dtype[x_dtype]).requires_grad_()
    weight = (0.1 * torch.randn(COLS, generator=gen)).to(dtype[weight_dtype]).requires_grad_()
    bias = None
    if bias_dtype is not None:
        bias = torch.randn(COLS, generator=gen).to(dtype[bias_dtype]).requires_grad_()
    dy = torch.randn(ROWS, COLS, generator=gen).to(dtype[x_dtype])
    weight_before = weight.detach().clone()
    kwargs: dict[str, Any] = {"weight": weight, "weight_offset": offset, "backend": backend}
    if op == "layer_norm":
        kwargs["bias"] = bias
    y = getattr(normlab, op)(x, **kwargs)
    assert y.dtype == x.dtype
    (y * dy).sum().backward()
    assert torch.equal(weight.detach(), weight_before), "the caller's weight was modified"
    want = _float64_gradients(op, x, weight, bias, offset, dy)
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is None:
            continue
        assert t.grad is not None and t.grad.dtype == t.dtype, (name, t.grad)
        got = t.grad.double().numpy()
        unit = float(torch.finfo(t.dtype).eps) if t.dtype != torch.float64 else 1e-12
        # x's gradient carries x's rounding of the forward; the sums over 64 rows, float32's
        scale = np.abs(want[name]).max()
        budget = (4 * unit + 64 * float(torch.finfo(torch.float32).eps)) * scale
        if name == "x":
            budget += 8 * float(torch.finfo(x.dtype).eps) * scale
        assert np.abs(got - want[name]).max() <= budget, name
