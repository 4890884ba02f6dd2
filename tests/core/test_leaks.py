"""No leaks: ten thousand calls do not grow memory, no cache keeps a caller's array alive, and
every cache normlab fills while serving calls is bounded.

Memory is measured twice: with tracemalloc (Python objects and NumPy buffers, which NumPy
reports to tracemalloc) and as the resident set size (torch's and Numba's own allocations),
after a warm-up that compiles every kernel and fills every cache once.
"""

from __future__ import annotations

import contextlib
import gc
import tracemalloc
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import numpy as np
import pytest

import normlab
from normlab import dispatch, registry, spec
from tests.support import plugins_for_tests

numba = pytest.importorskip("numba")
torch = pytest.importorskip("torch")

CALLS: Final = 10_000
RNG = np.random.default_rng(5)
X32 = RNG.standard_normal((64, 96)).astype(np.float32)
LARGE = RNG.standard_normal((160, 256)).astype(np.float32)  # numba's parallel kernels
X16 = RNG.standard_normal((4, 8, 32)).astype(np.float16)
W32, B32 = RNG.standard_normal(96).astype(np.float32), RNG.standard_normal(96).astype(np.float32)
TENSOR = torch.from_numpy(RNG.standard_normal((32, 48)).astype(np.float32))
OUT = np.empty_like(X32)


def _bad_call() -> None:
    try:
        normlab.layer_norm(X32, weight=W32[:5])
    except normlab.ShapeError:
        return
    raise AssertionError("the bad call was accepted")


def _backward() -> None:
    _, mean, rstd = normlab.layer_norm(X32, return_stats=True)
    normlab.layer_norm_backward(X32, X32, mean, rstd, W32, backend="numpy")


#: Ten kinds of call, each made CALLS // 10 times.
MIX: Final[list[Callable[[], Any]]] = [
    lambda: normlab.layer_norm(X32, weight=W32, bias=B32, backend="numpy"),
    lambda: normlab.layer_norm(X32, weight=W32, bias=B32, backend="numba"),
    lambda: normlab.layer_norm(LARGE, backend="numba", return_stats=True),
    lambda: normlab.layer_norm(X16, axis=(0, 2)),
    lambda: normlab.rms_norm(X32, weight=W32),
    lambda: normlab.layer_norm(X32, out=OUT),
    lambda: normlab.layer_norm(TENSOR),
    lambda: normlab.layer_norm(TENSOR, backend="numba"),
    _bad_call,
    _backward,
]


def resident_bytes() -> int | None:
    """This process's resident set size (Linux), or None."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return None
    import resource

    return pages * resource.getpagesize()


def run_mix(rounds: int) -> None:
    for _ in range(rounds):
        for call in MIX:
            call()


def test_ten_thousand_calls_do_not_grow_memory() -> None:
    run_mix(20)  # compile every kernel, fill every cache
    gc.collect()
    rss_before = resident_bytes()
    tracemalloc.start()
    try:
        run_mix(1)
        traced_before = tracemalloc.get_traced_memory()[0]
        run_mix(CALLS // len(MIX))
        gc.collect()
        traced_growth = tracemalloc.get_traced_memory()[0] - traced_before
    finally:
        tracemalloc.stop()
    assert traced_growth < 64 * 1024, f"{traced_growth} bytes traced after {CALLS} calls"
    rss_after = resident_bytes()
    if rss_before is not None and rss_after is not None:
        assert rss_after - rss_before < 32 * 2**20, f"RSS grew {rss_after - rss_before} bytes"


def _alive_after(call: Callable[..., Any], make: Callable[[], list[Any]]) -> list[int]:
    """Indices of the arrays ``make()`` returns still alive after ``call(*arrays)`` (successful
    or refused) once the caller has dropped them."""
    arrays = make()
    refs = [weakref.ref(a) for a in arrays]
    with contextlib.suppress(normlab.NormlabError):
        call(*arrays)
    del arrays
    gc.collect()
    return [i for i, r in enumerate(refs) if r() is not None]


@pytest.mark.parametrize("backend", ["numpy", "numba", "torch"])
def test_no_cache_keeps_a_callers_arrays_alive(backend: str) -> None:
    def arrays() -> list[Any]:
        made = [RNG.standard_normal(s).astype(np.float32) for s in ((8, 16), (16,), (16,), (8, 16))]
        return [torch.from_numpy(a) for a in made] if backend == "torch" else made

    def good(x: Any, w: Any, b: Any, out: Any) -> Any:
        use_out = out if backend != "torch" else None
        return normlab.layer_norm(
            x, weight=w, bias=b, out=use_out, backend=backend, return_stats=True
        )

    def bad(x: Any, w: Any, b: Any, out: Any) -> Any:
        return normlab.layer_norm(x, weight=w[:3], bias=b, out=out, backend=backend)

    assert _alive_after(good, arrays) == []
    assert _alive_after(bad, arrays) == []


def test_plan_cache_is_bounded() -> None:
    """One cache holds the plans of every op (forward and backward); it never grows past its
    bound."""
    spec.clear_cache()
    for rows in range(1, spec._CACHE_SIZE + 200):
        x = np.ones((rows, 2), np.float32)
        normlab.layer_norm(x, backend="numpy")
        stats = np.ones((rows, 1), np.float32)
        normlab.layer_norm_backward(x, x, stats, stats, backend="numpy")
        assert len(spec._cache) <= spec._CACHE_SIZE


def test_numba_compiles_per_kind_of_array_not_per_shape() -> None:
    """New shapes and strides of arrays of a kind already seen compile nothing."""
    from normlab.backends import numba_forward, numba_kernel_types

    def kinds(shift: int) -> None:
        for dtype in (np.float16, np.float32, np.float64):
            for rows, cols in ((3 + shift, 7 + shift), (200 + shift, 300 + shift)):
                x = RNG.standard_normal((rows, 2 * cols)).astype(dtype)
                normlab.layer_norm(x[:, :cols], backend="numba")  # strided rows
                normlab.layer_norm(x[:, ::2], backend="numba", return_stats=True)  # strided
                normlab.layer_norm(np.ascontiguousarray(x[:, :cols]), backend="numba")
                normlab.layer_norm(x[:, :cols], out=np.empty((rows, cols), dtype), backend="numba")

    def compiled() -> int:
        kernels = (numba_forward.layer_norm_rows, numba_forward.layer_norm_rows_parallel)
        return sum(len(k.signatures) for k in kernels)

    kinds(0)
    before = compiled()
    for shift in range(1, 6):
        kinds(shift)
    assert compiled() == before
    for cols in range(1, 300):  # the cached ones and zeros of calls without weight or bias
        normlab.layer_norm(np.ones((1, cols), np.float32), backend="numba")
    assert (
        numba_kernel_types.constant.cache_info().currsize
        <= numba_kernel_types.constant.cache_info().maxsize
    )


def test_cached_choices_stay_bounded_as_plugins_come_and_go() -> None:
    """A server that registers and unregisters a plugin now and then: each registration makes
    the cached choices stale, and stale ones must be dropped, not kept beside the new ones."""
    x = np.ones((2, 3), np.float32)
    for i in range(300):
        plugin = plugins_for_tests.plugin(plugins_for_tests.record(f"transient_{i}"))
        normlab.register_plugin(plugin)
        normlab.layer_norm(x)
        normlab.layer_norm(x.astype(np.float64))
        normlab.unregister_plugin(plugin)
    assert len(dispatch._choices) <= 64, f"{len(dispatch._choices)} cached choices"
    assert "transient_0" not in {b.name for b in registry.list_backends()}
