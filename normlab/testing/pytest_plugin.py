"""pytest plugin of the conformance suite: ``--normlab-backend NAME`` runs it against NAME.

Loaded with ``-p normlab.testing.pytest_plugin`` or through the ``pytest11`` entry point. Without
``--normlab-backend`` it changes nothing: it only adds its options and two fixtures that nothing
else requests, and imports no array library.

Options:
    --normlab-backend NAME  a backend to test (repeatable, or a comma list); the suite's tests
                            are parametrised over these backends. ``default:FAMILY`` tests the
                            default choice (no backend named) on FAMILY's arrays; ``default``
                            every installed family's.
    --normlab-profile P     ``ci`` (fast, derandomized; the default) or ``full`` (thorough).
    --normlab-xfail ID      tests whose node id contains ID are expected to fail (repeatable);
                            an ID that matches no collected test is reported with a warning.
    --normlab-json FILE     write every test's result to FILE as JSON (:mod:`.report`).
    --normlab-allow-unavailable
                            a backend unavailable here (no device, library not installed) has
                            its tests skipped with the reason; without it the run stops.
    --normlab-arrays FAMILY drive the backends with arrays of FAMILY, one their records serve
                            explicitly, on their device (``cupy`` with ``torch``: CUDA
                            tensors); by default, their records' own ``from_numpy``.

Before any test runs, each backend named must load: its module found and imported, every
function its record declares defined (:mod:`.preflight`); otherwise the run stops with one line
saying why (pytest's usage error, exit status 4). After the run, :class:`.report.Report` lists
the failures area by area, each with its first message and the code reproducing it, names each
area whose every test was skipped, and writes the JSON of ``--normlab-json FILE``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from hypothesis import settings

    from normlab.testing.subject import Subject

__all__ = [
    "normlab_settings",
    "normlab_subject",
    "pytest_addoption",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "pytest_generate_tests",
    "pytest_unconfigure",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("normlab", "normlab conformance suite")
    group.addoption(
        "--normlab-backend",
        action="append",
        default=[],
        metavar="NAME",
        help="run the normlab conformance suite against backend NAME (repeatable, or NAME,NAME)",
    )
    group.addoption(
        "--normlab-profile",
        choices=("ci", "full"),
        default="ci",
        help="ci: few generated cases, the same each run (default); full: many, new each run",
    )
    group.addoption(
        "--normlab-xfail",
        action="append",
        default=[],
        metavar="ID",
        help="expect tests whose node id contains ID to fail (warns if ID matches no test)",
    )
    group.addoption(
        "--normlab-allow-unavailable",
        action="store_true",
        help="skip the tests of a backend unavailable here (no device…) instead of failing",
    )
    group.addoption(
        "--normlab-arrays",
        default=None,
        metavar="FAMILY",
        help="drive the backends with FAMILY arrays they serve explicitly (cupy: torch)",
    )
    group.addoption(
        "--normlab-json",
        default=None,
        metavar="FILE",
        help="write every test's result to FILE as JSON (one backend; see docs/testing.md)",
    )


def pytest_configure(config: pytest.Config) -> None:
    names = backend_names(config)
    if not names:
        return
    from normlab.testing.preflight import obstacle

    allow = bool(config.getoption("normlab_allow_unavailable"))
    problems = [p for p in (obstacle(name, allow_unavailable=allow) for name in names) if p]
    if problems:
        raise pytest.UsageError("normlab check: " + "; ".join(problems))
    family = config.getoption("normlab_arrays")
    if family is not None:
        from normlab.testing.conversions import drive

        for name in names:
            try:
                drive(name, family)
            except ValueError as exc:
                raise pytest.UsageError(f"normlab check: {exc}") from None
    json_path = config.getoption("normlab_json")
    if json_path is not None and len(names) != 1:
        raise pytest.UsageError("normlab check: --normlab-json takes a run of one backend")
    from normlab.testing.report import Report

    profile = config.getoption("normlab_profile")
    for name in names:
        report = Report(name, profile, json_path, family)
        config.pluginmanager.register(report, f"normlab-report-{name}")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Backends driven with ``--normlab-arrays`` get their own arrays again (a later run in
    this process starts afresh)."""
    if config.getoption("normlab_arrays", None) is None:
        return
    from normlab.testing.conversions import drive

    for name in backend_names(config):
        drive(name, None)


def backend_names(config: pytest.Config) -> list[str]:
    """The backends named with ``--normlab-backend``, in order, without repeats; ``default``
    stands for the default subject of every installed family (``default:numpy``, …)."""
    names: list[str] = []
    for value in config.getoption("normlab_backend"):
        for part in (p.strip() for p in value.split(",")):
            if part == "default":
                from normlab.testing.default_choice import default_subjects

                names.extend(default_subjects())
            elif part:
                names.append(part)
    return list(dict.fromkeys(names))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "normlab_subject" not in metafunc.fixturenames:
        return
    names = backend_names(metafunc.config)
    if names:
        metafunc.parametrize("normlab_subject", names, indirect=True, ids=names, scope="session")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ids = list(dict.fromkeys(config.getoption("normlab_xfail")))
    if not ids:
        return
    matched = dict.fromkeys(ids, 0)
    for item in items:
        for xfail_id in ids:
            if xfail_id in item.nodeid:
                item.add_marker(pytest.mark.xfail(reason=f"--normlab-xfail {xfail_id}"))
                matched[xfail_id] += 1
    for xfail_id, count in matched.items():
        if count == 0:
            config.issue_config_time_warning(
                pytest.PytestWarning(f"--normlab-xfail {xfail_id!r} matches no collected test"),
                stacklevel=2,
            )


@pytest.fixture(scope="session")
def normlab_subject(request: pytest.FixtureRequest) -> Subject:
    """The backend under test (parametrised by ``--normlab-backend``)."""
    name: Any = getattr(request, "param", None)
    if name is None:
        pytest.skip("no backend under test: pass --normlab-backend NAME (or normlab check NAME)")
    from normlab.testing.subject import Subject

    return Subject.of(name)


@pytest.fixture(scope="session")
def normlab_settings(request: pytest.FixtureRequest) -> settings:
    """The hypothesis settings of ``--normlab-profile``."""
    from normlab.testing.strategies import profile

    return profile(request.config.getoption("normlab_profile"))
