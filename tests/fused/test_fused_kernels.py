"""The fused residual-add backend functions (``add_layer_norm``, ``add_rms_norm``) of the numpy,
numba and torch backends, driven directly with a Plan (as the core calls them).

Each result is checked three ways: ``h`` bitwise against the library's own add in x's dtype;
``y`` and the statistics bitwise against the same backend's ``layer_norm``/``rms_norm`` of that
``h``; and ``y`` within the tolerance table of the float64 reference of ``h``. The aliasing forms
the backends claim (``inplace``) are checked against results computed from copies.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from normlab import reference, spec
from normlab.backends import BUILTIN_RECORDS
from normlab.ops import FUSED_OPS
from normlab.testing.conversions import numpy_dtype
from normlab.testing.tolerances import assert_close, conditioning, y_scale
from tests.support.kernels import kernel_results

OPS = FUSED_OPS
DTYPES = ("float32", "float64", "float16", "bfloat16")
#: (weight, bias, return_stats); bias only for add_layer_norm.
VARIANTS = ((True, True, True), (False, False, False), (True, False, True))
Arrays = tuple[Any, Any, Any, Any]


def _backend(name: str) -> ModuleType:
    if name != "numpy":
        pytest.importorskip(name)
    return importlib.import_module(f"normlab.backends.{name}_backend")


def _np_dtype(name: str) -> np.dtype[Any]:
    if name == "bfloat16":
        pytest.importorskip("ml_dtypes")
    return numpy_dtype(name)


def _data(shape: tuple[int, ...], dtype: str, seed: int, loc: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (loc + rng.standard_normal(shape)).astype(_np_dtype(dtype))


def _family(backend: str, a: np.ndarray | None) -> Any:
    """``a`` as an array of the backend's family (a copy)."""
    if a is None:
        return None
    if backend != "torch":
        return a.copy()
    from normlab.backends import torch_backend

    return torch_backend.from_numpy(a)


def _numpy(a: Any) -> Any:
    if a is None or isinstance(a, np.ndarray):
        return a
    from normlab.backends import torch_backend

    return torch_backend.to_numpy(a)


def _norm_op(op: str) -> str:
    return op.removeprefix("add_")


def _plan(op: str, x: Any, w: Any, b: Any, eps: float, stats: bool, keep_h: bool) -> Any:
    base = spec.plan(_norm_op(op), x, weight=w, bias=b, eps=eps, return_stats=stats)
    return dataclasses.replace(base, op=op, return_residual=keep_h)


def _fused(
    module: ModuleType,
    op: str,
    x: Any,
    r: Any,
    w: Any,
    b: Any,
    *,
    eps: float = 1e-5,
    stats: bool = True,
    keep_h: bool = True,
    out: Any = None,
    residual_out: Any = None,
) -> Arrays:
    plan = _plan(op, x, w, b, eps, stats, keep_h)
    arrays = {"x": x, "residual": r, "weight": w, "bias": b}
    got = kernel_results(module, op, arrays, plan=plan, out=out, residual_out=residual_out)
    return got["y"], got["h"], got["mean"], got["rstd"]


def _unfused(module: ModuleType, op: str, h: Any, w: Any, b: Any, eps: float, stats: bool) -> Any:
    """``(y, mean, rstd)`` of the backend's own layer_norm / rms_norm of ``h``."""
    base = _norm_op(op)
    plan = spec.plan(base, h, weight=w, bias=b, eps=eps, return_stats=stats)
    got = kernel_results(module, base, {"x": h, "weight": w, "bias": b}, plan=plan, out=None)
    return got["y"], got["mean"], got["rstd"]


def _parameters(op: str, dtype: str, cols: int, weight: bool, bias: bool) -> tuple[Any, Any]:
    pdtype = "float32" if dtype in ("float16", "bfloat16") else dtype
    w = _data((cols,), pdtype, seed=5) if weight else None
    b = _data((cols,), pdtype, seed=6) if bias and op == "add_layer_norm" else None
    return w, b


def _assert_bitwise(got: Any, want: Any, what: str) -> None:
    if want is None:
        assert got is None, what
        return
    got, want = np.ascontiguousarray(_numpy(got)), np.ascontiguousarray(_numpy(want))
    assert got.dtype == want.dtype and got.shape == want.shape, what
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=what)


def _check_reference(op: str, h: np.ndarray, w: Any, b: Any, eps: float, y: Any) -> None:
    """y within the tolerance table of the float64 reference normalization of ``h``."""
    dtype, cols = h.dtype.name, h.shape[1]
    if op == "add_layer_norm":
        want, mean, rstd = reference.layer_norm(h, None, w, b, eps)
        z = (reference.to_float64(h) - mean) * rstd
        cond = conditioning(mean, rstd)
    else:
        want, rstd = reference.rms_norm(h, None, w, eps)
        z = reference.to_float64(h) * rstd
        cond = conditioning(None, rstd)
    scale = y_scale(_norm_op(op), z, w, b)
    assert_close(_numpy(y), want, dtype, cond, what="y", cols=cols, scale=scale)


def _run_and_check(
    backend: str, op: str, x: np.ndarray, r: np.ndarray, w: Any, b: Any, stats: bool, keep_h: bool
) -> None:
    module = _backend(backend)
    h_want = x + r  # NumPy's (ml_dtypes') add in x's dtype
    fx, fr, fw, fb = (_family(backend, a) for a in (x, r, w, b))
    y, h, mean, rstd = _fused(module, op, fx, fr, fw, fb, stats=stats, keep_h=keep_h)
    _assert_bitwise(fx, x, "x modified")
    _assert_bitwise(fr, r, "residual modified")
    _assert_bitwise(h, h_want if keep_h else None, "h")
    fh = _family(backend, h_want)
    y_want, mean_want, rstd_want = _unfused(module, op, fh, fw, fb, 1e-5, stats)
    _assert_bitwise(y, y_want, "y")
    _assert_bitwise(mean, mean_want, "mean")
    _assert_bitwise(rstd, rstd_want, "rstd")
    _check_reference(op, h_want, w, b, 1e-5, y)


@pytest.mark.parametrize("keep_h", [True, False], ids=["h", "post_norm"])
@pytest.mark.parametrize("variant", VARIANTS, ids=["affine_stats", "plain", "weight_stats"])
@pytest.mark.parametrize("shape", [(1, 8), (3, 768), (5, 1001)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", ["numpy", "numba", "torch"])
def test_matches_unfused(
    backend: str,
    op: str,
    dtype: str,
    shape: tuple[int, int],
    variant: tuple[bool, bool, bool],
    keep_h: bool,
) -> None:
    weight, bias, stats = variant
    x, r = _data(shape, dtype, seed=1, loc=2.0), _data(shape, dtype, seed=2)
    w, b = _parameters(op, dtype, shape[1], weight, bias)
    _run_and_check(backend, op, x, r, w, b, stats, keep_h)


@pytest.mark.parametrize("keep_h", [True, False], ids=["h", "post_norm"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", ["numpy", "numba", "torch"])
def test_large_batch(backend: str, op: str, keep_h: bool) -> None:
    """1000 x 1024: numba's parallel kernel (equal, bit for bit, to its parallel layer_norm).
    float32 only: each dtype is two more parallel compiles, and the aliasing tests run the
    parallel kernel on float16."""
    x, r = _data((1000, 1024), "float32", seed=3), _data((1000, 1024), "float32", seed=4)
    w, b = _parameters(op, "float32", 1024, True, True)
    _run_and_check(backend, op, x, r, w, b, True, keep_h)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", ["numpy", "numba", "torch"])
def test_wide_rows(backend: str, op: str) -> None:
    """Rows whose float32 squares overflow (values near 1e20) are redone in float64 from h."""
    x = _data((4, 300), "float32", seed=7) * np.float32(1e20)
    r = _data((4, 300), "float32", seed=8)
    _run_and_check(backend, op, x, r, None, None, True, False)


@pytest.mark.parametrize("keep_h", [True, False], ids=["h", "post_norm"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_long_rows(backend: str, op: str, keep_h: bool) -> None:
    """Rows past numba's LONG_ROW_BYTES (and numpy's block): h, then the segmented kernels."""
    cols = (1 << 18) + 5
    x, r = _data((2, cols), "float32", seed=9, loc=1.0), _data((2, cols), "float32", seed=10)
    _run_and_check(backend, op, x, r, None, None, True, keep_h)


# --------------------------------------------------------------------------------------------
# Rounding: y is that of h rounded to x's dtype, not of the exact sum.

#: Per dtype, a magnitude C whose spacing (2 in float16, 8 in float32) exceeds 1.
_BIG = {"float16": 2048.0, "float32": 1e8}


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", ["numpy", "numba", "torch"])
def test_cancellation(backend: str, op: str, dtype: str) -> None:
    """x = C + a, residual = -C + b (|a|, |b| < 1): h is what the dtype's add gives."""
    rng = np.random.default_rng(11)
    a, b = rng.uniform(-1, 1, (6, 64)), rng.uniform(-1, 1, (6, 64))
    x = (_BIG[dtype] + a).astype(dtype)
    r = (-_BIG[dtype] + b).astype(dtype)
    _run_and_check(backend, op, x, r, None, None, True, True)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("backend", ["numpy", "numba", "torch"])
def test_absorbed_residual(backend: str, dtype: str) -> None:
    """x = C + a, residual = b with |b| below the spacing at C: the rounded h has lost most of
    b, and LayerNorm's y (of the rounded h) is far from the normalization of the exact sum.
    (RMSNorm's y of values near C moves by about h's relative rounding: no test for it.)"""
    rng = np.random.default_rng(12)
    spacing = float(np.spacing(np.array(_BIG[dtype], dtype)))
    x = (_BIG[dtype] + spacing * rng.integers(0, 8, (6, 64))).astype(dtype)
    r = (0.45 * spacing * rng.uniform(-1, 1, (6, 64))).astype(dtype)
    exact = x.astype(np.float64) + r.astype(np.float64)
    module = _backend(backend)
    fx, fr = _family(backend, x), _family(backend, r)
    y = _numpy(_fused(module, "add_layer_norm", fx, fr, None, None)[0])
    assert np.max(np.abs(y - reference.layer_norm(exact)[0])) > 0.05  # the case tells them apart
    _run_and_check(backend, "add_layer_norm", x, r, None, None, True, True)


# --------------------------------------------------------------------------------------------
# Aliasing: outputs that are the very memory of inputs (the backends claiming "inplace").

INPLACE = [r.name for r in BUILTIN_RECORDS if "inplace" in r.capabilities and r.name != "cupy"]

#: (out, residual_out, residual is x): "x" / "r" name the input whose memory the output is.
FORMS = {
    "out=x": ("x", None, False),
    "out=r": ("r", None, False),
    "residual_out=r": (None, "r", False),
    "residual_out=x": (None, "x", False),
    "serving": ("x", "r", False),  # out=x, residual_out=residual
    "swapped": ("r", "x", False),  # out=residual, residual_out=x
    "r_is_x": (None, None, True),
    "r_is_x,out=x": ("x", None, True),
    "r_is_x,residual_out=x": (None, "x", True),
}


#: The forms with each value of return_residual (residual_out is given only with it).
KEEP_H_FORMS = [
    pytest.param(keep_h, form, id=f"{form}-{'h' if keep_h else 'post_norm'}")
    for keep_h in (True, False)
    for form, (_, h_of, _) in FORMS.items()
    if keep_h or h_of is None
]


@pytest.mark.parametrize(("keep_h", "form"), KEEP_H_FORMS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", INPLACE)
def test_aliasing(backend: str, op: str, dtype: str, form: str, keep_h: bool) -> None:
    out_of, h_of, same = FORMS[form]
    shape = (40, 1000) if backend == "numba" else (7, 300)  # numba: the parallel kernel
    x, r = _data(shape, dtype, seed=13, loc=1.0), _data(shape, dtype, seed=14)
    if same:
        r = x
    w, b = _parameters(op, dtype, shape[1], True, True)
    module = _backend(backend)
    y_want, h_want, mean_want, rstd_want = _fused(module, op, x.copy(), r.copy(), w, b)
    arrays = {"x": x, "r": x if same else r}
    out = None if out_of is None else arrays[out_of]
    residual_out = None if h_of is None else arrays[h_of]
    y, h, mean, rstd = _fused(
        module, op, x, arrays["r"], w, b, keep_h=keep_h, out=out, residual_out=residual_out
    )
    assert y is out if out is not None else y is not x
    _assert_bitwise(y, y_want, "y")
    _assert_bitwise(h, h_want if keep_h else None, "h")
    if residual_out is not None:
        assert h is residual_out
    _assert_bitwise(mean, mean_want, "mean")
    _assert_bitwise(rstd, rstd_want, "rstd")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", INPLACE)
def test_strided(backend: str, op: str) -> None:
    """Strided x, residual, out and residual_out (the records claim "strided")."""
    x = _data((9, 600), "float32", seed=15)[:, ::2]
    r = _data((600, 9), "float32", seed=16).T[:, ::2]
    out = np.empty((9, 600), np.float32)[:, 1::2]
    residual_out = np.empty((18, 300), np.float32)[::2]
    w, b = _parameters(op, "float32", 300, True, True)
    module = _backend(backend)
    want = _fused(module, op, np.ascontiguousarray(x), np.ascontiguousarray(r), w, b)
    got = _fused(module, op, x, r, w, b, out=out, residual_out=residual_out)
    assert got[0] is out and got[1] is residual_out
    for g, e, what in zip(got, want, ("y", "h", "mean", "rstd"), strict=True):
        _assert_bitwise(g, e, what)


# --------------------------------------------------------------------------------------------
# torch tensors: numba's zero-copy path; the torch backend's autograd.


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", OPS)
def test_numba_serves_tensors(op: str, dtype: str) -> None:
    torch = pytest.importorskip("torch")
    numba_backend = _backend("numba")
    from normlab.backends import torch_backend

    x, r = _data((6, 200), dtype, seed=17), _data((6, 200), dtype, seed=18)
    w, b = _parameters(op, dtype, 200, True, True)
    want = _fused(numba_backend, op, x, r, w, b)
    tx, tr, tw, tb = (None if a is None else torch_backend.from_numpy(a) for a in (x, r, w, b))
    h_out = torch.empty_like(tx)
    got = _fused(numba_backend, op, tx, tr, tw, tb, out=tx, residual_out=h_out)
    assert got[0] is tx and got[1] is h_out
    for g, e, what in zip(got, want, ("y", "h", "mean", "rstd"), strict=True):
        assert e is None or isinstance(g, torch.Tensor), what
        _assert_bitwise(g, e, what)


@pytest.mark.parametrize("op", OPS)
def test_torch_keeps_autograd(op: str) -> None:
    torch = pytest.importorskip("torch")
    module = _backend("torch")
    x, r = torch.randn(5, 32, requires_grad=True), torch.randn(5, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    b = torch.randn(32, requires_grad=True) if op == "add_layer_norm" else None
    y, h, _, _ = _fused(module, op, x, r, w, b, stats=False)
    (y.square().sum() + h.sum()).backward()
    grads = [p.grad.clone() for p in (x, r, w)]
    for p in (x, r, w):
        p.grad = None
    h2 = x + r
    norm = torch.nn.functional.layer_norm if op == "add_layer_norm" else None
    if norm is not None:
        y2 = norm(h2, (32,), w, b, 1e-5)
    else:
        y2 = torch.nn.functional.rms_norm(h2, (32,), w, 1e-5)
    (y2.square().sum() + h2.sum()).backward()
    for got, p in zip(grads, (x, r, w), strict=True):
        torch.testing.assert_close(got, p.grad)
