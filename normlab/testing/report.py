"""What a run of the suite tells a plugin author: per area, in a fixed order, one entry per
failing test with its first failure's message and the code that reproduces it; areas whose
every test was skipped; and, on request, every result as JSON.

The JSON file (``--normlab-json FILE``, ``normlab check NAME --json FILE``,
``normlab.testing.check(..., json_path=...)``) holds::

    {"schema": 1, "normlab": "<version>", "backend": NAME, "provided_by": "<source>",
     "profile": "ci" | "full",
     "fused": {"add_layer_norm": "kernel" | "composed" | null, "add_rms_norm": ...},
     "results": [{"id": "test_layouts.py::test_out[NAME-...]", "area": "out/in place",
                  "outcome": "passed" | "failed" | "skipped" | "xfailed" | "xpassed" | "error",
                  "message": "<first line of the failure or skip reason, or null>",
                  "reproduce": "<runnable code, or null>"}, ...]}

``fused`` says how the fused ops' tests reached the backend (:func:`.subject.fused_path`): its
own kernel, the core's composition around its base op, or neither (their tests skipped).
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import pytest

from normlab.ops import FUSED_OPS, OPS
from normlab.testing.areas import AREAS, area_of, rank_of

__all__ = ["SCHEMA", "Report", "Result"]

#: The version of the JSON file's layout.
SCHEMA: Final = 1

_REPRODUCE: Final = "Reproduce with:"

#: fused_path's answer -> how the summary says it.
_FUSED_PATHS: Final = {
    "kernel": "was tested through {backend}'s own fused kernel",
    "composed": "was tested through the core's composition ({backend}'s record lists {base}, "
    "not {op}): x + residual with x's library, then {backend}'s {base}",
    "default": "was tested through the default choice (no backend named)",
    None: "was not tested: {backend} provides neither it nor {base}",
}


@dataclass
class Result:
    """One suite test's outcome."""

    id: str
    area: str
    outcome: str
    message: str | None
    reproduce: str | None


class Report:
    """A pytest plugin collecting each suite test's :class:`Result`; at the end of the run it
    writes the failures by area (and the all-skipped areas) and, given ``json_path``, the
    JSON file."""

    def __init__(
        self, backend: str, profile: str, json_path: str | None, arrays: str | None = None
    ) -> None:
        self.backend = backend
        self.profile = profile
        #: the family the backend is driven with (``--normlab-arrays``), None for its own
        self.arrays = arrays
        self.json_path = json_path
        self.results: dict[str, Result] = {}
        self._failures: dict[str, BaseException] = {}

    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> None:
        if call.excinfo is not None and item.nodeid not in self._failures:
            self._failures[item.nodeid] = call.excinfo.value

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        area = area_of(report.nodeid)
        if area is None or not self._tests_backend(report.nodeid):
            return
        previous = self.results.get(report.nodeid)
        if previous is not None and previous.outcome not in ("passed",):
            return  # the first outcome that is not a pass stays (a failed teardown after a pass)
        if report.when != "call" and report.passed:
            return
        outcome, message, reproduce = self._outcome(report)
        test_id = report.nodeid.rsplit("/", 1)[-1]
        self.results[report.nodeid] = Result(test_id, area, outcome, message, reproduce)

    def _tests_backend(self, nodeid: str) -> bool:
        params = nodeid.rpartition("[")[2]
        return params.startswith(f"{self.backend}-") or params == f"{self.backend}]"

    def _outcome(self, report: pytest.TestReport) -> tuple[str, str | None, str | None]:
        if hasattr(report, "wasxfail"):
            return ("xfailed" if report.skipped else "xpassed"), report.wasxfail or None, None
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else None
            return (
                "skipped",
                None if reason is None else str(reason).removeprefix("Skipped: "),
                None,
            )
        if report.passed:
            return "passed", None, None
        exc = self._failures.get(report.nodeid)
        text = str(exc) if exc is not None else str(report.longrepr)
        head, _, tail = text.partition(_REPRODUCE)
        lines = [line for line in head.strip().splitlines() if line.strip()]
        kind = type(exc).__name__ if exc is not None else "error"
        message = f"{kind}: {lines[0]}" if lines else kind
        reproduce = _snippet(tail) if tail else self._rerun(report.nodeid)
        return ("failed" if report.when == "call" else "error"), message, reproduce

    def _rerun(self, nodeid: str) -> str:
        test = nodeid.rsplit("::", 1)[-1].split("[")[0]
        arrays = "" if self.arrays is None else f" --arrays {self.arrays}"
        return f"Reproduce with:\n    normlab check {self.backend}{arrays} -- -k {test}"

    def in_area_order(self) -> list[Result]:
        """The results, area by area in :data:`AREAS` order (see :func:`.areas.rank_of`)."""
        return [self.results[k] for k in sorted(self.results, key=rank_of)]

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        write = terminalreporter.write_line
        failed = [r for r in self.in_area_order() if r.outcome in ("failed", "error", "xpassed")]
        if failed:
            terminalreporter.section(f"normlab check {self.backend}: failures by area")
            area = None
            for result in failed:
                if result.area != area:
                    area = result.area
                    write(f"[{area}]", bold=True)
                write(f"{result.outcome.upper()} {result.id}: {result.message}", red=True)
                if result.reproduce:
                    write("    " + result.reproduce.replace("\n", "\n    "))
        if any(r.area == "fused" for r in self.results.values()):
            for op, path in self.fused_paths().items():
                how = _FUSED_PATHS[path].format(backend=self.backend, op=op, base=OPS[op].base)
                write(f"normlab: {op} {how}")
        for area in AREAS:
            results = [r for r in self.results.values() if r.area == area]
            if results and all(r.outcome == "skipped" for r in results):
                write(
                    f"normlab: every test of area {area!r} was skipped ({len(results)}), "
                    f"e.g. {results[0].message}",
                    yellow=True,
                )
        if self.json_path is not None:
            self.write_json(Path(self.json_path))
            write(f"normlab: results written to {self.json_path}")

    def fused_paths(self) -> dict[str, str | None]:
        """fused op -> how its tests reached the backend (:func:`.subject.fused_path`)."""
        from normlab.testing.subject import fused_path

        return {op: fused_path(self.backend, op) for op in FUSED_OPS}

    def write_json(self, path: Path) -> None:
        import normlab

        document = {
            "schema": SCHEMA,
            "normlab": normlab.__version__,
            "backend": self.backend,
            "provided_by": _provided_by(self.backend),
            "profile": self.profile,
            "fused": self.fused_paths(),
            "results": [asdict(r) for r in self.in_area_order()],
        }
        path.write_text(json.dumps(document, indent=1) + "\n")


def _provided_by(name: str) -> str:
    """Where subject ``name``'s record comes from (a default subject: the dispatcher's)."""
    from normlab import registry
    from normlab.testing.default_choice import candidates, default_family, is_default

    if is_default(name):
        family = default_family(name)
        chosen = ", ".join(b.name for b in candidates(family))
        return f"the default choice among {chosen}"
    return registry.get(name).provided_by


def _snippet(tail: str) -> str:
    """The indented code after "Reproduce with:" in a failure message, re-indented by four
    spaces; pytest's own explanation of an assert (from a line "assert ..." on) left out."""
    body: list[str] = []
    for line in tail.splitlines()[1:]:
        if line.strip() and not line.startswith(" "):
            break
        body.append(line)
    code = textwrap.dedent("\n".join(body)).strip("\n")
    return f"{_REPRODUCE}\n" + textwrap.indent(code, "    ")
