"""The quantizing CUDA kernels (kernels/quantize.cu) without a GPU: their quantizer
(kernels/quantize.cuh) built for the host with a C++ compiler and checked bitwise against
normlab's reference quantizer, its division against IEEE division; the planner laying rows out as
float32 rows; the launch from Python against a fake CuPy; and the record routing quantized calls
to the kernels. NVRTC compiling them (no spills): test_cuda_kernels.py."""

from __future__ import annotations

import ctypes
import dataclasses
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from normlab import quantize, reference, registry, spec
from normlab.backends import cuda_compile
from normlab.backends.cuda_launch import (
    QUANTIZE_OPS,
    QUANTIZING,
    Specialisation,
    all_specialisations,
    plan_launch,
)
from normlab.constants import FLOAT_DTYPES
from normlab.spec.quantize import LIMITS
from tests.support import fake_cupy as fake_cupy_module
from tests.support.cuda_source import parameter_names
from tests.support.host_memory import HostArray, host_view

HARNESS = Path(__file__).with_name("quantize_host.cpp")
MODES = {"int8": 0, "fp8_e4m3": 1}


# --------------------------------------------------------------------------------------------
# The quantizer, built for the host


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """quantize.cuh compiled by the host's C++ compiler (quantize_host.cpp), through ctypes."""
    compiler = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no host C++ compiler (g++, c++, clang++) to build quantize.cuh with")
    library = tmp_path_factory.mktemp("quantize_host") / "quantize_host.so"
    subprocess.run(
        [
            compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off",
            f"-I{cuda_compile.KERNEL_DIR}", str(HARNESS), "-o", str(library),
        ],
        check=True, capture_output=True,
    )  # fmt: skip
    lib = ctypes.CDLL(str(library))
    floats, size = ctypes.POINTER(ctypes.c_float), ctypes.c_longlong
    lib.divide_values.argtypes = [floats, floats, size, floats]
    lib.quantize_values.argtypes = [floats, size, ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
    lib.dynamic_scale_of.argtypes = [floats, size, ctypes.c_int]
    lib.dynamic_scale_of.restype = ctypes.c_float
    return lib


def _floats(a: np.ndarray) -> Any:
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


def _divide(host: Any, y: np.ndarray, s: np.ndarray) -> np.ndarray:
    y, s = np.ascontiguousarray(y, np.float32), np.ascontiguousarray(s, np.float32)
    out = np.empty_like(y)
    host.divide_values(_floats(y), _floats(s), y.size, _floats(out))
    return out


def _quantize(host: Any, y: np.ndarray, scale: float, mode: str) -> np.ndarray:
    y = np.ascontiguousarray(y, np.float32)
    q = np.empty(y.shape, np.uint8)
    host.quantize_values(_floats(y), y.size, scale, MODES[mode], q.ctypes.data)
    return q


def _reference_bits(y: np.ndarray, mode: str, scale: float | None) -> tuple[np.ndarray, Any]:
    """normlab's reference quantizer on the row y: q as bytes, and the scale."""
    if mode == "fp8_e4m3":
        pytest.importorskip("ml_dtypes")
    with np.errstate(all="ignore"):  # rows with inf and NaN, quotients beyond float32
        q, s = quantize.reference(y.reshape(1, -1), mode, scale, (1,))
    return np.asarray(q).view(np.uint8)[0], np.float32(s[0, 0])


def _spread_floats(rng: np.random.Generator, n: int) -> np.ndarray:
    """Float32 values of every sign and exponent, subnormals included (no NaN or inf)."""
    bits = rng.integers(0, 0x7F800000, n, dtype=np.uint32) | (
        rng.integers(0, 2, n, dtype=np.uint32) << 31
    )
    return bits.view(np.float32)


def test_the_division_is_ieee_where_the_quotient_is_normal(host: Any) -> None:
    rng = np.random.default_rng(0)
    y = np.concatenate([_spread_floats(rng, 400_000), rng.standard_normal(200_000, np.float32)])
    s = np.abs(_spread_floats(rng, y.size))
    # scales of every mantissa, all ones included (the reciprocal's hardest case), and the
    # dynamic scales' divisors
    s[:1000] = np.float32(1.9999999)
    s[1000:2000] = np.float32(127.0)
    s[2000:3000] = np.float32(448.0)
    s[3000:200_000] = (rng.random(197_000) * 4).astype(np.float32) + np.float32(1e-3)
    with np.errstate(all="ignore"):
        want = y / s
    got = _divide(host, y, s)
    normal = np.isfinite(want) & (np.abs(want) >= np.finfo(np.float32).tiny)
    assert normal.sum() > 400_000
    np.testing.assert_array_equal(got[normal].view(np.uint32), want[normal].view(np.uint32))
    # beyond float32's normal range only the side of every bin of q has to agree
    tiny = ~normal & np.isfinite(want)
    assert np.all(np.abs(got[tiny]) < np.finfo(np.float32).tiny)
    assert np.array_equal(np.signbit(got[tiny]), np.signbit(want[tiny]))
    huge = ~np.isfinite(want)
    assert np.all(np.abs(got[huge]) > 2.0**126) and np.array_equal(
        np.signbit(got[huge]), np.signbit(want[huge])
    )


def test_the_division_of_special_values(host: Any) -> None:
    y = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -3.0, np.nan], np.float32)
    s = np.array([3.0, 3.0, 3.0, 1e-30, 2.0, np.nan, np.nan, np.nan], np.float32)
    with np.errstate(all="ignore"):
        want = y / s
    got = _divide(host, y, s)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))


def _rows_of_every_kind(rng: np.random.Generator) -> list[np.ndarray]:
    """Rows a quantizer may get: typical activations, ties of int8's and e4m3's rounding, values
    at and beyond the limits, zeros of both signs, special values, tiny and subnormal rows."""
    ties = np.arange(-130, 131, dtype=np.float32) + np.float32(0.5)
    e4m3 = np.array(
        [0.0, 2.0**-10, 3 * 2.0**-10, 2.0**-9, 2.0**-6 - 2.0**-10, 1.0625, 1.1875, 240.0, 248.0,
         440.0, 447.0, 448.0, 464.0, 500.0],
        np.float32,
    )  # fmt: skip
    rows = [
        rng.standard_normal(4096).astype(np.float32) * np.float32(3),
        np.concatenate([ties, -ties]),
        np.concatenate([e4m3, -e4m3, np.float32(127.0) * e4m3 / np.float32(448.0)]),
        np.array([0.0, -0.0, 0.0], np.float32),
        np.array([1.0, -np.inf, 2.0, np.inf], np.float32),
        np.array([1.0, np.nan, -5.0], np.float32),
        (rng.standard_normal(257) * 1e-38).astype(np.float32),
        (rng.standard_normal(33) * 1e-43).astype(np.float32),
        _spread_floats(rng, 1000),
    ]
    return rows


@pytest.mark.parametrize("mode", list(MODES))
def test_the_dynamic_scale_and_q_are_the_reference_s(host: Any, mode: str) -> None:
    for row in _rows_of_every_kind(np.random.default_rng(1)):
        want_q, want_scale = _reference_bits(row, mode, None)
        scale = np.float32(host.dynamic_scale_of(_floats(row), row.size, MODES[mode]))
        if np.isnan(want_scale):
            assert np.isnan(scale)
            got_q = _quantize(host, row, float(scale), mode)
            if mode == "fp8_e4m3":  # every q is NaN; its sign is the platform's NaN's
                assert set((got_q & 0x7F).tolist()) == set((want_q & 0x7F).tolist()) == {0x7F}
            else:
                np.testing.assert_array_equal(got_q, want_q)
            continue
        assert scale.view(np.uint32) == want_scale.view(np.uint32), (row[:4], scale, want_scale)
        np.testing.assert_array_equal(_quantize(host, row, float(scale), mode), want_q)


@pytest.mark.parametrize("mode", list(MODES))
def test_the_dynamic_scale_of_tiny_rows_is_ieee(host: Any, mode: str) -> None:
    """max|y| / LIMIT correctly rounded where the quotient is subnormal or nearly (divided in
    double there): rows of one value between 2^-149 and 2^-90."""
    rng = np.random.default_rng(5)
    bits = rng.integers(1, np.float32(2.0**-90).view(np.uint32), 20_000, dtype=np.uint32)
    amax = bits.view(np.float32)
    limit = np.float32(LIMITS[mode])
    got = np.array(
        [host.dynamic_scale_of(_floats(amax[i : i + 1]), 1, MODES[mode]) for i in range(amax.size)],
        np.float32,
    )
    np.testing.assert_array_equal(got.view(np.uint32), (amax / limit).view(np.uint32))


def test_a_nan_anywhere_in_a_row_makes_its_dynamic_scale_nan(host: Any) -> None:
    for where in range(5):
        row = np.arange(1, 6, dtype=np.float32)
        row[where] = np.nan
        assert np.isnan(host.dynamic_scale_of(_floats(row), row.size, 0))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("static", [1.0, 0.0078125, 3.3, 1e-30, 2e38, 1e-44])
def test_a_static_scale_gives_the_reference_q(host: Any, mode: str, static: float) -> None:
    s = float(np.float32(static))
    for row in _rows_of_every_kind(np.random.default_rng(2)):
        if np.isnan(row).any():
            continue  # the sign of a NaN quotient is the platform's (tested above)
        want_q, _ = _reference_bits(row, mode, s)
        np.testing.assert_array_equal(_quantize(host, row, s, mode), want_q)


def test_every_e4m3_value_and_midpoint_rounds_as_the_reference(host: Any) -> None:
    """Each of e4m3fn's 127 magnitudes, the midpoints between them and the floats beside those
    (ties go to the even code), of both signs."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    codes = np.arange(0x7F, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    mids = (codes[:-1] + codes[1:]) / np.float32(2)
    near = np.concatenate(
        [np.nextafter(mids, np.float32(0)), mids, np.nextafter(mids, np.float32(np.inf))]
    )
    v = np.concatenate([codes, near])
    v = np.concatenate([v, -v])
    want, _ = _reference_bits(v, "fp8_e4m3", 1.0)
    np.testing.assert_array_equal(_quantize(host, v, 1.0, "fp8_e4m3"), want)


# --------------------------------------------------------------------------------------------
# The planner


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("cols", [1, 17, 1000, 4096, 8192, 16385, 65536])
def test_a_quantizing_row_is_laid_out_as_a_float32_row(dtype: str, cols: int) -> None:
    """The quantizing kernel of a row takes the rung and chunks of the float32 (float64) forward
    kernel of the same length: the same reductions, so y is the float32 y bit for bit."""
    layout = "float64" if dtype == "float64" else "float32"
    for op, quantizing in QUANTIZING.items():
        base = op.removeprefix("add_")
        plain = plan_launch(base, cols, layout, None, [0, 0], [cols, cols]).specialisation
        plan = plan_launch(quantizing, cols, dtype, None, [0, 0, 0], [cols, cols, cols])
        q = plan.specialisation
        assert (q.threads, q.items, q.loop) == (plain.threads, plain.items, plain.loop), op
        assert plan.vector_width == 16 // np.dtype(layout).itemsize
        assert q.capacity == plain.capacity


def test_vector_access_needs_chunks_of_the_layout() -> None:
    """A bfloat16 row of a quantizing op is read in chunks of 4 elements (8 bytes): a row stride
    of 4 elements keeps vector access, one of 2 does not."""
    aligned = [0x7F0000000000, None, 0x7F0000100000, None, None, None]
    plan = plan_launch("layer_norm_quantize", 4096, "bfloat16", None, aligned, [4100, 4096, 4096])
    assert plan.specialisation.vector
    plan = plan_launch("layer_norm_quantize", 4096, "bfloat16", None, aligned, [4098, 4096, 4096])
    assert not plan.specialisation.vector


def test_every_quantizing_specialisation_is_compiled() -> None:
    specs = [s for s in all_specialisations() if s.op in QUANTIZE_OPS]
    assert {s.dtype for s in specs} == set(FLOAT_DTYPES)
    assert {s.source for s in specs} == {"quantize.cu"}
    assert any(s.loop for s in specs) and any(s.param_dtype != s.dtype for s in specs)


# --------------------------------------------------------------------------------------------
# The launch from Python, with a fake CuPy whose "kernel" computes on the memory behind its
# pointers (tests.support.host_memory)


class _FakeQuantizeKernel:
    """The kernel's contract on host memory: h, y as the float32 forward of h, then normlab's
    reference quantizer."""

    def __init__(self, spec: Specialisation) -> None:
        self.spec = spec

    def __call__(
        self, grid: tuple[int], block: tuple[int], args: tuple[Any, ...], stream: Any = None
    ) -> None:
        assert self.spec.op in QUANTIZE_OPS
        kernel = "norm_quantize_loop" if self.spec.loop else "norm_quantize_rows"
        names = parameter_names("quantize.cu", kernel)
        assert len(args) == len(names)
        a = dict(zip(names, args, strict=True))
        pointers = ("X", "R", "W", "B", "Q", "H", "Scale")
        assert all(isinstance(a[name], np.uint64) for name in pointers)
        sizes = ("rows", "cols", "x_row_stride", "r_row_stride", "h_row_stride")
        assert all(isinstance(a[name], np.int64) for name in sizes)
        x_at, r_at, w_at, b_at, q_at, h_at, scale_at = (int(a[name]) for name in pointers)
        rows, cols, x_stride, r_stride, h_stride = (int(a[name]) for name in sizes)
        eps, offset, static, mode = a["eps"], a["offset"], a["static_scale"], a["mode"]
        stats = np.dtype(np.float64 if self.spec.dtype == "float64" else np.float32)
        assert eps.dtype == offset.dtype == stats
        assert static.dtype == np.float32 and mode.dtype == np.int32
        assert block == (self.spec.block,) and grid[0] * self.spec.rows_per_block >= rows
        dtype = np.dtype(self.spec.dtype)
        h = host_view(x_at, rows, cols, x_stride, dtype).copy()
        if r_at:
            h = h + host_view(r_at, rows, cols, r_stride, dtype)
            if h_at:
                host_view(h_at, rows, cols, h_stride, dtype)[...] = h
        else:
            assert h_at == 0
        param = np.dtype(self.spec.param_dtype)
        w = None if w_at == 0 else host_view(w_at, 1, cols, 0, param)[0].astype(stats) + offset
        b = None if b_at == 0 else host_view(b_at, 1, cols, 0, param)[0]
        if self.spec.op == "rms_norm_quantize":
            assert b_at == 0
            y = reference.rms_norm(h, weight=w, eps=float(eps))[0]
        else:
            y = reference.layer_norm(h, weight=w, bias=b, eps=float(eps))[0]
        name = {0: "int8", 1: "fp8_e4m3"}[int(mode)]
        q, scale = quantize.reference(
            y.astype(np.float32), name, float(static) if static > 0 else None, (1,)
        )
        host_view(q_at, rows, cols, cols, np.dtype(np.uint8))[...] = np.asarray(q).view(np.uint8)
        host_view(scale_at, 1, rows, 0, np.dtype(np.float32))[0] = scale[:, 0]


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Any:
    from normlab.backends import cupy_backend

    fake_cupy_module.install(monkeypatch, _FakeQuantizeKernel)
    return cupy_backend


@pytest.mark.parametrize("op", list(QUANTIZING))
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
@pytest.mark.parametrize(("mode", "static"), [("int8", None), ("int8", 0.05), ("fp8_e4m3", None)])
def test_the_launch_passes_what_the_kernel_reads(
    fake_cupy: Any, op: str, dtype: str, mode: str, static: float | None
) -> None:
    if mode == "fp8_e4m3":
        pytest.importorskip("ml_dtypes")
    rows, cols = 5, 24
    rng = np.random.default_rng(3)
    x = rng.standard_normal((rows, cols)).astype(dtype)
    r = rng.standard_normal((rows, cols)).astype(dtype)
    w = rng.standard_normal(cols).astype(dtype)
    centre = "layer" in op
    b = rng.standard_normal(cols).astype(dtype) if centre else None
    fused = op.startswith("add_")
    base = spec.plan(op.removeprefix("add_"), x, weight=w, bias=b, eps=1e-5)
    plan = dataclasses.replace(
        base, op=op, family="cupy", return_residual=fused, weight_offset=0.5,
        quantize=mode, quantize_scale=static,
    )  # fmt: skip
    q, scale, h = fake_cupy.quantized(
        HostArray(x), HostArray(r) if fused else None, HostArray(w),
        None if b is None else HostArray(b), plan=plan, residual_out=None,
    )  # fmt: skip
    source = x + r if fused else x
    formed = w.astype(plan.stats_dtype) + np.asarray(0.5, plan.stats_dtype)
    norm = reference.layer_norm if centre else reference.rms_norm
    y = norm(source, weight=formed, **({"bias": b} if centre else {}), eps=1e-5)[0]
    want_q, want_scale = quantize.reference(y.astype(np.float32), mode, static, (1,))
    assert q.a.dtype == (np.int8 if mode == "int8" else np.uint8)  # CuPy has no float8
    np.testing.assert_array_equal(q.a.view(np.uint8), np.asarray(want_q).view(np.uint8))
    np.testing.assert_array_equal(scale.a, want_scale[:, 0])
    if fused:
        np.testing.assert_array_equal(h.a, source)
    else:
        assert h is None


def test_the_fused_launch_writes_h_into_the_residual(fake_cupy: Any) -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 32)).astype(np.float32)
    r = rng.standard_normal((4, 32)).astype(np.float32)
    want_h = x + r
    base = spec.plan("rms_norm", x)
    plan = dataclasses.replace(
        base, op="add_rms_norm", family="cupy", return_residual=True, quantize="int8"
    )
    fr = HostArray(r)
    q, scale, h = fake_cupy.quantized(HostArray(x), fr, None, None, plan=plan, residual_out=fr)
    assert h is fr
    np.testing.assert_array_equal(r, want_h)
    y = reference.rms_norm(want_h, eps=plan.eps)[0].astype(np.float32)
    want_q, want_scale = quantize.reference(y, "int8", None, (1,))
    np.testing.assert_array_equal(q.a, want_q)
    np.testing.assert_array_equal(scale.a, want_scale[:, 0])


def test_the_cupy_record_writes_quantized_outputs_itself() -> None:
    """The core calls the kernels for quantized calls (normlab.quantize.native) instead of
    composing the float32 y and the reference quantizer."""
    assert "quantize" in registry.get("cupy").capabilities


def test_cuda_tensors_get_torch_s_q_dtypes(
    torch_module: Any, fake_cupy: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Named explicitly (backend="cupy"), CUDA tensors (CPU tensors stand in) get q as
    torch.int8 or torch.float8_e4m3fn and a float32 tensor of scales, written through their
    pointers."""
    torch = torch_module
    pytest.importorskip("ml_dtypes")
    monkeypatch.setattr(fake_cupy._Torch, "stream", staticmethod(lambda a: None))
    monkeypatch.setattr(fake_cupy._Torch, "device", staticmethod(lambda a: 0))
    rng = np.random.default_rng(6)
    x = rng.standard_normal((6, 40)).astype(np.float32)
    w = rng.standard_normal(40).astype(np.float32)
    y = reference.rms_norm(x, weight=w, eps=1e-6)[0].astype(np.float32)
    for mode, dtype in (("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn)):
        base = spec.plan("rms_norm", x, weight=w, eps=1e-6)
        plan = dataclasses.replace(base, family="torch", quantize=mode)
        q, scale, h = fake_cupy.quantized(
            torch.from_numpy(x), None, torch.from_numpy(w), None, plan=plan, residual_out=None
        )
        want_q, want_scale = quantize.reference(y, mode, None, (1,))
        assert q.dtype == dtype and scale.dtype == torch.float32 and h is None
        np.testing.assert_array_equal(
            q.view(torch.uint8).numpy(), np.asarray(want_q).view(np.uint8)
        )
        np.testing.assert_array_equal(scale.numpy(), want_scale[:, 0])
