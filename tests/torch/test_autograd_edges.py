"""The autograd graph at the edges of the forward ops: empty inputs, ``out=`` beside parameters
that require grad, half x with a lone float32 bias (each found by the API fuzzer,
tests/core/test_fuzz_api.py)."""

from __future__ import annotations

import numpy as np
import pytest

import normlab
from normlab import registry

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("grad_on", ["x", "weight", "bias"])
@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (2, 0, 4)])
def test_empty_input_requiring_grad_keeps_the_graph(grad_on: str, shape: tuple[int, ...]) -> None:
    """As torch's own layer_norm: y is in the graph; dx is empty, dweight and dbias are zero."""
    x = torch.zeros(shape, requires_grad=grad_on == "x")
    weight, bias = (torch.ones(shape[-1:], requires_grad=grad_on == n) for n in ("weight", "bias"))
    y = normlab.layer_norm(x, weight=weight, bias=bias)
    assert y.requires_grad and y.shape == x.shape
    y.sum().backward()
    leaf = {"x": x, "weight": weight, "bias": bias}[grad_on]
    assert leaf.grad is not None and leaf.grad.shape == leaf.shape and not leaf.grad.any()


def test_empty_input_requiring_grad_with_out() -> None:
    """A weight that requires grad allows ``out=``: out is returned, in the graph."""
    weight = torch.ones(4, requires_grad=True)
    out = torch.empty(0, 4)
    y = normlab.layer_norm(torch.zeros(0, 4), weight=weight, out=out)
    assert y is out and y.requires_grad
    y.sum().backward()
    assert weight.grad is not None and not weight.grad.any()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_half_x_with_a_lone_float32_bias_backpropagates(dtype: str) -> None:
    """torch's own CPU backward raises on half x with a float32 bias and no weight ("expected
    scalar type Half but found Float"); the torch backend passes a weight of ones."""
    x = torch.randn(3, 4, dtype=getattr(torch, dtype), requires_grad=True)
    bias = torch.randn(4, requires_grad=True)
    y = normlab.layer_norm(x, bias=bias, backend="torch")
    y.float().sum().backward()
    assert bias.grad is not None and x.grad is not None and x.grad.dtype == x.dtype
    np.testing.assert_array_equal(bias.grad.numpy(), 3.0)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_out_with_a_parameter_requiring_grad_keeps_the_graph(backend: str) -> None:
    """``out=`` with a bias that requires grad: the core copies the result into out, in the
    graph (numba once refused the call with a BackendError)."""
    if not registry.get(backend).available:
        pytest.skip(f"backend {backend!r} is unavailable here")
    x = torch.randn(3, 4, dtype=torch.float16)
    bias = torch.randn(4, requires_grad=True)
    out = torch.empty(3, 4, dtype=torch.float16)
    y = normlab.layer_norm(x, bias=bias, out=out, backend=backend)
    assert y is out and y.requires_grad
    y.float().sum().backward()
    assert bias.grad is not None
    np.testing.assert_array_equal(bias.grad.numpy(), 3.0)


@pytest.mark.parametrize("backend", [None, "numba", "torch"])
@pytest.mark.parametrize("mode", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_quantized_outputs_carry_no_gradient(op: str, mode: str, backend: str | None) -> None:
    """q and scale are not differentiable (docs/quantized.md): neither requires grad, whatever
    requires it among x, the residual and the weight; a fused op's h keeps its graph."""
    x = torch.randn(4, 64, requires_grad=True)
    weight = torch.randn(64, requires_grad=True)
    fused = op.startswith("add_")
    args = (x, torch.randn(4, 64, requires_grad=True)) if fused else (x,)
    result = getattr(normlab, op)(*args, weight=weight, quantize=mode, backend=backend)
    q, scale = result[0], result[1]
    assert not q.requires_grad and not scale.requires_grad
    if fused:
        h = result[2]
        assert h.requires_grad
        h.sum().backward()
        assert x.grad is not None and torch.equal(x.grad, torch.ones_like(x))
