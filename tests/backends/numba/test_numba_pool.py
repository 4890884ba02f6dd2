"""Numba's threads (:mod:`normlab.backends.numba_pool`): results that do not depend on the thread
count or on the serial/parallel split, short rows and long, and the pool itself (one parallel
call at a time, none in a forked child, the threading layer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

numba = pytest.importorskip("numba")

import normlab  # noqa: E402
from normlab.backends import numba_backend, numba_pool  # noqa: E402
from tests.support.numba_direct import long_cols, numba_call, randn  # noqa: E402


@pytest.fixture
def threads() -> Iterator[Callable[[int], None]]:
    """``threads(n)`` sets numba's thread count for this test only."""
    before = numba.get_num_threads()
    yield numba.set_num_threads
    numba.set_num_threads(before)


# --------------------------------------------------------------------------------------------
# Rows are independent: of each other, of the thread count, of the serial/parallel split


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_row_alone_equals_row_in_batch(dtype: str) -> None:
    rows, cols = 200, 700  # above the serial limit: the batch runs in parallel
    assert rows * cols >= numba_pool.SERIAL_ELEMENTS
    x = randn((rows, cols), dtype, loc=1.0)
    weight, bias = randn((cols,), dtype, seed=1), randn((cols,), dtype, seed=2)
    y, mean, rstd = numba_call(x, weight, bias)
    for i in (0, 1, 99, 137, 199):
        y1, mean1, rstd1 = numba_call(x[i : i + 1], weight, bias)
        assert y1.tobytes() == y[i : i + 1].tobytes()
        assert mean1[0] == mean[i] and rstd1[0] == rstd[i]


def test_thread_count_does_not_change_results(threads: Callable[[int], None]) -> None:
    x = randn((300, 513), "float32", loc=-5.0)
    results = []
    for n in range(1, numba.config.NUMBA_NUM_THREADS + 1):
        threads(n)
        results.append(numba_call(x))
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
    assert 42 * 768 < numba_pool.SERIAL_ELEMENTS <= 43 * 768
    x = randn((rows, 768), "float32", loc=0.5)
    w = randn((768,), "float32", seed=1)
    dy = randn((rows, 768), "float32", seed=2)
    backward = getattr(normlab, f"{op}_backward")
    runs = []
    for n in (1, 2, 1, 2):
        threads(min(n, numba.config.NUMBA_NUM_THREADS))
        y, *stats = getattr(normlab, op)(x, weight=w, backend="numba", return_stats=True)
        grads = backward(dy, x, *stats, w, backend="numba")
        runs.append([a.tobytes() for a in (y, *stats, *grads) if a is not None])
    assert all(run == runs[0] for run in runs[1:])


# --------------------------------------------------------------------------------------------
# Long rows: segments shared out between threads


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape", [(1, 1 << 20), (3, 3 << 16)], ids=["1-row", "3-rows"])
def test_long_rows_do_not_depend_on_the_thread_count(
    threads: Callable[[int], None], shape: tuple[int, int], op: str
) -> None:
    """One thread (the serial driver) and two (segments shared out) give the same bits; and a
    row alone gives the bits it gets in the batch."""
    x = randn(shape, "float32", seed=7, loc=-30.0)
    results = []
    for n in (1, 2):
        threads(n)
        results.append(numba_call(x, op=op))
    (y1, _, r1), (y2, _, r2) = results
    assert y1.tobytes() == y2.tobytes() and r1.tobytes() == r2.tobytes()
    alone = numba_call(x[-1:], op=op)
    assert alone[0].tobytes() == y2[-1:].tobytes() and alone[2][0] == r2[-1]


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_long_rows_without_weight_or_bias_equal_ones_and_zeros(
    threads: Callable[[int], None], op: str
) -> None:
    """Without weight and bias, long rows reuse one segment of ones and zeros for every segment:
    the same bits as row-long ones and zeros, on one thread or two."""
    cols = long_cols()
    x = randn((2, cols), "float32", seed=9, loc=2.0)
    ones, zeros = np.ones(cols, np.float32), np.zeros(cols, np.float32)
    for n in (1, 2):
        threads(n)
        given = numba_call(x, ones, zeros if op == "layer_norm" else None, op=op)
        absent = numba_call(x, op=op)
        assert (
            absent[0].tobytes() == given[0].tobytes() and absent[2].tobytes() == given[2].tobytes()
        )


# --------------------------------------------------------------------------------------------
# The pool: one parallel call at a time, none in a forked child


def test_a_second_caller_runs_serially_while_the_pool_is_held() -> None:
    pool = numba_pool.Pool()
    if numba.get_num_threads() < 2:
        pytest.skip("one numba thread: every call is serial")
    assert pool.acquire(numba_pool.SERIAL_ELEMENTS - 1) == 1
    held = pool.acquire(numba_pool.SERIAL_ELEMENTS)
    assert held == numba.get_num_threads()
    assert pool.acquire(1 << 30) == 1  # taken: serial kernels
    pool.release(held)
    again = pool.acquire(1 << 30)
    assert again > 1
    pool.release(again)


def test_a_forked_child_of_a_parallel_parent_stays_serial() -> None:
    pool = numba_pool.Pool()
    pool.after_fork_in_child()  # the parent never went parallel: the child may
    held = pool.acquire(1 << 30)
    assert held == numba.get_num_threads()
    pool.release(held)
    pool.after_fork_in_child()  # now it had
    assert pool.acquire(1 << 30) == 1


def test_threading_layer_after_a_parallel_call() -> None:
    layer = numba_backend.threading_layer(start=True)
    assert layer in ("omp", "tbb", "workqueue") or numba.get_num_threads() == 1
