"""normlab.torch.AddLayerNorm and AddRMSNorm: torch's constructors and checkpoints, outputs and
gradients of the unfused ``norm(x + residual)``, and torch.compile.

The reference is torch's own module on ``h = x + residual``, differentiated by torch autograd:
``h`` must be bitwise that add, ``y`` and every gradient within the tolerance table (float64:
near its rounding).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

import normlab
from normlab import dispatch, registry
from normlab.testing.tolerances import TOLERANCES

torch = pytest.importorskip("torch")
nt = pytest.importorskip("normlab.torch")

RNG = np.random.default_rng(17)
MODULES = {"AddLayerNorm": "LayerNorm", "AddRMSNorm": "RMSNorm"}


@pytest.fixture(params=[None, "torch", "numba"])
def backend(request: pytest.FixtureRequest) -> str | None:
    """None (normlab's choice), torch, or numba through normlab's custom ops."""
    if request.param == "numba":
        numba = registry.get("numba")
        if not numba.available:
            pytest.skip(f"backend 'numba' is unavailable here: {numba.reason}")
        if not dispatch.keeps_graph(numba, "layer_norm"):
            pytest.skip("numba provides no layer_norm_backward")
    name: str | None = request.param
    return name


def _tensor(*shape: int, dtype: Any = torch.float32) -> Any:
    return torch.tensor(RNG.standard_normal(shape), dtype=dtype)


def _assert_close(got: Any, want: Any, dtype: Any, factor: float = 64) -> None:
    """As test_torch_module: ``factor`` times the table's compute tolerance plus four roundings,
    scaled by the reference's largest magnitude."""
    tol = TOLERANCES[str(dtype).removeprefix("torch.")]
    got, want = got.detach().double(), want.detach().double()
    scale = 1.0 + float(want.abs().max())
    limit = factor * tol.compute * scale + 4 * tol.rounding * scale
    error = float((got - want).abs().max())
    assert error <= limit, f"error {error:.3g} > {limit:.3g}"


def _pair(name: str, kwargs: dict[str, Any], backend: str | None, dtype: Any) -> tuple[Any, Any]:
    """normlab's fused module and torch's unfused one, with the same random parameters."""
    stock = getattr(torch.nn, MODULES[name])((4, 6), **kwargs, dtype=dtype)
    with torch.no_grad():
        for p in stock.parameters():
            p.copy_(_tensor(*p.shape, dtype=dtype))
    mine = getattr(nt, name)((4, 6), **kwargs, dtype=dtype, backend=backend)
    mine.load_state_dict(stock.state_dict())
    return mine, stock


def _fused_grads(module: Any, x: Any, residual: Any, dy: Any, dh: Any) -> list[Any]:
    """``y``, ``h`` and the gradients of ``sum(y * dy + h * dh)`` for x, residual and the
    parameters: the module's fused forward."""
    x, residual = (t.detach().requires_grad_(True) for t in (x, residual))
    y, h = module(x, residual)
    grads = torch.autograd.grad((y, h), [x, residual, *module.parameters()], (dy, dh))
    return [y.detach(), h.detach(), *grads]


def _unfused_grads(module: Any, x: Any, residual: Any, dy: Any, dh: Any) -> list[Any]:
    """The same for torch's module on ``x + residual``, differentiated by torch autograd."""
    x, residual = (t.detach().requires_grad_(True) for t in (x, residual))
    h = x + residual
    y = module(h)
    grads = torch.autograd.grad((y, h), [x, residual, *module.parameters()], (dy, dh))
    return [y.detach(), h.detach(), *grads]


# --------------------------------------------------------------------------------------------
# Constructors and checkpoints


@pytest.mark.parametrize("name", sorted(MODULES))
def test_constructor_mirrors_torch(name: str) -> None:
    mine = inspect.signature(getattr(nt, name)).parameters
    stock = inspect.signature(getattr(torch.nn, MODULES[name])).parameters
    ours_only = {"backend", "weight_offset", "casting"}  # normlab's own, keyword only
    assert [(p.name, p.default) for p in stock.values()] == [
        (p.name, p.default) for p in mine.values() if p.name not in ours_only
    ]
    keyword_only = inspect.Parameter.KEYWORD_ONLY
    assert all(p.kind is keyword_only for p in mine.values() if p.name in ours_only)


def test_unknown_backend_is_refused_at_construction() -> None:
    for name in MODULES:
        with pytest.raises(normlab.BackendError, match="nope"):
            getattr(nt, name)(8, backend="nope")


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("AddLayerNorm", {}),
        ("AddLayerNorm", {"bias": False}),
        ("AddLayerNorm", {"elementwise_affine": False}),
        ("AddRMSNorm", {}),
        ("AddRMSNorm", {"elementwise_affine": False}),
    ],
    ids=["ln", "ln-no-bias", "ln-no-affine", "rms", "rms-no-affine"],
)
def test_state_dict_round_trip(name: str, kwargs: dict[str, Any]) -> None:
    """A checkpoint of torch's module loads into normlab's and back, key for key, value for
    value."""
    mine, stock = _pair(name, kwargs, None, torch.float32)
    assert list(mine.state_dict()) == list(stock.state_dict())
    for key, value in stock.state_dict().items():
        assert torch.equal(mine.state_dict()[key], value)
    fresh = getattr(torch.nn, MODULES[name])((4, 6), **kwargs)
    fresh.load_state_dict(mine.state_dict(), strict=True)
    for key, value in mine.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value)


def test_extra_repr_names_the_backend() -> None:
    assert repr(nt.AddLayerNorm(8, backend="torch")) == (
        "AddLayerNorm((8,), eps=1e-05, elementwise_affine=True, bias=True, backend='torch')"
    )
    assert repr(nt.AddRMSNorm(8)) == (
        "AddRMSNorm((8,), eps=None, elementwise_affine=True, backend=None)"
    )


# --------------------------------------------------------------------------------------------
# Outputs and gradients against the unfused form


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("AddLayerNorm", {}),
        ("AddLayerNorm", {"bias": False}),
        ("AddLayerNorm", {"elementwise_affine": False, "eps": 1e-3}),
        ("AddRMSNorm", {}),
        ("AddRMSNorm", {"eps": 1e-6}),
    ],
    ids=["ln", "ln-no-bias", "ln-no-affine-eps", "rms", "rms-eps"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_matches_the_unfused_form(
    backend: str | None, name: str, kwargs: dict[str, Any], dtype: Any
) -> None:
    """``h`` is bitwise ``x + residual``; ``y`` and the gradients of x, residual, weight and
    bias (of a loss that uses both ``y`` and ``h``) are those of torch autograd on the unfused
    form: float32 as the modules' tests, float64 within a dozen of its roundings (scaled by the
    largest magnitude), room for a kernel's own order of summation and no more."""
    mine, stock = _pair(name, kwargs, backend, dtype)
    x, residual, dy, dh = (_tensor(3, 4, 6, dtype=dtype) for _ in range(4))
    got = _fused_grads(mine, x, residual, dy, dh)
    want = _unfused_grads(stock, x, residual, dy, dh)
    assert len(got) == len(want)
    assert torch.equal(got[1], want[1]), "h is not bitwise x + residual"
    factor = 64 if dtype == torch.float32 else 1
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        _assert_close(g, w, dtype, factor)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_modules(dtype: Any) -> None:
    """Half-precision parameters and inputs (as torch's modules hold them): ``h`` is the half
    add, ``y`` and the gradients within the table."""
    for name in MODULES:
        mine, stock = _pair(name, {}, None, dtype)
        x, residual, dy, dh = (_tensor(5, 4, 6, dtype=dtype) for _ in range(4))
        got = _fused_grads(mine, x, residual, dy, dh)
        want = _unfused_grads(stock, x, residual, dy, dh)
        assert torch.equal(got[1], want[1])
        for g, w in zip(got, want, strict=True):
            assert g.dtype == dtype
            _assert_close(g, w, dtype)


def test_inputs_are_not_modified(backend: str | None) -> None:
    mine, _ = _pair("AddLayerNorm", {}, backend, torch.float32)
    x, residual = _tensor(2, 4, 6), _tensor(2, 4, 6)
    before = (x.clone(), residual.clone())
    with torch.no_grad():
        y, h = mine(x, residual)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])
    assert h.data_ptr() not in (x.data_ptr(), residual.data_ptr())
    assert not y.requires_grad


# --------------------------------------------------------------------------------------------
# torch.compile


class _PreNormBlock(torch.nn.Module):
    """``h = x + linear(x)``; ``y = norm(h)``; returns ``y + h`` (both outputs used)."""

    def __init__(self, name: str, backend: str | None) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)
        self.norm = getattr(nt, name)(16, backend=backend)

    def forward(self, x: Any) -> Any:
        y, h = self.norm(torch.relu(self.linear(x)), x)
        return y + h


@pytest.mark.parametrize("name", sorted(MODULES))
def test_torch_compile(backend: str | None, name: str) -> None:
    """torch.compile (aot_eager, fullgraph, static shapes) runs the module: one graph, outputs
    and gradients as eager's (within the table: AOTAutograd may decompose torch's own rms_norm
    into primitive ops that round differently)."""
    torch._dynamo.reset()
    model = _PreNormBlock(name, backend)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
    x, dz = _tensor(6, 16), _tensor(6, 16)
    results = []
    for module in (compiled, model):
        xs = x.detach().requires_grad_(True)
        z = module(xs)
        grads = torch.autograd.grad(z, [xs, *model.parameters()], dz)
        results.append([z.detach(), *grads])
    for got, want in zip(*results, strict=True):
        _assert_close(got, want, torch.float32)
