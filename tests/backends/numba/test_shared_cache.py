"""Processes that share one kernel cache directory (serving workers, ranks, test workers)
neither lose nor mix up each other's entries."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
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


#: A process that waits for the moment in argv, then makes a float64 call whose rows go to the
#: parallel driver (which calls the serial kernel), and prints how many of the two kernels'
#: signatures it compiled rather than loaded.
COMPILING_CHILD = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    import normlab
    from normlab.backends import numba_forward

    while time.time() < float(sys.argv[1]):
        time.sleep(0.001)
    normlab.layer_norm(np.ones((64, 1024)), backend="numba")
    kernels = (numba_forward.layer_norm_rows, numba_forward.layer_norm_rows_parallel)
    print(json.dumps({
        "compiled": sum(sum(k.stats.cache_misses.values()) for k in kernels),
        "loaded": sum(sum(k.stats.cache_hits.values()) for k in kernels),
    }))
    """
)


def test_processes_compiling_at_once_take_turns(tmp_path: Path) -> None:
    """Two processes that need the same two kernels at the same moment in a fresh cache: each
    kernel is compiled by one of them and loaded by the other (numba alone compiles both in
    both, and the cache's callers and callees then come from different processes: see
    numba_cache._CompileLock)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "NUMBA_NUM_THREADS": "2"}
    start_at = time.time() + 8.0  # after both have imported normlab and numba
    children = [
        subprocess.Popen(
            [sys.executable, "-c", COMPILING_CHILD, str(start_at)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    reports = []
    for child in children:
        out, err = child.communicate(timeout=600)
        assert child.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert time.time() > start_at
    # each kernel compiled once, by either process, and loaded by the other
    assert sum(r["compiled"] for r in reports) == 2, reports
    assert sum(r["loaded"] for r in reports) == 2, reports


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_child_forked_while_the_compile_lock_is_held_does_not_keep_it(tmp_path: Path) -> None:
    """A DataLoader worker forked while another thread compiles must not hold the parent's
    lock after the parent lets it go (else the parent's next compile waits for the child)."""
    fcntl = pytest.importorskip("fcntl")
    started, child_started = os.pipe()
    with numba_cache._compile_lock.held(tmp_path):
        pid = os.fork()
        if pid == 0:  # the child: alive, holding whatever it inherited, until killed
            os.write(child_started, b"!")  # after the at-fork handlers
            time.sleep(60)
            os._exit(0)
    assert os.read(started, 1) == b"!"
    fd = os.open(tmp_path / "compile.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError if still held
    finally:
        os.close(fd)
        os.close(started)
        os.close(child_started)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@pytest.mark.parametrize("damaged", ["nbi", "nbc"])
def test_a_damaged_cache_file_is_compiled_again_and_replaced(tmp_path: Path, damaged: str) -> None:
    """A truncated index (.nbi) or data file (.nbc) of a kernel: the next process says so once
    and compiles the kernel again, replacing the file, and the one after loads it silently
    (before: an UnpicklingError in every call, in every process, until the cache was deleted)."""
    code = textwrap.dedent(
        """
        import numpy as np, normlab
        y = normlab.layer_norm(np.ones((2, 8), np.float32), backend="numba")
        print(float(y.sum()))
        """
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop("NORMLAB_QUIET", None)

    def call() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
        )

    assert call().returncode == 0
    files = list(tmp_path.glob(f"*/numba_forward.layer_norm_rows-*.{damaged}"))
    assert files
    for f in files:
        f.write_bytes(f.read_bytes()[:20])
    again = call()
    assert again.returncode == 0, again.stderr
    assert "Traceback" not in again.stderr
    if damaged == "nbi":
        assert "is damaged" in again.stderr
    last = call()
    assert last.returncode == 0 and "is damaged" not in last.stderr, last.stderr
