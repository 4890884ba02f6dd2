"""Bitwise guarantees hold in a process that loads numba's kernels from the on-disk cache, not
only in the one that compiled them: a row's result does not depend on the other rows, and y, dx
and dweight do not depend on the thread count. And a value changed in normlab.constants takes
effect in a process that loads the kernels from a cache filled with the former value.

A first subprocess fills the cache (or finds it warm); a second loads the kernels from it and
checks, and asserts that the parallel drivers were indeed loaded from the cache (numba's
dispatcher statistics), so that the test cannot pass by compiling afresh. Without
:func:`normlab.backends.numba_pool.load_serial_first` the second process's parallel drivers
run their own copies of the serial kernels and rows differ by 1 ulp; so would small tensors'
rows, which the address entries (:mod:`normlab.backends.numba_addressed`) normalize."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("numba")

CHILD = textwrap.dedent(
    """
    import json
    import numba
    import numpy as np
    import normlab
    from normlab.backends import numba_backward, numba_forward

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 1024)).astype(np.float32)
    w = rng.standard_normal(1024).astype(np.float32)
    dy = rng.standard_normal((64, 1024)).astype(np.float32)
    r = rng.standard_normal((8, 1024)).astype(np.float32)

    # first of all, small tensors (the address entries): no NumPy call has loaded the kernels
    try:
        import torch
    except ImportError:
        tensor_y = tensor_fused = None
    else:
        tx, tw = torch.from_numpy(x[:8]), torch.from_numpy(w)
        tensor_y = normlab.layer_norm(tx, weight=tw, backend="numba")
        tensor_fused = normlab.add_layer_norm(tx, torch.from_numpy(r), weight=tw, backend="numba")

    def run(threads):
        numba.set_num_threads(threads)
        y, mean, rstd = normlab.layer_norm(x, weight=w, backend="numba", return_stats=True)
        dx, dw, _ = normlab.layer_norm_backward(dy, x, mean, rstd, w, backend="numba")
        return y, dx, dw

    y2, dx2, dw2 = run(2)
    y1, dx1, dw1 = run(1)
    alone = np.concatenate(
        [normlab.layer_norm(x[i : i + 1], weight=w, backend="numba") for i in range(64)]
    )
    long = rng.standard_normal((2, 300_000)).astype(np.float32)  # the segmented form
    numba.set_num_threads(2)
    long2 = normlab.layer_norm(long, backend="numba")
    numba.set_num_threads(1)
    long1 = normlab.layer_norm(long, backend="numba")
    tensors_differ = 0
    if tensor_y is not None:
        numpy_fused = normlab.add_layer_norm(x[:8], r, weight=w, backend="numba")
        tensors_differ = int((tensor_y.numpy() != alone[:8]).sum()) + sum(
            int((t.numpy() != a).sum()) for t, a in zip(tensor_fused, numpy_fused, strict=True)
        )
    drivers = (
        numba_forward.layer_norm_rows_parallel,
        numba_backward.backward_chunks_parallel,
        numba_forward.long_rows_parallel,
    )
    print(json.dumps({
        "tensors_differ": tensors_differ,
        "rows_differ": int((y2 != alone).any(axis=1).sum()),
        "y_threads_differ": int((y1 != y2).sum()),
        "dx_threads_differ": int((dx1 != dx2).sum()),
        "dweight_threads_differ": int((dw1 != dw2).sum()),
        "long_threads_differ": int((long1 != long2).sum()),
        "cache_hits": [sum(d.stats.cache_hits.values()) for d in drivers],
    }))
    """
)


def _child() -> dict[str, object]:
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    result = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


def test_bitwise_guarantees_hold_when_kernels_come_from_the_cache() -> None:
    first = _child()  # compiles and writes the cache, unless it is warm already
    second = _child()
    assert second["cache_hits"] == [1, 1, 1], second  # loaded from the cache, not compiled
    for report in (first, second):
        assert report["rows_differ"] == 0, report
        assert report["y_threads_differ"] == 0, report
        assert report["dx_threads_differ"] == 0, report
        assert report["dweight_threads_differ"] == 0, report
        assert report["long_threads_differ"] == 0, report
        assert report["tensors_differ"] == 0, report


#: A child that sets normlab.constants.ROW_CHUNK (argv) before any kernel loads, then runs a
#: backward call whose result shows the value: dbias of a column [1, e, e, ...] (e = 2^-24: each
#: chunk is summed in float32, where 1 + e rounds to 1, and the chunks in float64).
TABLE_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from normlab import constants
    constants.ROW_CHUNK = int(sys.argv[1])
    import normlab
    from normlab.backends import numba_backward

    rows, cols = 64, 8
    x = np.linspace(-1, 1, rows * cols, dtype=np.float32).reshape(rows, cols)
    mean = x.mean(axis=1, keepdims=True)
    rstd = (1 / np.sqrt(x.var(axis=1, keepdims=True) + 1e-5)).astype(np.float32)
    dy = np.full((rows, cols), 2.0**-24, np.float32)
    dy[0] = 1
    _, _, dbias = normlab.layer_norm_backward(
        dy, x, mean, rstd, backend="numba", needs=("bias",)
    )
    print(json.dumps({
        "dbias": float(dbias[0]),
        "cache_hits": sum(numba_backward.backward_chunks.stats.cache_hits.values()),
    }))
    """
)


def _dbias_model(chunk: int) -> float:
    """dbias of TABLE_CHILD's column: chunks of ``chunk`` rows summed in float32 in row order,
    the chunks added in float64, rounded once to float32."""
    column = [np.float32(1.0)] + [np.float32(2.0**-24)] * 63
    total = 0.0
    for start in range(0, 64, chunk):
        part = np.float32(0.0)
        for value in column[start : start + chunk]:
            part = np.float32(part + value)
        total += float(part)
    return float(np.float32(total))


def test_a_changed_constants_table_takes_effect_through_a_warm_cache(tmp_path: Path) -> None:
    """The kernels receive normlab.constants.ROW_CHUNK as an argument: numba would freeze a
    global into the kernel it caches (keyed on the kernel's own source file only), and a later
    process with another value would load the stale kernel."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "NUMBA_NUM_THREADS": "2"}

    def child(chunk: int) -> dict[str, object]:
        result = subprocess.run(
            [sys.executable, "-c", TABLE_CHILD, str(chunk)],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert result.returncode == 0, result.stderr
        report: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
        return report

    assert _dbias_model(32) != _dbias_model(4)
    assert child(32) == {"dbias": _dbias_model(32), "cache_hits": 0}  # fills the empty cache
    assert child(4) == {"dbias": _dbias_model(4), "cache_hits": 1}  # loads it
