"""Kernels out of bounds: Numba's bounds checks, proven to work, over the conformance suite.

``NUMBA_BOUNDSCHECK=1`` compiles every array access with a bounds check that raises
``IndexError``. It only applies to code compiled in that process: machine code from Numba's
on-disk cache (normlab's kernels are ``cache=True``) keeps the setting it was compiled with. So
every run here gets an empty ``NUMBA_CACHE_DIR``, and each proves the check is in force with a
deliberately out-of-bounds kernel (:mod:`tests.support.oob_kernel`) before it trusts a clean result.

The whole conformance suite under bounds checks takes about half a minute: it runs with
``NORMLAB_SLOW_TESTS=1`` (the nox session ``boundscheck``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import ROOT, TESTS

pytest.importorskip("numba")

SLOW = os.environ.get("NORMLAB_SLOW_TESTS", "") not in ("", "0")

#: Python run in a child: calls the out-of-bounds kernel on a view whose next element is 10.
PROBE = """
import json, numpy as np, numba
from tests.support import oob_kernel
memory = np.array([1.0, 2.0, 3.0, 10.0])
try:
    outcome = oob_kernel.sum_one_past_the_end(memory[:3])
except IndexError as exc:
    outcome = f"IndexError: {exc}"
print(json.dumps({"boundscheck": bool(numba.config.BOUNDSCHECK), "outcome": outcome}))
"""


def run_child(code: str, cache: Path, boundscheck: str, timeout: float = 120) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter with this bounds-check setting and Numba cache; its
    last line of output is JSON."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "NORMLAB_"))}
    env.update(
        NUMBA_BOUNDSCHECK=boundscheck,
        NUMBA_CACHE_DIR=str(cache),
        PYTHONPATH=str(ROOT),
        NORMLAB_DISABLE_PLUGIN_AUTOLOAD="1",
    )
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_without_boundscheck_the_kernel_is_silently_wrong(tmp_path: Path) -> None:
    result = run_child(PROBE, tmp_path / "cache", boundscheck="0")
    assert result == {"boundscheck": False, "outcome": 16.0}  # 1 + 2 + 3 + the stray 10


def test_with_boundscheck_and_a_fresh_cache_the_kernel_fails(tmp_path: Path) -> None:
    result = run_child(PROBE, tmp_path / "cache", boundscheck="1")
    assert result["boundscheck"] is True
    assert result["outcome"] == "IndexError: index is out of bounds"


def test_cached_code_ignores_the_flag(tmp_path: Path) -> None:
    """Why every bounds-checked run needs an empty cache: code cached without checks runs
    without them, whatever NUMBA_BOUNDSCHECK says."""
    cache = tmp_path / "cache"
    run_child(PROBE, cache, boundscheck="0")
    assert run_child(PROBE, cache, boundscheck="1") == {"boundscheck": True, "outcome": 16.0}


def test_normlab_kernels_are_compiled_with_bounds_checks(tmp_path: Path) -> None:
    """Asked for one row too many, normlab's own kernel raises instead of reading past x."""
    code = """
    import json, numpy as np
    from normlab.backends.numba_forward import layer_norm_rows
    x = np.ones((3, 4), np.float32)
    w, b = np.ones(4, np.float32), np.zeros(4, np.float32)
    mean, rstd = np.empty(3, np.float32), np.empty(3, np.float32)
    y = np.empty_like(x)
    layer_norm_rows(x, y, w, b, 1e-5, mean, rstd, True, 0, 3)  # in bounds: fine
    try:
        layer_norm_rows(x, y, w, b, 1e-5, mean, rstd, True, 0, 4)
        outcome = "no error"
    except IndexError as exc:
        outcome = f"IndexError: {exc}"
    print(json.dumps({"outcome": outcome}))
    """
    result = run_child(code, tmp_path / "cache", boundscheck="1")
    assert result == {"outcome": "IndexError: index is out of bounds"}


def test_fused_kernels_are_compiled_with_bounds_checks(tmp_path: Path) -> None:
    """Asked for one row too many, the fused add + norm kernel raises instead of reading past x
    and the residual."""
    code = """
    import json, numpy as np
    from normlab.backends.numba_fused import add_norm_rows
    x, r = np.ones((3, 4), np.float32), np.ones((3, 4), np.float32)
    w, b = np.ones(4, np.float32), np.zeros(4, np.float32)
    mean, rstd = np.empty(3, np.float32), np.empty(3, np.float32)
    y, h = np.empty_like(x), np.empty_like(x)
    add_norm_rows(x, r, y, h, w, b, 1e-5, mean, rstd, True, 0, 3)  # in bounds: fine
    try:
        add_norm_rows(x, r, y, h, w, b, 1e-5, mean, rstd, True, 0, 4)
        outcome = "no error"
    except IndexError as exc:
        outcome = f"IndexError: {exc}"
    print(json.dumps({"outcome": outcome}))
    """
    result = run_child(code, tmp_path / "cache", boundscheck="1")
    assert result == {"outcome": "IndexError: index is out of bounds"}


def test_address_entries_are_compiled_with_bounds_checks(tmp_path: Path) -> None:
    """Asked for one row too many, the entries that take small tensors by address raise instead
    of reading past the memory they view."""
    code = """
    import json, numpy as np
    from normlab.backends.numba_addressed import add_norm_rows_at, layer_norm_rows_at
    x, r, y, h = (np.ones((3, 4), np.float32) for _ in range(4))
    w, b = np.ones(4, np.float32), np.zeros(4, np.float32)
    stats = np.empty(0, np.float32)
    at = lambda a: a.ctypes.data
    def by_address(stop, fused):
        if fused:
            add_norm_rows_at(
                x, w, w, x, x, at(x), at(r), at(y), at(h), at(w), at(b), 0.0, 3, 4, 1e-5,
                stats, stats, True, 0, stop,
            )
        else:
            layer_norm_rows_at(
                x, w, w, at(x), at(y), at(w), at(b), 0.0, 3, 4, 1e-5, stats, stats, True, 0, stop
            )
    outcomes = []
    for fused in (False, True):
        by_address(3, fused)  # in bounds: fine
        try:
            by_address(4, fused)
            outcomes.append("no error")
        except IndexError as exc:
            outcomes.append(f"IndexError: {exc}")
    print(json.dumps({"outcomes": outcomes}))
    """
    result = run_child(code, tmp_path / "cache", boundscheck="1")
    assert result == {"outcomes": ["IndexError: index is out of bounds"] * 2}


@pytest.mark.slow
@pytest.mark.skipif(not SLOW, reason="a minute: set NORMLAB_SLOW_TESTS=1 (nox -s boundscheck)")
def test_fused_kernel_tests_with_bounds_checks(tmp_path: Path) -> None:
    """tests/fused/test_fused_kernels.py on numba (every shape, dtype, aliasing form and long rows),
    every kernel compiled afresh with bounds checks."""
    code = PROBE + textwrap.dedent(
        f"""
        assert outcome.startswith("IndexError"), "bounds checks are not in force"
        import pytest
        exit_code = int(pytest.main(
            [{str(TESTS / "fused" / "test_fused_kernels.py")!r}, "-q", "--tb=short", "-k", "numba",
             "-p", "no:cacheprovider"]
        ))
        print(json.dumps({{"exit_code": exit_code}}))
        """
    )
    result = run_child(code, tmp_path / "cache", boundscheck="1", timeout=900)
    assert result["exit_code"] == 0


@pytest.mark.slow
@pytest.mark.skipif(not SLOW, reason="half a minute: set NORMLAB_SLOW_TESTS=1 (nox -s boundscheck)")
def test_conformance_suite_with_bounds_checks(tmp_path: Path) -> None:
    """The conformance suite on numba, every kernel compiled afresh with bounds checks: on NumPy
    arrays, then on CPU torch tensors (small contiguous ones through the address entries),
    there without the backward area, whose kernels take the same arrays either way."""
    pytest.importorskip("torch", reason="the suite's second half runs on torch tensors")
    code = PROBE + textwrap.dedent(
        """
        assert outcome.startswith("IndexError"), "bounds checks are not in force"
        import normlab.testing
        args = ["-q", "--tb=short"]
        exit_code = normlab.testing.check("numba", extra_pytest_args=args)
        torch_exit_code = normlab.testing.check(
            "numba", arrays="torch", extra_pytest_args=[*args, "-k", "not test_backward"]
        )
        from numba import types
        from numba.core.dispatcher import Dispatcher
        from normlab.backends import (
            half_bits, numba_addressed, numba_backward, numba_forward, numba_fused
        )
        kernels = [
            k
            for m in (half_bits, numba_forward, numba_backward, numba_fused, numba_addressed)
            for k in vars(m).values()
            if isinstance(k, Dispatcher)
        ]
        print(json.dumps({
            "exit_code": exit_code,
            "torch_exit_code": torch_exit_code,
            "addressed": sorted(
                " ".join([k.__name__, str(sig[0].dtype), str(sig[2].dtype)] + (
                    ["with h" if sig[4] != types.none else "without h"]
                    if k.__name__.startswith("add_") else []
                ))
                for k in (
                    numba_addressed.layer_norm_rows_at,
                    numba_addressed.add_norm_rows_at,
                    numba_addressed.layer_norm_rows_parallel_at,
                    numba_addressed.add_norm_rows_parallel_at,
                )
                for sig in k.signatures
            ),
            "compiled": sum(sum(k.stats.cache_misses.values()) for k in kernels),
            "loaded": sum(sum(k.stats.cache_hits.values()) for k in kernels),
        }))
        """
    )
    result = run_child(code, tmp_path / "cache", boundscheck="1", timeout=900)
    assert result["exit_code"] == 0 and result["torch_exit_code"] == 0, result
    # the address entries for every dtype (the fused one with h and without) ran checked, as
    # did the norms' entries for half parameters (weight and bias in x's half dtype); and the
    # pool's entries (norms and fused) for every dtype
    elements = {"float32": "float32", "float64": "float64", "int16": "float32", "uint16": "float32"}
    wanted = {
        f"{name} {element} {compute}{form}"
        for element, compute in elements.items()
        for name, form in (
            ("layer_norm_rows_at", ""),
            ("add_norm_rows_at", " with h"),
            ("add_norm_rows_at", " without h"),
        )
    } | {f"layer_norm_rows_at {half} {half}" for half in ("int16", "uint16")}
    assert wanted <= set(result["addressed"]), result
    pooled = {" ".join(entry.split()[:2]) for entry in result["addressed"] if "parallel" in entry}
    assert pooled >= {
        f"{name} {element}"
        for element in elements
        for name in ("layer_norm_rows_parallel_at", "add_norm_rows_parallel_at")
    }, result
    # every kernel the suite ran was compiled here, with bounds checks, none loaded from a cache
    assert result["compiled"] > 0 and result["loaded"] == 0, result
