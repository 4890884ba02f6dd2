"""Every Python example in README.md and docs/ runs, as a reader would run it.

Each fenced ``python`` block is one self-contained example. A block is skipped, with the reason,
when a library it imports at top level is missing here or its backend is unavailable (torch,
numba, cupy); blocks that include a file with ``--8<--`` show code tested elsewhere.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import re
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from normlab import registry
from tests.support.paths import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```$", re.MULTILINE | re.DOTALL)
BACKEND_LIBRARIES = ("torch", "numba", "cupy")


class Example(NamedTuple):
    page: Path
    line: int
    code: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _examples() -> list[Example]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for match in FENCE.finditer(text):
            if "--8<--" not in match.group(1):
                line = text.count("\n", 0, match.start()) + 1
                found.append(Example(page, line, match.group(1)))
    return found


EXAMPLES = _examples()


def _missing(code: str) -> str | None:
    """Why this example cannot run here, or None."""
    for call in ast.walk(ast.parse(code)):
        for keyword in getattr(call, "keywords", ()):
            named = keyword.value
            if keyword.arg == "backend" and isinstance(named, ast.Constant):
                backend = registry.registry().backends.get(str(named.value))
                if backend is not None and not backend.available:
                    return f"the {named.value} backend is unavailable: {backend.reason}"
    for node in ast.parse(code).body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        for top in {name.partition(".")[0] for name in names}:
            if top in BACKEND_LIBRARIES:
                backend = registry.get(top)
                if not backend.available:
                    return f"the {top} backend is unavailable: {backend.reason}"
            elif importlib.util.find_spec(top) is None:
                return f"{top} is not installed"
    return None


def test_examples_are_found() -> None:
    pages = {example.page.name for example in EXAMPLES}
    assert {"README.md", "contract.md", "dispatch.md", "conventions.md", "plugins.md"} <= pages


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_example_runs(example: Example, no_preference: None) -> None:
    why = _missing(example.code)
    if why is not None:
        pytest.skip(why)
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        exec(compile(example.code, example.id, "exec"), {"__name__": "__example__"})
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    command = " && ".join(line for line in ci if line.startswith("python3 "))
    assert command
    assert command in (ROOT / "README.md").read_text()


# --------------------------------------------------------------------------------------------
# The built site reads right: no Sphinx role is left as literal text.

SPHINX_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|data|attr|exc|obj|const):")


def _roles_hook() -> Any:
    path = ROOT / "docs" / "hooks" / "sphinx_roles.py"
    spec = importlib.util.spec_from_file_location("sphinx_roles", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_hook_reduces_sphinx_roles_to_code() -> None:
    hook = _roles_hook()
    html = (
        "see :func:<code>layer_norm</code> and :class:<code>~normlab.errors.NormlabError</code>"
        ", :data:<code>CAPABILITIES</code>; a plain <code>x</code>: text"
    )
    assert hook.strip_roles(html) == (
        "see <code>layer_norm</code> and <code>NormlabError</code>, <code>CAPABILITIES</code>; "
        "a plain <code>x</code>: text"
    )


def test_the_site_hook_is_configured() -> None:
    assert "docs/hooks/sphinx_roles.py" in (ROOT / "mkdocs.yml").read_text()


def test_built_site_has_no_literal_sphinx_roles() -> None:
    """Scans the site ``nox -s docs`` built (it sets NORMLAB_SITE_DIR for this test)."""
    site = os.environ.get("NORMLAB_SITE_DIR")
    if not site:
        pytest.skip("no built site here: `python3 -m nox -s docs` builds one and runs this")
    pages = sorted(Path(site).rglob("*.html"))
    assert pages, f"no HTML under {site}"
    found = []
    for page in pages:
        # prose only: a listing of a source file (<pre>) shows its docstrings as they are
        text = re.sub(r"<(script|pre)\b.*?</\1>", "", page.read_text(), flags=re.DOTALL)
        found += [f"{page.relative_to(site)}: {m.group(0)}" for m in SPHINX_ROLE.finditer(text)]
    assert not found, found[:20]


# --------------------------------------------------------------------------------------------
# docs/plugins.md and docs/testing.md read as plain Markdown, and agree with the code

TITLED_BLOCK = re.compile(r'^```\w+ title="([^"]+)"\n(.*?)^```$', re.MULTILINE | re.DOTALL)


def _table_column(page: Path, header: str) -> list[str]:
    """The first cells (between backticks) of the Markdown table whose header starts with
    ``| header |``."""
    lines = page.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    cells = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells.append(line.split("|")[1].strip().strip("`"))
    return cells


@pytest.mark.parametrize("page", ["plugins.md", "testing.md"])
def test_plugin_pages_are_plain_markdown(page: str) -> None:
    """No include (--8<--) nor generated API block (:::): the files read completely where
    the README links them, on GitHub or in an editor."""
    text = (ROOT / "docs" / page).read_text()
    assert "--8<--" not in text and "\n::: " not in text


def test_inline_example_plugin_is_the_example_plugin() -> None:
    """Each block titled with a file of plugins/normlab-example is that file, exactly."""
    blocks = TITLED_BLOCK.findall((ROOT / "docs" / "plugins.md").read_text())
    titles = [title for title, _ in blocks]
    assert titles == [
        "plugins/normlab-example/pyproject.toml",
        "plugins/normlab-example/src/normlab_example/__init__.py",
        "plugins/normlab-example/src/normlab_example/backend.py",
    ]
    for title, body in blocks:
        assert body == (ROOT / title).read_text(), f"docs/plugins.md shows an old {title}"


def test_plan_table_lists_what_hookspecs_allows() -> None:
    from normlab.hookspecs import PLAN_FIELDS
    from normlab.spec import Plan

    listed = _table_column(ROOT / "docs" / "plugins.md", "plan field")
    assert listed == list(PLAN_FIELDS)
    assert all(hasattr(Plan, name) or name in Plan.__dataclass_fields__ for name in listed)


def test_record_table_lists_every_record_field() -> None:
    import dataclasses

    from normlab.hookspecs import BackendRecord

    listed = _table_column(ROOT / "docs" / "plugins.md", "field")
    assert listed == [f.name for f in dataclasses.fields(BackendRecord)]
