"""The fused ops on a float32 residual stream beside half x (normlab.residual_stream): what the
core checks, autograd through it, and explain()."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import normlab
from normlab.quantize import reference as quantized_reference
from normlab.testing.bitwise import same_bits


def _pair(dtype: object = np.float16, rows: int = 6, cols: int = 32) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((rows, cols)).astype(dtype)
    return x, (50 * rng.standard_normal((rows, cols))).astype(np.float32)


@pytest.mark.parametrize("op", ["add_layer_norm", "add_rms_norm"])
def test_a_half_residual_beside_float32_x_is_refused(op: str) -> None:
    """The reverse stream (x float32, residual half) is no form a model uses."""
    x, residual = _pair()
    with pytest.raises(normlab.DtypeError, match="residual has dtype float16; it must be float32"):
        getattr(normlab, op)(residual, x)


def test_residual_out_takes_the_streams_dtype() -> None:
    x, residual = _pair(ml_dtypes.bfloat16)
    with pytest.raises(normlab.DtypeError, match="residual_out has dtype bfloat16"):
        normlab.add_layer_norm(x, residual, residual_out=np.empty_like(x))
    with pytest.raises(normlab.DtypeError, match="out has dtype float32"):
        normlab.add_layer_norm(x, residual, out=np.empty_like(residual))


def test_inputs_are_not_modified() -> None:
    x, residual = _pair()
    copies = x.copy(), residual.copy()
    normlab.add_rms_norm(x, residual, weight=np.ones(32, np.float16))
    assert same_bits(x, copies[0]) and same_bits(residual, copies[1])


def test_explain_names_the_stream() -> None:
    pytest.importorskip("numba")
    x, residual = _pair()
    text = normlab.explain(x, residual, op="add_layer_norm", backend="numba")
    assert "numba takes it as given: h = float32(x) + residual kept in float32" in text
    text = normlab.explain(x, residual, op="add_layer_norm", backend="numpy")
    assert "the core adds float32(x) + residual in float32" in text


@pytest.mark.parametrize("arrays", ["numpy", "torch"])
@pytest.mark.parametrize("op", ["add_layer_norm", "add_rms_norm"])
@pytest.mark.parametrize(("rows", "cols"), [(1, 4096), (7, 320), (300, 1024), (2, 300_000)])
def test_numba_takes_the_stream_as_the_core_composes_it(
    arrays: str, op: str, rows: int, cols: int
) -> None:
    """numba's own stream (in its fused kernel; long rows: the add, then the segmented norm of
    the float32 h) gives the bits of the core's composition on numba: h = float32(x) + residual
    exactly, y numba's norm of that h rounded to x's dtype; with h returned, into
    residual_out, and not returned (the post-norm form)."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, cols)).astype(ml_dtypes.bfloat16)
    residual = (20 * rng.standard_normal((rows, cols))).astype(np.float32)
    weight = (1 + 0.1 * rng.standard_normal(cols)).astype(ml_dtypes.bfloat16)
    convert, to_numpy = _family(arrays)
    x_t, r_t, w_t = convert(x), convert(residual), convert(weight)
    function, base = getattr(normlab, op), getattr(normlab, op.removeprefix("add_"))
    h_want = x.astype(np.float32) + residual
    y_want = to_numpy(base(convert(h_want), weight=w_t, backend="numba")).astype(x.dtype)
    y, h = function(x_t, r_t, weight=w_t, backend="numba")
    assert same_bits(to_numpy(h), h_want) and same_bits(to_numpy(y), y_want)
    h_out = convert(np.zeros_like(residual))
    function(x_t, r_t, weight=w_t, residual_out=h_out, backend="numba")
    assert same_bits(to_numpy(h_out), h_want)
    post = function(x_t, r_t, weight=w_t, return_residual=False, backend="numba")
    assert same_bits(to_numpy(post), y_want)


def _family(arrays: str) -> tuple[Callable[[np.ndarray], Any], Callable[[Any], np.ndarray]]:
    """How a NumPy array becomes one of ``arrays``' and back."""
    if arrays == "numpy":
        return (lambda a: a), (lambda a: a)
    pytest.importorskip("torch")
    from normlab.backends.torch_backend import from_numpy, to_numpy

    return from_numpy, to_numpy


def test_torch_gradients_through_the_stream() -> None:
    """x's gradient in x's dtype, the stream's in float32, the weight's in its own; as torch's
    own float32 add and norm would give them."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 64, generator=gen).to(torch.bfloat16).requires_grad_()
    residual = (10 * torch.randn(16, 64, generator=gen)).requires_grad_()
    weight = torch.randn(64, generator=gen).to(torch.bfloat16).requires_grad_()
    y, h = normlab.add_rms_norm(x, residual, weight=weight, weight_offset=1.0)
    assert (y.dtype, h.dtype) == (torch.bfloat16, torch.float32)
    dy = torch.randn(16, 64, generator=gen)
    ((y.float() * dy).sum() + h.sum()).backward()
    grads = [t.grad for t in (x, residual, weight)]
    assert [g.dtype for g in grads] == [torch.bfloat16, torch.float32, torch.bfloat16]
    x2, r2, w2 = (t.detach().double().requires_grad_() for t in (x, residual, weight))
    h2 = x2 + r2
    y2 = torch.nn.functional.rms_norm(h2, (64,), 1 + w2, eps=float(np.finfo(np.float32).eps))
    ((y2 * dy.double()).sum() + h2.sum()).backward()
    for got, want in zip(grads, (x2.grad, r2.grad, w2.grad), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max())


@pytest.mark.parametrize("mode", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("backend", [None, "numba", "torch"])
def test_llama_casting_quantizes_x_hat_rounded_to_xs_dtype(backend: str | None, mode: str) -> None:
    """casting="llama" beside a float32 stream: the quantized y is x̂ (the norm of the float32
    h) rounded to x's dtype, times the weight in float32 (docs/quantized.md), as without the
    stream; it was x̂ of float32 rounding (scales up to 0.24 % off)."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(6)
    x = torch.randn(16, 64, generator=g).bfloat16()
    residual = torch.randn(16, 64, generator=g)
    weight = torch.randn(64, generator=g).bfloat16()
    call = normlab.add_rms_norm(
        x, residual, 64, weight, 1e-6, casting="llama", quantize=mode, backend=backend
    )
    x_hat = normlab.add_rms_norm(x, residual, 64, None, 1e-6, backend=backend)[0]
    y = x_hat.float() * weight.float()
    q, scale = quantized_reference(y, mode, None, (1,))
    assert torch.equal(call[1], scale)
    assert torch.equal(call[0].view(torch.uint8), q.view(torch.uint8))
