"""pytest plugin of the conformance suite: ``--normlab-backend NAME`` runs it against NAME.

Loaded with ``-p normlab.testing.pytest_plugin`` or through the ``pytest11`` entry point. Without
``--normlab-backend`` it changes nothing: it only adds its options and two fixtures that nothing
else requests, and imports no array library.

Options:
    --normlab-backend NAME  a backend to test (repeatable, or a comma list); the suite's tests
                            are parametrised over these backends.
    --normlab-profile P     ``ci`` (fast, derandomized; the default) or ``full`` (thorough).
    --normlab-xfail ID      tests whose node id contains ID are expected to fail (repeatable);
                            an ID that matches no collected test is reported with a warning.
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
    "pytest_generate_tests",
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


def backend_names(config: pytest.Config) -> list[str]:
    """The backends named with ``--normlab-backend``, in order, without repeats."""
    names: list[str] = []
    for value in config.getoption("normlab_backend"):
        names.extend(part.strip() for part in value.split(",") if part.strip())
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
