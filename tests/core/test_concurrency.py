"""Concurrent callers: threads and asyncio tasks calling normlab at once.

Every caller runs a mix of calls (NumPy and torch arrays, small ones and ones large enough for
Numba's parallel kernels, ``rms_norm``, ``out=``, calls that must fail) inside nested
``use_backend()`` blocks of its own. Each result must be bitwise equal to the result the
expected backend gives when called alone (which also proves the right backend was chosen: the
backends differ in the last bits), each block must see its own preference and leave none behind,
and every caller must finish (a deadlock fails the join's timeout).

Numba runs parallel kernels on a *threading layer*; which one depends on what is installed (see
:func:`test_the_threading_layer_in_use`). ``omp`` and ``tbb`` may be entered by several threads
at once; ``workqueue`` may not, so normlab lets one caller at a time into the parallel kernels
(the others run the serial kernels meanwhile), which
:func:`test_workqueue_layer_with_concurrent_callers` checks. ``NORMLAB_STRESS=N`` multiplies
the callers and calls (the figures of docs/reliability.md come from ``NORMLAB_STRESS=25``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import pytest

import normlab
from normlab import dispatch, registry
from tests.support.paths import ROOT

torch = pytest.importorskip("torch")
numba = pytest.importorskip("numba")

STRESS: Final = int(os.environ.get("NORMLAB_STRESS", "1"))
THREADS: Final = 16 * STRESS
CALLS_PER_THREAD: Final = 24 * STRESS
TASKS: Final = 64 * STRESS
JOIN_TIMEOUT_S: Final = 120.0 * STRESS
#: Preferences of the outer and inner ``use_backend`` blocks (None: no block).
NESTINGS: Final = [
    (None, None),
    ("numpy", None),
    ("numba", None),
    ("torch", None),
    ("numpy", "numba"),
    ("numba", "numpy"),
    ("torch", "numba"),
    ("numba", "torch"),
    ("cupy", "numpy"),
]


@dataclass(frozen=True)
class Job:
    """One call: an op on an input, maybe with a named backend, ``out`` or a bad weight."""

    name: str
    op: str
    make: Callable[[], Any]
    backend: str | None = None
    out: bool = False
    bad_weight: bool = False

    @property
    def family(self) -> str:
        return "torch" if isinstance(self.make(), torch.Tensor) else "numpy"

    def call(self, x: Any) -> Any:
        function = normlab.layer_norm if self.op == "layer_norm" else normlab.rms_norm
        kwargs: dict[str, Any] = {}
        if self.backend is not None:
            kwargs["backend"] = self.backend
        if self.out:
            kwargs["out"] = np.empty_like(x) if isinstance(x, np.ndarray) else torch.empty_like(x)
        if self.bad_weight:
            kwargs["weight"] = np.ones(x.shape[-1] - 1, x.dtype)
        y = function(x, **kwargs)
        assert not self.out or y is kwargs["out"]
        return y


def _array(shape: tuple[int, ...], dtype: Any, seed: int, family: str = "numpy") -> Any:
    a = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    if family == "torch":
        return torch.from_numpy(a).to(dtype)
    return a.astype(dtype)


INPUTS: Final[dict[str, Any]] = {
    "small": _array((8, 64), np.float32, 1),
    "large": _array((256, 512), np.float32, 2),  # over numba's serial limit: parallel kernels
    "half": _array((16, 96), np.float16, 3),
    "tensor": _array((8, 64), torch.float32, 4, "torch"),
    "bf16": _array((16, 96), torch.bfloat16, 5, "torch"),
}
JOBS: Final = [
    Job("small", "layer_norm", lambda: INPUTS["small"]),
    Job("large", "layer_norm", lambda: INPUTS["large"]),
    Job("half-out", "layer_norm", lambda: INPUTS["half"], out=True),
    Job("tensor", "layer_norm", lambda: INPUTS["tensor"]),
    Job("bf16-numba", "layer_norm", lambda: INPUTS["bf16"], backend="numba"),
    Job("rms", "rms_norm", lambda: INPUTS["small"]),
    Job("large-numpy", "layer_norm", lambda: INPUTS["large"], backend="numpy"),
    Job("bad", "layer_norm", lambda: INPUTS["small"], bad_weight=True),
]


def serves(name: str, op: str, family: str, named: bool) -> bool:
    """Whether backend ``name`` serves this call, by its record (as dispatch decides)."""
    b = registry.get(name)
    families = b.families | b.zero_copy_families | (b.explicit_families if named else frozenset())
    return op in b.ops and family in families and "cpu" in b.devices and b.available


def expected_backend(job: Job, preference: str | None) -> str:
    """The backend that must serve ``job`` under ``preference`` (no NORMLAB_BACKEND): the one
    named, else the preference where it serves, else normlab's own choice for the job's
    arrays (priority, or cost between backends with cost models), taken before the stress."""
    if job.backend is not None:
        return job.backend
    if preference is not None and serves(preference, job.op, job.family, named=True):
        return preference
    return DEFAULTS[job.name]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return type(b) is torch.Tensor and bool(torch.equal(a, b))
    return type(b) is np.ndarray and a.dtype == b.dtype and bool(np.array_equal(a, b))


#: Each job's default backend (nothing named, no preference), filled by :func:`expected`.
DEFAULTS: dict[str, str] = {}


@pytest.fixture
def expected(no_preference: None) -> dict[tuple[str, str], Any]:
    """Each job's result on each backend that can serve it, computed alone, before the stress;
    and, in :data:`DEFAULTS`, the backend normlab chooses for it by default."""
    results = {}
    for job in JOBS:
        if job.bad_weight:
            continue
        text = normlab.explain(job.make(), op=job.op)
        DEFAULTS[job.name] = text.split("\n  chosen: ", 1)[1].split(" ", 1)[0]
        for b in normlab.list_backends():
            if serves(b.name, job.op, job.family, named=True):
                results[job.name, b.name] = Job(job.name, job.op, job.make, b.name).call(job.make())
    return results


def run_job(job: Job, preference: str | None, expected: dict[tuple[str, str], Any]) -> None:
    """One call under ``preference``, checked against the result of the expected backend."""
    if job.bad_weight:
        with pytest.raises(normlab.ShapeError):
            job.call(job.make())
        return
    y = job.call(job.make())
    backend = expected_backend(job, preference)
    assert same(expected[job.name, backend], y), f"{job.name}: not {backend}'s result"


def nested_calls(
    worker: int, calls: int, expected: dict[tuple[str, str], Any], barrier: threading.Barrier | None
) -> int:
    """``calls`` jobs in the worker's nested ``use_backend`` blocks; returns the number run."""
    done = 0
    for k in range(calls):
        outer, inner = NESTINGS[(worker + k) % len(NESTINGS)]
        job = JOBS[(worker * 7 + k) % len(JOBS)]
        with ExitStack() as blocks:
            if outer is not None:
                blocks.enter_context(normlab.use_backend(outer))
            assert dispatch.current_preference() == outer
            if inner is not None:
                blocks.enter_context(normlab.use_backend(inner))
            if barrier is not None and k == 0:
                barrier.wait()  # every thread is inside its blocks: now call, all at once
            run_job(job, inner or outer, expected)
            assert dispatch.current_preference() == (inner or outer)
        assert dispatch.current_preference() is None
        done += 1
    return done


def test_threads_with_every_backend_and_nested_preferences(
    expected: dict[tuple[str, str], Any],
) -> None:
    barrier = threading.Barrier(THREADS, timeout=JOIN_TIMEOUT_S)
    counts: dict[int, int] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            counts[i] = nested_calls(i, CALLS_PER_THREAD, expected, barrier)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
    assert not [t for t in threads if t.is_alive()], "a thread is stuck (deadlock?)"
    if errors:
        raise errors[0]
    assert sum(counts.values()) == THREADS * CALLS_PER_THREAD
    assert dispatch.current_preference() is None


def test_asyncio_tasks_and_threads_they_start(expected: dict[tuple[str, str], Any]) -> None:
    """Tasks interleave inside their blocks; ``asyncio.to_thread`` carries a task's preference
    into the worker thread (contextvars are copied), and nothing leaks between tasks."""

    async def task(i: int) -> int:
        outer, inner = NESTINGS[i % len(NESTINGS)]
        job = JOBS[(i * 3) % len(JOBS)]
        with ExitStack() as blocks:
            if outer is not None:
                blocks.enter_context(normlab.use_backend(outer))
            await asyncio.sleep(0)  # let the other tasks enter their blocks
            if inner is not None:
                blocks.enter_context(normlab.use_backend(inner))
            await asyncio.sleep(0)
            run_job(job, inner or outer, expected)
            await asyncio.to_thread(run_job, job, inner or outer, expected)
            assert dispatch.current_preference() == (inner or outer)
        assert dispatch.current_preference() is None
        return 2

    async def main() -> list[int]:
        return await asyncio.wait_for(
            asyncio.gather(*(task(i) for i in range(TASKS))), JOIN_TIMEOUT_S
        )

    assert sum(asyncio.run(main())) == 2 * TASKS
    assert dispatch.current_preference() is None


def test_the_threading_layer_in_use(record_property: Callable[[str, Any], None]) -> None:
    """Numba picks tbb, then omp, then workqueue; normlab's parallel kernels run on it."""
    large = INPUTS["large"]
    normlab.layer_norm(large, backend="numba")
    layer = numba.threading_layer()
    record_property("numba_threading_layer", layer)
    assert layer in ("tbb", "omp", "workqueue")


# --------------------------------------------------------------------------------------------
# Fresh interpreters: the first calls racing, and the workqueue layer


def run_child(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NORMLAB_")}
    environment.update(PYTHONPATH=str(ROOT), NORMLAB_DISABLE_PLUGIN_AUTOLOAD="1", **env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


#: Threads that all make their first call at once: the registry, the backend modules, Numba's
#: compilation and torch are all first used by several threads together.
COLD_START = """
import json, threading
import numpy as np
import normlab
x = np.random.default_rng(0).standard_normal((256, 512)).astype(np.float32)
threads, barrier, results = 8, threading.Barrier(8), {}
def first_call(i):
    barrier.wait()
    if i % 4 == 3:
        import torch
        results[i] = normlab.layer_norm(torch.from_numpy(x)).numpy()
    else:
        results[i] = normlab.layer_norm(x, backend=("numba", "numpy")[i % 2])
workers = [threading.Thread(target=first_call, args=(i,)) for i in range(threads)]
for t in workers:
    t.start()
for t in workers:
    t.join(240)
from normlab import reference
expected = reference.layer_norm(x)[0]
print(json.dumps({
    "alive": sum(t.is_alive() for t in workers),
    "ok": sorted(i for i, y in results.items() if np.allclose(y, expected, atol=1e-4)),
}))
"""


def test_first_calls_racing_in_a_fresh_process() -> None:
    done = run_child(COLD_START)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"alive": 0, "ok": list(range(8))}


WORKQUEUE = """
import threading
import numpy as np
import normlab
x = np.ones((256, 512), np.float32)
x[:, ::2] = 3.0
normlab.layer_norm(x, backend="numba")
import numba
assert numba.threading_layer() == "workqueue"
long = np.tile(x[0], 1024)[None]  # one long row: segments shared out between threads
dy = np.ones_like(x)
_, mean, rstd = normlab.layer_norm(x, return_stats=True, backend="numba")
errors = []
def calls():
    try:
        checked_calls()
    except BaseException as exc:  # a failed check in a thread must fail the script
        errors.append(exc)
def checked_calls():
    for _ in range(20):
        y = normlab.layer_norm(x, backend="numba")
        assert abs(float(y[0, 0]) - 1.0) < 1e-3
        z = normlab.rms_norm(x, backend="numba")
        assert abs(float(z[0, 0]) - 3 / 5 ** 0.5) < 1e-3
        assert abs(float(normlab.layer_norm(long, backend="numba")[0, 1]) + 1.0) < 1e-3
        dx, _, _ = normlab.layer_norm_backward(dy, x, mean, rstd, backend="numba")
        assert abs(float(dx[0, 0])) < 1e-3
workers = [threading.Thread(target=calls) for _ in range(4)]
for t in workers:
    t.start()
for t in workers:
    t.join(120)
assert not errors, errors
assert not any(t.is_alive() for t in workers)
print("all calls returned")
"""


def test_workqueue_layer_with_concurrent_callers() -> None:
    """The workqueue layer (used where neither tbb nor OpenMP is installed) is not threadsafe:
    two threads in parallel kernels at once would abort the whole process. One caller at a
    time holds numba's pool; the others run the serial kernels meanwhile."""
    done = run_child(WORKQUEUE, NUMBA_THREADING_LAYER="workqueue")
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-500:]}"
    assert "all calls returned" in done.stdout


def test_a_threading_layer_that_cannot_load_runs_serially_saying_so() -> None:
    """NUMBA_THREADING_LAYER=tbb without tbb installed: one NormlabWarning, then every call on
    the calling thread with the same bits (before: the first large call raised, and the pool's
    lock, never released, left every later call serial without a word); normlab info says so
    without a traceback."""
    import importlib.util

    if importlib.util.find_spec("tbb") is not None:
        pytest.skip("tbb is installed here: its layer loads")
    code = """
    import json, warnings
    import numpy as np
    import normlab
    from normlab.backends import numba_backend
    x = np.random.default_rng(0).standard_normal((2048, 1024)).astype(np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = normlab.layer_norm(x, backend="numba")
        second = normlab.layer_norm(x, backend="numba")
    print(json.dumps({
        "warnings": [str(w.message) for w in caught if "threading layer" in str(w.message)],
        "same": first.tobytes() == second.tobytes(),
        "layer": numba_backend.threading_layer(),
    }))
    """
    result = run_child(code, NUMBA_THREADING_LAYER="tbb")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert (
        len(report["warnings"]) == 1
        and "runs the numba kernels on the calling" in (report["warnings"][0])
    )
    assert report["same"] and report["layer"].startswith("cannot start (requested: tbb)")
    info = subprocess.run(
        [sys.executable, "-m", "normlab", "info"],
        env={**os.environ, "NUMBA_THREADING_LAYER": "tbb", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert info.returncode == 0 and "Traceback" not in info.stderr + info.stdout, info.stderr
