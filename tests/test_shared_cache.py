"""Processes that share one kernel cache directory (serving workers, ranks, test workers)
neither lose nor mix up each other's entries."""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

numba_cache = pytest.importorskip("normlab.backends.numba_cache", exc_type=ImportError)

WORKERS = 4
ENTRIES = 50


def _save_entries(cache_path: str, worker: int, start_at: float) -> None:
    """Save ENTRIES entries of this worker into one kernel's files, starting at ``start_at``
    (every worker at the same moment)."""
    files = numba_cache._EntryFiles(cache_path, "kernel", "stamp")
    while time.time() < start_at:
        pass
    for i in range(ENTRIES):
        files.save(("signature", worker, i), ("code", worker, i))


def test_processes_saving_at_once_keep_every_entry_with_its_own_code(tmp_path: Path) -> None:
    """Numba's own files, saved this way, lose entries and give some signature the code saved
    for another (both fail this test); normlab's keep all, each with its own data."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(WORKERS, mp_context=spawn) as pool:
        pool.submit(time.sleep, 0).result()  # the pool is up before the clock starts
        start_at = time.time() + 3.0
        jobs = [pool.submit(_save_entries, str(tmp_path), w, start_at) for w in range(WORKERS)]
        for job in jobs:
            job.result()
    files = numba_cache._EntryFiles(str(tmp_path), "kernel", "stamp")
    missing, wrong = [], []
    for worker in range(WORKERS):
        for i in range(ENTRIES):
            code = files.load(("signature", worker, i))
            if code is None:
                missing.append((worker, i))
            elif code != ("code", worker, i):
                wrong.append(((worker, i), code))
    assert not wrong, f"entries loaded with another entry's code: {wrong[:5]}"
    assert not missing, f"{len(missing)} of {WORKERS * ENTRIES} entries lost: {missing[:5]}"


def test_normlab_kernels_save_through_the_shared_cache_files() -> None:
    from normlab.backends import numba_backend, numba_forward  # the backend adopts the kernels

    assert numba_backend.numba_cache is numba_cache
    cache = numba_forward.layer_norm_rows._cache
    if isinstance(cache, numba_cache.caching.NullCache):
        pytest.skip("no usable cache directory here: nothing is saved")
    assert isinstance(cache._cache_file, numba_cache._EntryFiles)
