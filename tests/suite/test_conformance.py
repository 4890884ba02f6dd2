"""The conformance suite passes on every built-in backend that can run here, and its pytest
plugin behaves: inert without ``--normlab-backend``, loud about ``--normlab-xfail`` ids that
match nothing."""

from __future__ import annotations

import functools
import subprocess
import sys
import warnings
from typing import Final

import numpy as np
import pytest

import normlab.testing
from normlab import registry
from normlab.backends import BUILTIN_RECORDS
from normlab.errors import BackendError
from normlab.testing import default_choice, pytest_plugin
from normlab.testing.tolerances import assert_close
from tests.support import mutants

#: Known deviations, expected to fail (passed as ``--normlab-xfail`` ids). Each id must still
#: catch a failure: once one is fixed, the test asks to remove it. The torch backend's
#: LayerNorm of float32 and float64 x runs torch's own CPU backward in autograd, whose
#: parameter gradients split their sum over rows by the thread count (docs/training.md: the
#: chunked sums it takes for half x cost 4-6 times the step here); the default choice sends
#: training LayerNorm calls there.
_TORCH_THREADS: Final = tuple(
    f"test_autograd_thread_counts[{subject}-layer_norm-{dtype}]"
    for subject in ("torch", "default:torch")
    for dtype in ("float32", "float64")
)
KNOWN_FAILURES: Final[dict[str, tuple[str, ...]]] = {
    "torch": _TORCH_THREADS[:2],
    "default:torch": _TORCH_THREADS[2:],
}
#: The subjects whose suite runs with NumPy's floating-point warnings as errors: the numpy
#: backend and the core's composition on NumPy arrays are silent on every extreme case (an
#: overflow to inf is the contract's result, not a warning).
SILENT: Final = frozenset({"numpy", "default:numpy"})
#: The pytest arguments that make those warnings errors.
WARNINGS_AS_ERRORS: Final = ("-W", "error::RuntimeWarning")


class Outcomes:
    """A pytest plugin noting each test's outcome (skips with their reason) and the warnings
    of an in-process suite run."""

    def __init__(self) -> None:
        self.passed: list[str] = []
        self.failed: list[str] = []
        self.xfailed: list[str] = []
        self.xpassed: list[str] = []
        self.skipped: dict[str, str] = {}
        self.warnings: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if hasattr(report, "wasxfail"):
            (self.xfailed if report.skipped else self.xpassed).append(report.nodeid)
        elif report.skipped:
            self.skipped[report.nodeid] = str(report.longrepr)
        elif report.failed:
            self.failed.append(report.nodeid)
        elif report.when == "call":
            self.passed.append(report.nodeid)

    def pytest_warning_recorded(self, warning_message: warnings.WarningMessage) -> None:
        self.warnings.append(str(warning_message.message))


@pytest.mark.parametrize("name", [record.name for record in BUILTIN_RECORDS])
def test_backend_conforms(name: str) -> None:
    """``normlab.testing.check(name)`` passes (known core bugs aside, see KNOWN_FAILURES)."""
    backend = registry.get(name)
    if not backend.available:
        pytest.skip(f"backend {name!r} is unavailable here: {backend.reason}")
    try:
        backend.module  # noqa: B018 (imports it)
    except BackendError as exc:
        pytest.skip(f"backend {name!r} does not import yet: {exc}")
    xfails = [f"--normlab-xfail={known}" for known in KNOWN_FAILURES.get(name, ())]
    outcomes = Outcomes()
    silent = WARNINGS_AS_ERRORS if name in SILENT else ()
    code = normlab.testing.check(
        name, extra_pytest_args=("-q", "--tb=short", *silent, *xfails), plugins=[outcomes]
    )
    assert code == pytest.ExitCode.OK, f"{len(outcomes.failed)} failed: {outcomes.failed[:20]}"
    fixed = [k for k in KNOWN_FAILURES.get(name, ()) if not any(k in t for t in outcomes.xfailed)]
    assert not fixed, f"known failures of {name!r} no longer fail; remove them: {fixed}"


@pytest.mark.parametrize("family", ["numpy", "torch", "array_api"])
def test_the_default_choice_conforms(family: str) -> None:
    """``normlab.testing.check("default:FAMILY")``: the suite through ``backend=None`` on the
    family's arrays passes, whichever backends the choice composes."""
    if not default_choice.candidates(family):
        pytest.skip(f"no backend available here serves {family} arrays by default")
    outcomes = Outcomes()
    subject = f"default:{family}"
    silent = WARNINGS_AS_ERRORS if subject in SILENT else ()
    xfails = [f"--normlab-xfail={known}" for known in KNOWN_FAILURES.get(subject, ())]
    code = normlab.testing.check(
        subject, extra_pytest_args=("-q", "--tb=short", *silent, *xfails), plugins=[outcomes]
    )
    assert code == pytest.ExitCode.OK, f"{len(outcomes.failed)} failed: {outcomes.failed[:20]}"
    fixed = [
        k for k in KNOWN_FAILURES.get(subject, ()) if not any(k in t for t in outcomes.xfailed)
    ]
    assert not fixed, f"known failures of {subject!r} no longer fail; remove them: {fixed}"


def test_declared_flushing_skips_the_subnormal_cases() -> None:
    """A backend that flushes subnormals to zero and declares it (``flushes_subnormals``) passes,
    its subnormal cases skipped with a reason naming the field; the rows near the dtype's max
    still run. Undeclared, the same backend fails them (test_suite_teeth)."""
    outcomes = Outcomes()
    with mutants.registered("flush_subnormals", flushes_subnormals=True) as name:
        code = normlab.testing.check(
            name, extra_pytest_args=("-q", "-k", "test_magnitudes"), plugins=[outcomes]
        )
    assert code == pytest.ExitCode.OK, outcomes.failed
    declared = [why for test, why in outcomes.skipped.items() if "-layer_norm-" in test]
    assert len(declared) == 4  # the four dtypes' subnormal rows (the mutant has no rms_norm)
    assert all("declares flushes_subnormals=True" in why for why in declared)
    assert len(outcomes.passed) == 4 and all("-dtype_max]" in t for t in outcomes.passed)


def test_a_declared_flush_may_zero_a_subnormal_result_only() -> None:
    """With ``flushed`` (the record's flushes_subnormals) a statistic whose true value is
    subnormal may be 0 (the rstd of a float32 row near the max is about 8e-39); a normal one
    may not, and without the declaration neither may."""
    subnormal, normal = np.array([8e-39]), np.array([2e-38])
    close = functools.partial(assert_close, dtype="float32", conditioning=1.0, what="rstd", cols=64)
    close(np.zeros(1), subnormal, scale=subnormal, flushed=True)
    with pytest.raises(AssertionError, match="rstd"):
        close(np.zeros(1), normal, scale=normal, flushed=True)
    with pytest.raises(AssertionError, match="rstd"):
        close(np.zeros(1), subnormal, scale=subnormal)


def test_xfail_id_matching_nothing_warns() -> None:
    outcomes = Outcomes()
    code = normlab.testing.check(
        "numpy",
        extra_pytest_args=("-q", "-k", "test_worked_example", "--normlab-xfail=no_such_test"),
        plugins=[outcomes],
    )
    assert code == pytest.ExitCode.OK
    assert any("'no_such_test' matches no collected test" in w for w in outcomes.warnings)


def test_xfail_id_marks_matching_tests() -> None:
    outcomes = Outcomes()
    code = normlab.testing.check(
        "numpy",
        extra_pytest_args=("-q", "-k", "worked_example", "--normlab-xfail=worked_example[numpy-"),
        plugins=[outcomes],
    )
    assert code == pytest.ExitCode.OK
    assert not outcomes.warnings
    assert outcomes.xpassed and not outcomes.passed


def test_plugin_inert_without_backend() -> None:
    """Without --normlab-backend nothing is parametrised: the suite's tests skip, saying why."""
    outcomes = Outcomes()
    code = pytest.main(
        [str(normlab.testing.SUITE), "-q", "-p", "no:normlab", "-p", "no:cacheprovider"],
        plugins=[pytest_plugin, outcomes],
    )
    assert code == pytest.ExitCode.OK
    assert outcomes.skipped and not outcomes.passed and not outcomes.xfailed
    assert all("no backend under test" in reason for reason in outcomes.skipped.values())


def test_plugin_imports_no_array_library() -> None:
    """The plugin is auto-loaded in every pytest run: it must stay light."""
    code = (
        "import sys, normlab.testing.pytest_plugin; "
        "print(sorted({'numpy', 'torch', 'hypothesis', 'numba'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
