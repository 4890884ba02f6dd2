"""What torch's own machinery sees of a call, on the default choice: torch.func transforms and
forward-mode AD (run on the torch backend), fake, functional and subclass tensors (through
normlab's custom ops), tensors without memory (refused), and RMSNorm's eps as torch's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import normlab
from normlab import registry

torch = pytest.importorskip("torch")
normlab_torch = pytest.importorskip("normlab.torch")
F = torch.nn.functional

pytestmark = pytest.mark.skipif(
    not registry.get("numba").available,
    reason="the default on CPU tensors without grad is numba: what these tests reroute",
)

COLS = 8
#: (normlab's call, torch's composition of the same formula), both of (x, weight).
OPS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "layer_norm": (
        lambda x, w: normlab.layer_norm(x, weight=w, bias=w * 0.5),
        lambda x, w: F.layer_norm(x, (COLS,), w, w * 0.5),
    ),
    "rms_norm": (
        lambda x, w: normlab.rms_norm(x, weight=w, eps=1e-6),
        lambda x, w: F.rms_norm(x, (COLS,), w, 1e-6),
    ),
    "add_layer_norm": (
        lambda x, w: normlab.add_layer_norm(x, x * 0.5, weight=w, return_residual=False),
        lambda x, w: F.layer_norm(x + x * 0.5, (COLS,), w),
    ),
    "add_rms_norm": (
        lambda x, w: normlab.add_rms_norm(x, x * 0.5, weight=w, eps=1e-6)[0],
        lambda x, w: F.rms_norm(x + x * 0.5, (COLS,), w, 1e-6),
    ),
    "layer_norm_backward": (
        lambda x, w: normlab.layer_norm_backward(x.cos(), x, *_stats(x), w)[0],
        lambda x, w: _autograd_dx(x, w),
    ),
}


def _stats(x: Any) -> tuple[Any, Any]:
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return mean, torch.rsqrt(var + 1e-5)


def _autograd_dx(x: Any, w: Any) -> Any:
    """dx of layer_norm(x, w) for dy = cos(x), as a differentiable torch expression."""
    mean, rstd = _stats(x)
    xhat = (x - mean) * rstd
    g = x.cos() * w
    return rstd * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))


def _flat(result: Any) -> Any:
    parts = result if isinstance(result, tuple) else (result,)
    return torch.cat([torch.as_tensor(p).reshape(-1) for p in parts])


TRANSFORMS: dict[str, Callable[[Callable[..., Any], Any, Any], Any]] = {
    "vmap": lambda f, x, w: torch.func.vmap(f, in_dims=(0, None))(x, w),
    "grad": lambda f, x, w: torch.func.grad(lambda x, w: f(x, w).sin().sum(), (0, 1))(x, w),
    "jvp": lambda f, x, w: torch.func.jvp(f, (x, w), (x.cos(), w.sin())),
    "jacrev": lambda f, x, w: torch.func.jacrev(f, argnums=1)(x, w),
    "jacfwd": lambda f, x, w: torch.func.jacfwd(f, argnums=1)(x, w),
    "hessian": lambda f, x, w: torch.func.hessian(lambda w: f(x, w).sin().sum())(w),
}


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("op", OPS)
def test_torch_func_transforms_match_torch(op: str, transform: str) -> None:
    """vmap, grad, jvp, jacrev, jacfwd and hessian over every op with no backend named give
    torch's own results (float64): under a transform the call runs torch's ops."""
    x = torch.randn(3, 4, COLS, dtype=torch.float64)
    w = torch.randn(COLS, dtype=torch.float64)
    ours, theirs = OPS[op]
    got = TRANSFORMS[transform](ours, x, w)
    want = TRANSFORMS[transform](theirs, x, w)
    assert torch.allclose(_flat(got), _flat(want), atol=1e-9, rtol=1e-7)


def test_grad_of_a_large_call_runs_where_numba_would_be_chosen() -> None:
    """torch.func.grad at 8192 x 1024 (numba's size without a transform) works and matches."""
    x, w = torch.randn(8192, 1024), torch.randn(1024)
    got = torch.func.grad(lambda x: normlab.layer_norm(x, weight=w).sum())(x)
    want = torch.func.grad(lambda x: F.layer_norm(x, (1024,), w).sum())(x)
    assert torch.allclose(got, want, atol=1e-5)


def test_forward_mode_ad_keeps_the_tangent() -> None:
    """A dual tensor's tangent comes through (torch's jvp of layer_norm), never dropped."""
    import torch.autograd.forward_ad as fwad

    x, t = torch.randn(4, COLS, dtype=torch.float64), torch.randn(4, COLS, dtype=torch.float64)
    with fwad.dual_level():
        y = normlab.layer_norm(fwad.make_dual(x, t))
        tangent = fwad.unpack_dual(y).tangent
        want = fwad.unpack_dual(F.layer_norm(fwad.make_dual(x, t), (COLS,))).tangent
    assert tangent is not None and torch.allclose(tangent, want)


def test_a_named_backend_that_cannot_run_a_transform_refuses() -> None:
    """backend= is strict: numba named under vmap is a BackendError saying what to do."""
    with pytest.raises(normlab.BackendError, match="leave backend= unset"):
        torch.func.vmap(lambda x: normlab.layer_norm(x, backend="numba"))(torch.randn(2, 3, 4))


@pytest.mark.parametrize("how", ["mode", "from_tensor"])
def test_fake_tensors_give_fake_results(how: str) -> None:
    """Under FakeTensorMode (what tracing runs) the result is a FakeTensor of x's shape and
    dtype; no kernel reads memory (before: a segfault on numba)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        if how == "mode":
            x, w = torch.randn(64, 768), torch.randn(768)
        else:
            x, w = mode.from_tensor(torch.randn(64, 768)), mode.from_tensor(torch.randn(768))
        for y in (normlab.layer_norm(x, weight=w), normlab.rms_norm(x, weight=w)):
            assert isinstance(y, FakeTensor) and y.shape == x.shape and y.dtype == x.dtype
        y, h = normlab.add_layer_norm(x, x, weight=w)
        assert isinstance(y, FakeTensor) and isinstance(h, FakeTensor)


@pytest.mark.parametrize("backend", [None, "numba", "torch"])
@pytest.mark.parametrize("mode", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("op", ["rms_norm", "add_layer_norm"])
def test_fake_tensors_outside_their_mode_give_fake_quantized_outputs(
    op: str, mode: str, backend: str | None
) -> None:
    """Fake tensors made in a mode that has since exited, as a plain call gets them: q and
    scale are fake (the core's quantizer makes every array like one of y's; a scale made
    from nothing was a real tensor beside fake ones: torch's AssertionError)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(4, 64)
    args = (x, x) if op.startswith("add_") else (x,)
    q, scale, *_ = getattr(normlab, op)(*args, quantize=mode, backend=backend)
    assert isinstance(q, FakeTensor) and isinstance(scale, FakeTensor)
    assert q.shape == x.shape and scale.shape == (4, 1)
    assert q.dtype == (torch.int8 if mode == "int8" else torch.float8_e4m3fn)


def test_functionalize_runs_torch_s_ops() -> None:
    """torch.func.functionalize is a transform too: its result is the torch backend's, bitwise."""
    x, w = torch.randn(64, 768), torch.randn(768)
    functional = torch.func.functionalize(lambda x: normlab.layer_norm(x, weight=w))
    assert torch.equal(functional(x), normlab.layer_norm(x, weight=w, backend="torch"))


def test_a_wrapper_subclass_is_handled_by_its_own_dispatch() -> None:
    """TwoTensor (two tensors behind one, torch's test subclass) normalizes each of its parts."""
    from torch.testing._internal.two_tensor import TwoTensor

    a, b = torch.randn(16, 32), torch.randn(16, 32)
    y = normlab.layer_norm(TwoTensor(a, b))
    assert torch.equal(y.a, normlab.layer_norm(a)) and torch.equal(y.b, normlab.layer_norm(b))


@pytest.mark.parametrize("freed", ["x", "weight", "bias"])
@pytest.mark.parametrize("backend", [None, "numba", "torch"])
def test_a_tensor_whose_storage_was_freed_is_refused_naming_it(
    freed: str, backend: str | None
) -> None:
    """FSDP resizes freed parameters' storage to 0: an ArgumentError names the tensor (before: a
    segfault on numba); nothing reads memory the tensor does not hold."""
    tensors = {"x": torch.randn(4, 32), "weight": torch.randn(32), "bias": torch.randn(32)}
    tensors[freed].untyped_storage().resize_(0)
    with pytest.raises(normlab.NormlabError, match=rf"\b{freed}\b"):
        normlab.layer_norm(
            tensors["x"], weight=tensors["weight"], bias=tensors["bias"], backend=backend
        )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rms_norm_s_default_eps_is_torch_s(dtype: str) -> None:
    """eps=None is the compute dtype's machine epsilon, as torch's RMSNorm: a half model with
    its RMSNorm swapped for normlab's gives torch's bits (before: 90% off on 0.01-scale input)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.RMSNorm(64)).to(
        getattr(torch, dtype)
    )
    x = torch.randn(8, 64, dtype=getattr(torch, dtype)) * 0.01
    want = model(x)
    normlab_torch.replace_layer_norms(model)
    assert type(model[1]) is normlab_torch.RMSNorm
    assert torch.equal(model(x), want)
    plain = normlab.rms_norm(x)
    assert torch.equal(plain, F.rms_norm(x, (64,)))


@pytest.mark.parametrize("backend", [None, "numba", "torch"])
def test_a_negated_view_is_normalized_as_its_values(backend: str | None) -> None:
    """A tensor with the negative bit set (torch._neg_view) holds its memory's values negated:
    normalized as those values (torch resolves the view before normlab's kernels), and refused
    as out= (results go into memory), never read or written as its memory."""
    x = torch.randn(4, 16)
    y = normlab.layer_norm(torch._neg_view(x), backend=backend)
    assert torch.allclose(y, F.layer_norm(-x, (16,)), atol=1e-5)
    with pytest.raises(normlab.ArgumentError, match="negated view"):
        normlab.layer_norm(x, out=torch._neg_view(torch.empty(4, 16)), backend=backend)


class _Block(torch.nn.Module):
    """normlab's three module kinds in one block."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = normlab_torch.LayerNorm(32)
        self.rms = normlab_torch.RMSNorm(32)
        self.add = normlab_torch.AddLayerNorm(32)

    def forward(self, x: Any) -> Any:
        y, h = self.add(self.ln(x), self.rms(x))
        return y + h


def _graph_count(module: Any, shapes: list[tuple[int, ...]]) -> int:
    graphs = []

    def count(gm: Any, example: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(module, fullgraph=True, dynamic=True, backend=count)
    for shape in shapes:
        x = torch.randn(*shape)
        assert torch.allclose(compiled(x), module(x), atol=1e-5)
    return len(graphs)


def test_compile_with_dynamic_shapes_makes_one_graph_for_every_batch() -> None:
    """torch.compile(dynamic=True, fullgraph=True): as many graphs as torch's own modules (the
    size-1 specialization and one for the rest), whatever the batch and sequence lengths (before:
    a graph per batch size, failing at the 9th)."""
    shapes = [(b, s, 32) for b, s in ((1, 3), (2, 5), (3, 7), (4, 9), (5, 2), (9, 17), (12, 4))]
    shapes += [(b, 4, 32) for b in range(13, 20)]
    reference = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.RMSNorm(32))
    assert _graph_count(_Block(), shapes) <= _graph_count(reference, shapes)


def test_export_with_dynamic_batch_and_sequence() -> None:
    from torch.export import Dim, export

    block = _Block()
    dims = {"x": {0: Dim("batch"), 1: Dim("seq")}}
    program = export(block, (torch.randn(4, 8, 32),), dynamic_shapes=dims)
    for shape in ((9, 13, 32), (2, 3, 32)):
        x = torch.randn(*shape)
        assert torch.allclose(program.module()(x), block(x), atol=1e-5)


def test_jit_trace_of_a_model_with_normlab_s_modules() -> None:
    """torch.jit.trace records the modules' calls (before: AttributeError 'bit_length' in
    dispatch): the traced model gives the same results on other shapes."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), normlab_torch.LayerNorm(32))
    traced = torch.jit.trace(model, torch.randn(4, 32))
    x = torch.randn(7, 32)
    assert torch.allclose(traced(x), model(x), atol=1e-6)
