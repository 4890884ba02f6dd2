"""A plain normlab call inside ``torch.compile``: one opaque node of dynamo's graph.

For each op, float16 and bfloat16, each option (``out=`` and in place included), on the
default choice, with
``backend="eager"`` and ``"aot_eager"``: the compiled function gives the bits of the plain
call, dynamo breaks its graph at most once, and no frame of normlab is compiled (dynamo never
traces normlab's validation, its backends or numba; a repeated call compiles nothing again).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch._dynamo.utils import counters, orig_code_map  # noqa: E402  (after the skip)

import normlab  # noqa: E402
from normlab.ops import names  # noqa: E402

#: normlab's source folder: no frame compiled by dynamo may come from it.
PACKAGE = os.path.dirname(normlab.__file__)


def _options(op: str) -> Iterator[str]:
    yield from ("plain", "float32-parameters", "weight-offset", "stats", "int8", "fp8", "grad")
    yield from ("out", "in-place")
    if "rms" in op:
        yield from ("llama", "t5")
    if op.startswith("add_"):
        yield from ("float32-stream", "no-residual")


CASES = [
    (op, dtype, option)
    for op in names(direction="forward")
    for dtype in ("float16", "bfloat16")
    for option in _options(op)
] + [
    (op, dtype, option)
    for op in names(direction="backward")
    for dtype in ("float16", "bfloat16")
    for option in ("plain", "float32-parameters")
]


def _call(op: str, dtype: str, option: str) -> tuple[Callable[..., Any], list[Any]]:
    """A function of tensors calling normlab's ``op`` with ``option``, and its tensors."""
    g = torch.Generator().manual_seed(0)
    half = getattr(torch, dtype)
    x = torch.randn(4, 64, generator=g).to(half)
    parameters = torch.float32 if option == "float32-parameters" else half
    weight = torch.randn(64, generator=g).to(parameters)
    bias = torch.randn(64, generator=g).to(parameters)
    keywords: dict[str, Any] = {
        "weight-offset": {"weight_offset": 1.0},
        "stats": {"return_stats": True},
        "int8": {"quantize": "int8"},
        "fp8": {"quantize": "fp8_e4m3"},
        "llama": {"casting": "llama"},
        "t5": {"casting": "t5"},
        "no-residual": {"return_residual": False},
    }.get(option, {})
    function = getattr(normlab, op)
    if op.endswith("_backward"):
        _, *stats = getattr(normlab, op.removesuffix("_backward"))(x, 64, weight, return_stats=True)
        dy = torch.randn(4, 64, generator=g).to(half)
        return (lambda *given: function(*given)), [dy, x, *stats, weight]
    tensors = [x]
    if op.startswith("add_"):
        stream = torch.float32 if option == "float32-stream" else half
        tensors.append(torch.randn(4, 64, generator=g).to(stream))
    tensors.append(weight)
    if "layer" in op:
        tensors.append(bias)
    if option == "grad":
        for t in (tensors[0], weight):
            t.requires_grad_()
    arity = len(tensors) - (2 if "layer" in op else 1)

    def call(*given: Any) -> Any:
        head, params = given[:arity], given[arity:]
        named = dict(zip(("weight", "bias"), params, strict=False))
        if option == "out":  # buffers the compiled code makes, written by normlab
            named["out"] = torch.empty_like(head[0])
            if op.startswith("add_"):
                named["residual_out"] = torch.empty_like(head[0])
        elif option == "in-place":  # a copy of x (and of the residual) overwritten
            head = tuple(t.clone() for t in head)
            named["out"] = head[0]
            if op.startswith("add_"):
                named["residual_out"] = head[1]
        return function(*head, **named, **keywords)

    return call, tensors


def _bits(result: Any) -> list[Any]:
    """The tensors of a result, float8 as its bits (torch.equal has no float8 kernel)."""
    values = result if isinstance(result, tuple) else (result,)
    return [
        v.detach().view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v.detach()
        for v in values
        if v is not None
    ]


def _compiled_in_normlab() -> list[str]:
    """The frames dynamo compiled from normlab's source (it should compile none)."""
    return [
        f"{code.co_filename}:{code.co_name}"
        for code in list(orig_code_map.values.values())
        if code.co_filename.startswith(PACKAGE)
    ]


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
@pytest.mark.parametrize(("op", "dtype", "option"), CASES)
def test_a_plain_call_is_one_node(op: str, dtype: str, option: str, compiler: str) -> None:
    call, tensors = _call(op, dtype, option)
    want = call(*tensors)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(call, backend=compiler)
    got = compiled(*tensors)
    again = compiled(*tensors)
    assert sum(counters["graph_break"].values()) <= 1, dict(counters["graph_break"])
    assert _compiled_in_normlab() == []
    for a, b, c in zip(_bits(got), _bits(again), _bits(want), strict=True):
        assert torch.equal(a, c) and torch.equal(b, c), f"{op} {option}: other bits compiled"
    if option == "grad":
        y = got[0] if isinstance(got, tuple) else got
        y.float().sum().backward()
        assert all(t.grad is not None for t in tensors if t.requires_grad)
