"""The Numba backend beside its peers, float32, one pytest-benchmark group per shape.

Each group times, on the same input: the numba backend's ``layer_norm`` called directly
(allocating its result, and writing into an existing ``out``), ``torch.nn.functional.layer_norm``
on all cores, ``x.copy()`` (allocate + copy: the floor of an allocating call) and
``np.copyto(existing, x)`` (the floor of a call with ``out=``). Each contender gets an untimed
warm-up call (JIT compilation excluded). ``extra_info`` holds the GB/s (bytes of x + y over the
median time). Run with::

    python -m pytest benchmarks/bench_numba.py --benchmark-only -q

Targets on a 2-core machine (see docs/numba.md): allocating ≥ 1.5x torch and faster than
``x.copy()``; with ``out=`` ≥ 0.65 of ``np.copyto``'s throughput; 32x768 ≥ 0.9x torch. The
long-row shapes (1x2^24, 16x2^20) read x twice from memory (statistics, then y), so with
``out=`` they stay below the copy; ``-k "1x16777216 or 16x1048576"`` runs them alone.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Final

import numpy as np
import pytest

pytest.importorskip("numba")

from normlab import spec
from normlab.backends import numba_backend

#: Short rows of three widths, a tiny input, and long rows (segmented one-pass form): one row
#: shared out between the threads, and more rows than threads.
SHAPES: Final = (
    (8192, 1024),
    (4096, 4096),
    (65536, 768),
    (32, 768),
    (1, 1 << 24),
    (16, 1 << 20),
)
CONTENDERS: Final = ("numba", "numba_out", "torch", "copy", "copyto")
#: Timed rounds per case, and calls per round (tiny inputs repeat within a round).
ROUNDS: Final = 25
SMALL_ELEMENTS: Final = 1 << 16
SMALL_ITERATIONS: Final = 200
SMALL_ROUNDS: Final = 100

_inputs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _input(shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x, weight and bias of ``shape`` (float32), made once per shape."""
    if shape not in _inputs:
        _inputs.clear()  # one large input at a time
        rng = np.random.default_rng(0)
        x = rng.standard_normal(shape, dtype=np.float32)
        weight = rng.standard_normal(shape[1], dtype=np.float32)
        bias = rng.standard_normal(shape[1], dtype=np.float32)
        _inputs[shape] = (x, weight, bias)
    return _inputs[shape]


def _call(contender: str, x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> Callable[[], Any]:
    """A no-argument callable running ``contender`` on the input."""
    if contender == "numba":
        plan = spec.plan("layer_norm", x, weight=weight, bias=bias)
        return lambda: numba_backend.layer_norm(x, weight, bias, plan=plan, out=None)
    if contender == "numba_out":
        out = np.zeros_like(x)
        plan = spec.plan("layer_norm", x, weight=weight, bias=bias, out=out)
        return lambda: numba_backend.layer_norm(x, weight, bias, plan=plan, out=out)
    if contender == "torch":
        torch = pytest.importorskip("torch")
        torch.set_num_threads(os.cpu_count() or 1)
        xt, wt, bt = torch.from_numpy(x), torch.from_numpy(weight), torch.from_numpy(bias)
        cols = (x.shape[1],)
        return lambda: torch.nn.functional.layer_norm(xt, cols, wt, bt, 1e-5)
    if contender == "copy":
        return x.copy
    existing = np.zeros_like(x)
    return lambda: np.copyto(existing, x)


@pytest.mark.parametrize("contender", CONTENDERS)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_float32(benchmark: Any, shape: tuple[int, int], contender: str) -> None:
    x, weight, bias = _input(shape)
    benchmark.group = f"float32 {shape[0]}x{shape[1]}"
    call = _call(contender, x, weight, bias)
    call()  # warm-up: JIT compilation (or the cache load) and first-touch page faults
    small = x.size < SMALL_ELEMENTS
    benchmark.pedantic(
        call,
        rounds=SMALL_ROUNDS if small else ROUNDS,
        iterations=SMALL_ITERATIONS if small else 1,
        warmup_rounds=1,
    )
    stats = getattr(benchmark.stats, "stats", None)
    if stats is not None:
        benchmark.extra_info["GB/s"] = round(2 * x.nbytes / stats.median / 1e9, 2)
