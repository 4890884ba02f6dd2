"""The float16 and bfloat16 conversions on both paths: CPU instructions and bit patterns.

Every 16-bit pattern of both types is widened to float32 and narrowed back, and float32 values
around every half value (exact ties, one unit either side, overflow and subnormal ranges) are
narrowed, each compared with NumPy's and ml_dtypes' casts (round to nearest, ties to even):
equal bit for bit for every non-NaN value, subnormals included; a NaN stays a NaN of its sign
(its payload may change on the instruction path, docs/contract.md). The path is chosen at import
from the CPU Numba compiles for, so each CPU is emulated in a subprocess with
``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` (a few seconds each: Numba's import and small
compiles).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("numba")
ml_dtypes = pytest.importorskip("ml_dtypes")

from normlab.backends import half_hw  # noqa: E402

ALL_BITS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
#: The emulated CPUs are x86-64 models.
x86_only = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="emulates x86-64 CPU models"
)

#: Runs in a subprocess on the emulated CPU: the conversions the kernels use (half_convert's),
#: on every pattern and on the probes, saved for the parent to check.
CONVERT = textwrap.dedent(
    """
    import sys
    import numba
    import numpy as np
    from normlab.backends import half_convert as hc

    @numba.njit
    def widen16(bits, out):
        for i in range(bits.shape[0]):
            out[i] = hc.float16_to_float32(bits[i])

    @numba.njit
    def narrow16(values, out):
        for i in range(values.shape[0]):
            out[i] = hc.float32_to_float16(values[i])

    @numba.njit
    def widen_b16(bits, out):
        for i in range(bits.shape[0]):
            out[i] = hc.bfloat16_to_float32(bits[i])

    @numba.njit
    def narrow_b16(values, out):
        for i in range(values.shape[0]):
            out[i] = hc.float32_to_bfloat16(values[i])

    data = np.load(sys.argv[1])
    results = {"hardware": np.array(hc.FLOAT16_IN_HARDWARE)}
    paths = (("float16", widen16, narrow16), ("bfloat16", widen_b16, narrow_b16))
    for name, widen, narrow in paths:
        wide = np.empty(data["bits"].size, np.float32)
        widen(data["bits"].view(np.int16) if name == "float16" else data["bits"], wide)
        back = np.empty(wide.size, np.uint16)
        narrow(wide, back)
        narrowed = np.empty(data[name + "_probes"].size, np.uint16)
        narrow(data[name + "_probes"], narrowed)
        results[name + "_wide"], results[name + "_back"] = wide, back
        results[name + "_narrowed"] = narrowed

    # A float16 LayerNorm forward and backward through the kernels (small: the serial ones), on
    # the CPUs that test_kernels_agree_on_both_paths compares.
    if sys.argv[3] == "no-kernels":
        np.savez(sys.argv[2], **results)
        sys.exit()
    import normlab

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4, 777)) * 3).astype(np.float16)
    x[0, :8] = [6e-8, -6e-8, 1e-5, 3e-5, 2.0**-14, 1.0, 0.0, -0.0]  # subnormals, tiny normals
    x[1, :4] = [65504.0, -65504.0, 60000.0, 1e4]
    weight = rng.standard_normal(777).astype(np.float32)
    bias = rng.standard_normal(777).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float16)
    y, mean, rstd = normlab.layer_norm(
        x, None, weight, bias, 1e-5, backend="numba", return_stats=True
    )
    dx, dweight, dbias = normlab.layer_norm_backward(dy, x, mean, rstd, weight, backend="numba")
    results.update(y=y, mean=mean, rstd=rstd, dx=dx, dweight=dweight, dbias=dbias)
    np.savez(sys.argv[2], **results)
    """
)

#: (NUMBA_CPU_NAME, NUMBA_CPU_FEATURES, whether float16 must take the instruction path).
CPUS = [
    pytest.param("haswell", "+f16c", True, id="haswell-f16c"),
    pytest.param("haswell", "-f16c", False, id="haswell-without-f16c"),
    pytest.param("generic", "", False, id="generic"),  # no kernels: conversions only
]


def _dtype(name: str) -> np.dtype[Any]:
    return np.dtype(np.float16) if name == "float16" else np.dtype(ml_dtypes.bfloat16)


def _probes(name: str) -> np.ndarray:
    """float32 values around every finite value of the half type ``name``: each value, the
    midpoints to its neighbours (exact ties), one float32 unit either side of each, and a few
    float32 values below and beyond the type's range."""
    dtype = _dtype(name)
    values = ALL_BITS.view(dtype).astype(np.float32)
    finite = np.sort(values[np.isfinite(values)].astype(np.float64))
    finite = np.unique(finite)
    mid = ((finite[:-1] + finite[1:]) / 2).astype(np.float32)  # exact: one bit more
    inf = np.float32(np.inf)
    probes = [finite.astype(np.float32), mid, np.nextafter(mid, inf), np.nextafter(mid, -inf)]
    edges = np.array([1e-45, 1e-40, 1e-30, 3e-8, 6e-8, 65519.0, 65520.0, 1e5, 3.4e38], np.float32)
    probes += [edges, -edges]
    return np.concatenate(probes)


def _check_nan_aware(got: np.ndarray, want: np.ndarray, dtype: np.dtype[Any], what: str) -> None:
    """``got`` equals ``want`` (bit patterns of ``dtype``) where ``want`` is not a NaN; where it
    is, ``got`` is a NaN of the same sign."""
    got_values, want_values = got.view(dtype), want.view(dtype)
    nan = np.isnan(want_values.astype(np.float32))
    mismatch = np.flatnonzero((got != want) & ~nan)
    first = mismatch[:4]
    assert mismatch.size == 0, f"{what}: {mismatch.size} differ: {want[first]} -> {got[first]}"
    assert np.isnan(got_values[nan].astype(np.float32)).all(), f"{what}: a NaN became a number"
    sign = 1 << (got.dtype.itemsize * 8 - 1)
    assert np.array_equal(got[nan] & sign, want[nan] & sign), f"{what}: a NaN changed sign"


def _check(results: dict[str, np.ndarray], inputs: dict[str, np.ndarray]) -> None:
    for name in ("float16", "bfloat16"):
        dtype = _dtype(name)
        want_wide = ALL_BITS.view(dtype).astype(np.float32)
        _check_nan_aware(
            results[name + "_wide"].view(np.uint32),
            want_wide.view(np.uint32),
            np.dtype(np.float32),
            f"{name} -> float32",
        )
        _check_nan_aware(results[name + "_back"], ALL_BITS, dtype, f"{name} -> float32 -> {name}")
        with np.errstate(over="ignore"):  # the probes beyond the range become infinities
            want = inputs[name + "_probes"].astype(dtype).view(np.uint16)
        _check_nan_aware(results[name + "_narrowed"], want, dtype, f"float32 -> {name}")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    data = {"bits": ALL_BITS, **{f"{n}_probes": _probes(n) for n in ("float16", "bfloat16")}}
    path = tmp_path_factory.mktemp("half") / "inputs.npz"
    np.savez(path, **data)
    return path, data


_emulated: dict[tuple[str, str], dict[str, np.ndarray]] = {}


def _run_on(cpu: str, features: str, inputs: Path, tmp_path: Path) -> dict[str, np.ndarray]:
    """:data:`CONVERT`'s results on the emulated CPU (run once per CPU in this session)."""
    kernels = cpu == "haswell"  # the CPU of test_kernels_agree_on_both_paths
    if (cpu, features) in _emulated:
        return _emulated[cpu, features]
    out = tmp_path / "results.npz"
    env = {**os.environ, "NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": features}
    env.pop("NUMBA_DISABLE_JIT", None)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            CONVERT,
            str(inputs),
            str(out),
            "kernels" if kernels else "no-kernels",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(out) as saved:
        _emulated[cpu, features] = dict(saved)
    return _emulated[cpu, features]


@x86_only
@pytest.mark.parametrize(("cpu", "features", "hardware"), CPUS)
def test_every_pattern_on_an_emulated_cpu(
    cpu: str,
    features: str,
    hardware: bool,
    inputs: tuple[Path, dict[str, np.ndarray]],
    tmp_path: Path,
) -> None:
    """The path chosen for the CPU, and its results on every pattern and probe."""
    path, data = inputs
    results = _run_on(cpu, features, path, tmp_path)
    assert bool(results["hardware"]) is hardware
    _check(results, data)


@x86_only
def test_kernels_agree_on_both_paths(
    inputs: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    """A float16 LayerNorm (subnormal, tiny and huge values in x) on the same CPU with F16C and
    without it. The forward is bitwise the same: its sums run over the decoded float32 row, and
    y is written element by element. The backward's first sweep decodes and sums in one loop,
    which LLVM vectorises differently around a one-instruction conversion: its reassociated
    sums may differ in the last float32 bits (as between CPUs of different vector widths)."""
    with_f16c = _run_on("haswell", "+f16c", inputs[0], tmp_path)
    without = _run_on("haswell", "-f16c", inputs[0], tmp_path)
    assert bool(with_f16c["hardware"]) and not bool(without["hardware"])
    for name in ("y", "mean", "rstd"):
        assert with_f16c[name].tobytes() == without[name].tobytes(), name
    for name in ("dx", "dweight", "dbias"):
        got, want = with_f16c[name].astype(np.float64), without[name].astype(np.float64)
        ulps = 2.0**-10 if name == "dx" else 2.0**-21  # float16's and float32's, relative
        np.testing.assert_allclose(got, want, rtol=ulps, atol=ulps * np.abs(want).max())


@pytest.mark.parametrize(
    ("cpu", "features", "hardware"),
    [
        ("haswell", "", True),
        ("haswell", "-f16c", False),
        ("x86-64", "", False),
        ("x86-64", "+f16c", True),
        ("sapphirerapids", "", True),  # AVX-512 FP16: its own conversion instructions
    ],
)
@x86_only
def test_instruction_probe(cpu: str, features: str, hardware: bool) -> None:
    """LLVM's answer for a CPU: instructions where it has F16C or AVX-512 FP16, else none."""
    assert half_hw.converts_float16(cpu, features) is hardware


def test_host_path_matches_the_cpu_numba_compiles_for() -> None:
    """In this process the kernels use the path LLVM gives the host (or NUMBA_CPU_*)."""
    from normlab.backends import half_bits, half_convert

    hardware = half_hw.converts_float16(*half_hw.numba_target())
    assert half_convert.FLOAT16_IN_HARDWARE is hardware
    chosen = half_hw if hardware else half_bits
    assert half_convert.float16_to_float32 is chosen.float16_to_float32
    assert half_convert.float32_to_float16 is chosen.float32_to_float16
    assert half_convert.float32_to_bfloat16 is half_bits.float32_to_bfloat16


def test_kernel_cache_keyed_by_the_conversions_source(tmp_path: Path) -> None:
    """A cached kernel is found again only while the sources it calls are unchanged: Numba keys
    an entry by the kernel's own bytecode, so without the digest an entry compiled on the bit
    path would outlive a switch to CPU instructions (half_hw.py, half_convert.py)."""
    import shutil

    import numba

    from normlab.backends import numba_backend, numba_cache

    package = tmp_path / "normlab" / "backends"
    shutil.copytree(Path(numba_cache.__file__).parent, package)
    (tmp_path / "normlab" / "constants.py").write_text("ROW_CHUNK = 32\n")
    before = numba_cache.sources_digest(package)
    assert numba_cache.sources_digest(package) == before
    half = package / "half_hw.py"
    half.write_text(half.read_text() + "\n")
    assert numba_cache.sources_digest(package) != before

    kernel: Any = numba_backend.numba_forward.layer_norm_rows  # adopted by the backend
    codegen = numba.core.registry.cpu_target.target_context.codegen()
    key = kernel._cache._index_key((), codegen)
    assert key[-1] == numba_cache.backend_sources_digest()
