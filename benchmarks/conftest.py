"""pytest plumbing for the benchmark matrix: options, time budget, progress line, saved JSON.

The matrix (``bench_matrix.py``) is sized by ``--normlab-matrix`` (quick or full) and paced by
``--normlab-budget-minutes``: each timed case gets a share of the time left, in proportion to
its input size, and cases still waiting when the budget is spent are skipped (never failed).
The JSON that pytest-benchmark writes is trimmed (per-round data and unused options dropped,
statistics kept) and extended with a ``normlab`` section: matrix settings, the load average at
the start and the end, peak-memory records and skip reasons.
"""

from __future__ import annotations

import importlib.metadata
import os
import time
from dataclasses import dataclass, field
from typing import Any, Final

import pytest

__all__ = ["MatrixState"]

#: Default budgets (minutes) and the least and most rounds of one timed case.
SETTINGS: Final = {
    "quick": {"budget_minutes": 2.0, "min_rounds": 3, "max_rounds": 200},
    "full": {"budget_minutes": 45.0, "min_rounds": 5, "max_rounds": 1000},
}
MATRIX_FILE: Final = "bench_matrix.py"
#: Part of a case's share of the time left that its timed rounds may use.
ROUNDS_SHARE: Final = 0.7
_LIBRARIES: Final = ("numpy", "torch", "numba", "ml_dtypes", "pytest-benchmark", "matplotlib")


@dataclass
class MatrixState:
    """The session's matrix settings, its clock and what it collected beyond timings.

    ``active``: the session runs the matrix (other benchmark files here are left alone).
    """

    matrix: str
    budget_s: float
    min_rounds: int
    max_rounds: int
    started: float = field(default_factory=time.perf_counter)
    load_at_start: tuple[float, float, float] = field(default_factory=os.getloadavg)
    active: bool = False
    weight_left: float = 0.0
    memory: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def share(self, weight: float) -> float:
        """Seconds the next case may spend on its rounds (weight: its input size).

        Its part of the time left, less a margin for warm-up calls and making inputs; past the
        budget the case is skipped.
        """
        left = self.budget_s - self.elapsed()
        fraction = weight / self.weight_left if self.weight_left > 0 else 1.0
        self.weight_left = max(0.0, self.weight_left - weight)
        if left <= 0:
            pytest.skip(f"time budget of {self.budget_s / 60:.1f} min spent")
        return ROUNDS_SHARE * left * min(1.0, fraction)

    def progress(self) -> str:
        return f"[{_clock(self.elapsed())} / {_clock(self.budget_s)}]"

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Keep each skip's reason for the saved JSON (registered as a plugin)."""
        if report.skipped and isinstance(report.longrepr, tuple):
            reason = str(report.longrepr[2]).removeprefix("Skipped: ")
            self.skipped.append({"id": report.nodeid.split("::")[-1], "reason": reason})


_STATE: Final = pytest.StashKey[MatrixState]()


def _clock(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("normlab", "normlab benchmark matrix")
    group.addoption(
        "--normlab-matrix",
        choices=tuple(SETTINGS),
        default="quick",
        help="which matrix to run (default: quick)",
    )
    group.addoption(
        "--normlab-budget-minutes",
        type=float,
        default=None,
        help="time budget of the whole session (default: 2 quick, 45 full)",
    )


def pytest_configure(config: pytest.Config) -> None:
    matrix = config.getoption("--normlab-matrix")
    settings = SETTINGS[matrix]
    minutes = config.getoption("--normlab-budget-minutes") or settings["budget_minutes"]
    state = MatrixState(
        matrix=matrix,
        budget_s=60.0 * minutes,
        min_rounds=int(settings["min_rounds"]),
        max_rounds=int(settings["max_rounds"]),
    )
    config.stash[_STATE] = state
    config.pluginmanager.register(state, "normlab-matrix-state")
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(os.cpu_count() or 1)  # the peer uses every core


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    state = config.stash[_STATE]
    ours = [item for item in items if item.path.name == MATRIX_FILE]
    state.active = bool(ours)
    for item in ours:
        case = getattr(item, "callspec", None) and item.callspec.params.get("case")
        if case is not None and not item.get_closest_marker("skip"):
            state.weight_left += case.weight


@pytest.fixture(scope="session")
def matrix(request: pytest.FixtureRequest) -> MatrixState:
    """The session's :class:`MatrixState`."""
    return request.config.stash[_STATE]


def pytest_report_header(config: pytest.Config) -> str:
    state = config.stash[_STATE]
    threads = ""
    try:
        import torch

        threads = f", torch threads {torch.get_num_threads()}"
    except ImportError:
        pass
    return (
        f"normlab matrix: {state.matrix}, budget {state.budget_s / 60:.1f} min, "
        f"rounds {state.min_rounds}..{state.max_rounds}{threads}"
    )


def pytest_report_teststatus(
    report: pytest.TestReport, config: pytest.Config
) -> tuple[str, str, tuple[str, dict[str, bool]]] | None:
    if report.when != "call" or not report.passed:
        return None
    line = dict(report.user_properties).get("normlab")
    if line is None:
        return None
    return "passed", ".", (f"{line}  {config.stash[_STATE].progress()}", {"green": True})


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    state = config.stash[_STATE]
    if not state.active:
        return
    terminalreporter.write_line(
        f"normlab matrix ({state.matrix}): {_clock(state.elapsed())} of a "
        f"{_clock(state.budget_s)} budget"
    )


def pytest_benchmark_update_machine_info(
    config: pytest.Config, machine_info: dict[str, Any]
) -> None:
    import normlab

    versions = {}
    for name in _LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    machine_info["libraries"] = versions
    machine_info["cpu_count"] = os.cpu_count()
    machine_info["memory_bytes"] = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        import torch

        machine_info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        machine_info["torch_threads"] = None
    machine_info["normlab"] = {
        "version": normlab.__version__,
        "path": os.path.dirname(normlab.__file__),
        "backends": [
            {"name": b.name, "provided_by": b.provided_by, "reason": b.reason, "version": b.version}
            for b in normlab.list_backends()
        ],
        "plugin_failures": [
            f"{f.plugin} ({f.source}): {f.error}" for f in normlab.plugin_failures()
        ],
    }


def pytest_benchmark_update_json(
    config: pytest.Config, benchmarks: list[Any], output_json: dict[str, Any]
) -> None:
    state = config.stash[_STATE]
    if not state.active:  # another benchmark file of this folder: its JSON is its own
        return
    for bench in output_json["benchmarks"]:
        bench["stats"].pop("data", None)
        bench.pop("params", None)  # the case objects; extra_info says the same as plain data
        bench.pop("options", None)  # defaults that benchmark.pedantic does not use
    output_json["normlab"] = {
        "matrix": state.matrix,
        "budget_s": state.budget_s,
        "elapsed_s": state.elapsed(),
        "min_rounds": state.min_rounds,
        "max_rounds": state.max_rounds,
        "load_average": {"start": list(state.load_at_start), "end": list(os.getloadavg())},
        "memory": state.memory,
        "skipped": state.skipped,
    }
