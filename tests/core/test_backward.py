"""The backward ops: finite differences, torch.autograd, large offsets, determinism, bad inputs.

Each backend that lists ``layer_norm_backward`` in its record runs on its array families: numpy
and numba on NumPy arrays, torch on tensors, numba on CPU tensors (named explicitly). Gradients
are compared with the suite's float64 oracles within the tolerance table of ``normlab.testing``,
scaled for the backward formula (:func:`normlab.testing.tolerances.gradient_scales`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import normlab
from normlab import dispatch, reference, registry, spec
from normlab.ops import OPS
from normlab.testing import backward_reference
from normlab.testing.conversions import numpy_dtype
from normlab.testing.tolerances import assert_close

RNG = np.random.default_rng(7)


@dataclass(frozen=True)
class Subject:
    """A backend and the array family it runs on here."""

    backend: str
    family: str

    def array(self, a: np.ndarray) -> Any:
        return registry.get(self.family).from_numpy(a)

    def numpy(self, a: Any) -> np.ndarray:
        return np.asarray(registry.get(self.family).to_numpy(a))


SUBJECTS = [
    Subject("numpy", "numpy"),
    Subject("numba", "numpy"),
    Subject("torch", "torch"),
    Subject("numba", "torch"),
]


@pytest.fixture(params=SUBJECTS, ids=[f"{s.backend}-{s.family}" for s in SUBJECTS])
def subject(request: pytest.FixtureRequest) -> Subject:
    s: Subject = request.param
    for name in {s.backend, s.family}:
        backend = registry.get(name)
        if not backend.available:
            pytest.skip(f"backend {name!r} is unavailable here: {backend.reason}")
    if "layer_norm_backward" not in registry.get(s.backend).ops:
        pytest.skip(f"backend {s.backend!r} does not provide layer_norm_backward")
    return s


def _x(shape: tuple[int, ...], dtype: str, offset: float = 0.0, scale: float = 1.0) -> np.ndarray:
    return (offset + scale * RNG.standard_normal(shape)).astype(numpy_dtype(dtype))


def _param(cols: tuple[int, ...], dtype: str) -> np.ndarray:
    return (1.0 + 0.5 * RNG.standard_normal(cols)).astype(numpy_dtype(dtype))


@dataclass
class Case:
    """A forward call, its statistics from the backend under test, and an upstream ``dy``."""

    op: str
    x: np.ndarray
    dy: np.ndarray
    weight: np.ndarray | None
    bias: np.ndarray | None
    axes: tuple[int, ...]
    eps: float


def _case(
    op: str,
    shape: tuple[int, ...],
    axes: tuple[int, ...],
    dtype: str,
    *,
    weight: bool = True,
    bias: bool = True,
    param_dtype: str | None = None,
    offset: float = 0.0,
    scale: float = 1.0,
) -> Case:
    norm_shape = tuple(shape[a] for a in axes)
    pdtype = param_dtype or dtype
    return Case(
        op=op,
        x=_x(shape, dtype, offset, scale),
        dy=_x(shape, dtype),
        weight=_param(norm_shape, pdtype) if weight else None,
        bias=_param(norm_shape, pdtype) if bias and op == "layer_norm" else None,
        axes=axes,
        eps=1e-5,
    )


def _run(
    s: Subject, case: Case, needs: tuple[str, ...] | None = None
) -> tuple[dict[str, np.ndarray | None], Any]:
    """The backward on ``s`` (stats from the forward on ``s``): gradients as NumPy, and the
    stats (keepdims, NumPy)."""
    a = s.array
    x, dy = a(case.x), a(case.dy)
    w = None if case.weight is None else a(case.weight)
    if case.op == "layer_norm":
        b = None if case.bias is None else a(case.bias)
        _, mean, rstd = normlab.layer_norm(
            x, None, w, b, case.eps, axis=case.axes, backend=s.backend, return_stats=True
        )
        extra = {} if needs is None else {"needs": needs}
        grads = normlab.layer_norm_backward(
            dy, x, mean, rstd, w, axis=case.axes, backend=s.backend, **extra
        )
        names = ("x", "weight", "bias")
        stats = (s.numpy(mean), s.numpy(rstd))
    else:
        _, rstd = normlab.rms_norm(
            x, None, w, case.eps, axis=case.axes, backend=_forward_backend(s, "rms_norm"),
            return_stats=True,
        )  # fmt: skip
        extra = {} if needs is None else {"needs": needs}
        grads = normlab.rms_norm_backward(
            dy, x, rstd, w, axis=case.axes, backend=s.backend, **extra
        )
        names = ("x", "weight")
        stats = (None, s.numpy(rstd))
    return {n: None if g is None else s.numpy(g) for n, g in zip(names, grads, strict=True)}, stats


def _require_rms(s: Subject) -> None:
    if "rms_norm_backward" not in registry.get(s.backend).ops:
        pytest.skip(f"backend {s.backend!r} does not provide rms_norm_backward")


def _forward_backend(s: Subject, op: str) -> str:
    """The backend that runs the forward: the subject's own, else its family's (the backward
    only reads the statistics)."""
    return s.backend if op in registry.get(s.backend).ops else s.family


# --------------------------------------------------------------------------------------------
# float64 oracles


def _oracle(case: Case) -> dict[str, np.ndarray]:
    """Exact gradients in float64 and what their tolerances scale with: the suite's oracle
    (:func:`normlab.testing.backward_reference.gradients`), checked against finite differences
    here in :func:`test_oracle_matches_finite_differences`. Keys: the gradients' names, each
    with ``_scale`` too, and ``"conditioning"``."""
    want = backward_reference.gradients(case.op, case.x, case.dy, case.weight, case.eps, case.axes)
    scales = {f"{name}_scale": scale for name, scale in want.scales.items()}
    return {**want.gradients, **scales, "conditioning": want.conditioning}


def _grad_dtype(case: Case) -> str:
    """The dtype of dweight/dbias: weight's, or x's without weight."""
    return (case.weight if case.weight is not None else case.x).dtype.name


def _assert_gradients(
    grads: dict[str, np.ndarray | None], case: Case, want: dict[str, np.ndarray], label: str
) -> None:
    dtype = case.x.dtype.name
    cols = math.prod(case.x.shape[a] for a in case.axes)
    rows = case.x.size // max(cols, 1)
    repro = f"{label}: op={case.op} shape={case.x.shape} axes={case.axes} dtype={dtype}"
    cond = want["conditioning"]
    got = grads["x"]
    assert got is not None and got.dtype == case.x.dtype
    assert_close(
        got, want["x"], dtype, cond, what="y", cols=cols, scale=want["x_scale"], repro=repro
    )
    # dweight and dbias sum rows whose x̂ carries the error of the row statistics (growth with
    # log2(cols)) and add the error of the sum over rows (log2(rows)): log2(rows * cols).
    for name in ("weight", "bias"):
        if name not in grads:
            continue
        got = grads[name]
        assert got is not None and got.dtype.name == _grad_dtype(case), (name, got)
        assert_close(
            got, want[name], _grad_dtype(case), cond.max(initial=1.0), what="y", cols=rows * cols,
            scale=want[f"{name}_scale"], repro=f"{repro} ({name})",
        )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Numerics


def _central_differences(
    loss: Callable[[dict[str, np.ndarray | None]], float], params: dict[str, np.ndarray | None]
) -> dict[str, np.ndarray]:
    """The gradient of ``loss(params)`` with respect to each array in ``params`` (step 1e-6)."""
    h = 1e-6
    numeric = {}
    for name, value in params.items():
        if value is None:
            continue
        grad = np.empty_like(value)
        for i in np.ndindex(value.shape):
            shifted = []
            for step in (h, -h):
                moved = value.copy()
                moved[i] += step
                shifted.append(loss({**params, name: moved}))
            grad[i] = (shifted[0] - shifted[1]) / (2 * h)
        numeric[name] = grad
    return numeric


def _params(case: Case) -> dict[str, np.ndarray | None]:
    return {"x": case.x, "weight": case.weight, "bias": case.bias}


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize(
    ("shape", "axes"), [((3, 5), (1,)), ((2, 3, 4), (1, 2)), ((3, 2, 4), (0, 2))]
)
def test_oracle_matches_finite_differences(
    op: str, shape: tuple[int, ...], axes: tuple[int, ...]
) -> None:
    """The float64 oracle is the gradient of reference.layer_norm / rms_norm (central
    differences on small inputs, every arrangement of axes)."""
    case = _case(op, shape, axes, "float64")

    def loss(p: dict[str, np.ndarray | None]) -> float:
        if op == "layer_norm":
            y = reference.layer_norm(p["x"], None, p["weight"], p["bias"], case.eps, axis=axes)[0]
        else:
            y = reference.rms_norm(p["x"], None, p["weight"], case.eps, axis=axes)[0]
        return float((y * case.dy).sum())

    want = _oracle(case)
    for name, numeric in _central_differences(loss, _params(case)).items():
        np.testing.assert_allclose(want[name], numeric, rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_float64_matches_finite_differences(subject: Subject, op: str) -> None:
    """Each backend's float64 gradients equal central differences of the forward it runs."""
    if op == "rms_norm":
        _require_rms(subject)
    case = _case(op, (3, 2, 4), (0, 2), "float64")
    grads, _ = _run(subject, case)

    def loss(p: dict[str, np.ndarray | None]) -> float:
        x, w, b = (None if a is None else subject.array(a) for a in p.values())
        kwargs: dict[str, Any] = {"axis": case.axes, "backend": _forward_backend(subject, op)}
        if op == "layer_norm":
            y = normlab.layer_norm(x, None, w, b, case.eps, **kwargs)
        else:
            y = normlab.rms_norm(x, None, w, case.eps, **kwargs)
        return float((subject.numpy(y) * case.dy).sum())

    for name, numeric in _central_differences(loss, _params(case)).items():
        np.testing.assert_allclose(grads[name], numeric, rtol=1e-6, atol=1e-7, err_msg=name)


RANDOM_CASES = [
    ((7, 33), (1,)),
    ((2, 5, 64), (2,)),
    ((3, 4, 10), (1, 2)),
    ((6, 3, 8), (0, 2)),
    ((1, 1000), (1,)),
    ((70, 1), (1,)),
]


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("shape", "axes"), RANDOM_CASES, ids=[str(c) for c in RANDOM_CASES])
def test_matches_torch_autograd(
    subject: Subject, dtype: str, shape: tuple[int, ...], axes: tuple[int, ...]
) -> None:
    """dx, dweight, dbias of every dtype against torch.autograd in float64 on the same inputs;
    half types with float32 parameters too."""
    torch = pytest.importorskip("torch")
    for param_dtype in {dtype, "float32"} if dtype in ("float16", "bfloat16") else {dtype}:
        case = _case("layer_norm", shape, axes, dtype, param_dtype=param_dtype)
        grads, _ = _run(subject, case)
        want = _oracle(case)
        batch = tuple(a for a in range(len(shape)) if a not in axes)
        x64 = torch.tensor(case.x.astype(np.float64), requires_grad=True)
        assert case.weight is not None and case.bias is not None
        w64 = torch.tensor(case.weight.astype(np.float64), requires_grad=True)
        b64 = torch.tensor(case.bias.astype(np.float64), requires_grad=True)
        y = torch.nn.functional.layer_norm(
            x64.permute(batch + axes), w64.shape, w64, b64, case.eps
        ).permute(tuple(int(i) for i in np.argsort(batch + axes)))
        dy64 = torch.tensor(case.dy.astype(np.float64))
        autograd = torch.autograd.grad(y, (x64, w64, b64), dy64)
        for name, g in zip(("x", "weight", "bias"), autograd, strict=True):
            np.testing.assert_allclose(want[name], g.numpy(), rtol=1e-9, atol=1e-9)
        _assert_gradients(grads, case, want, subject.backend)


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_rms_norm_matches_torch_autograd(subject: Subject, dtype: str) -> None:
    torch = pytest.importorskip("torch")
    _require_rms(subject)
    for shape, axes in ((7, 33), (1,)), ((6, 3, 8), (0, 2)):
        case = _case("rms_norm", shape, axes, dtype)
        grads, _ = _run(subject, case)
        want = _oracle(case)
        batch = tuple(a for a in range(len(shape)) if a not in axes)
        x64 = torch.tensor(case.x.astype(np.float64), requires_grad=True)
        assert case.weight is not None
        w64 = torch.tensor(case.weight.astype(np.float64), requires_grad=True)
        y = torch.nn.functional.rms_norm(x64.permute(batch + axes), w64.shape, w64, case.eps)
        y = y.permute(tuple(int(i) for i in np.argsort(batch + axes)))
        autograd = torch.autograd.grad(y, (x64, w64), torch.tensor(case.dy.astype(np.float64)))
        for name, g in zip(("x", "weight"), autograd, strict=True):
            np.testing.assert_allclose(want[name], g.numpy(), rtol=1e-9, atol=1e-9)
        _assert_gradients(grads, case, want, subject.backend)


def test_large_offset(subject: Subject) -> None:
    """``100 + 0.01·randn`` in float32: the float32 mean's rounding must not reach dx."""
    case = _case("layer_norm", (16, 256), (1,), "float32", offset=100.0, scale=0.01)
    grads, _ = _run(subject, case)
    _assert_gradients(grads, case, _oracle(case), subject.backend)


def test_constant_rows(subject: Subject) -> None:
    """A constant row has x̂ = 0: dx = rstd * (g - mean(g)), dweight gets nothing from it."""
    case = _case("layer_norm", (4, 8), (1,), "float32")
    case.x[:] = 3.0
    grads, _ = _run(subject, case)
    _assert_gradients(grads, case, _oracle(case), subject.backend)
    assert grads["weight"] is not None
    np.testing.assert_array_equal(grads["weight"], 0.0)


def test_nan_stays_in_its_row(subject: Subject) -> None:
    case = _case("layer_norm", (4, 8), (1,), "float32")
    case.x[1, 3] = np.nan
    grads, _ = _run(subject, case)
    dx = grads["x"]
    assert dx is not None
    assert np.isnan(dx[1]).all()
    assert np.isfinite(np.delete(dx, 1, axis=0)).all()


@pytest.mark.parametrize(
    ("weight", "bias"), [(True, True), (True, False), (False, True), (False, False)]
)
def test_affine_combinations(subject: Subject, weight: bool, bias: bool) -> None:
    """Weight only, bias only, neither: the gradients do not depend on bias, and dweight and
    dbias are computed (in x's dtype without weight) whenever they are asked for."""
    case = _case("layer_norm", (5, 12), (1,), "float16", weight=weight, bias=bias)
    grads, _ = _run(subject, case)
    _assert_gradients(grads, case, _oracle(case), subject.backend)


@pytest.mark.parametrize(
    "needs", [(), ("x",), ("weight",), ("bias",), ("x", "bias"), ["weight", "x"]]
)
def test_needs(subject: Subject, needs: tuple[str, ...]) -> None:
    """An entry is None exactly when it is not in ``needs``; the others are unchanged."""
    case = _case("layer_norm", (5, 12), (1,), "float32")
    grads, _ = _run(subject, case, needs)
    full, _ = _run(subject, case)
    for name, got in grads.items():
        if name in needs:
            assert got is not None
            np.testing.assert_array_equal(got, full[name])
        else:
            assert got is None


def test_rms_norm_needs(subject: Subject) -> None:
    _require_rms(subject)
    case = _case("rms_norm", (5, 12), (1,), "float32")
    grads, _ = _run(subject, case, ("weight",))
    assert grads["x"] is None and grads["weight"] is not None


@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (2, 0, 4)])
def test_empty(subject: Subject, shape: tuple[int, ...]) -> None:
    """No rows or no columns: an empty dx and zero sums of the normalized shape."""
    case = _case("layer_norm", shape, (len(shape) - 1,), "float32")
    grads, _ = _run(subject, case)
    assert grads["x"] is not None and grads["x"].shape == shape
    for name in ("weight", "bias"):
        got = grads[name]
        assert got is not None and got.shape == (shape[-1],) and got.dtype == np.float32
        np.testing.assert_array_equal(got, 0.0)


def test_strided_inputs(subject: Subject) -> None:
    """A transposed x and a broadcast dy (stride 0, as ``y.sum().backward()`` makes)."""
    case = _case("layer_norm", (12, 9), (1,), "float32")
    x = subject.array(np.ascontiguousarray(case.x.T)).T
    dy_row = case.dy[:1]
    dy = subject.array(dy_row)
    dy = dy.expand(12, 9) if subject.family == "torch" else np.broadcast_to(dy, (12, 9))
    case.dy = np.broadcast_to(dy_row, (12, 9)).copy()
    w = subject.array(case.weight)
    _, mean, rstd = normlab.layer_norm(x, 9, w, None, backend=subject.backend, return_stats=True)
    grads = normlab.layer_norm_backward(dy, x, mean, rstd, w, backend=subject.backend)
    got = dict(zip(("x", "weight", "bias"), map(subject.numpy, grads), strict=True))
    _assert_gradients(got, case, _oracle(case), subject.backend)


# --------------------------------------------------------------------------------------------
# Determinism


@pytest.fixture
def set_threads() -> Iterator[Callable[[int], None]]:
    """``set_threads(n)``: numba's and torch's thread counts, restored after the test."""
    numba = pytest.importorskip("numba") if registry.get("numba").available else None
    torch = pytest.importorskip("torch") if registry.get("torch").available else None
    before = (
        numba.get_num_threads() if numba else None,
        torch.get_num_threads() if torch else None,
    )

    def _set(n: int) -> None:
        if numba is not None:
            numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
        if torch is not None:
            torch.set_num_threads(n)

    yield _set
    if numba is not None and before[0] is not None:
        numba.set_num_threads(before[0])
    if torch is not None and before[1] is not None:
        torch.set_num_threads(before[1])


@pytest.mark.parametrize(("dtype", "weight"), [("float32", True), ("float16", False)])
def test_bitwise_repeatable_across_runs_and_threads(
    subject: Subject, set_threads: Callable[[int], None], dtype: str, weight: bool
) -> None:
    """dx, dweight and dbias are the same bits run after run, with 1 or 2 threads (the input is
    large enough for the parallel kernels)."""
    case = _case("layer_norm", (1000, 160), (1,), dtype, weight=weight)
    runs = []
    for threads in (1, 2, 2, 1):
        set_threads(threads)
        grads, _ = _run(subject, case)
        runs.append({name: g.tobytes() for name, g in grads.items() if g is not None})
    assert all(run == runs[0] for run in runs[1:])


def test_inputs_untouched(subject: Subject) -> None:
    case = _case("layer_norm", (6, 10), (1,), "float32")
    a = subject.array
    x, dy, w = a(case.x), a(case.dy), a(case.weight)
    _, mean, rstd = normlab.layer_norm(x, 10, w, None, backend=subject.backend, return_stats=True)
    before = [subject.numpy(t).copy() for t in (x, dy, w, mean, rstd)]
    normlab.layer_norm_backward(dy, x, mean, rstd, w, backend=subject.backend)
    for old, t in zip(before, (x, dy, w, mean, rstd), strict=True):
        np.testing.assert_array_equal(old, subject.numpy(t))


@pytest.mark.parametrize("op", ["layer_norm_backward", "rms_norm_backward"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_numba_half_backward_is_its_float32_backward_rounded_once(dtype: str, op: str) -> None:
    """numba decodes a half row once and computes in float32: dx is the float32 backward of the
    decoded values rounded to the half type (within one unit of that type: the two kernels may
    add a row's sums in another order), dweight and dbias are its float32 sums."""
    if not registry.get("numba").available:
        pytest.skip("numba is unavailable here")
    x, dy = _x((70, 300), dtype, offset=3.0), _x((70, 300), dtype)
    weight = _param((300,), "float32")
    x32, dy32 = x.astype(np.float32), dy.astype(np.float32)
    if op == "layer_norm_backward":
        _, mean, rstd = normlab.layer_norm(x, 300, weight, return_stats=True, backend="numba")
        half = normlab.layer_norm_backward(dy, x, mean, rstd, weight, backend="numba")
        wide = normlab.layer_norm_backward(dy32, x32, mean, rstd, weight, backend="numba")
    else:
        _, rstd = normlab.rms_norm(x, 300, weight, return_stats=True, backend="numba")
        half = normlab.rms_norm_backward(dy, x, rstd, weight, backend="numba")
        wide = normlab.rms_norm_backward(dy32, x32, rstd, weight, backend="numba")
    assert half[0].dtype == x.dtype
    rounded = wide[0].astype(x.dtype).astype(np.float32)
    unit = np.spacing(np.abs(rounded).astype(x.dtype)).astype(np.float32)
    assert np.all(np.abs(half[0].astype(np.float32) - rounded) <= unit)
    for got, want in zip(half[1:], wide[1:], strict=True):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_numba_backward_without_weight_is_with_ones(dtype: str) -> None:
    """Without weight numba's kernel skips the multiply (no row of ones): the gradients are
    those of a weight of ones, within a rounding or two (dweight and dbias come in x's dtype
    without weight, float32 with it)."""
    if not registry.get("numba").available:
        pytest.skip("numba is unavailable here")
    x, dy = _x((40, 257), dtype, offset=-2.0), _x((40, 257), dtype)
    _, mean, rstd = normlab.layer_norm(x, 257, return_stats=True, backend="numba")
    ones = np.ones(257, np.float32)
    absent = normlab.layer_norm_backward(dy, x, mean, rstd, backend="numba")
    given = normlab.layer_norm_backward(dy, x, mean, rstd, ones, backend="numba")
    tol = {"float32": 1e-5, "float16": 2e-3}[dtype]
    for got, want in zip(absent, given, strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(
            got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol
        )


# --------------------------------------------------------------------------------------------
# Dispatch


def test_dispatch_follows_the_forward_rules(no_preference: None) -> None:
    """NumPy arrays: the highest-priority backend providing the op; a named backend strictly."""
    x = _x((4, 8), "float32")
    _, mean, rstd = normlab.layer_norm(x, return_stats=True, backend="numpy")
    call = spec.validated(
        OPS["layer_norm_backward"],
        spec.arguments("layer_norm_backward", x, x, mean, rstd, needs=("x",)),
    )
    plan = call.plan
    providers = [
        b for b in normlab.list_backends()
        if "layer_norm_backward" in b.ops and "numpy" in b.families and b.available
    ]  # fmt: skip
    assert dispatch.choose(plan).backend is providers[0]
    with pytest.raises(normlab.BackendError, match="torch"):
        normlab.layer_norm_backward(x, x, mean, rstd, backend="torch")


def test_public_signatures() -> None:
    import inspect

    params = inspect.signature(normlab.layer_norm_backward).parameters
    assert list(params) == [
        "dy", "x", "mean", "rstd", "weight", "normalized_shape", "axis", "backend", "needs",
        "weight_offset",
    ]  # fmt: skip
    assert params["needs"].default == ("x", "weight", "bias")
    params = inspect.signature(normlab.rms_norm_backward).parameters
    assert list(params) == [
        "dy", "x", "rstd", "weight", "normalized_shape", "axis", "backend", "needs",
        "weight_offset",
    ]  # fmt: skip
    assert params["needs"].default == ("x", "weight")
    assert {"layer_norm_backward", "rms_norm_backward"} <= set(normlab.__all__)


# --------------------------------------------------------------------------------------------
# Every bad input


X = _x((2, 3, 4), "float32")
DY = _x((2, 3, 4), "float32")
_, MEAN, RSTD = normlab.layer_norm(X, return_stats=True, backend="numpy")
W = _param((4,), "float32")


def _lnb(**changes: Any) -> Callable[[], Any]:
    args: dict[str, Any] = {"dy": DY, "x": X, "mean": MEAN, "rstd": RSTD, "weight": W}
    args.update(changes)
    return lambda: normlab.layer_norm_backward(**args)


BAD_CALLS: dict[str, tuple[Callable[[], Any], type[Exception], str]] = {
    "dy-shape": (_lnb(dy=DY[:, :, :3]), normlab.ShapeError, r"dy has shape \(2, 3, 3\)"),
    "dy-dtype": (_lnb(dy=DY.astype(np.float64)), normlab.DtypeError, "dy has dtype float64"),
    "dy-list": (_lnb(dy=DY.tolist()), normlab.ArgumentError, "dy must be an array"),
    "dy-masked": (_lnb(dy=np.ma.masked_array(DY)), normlab.DtypeError, "masked"),
    "mean-flat": (_lnb(mean=MEAN.reshape(2, 3)), normlab.ShapeError, r"mean has shape \(2, 3\)"),
    "mean-other-axis": (
        _lnb(mean=np.zeros((2, 1, 4), np.float32)),
        normlab.ShapeError,
        r"\(2, 3, 1\)",
    ),
    "mean-missing": (_lnb(mean=None), normlab.ArgumentError, "mean must be an array"),
    "mean-dtype": (_lnb(mean=MEAN.astype(np.float64)), normlab.DtypeError, "mean has dtype"),
    "rstd-dtype": (_lnb(rstd=RSTD.astype(np.float16)), normlab.DtypeError, "rstd has dtype"),
    "rstd-shape": (_lnb(rstd=RSTD[:1]), normlab.ShapeError, "rstd has shape"),
    "weight-shape": (_lnb(weight=W[:3]), normlab.ShapeError, "weight has shape"),
    "weight-int": (_lnb(weight=W.astype(np.int32)), normlab.DtypeError, "weight has dtype int32"),
    "x-int": (_lnb(x=X.astype(np.int32), dy=DY.astype(np.int32)), normlab.DtypeError, "int32"),
    "x-0d": (_lnb(x=np.float32(1.0)), normlab.ShapeError, "0-d"),
    "normalized_shape": (_lnb(normalized_shape=(5,)), normlab.ShapeError, r"\(5,\)"),
    "axis-range": (_lnb(axis=3), normlab.ShapeError, "axis 3 is out of range"),
    "needs-unknown": (_lnb(needs=("x", "gamma")), normlab.ArgumentError, "'gamma'"),
    "needs-str": (_lnb(needs="x"), normlab.ArgumentError, "needs must be a tuple"),
    "needs-none": (_lnb(needs=None), normlab.ArgumentError, "needs must be a tuple"),
    "backend-unknown": (_lnb(backend="nope"), normlab.BackendError, "nope"),
    "backend-cannot-serve": (_lnb(backend="torch"), normlab.BackendError, "torch"),
    "rms-bias": (
        lambda: normlab.rms_norm_backward(DY, X, RSTD, needs=("x", "bias")),
        normlab.ArgumentError,
        "'bias'",
    ),
    "rms-rstd-dtype": (
        lambda: normlab.rms_norm_backward(DY, X, RSTD.astype(np.float64)),
        normlab.DtypeError,
        "rstd has dtype",
    ),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input(name: str) -> None:
    call, error, pattern = BAD_CALLS[name]
    snapshot = [a.copy() for a in (X, DY, MEAN, RSTD, W)]
    with pytest.raises(error, match=pattern):
        call()
    for old, a in zip(snapshot, (X, DY, MEAN, RSTD, W), strict=True):
        np.testing.assert_array_equal(old, a)


def test_bad_input_across_libraries() -> None:
    """dy, mean or rstd from another array library than x: DeviceError (no conversion)."""
    torch = pytest.importorskip("torch")
    for changes in ({"dy": torch.from_numpy(DY)}, {"rstd": torch.from_numpy(RSTD)}):
        with pytest.raises(normlab.DeviceError, match="same array library"):
            _lnb(**changes)()
    with pytest.raises(normlab.DeviceError, match=r"weight is a torch\.Tensor"):
        _lnb(weight=torch.from_numpy(W))()


def test_a_sparse_gradient_is_a_dtype_error() -> None:
    torch = pytest.importorskip("torch")
    dy = torch.randn(3, 4).to_sparse()
    stats = torch.ones(3, 1)
    with pytest.raises(normlab.DtypeError, match="dense"):
        normlab.layer_norm_backward(dy, dy, stats, stats)
