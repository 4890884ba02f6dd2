"""RMSNorm's casting orders (normlab.casting) against the HF transformers modules' own
arithmetic, written out in torch: the same dtype, the same values up to the reduction order."""

from __future__ import annotations

from typing import Any

import pytest

import normlab
from normlab import spec

torch = pytest.importorskip("torch")


def _llama(x: Any, weight: Any, eps: float) -> Any:
    """LlamaRMSNorm.forward (Mistral's and Qwen2's are the same)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _t5(x: Any, weight: Any, eps: float) -> Any:
    """T5LayerNorm.forward."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    h = x * torch.rsqrt(variance + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        h = h.to(weight.dtype)
    return weight * h


_BITS = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24}


@pytest.mark.parametrize("backend", [None, "torch"])
@pytest.mark.parametrize(("casting", "model"), [("llama", _llama), ("t5", _t5)])
@pytest.mark.parametrize("weight_dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("x_dtype", ["bfloat16", "float16", "float32"])
def test_matches_the_model_code(
    x_dtype: str, weight_dtype: str, casting: str, model: Any, backend: str | None
) -> None:
    """The model's dtype; its values within a unit of x̂'s dtype and one of y's (the mean
    square's reduction order may move x̂ across a midpoint), and bitwise for all but a few
    elements of a half y, where the exact order differs in many."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 512, generator=gen).to(getattr(torch, x_dtype))
    weight = torch.randn(512, generator=gen).to(getattr(torch, weight_dtype))
    want = model(x, weight, 1e-6)
    got = normlab.rms_norm(x, weight=weight, eps=1e-6, casting=casting, backend=backend)
    assert got.dtype == want.dtype
    rounded_to = x.dtype if casting == "llama" else weight.dtype
    if casting == "t5" and weight.dtype == torch.float32:
        rounded_to = torch.float32
    rtol = 2.0 ** (1 - _BITS[rounded_to]) + 2.0 ** (1 - _BITS[want.dtype]) + 1e-5
    torch.testing.assert_close(got.double(), want.double(), rtol=rtol, atol=1e-6)
    if want.dtype != torch.float32:
        assert (got != want).double().mean() < 0.01
        exact = normlab.rms_norm(x, weight=weight, eps=1e-6, backend=backend)
        assert (exact.to(want.dtype) != want).double().mean() > 0.05


def test_weight_over_non_trailing_axes() -> None:
    """The weight multiply follows the normalized axes, wherever they are."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 3, 5, generator=gen).to(torch.bfloat16)
    weight = torch.randn(6, 5, generator=gen)
    y = normlab.rms_norm(x, weight=weight, axis=(0, 2), casting="llama")
    moved = x.permute(1, 0, 2)
    h = moved.float()
    h = h * torch.rsqrt(h.pow(2).mean((-1, -2), keepdim=True) + torch.finfo(torch.float32).eps)
    assert torch.equal(y, (weight * h.to(x.dtype)).permute(1, 0, 2))


def test_without_a_weight_every_order_is_exact() -> None:
    x = torch.randn(4, 32).to(torch.bfloat16)
    exact = normlab.rms_norm(x)
    for casting in ("llama", "t5"):
        assert torch.equal(normlab.rms_norm(x, casting=casting), exact)


def test_out_takes_the_promoted_dtype() -> None:
    x = torch.randn(4, 32).to(torch.bfloat16)
    weight = torch.randn(32)
    out = torch.empty(4, 32)
    y = normlab.rms_norm(x, weight=weight, casting="llama", out=out)
    assert y is out and torch.equal(out, normlab.rms_norm(x, weight=weight, casting="llama"))


def test_gradients_through_a_composed_order() -> None:
    x = torch.randn(8, 32).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(32).requires_grad_()
    normlab.rms_norm(x, weight=weight, casting="llama").sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16
    assert weight.grad is not None and weight.grad.dtype == torch.float32


def test_explain_and_errors() -> None:
    x = torch.randn(4, 32).to(torch.bfloat16)
    with pytest.raises(normlab.ArgumentError, match="casting must be one of"):
        normlab.rms_norm(x, weight=torch.ones(32), casting="gemma")


@pytest.mark.parametrize("rounds", ["x", "half weight"])
def test_a_casting_order_is_a_row_of_data(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, rounds: str
) -> None:
    """An order is one row of CASTINGS (its rounding point), read by validation, the
    composition, quantized outputs and the torch module alike: a row named otherwise, with
    llama's or T5's rounding point, gives that order's bits and errors."""
    import normlab.torch
    from normlab.spec.casting import CASTINGS, Casting

    known = next(order for order in CASTINGS.values() if order.normalized == rounds)
    row = Casting("engine", rounds, unquantizable=known.unquantizable)
    monkeypatch.setitem(CASTINGS, "engine", row)
    spec.clear_cache()  # validated calls of an earlier "engine" row are gone
    request.addfinalizer(spec.clear_cache)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 256, generator=gen).to(torch.bfloat16)
    weight = torch.randn(256, generator=gen).to(torch.float16)
    got = normlab.rms_norm(x, weight=weight, casting="engine")
    want = normlab.rms_norm(x, weight=weight, casting=known.name)
    assert got.dtype == want.dtype and torch.equal(got, want)
    module = normlab.torch.RMSNorm(256, casting="engine")
    with torch.no_grad():
        module.weight.copy_(weight)
    assert module.to(torch.float16)(x).dtype == want.dtype
    if known.unquantizable is None:
        q, scale = normlab.rms_norm(x, weight=weight, casting="engine", quantize="int8")
        q_want, scale_want = normlab.rms_norm(x, weight=weight, casting=known.name, quantize="int8")
        assert torch.equal(q, q_want) and torch.equal(scale, scale_want)
    else:
        with pytest.raises(normlab.ArgumentError, match="casting='engine' is not served"):
            normlab.rms_norm(x, weight=weight, casting="engine", quantize="int8")
