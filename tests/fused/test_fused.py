"""add_layer_norm / add_rms_norm through the public API: return forms, h rounded as the unfused
add (rows whose mean is not representable included, judged by the fused fuzzer's own check),
in-place forms, aliasing and argument errors, autograd and the composed path."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import normlab
from normlab.errors import ArgumentError, DeviceError, DtypeError, ShapeError
from normlab.ops import FUSED_OPS

torch = pytest.importorskip("torch")
pytest.importorskip("numba")

from tests.support.fuzz_model import VALID_FUSED, Fused, check_fused_result, unfused_add  # noqa: E402

OPS = FUSED_OPS
BASE = {"add_layer_norm": normlab.layer_norm, "add_rms_norm": normlab.rms_norm}
BACKENDS = ("numpy", "numba", "torch")


def _inputs(
    rows: int = 5, cols: int = 24, dtype: Any = np.float32, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(dtype)
    residual = rng.standard_normal((rows, cols)).astype(dtype)
    weight = rng.standard_normal(cols).astype(dtype)
    bias = rng.standard_normal(cols).astype(dtype)
    return x, residual, weight, bias


def _family(a: np.ndarray, backend: str) -> Any:
    return torch.from_numpy(a.copy()) if backend == "torch" else a.copy()


def _numpy(a: Any) -> np.ndarray:
    return a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def _params(op: str, weight: Any, bias: Any) -> dict[str, Any]:
    return {"weight": weight} if op == "add_rms_norm" else {"weight": weight, "bias": bias}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS)
def test_h_is_the_unfused_add_and_y_the_base_op_of_h(op: str, backend: str) -> None:
    arrays = [_family(a, backend) for a in _inputs(dtype=np.float16)]
    x, residual, weight, bias = arrays
    x_before, residual_before = _numpy(x).copy(), _numpy(residual).copy()
    params = _params(op, weight, bias)
    y, h = getattr(normlab, op)(x, residual, backend=backend, **params)
    np.testing.assert_array_equal(_numpy(h), x_before + residual_before)  # float16 add
    expected = BASE[op](x + residual, backend=backend, **params)
    np.testing.assert_array_equal(_numpy(y), _numpy(expected))
    np.testing.assert_array_equal(_numpy(x), x_before)  # inputs untouched
    np.testing.assert_array_equal(_numpy(residual), residual_before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dtype", "big"), [(np.float16, 2048.0), (np.float32, 1e8)])
def test_y_normalizes_the_rounded_h_not_the_exact_sum(backend: str, dtype: Any, big: float) -> None:
    """x near C (a few spacings apart), residual below half the spacing at C: the rounded h is x
    itself, the exact sum is not. (x = C + a, residual = -C + b would not discriminate: the two
    nearly cancel, and such a sum is exact — Sterbenz's lemma.)"""
    rng = np.random.default_rng(1)
    spacing = float(np.spacing(dtype(big)))
    x = (big + spacing * rng.integers(1, 6, (4, 64))).astype(dtype)  # one binade
    residual = (spacing * rng.uniform(-0.45, 0.45, (4, 64))).astype(dtype)
    y, h = normlab.add_layer_norm(_family(x, backend), _family(residual, backend), backend=backend)
    rounded = x + residual
    np.testing.assert_array_equal(rounded, x)
    np.testing.assert_array_equal(_numpy(h), rounded)
    from_rounded = normlab.layer_norm(rounded.astype(np.float64))
    from_exact = normlab.layer_norm(x.astype(np.float64) + residual.astype(np.float64))
    assert np.abs(from_rounded - from_exact).max() > 0.1  # the case discriminates
    want = normlab.layer_norm(_family(rounded, backend), backend=backend)
    np.testing.assert_array_equal(_numpy(y), _numpy(want))


def _spaced_row(dtype: str, backend: str | None) -> Fused:
    """x = [C + 6, C + 4] where the dtype's spacing is 2 (C = 2**24 in float32, 2**53 in float64),
    a residual below half a spacing: h = x, a row whose mean is not representable."""
    call = dataclasses.replace(
        VALID_FUSED.call,
        dtype=dtype,
        shape=(2,),
        values="spaced",
        normalized_shape=(2,),
        backend=backend,
    )
    return dataclasses.replace(VALID_FUSED, call=call, residual_values="below_spacing")


def _run_as_the_fuzzer(fz: Fused) -> None:
    """The call ``fz`` (drawn by tests/core/test_fuzz_api.py::test_fused_calls), judged by the
    fuzzer's own check: ``h`` bitwise the unfused add, ``y`` within the conformance tolerances
    of the float64 reference of that ``h``."""
    kwargs = fz.build()
    assert not fz.problems(kwargs)
    h_want = unfused_add(kwargs["x"], kwargs["residual"])
    check_fused_result(fz, kwargs, normlab.add_layer_norm(**kwargs), h_want)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rows_of_unrepresentable_mean_on_numba(dtype: str) -> None:
    """The same rows on numba: within the tolerances (y = [1.414, 0] against [1, -1], allowed
    16 at conditioning 1.7e7)."""
    _run_as_the_fuzzer(_spaced_row(dtype, "numba"))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rows_of_unrepresentable_mean_on_torch(dtype: str) -> None:
    """torch's CPU layer_norm (torch 2.13) finds variance 0 for these rows (y = [632.46, 0] =
    2 / sqrt(eps)); the torch backend's row check now flags float32/float64 rows whose rstd is
    eps-dominated and recomputes them in float64, shifted (its layer_norm alone:
    tests/core/test_range.py::test_torch_rows_of_unrepresentable_mean_are_recomputed)."""
    _run_as_the_fuzzer(_spaced_row(dtype, "torch"))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("return_residual", [True, False])
@pytest.mark.parametrize("return_stats", [True, False])
def test_return_forms(op: str, return_residual: bool, return_stats: bool) -> None:
    x, residual, _weight, _bias = _inputs()
    result = getattr(normlab, op)(
        x, residual, return_residual=return_residual, return_stats=return_stats
    )
    base = BASE[op](x + residual, return_stats=return_stats)
    stats = len(normlab.ops.OPS[op].stats_outputs)
    if not return_residual:  # exactly the base op's form
        assert type(result) is type(base)
        if return_stats:
            assert len(result) == 1 + stats
        return
    assert isinstance(result, tuple) and len(result) == 2 + (stats if return_stats else 0)
    np.testing.assert_array_equal(result[1], x + residual)
    if return_stats:
        for got, want in zip(result[2:], base[1:], strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("form", ["serving", "swapped", "residual_is_x", "into_x_only"])
def test_in_place_forms(op: str, backend: str, form: str) -> None:
    """out=x with residual_out=residual (the serving form), the swapped form, residual passed
    as x itself, and out=x alone: results as from copies; the outputs are the objects given."""
    x, residual, weight, bias = (_family(a, backend) for a in _inputs(rows=40, cols=96))
    if form == "residual_is_x":
        residual = x
    x0, r0 = _numpy(x).copy(), _numpy(residual).copy()
    want_y, want_h = getattr(normlab, op)(
        _family(x0, backend), _family(r0, backend), backend=backend, **_params(op, weight, bias)
    )
    outs = {
        "serving": (x, residual),
        "swapped": (residual, x),
        "residual_is_x": (x, None),
        "into_x_only": (x, None),
    }[form]
    y, h = getattr(normlab, op)(
        x,
        residual,
        backend=backend,
        out=outs[0],
        residual_out=outs[1],
        **_params(op, weight, bias),
    )
    assert y is outs[0]
    if outs[1] is not None:
        assert h is outs[1]
    np.testing.assert_array_equal(_numpy(y), _numpy(want_y))
    np.testing.assert_array_equal(_numpy(h), _numpy(want_h))


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_and_permuted_inputs_and_outputs(backend: str) -> None:
    base = _inputs(rows=6, cols=40)
    x = _family(base[0], backend)[:, ::2]
    residual = _family(base[1], backend)[:, 1::2]
    out = _family(np.zeros((6, 40), np.float32), backend)[:, ::2]
    h_out = _family(np.zeros((20, 6), np.float32), backend).T
    y, h = normlab.add_layer_norm(x, residual, backend=backend, out=out, residual_out=h_out)
    want_h = _numpy(x) + _numpy(residual)
    np.testing.assert_array_equal(_numpy(h), want_h)
    np.testing.assert_allclose(_numpy(y), normlab.layer_norm(want_h), rtol=1e-5, atol=1e-5)
    _y2, h2, mean, rstd = normlab.add_layer_norm(
        x.T, residual.T, axis=0, backend=backend, return_stats=True
    )
    np.testing.assert_array_equal(_numpy(h2), want_h.T)
    assert tuple(mean.shape) == (1, 6) and tuple(rstd.shape) == (1, 6)


def test_out_tuple_takes_the_statistics_and_never_h() -> None:
    x, residual, weight, bias = _inputs()
    out = (np.empty_like(x), np.empty((5, 1), np.float32), None)
    y, h, mean, rstd = normlab.add_layer_norm(
        x, residual, weight=weight, bias=bias, return_stats=True, out=out
    )
    assert y is out[0] and mean is out[1] and h is not out[0]
    want = normlab.layer_norm(x + residual, weight=weight, bias=bias, return_stats=True)
    for got, expected in zip((y, mean, rstd), want, strict=True):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        ("shape", ShapeError, "residual has shape"),
        ("dtype", DtypeError, "residual has dtype"),
        ("family", DeviceError, "residual is a"),
        ("residual_out_tuple", ArgumentError, "one array"),
        ("residual_out_post_norm", ArgumentError, "return_residual=False"),
        ("return_residual", ArgumentError, "return_residual must be"),
        ("outputs_share", ArgumentError, "share memory"),
        ("out_overlaps_weight", ArgumentError, "shares memory with weight"),
        ("h_partial_overlap", ArgumentError, "residual_out shares memory with x"),
        ("residual_out_read_only", ArgumentError, "residual_out is read-only"),
        ("bias_for_rms", ArgumentError, "takes no bias"),
    ],
)
def test_bad_calls_name_the_problem(change: str, error: type, words: str) -> None:
    x, residual, _weight, bias = _inputs(rows=4, cols=8)
    originals = [(a, a.copy()) for a in (x, residual)]
    kwargs: dict[str, Any] = {}
    op = normlab.add_layer_norm
    if change == "shape":
        residual = residual[:, :4]
    elif change == "dtype":
        residual = residual.astype(np.float64)
    elif change == "family":
        residual = torch.from_numpy(residual)
    elif change == "residual_out_tuple":
        kwargs["residual_out"] = (np.empty_like(x),)
    elif change == "residual_out_post_norm":
        kwargs.update(residual_out=np.empty_like(x), return_residual=False)
    elif change == "return_residual":
        kwargs["return_residual"] = 1
    elif change == "outputs_share":
        shared = np.empty_like(x)
        kwargs.update(out=shared, residual_out=shared)
    elif change == "out_overlaps_weight":
        memory = np.empty(40, np.float32)
        kwargs.update(out=memory[4:36].reshape(4, 8), weight=memory[:8])
    elif change == "h_partial_overlap":
        big = np.concatenate([x, x])
        x = big[:4]
        kwargs["residual_out"] = big[2:6]
    elif change == "residual_out_read_only":
        h_out = np.empty_like(x)
        h_out.flags.writeable = False
        kwargs["residual_out"] = h_out
    elif change == "bias_for_rms":
        op = normlab.api.add_rms_norm
        kwargs = {}
        with pytest.raises(TypeError):
            normlab.add_rms_norm(x, residual, bias=bias)  # no such parameter
        with pytest.raises(error, match=words):
            normlab.spec.plan("add_rms_norm", x, residual, bias=bias)
        return
    with pytest.raises(error, match=words):
        op(x, residual, **kwargs)
    for given, before in originals:  # nothing the caller passed is modified
        np.testing.assert_array_equal(given, before)


def test_out_is_refused_when_an_input_requires_grad() -> None:
    x, residual, weight, _bias = (torch.from_numpy(a) for a in _inputs())
    weight.requires_grad_(True)
    with pytest.raises(ArgumentError, match="requires grad"):
        normlab.add_layer_norm(x, residual, weight=weight, residual_out=torch.empty_like(x))
    with pytest.raises(ArgumentError, match="requires grad"):
        normlab.add_layer_norm(x, residual, weight=weight, out=torch.empty_like(x))


def _unfused(op: str, x: Any, residual: Any, weight: Any, bias: Any) -> tuple[Any, Any]:
    h = x + residual
    if op == "add_rms_norm":
        return torch.nn.functional.rms_norm(h, h.shape[-1:], weight, torch.finfo(h.dtype).eps), h
    return torch.nn.functional.layer_norm(h, h.shape[-1:], weight, bias, 1e-5), h


@pytest.mark.parametrize("backend", BACKENDS[1:])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("return_residual", [True, False])
def test_gradients_match_torch_autograd_of_the_unfused_form(
    op: str, backend: str, return_residual: bool
) -> None:
    leaves = [torch.from_numpy(a).double().requires_grad_(True) for a in _inputs(rows=7)]
    x, residual, weight, bias = leaves
    params = _params(op, weight, bias)
    result = getattr(normlab, op)(
        x, residual, backend=backend, return_residual=return_residual, **params
    )
    y, h = result if return_residual else (result, None)
    want_y, want_h = _unfused(op, x, residual, weight, bias)
    g = torch.randn_like(y)
    loss = (y * g).sum() + (h.square().sum() if h is not None else 0)
    want_loss = (want_y * g).sum() + (want_h.square().sum() if h is not None else 0)
    used = [x, residual, *params.values()]
    got = torch.autograd.grad(loss, used)
    want = torch.autograd.grad(want_loss, used)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_residual_passed_as_x_gets_both_gradients() -> None:
    x = torch.randn(3, 16, dtype=torch.float64, requires_grad=True)
    y, h = normlab.add_layer_norm(x, x, backend="numba")
    (y.sum() + h.sum()).backward()
    want = torch.autograd.grad(_unfused("add_layer_norm", x, x, None, None)[0].sum(), x)[0]
    torch.testing.assert_close(x.grad, want + 2)


@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_compiles_with_torch_compile(backend: str) -> None:
    x, residual, weight, bias = (torch.from_numpy(a) for a in _inputs())

    def block(x: Any, residual: Any) -> Any:
        return normlab.add_layer_norm(x, residual, weight=weight, bias=bias, backend=backend)

    y, h = torch.compile(block, backend="aot_eager")(x, residual)
    want_y, want_h = normlab.add_layer_norm(x, residual, weight=weight, bias=bias, backend=backend)
    torch.testing.assert_close(y, want_y)
    torch.testing.assert_close(h, want_h)


def test_empty_inputs_launch_no_kernel_and_keep_the_forms() -> None:
    x = np.empty((0, 8), np.float32)
    y, h, mean, _rstd = normlab.add_layer_norm(x, x.copy(), return_stats=True)
    assert y.shape == h.shape == (0, 8) and mean.shape == (0, 1)
    y = normlab.add_rms_norm(np.empty((3, 0), np.float32), np.empty((3, 0), np.float32),
                             return_residual=False)  # fmt: skip
    assert y.shape == (3, 0)


def test_a_backend_without_the_fused_op_is_composed_and_explain_says_so() -> None:
    import array_api_strict as xp

    x = xp.asarray(np.ones((2, 8), np.float32))
    residual = xp.asarray(np.arange(16, dtype=np.float32).reshape(2, 8))
    text = normlab.explain(x, residual, op="add_layer_norm")
    assert "composed" in text and "array_api" in text
    y, h = normlab.add_layer_norm(x, residual)
    assert type(y) is type(x)
    np.testing.assert_array_equal(np.asarray(h), np.ones((2, 8)) + np.arange(16).reshape(2, 8))
    np.testing.assert_allclose(
        np.asarray(y), normlab.layer_norm(np.asarray(h)), rtol=1e-6, atol=1e-6
    )


def test_explain_names_the_copies_of_both_inputs() -> None:
    x, residual, _, _ = _inputs(rows=4, cols=8)
    text = normlab.explain(x, residual[:, ::-1].T.T, op="add_layer_norm", backend="numpy")
    assert "x" in text and "residual" in text
