"""First calls that compile: the ``normlab.compile`` notice, ``normlab warmup``, and the number
of numba specializations a training step compiles.

The unit tests drive the compile watcher directly; the tests in child processes compile for
real into a fresh numba cache (tens of seconds on a loaded machine; the whole module is about
half a minute on an idle one).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import normlab
from normlab.backends import compile_notices as notices

PACKAGE_PARENT = Path(normlab.__file__).resolve().parent.parent
NOTICE = "compiling the numba kernel"


@pytest.fixture
def watcher(caplog: pytest.LogCaptureFixture) -> notices._CompileWatcher:
    caplog.set_level(logging.INFO, logger=notices.COMPILE_LOGGER)
    return notices._CompileWatcher()


def _notices(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == notices.COMPILE_LOGGER]


def test_a_slow_compile_is_announced_once(
    watcher: notices._CompileWatcher, caplog: pytest.LogCaptureFixture
) -> None:
    for _ in range(2):
        watcher.on_start("layer_norm_rows", "float16 contiguous rows")
        watcher.on_start("_moments", "float32 contiguous rows")  # a helper, inside
        time.sleep(notices.NOTICE_AFTER_S + 0.3)
        watcher.on_end()
        watcher.on_end()
    [message] = _notices(caplog)
    assert "layer_norm_rows for float16 contiguous rows" in message
    assert "cached on disk afterwards" in message
    assert "`normlab warmup`" in message


def test_a_fast_compile_or_cache_load_stays_silent(
    watcher: notices._CompileWatcher, caplog: pytest.LogCaptureFixture
) -> None:
    watcher.on_start("layer_norm_rows", "float32 contiguous rows")
    watcher.on_end()
    time.sleep(notices.NOTICE_AFTER_S + 0.3)
    assert _notices(caplog) == []


def test_notices_are_once_per_specialization_across_threads(
    watcher: notices._CompileWatcher, caplog: pytest.LogCaptureFixture
) -> None:
    barrier = threading.Barrier(8)

    def announce(i: int) -> None:
        barrier.wait()
        watcher._announce("layer_norm_rows", f"float{32 if i % 2 else 64} contiguous rows")

    threads = [threading.Thread(target=announce, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(_notices(caplog)) == 2


def test_silenced_block_gives_no_notice(
    watcher: notices._CompileWatcher, caplog: pytest.LogCaptureFixture
) -> None:
    with watcher.silenced():
        watcher._announce("layer_norm_rows", "float32 contiguous rows")
    assert _notices(caplog) == []
    watcher._announce("layer_norm_rows", "float32 contiguous rows")  # not used up by silence
    assert len(_notices(caplog)) == 1


@pytest.mark.parametrize(
    ("quiet", "root_handler", "shown"),
    [(None, False, True), ("1", False, False), (None, True, False), ("0", False, True)],
)
def test_the_default_handler_writes_to_stderr_unless_silenced(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    quiet: str | None,
    root_handler: bool,
    shown: bool,
) -> None:
    if quiet is None:
        monkeypatch.delenv("NORMLAB_QUIET", raising=False)
    else:
        monkeypatch.setenv("NORMLAB_QUIET", quiet)
    root = [logging.NullHandler()] if root_handler else []
    monkeypatch.setattr(logging.getLogger(), "handlers", root)  # pytest's own are set aside
    handler = next(
        h for h in notices.compile_logger().handlers if isinstance(h, notices._DefaultStderr)
    )
    record = logging.LogRecord(notices.COMPILE_LOGGER, logging.INFO, "", 0, "hello", (), None)
    handler.emit(record)
    assert (capsys.readouterr().err == "normlab: hello\n") is shown


def test_an_application_level_keeps_its_level() -> None:
    logger = logging.getLogger(notices.COMPILE_LOGGER)
    before = logger.level
    try:
        logger.setLevel(logging.WARNING)
        notices.compile_logger()
        assert logger.level == logging.WARNING
    finally:
        logger.setLevel(before)


# --------------------------------------------------------------------------------------------
# Real compiles, in child processes with a fresh numba cache.


def _child(code: str, cache: Path, **env: str) -> subprocess.CompletedProcess[str]:
    child_env = dict(os.environ, PYTHONPATH=str(PACKAGE_PARENT), NUMBA_CACHE_DIR=str(cache))
    child_env.pop("NORMLAB_QUIET", None)
    child_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=child_env,
        timeout=600,
        check=False,
    )


FIRST_CALL = """
    import numpy as np, normlab
    x = np.linspace(-1, 1, 4 * 48).reshape(4, 48).astype(np.float16)
    normlab.layer_norm(x, backend="numba")
    print("done")
"""


def test_a_first_call_that_compiles_says_so_and_a_cached_one_does_not(tmp_path: Path) -> None:
    pytest.importorskip("numba")
    cold = _child(FIRST_CALL, tmp_path)
    assert cold.returncode == 0, cold.stderr
    assert f"normlab: {NOTICE} layer_norm_rows for float16 contiguous rows" in cold.stderr
    assert cold.stderr.count(NOTICE) == 1
    warm = _child(FIRST_CALL, tmp_path)
    assert warm.returncode == 0, warm.stderr
    assert NOTICE not in warm.stderr
    quiet = _child(FIRST_CALL, tmp_path / "other", NORMLAB_QUIET="1")
    assert quiet.returncode == 0, quiet.stderr
    assert NOTICE not in quiet.stderr


def test_the_warmup_set_covers_every_kernel_family() -> None:
    """dtypes x layouts x threads x directions, the quantizing kernels on contiguous rows only
    (strided quantized calls are composed from the forward's kernels)."""
    from normlab import precompile

    calls = precompile.warmup_calls(["float32"])
    assert {c.direction for c in calls} == set(precompile.DIRECTIONS)
    quantized = [c for c in calls if c.direction == "quantized"]
    assert [(c.strided, c.parallel) for c in quantized] == [(False, False), (False, True)]
    assert len(calls) == 2 * 2 * 3 + 2
    with pytest.raises(normlab.ArgumentError, match="unknown op"):
        precompile.warmup_calls(["float32"], ["quantize"])


WARMED_CALLS = """
    import numpy as np, normlab
    from numba.core import event
    from normlab.backends.numba_pool import SERIAL_ELEMENTS

    compiled = []

    class Count(event.Listener):
        def on_start(self, ev):
            compiled.append(ev.data["dispatcher"].py_func.__name__)

        def on_end(self, ev):
            pass

    event.register("numba:compile", Count())
    warmed = normlab.warmup(["float32"], ["forward", "quantized"])
    # calls the warmed set covers without being in it: every quantize mode and rms_norm run
    # the warmed quantizing kernels, serial and parallel
    x = np.linspace(-1, 1, 4 * 64, dtype=np.float32).reshape(4, 64)
    big = np.linspace(-1, 1, 4 * SERIAL_ELEMENTS, dtype=np.float32).reshape(-1, 64)
    for mode in ("int8", "fp8_e4m3"):
        normlab.rms_norm(x, quantize=mode, backend="numba")
        normlab.layer_norm(big, quantize=mode, quantize_scale=0.5, backend="numba")
        normlab.add_rms_norm(x, x, quantize=mode, backend="numba")
    print("compiled", warmed.compiled, "loaded", warmed.loaded, "calls", warmed.calls,
          "then", len(compiled), compiled)
"""


def test_warmup_float32_compiles_ahead_and_removes_the_notice(tmp_path: Path) -> None:
    """``normlab warmup`` of float32's forward and quantized kernels (two of the four
    directions, which go through the same code: the others would add a minute and a half to
    CI), then the calls they cover in a new process: nothing compiles, nothing is said."""
    pytest.importorskip("numba")
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_PARENT), COLUMNS="100")
    env.pop("NUMBA_CACHE_DIR", None)
    command = [sys.executable, "-m", "normlab", "warmup", "--dtypes", "float32"]
    command += ["--ops", "forward", "quantized"]
    result = subprocess.run(
        [*command, "--cache-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "kernels compiled" in result.stdout
    unwrapped = "".join(result.stdout.split())  # rich wraps a long path anywhere
    assert f"loadedfromthecache({tmp_path})" in unwrapped
    assert NOTICE not in result.stderr  # the progress bar says it instead
    again = _child(WARMED_CALLS, tmp_path)  # the same calls in a new process: all cached
    assert again.returncode == 0, again.stderr
    assert "compiled 0 loaded" in again.stdout
    assert "then 0 []" in again.stdout
    assert NOTICE not in again.stderr


# The first training step of a float32 and a bfloat16 model: forward and backward on a
# C-contiguous [B, L, D] input with weight and bias. Each entry point of the kernels that Python
# calls is one specialization per dtype (the serial kernel is also compiled inside the parallel
# one); the count holds the line against new ones (an extra layout, a type that varies by call).
TRAINING_STEP = """
    import numpy as np, normlab, numba
    from numba.core import event
    import ml_dtypes

    compiled = []
    everything = []

    class Count(event.Listener):
        def on_start(self, ev):
            f = ev.data["dispatcher"].py_func
            everything.append(f.__name__)
            if f.__module__.startswith("normlab."):
                compiled.append(f.__name__)

        def on_end(self, ev):
            pass

    event.register("numba:compile", Count())
    for dtype in (np.float32, ml_dtypes.bfloat16):
        x = np.linspace(-3, 3, 4 * 64 * 512).reshape(4, 64, 512).astype(dtype)
        w, b = np.ones(512, np.float32), np.zeros(512, np.float32)
        y, mean, rstd = normlab.layer_norm(x, weight=w, bias=b, return_stats=True, backend="numba")
        normlab.layer_norm_backward(y, x, mean, rstd, w, backend="numba")
    entries = ("layer_norm_rows", "layer_norm_rows_parallel", "backward_chunks",
               "backward_chunks_parallel", "sum_chunks")
    print("entries", sum(name in entries for name in compiled), "all", len(compiled),
          "threads", numba.get_num_threads(), "with_numba_s_own", len(everything))
"""


def test_a_training_step_compiles_a_counted_number_of_specializations(tmp_path: Path) -> None:
    pytest.importorskip("numba")
    pytest.importorskip("ml_dtypes")
    result = _child(TRAINING_STEP, tmp_path)
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    entries, total, threads, with_numba = (int(words[i]) for i in (1, 3, 5, 7))
    # float32: forward, backward, the weight/bias sum; bfloat16: forward, backward (its sums
    # are float32 too). With threads, the serial forward and backward are compiled inside the
    # parallel ones.
    assert entries == (9 if threads > 1 else 5), result.stdout
    assert total <= 37, result.stdout  # every normlab function numba compiled, helpers included
    # and the functions of numba's own library they use: no error message built from strings
    # (an array assignment's shape check compiled 37 of them, a quarter of the compile time)
    assert with_numba <= 50, result.stdout


@pytest.mark.parametrize("place", ["a regular file", "/proc/normlab"])
def test_warmup_refuses_a_cache_dir_that_cannot_hold_one(tmp_path: Path, place: str) -> None:
    """A --cache-dir that is a regular file or cannot be made: one line and exit status 2, no
    traceback."""
    pytest.importorskip("numba")
    target = tmp_path / "file" if place == "a regular file" else Path(place)
    if place == "a regular file":
        target.write_text("")
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_PARENT), COLUMNS="100")
    env.pop("NUMBA_CACHE_DIR", None)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "normlab",
            "warmup",
            "--dtypes",
            "float32",
            "--cache-dir",
            str(target),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "cannot hold a cache" in result.stderr
