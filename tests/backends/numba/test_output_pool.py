"""The output pool (normlab/backends/output_pool.py): a large result's memory is reused only
after the caller has released the result and every view of it; results stay exact."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

import normlab
from normlab.backends import output_pool
from normlab.backends.output_pool import MIN_BYTES, OutputPool

pytest.importorskip("numba")

ROWS, COLS = 1024, 512  # 2 MiB of float32: above MIN_BYTES


@pytest.fixture
def pool() -> Iterator[OutputPool]:
    """The process's pool, emptied and with its default room, before and after the test."""
    saved = output_pool.POOL.capacity
    output_pool.POOL.clear()
    output_pool.POOL.capacity = 64 << 20
    yield output_pool.POOL
    output_pool.POOL.clear()
    output_pool.POOL.capacity = saved


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def test_a_released_result_is_reused_and_a_live_one_never(pool: OutputPool) -> None:
    x = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    first = normlab.layer_norm(x, backend="numba")
    address = _address(first)
    second = normlab.layer_norm(x, backend="numba")
    assert _address(second) != address  # first is alive: its memory is not handed out
    view = first[::2]
    del first
    gc.collect()
    third = normlab.layer_norm(x, backend="numba")
    assert _address(third) != address  # a view keeps it alive
    del view
    fourth = normlab.layer_norm(x, backend="numba")
    assert _address(fourth) == address  # released: reused
    np.testing.assert_array_equal(fourth, second)
    assert pool.held_bytes == 0


def test_reused_memory_holds_no_stale_values(pool: OutputPool) -> None:
    x = np.random.default_rng(1).standard_normal((ROWS, COLS)).astype(np.float32)
    weight = np.full(COLS, 0.5, np.float32)
    pool.capacity = 0
    fresh = normlab.layer_norm(x, weight=weight, backend="numba")
    pool.capacity = 64 << 20
    stale = normlab.layer_norm(x, backend="numba")
    stale[...] = np.nan
    address = _address(stale)
    del stale
    y = normlab.layer_norm(x, weight=weight, backend="numba")
    assert _address(y) == address
    np.testing.assert_array_equal(y, fresh)


def test_the_pool_holds_at_most_its_capacity(pool: OutputPool) -> None:
    pool.capacity = 3 * MIN_BYTES
    arrays = [pool.empty((MIN_BYTES // 4,), np.dtype(np.float32)) for _ in range(5)]
    del arrays
    assert pool.held_bytes == 3 * MIN_BYTES
    pool.capacity = 0
    plain = pool.empty((MIN_BYTES,), np.dtype(np.uint8))
    assert plain.base is None  # off: numpy.empty itself


def test_a_pool_full_of_other_sizes_makes_room_for_the_latest(pool: OutputPool) -> None:
    """A process that has moved on to a new shape still reuses its outputs: the buffers
    released longest ago are freed to make room (a full pool used to keep them for good)."""
    pool.capacity = 4 * MIN_BYTES
    f32 = np.dtype(np.float32)
    stale = [pool.empty((n * MIN_BYTES // 4,), f32) for n in (1, 2)]  # 1 and 2 MiB
    del stale
    assert pool.held_bytes == 3 * MIN_BYTES
    new = pool.empty((2 * MIN_BYTES // 4,), f32)  # takes the 2 MiB buffer: 1 MiB held
    bigger = pool.empty((3 * MIN_BYTES // 4,), f32)
    bigger_address = _address(bigger)
    del new, bigger  # 2 MiB then 3 MiB back: the 1 MiB, then the 2 MiB buffer make room
    assert pool.held_bytes == 3 * MIN_BYTES
    again = pool.empty((3 * MIN_BYTES // 4,), f32)
    assert _address(again) == bigger_address
    assert pool.held_bytes == 0
    other = pool.empty((2 * MIN_BYTES // 4,), f32)  # a new buffer: the old 2 MiB one is gone
    other_address = _address(other)
    too_big = pool.empty((5 * MIN_BYTES // 4,), f32)
    assert too_big.base is None  # larger than the pool: plain, never kept
    del again, other, too_big  # 3 MiB back, then 2 MiB, for which the 3 MiB buffer makes room
    assert pool.held_bytes == 2 * MIN_BYTES
    assert _address(pool.empty((2 * MIN_BYTES // 4,), f32)) == other_address


def test_the_latest_released_buffer_is_taken_first(pool: OutputPool) -> None:
    """Of two free buffers of one size the one released last (warmest in cache) is taken; a
    buffer given back after the pool shrank below its size is freed, not kept."""
    f32 = np.dtype(np.float32)
    first, second = (pool.empty((MIN_BYTES // 4,), f32) for _ in range(2))
    second_address = _address(second)
    del first, second  # second released last
    assert _address(pool.empty((MIN_BYTES // 4,), f32)) == second_address
    pool.clear()
    pool.capacity = MIN_BYTES
    pool.give_back(np.empty(2 * MIN_BYTES, np.uint8))  # as a lease of the larger pool would
    assert pool.held_bytes == 0


def test_small_outputs_are_plain_arrays(pool: OutputPool) -> None:
    small = pool.empty((MIN_BYTES // 8 - 1,), np.dtype(np.float64))
    assert small.base is None and small.flags.c_contiguous
    large = pool.empty((4, MIN_BYTES // 16), np.dtype(np.float32))
    assert large.shape == (4, MIN_BYTES // 16) and large.dtype == np.float32
    assert large.flags.c_contiguous and large.flags.writeable and large.flags.aligned


def test_backward_and_torch_results_return_their_memory(pool: OutputPool) -> None:
    torch = pytest.importorskip("torch")
    x = torch.randn(ROWS, COLS)
    # a first call may load (or compile) its kernel, whose frames can outlive the call until
    # a collection: the promise is for the calls after it
    normlab.layer_norm(x, backend="numba")
    gc.collect()
    pool.clear()
    y = normlab.layer_norm(x, backend="numba")
    address = y.data_ptr()
    del y
    assert pool.held_bytes == ROWS * COLS * 4
    y = normlab.layer_norm(x, backend="numba")
    assert y.data_ptr() == address
    xn = x.numpy()
    _, mean, rstd = normlab.layer_norm(xn, backend="numba", return_stats=True)
    dx, _, _ = normlab.layer_norm_backward(xn, xn, mean, rstd, backend="numba")
    assert dx.shape == xn.shape and np.isfinite(dx).all()


def test_a_bad_capacity_setting_warns_and_keeps_the_default() -> None:
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "try:\n"
        "    import normlab.backends.output_pool\n"
        "except Warning as w:\n"
        "    print('warned:', w)\n"
    )
    env = {"NORMLAB_OUTPUT_POOL_MIB": "lots", "PATH": ""}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert "NORMLAB_OUTPUT_POOL_MIB='lots'" in done.stdout
