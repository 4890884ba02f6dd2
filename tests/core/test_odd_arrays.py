"""Odd arrays: read-only and memory-mapped inputs, non-native byte order, Fortran order, zero
strides, masked arrays, odd tensors, and inputs beyond 2**31 elements.

Each odd array goes through every CPU backend that serves it and must give the reference
result, leave its memory (and a memory-mapped file) untouched unless it is ``out``, or be
refused with a NormlabError that says what to do. The test beyond 2**31 elements needs about
9 GB of memory and a few minutes: it runs with ``NORMLAB_SLOW_TESTS=1``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import numpy as np
import pytest

import normlab
from normlab import reference, registry
from normlab.ops import OPS

SLOW: Final = os.environ.get("NORMLAB_SLOW_TESTS", "") not in ("", "0")
RNG = np.random.default_rng(11)
NUMPY_BACKENDS: Final = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(
            not registry.get(name).available, reason=f"{name}: {registry.get(name).reason}"
        ),
    )
    for name in ("numpy", "numba")
]
#: float32 and float64 results within a few units of roundoff of the float64 reference.
CLOSE: Final = {"float32": 1e-5, "float64": 1e-12, "float16": 4e-3}


def check(y: Any, x: np.ndarray, weight: Any = None, bias: Any = None, axis: Any = -1) -> None:
    """``y`` is the float64 reference of the same call, to ``x``'s dtype's tolerance."""
    want = reference.layer_norm(x, weight=weight, bias=bias, axis=axis)[0]
    tol = CLOSE[np.dtype(x.dtype).name]
    np.testing.assert_allclose(np.asarray(y, dtype=np.float64), want, rtol=tol, atol=tol)


def read_only(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


# --------------------------------------------------------------------------------------------
# Read-only and memory-mapped


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
@pytest.mark.parametrize("shape", [(6, 40), (300, 256)], ids=["serial", "parallel"])
def test_read_only_inputs(backend: str, shape: tuple[int, int]) -> None:
    x = read_only(RNG.standard_normal(shape).astype(np.float32))
    w, b = (read_only(RNG.standard_normal(shape[1]).astype(np.float32)) for _ in range(2))
    y, mean, rstd = normlab.layer_norm(x, weight=w, bias=b, backend=backend, return_stats=True)
    check(y, x, w, b)
    assert y.flags.writeable and mean.flags.writeable and rstd.flags.writeable


@pytest.fixture
def embeddings(tmp_path: Path) -> tuple[Path, np.ndarray]:
    """A file of 4096 float32 embeddings of width 256, and its values."""
    values = RNG.standard_normal((4096, 256)).astype(np.float32) * 3 + 1
    path = tmp_path / "embeddings.f32"
    values.tofile(path)
    return path, values


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
@pytest.mark.parametrize("mode", ["r", "r+", "c"])
def test_memory_mapped_inputs(embeddings: tuple[Path, np.ndarray], backend: str, mode: str) -> None:
    path, values = embeddings
    x = np.memmap(path, dtype=np.float32, mode=mode, shape=values.shape)
    for rows in (x, x[1000:1010], x[::7]):  # all of it (parallel), a few rows, strided rows
        y = normlab.layer_norm(rows, backend=backend)
        check(y, np.asarray(rows))
        assert type(y) is np.ndarray  # a new array, not a memmap without a file
    del x
    assert path.read_bytes() == values.tobytes()  # the file is untouched


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
def test_memory_mapped_out_writes_the_file(
    embeddings: tuple[Path, np.ndarray], backend: str, tmp_path: Path
) -> None:
    path, values = embeddings
    x = np.memmap(path, dtype=np.float32, mode="r", shape=values.shape)
    out = np.memmap(tmp_path / "normalized.f32", dtype=np.float32, mode="w+", shape=values.shape)
    assert normlab.layer_norm(x, out=out, backend=backend) is out
    out.flush()
    del out
    written = np.fromfile(tmp_path / "normalized.f32", dtype=np.float32).reshape(values.shape)
    check(written, values)


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
def test_memory_mapped_in_place(embeddings: tuple[Path, np.ndarray], backend: str) -> None:
    path, values = embeddings
    x = np.memmap(path, dtype=np.float32, mode="r+", shape=values.shape)
    normlab.layer_norm(x, out=x, backend=backend)
    x.flush()
    del x
    check(np.fromfile(path, dtype=np.float32).reshape(values.shape), values)


# --------------------------------------------------------------------------------------------
# Byte order, Fortran order, zero strides


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_non_native_byte_order_everywhere(backend: str, dtype: str) -> None:
    swapped = np.dtype(dtype).newbyteorder()
    x = RNG.standard_normal((5, 12)).astype(swapped)
    w, b = (RNG.standard_normal(12).astype(swapped) for _ in range(2))
    weight = w if dtype != "float16" else w.astype(np.dtype("float32").newbyteorder())
    y, mean, rstd = normlab.layer_norm(x, weight=weight, bias=b, backend=backend, return_stats=True)
    check(y, x, weight, b)
    assert y.dtype.name == dtype and mean.dtype.isnative and rstd.dtype.isnative


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
def test_non_native_out_arrays(backend: str) -> None:
    x = RNG.standard_normal((5, 12)).astype(np.float32)
    out = (np.empty((5, 12), ">f4"), np.empty((5, 1), ">f4"), np.empty((5, 1), ">f4"))
    y, mean, rstd = normlab.layer_norm(x, out=out, return_stats=True, backend=backend)
    assert (y, mean, rstd) == out
    check(y, x)
    want_mean, want_rstd = reference.layer_norm(x)[1:]
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rstd, want_rstd, rtol=1e-5)


#: Every array argument of every op, by op: the byte-order rule (normlab.spec.non_native)
#: covers each one. Inputs are converted once by the core; outputs written through a temporary.
BYTE_ORDER_ARGUMENTS: Final = {
    "layer_norm": ("x", "weight", "bias", "out", "out_mean", "out_rstd"),
    "rms_norm": ("x", "weight", "out", "out_rstd"),
    "layer_norm_backward": ("dy", "x", "mean", "rstd", "weight"),
    "rms_norm_backward": ("dy", "x", "rstd", "weight"),
}


def _byte_order_call(op: str, swapped: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Arguments of one call of ``op`` on float32 rows: native ones, and the same values with
    the argument ``swapped`` in non-native byte order (``out*``: fresh output arrays)."""
    x = RNG.standard_normal((6, 16)).astype(np.float32)
    weight = RNG.standard_normal(16).astype(np.float32)
    native: dict[str, Any] = {"x": x, "weight": weight}
    if op == "layer_norm":
        native["bias"] = RNG.standard_normal(16).astype(np.float32)
    if op.endswith("_backward"):
        forward = getattr(normlab, op.removesuffix("_backward"))
        stats = forward(x, weight=weight, return_stats=True, backend="numpy")[1:]
        native["dy"] = RNG.standard_normal(x.shape).astype(np.float32)
        native.update(zip(("mean", "rstd") if len(stats) == 2 else ("rstd",), stats, strict=True))
    else:
        native["return_stats"] = True
        stats = ("out_mean", "out_rstd") if op == "layer_norm" else ("out_rstd",)
        native["out"] = tuple(
            np.empty(x.shape if name == "out" else (6, 1), np.float32) for name in ("out", *stats)
        )
    call = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in native.items()}
    if swapped.startswith("out"):
        names = ("out", *stats)
        call["out"] = tuple(
            o.astype(o.dtype.newbyteorder()) if name == swapped else o.copy()
            for name, o in zip(names, native["out"], strict=True)
        )
    else:
        call[swapped] = call[swapped].astype(call[swapped].dtype.newbyteorder())
    return native, call


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
@pytest.mark.parametrize(
    ("op", "argument"), [(op, a) for op, args in BYTE_ORDER_ARGUMENTS.items() for a in args]
)
def test_non_native_byte_order_of_each_argument(backend: str, op: str, argument: str) -> None:
    """One argument in non-native byte order gives bitwise the result of the native call, on
    the backend's own kernel, and leaves the caller's inputs untouched."""
    native, call = _byte_order_call(op, argument)
    inputs = {k: v.copy() for k, v in call.items() if isinstance(v, np.ndarray)}
    want = getattr(normlab, op)(**native, backend=backend)
    got = getattr(normlab, op)(**call, backend=backend)
    for w, g in zip(want, got, strict=True):
        if w is None:
            assert g is None
        else:
            np.testing.assert_array_equal(np.asarray(g, dtype=w.dtype), w, strict=False)
    if not op.endswith("_backward"):
        assert all(g is o for g, o in zip(got, call["out"], strict=True))  # out returned as is
    for name, value in inputs.items():
        np.testing.assert_array_equal(call[name], value)
        assert call[name].dtype == value.dtype


def test_non_native_byte_order_is_named_by_the_layout_and_explain() -> None:
    x = RNG.standard_normal((3, 8)).astype(np.float32)
    weight = np.ones(8, ">f4")
    call = normlab.spec.validated(
        OPS["layer_norm"], normlab.spec.arguments("layer_norm", x, weight=weight)
    )
    assert call.non_native == {"weight"}
    assert "native copy of weight" in normlab.explain(x, weight=weight, backend="numpy")


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
def test_fortran_order_x_weight_and_out(backend: str) -> None:
    x = np.asfortranarray(RNG.standard_normal((6, 5, 4)))
    w, b = (np.asfortranarray(RNG.standard_normal((5, 4))) for _ in range(2))
    out = np.empty_like(x, order="F")
    assert normlab.layer_norm(x, (5, 4), w, b, out=out, backend=backend) is out
    check(out, x, w, b, axis=(1, 2))


@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
def test_zero_strides(backend: str) -> None:
    row = RNG.standard_normal(16).astype(np.float32)
    bias = RNG.standard_normal(16).astype(np.float32)
    rows = np.broadcast_to(row, (300, 16))  # every row the same memory
    check(normlab.layer_norm(rows, backend=backend), np.ascontiguousarray(rows))
    columns = np.broadcast_to(row[:, None], (16, 300))  # each row one value: y is bias
    y = normlab.layer_norm(columns, bias=np.broadcast_to(bias[0], (300,)), backend=backend)
    np.testing.assert_array_equal(y, np.full((16, 300), bias[0]))
    scale = np.broadcast_to(np.float32(2.0), (16,))
    check(
        normlab.layer_norm(rows, weight=scale, backend=backend),
        np.ascontiguousarray(rows),
        weight=np.full(16, 2.0),
    )


# --------------------------------------------------------------------------------------------
# Masked arrays: refused, saying what to do


X = RNG.standard_normal((3, 4)).astype(np.float32)
MASKED = np.ma.masked_array(X, mask=X > 1)


@pytest.mark.parametrize(
    "call",
    [
        lambda: normlab.layer_norm(X, bias=np.ma.masked_array(X[0])),
        lambda: normlab.rms_norm(MASKED),
        lambda: normlab.layer_norm(np.ma.masked_array(X)),  # no element masked: still refused
        lambda: normlab.layer_norm_backward(MASKED, X, X[:, :1], X[:, :1]),
    ],
    ids=["bias", "rms_norm", "nothing-masked", "backward-dy"],
)
def test_masked_arrays_are_refused(call: Callable[[], Any]) -> None:
    with pytest.raises(normlab.DtypeError, match="masked"):
        call()


def test_the_masked_x_message_says_what_to_do() -> None:
    with pytest.raises(normlab.DtypeError, match=r"mask would be ignored.*x\.filled"):
        normlab.layer_norm(MASKED)


def test_a_masked_out_is_refused() -> None:
    with pytest.raises(normlab.DtypeError, match="masked"):
        normlab.layer_norm(X, out=np.ma.masked_array(np.empty_like(X)))


# --------------------------------------------------------------------------------------------
# Odd tensors


def test_tensors_with_odd_strides_and_devices() -> None:
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(RNG.standard_normal((4, 6, 8, 2)).astype(np.float32))
    channels_last = x.contiguous(memory_format=torch.channels_last)
    views = [
        (x.transpose(0, 2), -1),
        (x[:, ::2], -1),
        (x[:1].expand(5, 6, 8, 2), -1),
        (channels_last, 1),
        (channels_last, (1, 3)),
    ]
    for view, axis in views:
        check(normlab.layer_norm(view, axis=axis), view.numpy(), axis=axis)
    with pytest.raises(normlab.BackendError, match="meta"):
        normlab.layer_norm(torch.ones(2, 3, device="meta"))


@pytest.mark.parametrize("layout", ["coo", "csr", "csc", "nested"])
def test_sparse_and_nested_tensors_are_refused(layout: str) -> None:
    torch = pytest.importorskip("torch")
    if layout == "nested":
        x = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)])
    else:
        x = getattr(torch.eye(3), "to_sparse" if layout == "coo" else f"to_sparse_{layout}")()
    with pytest.raises(normlab.DtypeError):
        normlab.layer_norm(x)


# --------------------------------------------------------------------------------------------
# Beyond 2**31 elements (opt-in)

ROWS_BEYOND: Final = 2**21 + 3
COLS_BEYOND: Final = 1024  # ROWS_BEYOND * COLS_BEYOND = 2**31 + 3072 elements, 4 GiB of float16
CHUNK_ROWS: Final = 1 << 16


def _available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _beyond_values(start: int, stop: int) -> np.ndarray:
    """Rows ``start..stop`` of the big input: each row its own offset, scale and shape."""
    i = np.arange(start, stop, dtype=np.float64)[:, None]
    j = np.arange(COLS_BEYOND, dtype=np.float64)[None, :]
    return (i % 13) - 6 + (1 + i % 7) * np.sin(0.37 * i + 0.011 * j * (1 + i % 3))


@pytest.mark.slow
@pytest.mark.skipif(not SLOW, reason="minutes and ~9 GB: set NORMLAB_SLOW_TESTS=1")
@pytest.mark.parametrize("backend", NUMPY_BACKENDS)
def test_beyond_two_to_the_31_elements(backend: str) -> None:
    """2**31 + 3072 float16 elements: every row, the last ones past the 32-bit offsets, equals
    the float64 reference computed chunk by chunk."""
    if _available_bytes() < 10 * 2**30:
        pytest.skip("needs about 9 GB of free memory")
    x = np.empty((ROWS_BEYOND, COLS_BEYOND), np.float16)
    for start in range(0, ROWS_BEYOND, CHUNK_ROWS):
        stop = min(start + CHUNK_ROWS, ROWS_BEYOND)
        x[start:stop] = _beyond_values(start, stop)
    assert x.size > 2**31
    y = normlab.layer_norm(x, backend=backend)
    for start in range(0, ROWS_BEYOND, CHUNK_ROWS):
        stop = min(start + CHUNK_ROWS, ROWS_BEYOND)
        want = reference.layer_norm(x[start:stop])[0]
        error = np.abs(y[start:stop].astype(np.float64) - want)
        assert (error <= CLOSE["float16"] * (1 + np.abs(want))).all(), f"rows {start}..{stop}"
