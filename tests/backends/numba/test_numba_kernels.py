"""The Numba kernels themselves: the half conversions on every bit pattern, and how the kernels
are built (NaN semantics, the on-disk cache, no number of another module frozen in).
"""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from normlab.backends import half_bits, numba_backward, numba_forward  # noqa: E402
from tests.support.numba_direct import dtype_of  # noqa: E402

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
    want = ALL_BITS.view(dtype_of(dtype)).astype(np.float32)
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
        want = probes.astype(dtype_of(dtype)).view(np.uint16)
    assert np.array_equal(got, want)


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
