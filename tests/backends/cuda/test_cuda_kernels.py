"""The CUDA kernels without a GPU: NVRTC compiles every specialisation (LayerNorm and RMSNorm,
forward, backward and fused with a residual add) for sm_80 and sm_90 with no spills; the launch
planner; the ptxas report parser; a NumPy model of the kernels' arithmetic (chunk assignment,
per-thread sums, merges in the kernels' order, LayerNorm's corrected two-pass mean, y from the
unshifted x and its accuracy in float32); the launch from Python against a fake CuPy; and the
cupy backend reporting, on a machine without a CUDA device, that it is unavailable and why. The
backward's planner and launches: test_cuda_backward.py."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from normlab import constants, reference, registry, spec
from normlab.backends import cuda_compile, cuda_launch
from normlab.backends.cuda_launch import (
    FORWARD_OPS,
    FUSED_OPS,
    MAX_GRID,
    OPS,
    Specialisation,
    all_specialisations,
    plan_launch,
    vector_width,
)
from normlab.constants import FLOAT_DTYPES
from tests.support import fake_cupy as fake_cupy_module
from tests.support.host_memory import HostArray, host_view
from tests.support.kernels import kernel_results

ARCHS = ("sm_80", "sm_90")
AWKWARD_COLS = (1, 3, 17, 127, 1000, 4097, 65536, 262144)
ALIGNED = [0x7F0000000000, 0x7F0000100000, None, None]  # x, out, weight, bias


def _nvrtc_or_skip() -> None:
    problem = cuda_compile.nvrtc_problem()
    if problem is not None:
        pytest.skip(f"NVRTC is unavailable: {problem}")


@pytest.fixture(scope="module", params=ARCHS)
def reports(
    request: pytest.FixtureRequest, cubins: Callable[[str], list[cuda_compile.KernelReport]]
) -> list[cuda_compile.KernelReport]:
    """Every kernel compiled for the architecture, once for all tests (tests/conftest.py)."""
    _nvrtc_or_skip()
    return cubins(request.param)


# --------------------------------------------------------------------------------------------
# Compilation


def test_every_specialisation_compiles(reports: list[cuda_compile.KernelReport]) -> None:
    assert [r.name for r in reports] == [s.name for s in all_specialisations()]
    assert all(r.registers > 0 for r in reports)


def test_no_kernel_spills_or_uses_a_stack(reports: list[cuda_compile.KernelReport]) -> None:
    bad = [r for r in reports if r.spills or r.stack]
    assert not bad, f"spills or stack frames: {bad}"


def test_registers_fit_the_launch_bounds(reports: list[cuda_compile.KernelReport]) -> None:
    # The kernels over rows ask for 512 resident threads per SM: at most 128 registers per
    # thread; the others for one block of their size.
    specs = {s.name: s for s in all_specialisations()}
    for r in reports:
        s = specs[r.name]
        limit = 128 if s.stage == "rows" else min(255, 65536 // s.block)
        assert r.registers <= limit, r


def test_the_backward_kernels_are_compiled_and_reported(
    reports: list[cuda_compile.KernelReport],
) -> None:
    backward = [r for r in reports if "bwd_" in r.name]
    stages = {s.name: s.stage for s in all_specialisations()}
    assert {stages[r.name] for r in backward} == {"rows", "partials", "sum"}
    assert len(backward) == sum(s.op.endswith("_backward") for s in all_specialisations())
    assert all(r.registers > 0 and not r.spills and not r.stack for r in backward)


def test_compile_kernels_is_cached_on_disk(tmp_path: Path) -> None:
    _nvrtc_or_skip()
    spec = Specialisation("layer_norm", "float32", "float32", 32, 1, True)
    first = cuda_compile.compile_kernels([spec], "sm_90", cache_dir=tmp_path)
    assert first.image[:4] == b"\x7fELF"  # a cubin, not PTX
    assert len(list(tmp_path.glob("*.bin"))) == 1
    again = cuda_compile.compile_kernels([spec], "sm_90", cache_dir=tmp_path)
    assert again.image == first.image
    assert again.functions == first.functions
    assert again.reports == first.reports


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The NVRTC runs of this test, one file name each."""
    runs: list[str] = []
    real = cuda_compile._compile

    def counted(*args: Any) -> Any:
        runs.append(args[0])
        return real(*args)

    monkeypatch.setattr(cuda_compile, "_compile", counted)
    return runs


def _compile_one() -> bytes:
    """Compile one small program through the default cache."""
    spec = Specialisation("layer_norm", "float32", "float32", 32, 1, True)
    return cuda_compile.compile_kernels([spec], "sm_90").image


def test_the_cuda_cache_is_under_normlab_cache_dir_cuda_and_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiles: list[str]
) -> None:
    _nvrtc_or_skip()
    monkeypatch.setenv("NORMLAB_CACHE_DIR", str(tmp_path / "cache"))
    _compile_one()
    assert len(list((tmp_path / "cache" / "cuda").glob("*.bin"))) == 1
    for folder in (tmp_path / "cache", tmp_path / "cache" / "cuda"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    _compile_one()
    assert len(compiles) == 1


@pytest.mark.parametrize("damage", ["truncated", "same size, other bytes"])
def test_a_damaged_cached_cubin_is_compiled_again_not_loaded(
    damage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiles: list[str]
) -> None:
    _nvrtc_or_skip()
    monkeypatch.setenv("NORMLAB_CACHE_DIR", str(tmp_path))
    good = _compile_one()
    (cubin,) = (tmp_path / "cuda").glob("*.bin")
    data = cubin.read_bytes()
    cubin.write_bytes(
        data[:-100] if damage == "truncated" else data[:-1] + bytes([~data[-1] & 255])
    )
    damaged = cubin.read_bytes()
    again = _compile_one()
    assert len(compiles) == 2  # compiled afresh (NVRTC's cubins differ from run to run)
    assert again != damaged and len(again) == len(good)
    assert cubin.read_bytes() == again  # repaired


def test_cubins_in_the_old_layout_are_still_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compiles: list[str]
) -> None:
    """Before ``NORMLAB_CACHE_DIR/cuda``, ``NORMLAB_CACHE_DIR`` itself held the cubins (and no
    digest): such a cache is read, and carried into the new layout with a digest."""
    _nvrtc_or_skip()
    monkeypatch.setenv("NORMLAB_CACHE_DIR", str(tmp_path))
    good = _compile_one()
    for entry in (tmp_path / "cuda").iterdir():  # move it to the old place, digest removed
        if entry.suffix == ".json":
            meta = json.loads(entry.read_text())
            del meta["size"], meta["sha256"]
            entry.write_text(json.dumps(meta))
        entry.rename(tmp_path / entry.name)
    assert _compile_one() == good
    assert len(compiles) == 1
    assert len(list((tmp_path / "cuda").glob("*.bin"))) == 1


def test_nvrtc_is_given_the_launch_shapes_of_the_constants_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shapes the planner uses reach the kernels as ``-D`` options, read from
    normlab.constants at compile time; a changed value is another cache entry, compiled anew."""
    _nvrtc_or_skip()
    runs: list[list[str]] = []
    real = cuda_compile._compile

    def recorded(*args: Any) -> Any:
        runs.append(list(args[3]))
        return real(*args)

    monkeypatch.setattr(cuda_compile, "_compile", recorded)
    spec = Specialisation("layer_norm_backward", "float32", "float32", 128, 0, True, "partials")
    cuda_compile.compile_kernels([spec], "sm_90", cache_dir=tmp_path)
    expected = {
        "ROW_CHUNK": constants.ROW_CHUNK,
        "LOOP_THREADS": constants.CUDA_LOOP_THREADS,
        "LOOP_ITEMS": constants.CUDA_LOOP_ITEMS,
        "MIN_BLOCK": constants.CUDA_MIN_BLOCK,
        "PARTIAL_THREADS": constants.CUDA_PARTIAL_THREADS,
        "SUM_COLUMNS": constants.CUDA_SUM_COLUMNS,
        "SUM_LANES": constants.CUDA_SUM_LANES,
    }
    assert {f"-DNORMLAB_{name}={value}" for name, value in expected.items()} <= set(runs[0])
    monkeypatch.setattr(constants, "ROW_CHUNK", 16)
    cuda_compile.compile_kernels([spec], "sm_90", cache_dir=tmp_path)
    assert len(runs) == 2 and "-DNORMLAB_ROW_CHUNK=16" in runs[1]
    assert len(list(tmp_path.glob("*.bin"))) == 2


def test_every_macro_the_kernels_read_is_in_the_table_and_required() -> None:
    """The sources use only macros that kernel_macros defines, and refuse to compile without
    them (a value written into a .cu file would drift from the planner's)."""
    _nvrtc_or_skip()
    given = {o.split("=")[0].removeprefix("-D") for o in cuda_compile.kernel_macros()}
    used = {
        name
        for path in cuda_compile.KERNEL_DIR.iterdir()
        for name in re.findall(r"\bNORMLAB_[A-Z_]+\b", path.read_text())
    }
    assert used == given
    source, headers = cuda_compile._read_sources(cuda_compile.SOURCE)
    spec = Specialisation("layer_norm", "float32", "float32", 32, 1, True)
    with pytest.raises(cuda_compile.CudaCompileError, match="kernel_macros"):
        cuda_compile._compile(
            cuda_compile.SOURCE, source, headers, ["--gpu-architecture=sm_90"], [spec.expression]
        )


def test_compute_target_gives_ptx_without_reports(tmp_path: Path) -> None:
    _nvrtc_or_skip()
    spec = Specialisation("rms_norm", "bfloat16", "float32", 512, 0, False)
    module = cuda_compile.compile_kernels([spec], "compute_80", cache_dir=tmp_path)
    assert b".entry " + module.functions[spec.name].encode() in module.image
    assert module.reports == ()


def test_a_bad_target_raises_with_nvrtc_s_message(tmp_path: Path) -> None:
    _nvrtc_or_skip()
    spec = Specialisation("layer_norm", "float32", "float32", 32, 1, True)
    with pytest.raises(cuda_compile.CudaCompileError, match="NVRTC_ERROR_INVALID_OPTION"):
        cuda_compile.compile_kernels([spec], "sm_1", cache_dir=tmp_path)


def test_target_for_a_device() -> None:
    _nvrtc_or_skip()
    archs = cuda_compile.supported_archs()
    assert cuda_compile.target_for(90) == "sm_90"
    newest = max(archs)
    assert cuda_compile.target_for(newest + 1) == f"compute_{newest}"
    with pytest.raises(cuda_compile.CudaCompileError, match="compute capabilities"):
        cuda_compile.target_for(min(archs) - 1)


PTXAS_LOG = """\
ptxas info    : 20 bytes gmem
ptxas info    : Compiling entry function '_Z1aPf' for 'sm_90'
ptxas info    : Function properties for _Z1aPf
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 111 registers, used 1 barriers, 48 bytes smem
ptxas info    : Compile time = 137.028 ms
ptxas info    : Compiling entry function '_Z1bPd' for 'sm_80'
ptxas info    : Function properties for _Z1bPd
ptxas         .     48 bytes stack frame, 28 bytes spill stores, 44 bytes spill loads
ptxas info    : Used 64 registers, 48 bytes cumulative stack size, 768 bytes smem, 400 bytes cmem[0]
"""


def test_ptxas_log_is_parsed() -> None:
    assert cuda_compile.parse_ptxas_log(PTXAS_LOG) == {
        "_Z1aPf": {"registers": 111, "stack": 0, "spill_stores": 0, "spill_loads": 0, "shared": 48},
        "_Z1bPd": {
            "registers": 64,
            "stack": 48,
            "spill_stores": 28,
            "spill_loads": 44,
            "shared": 768,
        },
    }


# --------------------------------------------------------------------------------------------
# The launch planner


def test_specialisations_have_unique_names_and_expressions() -> None:
    specs = all_specialisations()
    assert len({s.name for s in specs}) == len(specs)
    for s in specs:  # sum_chunks<float> serves three dtypes, one program each
        program = cuda_launch.program_of(s)
        assert len({p.expression for p in program}) == len(program)
        assert len({p.source for p in program}) == 1
    assert {s.dtype for s in specs} == set(FLOAT_DTYPES)
    assert {s.op for s in specs} == set(OPS)
    assert set(OPS) == {
        "layer_norm",
        "rms_norm",
        "layer_norm_backward",
        "rms_norm_backward",
        "add_layer_norm",
        "add_rms_norm",
        "layer_norm_quantize",
        "rms_norm_quantize",
    }


def test_the_fused_ops_take_the_forward_rungs() -> None:
    """The fused kernels have the forward's specialisations (same rungs, dtypes, parameter dtypes),
    in their own source, one program per op, dtype and parameter dtype."""
    specs = all_specialisations()
    for fused, forward in zip(FUSED_OPS, FORWARD_OPS, strict=True):
        mine = [s for s in specs if s.op == fused]
        assert [dataclasses.replace(s, op=forward) for s in mine] == [
            s for s in specs if s.op == forward
        ]
        assert all(s.name.startswith("add_") and "add_normalize_" in s.expression for s in mine)
        assert {s.source for s in mine} == {"add_norm.cu"}
        for s in mine:
            assert {p.op for p in cuda_launch.program_of(s)} == {fused}
    source = (cuda_compile.KERNEL_DIR / "add_norm.cu").read_text()
    assert source.count("__global__") == 2
    for parameters in (
        "typename T, typename P, bool CENTRE, int THREADS, int ITEMS, bool VECTOR",
        "typename T, typename P, bool CENTRE, bool VECTOR",
    ):
        assert f"template <{parameters}>\n__global__ void" in source


def test_both_ops_share_the_kernel_templates() -> None:
    """One template per kernel shape: the ops differ only in the CENTRE argument, and each has
    the same specialisations (and NVRTC programs of the same shape)."""
    specs = all_specialisations()
    layer_norm = [s for s in specs if s.op == "layer_norm"]  # the backward: test_cuda_backward
    rms_norm = [s for s in specs if s.op == "rms_norm"]
    assert [dataclasses.replace(s, op="rms_norm") for s in layer_norm] == rms_norm
    for ln, rms in zip(layer_norm, rms_norm, strict=True):
        assert ln.expression.replace(", true, ", ", false, ", 1) == rms.expression
        assert rms.name == f"rms_{ln.name}"
        program = cuda_launch.program_of(rms)
        assert {s.op for s in program} == {"rms_norm"}
        assert len(program) == len(cuda_launch.program_of(ln))
    source = (cuda_compile.KERNEL_DIR / cuda_compile.SOURCE).read_text()
    assert source.count("__global__") == 2


@pytest.mark.parametrize("op", FORWARD_OPS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("cols", [*AWKWARD_COLS, 4096, 16384, 16385])
def test_the_smallest_rung_that_holds_the_row_is_chosen(op: str, dtype: str, cols: int) -> None:
    plan = plan_launch(op, cols, dtype, None, ALIGNED, [cols, cols])
    spec = plan.specialisation
    rungs = [
        s
        for s in all_specialisations()
        if (s.op, s.dtype, s.param_dtype, s.vector) == (op, dtype, dtype, spec.vector)
    ]
    held = [s for s in rungs if s.capacity is not None and s.capacity >= cols]
    if held:
        assert spec == min(held, key=lambda s: s.capacity or 0)
    else:
        assert spec.loop and all(s.capacity is None or s.capacity < cols for s in rungs)
    assert spec in all_specialisations()


@pytest.mark.parametrize("op", FORWARD_OPS)
def test_typical_hidden_sizes_stay_in_registers(op: str) -> None:
    for dtype in FLOAT_DTYPES:
        limit = 8192 if dtype == "float64" else 16384
        assert not plan_launch(op, limit, dtype, None, ALIGNED, [limit]).specialisation.loop
        assert plan_launch(op, limit + 8, dtype, None, ALIGNED, [limit + 8]).specialisation.loop


@pytest.mark.parametrize("spec", all_specialisations(), ids=lambda s: s.name)
def test_block_shapes(spec: Specialisation) -> None:
    assert spec.block % 32 == 0 and 128 <= spec.block <= 1024
    if spec.stage == "rows":
        assert spec.block == spec.threads * spec.rows_per_block
    else:
        assert spec.rows_per_block == 1 and spec.capacity is None and not spec.loop


def test_16_byte_accesses_need_alignment_everywhere() -> None:
    def vector(cols: int, addresses: list[int | None], strides: list[int]) -> bool:
        plan = plan_launch("layer_norm", cols, "float16", "float32", addresses, strides)
        return plan.specialisation.vector

    base = 0x7F0000000000
    assert vector(1024, [base, base + 4096, base + 8192, None], [1024, 1024])
    assert not vector(1020, [base, base, base, base], [1020, 1020])  # 1020 % 8 != 0
    assert not vector(1024, [base + 2, base, None, None], [1024, 1024])  # x misaligned
    assert not vector(1024, [base, base, base + 4, None], [1024, 1024])  # weight misaligned
    assert not vector(1024, [base, base, None, None], [1028, 1024])  # row stride, 2056 bytes
    assert vector(1024, [base, base, None, None], [-2048, 0])  # negative and zero strides


def test_the_plan_never_depends_on_the_number_of_rows() -> None:
    assert "rows" not in inspect.signature(plan_launch).parameters
    plan = plan_launch("rms_norm", 768, "bfloat16", "float32", ALIGNED, [768, 768])
    assert plan.rows_per_block == 4 and plan.block == 128 and plan.threads_per_row == 32
    assert plan.vector_width == 8
    assert [plan.grid(r) for r in (1, 4, 5, 65537)] == [1, 1, 2, 16385]
    assert plan.grid(2**40) == MAX_GRID  # blocks stride over the rest
    with pytest.raises(ValueError, match="no launch for empty input"):
        plan.grid(0)
    with pytest.raises(ValueError, match="no launch for empty input"):
        plan_launch("layer_norm", 0, "float32", None, ALIGNED, [0])
    with pytest.raises(ValueError, match="not layer_norm_backward"):
        plan_launch("layer_norm_backward", 8, "float32", None, ALIGNED, [8])


def test_the_planner_and_the_kernel_source_agree() -> None:
    source = (cuda_compile.KERNEL_DIR / cuda_compile.SOURCE).read_text()
    rows = (cuda_compile.KERNEL_DIR / "rows.cuh").read_text()  # shared with the backward
    assert '#include "rows.cuh"' in source
    for cxx in cuda_launch.CXX_TYPES.values():
        assert cxx in ("float", "double") or f"struct {cxx.split('::')[1]} " in rows
    # The template parameters, in the order the name expressions give them.
    for parameters in (
        "typename T, typename P, bool CENTRE, int THREADS, int ITEMS, bool VECTOR",
        "typename T, typename P, bool CENTRE, bool VECTOR",
    ):
        assert f"template <{parameters}>\n__global__ void" in source


def test_parameter_dtypes() -> None:
    assert cuda_launch.param_dtypes("float16") == ("float16", "float32")
    assert cuda_launch.param_dtypes("float64") == ("float64",)
    with pytest.raises(ValueError, match="do not go with"):
        plan_launch("layer_norm", 8, "float32", "float16", ALIGNED, [8])


# --------------------------------------------------------------------------------------------
# A NumPy model of the kernels' arithmetic: which thread holds which column, per-thread sums (each
# thread's values added in its column order), merges in butterfly order across lanes and then
# across warps, LayerNorm's two reductions (the corrected two-pass) and y formed from the
# unshifted x. It checks the algorithm (not the CUDA code, which needs a GPU:
# benchmarks/gpu_check.py runs that). It models a batch of rows at once, each row on its own (the
# kernels never mix rows). The former kernels' statistics (exact moments per thread, merged with
# Chan's rule) are modelled too, to show what the correction gains.

Statistic = tuple[Any, ...]  # sums (s1, s2, ...) or moments (count, mean, m2); count an int


def _chan(a: Statistic, b: Statistic, acc: type) -> Statistic:
    n = a[0] + b[0]
    wb = acc(1) if a[0] == 0 else acc(b[0] / n)
    delta = acc(b[1] - a[1])
    return n, acc(a[1] + delta * wb), acc(a[2] + b[2] + delta * delta * a[0] * wb)


def _add(a: Statistic, b: Statistic, acc: type) -> Statistic:
    return tuple(acc(p + q) for p, q in zip(a, b, strict=True))


def _butterfly(stats: list[Statistic], acc: type, combine: Any) -> Statistic:
    offset = 1
    while offset < len(stats):
        stats = [
            combine(stats[i ^ offset], stats[i], acc)
            if i & offset
            else combine(stats[i], stats[i ^ offset], acc)
            for i in range(len(stats))
        ]
        offset *= 2
    for m in stats:  # every lane ends with the same bits
        assert all(np.array_equal(p, q) for p, q in zip(m, stats[0], strict=True))
    return stats[0]


def _thread_columns(cols: int, spec: Specialisation) -> list[np.ndarray]:
    """The columns each thread of a row holds (chunk c of the row to thread c % threads), in
    the order the thread adds them."""
    width = vector_width(spec.dtype)
    step = spec.threads * width
    held = []
    covered = np.zeros(cols, int)
    for t in range(spec.threads):
        columns = np.array(
            [
                c
                for i in range(spec.items)
                for c in range(t * width + i * step, t * width + i * step + width)
                if c < cols
            ],
            int,
        )
        covered[columns] += 1
        held.append(columns)
    assert (covered == 1).all()  # every column held by exactly one thread
    return held


def _serial_sum(v: np.ndarray, acc: type) -> np.ndarray:
    """Sum over the last axis in order, as a thread adds its registers (one rounding a term)."""
    total = np.zeros(v.shape[:-1], acc)
    for j in range(v.shape[-1]):
        total = (total + v[..., j]).astype(acc)
    return total


def _merge(
    per_thread: list[Statistic], spec: Specialisation, acc: type, combine: Any = _add
) -> Statistic:
    """The row's statistic: butterflies within each warp, then across the warps (the lanes past
    the warps hold the empty set)."""
    zeros = np.zeros_like(per_thread[0][-1])
    empty = (0, zeros, zeros) if combine is _chan else (zeros,) * len(per_thread[0])
    warps = [_butterfly(per_thread[w : w + 32], acc, combine) for w in range(0, spec.threads, 32)]
    warps += [empty] * (32 - len(warps))
    return _butterfly(warps, acc, combine) if spec.threads > 32 else warps[0]


FORMULAS = ("corrected", "shifted", "two_roundings")


def _model_rows(
    x: np.ndarray, spec: Specialisation, eps: float = 1e-5, *, formula: str = "corrected"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """LayerNorm's (mean, rstd, y) of the rows of x (2-D), as the kernel computes them, with
    x0 = x[:, 0] and n = the row length:

    - ``corrected`` (the kernels): m = x0 + sum(x - x0) / n (first reduction); d = x - m;
      res = sum(d) / n, mean = m + res, M2 = sum(d^2) - sum(d) * res (second reduction, over
      the registers); y = (x - mean) * rstd, x - mean rounded once. (The kernels may fuse
      d * d into its sum, an FMA; the model rounds both.)
    - ``shifted`` (the kernels before the correction): exact moments of d = x - x0 per thread,
      merged with Chan's rule; mean = x0 + mean(d), rounded at the scale of |x0 - mean|;
      y = (x - mean) * rstd, rounded once.
    - ``two_roundings`` (the kernels before that): the same moments, y = (d - mean(d)) * rstd."""
    assert formula in FORMULAS
    acc = np.float64 if spec.dtype == "float64" else np.float32
    v = x.astype(acc)
    x0 = v[:, :1]
    n = acc(x.shape[1])
    d = (v - x0).astype(acc)  # the shifted values, formed on the fly by the kernel
    threads = _thread_columns(x.shape[1], spec)
    if formula == "corrected":
        (shifted,) = _merge([(_serial_sum(d[:, c], acc),) for c in threads], spec, acc)
        m = (x0[:, 0] + (shifted / n).astype(acc)).astype(acc)
        e = (v - m[:, None]).astype(acc)
        sums = [(_serial_sum(e[:, c], acc), _serial_sum(e[:, c] * e[:, c], acc)) for c in threads]
        s1, s2 = _merge(sums, spec, acc)
        res = (s1 / n).astype(acc)
        mean = (m + res).astype(acc)
        m2 = np.maximum((s2 - (s1 * res).astype(acc)).astype(acc), acc(0))
    else:
        per_thread: list[Statistic] = []
        for columns in threads:
            held = d[:, columns]
            count = len(columns)
            thread_mean = (_serial_sum(held, acc) / acc(max(count, 1))).astype(acc)
            deviation = (held - thread_mean[:, None]).astype(acc)
            per_thread.append((count, thread_mean, _serial_sum(deviation * deviation, acc)))
        _, mean_d, m2 = _merge(per_thread, spec, acc, _chan)
        mean = (x0[:, 0] + mean_d).astype(acc)
    rstd = (acc(1) / np.sqrt((m2 / n).astype(acc) + acc(eps))).astype(acc)
    if formula == "two_roundings":
        y = (d - mean_d[:, None]).astype(acc) * rstd[:, None]
    else:
        y = (v - mean[:, None]).astype(acc) * rstd[:, None]
    return mean, rstd, y.astype(acc)


def _model_row(x: np.ndarray, spec: Specialisation) -> tuple[float, float, np.ndarray]:
    """LayerNorm's (mean, rstd, y) of one row, as the kernel computes it (eps 1e-5)."""
    mean, rstd, y = _model_rows(x[None], spec)
    return float(mean[0]), float(rstd[0]), y[0]


def _model_rms_row(x: np.ndarray, spec: Specialisation) -> tuple[float, np.ndarray]:
    """RMSNorm's (rstd, y) of one row, as the kernel computes it (eps 1e-5): no shift."""
    acc = np.float64 if spec.dtype == "float64" else np.float32
    v = x.astype(acc)[None]
    per_thread: list[Statistic] = []
    for columns in _thread_columns(len(x), spec):
        held = v[:, columns]
        per_thread.append((_serial_sum((held * held).astype(acc), acc),))
    (square_sum,) = _merge(per_thread, spec, acc)
    rstd = (acc(1) / np.sqrt((square_sum / acc(len(x))).astype(acc) + acc(1e-5))).astype(acc)
    return float(rstd[0]), (v * rstd[:, None]).astype(acc)[0]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("cols", [1, 3, 17, 127, 1000, 4097])
def test_model_of_the_kernel_arithmetic(dtype: str, cols: int) -> None:
    rng = np.random.default_rng(cols)
    x = (100 + 0.01 * rng.standard_normal(cols)).astype(dtype)
    spec = plan_launch("layer_norm", cols, dtype, None, ALIGNED, [cols]).specialisation
    mean, rstd, y = _model_row(x, spec)
    exact = x.astype(np.float64)
    var = exact.var()
    assert mean == pytest.approx(exact.mean(), rel=1e-6)
    if cols > 1:
        tol = 2e-3 if dtype == "float32" else 1e-9
        assert rstd == pytest.approx(1 / np.sqrt(var + 1e-5), rel=tol)
        assert np.allclose(y, (exact - exact.mean()) / np.sqrt(var + 1e-5), atol=tol * 10)


def test_model_of_a_constant_row_gives_exact_zeros() -> None:
    """x - mean = 0 exactly: sum(x - x0) = 0, so m = x0; d = x - m = 0, so res = 0 and
    mean = x0 (y = bias in the kernel)."""
    x = np.full(1000, 3.25, np.float32)
    spec = plan_launch("layer_norm", 1000, "float32", None, ALIGNED, [1000]).specialisation
    for formula in FORMULAS:
        mean, rstd, y = _model_rows(x[None], spec, formula=formula)
        assert mean[0] == 3.25 and not y.any() and rstd[0] == pytest.approx(1e-5**-0.5, rel=1e-6)


def _standard_normal_case(eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """2048 float32 rows of 768 standard normal values, their float64 LayerNorm (no weight, no
    bias) and torch's float32 accuracy on them: F.layer_norm is within 1e-7 + 1.3e-6 |ref|
    (at about 0.2 of it)."""
    x = np.random.default_rng(768).standard_normal((2048, 768)).astype(np.float32)
    return (x, *_reference_and_tolerance(x, eps))


def _reference_and_tolerance(x: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """The float64 LayerNorm of x's rows (no weight, no bias) and the tolerance 1e-7 + 1.3e-6 |ref|
    on it."""
    exact = x.astype(np.float64)
    mean, var = exact.mean(axis=1, keepdims=True), exact.var(axis=1, keepdims=True)
    ref = (exact - mean) / np.sqrt(var + eps)
    return ref, 1e-7 + 1.3e-6 * np.abs(ref)


def _worst(y: np.ndarray, ref: np.ndarray, tol: np.ndarray) -> float:
    """The largest error of y, in units of the tolerance."""
    return float(np.max(np.abs(y.astype(np.float64) - ref) / tol))


@pytest.mark.parametrize("eps", [1e-3, 1e-7])
def test_the_model_forms_y_from_x_minus_the_mean_rounded_once(eps: float) -> None:
    """y = (x - mean) * rstd rounds x - mean once; the former y = (d - mean(d)) * rstd from the
    shifted d = x - x0 rounded twice, erring by up to half an ulp of x - x0 on small outputs of
    rows whose first element is far from their mean. With the same (unrefined) statistics the
    model's y errs less with one rounding; and given a mean as accurate as float32 holds (and the
    model's rstd), one rounding is within torch's float32 accuracy and two roundings are not,
    even with mean(d) correctly rounded."""
    x, ref, tol = _standard_normal_case(eps)
    spec = plan_launch("layer_norm", 768, "float32", None, ALIGNED, [768]).specialisation
    _, _, once = _model_rows(x, spec, eps, formula="shifted")
    _, _, twice = _model_rows(x, spec, eps, formula="two_roundings")
    assert _worst(once, ref, tol) < _worst(twice, ref, tol)
    _, rstd, _ = _model_rows(x, spec, eps)
    mean = x.astype(np.float64).mean(axis=1)
    x0 = x[:, 0].astype(np.float64)
    mean_d = (mean - x0).astype(np.float32)  # mean(d), correctly rounded
    rounded_once = (x - mean.astype(np.float32)[:, None]) * rstd[:, None]
    rounded_twice = ((x - x[:, :1]) - mean_d[:, None]) * rstd[:, None]
    assert _worst(rounded_once, ref, tol) <= 0.5 and _worst(rounded_twice, ref, tol) > 1


def _errors(
    x: np.ndarray, eps: float, ref: np.ndarray, tol: np.ndarray
) -> dict[str, tuple[float, float]]:
    """Per formula: the model's largest error of y in units of the tolerance, and of the mean."""
    spec = plan_launch("layer_norm", x.shape[1], "float32", None, ALIGNED, [x.shape[1]])
    exact_mean = x.astype(np.float64).mean(axis=1)
    errors = {}
    for formula in FORMULAS:
        mean, _, y = _model_rows(x, spec.specialisation, eps, formula=formula)
        errors[formula] = (_worst(y, ref, tol), float(np.max(np.abs(mean - exact_mean))))
    return errors


@pytest.mark.parametrize("eps", [1e-3, 1e-7])
def test_the_model_is_as_accurate_as_torch_in_float32(eps: float) -> None:
    """The corrected two-pass: y within torch's float32 accuracy (measured: 0.21 of the
    tolerance, as the CPU backends), the mean within 2.1e-8 of the exact one. The former
    formulas, modelled the same way, are not: their shifted mean x0 + mean(x - x0) errs by up to
    2.9e-7 (mean(x - x0) is rounded at the scale of |x0 - mean|, not of the row's spread), which
    puts y at 2.9 times the tolerance with x - mean rounded once and 3.7 times with two
    roundings."""
    x, ref, tol = _standard_normal_case(eps)
    errors = _errors(x, eps, ref, tol)
    assert errors["corrected"][0] <= 1
    assert errors["shifted"][0] > 1 and errors["two_roundings"][0] > 1
    assert errors["corrected"][1] <= 5e-8 < errors["shifted"][1]


def test_the_correction_holds_when_the_first_element_is_far_from_the_mean() -> None:
    """Rows of standard normal values whose first element is 1000: the shifted mean is off by
    a rounding at the scale of 1000, which the correction removes (measured: 0.14 of the
    tolerance; the former formulas 20 and 27 times it)."""
    x = np.random.default_rng(1000).standard_normal((256, 768)).astype(np.float32)
    x[:, 0] = 1000
    errors = _errors(x, 1e-5, *_reference_and_tolerance(x, 1e-5))
    assert errors["corrected"][0] <= 1
    assert errors["shifted"][0] > 10 and errors["two_roundings"][0] > 10


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("cols", [1, 3, 17, 127, 1000, 4097])
def test_model_of_the_rms_kernel_arithmetic(dtype: str, cols: int) -> None:
    rng = np.random.default_rng(cols)
    x = (100 + rng.standard_normal(cols)).astype(dtype)
    spec = plan_launch("rms_norm", cols, dtype, None, ALIGNED, [cols]).specialisation
    rstd, y = _model_rms_row(x, spec)
    want_y, want_rstd = reference.rms_norm(x, eps=1e-5)
    tol = 1e-6 if dtype == "float32" else 1e-14  # no cancellation: relative error ~ sqrt(n) u
    assert rstd == pytest.approx(float(want_rstd[0]), rel=tol)
    np.testing.assert_allclose(y, want_y, rtol=tol)


# --------------------------------------------------------------------------------------------
# The launch from Python, with a fake CuPy whose "kernel" reads and writes host memory through the
# pointers it is given (tests.support.host_memory): argument order, element strides,
# weight/bias handling, statistics.


class _FakeKernel:
    """Runs the float64 reference of the kernel's op on the memory behind its pointer
    arguments."""

    def __init__(self, spec: Specialisation) -> None:
        self.spec = spec

    def __call__(
        self, grid: tuple[int], block: tuple[int], args: tuple[Any, ...], stream: Any = None
    ) -> None:
        fused = self.spec.op in FUSED_OPS
        pointers, sizes = (8, 6) if fused else (6, 4)
        assert all(isinstance(a, np.uint64) for a in args[:pointers])
        assert all(isinstance(a, np.int64) for a in args[pointers : pointers + sizes])
        assert len(args) == pointers + sizes + 2
        eps, offset = args[-2:]
        if fused:
            x_at, r_at, w_at, b_at, y_at, h_at, mean_at, rstd_at = args[:8]
            rows, cols, x_stride, r_stride, y_stride, h_stride = args[8:-2]
        else:
            x_at, w_at, b_at, y_at, mean_at, rstd_at, rows, cols, x_stride, y_stride = args[:-2]
        stats = np.dtype(np.float64 if self.spec.dtype == "float64" else np.float32)
        assert eps.dtype == stats and offset.dtype == stats
        assert block == (self.spec.block,) and grid[0] * self.spec.rows_per_block >= rows
        dtype = np.dtype(self.spec.dtype)
        x = host_view(int(x_at), int(rows), int(cols), int(x_stride), dtype)
        if fused:  # h from copies, written (when asked) before y, as the kernel does per chunk
            x = x + host_view(int(r_at), int(rows), int(cols), int(r_stride), dtype)
            if h_at != 0:
                host_view(int(h_at), int(rows), int(cols), int(h_stride), dtype)[...] = x
        param = np.dtype(self.spec.param_dtype)
        w = None if w_at == 0 else host_view(int(w_at), 1, int(cols), 0, param)[0]
        if w is not None and offset != 0:  # the kernels' write_chunks: offset + W in A
            w = w.astype(stats) + offset
        b = None if b_at == 0 else host_view(int(b_at), 1, int(cols), 0, param)[0]
        mean: np.ndarray | None = None
        if self.spec.op in ("rms_norm", "add_rms_norm"):
            assert b_at == 0 and mean_at == 0, "rms_norm has neither bias nor mean"
            y, rstd = reference.rms_norm(x, weight=w, eps=float(eps))
        else:
            y, mean, rstd = reference.layer_norm(x, weight=w, bias=b, eps=float(eps))
        host_view(int(y_at), int(rows), int(cols), int(y_stride), dtype)[...] = y
        for at, values in ((mean_at, mean), (rstd_at, rstd)):
            if at != 0 and values is not None:
                host_view(int(at), 1, int(rows), 0, stats)[0] = values[:, 0]


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fake ``cupy`` module, and kernels that compute on host memory."""
    from normlab.backends import cupy_backend

    fake_cupy_module.install(monkeypatch, _FakeKernel)
    return cupy_backend


AFFINES = [
    *((d, a) for d in ("float16", "float32", "float64") for a in ("none", "weight", "both")),
    ("float16", "mixed"),  # a float16 weight and a float32 bias: both read as float32
]


@pytest.mark.parametrize("layout", ["c", "padded", "reversed", "broadcast"])
@pytest.mark.parametrize(("dtype", "affine"), AFFINES)
def test_the_launch_passes_what_the_kernel_reads(
    fake_cupy: Any, dtype: str, affine: str, layout: str
) -> None:
    rows, cols = 5, 12
    rng = np.random.default_rng(0)
    wide = rng.standard_normal((rows, cols + 4)).astype(dtype)
    x = {
        "c": np.ascontiguousarray(wide[:, :cols]),
        "padded": wide[:, :cols],
        "reversed": wide[::-1, :cols],
        "broadcast": np.broadcast_to(wide[0, :cols], (rows, cols)),
    }[layout]
    w = rng.standard_normal(cols).astype(dtype) if affine != "none" else None
    bias_dtype = "float32" if affine == "mixed" else dtype
    b = rng.standard_normal(cols).astype(bias_dtype) if affine in ("both", "mixed") else None
    plan = spec.plan("layer_norm", x, weight=w, bias=b, return_stats=True)
    y, mean, rstd = fake_cupy.layer_norm(
        HostArray(x),
        None if w is None else HostArray(w),
        None if b is None else HostArray(b),
        plan=dataclasses.replace(plan, family="cupy"),
        out=None,
    )
    want = reference.layer_norm(x, weight=w, bias=b, eps=1e-5)
    tol = 1e-3 if dtype == "float16" else 1e-5
    np.testing.assert_allclose(y.a, want[0], rtol=tol, atol=tol)
    np.testing.assert_allclose(mean.a, want[1][:, 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rstd.a, want[2][:, 0], rtol=1e-5)
    assert y.a.dtype == x.dtype and mean.a.dtype == rstd.a.dtype == plan.stats_dtype


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_the_launch_passes_the_weight_offset(fake_cupy: Any, op: str, dtype: str) -> None:
    """``plan.weight_offset`` reaches the kernels as their last argument, in the statistics
    dtype (the record declares ``"weight_offset"``: the core passes the weight as given)."""
    rows, cols = 5, 12
    rng = np.random.default_rng(4)
    x = rng.standard_normal((rows, cols)).astype(dtype)
    w = (0.1 * rng.standard_normal(cols)).astype(dtype)
    base = spec.plan(op, x, weight=w, eps=1e-5, return_stats=True)
    plan = dataclasses.replace(base, family="cupy", weight_offset=1.0)
    y = kernel_results(
        fake_cupy, op, {"x": HostArray(x), "weight": HostArray(w)}, plan=plan, out=None
    )["y"]
    formed = w.astype(plan.compute_dtype) + 1
    want = getattr(reference, op)(x, weight=formed, eps=1e-5)[0]
    tol = 1e-3 if dtype == "float16" else 1e-6
    np.testing.assert_allclose(y.a, want, rtol=tol, atol=tol)
    assert "weight_offset" in registry.get("cupy").capabilities


@pytest.mark.parametrize("layout", ["c", "reversed"])
@pytest.mark.parametrize(
    ("dtype", "weight"), [("float16", None), ("float16", "float32"), ("float64", "float64")]
)
def test_the_rms_launch_passes_what_the_kernel_reads(
    fake_cupy: Any, dtype: str, weight: str | None, layout: str
) -> None:
    rows, cols = 5, 12
    rng = np.random.default_rng(2)
    x = rng.standard_normal((rows, cols)).astype(dtype)
    x = x[::-1] if layout == "reversed" else x
    w = None if weight is None else rng.standard_normal(cols).astype(weight)
    plan = dataclasses.replace(spec.plan("rms_norm", x, weight=w, return_stats=True), family="cupy")
    y, rstd = fake_cupy.rms_norm(
        HostArray(x), None if w is None else HostArray(w), plan=plan, out=None
    )
    want_y, want_rstd = reference.rms_norm(x, weight=w)  # eps None: finfo(dtype).eps
    tol = 1e-3 if dtype == "float16" else 1e-12
    np.testing.assert_allclose(y.a, want_y, rtol=tol, atol=tol)
    np.testing.assert_allclose(rstd.a, want_rstd[:, 0], rtol=1e-6)
    assert y.a.dtype == x.dtype and rstd.a.dtype == plan.stats_dtype


def test_the_launch_writes_out_in_place(fake_cupy: Any) -> None:
    x = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    want = reference.layer_norm(x, eps=1e-5)[0]
    plan = dataclasses.replace(spec.plan("layer_norm", x, out=x), family="cupy")
    fake = HostArray(x)
    y, mean, rstd = fake_cupy.layer_norm(fake, None, None, plan=plan, out=fake)
    assert y is fake and mean is None and rstd is None
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("keep_h", [True, False], ids=["h", "post_norm"])
@pytest.mark.parametrize("layout", ["c", "reversed"])
@pytest.mark.parametrize(
    ("op", "dtype"), [(o, d) for o in FUSED_OPS for d in ("float16", "float32")]
)
def test_the_fused_launch_passes_what_the_kernel_reads(
    fake_cupy: Any, op: str, dtype: str, layout: str, keep_h: bool
) -> None:
    rows, cols = 5, 16
    rng = np.random.default_rng(3)
    x = rng.standard_normal((rows, cols)).astype(dtype)
    r = rng.standard_normal((rows, cols)).astype(dtype)
    x, r = (x[::-1], r[::-1]) if layout == "reversed" else (x, r)
    w = rng.standard_normal(cols).astype(np.float32)
    b = rng.standard_normal(cols).astype(np.float32) if op == "add_layer_norm" else None
    base = spec.plan(op.removeprefix("add_"), x, weight=w, bias=b, eps=1e-5, return_stats=True)
    plan = dataclasses.replace(base, op=op, family="cupy", return_residual=keep_h)
    arrays = {"x": HostArray(x), "residual": HostArray(r), "weight": HostArray(w)}
    if b is not None:
        arrays["bias"] = HostArray(b)
    got = kernel_results(fake_cupy, op, arrays, plan=plan, out=None, residual_out=None)
    y, h, mean, rstd = got["y"], got["h"], got["mean"], got["rstd"]
    h_want = x + r
    if op == "add_layer_norm":
        want_y, want_mean, want_rstd = reference.layer_norm(h_want, weight=w, bias=b, eps=1e-5)
        np.testing.assert_allclose(mean.a, want_mean[:, 0], rtol=1e-5, atol=1e-6)
    else:
        want_y, want_rstd = reference.rms_norm(h_want, weight=w, eps=1e-5)
        assert mean is None
    tol = 1e-3 if dtype == "float16" else 1e-5
    np.testing.assert_allclose(y.a, want_y, rtol=tol, atol=tol)
    np.testing.assert_allclose(rstd.a, want_rstd[:, 0], rtol=1e-5)
    if keep_h:
        np.testing.assert_array_equal(h.a, h_want)
    else:
        assert h is None


def test_the_fused_launch_writes_in_place(fake_cupy: Any) -> None:
    """The serving form: out is x, residual_out is the residual."""
    rng = np.random.default_rng(4)
    x, r = rng.standard_normal((4, 32)).astype(np.float32), rng.standard_normal((4, 32))
    r = r.astype(np.float32)
    h_want = x + r
    want = reference.layer_norm(h_want, eps=1e-5)[0]
    base = spec.plan("layer_norm", x, out=x)
    plan = dataclasses.replace(base, op="add_layer_norm", family="cupy", return_residual=True)
    fx, fr = HostArray(x), HostArray(r)
    y, h, mean, rstd = fake_cupy.add_layer_norm(
        fx, fr, None, None, plan=plan, out=fx, residual_out=fr
    )
    assert y is fx and h is fr and mean is None and rstd is None
    np.testing.assert_array_equal(r, h_want)
    np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------
# Without a CUDA device


def _device_problem_or_skip() -> str:
    pytest.importorskip("cupy")
    from normlab.backends.cupy_backend import device_problem

    problem = device_problem()
    if problem is None:
        pytest.skip("a CUDA device is usable here; benchmarks/gpu_check.sh tests the kernels")
    return problem


def test_device_problem_says_there_is_no_cuda_device() -> None:
    assert _device_problem_or_skip().startswith("no CUDA device")


def test_the_cupy_backend_is_unavailable_with_that_reason() -> None:
    problem = _device_problem_or_skip()
    backend = registry.get("cupy")
    assert not backend.available
    assert backend.reason == problem
