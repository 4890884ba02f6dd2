"""The Numba backend's entry module (:mod:`normlab.backends.numba_backend`): the direct route's
prepared functions, for NumPy arrays and CPU tensors, bitwise the op functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("numba")

import normlab
from normlab import registry, spec
from normlab.backends import numba_backend
from normlab.ops import OPS
from tests.support.numba_direct import DTYPES, as_numpy_array, dtype_of, randn, same_bits


@pytest.fixture
def torch() -> Any:
    return pytest.importorskip("torch")


# --------------------------------------------------------------------------------------------
# The direct route's prepared functions (numba_backend.prepare)


def _direct_cases(family: str, dtype: str) -> list[tuple[str, Any, Any, Any]]:
    """Small calls of the direct route, as (name, x, weight, bias): ones the prepared function
    runs itself, and ones it hands back to the op's function (a weight to convert or copy, a
    misaligned tensor)."""
    import torch

    half = dtype in ("float16", "bfloat16")
    x = torch.from_numpy(randn((3, 768), "float32", loc=2.0)).to(getattr(torch, dtype))
    w = torch.randn(768, dtype=torch.float32 if half else x.dtype)
    b = torch.randn(768, dtype=w.dtype)
    cases = [
        ("weight and bias", x, w, b),
        ("neither", x, None, None),
        ("strided weight", x, torch.stack([w, w], 1)[:, 0], b),
        ("x's dtype for weight", x, w.to(x.dtype), b.to(x.dtype)),
    ]
    if family == "numpy":
        return [
            (name, *(None if a is None else as_numpy_array(a) for a in c)) for name, *c in cases
        ]
    misaligned = torch.frombuffer(bytearray(x.numel() * x.itemsize + 1), dtype=x.dtype, offset=1)
    misaligned = misaligned.view(3, 768)
    misaligned.copy_(x)
    return [*cases, ("misaligned x", misaligned, w, b)]


def _recording(function: Callable[..., Any], calls: list[str], name: str) -> Callable[..., Any]:
    """``function``, appending ``name`` to ``calls`` on each call."""

    def recording(*args: Any) -> Any:
        calls.append(name)
        return function(*args)

    return recording


@pytest.mark.parametrize("family", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_small_direct_calls_run_the_prepared_function_bitwise_the_op(
    torch: Any, family: str, dtype: str, op: str
) -> None:
    """A small call that takes the direct route (inputs read as they are, no outputs given, no
    statistics) runs the function ``prepare`` made for its plan, which returns bitwise what the
    op's own function returns, also where it hands the call back to it."""
    dtype_of(dtype)
    fused, centred = op.startswith("add_"), "layer_norm" in op
    function = getattr(numba_backend, op)
    numba_record = registry.get("numba")
    for name, x, w, b in _direct_cases(family, dtype):
        bias, eps = (b, 1e-5) if centred else (None, None)  # the functions' defaults
        params = {"weight": w} | ({"bias": b} if centred else {})
        for keep_h in (True, False) if fused else (False,):
            case = f"{name}, h kept" if keep_h else name
            if fused:
                inputs = (x, x * 2)  # x and a residual
                call = spec.validated(
                    OPS[op],
                    spec.arguments(op, *inputs, weight=w, bias=bias, eps=eps,
                                   return_residual=keep_h),
                )  # fmt: skip
                keywords = {"return_residual": keep_h}
                outputs = {"out": None, "residual_out": None}
            else:
                inputs = (x,)
                call = spec.validated(OPS[op], spec.arguments(op, x, weight=w, bias=bias, eps=eps))
                keywords, outputs = {}, {"out": None}
            run = getattr(normlab, op)
            for _ in range(2):  # the first call compiles (or loads) the entry, the second reads it
                got = run(*inputs, **params, **keywords, backend="numba")
            route = call.routes[numba_record]
            assert route.direct is not None and route.prepared, case
            ran: list[str] = []  # the core calls the route's prepared function
            call.routes[numba_record] = dataclasses.replace(
                route, direct=_recording(route.direct, ran, case)
            )
            try:
                again = run(*inputs, **params, **keywords, backend="numba")
            finally:
                call.routes[numba_record] = route
            assert ran == [case]
            parameters = (w, bias) if centred else (w,)
            want = function(*inputs, *parameters, plan=call.plan, **outputs)
            prepared = route.direct(*inputs, *parameters)
            assert len(prepared) == len(want), case
            assert all(same_bits(p, v) for p, v in zip(prepared, want, strict=True)), case
            returned = want[:2] if keep_h else want[:1]
            for result in (got, again):
                result = result if keep_h else (result,)
                assert all(same_bits(r, v) for r, v in zip(result, returned, strict=True)), case


def test_prepare_leaves_calls_it_does_not_serve_to_the_op(torch: Any) -> None:
    """No prepared function for calls on the thread pool, calls that need autograd's graph, or
    the backward ops: the op's function runs them."""
    small, large = torch.randn(2, 768), torch.randn(64, 1024)  # large: above SERIAL_ELEMENTS
    for x, served in ((small, True), (large, False), (small.clone().requires_grad_(), False)):
        plan = spec.plan("layer_norm", x)
        assert (numba_backend.prepare("layer_norm", plan) is not None) == served
    plan = spec.plan("layer_norm", small.numpy())
    assert numba_backend.prepare("layer_norm", plan) is not None
    assert numba_backend.prepare("layer_norm_backward", plan) is None
