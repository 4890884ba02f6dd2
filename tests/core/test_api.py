"""The public API: names and signatures, axis rules, statistics, ``out=``, parameter dtypes.

Numerics are checked loosely here (against :mod:`normlab.reference`); the conformance suite in
``normlab.testing`` tests them in depth.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

import normlab
from normlab import reference
from normlab.constants import FLOAT_DTYPES
from normlab.registry import Backend
from normlab.testing.conversions import numpy_dtype

torch = pytest.importorskip("torch")

RNG = np.random.default_rng(0)


def _x(*shape: int, dtype: Any = np.float64) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


def _close(actual: Any, expected: np.ndarray, lib: Backend, tol: float = 1e-10) -> None:
    np.testing.assert_allclose(
        lib.to_numpy(actual).astype(np.float64), expected, rtol=tol, atol=tol
    )


# --------------------------------------------------------------------------------------------
# Names and signatures


def test_public_names() -> None:
    names = {
        "layer_norm", "list_backends", "explain", "use_backend", "register_plugin",
        "unregister_plugin", "plugin_failures", "hookimpl", "BackendRecord", "NormlabError",
        "NormlabWarning", "ShapeError", "ArgumentError", "DtypeError", "DeviceError",
        "BackendError",
    }  # fmt: skip
    assert names <= set(normlab.__all__)
    assert all(hasattr(normlab, name) for name in normlab.__all__)


def test_layer_norm_signature() -> None:
    params = inspect.signature(normlab.layer_norm).parameters
    P = inspect.Parameter
    expected = [
        ("x", P.POSITIONAL_OR_KEYWORD, P.empty),
        ("normalized_shape", P.POSITIONAL_OR_KEYWORD, None),
        ("weight", P.POSITIONAL_OR_KEYWORD, None),
        ("bias", P.POSITIONAL_OR_KEYWORD, None),
        ("eps", P.POSITIONAL_OR_KEYWORD, 1e-5),
        ("axis", P.KEYWORD_ONLY, None),
        ("backend", P.KEYWORD_ONLY, None),
        ("return_stats", P.KEYWORD_ONLY, False),
        ("out", P.KEYWORD_ONLY, None),
        ("weight_offset", P.KEYWORD_ONLY, 0.0),
        ("quantize", P.KEYWORD_ONLY, None),
        ("quantize_scale", P.KEYWORD_ONLY, None),
    ]
    assert [(p.name, p.kind, p.default) for p in params.values()] == expected


def test_explain_signature() -> None:
    params = list(inspect.signature(normlab.explain).parameters.values())
    assert [(p.name, p.kind) for p in params] == [
        ("args", inspect.Parameter.VAR_POSITIONAL),
        ("op", inspect.Parameter.KEYWORD_ONLY),
        ("kwargs", inspect.Parameter.VAR_KEYWORD),
    ]
    assert params[1].default == "layer_norm"
    assert "chosen: numpy" in normlab.explain(x=_x(2, 4))  # x by keyword, as the op takes it


def test_list_backends_records() -> None:
    backends = normlab.list_backends()
    by_name = {b.name: b for b in backends}
    assert {"numpy", "numba", "torch", "cupy"} <= set(by_name)
    priorities = [b.priority for b in backends]
    assert priorities == sorted(priorities, reverse=True)
    for b in backends:
        assert isinstance(b.name, str) and isinstance(b.priority, int)
        assert isinstance(b.available, bool)
        assert (b.reason is None) == b.available
        for field in (b.families, b.devices, b.dtypes, b.ops, b.capabilities):
            assert isinstance(field, frozenset)
    assert all("layer_norm" in by_name[name].ops for name in ("numpy", "numba", "torch", "cupy"))
    numpy_backend = by_name["numpy"]
    assert numpy_backend.available and numpy_backend.reason is None
    assert numpy_backend.families == frozenset({"numpy"})
    assert numpy_backend.provided_by == "built-in"
    assert by_name["torch"].capabilities >= {"autograd"}


def test_explain_returns_text_naming_the_choice() -> None:
    text = normlab.explain(_x(3, 4))
    assert isinstance(text, str)
    assert "chosen: numpy" in text
    assert "normalized axes (1,) -> 3 rows x 4 cols" in text


def test_explain_takes_the_ops_arguments() -> None:
    x = _x(2, 3, 4)
    text = normlab.explain(x, (3, 4), np.ones((3, 4)), None, 0.1, backend="numpy")
    assert "normalized axes (1, 2) -> 2 rows x 12 cols" in text
    assert "named backend: numpy" in text
    assert "normalized axes (0, 2) -> 3 rows x 8 cols" in normlab.explain(x, axis=(0, 2))


def test_explain_serves_the_backward_ops() -> None:
    x = _x(3, 8)
    _, mean, rstd = normlab.layer_norm(x, return_stats=True, backend="numpy")
    text = normlab.explain(x, x, mean, rstd, op="layer_norm_backward", backend="numpy")
    assert text.startswith("normlab.layer_norm_backward on numpy.ndarray")
    assert "chosen: numpy (named with backend=)" in text
    assert "layout: no copy of dy" in text and "layout: no copy of x" in text
    x3 = _x(2, 3, 4)
    dy = _x(2, 5, 4)[:, :3]  # its batch axes do not collapse into one row stride
    _, rstd = normlab.rms_norm(x3, return_stats=True, backend="numpy")
    text = normlab.explain(dy, x3, rstd, op="rms_norm_backward", backend="numpy")
    assert "layout: copy of dy — dy's batch or normalized axes cannot be viewed" in text
    assert "layout: no copy of x" in text


def test_explain_binds_arguments_as_the_op_does() -> None:
    x = _x(2, 4)
    assert "named backend: numpy" in normlab.explain(
        x, 4, None, 1e-6, op="rms_norm", backend="numpy"
    )
    with pytest.raises(normlab.ArgumentError, match="unexpected keyword argument 'bias'"):
        normlab.explain(x, bias=np.zeros(4), op="rms_norm")
    with pytest.raises(normlab.ArgumentError, match="too many positional arguments"):
        normlab.explain(x, 4, None, None, 1e-5, 0, op="layer_norm")
    with pytest.raises(normlab.ArgumentError, match="missing a required argument: 'rstd'"):
        normlab.explain(x, x, op="rms_norm_backward")


# --------------------------------------------------------------------------------------------
# Normalized axes


def test_default_is_the_last_axis(lib: Backend) -> None:
    x = _x(2, 3, 4)
    _close(normlab.layer_norm(lib.from_numpy(x)), reference.layer_norm(x, 4)[0], lib)


@pytest.mark.parametrize("normalized_shape", [4, (4,), [4], (3, 4), (2, 3, 4), np.int64(4)])
def test_normalized_shape_names_trailing_dims(lib: Backend, normalized_shape: Any) -> None:
    x = _x(2, 3, 4)
    dims = np.atleast_1d(normalized_shape)
    w, b = _x(*dims), _x(*dims)
    y = normlab.layer_norm(
        lib.from_numpy(x), normalized_shape, lib.from_numpy(w), lib.from_numpy(b)
    )
    k = len(dims)
    _close(y, reference.layer_norm(x, weight=w, bias=b, axis=tuple(range(3 - k, 3)))[0], lib)


def test_normalized_shape_may_be_a_torch_size() -> None:
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    y = normlab.layer_norm(x, x.shape[-2:])
    torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, x.shape[-2:]))


@pytest.mark.parametrize("axis", [0, 1, -1, (0, 2), (2, 0), (-3, -1), (0, 1), (1, 2), (0, 1, 2)])
def test_axis_names_any_axes(lib: Backend, axis: Any) -> None:
    x = _x(2, 3, 4)
    axes = sorted(a % 3 for a in np.atleast_1d(axis))
    w, b = _x(*(x.shape[a] for a in axes)), _x(*(x.shape[a] for a in axes))
    y = normlab.layer_norm(
        lib.from_numpy(x), weight=lib.from_numpy(w), bias=lib.from_numpy(b), axis=axis
    )
    assert tuple(y.shape) == x.shape
    _close(y, reference.layer_norm(x, weight=w, bias=b, axis=axis)[0], lib)


def test_axis_statistics_are_over_exactly_those_axes() -> None:
    x = _x(2, 3, 4)
    y = normlab.layer_norm(x, axis=(0, 2))
    np.testing.assert_allclose(y.mean(axis=(0, 2)), 0, atol=1e-12)
    np.testing.assert_allclose(y.var(axis=(0, 2)), 1, rtol=1e-4)


@pytest.mark.parametrize(
    ("normalized_shape", "axis"), [((3, 4), (1, 2)), ((3, 4), (-1, -2)), (4, -1), ((4,), 2)]
)
def test_axis_and_normalized_shape_that_agree(normalized_shape: Any, axis: Any) -> None:
    x = _x(2, 3, 4)
    np.testing.assert_array_equal(
        normlab.layer_norm(x, normalized_shape, axis=axis),
        normlab.layer_norm(x, normalized_shape),
    )


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_onnx_axis_k_is_the_axes_k_to_end(lib: Backend, k: int) -> None:
    """ONNX ``LayerNormalization(axis=k)`` normalizes dims k…end: in normlab, an axis tuple."""
    x = _x(2, 3, 4, 5)
    onnx_axes = tuple(range(k, x.ndim))
    y_axis = normlab.layer_norm(lib.from_numpy(x), axis=onnx_axes)
    y_shape = normlab.layer_norm(lib.from_numpy(x), x.shape[k:])
    np.testing.assert_array_equal(lib.to_numpy(y_axis), lib.to_numpy(y_shape))
    rows = x.reshape(int(np.prod(x.shape[:k])), -1)
    expected = (rows - rows.mean(1, keepdims=True)) / np.sqrt(rows.var(1, keepdims=True) + 1e-5)
    _close(y_axis, expected.reshape(x.shape), lib)


# --------------------------------------------------------------------------------------------
# Statistics, dtypes, parameters

_TOL = {"float16": 5e-3, "bfloat16": 3e-2, "float32": 1e-5, "float64": 1e-10}


@pytest.mark.parametrize("dtype", list(FLOAT_DTYPES))
@pytest.mark.parametrize("axis", [-1, (0, 2)])
def test_return_stats(lib: Backend, dtype: str, axis: Any) -> None:
    x = _x(2, 3, 8, dtype=numpy_dtype(dtype))
    xl = lib.from_numpy(x)
    y, mean, rstd = normlab.layer_norm(xl, axis=axis, return_stats=True)
    stats_dtype = "float64" if dtype == "float64" else "float32"
    y_ref, mean_ref, rstd_ref = reference.layer_norm(x, axis=axis)
    assert str(y.dtype).removeprefix("torch.") == dtype
    for got, want in ((mean, mean_ref), (rstd, rstd_ref)):
        assert type(got) is type(xl)
        assert str(got.dtype).removeprefix("torch.") == stats_dtype
        assert tuple(got.shape) == want.shape
        _close(got, want, lib, tol=1e-5 if stats_dtype == "float32" else 1e-10)
    _close(y, y_ref, lib, tol=_TOL[dtype])


_PARAM_DTYPES = [
    ("float16", "float16"),
    ("float16", "float32"),
    ("bfloat16", "bfloat16"),
    ("bfloat16", "float32"),
    ("float32", "float32"),
    ("float64", "float64"),
]


@pytest.mark.parametrize(("x_dtype", "param_dtype"), _PARAM_DTYPES)
def test_parameters_in_x_dtype_or_float32_for_half(
    lib: Backend, x_dtype: str, param_dtype: str
) -> None:
    x = _x(3, 8, dtype=numpy_dtype(x_dtype))
    w = _x(8, dtype=numpy_dtype(param_dtype))
    b = _x(8, dtype=numpy_dtype(param_dtype))
    y = normlab.layer_norm(lib.from_numpy(x), weight=lib.from_numpy(w), bias=lib.from_numpy(b))
    assert str(y.dtype).removeprefix("torch.") == x_dtype
    _close(y, reference.layer_norm(x, weight=w, bias=b)[0], lib, tol=_TOL[x_dtype] * 4)


@pytest.mark.parametrize(
    ("w_dtype", "b_dtype"),
    [("float32", None), (None, "float32"), ("float16", "float32"), ("float32", "float16")],
)
def test_half_x_with_mixed_parameters(
    lib: Backend, w_dtype: str | None, b_dtype: str | None
) -> None:
    x = _x(3, 8, dtype=np.float16)
    w = None if w_dtype is None else _x(8, dtype=numpy_dtype(w_dtype))
    b = None if b_dtype is None else _x(8, dtype=numpy_dtype(b_dtype))
    y = normlab.layer_norm(
        lib.from_numpy(x),
        weight=None if w is None else lib.from_numpy(w),
        bias=None if b is None else lib.from_numpy(b),
    )
    assert str(y.dtype).removeprefix("torch.") == "float16"
    _close(y, reference.layer_norm(x, weight=w, bias=b)[0], lib, tol=2e-2)


def test_weight_and_bias_are_independent(lib: Backend) -> None:
    x, w, b = _x(3, 5), _x(5), _x(5)
    for weight, bias in ((w, None), (None, b)):
        y = normlab.layer_norm(
            lib.from_numpy(x),
            weight=None if weight is None else lib.from_numpy(weight),
            bias=None if bias is None else lib.from_numpy(bias),
        )
        _close(y, reference.layer_norm(x, weight=weight, bias=bias)[0], lib)


def test_eps_is_used_and_zero_is_allowed() -> None:
    x = _x(3, 5)
    for eps in (0, 0.0, 0.5, 3):
        np.testing.assert_allclose(
            normlab.layer_norm(x, eps=eps),
            reference.layer_norm(x, eps=eps)[0],
            rtol=1e-10,
            atol=1e-12,
        )


def test_result_has_x_type_shape_and_dtype(lib: Backend) -> None:
    x = lib.from_numpy(_x(2, 3, dtype=np.float32))
    y = normlab.layer_norm(x)
    assert type(y) is type(x)
    assert tuple(y.shape) == (2, 3) and y.dtype == x.dtype


def test_nothing_the_caller_passed_is_modified(lib: Backend) -> None:
    x, w, b = (lib.from_numpy(a) for a in (_x(4, 6), _x(6), _x(6)))
    before = [lib.to_numpy(a).tobytes() for a in (x, w, b)]
    normlab.layer_norm(x, weight=w, bias=b, return_stats=True)
    normlab.layer_norm(x, weight=w, bias=b, out=lib.from_numpy(np.zeros((4, 6))))
    assert [lib.to_numpy(a).tobytes() for a in (x, w, b)] == before


# --------------------------------------------------------------------------------------------
# out=


def test_out_is_written_and_returned(lib: Backend) -> None:
    x, w = _x(3, 4, 5), _x(4, 5)
    out = lib.from_numpy(np.zeros_like(x))
    y = normlab.layer_norm(lib.from_numpy(x), (4, 5), lib.from_numpy(w), out=out)
    assert y is out
    _close(out, reference.layer_norm(x, (4, 5), w)[0], lib)


def test_out_may_have_another_layout(lib: Backend) -> None:
    x = _x(4, 6)
    out = lib.from_numpy(np.zeros((6, 4))).T
    assert normlab.layer_norm(lib.from_numpy(x), out=out) is out
    _close(out, reference.layer_norm(x)[0], lib)


@pytest.mark.parametrize("axis", [-1, 0, (0, 2)])
def test_out_may_be_x_itself(lib: Backend, axis: Any) -> None:
    x = _x(3, 4, 5)
    xl = lib.from_numpy(x)
    assert normlab.layer_norm(xl, axis=axis, out=xl) is xl
    _close(xl, reference.layer_norm(x, axis=axis)[0], lib)


def test_out_may_be_a_transposed_x_itself(lib: Backend) -> None:
    x = _x(5, 4)
    xt = lib.from_numpy(x).T  # (4, 5), normalized over its last axis (stride 4 in memory)
    normlab.layer_norm(xt, out=xt)
    _close(xt, reference.layer_norm(x.T)[0], lib)


@pytest.mark.parametrize(
    "given",
    [
        (True, True, True),
        (True, False, False),
        (False, True, False),
        (False, False, True),
        (False, False, False),
    ],
)
def test_out_tuple_with_return_stats(lib: Backend, given: tuple[bool, bool, bool]) -> None:
    x = _x(2, 3, 4, dtype=np.float32)
    shapes = [(2, 3, 4), (1, 3, 1), (1, 3, 1)]
    dtypes = [np.float32, np.float32, np.float32]
    outs = tuple(
        lib.from_numpy(np.zeros(s, d)) if g else None
        for g, s, d in zip(given, shapes, dtypes, strict=True)
    )
    result = normlab.layer_norm(lib.from_numpy(x), axis=(0, 2), return_stats=True, out=outs)
    expected = reference.layer_norm(x, axis=(0, 2))
    for o, r, e in zip(outs, result, expected, strict=True):
        if o is not None:
            assert r is o
        _close(r, e, lib, tol=1e-5)


def test_out_array_with_return_stats(lib: Backend) -> None:
    x = _x(3, 4)
    out = lib.from_numpy(np.zeros_like(x))
    y, _, rstd = normlab.layer_norm(lib.from_numpy(x), return_stats=True, out=out)
    assert y is out
    _close(rstd, reference.layer_norm(x)[2], lib)
