"""Long single rows: accuracy independent of the row's length (column segments merged with
Chan's formula) and peak memory of the output plus O(block), for the numpy and numba backends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import normlab

SLOW = pytest.mark.skipif(
    os.environ.get("NORMLAB_SLOW_TESTS", "") in ("", "0"),
    reason="2^31 elements (4 GiB): set NORMLAB_SLOW_TESTS=1",
)


def _exact_stats(row: np.ndarray) -> tuple[float, float]:
    """The float64 (mean, rstd at eps=1e-5) of a long row, a chunk at a time."""
    chunk = 1 << 20
    mean = sum(
        float(np.sum(row[i : i + chunk], dtype=np.float64)) for i in range(0, row.size, chunk)
    )
    mean /= row.size
    m2 = 0.0
    for i in range(0, row.size, chunk):
        d = row[i : i + chunk].astype(np.float64) - mean
        m2 += float(d @ d)
    return mean, 1.0 / np.sqrt(m2 / row.size + 1e-5)


def _check_long_row(n: int, backend: str) -> None:
    rng = np.random.default_rng(3)
    x = (3.0 + rng.standard_normal((1, n), dtype=np.float32)).astype(np.float16)
    y, mean, rstd = normlab.layer_norm(x, backend=backend, return_stats=True)
    want_mean, want_rstd = _exact_stats(x[0])
    assert abs(float(mean[0, 0]) - want_mean) < 1e-6 * abs(want_mean)
    assert abs(float(rstd[0, 0]) / want_rstd - 1) < 1e-6
    head = (x[0, :4096].astype(np.float64) - want_mean) * want_rstd
    np.testing.assert_allclose(y[0, :4096].astype(np.float64), head, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_a_long_float16_row_is_accurate(backend: str) -> None:
    if backend == "numba":
        pytest.importorskip("numba")
    _check_long_row(1 << 24, backend)


@SLOW
@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_a_float16_row_of_two_to_the_31_elements_is_accurate(backend: str) -> None:
    if backend == "numba":
        pytest.importorskip("numba")
    _check_long_row(1 << 31, backend)


PEAK = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import normlab

    def rss(field):
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith(field))
        return int(line.split()[1]) * 1024

    backend, n = sys.argv[1], int(sys.argv[2])
    normlab.layer_norm(np.ones((1, 1 << 19), np.float16), backend=backend)  # code loaded
    x = np.random.default_rng(0).standard_normal((1, n), dtype=np.float32).astype(np.float16)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak RSS (VmHWM) starts again from the RSS of now
    before = rss("VmRSS:")
    y = normlab.layer_norm(x, backend=backend)
    print(json.dumps({"growth": rss("VmHWM:") - before, "y": y.nbytes}))
    """
)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_peak_memory_of_a_long_row_is_the_output_plus_a_block(backend: str) -> None:
    """Measured in a subprocess (peak RSS): a 2^25-element float16 row (64 MiB) must not need
    more than its 64 MiB result and a few MiB of scratch (it took 5x the input before)."""
    if backend == "numba":
        pytest.importorskip("numba")
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("the peak RSS is reset through Linux's /proc/self/clear_refs")
    result = subprocess.run(
        [sys.executable, "-c", PEAK, backend, str(1 << 25)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    # the lower bound: the measurement saw the result being written (it is not vacuous)
    assert report["y"] // 2 <= report["growth"] <= report["y"] + (16 << 20), report


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_a_long_constant_row_near_float64_s_max_gives_bias(backend: str) -> None:
    """float64 rows of 300,000 copies of 1e308 (segments merged): exactly bias (the numpy
    backend gave NaN: its first segment's merge took inf * 0)."""
    if backend == "numba" and not normlab.registry.get("numba").available:
        pytest.skip("numba is not installed")
    bias = np.arange(300_000.0)
    y = normlab.layer_norm(np.full((2, 300_000), 1e308), bias=bias, backend=backend)
    assert np.array_equal(y, np.broadcast_to(bias, y.shape))
