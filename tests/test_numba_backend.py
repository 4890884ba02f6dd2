"""The Numba backend module, driven directly (a Plan from ``spec.plan``, then its layer_norm or
rms_norm).

Results are compared with the float64 reference within the tolerance table of
:mod:`normlab.testing.tolerances`; the half conversions are checked on every bit pattern.
Arrays stay small: these tests check correctness, never speed.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

numba = pytest.importorskip("numba")

import normlab  # noqa: E402
from normlab import reference, registry, spec  # noqa: E402
from normlab.backends import (  # noqa: E402
    half_bits,
    numba_backend,
    numba_backward,
    numba_forward,
    output_pool,
)
from normlab.errors import BackendError  # noqa: E402
from normlab.testing.conversions import numpy_dtype  # noqa: E402
from normlab.testing.tolerances import assert_close, conditioning, y_scale  # noqa: E402

DTYPES = ("float32", "float64", "float16", "bfloat16")
Result = tuple[Any, Any, Any]


def _dtype(name: str) -> np.dtype[Any]:
    if name == "bfloat16":
        pytest.importorskip("ml_dtypes")
    return numpy_dtype(name)


def _data(shape: tuple[int, ...], dtype: str, seed: int = 0, loc: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (loc + rng.standard_normal(shape)).astype(_dtype(dtype))


def _call(
    x: Any,
    weight: Any = None,
    bias: Any = None,
    *,
    eps: float = 1e-5,
    out: Any = None,
    stats: bool = True,
    op: str = "layer_norm",
) -> Result:
    plan = spec.plan(op, x, None, weight, bias, eps, None, stats, out)
    function = numba_backend.layer_norm if op == "layer_norm" else numba_backend.rms_norm
    result: Result = function(x, weight, bias, plan=plan, out=out)
    return result


def _check_rms(x: Any, weight: Any, eps: float, result: Result) -> None:
    """Assert y and rstd of rms_norm (NumPy) match the reference; mean is None."""
    y, mean, rstd = result
    dtype = x.dtype.name
    want_y, want_rstd = reference.rms_norm(x, None, weight, eps)
    cond = conditioning(None, want_rstd)
    z = reference.to_float64(x) * want_rstd
    scale = y_scale("rms_norm", z, weight)
    assert y.dtype == x.dtype and y.shape == x.shape and mean is None
    assert_close(y, want_y, dtype, cond, what="y", cols=x.shape[1], scale=scale)
    assert rstd.dtype == (np.float64 if dtype == "float64" else np.float32)
    assert_close(
        rstd, want_rstd[:, 0], dtype, cond[:, 0], what="rstd", cols=x.shape[1],
        scale=want_rstd[:, 0],
    )  # fmt: skip


def _check(x: Any, weight: Any, bias: Any, eps: float, result: Result) -> None:
    """Assert y, mean and rstd (NumPy) match the reference within the dtype's tolerance."""
    y, mean, rstd = result
    dtype = x.dtype.name
    want_y, want_mean, want_rstd = reference.layer_norm(x, None, weight, bias, eps)
    cond = conditioning(want_mean, want_rstd)
    z = (reference.to_float64(x) - want_mean) * want_rstd
    w = 1.0 if weight is None else np.abs(reference.to_float64(weight))
    b = 0.0 if bias is None else np.abs(reference.to_float64(bias))
    cols = x.shape[1]
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, want_y, dtype, cond, what="y", cols=cols, scale=w * (1 + np.abs(z)) + b)
    stats = np.float64 if dtype == "float64" else np.float32
    assert mean.dtype == stats and rstd.dtype == stats and mean.shape == (x.shape[0],)
    cond1 = cond[:, 0]
    assert_close(
        mean, want_mean[:, 0], dtype, cond1, what="mean", cols=cols, scale=1 / want_rstd[:, 0]
    )
    assert_close(rstd, want_rstd[:, 0], dtype, cond1, what="rstd", cols=cols, scale=want_rstd[:, 0])


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    """``threads(n)`` sets numba's thread count for this test only."""
    before = numba.get_num_threads()
    yield numba.set_num_threads
    numba.set_num_threads(before)


# --------------------------------------------------------------------------------------------
# Values


@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference(dtype: str, affine: str) -> None:
    x = _data((37, 300), dtype, loc=3.0)
    weight = _data((300,), dtype, seed=1) if affine in ("both", "weight") else None
    bias = _data((300,), dtype, seed=2) if affine in ("both", "bias") else None
    _check(x, weight, bias, 1e-5, _call(x, weight, bias))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_x_with_float32_parameters(dtype: str) -> None:
    x = _data((9, 64), dtype)
    weight, bias = _data((64,), "float32", seed=1), _data((64,), "float32", seed=2)
    _check(x, weight, bias, 1e-5, _call(x, weight, bias))


@pytest.mark.parametrize("cols", [1, 3, 17, 127, 1000, 4097])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_awkward_row_lengths(dtype: str, cols: int) -> None:
    x = _data((5, cols), dtype, loc=-2.0)
    weight, bias = _data((cols,), dtype, seed=1), _data((cols,), dtype, seed=2)
    _check(x, weight, bias, 1e-5, _call(x, weight, bias))


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_rows_give_bias_exactly(dtype: str) -> None:
    x = np.repeat(np.array([[0.0], [1.5], [-3.25], [1000.0]]), 513, axis=1).astype(_dtype(dtype))
    weight, bias = _data((513,), dtype, seed=1), _data((513,), dtype, seed=2)
    y, mean, _ = _call(x, weight, bias)
    assert np.array_equal(y, np.broadcast_to(bias, y.shape))
    assert np.array_equal(mean, x[:, 0].astype(mean.dtype))
    y, _, _ = _call(x, weight)
    assert not y.astype(np.float64).any()


@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm"])
def test_float64_tensor_parameters_stay_float64(op: str) -> None:
    """A float64 tensor's weight and bias reach the kernel unrounded: bitwise the NumPy call
    (a float32 weight would move y by about 1e-8)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    x, r = rng.standard_normal((3, 16)), rng.standard_normal((3, 16))
    w, b = 1 + np.arange(16) * 1e-9, np.arange(16) * 1e-10
    function = getattr(normlab, op)
    lead_np = (x, r) if op == "add_layer_norm" else (x,)
    lead_t = tuple(torch.from_numpy(a) for a in lead_np)
    y_np = function(*lead_np, weight=w, bias=b, backend="numba")
    y_t = function(*lead_t, weight=torch.from_numpy(w), bias=torch.from_numpy(b), backend="numba")
    for got, want in zip(
        y_t if isinstance(y_t, tuple) else (y_t,),
        y_np if isinstance(y_np, tuple) else (y_np,),
        strict=True,
    ):
        assert np.array_equal(got.numpy(), want)


def test_large_offset_float32() -> None:
    x = _data((16, 1024), "float64", seed=3)
    x = (100 + 0.01 * x).astype(np.float32)
    _check(x, None, None, 1e-5, _call(x))


def test_float16_zeros_with_tiny_eps() -> None:
    x = np.zeros((4, 100), np.float16)
    y, _, rstd = _call(x, eps=1e-12)
    assert not np.isnan(y).any() and not y.astype(np.float64).any()
    assert np.all(rstd == np.float32(1e6))


def test_float16_near_max_does_not_overflow() -> None:
    rng = np.random.default_rng(4)
    magnitudes = rng.uniform(55000, 65000, (6, 777))
    x = (magnitudes * rng.choice([-1.0, 1.0], magnitudes.shape)).astype(np.float16)
    x[0] = np.float16(60000) + rng.integers(0, 3, 777).astype(np.float16) * 32
    result = _call(x)
    assert np.isfinite(result[0].astype(np.float64)).all()
    _check(x, None, None, 1e-5, result)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nan_and_inf_stay_in_their_rows(dtype: str) -> None:
    x = _data((8, 50), dtype)
    clean, _, _ = _call(x)
    poisoned = x.copy()
    poisoned[1, 7], poisoned[2, 0], poisoned[5, 49] = np.nan, np.inf, -np.inf
    y, mean, _ = _call(poisoned)
    bad = [1, 2, 5]
    assert np.isnan(y[bad].astype(np.float64)).all() and not np.isfinite(mean[bad]).any()
    good = [0, 3, 4, 6, 7]
    assert y[good].tobytes() == clean[good].tobytes()


# --------------------------------------------------------------------------------------------
# Rows are independent: of each other, of the thread count, of the serial/parallel split


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_row_alone_equals_row_in_batch(dtype: str) -> None:
    rows, cols = 200, 700  # above the serial limit: the batch runs in parallel
    assert rows * cols >= numba_backend.SERIAL_ELEMENTS
    x = _data((rows, cols), dtype, loc=1.0)
    weight, bias = _data((cols,), dtype, seed=1), _data((cols,), dtype, seed=2)
    y, mean, rstd = _call(x, weight, bias)
    for i in (0, 1, 99, 137, 199):
        y1, mean1, rstd1 = _call(x[i : i + 1], weight, bias)
        assert y1.tobytes() == y[i : i + 1].tobytes()
        assert mean1[0] == mean[i] and rstd1[0] == rstd[i]


def test_thread_count_does_not_change_results(threads: Callable[[int], None]) -> None:
    x = _data((300, 513), "float32", loc=-5.0)
    results = []
    for n in range(1, numba.config.NUMBA_NUM_THREADS + 1):
        threads(n)
        results.append(_call(x))
    for y, mean, rstd in results[1:]:
        assert y.tobytes() == results[0][0].tobytes()
        assert mean.tobytes() == results[0][1].tobytes()
        assert rstd.tobytes() == results[0][2].tobytes()


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("rows", [1, 31, 32, 33, 42, 43, 64, 65, 97])
def test_results_around_the_parallel_threshold_do_not_depend_on_threads(
    threads: Callable[[int], None], op: str, rows: int
) -> None:
    """Forward and backward give the same bits on one thread and on two, for the sizes around
    SERIAL_ELEMENTS (42 x 768 is below it, 43 x 768 above) and around the backward's row
    chunks (32 rows each)."""
    assert 42 * 768 < numba_backend.SERIAL_ELEMENTS <= 43 * 768
    x = _data((rows, 768), "float32", loc=0.5)
    w = _data((768,), "float32", seed=1)
    dy = _data((rows, 768), "float32", seed=2)
    backward = getattr(normlab, f"{op}_backward")
    runs = []
    for n in (1, 2, 1, 2):
        threads(min(n, numba.config.NUMBA_NUM_THREADS))
        y, *stats = getattr(normlab, op)(x, weight=w, backend="numba", return_stats=True)
        grads = backward(dy, x, *stats, w, backend="numba")
        runs.append([a.tobytes() for a in (y, *stats, *grads) if a is not None])
    assert all(run == runs[0] for run in runs[1:])


# --------------------------------------------------------------------------------------------
# Layouts, out= and in place


def _layouts(x: np.ndarray) -> dict[str, np.ndarray]:
    """Views of (copies of) x's values with the same shape and other strides."""
    rows, cols = x.shape
    wide = np.full((2 * rows, 2 * cols), np.nan, x.dtype)
    wide[::2, ::2] = x
    padded = np.full((rows, cols + 5), np.nan, x.dtype)
    padded[:, :cols] = x
    return {
        "transposed": np.ascontiguousarray(x.T).T,
        "fortran": np.asfortranarray(x),
        "sliced": wide[::2, ::2],
        "padded": padded[:, :cols],
        "reversed": np.ascontiguousarray(x[::-1, ::-1])[::-1, ::-1],
        "rows_broadcast": np.broadcast_to(x[:1], x.shape),
        "cols_broadcast": np.broadcast_to(x[:, :1], x.shape),
    }


@pytest.mark.parametrize(
    "layout",
    ["transposed", "fortran", "sliced", "padded", "reversed", "rows_broadcast", "cols_broadcast"],
)
def test_float32_layouts_without_copy(layout: str) -> None:
    x = _layouts(_data((23, 130), "float32", loc=2.0))[layout]
    weight, bias = _data((130,), "float32", seed=1), _data((130,), "float32", seed=2)
    _check(x, weight, bias, 1e-5, _call(x, weight, bias))


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
def test_other_dtypes_strided(dtype: str) -> None:
    x = _layouts(_data((11, 70), dtype, loc=2.0))["reversed"][:, ::3]
    weight, bias = _data((x.shape[1],), dtype, seed=1), _data((x.shape[1],), dtype, seed=2)
    _check(x, weight, bias, 1e-5, _call(x, weight, bias))


@pytest.mark.parametrize("layout", ["c", "fortran", "reversed"])
def test_out(layout: str) -> None:
    x = _data((19, 96), "float32")
    out = {
        "c": np.empty_like(x),
        "fortran": np.empty_like(x, order="F"),
        "reversed": np.empty_like(x)[::-1, ::-1],
    }[layout]
    result = _call(x, out=out)
    assert result[0] is out
    _check(x, None, None, 1e-5, result)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_in_place(dtype: str) -> None:
    x = _data((21, 333), dtype, loc=4.0)
    weight = _data((333,), dtype, seed=1)
    expected, _, _ = _call(x, weight)
    original = x.copy()
    y, mean, rstd = _call(x, weight, out=x)
    assert y is x
    assert x.tobytes() == expected.tobytes()
    _check(original, weight, None, 1e-5, (x, mean, rstd))


def test_in_place_through_another_view() -> None:
    x = _data((64, 48), "float32")
    original, view = x.copy(), x.T.T
    y, _, _ = _call(x, out=view)
    assert y is view
    assert x.tobytes() == _call(original)[0].tobytes()


def test_without_stats_and_input_untouched() -> None:
    x = _data((7, 40), "bfloat16")
    before = x.tobytes()
    y, mean, rstd = _call(x, stats=False)
    assert mean is None and rstd is None
    assert x.tobytes() == before and y.tobytes() == _call(x)[0].tobytes()


# --------------------------------------------------------------------------------------------
# The half conversions, on every bit pattern


@numba.njit
def _decode(bits: np.ndarray, floats: np.ndarray) -> None:
    for i in range(bits.shape[0]):
        floats[i] = half_bits.float16_to_float32(bits[i])


@numba.njit
def _decode_bfloat16(bits: np.ndarray, floats: np.ndarray) -> None:
    for i in range(bits.shape[0]):
        floats[i] = half_bits.bfloat16_to_float32(bits[i])


@numba.njit
def _encode(floats: np.ndarray, bits: np.ndarray) -> None:
    for i in range(floats.shape[0]):
        bits[i] = half_bits.float32_to_float16(floats[i])


@numba.njit
def _encode_bfloat16(floats: np.ndarray, bits: np.ndarray) -> None:
    for i in range(floats.shape[0]):
        bits[i] = half_bits.float32_to_bfloat16(floats[i])


ALL_BITS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_to_float32_every_pattern(dtype: str) -> None:
    decode = _decode if dtype == "float16" else _decode_bfloat16
    got = np.empty(ALL_BITS.size, np.float32)
    decode(ALL_BITS, got)
    want = ALL_BITS.view(_dtype(dtype)).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # NaN payloads included


def _float32_probes() -> np.ndarray:
    """float32 values around every half value: each 16-bit high half with low halves that
    make exact ties, one unit either side of a tie, and others; plus the float16 midpoints."""
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = [0, 1, 0x0FFF, 0x1000, 0x1001, 0x2000, 0x7FFF, 0x8000, 0x8001, 0xC000, 0xFFFF]
    probes = [(high | low).view(np.float32) for low in lows]
    halves = ALL_BITS[ALL_BITS < 0x7C00].view(np.float16).astype(np.float32)
    mid = (halves[:-1].astype(np.float64) + halves[1:]) / 2  # exact in float32
    for m in (mid, -mid):
        m32 = m.astype(np.float32)
        probes += [m32, np.nextafter(m32, np.float32(np.inf)), np.nextafter(m32, np.float32(0))]
    return np.concatenate(probes)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_float32_to_half_every_pattern(dtype: str) -> None:
    encode = _encode if dtype == "float16" else _encode_bfloat16
    probes = _float32_probes()
    got = np.empty(probes.size, np.uint16)
    encode(probes, got)
    with np.errstate(over="ignore", invalid="ignore"):
        want = probes.astype(_dtype(dtype)).view(np.uint16)
    assert np.array_equal(got, want)


# --------------------------------------------------------------------------------------------
# Torch CPU tensors, served zero-copy when named


@pytest.fixture
def torch() -> Any:
    return pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_tensors(torch: Any, dtype: str) -> None:
    t = torch.randn(12, 40, dtype=getattr(torch, dtype)).t()  # strided: served without a copy
    w = torch.randn(12, dtype=torch.float32)
    y, mean, rstd = _call(t, w, None)
    assert isinstance(y, torch.Tensor) and y.dtype == t.dtype and y.shape == t.shape
    x_np = t.float().numpy().astype(_dtype(dtype))
    _check(x_np, w.numpy(), None, 1e-5, (_numpy(y), mean.numpy(), rstd.numpy()))


def _numpy(t: Any) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        return t.float().numpy().astype(numpy_dtype("bfloat16"))
    return t.numpy()  # type: ignore[no-any-return]


def test_torch_out_and_in_place(torch: Any) -> None:
    t = torch.randn(8, 30, dtype=torch.float16)
    expected = _call(t)[0]
    out = torch.empty_like(t)
    assert _call(t, out=out)[0] is out and torch.equal(out, expected)
    assert _call(t, out=t)[0] is t and torch.equal(t, expected)


def test_torch_requires_grad_keeps_the_graph(torch: Any) -> None:
    x = torch.randn(4, 6)
    w = torch.ones(6, requires_grad=True)
    y = normlab.layer_norm(x, weight=w, backend="numba")
    assert y.grad_fn is not None  # through normlab's custom ops, never detached
    with pytest.raises(BackendError, match="autograd"):  # out= cannot keep a graph
        numba_backend.layer_norm(
            x,
            w,
            None,
            plan=spec.plan("layer_norm", x, None, w, None, 1e-5, None, False, None),
            out=torch.empty(4, 6),
        )
    with torch.no_grad():
        y, _, _ = _call(x, w)
    assert torch.allclose(y, torch.nn.functional.layer_norm(x, (6,)), atol=1e-6)


def test_torch_through_the_api(torch: Any) -> None:
    t = torch.randn(3, 5, 7)
    y = normlab.layer_norm(t, backend="numba")
    assert isinstance(y, torch.Tensor)
    assert torch.allclose(y, torch.nn.functional.layer_norm(t, (7,)), atol=1e-6)


# --------------------------------------------------------------------------------------------
# How the kernels are built


def test_kernels_keep_nan_semantics_and_cache() -> None:
    assert not numba_forward.FASTMATH & {"nnan", "ninf", "fast"}
    for kernel in (numba_forward.layer_norm_rows, numba_forward.layer_norm_rows_parallel):
        assert isinstance(kernel._cache, numba.core.caching.FunctionCache)  # cache=True
        assert kernel.targetoptions["error_model"] == "numpy"


def test_kernels_read_no_number_of_another_module_as_a_global() -> None:
    """Numba freezes a global's value into the kernel it caches, and keys the cache on the
    kernel's own source file: a number defined in another file (normlab.constants, or the
    forward module for the backward kernels) must reach a kernel as an argument, else changing
    it would leave stale cached kernels."""
    modules = (half_bits, numba_forward, numba_backward)
    frozen = []
    for module in modules:
        source = inspect.getsource(module)
        for function in vars(module).values():
            function = getattr(function, "py_func", function)  # a numba dispatcher's function
            if not inspect.isfunction(function) or function.__module__ != module.__name__:
                continue
            for name in function.__code__.co_names:
                value = vars(module).get(name)
                if not isinstance(value, int | float | str | tuple | frozenset | set):
                    continue
                if not re.search(rf"^{name}\b[^=\n]*=", source, re.M):  # not defined here
                    frozen.append(f"{module.__name__}.{function.__name__} reads {name}")
    assert not frozen
    assert "chunk" in inspect.signature(numba_backward.backward_chunks.py_func).parameters


# --------------------------------------------------------------------------------------------
# RMSNorm: the same kernels without the centring


@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "no-weight"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype: str, weighted: bool) -> None:
    x = _data((37, 300), dtype, loc=0.5)
    weight = _data((300,), dtype, seed=1) if weighted else None
    _check_rms(x, weight, 1e-5, _call(x, weight, op="rms_norm"))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_rms_norm_layouts_out_and_in_place_give_the_same_bits(dtype: str) -> None:
    x = _data((23, 130), dtype)
    weight = _data((130,), dtype, seed=1)
    y, _, rstd = _call(x, weight, op="rms_norm")
    for layout, view in _layouts(x).items():
        if layout.endswith("broadcast"):
            continue  # other values
        y2, _, rstd2 = _call(view, weight, op="rms_norm")
        assert y2.tobytes() == y.tobytes() and rstd2.tobytes() == rstd.tobytes(), layout
    out = np.empty_like(x)[::-1, ::-1]
    assert _call(x, weight, out=out, op="rms_norm")[0] is out
    assert np.ascontiguousarray(out).tobytes() == y.tobytes()
    inplace = x.copy()
    assert _call(inplace, weight, out=inplace, op="rms_norm")[0] is inplace
    assert inplace.tobytes() == y.tobytes()
    y3, mean3, rstd3 = _call(x, weight, op="rms_norm", stats=False)
    assert mean3 is None and rstd3 is None and y3.tobytes() == y.tobytes()


def test_rms_norm_of_zero_rows_is_zero() -> None:
    x = np.zeros((3, 40), np.float16)
    y, _, rstd = _call(x, eps=1e-12, op="rms_norm")
    assert not y.astype(np.float64).any() and np.all(rstd == np.float32(1e6))


def test_rms_norm_torch_tensors_keep_the_graph(torch: Any) -> None:
    x = torch.randn(5, 24, dtype=torch.float64, requires_grad=True)
    w = torch.randn(24, dtype=torch.float64, requires_grad=True)
    y = normlab.rms_norm(x, weight=w, eps=1e-6, backend="numba")
    assert y.grad_fn is not None
    want = torch.nn.functional.rms_norm(x, (24,), w, 1e-6)
    assert torch.allclose(y, want, atol=1e-12)
    dy = torch.randn(5, 24, dtype=torch.float64)
    got = torch.autograd.grad(y, (x, w), dy)
    expected = torch.autograd.grad(want, (x, w), dy)
    for g, e in zip(got, expected, strict=True):
        assert torch.allclose(g, e, atol=1e-10)
    with torch.no_grad():
        t = torch.randn(6, 10, dtype=torch.bfloat16)
        y, _, rstd = _call(t, op="rms_norm")
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and rstd.shape == (6,)
    _check_rms(_numpy(t), None, 1e-5, (_numpy(y), None, rstd.numpy()))


# --------------------------------------------------------------------------------------------
# The float32 range: sums that overflow, rstd beyond float32


def _long_cols() -> int:
    """A row length that takes the segmented long-row form in float32, with a partial segment."""
    return numba_forward.LONG_ROW_BYTES // 4 + numba_forward.SEGMENT // 2 + 3


@pytest.mark.parametrize("cols", [4, 1001, "long"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("spread", [1e20, 1e38, 3.4e38])
def test_float32_rows_of_huge_spread(spread: float, op: str, cols: Any) -> None:
    """The squares (and, at 3.4e38, the differences) overflow float32: such a row is redone in
    float64, and normalizes to +-1 as the float64 reference does."""
    n = _long_cols() if cols == "long" else cols
    x = np.tile(np.array([spread, -spread], np.float32), (2, n // 2))
    normal = _data((1, x.shape[1]), "float32")
    batch = np.concatenate([x, normal])
    y, _, rstd = _call(batch, op=op)
    np.testing.assert_allclose(y[:2], np.tile([1.0, -1.0], (2, n // 2)), rtol=1e-6)
    np.testing.assert_allclose(rstd[:2], np.float32(1 / spread), rtol=1e-6)
    assert y[2:].tobytes() == _call(normal, op=op)[0].tobytes()  # the other rows: unchanged


@pytest.mark.parametrize("cols", [4, "long"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_constant_rows_with_a_tiny_positive_eps_give_bias(dtype: str, cols: Any) -> None:
    """eps = 1e-80 > 0: rstd = 1e40 exceeds float32, and (x - mean) * rstd must be 0, not
    0 * inf = NaN. rstd itself is reported as float32's rounding of 1e40: inf."""
    n = _long_cols() if cols == "long" else cols
    x = np.full((2, n), 3.0).astype(_dtype(dtype))
    bias = _data((n,), dtype, seed=2)
    y, mean, rstd = _call(x, None, bias, eps=1e-80)
    assert y.tobytes() == np.broadcast_to(bias, y.shape).tobytes()
    assert np.all(mean == 3.0) and np.all(rstd == np.inf)
    y, _, _ = _call(np.zeros_like(x), eps=1e-80, op="rms_norm")
    assert not np.isnan(y.astype(np.float64)).any() and not y.astype(np.float64).any()


@pytest.mark.parametrize("cols", [6, "long"])
def test_in_place_with_wide_rows_equals_out_of_place(cols: Any) -> None:
    """Wide rows are redone after the others: in place, only they, from x as it was."""
    n = _long_cols() if cols == "long" else cols
    x = _data((4, n), "float32", seed=9)
    x[1] = np.resize(np.array([3e38, -3e38], np.float32), n)
    x[3, 0] = np.nan
    weight = _data((n,), "float32", seed=1)
    weight[2] = np.nan  # one NaN column in every row, and no more
    expected = _call(x, weight)
    y = x.copy()
    result = _call(y, weight, out=y)
    assert result[0] is y and y.tobytes() == expected[0].tobytes()
    assert np.isnan(y[[0, 2]]).sum() == 2 and np.isnan(y[3]).all()
    assert result[1].tobytes() == expected[1].tobytes()


def test_a_tiny_eps_on_a_varying_row_is_unaffected() -> None:
    x = _data((4, 64), "float32", loc=2.0)
    _check(x, None, None, 1e-80, _call(x, eps=1e-80))


# --------------------------------------------------------------------------------------------
# Long rows: segment moments merged (Chan), x read twice from memory, threads share a row


def test_long_row_threshold() -> None:
    """Long means more compute-dtype bytes than LONG_ROW_BYTES, whole segments of blocks."""
    assert numba_forward.SEGMENT % numba_forward.BLOCK == 0
    assert numba_forward.LONG_ROW_BYTES // 4 > numba_forward.SEGMENT


def test_long_row_with_a_large_offset_is_exact() -> None:
    """1e4 + N(0, 1) over 2^22 float32 columns: a one-pass E[x²]-E[x]² would lose every digit."""
    x = _data((1, 1 << 22), "float64", seed=5, loc=1e4).astype(np.float32)
    weight, bias = _data((1 << 22,), "float32", seed=1), _data((1 << 22,), "float32", seed=2)
    _check(x, weight, bias, 1e-5, _call(x, weight, bias))


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_rows_match_reference(dtype: str) -> None:
    cols = _long_cols() if dtype != "float64" else numba_forward.LONG_ROW_BYTES // 8 + 1000
    x = _data((3, cols), dtype, seed=6, loc=100.0)
    x[1] = x[1, 0]  # a constant row: exactly bias
    weight, bias = _data((cols,), dtype, seed=1), _data((cols,), dtype, seed=2)
    result = _call(x, weight, bias)
    _check(x, weight, bias, 1e-5, result)
    assert result[0][1].tobytes() == bias.tobytes()
    _check_rms(x, weight, 1e-5, _call(x, weight, op="rms_norm"))


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape", [(1, 1 << 20), (3, 3 << 16)], ids=["1-row", "3-rows"])
def test_long_rows_do_not_depend_on_the_thread_count(
    threads: Callable[[int], None], shape: tuple[int, int], op: str
) -> None:
    """One thread (the serial driver) and two (segments shared out) give the same bits; and a
    row alone gives the bits it gets in the batch."""
    x = _data(shape, "float32", seed=7, loc=-30.0)
    results = []
    for n in (1, 2):
        threads(n)
        results.append(_call(x, op=op))
    (y1, _, r1), (y2, _, r2) = results
    assert y1.tobytes() == y2.tobytes() and r1.tobytes() == r2.tobytes()
    alone = _call(x[-1:], op=op)
    assert alone[0].tobytes() == y2[-1:].tobytes() and alone[2][0] == r2[-1]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_long_rows_strided_out_and_in_place(dtype: str) -> None:
    cols = _long_cols()
    x = _data((2, cols), dtype, seed=8, loc=3.0)
    weight = _data((cols,), dtype, seed=1)
    """Every layout reads the same values; y is written by code specialised per layout (so the
    bits may differ where the compiler vectorises one and not another, as with bounds checks)."""
    before = x.tobytes()
    y, mean, rstd = _call(x, weight)
    _check(x, weight, None, 1e-5, (y, mean, rstd))
    out = np.empty_like(x)[:, ::-1]
    inplace = x.copy()
    results = {layout: _call(_layouts(x)[layout], weight) for layout in ("reversed", "fortran")}
    results["out"] = _call(x, weight, out=out)
    results["in place"] = _call(inplace, weight, out=inplace)
    assert results["out"][0] is out and results["in place"][0] is inplace
    for layout, result in results.items():
        _check(x, weight, None, 1e-5, result)
        same_stats = result[1].tobytes() == mean.tobytes() and result[2].tobytes() == rstd.tobytes()
        assert same_stats, layout
    assert x.tobytes() == before  # only the copy was normalized in place


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_long_rows_without_weight_or_bias_equal_ones_and_zeros(
    threads: Callable[[int], None], op: str
) -> None:
    """Without weight and bias, long rows reuse one segment of ones and zeros for every segment:
    the same bits as row-long ones and zeros, on one thread or two."""
    cols = _long_cols()
    x = _data((2, cols), "float32", seed=9, loc=2.0)
    ones, zeros = np.ones(cols, np.float32), np.zeros(cols, np.float32)
    for n in (1, 2):
        threads(n)
        given = _call(x, ones, zeros if op == "layer_norm" else None, op=op)
        absent = _call(x, op=op)
        assert (
            absent[0].tobytes() == given[0].tobytes() and absent[2].tobytes() == given[2].tobytes()
        )


def test_long_rows_without_weight_or_bias_allocate_no_row_sized_stand_in() -> None:
    """A 1 x 2^22 float32 call without weight or bias allocates y, and nothing else row-sized
    (traced NumPy allocations; a stand-in of ones and zeros would add two rows)."""
    cols = 1 << 22
    x = _data((1, cols), "float32", seed=10)
    _call(x, stats=False)  # compiled (or loaded) and the segment stand-ins cached
    capacity, output_pool.POOL.capacity = output_pool.POOL.capacity, 0  # y: a fresh array
    tracemalloc.start()
    try:
        y, _, _ = _call(x, stats=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        output_pool.POOL.capacity = capacity
    assert y.nbytes <= peak < y.nbytes + (1 << 20)


# --------------------------------------------------------------------------------------------
# The pool: one parallel call at a time, none in a forked child


def test_a_second_caller_runs_serially_while_the_pool_is_held() -> None:
    pool = numba_backend.Pool()
    if numba.get_num_threads() < 2:
        pytest.skip("one numba thread: every call is serial")
    assert pool.acquire(numba_backend.SERIAL_ELEMENTS - 1) == 1
    held = pool.acquire(numba_backend.SERIAL_ELEMENTS)
    assert held == numba.get_num_threads()
    assert pool.acquire(1 << 30) == 1  # taken: serial kernels
    pool.release(held)
    again = pool.acquire(1 << 30)
    assert again > 1
    pool.release(again)


def test_a_forked_child_of_a_parallel_parent_stays_serial() -> None:
    pool = numba_backend.Pool()
    pool.after_fork_in_child()  # the parent never went parallel: the child may
    held = pool.acquire(1 << 30)
    assert held == numba.get_num_threads()
    pool.release(held)
    pool.after_fork_in_child()  # now it had
    assert pool.acquire(1 << 30) == 1


def test_threading_layer_after_a_parallel_call() -> None:
    layer = numba_backend.threading_layer(start=True)
    assert layer in ("omp", "tbb", "workqueue") or numba.get_num_threads() == 1


# --------------------------------------------------------------------------------------------
# Small C-contiguous tensors: the address entries (numba_addressed), bitwise the NumPy call


def _as_numpy_array(t: Any) -> np.ndarray:
    """The tensor ``t``'s memory as a NumPy array of its dtype (bfloat16: ml_dtypes')."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return t.numpy()  # type: ignore[no-any-return]


@pytest.fixture
def address_entries(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The names of the address entries called (each call appends its name): the first call
    of a signature runs through numba's dispatcher, later ones through its entry point."""
    called: list[str] = []
    entry_point = numba_backend._entry_point

    def recording_entry_point(kernel: Any, args: tuple[Any, ...]) -> Any:
        called.append(kernel.__name__)
        entry = entry_point(kernel, args)

        def recording(*args: Any) -> Any:
            called.append(kernel.__name__)
            return entry(*args)

        return recording

    monkeypatch.setattr(numba_backend, "_entry_point", recording_entry_point)
    # entry points taken before, and the prepared functions holding them: taken anew
    numba_backend._kernel_types.cache_clear()
    spec.clear_cache()
    yield called
    numba_backend._kernel_types.cache_clear()  # the recording ones go
    spec.clear_cache()


_SMALL_SHAPES = [(1, 1), (1, 768), (3, 5), (7, 1000), (40, 768)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_small_tensors_go_by_address_bitwise_the_numpy_call(
    torch: Any, address_entries: list[str], dtype: str, op: str
) -> None:
    _dtype(dtype)
    half = dtype in ("float16", "bfloat16")
    for i, (rows, cols) in enumerate(_SMALL_SHAPES):
        x = torch.from_numpy(_data((rows, cols), "float32", seed=i, loc=2.0)).to(
            getattr(torch, dtype)
        )
        w = torch.randn(cols, dtype=torch.float32 if half else x.dtype)
        b = {"bias": torch.randn(cols, dtype=w.dtype)} if op == "layer_norm" else {}
        b_np = {k: v.numpy() for k, v in b.items()}
        for stats in (False, True):
            got = getattr(normlab, op)(x, weight=w, return_stats=stats, backend="numba", **b)
            want = getattr(normlab, op)(
                _as_numpy_array(x), weight=w.numpy(), return_stats=stats, backend="numba", **b_np
            )
            got, want = (got, want) if stats else ((got,), (want,))
            for g, v in zip(got, want, strict=True):
                assert isinstance(g, torch.Tensor)
                assert np.array_equal(_as_numpy_array(g).view(np.uint8), v.view(np.uint8))
    assert address_entries == ["layer_norm_rows_at"] * 2 * len(_SMALL_SHAPES)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("keep_h", [True, False])
def test_small_fused_tensors_go_by_address_bitwise_the_numpy_call(
    torch: Any, address_entries: list[str], dtype: str, keep_h: bool
) -> None:
    _dtype(dtype)
    for i, (rows, cols) in enumerate(_SMALL_SHAPES):
        x, r = (
            torch.from_numpy(_data((rows, cols), "float32", seed=s, loc=1.0)).to(
                getattr(torch, dtype)
            )
            for s in (2 * i, 2 * i + 1)
        )
        w = torch.randn(cols, dtype=x.dtype)  # float16/bfloat16 weights read in that dtype
        got = normlab.add_layer_norm(
            x, r, weight=w, return_residual=keep_h, return_stats=True, backend="numba"
        )
        want = normlab.add_layer_norm(
            _as_numpy_array(x), _as_numpy_array(r), weight=_as_numpy_array(w),
            return_residual=keep_h, return_stats=True, backend="numba",
        )  # fmt: skip
        for g, v in zip(got, want, strict=True):
            assert np.array_equal(_as_numpy_array(g).view(np.uint8), v.view(np.uint8))
    assert address_entries == ["add_norm_rows_at"] * len(_SMALL_SHAPES)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_parameters_go_by_address_bitwise_their_float32_values(
    torch: Any, address_entries: list[str], monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """A weight and bias stored in x's half dtype (``model.half()``) reach the address entries
    as they are, widened inside the kernel, never copied: the results are bitwise those of
    the same values as float32 parameters (widening is exact), with and without outputs,
    statistics and the prepared route; an absent one takes a stand-in in that dtype."""
    _dtype(dtype)
    half = getattr(torch, dtype)
    x, r = (torch.from_numpy(_data((3, 768), "float32", seed=s, loc=2.0)).to(half) for s in (1, 2))
    w, b = torch.randn(768).to(half), torch.randn(768).to(half)

    def never_converted(*args: Any) -> Any:
        raise AssertionError("half parameters were converted")

    calls = [
        ("layer_norm", {"weight": w, "bias": b}),
        ("layer_norm", {"weight": w}),
        ("layer_norm", {"bias": b}),
        ("rms_norm", {"weight": w}),
        ("add_layer_norm", {"weight": w, "bias": b}),
        ("add_layer_norm", {"weight": w, "bias": b, "return_residual": False}),
        ("add_rms_norm", {"weight": w}),
    ]
    for op, kwargs in calls:
        inputs = (x, r) if op.startswith("add_") else (x,)
        wide = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        for stats in (False, True):
            want = getattr(normlab, op)(*inputs, **wide, return_stats=stats, backend="numba")
            with monkeypatch.context() as m:
                m.setattr(numba_backend, "_converted_params", never_converted)
                for _ in range(2):  # the first may compile the entry (then: prepared, w/o stats)
                    got = getattr(normlab, op)(
                        *inputs, **kwargs, return_stats=stats, backend="numba"
                    )
            got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
            for g, v in zip(got, want, strict=True):
                assert _same_bits(g, v), (op, list(kwargs), stats)
    assert set(address_entries) == {"layer_norm_rows_at", "add_norm_rows_at"}
    mixed = normlab.layer_norm(x, weight=w, bias=b.float(), backend="numba")  # w converted
    want = normlab.layer_norm(x, weight=w.float(), bias=b.float(), backend="numba")
    assert _same_bits(mixed, want)


def test_tensors_the_address_entries_cannot_read_take_numpy_views(
    torch: Any, address_entries: list[str]
) -> None:
    """Strided, misaligned, large, in place: the NumPy views as before, the same results; a
    strided or misaligned weight is copied for the address entry."""
    x = torch.randn(4, 768)
    want = normlab.layer_norm(x.numpy(), backend="numba")
    strided = torch.empty(4, 2 * 768)[:, ::2]
    strided.copy_(x)
    misaligned = torch.frombuffer(bytearray(4 * 4 * 768 + 2), dtype=torch.float32, offset=2)
    misaligned = misaligned.view(4, 768)
    misaligned.copy_(x)
    assert misaligned.data_ptr() % 4 == 2
    in_place = x.clone()
    for t, kwargs in ((strided, {}), (misaligned, {}), (in_place, {"out": in_place})):
        assert np.array_equal(normlab.layer_norm(t, backend="numba", **kwargs).numpy(), want)
    large = torch.randn(64, 1024)  # above SERIAL_ELEMENTS: the parallel kernels' pool
    normlab.layer_norm(large, backend="numba")
    assert address_entries == []
    w_strided = torch.randn(2 * 768)[::2]
    w_misaligned = torch.frombuffer(bytearray(4 * 768 + 2), dtype=torch.float32, offset=2)
    w_misaligned.copy_(w_strided)
    w_want = normlab.layer_norm(x.numpy(), weight=w_strided.numpy(), backend="numba")
    for w in (w_strided, w_misaligned):
        assert np.array_equal(normlab.layer_norm(x, weight=w, backend="numba").numpy(), w_want)
    assert address_entries == ["layer_norm_rows_at"] * 2


def test_outputs_given_go_by_address_in_place_forms_included(
    torch: Any, address_entries: list[str]
) -> None:
    """``out=`` a separate tensor, and the fused op's in-place serving form (``out=x,
    residual_out=residual``): by address, written in place, bitwise the NumPy call."""
    x, r = torch.randn(3, 768), torch.randn(3, 768)
    w, b = torch.randn(768), torch.randn(768)
    want = normlab.layer_norm(x.numpy(), weight=w.numpy(), bias=b.numpy(), backend="numba")
    out = torch.empty(3, 768)
    assert normlab.layer_norm(x, weight=w, bias=b, out=out, backend="numba") is out
    assert np.array_equal(out.numpy(), want)
    want_y, want_h = normlab.add_layer_norm(
        x.numpy(), r.numpy(), weight=w.numpy(), bias=b.numpy(), backend="numba"
    )
    xs, rs = x.clone(), r.clone()
    y, h = normlab.add_layer_norm(
        xs, rs, weight=w, bias=b, out=xs, residual_out=rs, backend="numba"
    )
    assert y is xs and h is rs
    assert np.array_equal(xs.numpy(), want_y) and np.array_equal(rs.numpy(), want_h)
    xs, rs = x.clone(), r.clone()  # swapped: h over x, y over the residual
    y, h = normlab.add_layer_norm(
        xs, rs, weight=w, bias=b, out=rs, residual_out=xs, backend="numba"
    )
    assert y is rs and h is xs
    assert np.array_equal(rs.numpy(), want_y) and np.array_equal(xs.numpy(), want_h)
    assert address_entries == ["layer_norm_rows_at"] + ["add_norm_rows_at"] * 2


def test_an_integer_eps_first_does_not_fix_the_entry_points_eps_type(torch: Any) -> None:
    """The address entries keep the entry point of their first call's argument types: a plan
    whose eps is an int (a backend driven by hand) must not make later calls' eps an integer
    (1e-5 truncated to 0)."""
    numba_backend._kernel_types.cache_clear()  # the entry point is taken by the next call
    x = torch.from_numpy(_data((1, 768), "float32", seed=3, loc=2.0))
    plan = spec.plan("layer_norm", x, None, None, None, 1e-5, None, False, None)
    numba_backend.layer_norm(x, None, None, plan=dataclasses.replace(plan, eps=0), out=None)
    got = numba_backend.layer_norm(x, None, None, plan=plan, out=None)[0]
    want = normlab.layer_norm(x.numpy(), backend="numba")
    assert np.array_equal(got.numpy(), want)


# --------------------------------------------------------------------------------------------
# The direct route's prepared functions (numba_backend.prepare)


def _direct_cases(family: str, dtype: str) -> list[tuple[str, Any, Any, Any]]:
    """Small calls of the direct route, as (name, x, weight, bias): ones the prepared function
    runs itself, and ones it hands back to the op's function (a weight to convert or copy, a
    misaligned tensor)."""
    import torch

    half = dtype in ("float16", "bfloat16")
    x = torch.from_numpy(_data((3, 768), "float32", loc=2.0)).to(getattr(torch, dtype))
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
            (name, *(None if a is None else _as_numpy_array(a) for a in c)) for name, *c in cases
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


def _same_bits(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are both None or arrays (or tensors) of the same type and bytes."""
    if a is None or b is None:
        return a is b
    as_bytes = [
        (t if isinstance(t, np.ndarray) else _as_numpy_array(t)).view(np.uint8) for t in (a, b)
    ]
    return type(a) is type(b) and np.array_equal(*as_bytes)


@pytest.mark.parametrize("family", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_small_direct_calls_run_the_prepared_function_bitwise_the_op(
    torch: Any, family: str, dtype: str, op: str
) -> None:
    """A small call that takes the direct route (inputs read as they are, no outputs given, no
    statistics) runs the function ``prepare`` made for its plan, which returns bitwise what the
    op's own function returns, also where it hands the call back to it."""
    _dtype(dtype)
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
                call = spec.validated_fused(
                    op, *inputs, None, w, bias, eps, None, False, keep_h, None, None
                )
                keywords = {"return_residual": keep_h}
                outputs = {"out": None, "residual_out": None}
            else:
                inputs = (x,)
                call = spec.validated(op, x, None, w, bias, eps, None, False, None)
                keywords, outputs = {}, {"out": None}
            run = getattr(normlab, op)
            for _ in range(2):  # the first call compiles (or loads) the entry, the second reads it
                got = run(*inputs, **params, **keywords, backend="numba")
            route = call.routes[numba_record]
            assert route.prepared is not None, case
            ran: list[str] = []  # the core calls the route's prepared function
            call.routes[numba_record] = dataclasses.replace(
                route, prepared=_recording(route.prepared, ran, case)
            )
            try:
                again = run(*inputs, **params, **keywords, backend="numba")
            finally:
                call.routes[numba_record] = route
            assert ran == [case]
            want = function(*inputs, w, bias, plan=call.plan, **outputs)
            prepared = route.prepared(*inputs, w, bias)
            assert len(prepared) == len(want), case
            assert all(_same_bits(p, v) for p, v in zip(prepared, want, strict=True)), case
            returned = want[:2] if keep_h else want[:1]
            for result in (got, again):
                result = result if keep_h else (result,)
                assert all(_same_bits(r, v) for r, v in zip(result, returned, strict=True)), case


def test_prepare_leaves_calls_it_does_not_serve_to_the_op(torch: Any) -> None:
    """No prepared function for calls on the thread pool, calls that need autograd's graph, or
    the backward ops: the op's function runs them."""
    small, large = torch.randn(2, 768), torch.randn(64, 1024)  # large: above SERIAL_ELEMENTS
    for x, served in ((small, True), (large, False), (small.clone().requires_grad_(), False)):
        plan = spec.plan("layer_norm", x, None, None, None, 1e-5, None, False, None)
        assert (numba_backend.prepare("layer_norm", plan) is not None) == served
    plan = spec.plan("layer_norm", small.numpy(), None, None, None, 1e-5, None, False, None)
    assert numba_backend.prepare("layer_norm", plan) is not None
    assert numba_backend.prepare("layer_norm_backward", plan) is None
