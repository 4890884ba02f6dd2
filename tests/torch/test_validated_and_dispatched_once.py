"""The core wraps autograd once: a call validates its arguments once and dispatches once, in eager
mode, under ``torch.compile`` (aot_eager) and under ``torch.export``, with and without grad,
named backend or not. The custom ops call the chosen backend's own function, never the public
API, and a backend never calls up into torch integration."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import normlab
from normlab import dispatch, registry, route, spec

torch = pytest.importorskip("torch")
nt = pytest.importorskip("normlab.torch")

RNG = np.random.default_rng(5)


def _backend(name: str | None) -> str | None:
    if name is not None and not registry.get(name).available:
        pytest.skip(f"backend {name!r} is unavailable here: {registry.get(name).reason}")
    return name


@pytest.fixture(params=["numba", None], ids=["numba", "backend=None"])
def backend(request: pytest.FixtureRequest) -> str | None:
    return _backend(request.param)


@contextlib.contextmanager
def counting(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter[str]]:
    """Count the caller's calls (``normlab.layer_norm``/``rms_norm``, as the modules call them,
    outside any call already running), entries into validation (``spec.validated``) and
    dispatch (``dispatch.choose``), and those entered again while ``route.run`` runs a call (a
    backend or an op going back through the public API)."""
    counts: collections.Counter[str] = collections.Counter()
    running = [0]

    def counted(module: Any, name: str) -> None:
        original = getattr(module, name)

        def entry(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            if running[0]:
                counts[f"{name} again inside route.run"] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, entry)

    def caller(name: str) -> None:
        original = getattr(normlab, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if not running[0]:
                counts["call"] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(normlab, name, call)

    caller("layer_norm")
    caller("rms_norm")
    counted(spec, "validated")
    counted(dispatch, "choose")
    run = route.run

    def route_run(*args: Any, **kwargs: Any) -> Any:
        running[0] += 1
        try:
            return run(*args, **kwargs)
        finally:
            running[0] -= 1

    monkeypatch.setattr(route, "run", route_run)
    yield counts


class _Block(torch.nn.Module):
    def __init__(self, backend: str | None, module: str = "LayerNorm") -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.norm = getattr(nt, module)(16, backend=backend)

    def forward(self, x: Any) -> Any:
        return self.norm(torch.relu(self.linear(x)))


def _x(rows: int) -> Any:
    return torch.tensor(RNG.standard_normal((rows, 16)), dtype=torch.float32)


def _records_no_graph(model: _Block, x: Any) -> bool:
    """Whether the backend that serves ``model``'s norm on ``x`` (named, or the dispatcher's
    choice by cost) records no autograd graph: then normlab's custom op runs it."""
    norm = model.norm
    with torch.no_grad():
        hidden = torch.relu(model.linear(x))
    plan = spec.plan("layer_norm", hidden, weight=norm.weight, bias=norm.bias)
    chosen = dispatch.choose(plan, norm.backend)
    return "autograd" not in chosen.backend.capabilities


# --------------------------------------------------------------------------------------------
# Eager


@pytest.mark.parametrize("module", ["LayerNorm", "RMSNorm"])
def test_eager_forward_and_backward_validate_and_dispatch_once(
    backend: str | None, module: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _Block(backend, module)
    x = _x(6).requires_grad_(True)
    with counting(monkeypatch) as counts:
        y = model(x)
        y.backward(torch.ones_like(y))
    assert counts == {"call": 1, "validated": 1, "choose": 1}  # the backward op: neither again
    assert x.grad is not None and model.norm.weight.grad is not None


def test_eager_functional_call_with_stats(monkeypatch: pytest.MonkeyPatch) -> None:
    _backend("numba")
    x = _x(5).reshape(5, 2, 8).requires_grad_(True)
    w = torch.ones(2, 8, requires_grad=True)
    with counting(monkeypatch) as counts:
        y, mean, rstd = normlab.layer_norm(x, (2, 8), w, backend="numba", return_stats=True)
        (y * y).sum().backward()
    assert counts == {"call": 1, "validated": 1, "choose": 1}
    assert y.grad_fn is not None and not mean.requires_grad and not rstd.requires_grad
    x64, w64 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    want = torch.nn.functional.layer_norm(x64, (2, 8), w64)
    (want * want).sum().backward()
    assert torch.allclose(x.grad.double(), x64.grad, atol=1e-4)
    assert torch.allclose(w.grad.double(), w64.grad, atol=1e-4)


def test_backward_op_on_tensors_that_require_grad_dispatches_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _backend("numba")
    x, dy = _x(4).requires_grad_(True), _x(4)
    _, mean, rstd = normlab.layer_norm(x.detach(), return_stats=True)
    with counting(monkeypatch) as counts:
        dx, _, _ = normlab.layer_norm_backward(dy, x, mean, rstd, backend="numba", needs=("x",))
    assert counts == {"validated": 1, "choose": 1}
    assert dx.grad_fn is not None  # in the graph, as a leaf op (no double backward)


def test_out_with_a_weight_that_requires_grad_is_written_by_the_core() -> None:
    """The custom op computes; the core copies into ``out`` (torch records the copy)."""
    _backend("numba")
    x, w = _x(4), torch.ones(16, requires_grad=True)
    out = torch.empty(4, 16)
    y = normlab.layer_norm(x, 16, w, backend="numba", out=out)
    assert y is out and out.grad_fn is not None
    assert torch.allclose(out.detach(), torch.nn.functional.layer_norm(x, (16,)), atol=1e-5)


# --------------------------------------------------------------------------------------------
# torch.compile (aot_eager) and torch.export


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_torch_compile_validates_once_per_trace_and_never_at_run_time(
    backend: str | None, grad: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _Block(backend)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = _x(8)
    with torch.set_grad_enabled(grad), counting(monkeypatch) as counts:
        y = compiled(x)
    passes = counts["call"]  # torch runs the module's node once per pass (metadata, joint…)
    assert passes >= 1 and counts == {"call": passes, "validated": passes, "choose": passes}
    with torch.set_grad_enabled(grad), counting(monkeypatch) as again:
        y_again = compiled(x)
        if grad:
            y_again.sum().backward()
    assert again == {}  # the compiled graph calls the op (or torch's) directly
    assert torch.equal(y, y_again) and torch.equal(y.detach(), model(x).detach())


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_torch_export_validates_once(
    backend: str | None, grad: bool, strict: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _Block(backend)
    model.requires_grad_(grad)
    x = _x(8)
    with counting(monkeypatch) as counts:
        program = torch.export.export(model, (x,), strict=strict)
    passes = counts["call"]  # strict: dynamo's pass, then the export trace
    assert passes == (2 if strict else 1)
    assert counts == {"call": passes, "validated": passes, "choose": passes}
    targets = {str(node.target) for node in program.graph.nodes}
    # the custom op is in the graph exactly when the backend chosen records no graph itself
    assert ("normlab.layer_norm.default" in targets) == _records_no_graph(model, x)
    with counting(monkeypatch) as again:
        y = program.module()(x)
    assert again == {}
    assert torch.equal(y, model(x))


# --------------------------------------------------------------------------------------------
# The op calls the backend's own function with a row plan rebuilt from its arguments


def test_the_op_calls_the_backend_function_with_a_cached_row_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _backend("numba")
    numba = registry.get("numba")
    seen: list[Any] = []
    original = numba.module.layer_norm

    def spy(x: Any, weight: Any, bias: Any, *, plan: Any, out: Any) -> Any:
        seen.append((plan, x.requires_grad, out))
        return original(x, weight, bias, plan=plan, out=out)

    monkeypatch.setattr(numba.module, "layer_norm", spy)
    x = _x(6).reshape(2, 3, 16).requires_grad_(True)
    for _ in range(2):
        normlab.layer_norm(x, 16, eps=1e-3, backend="numba").sum().backward()
    (first, grad, out), (second, _, _) = seen
    assert first is second  # rebuilt from the op's arguments through a cache
    assert (first.rows, first.cols, first.eps, first.shape) == (6, 16, 1e-3, (6, 16))
    assert first.return_stats and not first.requires_grad and not grad and out is None


class RowsTorch:
    """A third-party backend of CPU torch tensors that records no graph: NumPy arithmetic (the
    numpy backend's functions) on the tensors' memory; it provides the backward op."""

    @staticmethod
    def layer_norm(x: Any, weight: Any, bias: Any, *, plan: Any, out: Any) -> Any:
        from normlab.backends import numpy_backend

        arrays = (None if a is None else a.numpy() for a in (x, weight, bias))
        y, mean, rstd = numpy_backend.layer_norm(*arrays, plan=plan, out=None)
        return tuple(None if a is None else torch.from_numpy(a) for a in (y, mean, rstd))

    @staticmethod
    def layer_norm_backward(
        dy: Any, x: Any, mean: Any, rstd: Any, weight: Any, *, plan: Any, needs: Any
    ) -> Any:
        from normlab.backends import numpy_backend

        arrays = (None if a is None else a.numpy() for a in (dy, x, mean, rstd, weight))
        grads = numpy_backend.layer_norm_backward(*arrays, plan=plan, needs=needs)
        return tuple(None if g is None else torch.from_numpy(g) for g in grads)


def test_a_torch_plugin_without_autograd_is_run_through_the_custom_ops(register: Any) -> None:
    """Any backend that records no graph and provides the backward op keeps the graph through
    the core: the same path as numba's, for a third party."""
    from tests.support.plugins_for_tests import record

    register(
        record(
            "rows_torch",
            module=f"{__name__}:RowsTorch",
            families=frozenset({"torch"}),
            ops=frozenset({"layer_norm", "layer_norm_backward"}),
            priority=100,
        )
    )
    x, w = _x(4).requires_grad_(True), torch.ones(16, requires_grad=True)
    assert "chosen: rows_torch" in normlab.explain(x, 16, w)
    y = normlab.layer_norm(x, 16, w)
    assert y.grad_fn is not None
    y.backward(torch.ones_like(y) + x.detach())
    x64 = x.detach().double().requires_grad_(True)
    want = torch.nn.functional.layer_norm(x64, (16,))
    want.backward(torch.ones(4, 16, dtype=torch.float64) + x64.detach())
    assert torch.allclose(x.grad.double(), x64.grad, atol=1e-5)
    assert w.grad is not None
