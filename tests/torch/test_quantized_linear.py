"""A real client of quantized outputs: a W8A8 linear layer on CPU (int8 activations from
normlab's norm, int8 weights per output channel, ``torch._int_mm``), against the float path."""

from __future__ import annotations

from typing import Any

import pytest

import normlab

torch = pytest.importorskip("torch")


class W8A8Linear:
    """``y = x @ W.T`` with W quantized per output channel (symmetric int8) and x given as int8
    with a per-row scale: ``int32(q_x @ q_W.T) · scale_x · scale_W``."""

    def __init__(self, weight: Any) -> None:
        self.scale = weight.abs().amax(dim=1) / 127  # (out,)
        self.q = (weight / self.scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.q_t = self.q.t().contiguous()

    def __call__(self, q: Any, scale: Any) -> Any:
        acc = torch._int_mm(q, self.q_t)
        return acc.to(torch.float32) * scale * self.scale


@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_w8a8_linear_after_the_norm(dtype: Any, fused: bool, backend: str | None) -> None:
    """The int8 matmul of the quantized norm output is the float path's within the bound of
    the two quantizations: per output, half a step of x times Σ|W| plus half a step of W times
    Σ|y|; and exactly the int32 matmul of q with the quantized weight."""
    torch.manual_seed(0)
    tokens, hidden, out = 33, 256, 96
    x = torch.randn(tokens, hidden).to(dtype) * 2
    residual = torch.randn(tokens, hidden).to(dtype)
    norm_weight = 1 + 0.1 * torch.randn(hidden)
    weight = torch.randn(out, hidden) / hidden**0.5
    linear = W8A8Linear(weight)
    if fused:
        q, scale, h = normlab.add_rms_norm(
            x, residual, hidden, norm_weight, 1e-6, quantize="int8", backend=backend
        )
        y = normlab.rms_norm(h.float(), hidden, norm_weight, 1e-6, backend=backend)
    else:
        q, scale = normlab.rms_norm(x, hidden, norm_weight, 1e-6, quantize="int8", backend=backend)
        y = normlab.rms_norm(x.float(), hidden, norm_weight, 1e-6, backend=backend)
    assert q.dtype == torch.int8 and scale.shape == (tokens, 1)
    got = linear(q, scale)
    assert torch.equal(torch._int_mm(q, linear.q_t), q.int() @ linear.q_t.int())
    want = y.double() @ weight.double().t()
    bound = (scale.double() / 2) * weight.abs().sum(1).double() + (
        linear.scale.double() / 2
    ) * y.abs().sum(1, keepdim=True).double()
    error = (got.double() - want).abs()
    assert (error <= bound * 1.001 + 1e-6).all(), float((error / bound).max())
    relative = error.norm() / want.norm()
    assert relative < 0.02, float(relative)
