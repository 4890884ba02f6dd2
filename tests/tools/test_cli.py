"""The ``normlab`` command: info, check, kernels, demo, and ``python -m normlab``."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

import pytest

import normlab
from normlab import cli
from tests.support.plugins_for_tests import record

#: The folder that holds the normlab package under test, for child processes.
PACKAGE_PARENT = Path(normlab.__file__).resolve().parent.parent

Register = Callable[..., ModuleType]


def _python_m_normlab(
    *args: str, path: Path | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m normlab ARGS`` in a child process with a wide console."""
    paths = [str(PACKAGE_PARENT)] + ([str(path)] if path is not None else [])
    child_env = dict(os.environ, COLUMNS="1000", PYTHONPATH=os.pathsep.join(paths), **env)
    return subprocess.run(
        [sys.executable, "-m", "normlab", *args],
        capture_output=True,
        text=True,
        env=child_env,
        timeout=300,
        check=False,
    )


@pytest.fixture
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tables as wide as their content, so cells do not wrap in the captured output."""
    monkeypatch.setenv("COLUMNS", "1000")


class _Plugin:
    """A plugin object whose hook returns the records it was given."""

    def __init__(self, records: list[normlab.BackendRecord]) -> None:
        self.records = records

    @normlab.hookimpl
    def normlab_backends(self) -> list[normlab.BackendRecord]:
        return self.records


def _failing_check() -> str | None:
    raise RuntimeError("the probe exploded")


@pytest.fixture
def sick_backends() -> Iterator[None]:
    """Two extra backends: one unavailable with a reason, one whose check raises."""
    absent = normlab.BackendRecord(
        name="cli_absent",
        module="json",  # found, so the record's own check decides
        families=frozenset({"numpy"}),
        devices=frozenset({"cpu"}),
        dtypes=frozenset({"float32"}),
        priority=-5,
        check=lambda: "no frobnicator here",
    )
    plugin = _Plugin([absent, dataclasses.replace(absent, name="cli_broken", check=_failing_check)])
    normlab.register_plugin(plugin, name="test_cli_sick")
    yield
    normlab.unregister_plugin(plugin)


def test_info_lists_every_backend(wide: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for backend in normlab.list_backends():
        assert backend.name in out
        assert backend.provided_by in out
    assert "built-in" in out
    numpy_row = next(line for line in out.splitlines() if "│ numpy " in line)
    assert "available" in numpy_row
    assert "unavailable" not in numpy_row
    assert "normlab info NAME" in out


def test_info_name_shows_all_one_backend_declares(
    wide: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["info", "numpy"]) == 0
    out = capsys.readouterr().out
    numpy = next(b for b in normlab.list_backends() if b.name == "numpy")
    assert "float16, bfloat16, float32, float64" in out
    assert ", ".join(sorted(numpy.ops)) in out
    assert ", ".join(sorted(numpy.capabilities)) in out
    assert f"numpy {numpy.version}" in out
    assert "flushes subnormals │ no " in out


def test_info_name_shows_a_declared_flush_to_zero(
    wide: None, register: Register, capsys: pytest.CaptureFixture[str]
) -> None:
    register(record("fake_ftz", flushes_subnormals=True))
    assert cli.main(["info", "fake_ftz"]) == 0
    out = capsys.readouterr().out
    assert "flushes subnormals │ yes — subnormal inputs are outside its contract" in out


def test_info_name_suggests_a_close_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info", "numab"]) == 2
    assert "did you mean 'numba'?" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["info"], ["info", "numba"], []])
def test_output_fits_80_columns(
    sick_backends: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "…" not in out  # no cell cut short
    if args == ["info"]:
        cells = " ".join(part.strip() for line in out.splitlines() for part in line.split("│")[2:3])
        assert "unavailable — availability check raised RuntimeError: the probe exploded" in (
            " ".join(cells.split())
        )


def test_info_marks_zero_copy_and_explicit_families(
    wide: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["info"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "numpy, torch+" in next(line for line in lines if "│ numba " in line)
    assert "cupy, torch*" in next(line for line in lines if "│ cupy " in line)


def test_info_survives_failing_checks(
    wide: None, sick_backends: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "unavailable — no frobnicator here" in out
    assert "unavailable — availability check raised RuntimeError: the probe exploded" in out
    assert "register_plugin(test_cli_sick)" in out


def test_info_says_why_cupy_is_unavailable_without_a_gpu(
    wide: None, capsys: pytest.CaptureFixture[str]
) -> None:
    cupy = next(b for b in normlab.list_backends() if b.name == "cupy")
    if cupy.available:
        pytest.skip("a CUDA device is present: cupy is available")
    assert cli.main(["info"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "│ cupy " in line)
    assert f"unavailable — {cupy.reason}"[:40] in row


def test_info_shows_plugin_failures(tmp_path: Path) -> None:
    (tmp_path / "cli_plugin_raises.py").write_text(
        textwrap.dedent(
            """
            import normlab

            @normlab.hookimpl
            def normlab_backends():
                raise RuntimeError("no records today")
            """
        )
    )
    result = _python_m_normlab(
        "info", path=tmp_path, NORMLAB_PLUGINS="cli_plugin_raises,cli_plugin_missing"
    )
    assert result.returncode == 0, result.stderr
    assert "Plugins that failed to load" in result.stdout
    assert "no records today" in result.stdout
    assert "cli_plugin_missing" in result.stdout
    assert "ModuleNotFoundError" in result.stdout
    assert "NormlabWarning" not in result.stderr  # shown once, in the table


def test_check_unknown_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "no_such_backend"]) == 2
    err = capsys.readouterr().err
    assert "no_such_backend" in err
    for backend in normlab.list_backends():
        assert backend.name in err


def test_check_forwards_profile_and_pytest_args(monkeypatch: pytest.MonkeyPatch) -> None:
    import normlab.testing

    calls = []

    def fake_check(
        backend_name: str,
        *,
        profile: str = "ci",
        allow_unavailable: bool = False,
        arrays: str | None = None,
        json_path: str | None = None,
        extra_pytest_args: tuple[str, ...] = (),
    ) -> int:
        calls.append(
            (backend_name, profile, allow_unavailable, arrays, json_path, extra_pytest_args)
        )
        return 7

    monkeypatch.setattr(normlab.testing, "check", fake_check)
    short = ("-q", "--tb=no", "-rN", "--disable-warnings")
    assert cli.main(["check", "numpy", "--profile", "full", "--", "-x", "-k", "offset"]) == 7
    assert cli.main(["check", "numpy", "--allow-unavailable", "--json", "r.json"]) == 7
    assert cli.main(["check", "numpy", "--verbose"]) == 7
    assert cli.main(["check", "numpy", "--arrays", "torch"]) == 7
    assert calls == [
        ("numpy", "full", False, None, None, (*short, "-x", "-k", "offset")),
        ("numpy", "ci", True, None, "r.json", short),
        ("numpy", "ci", False, None, None, ()),
        ("numpy", "ci", False, "torch", None, short),
    ]


@pytest.fixture
def unloadable_backends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Backends the suite must refuse before running a test: a module path with a typo, a
    module that raises on import, one that lacks its declared functions, one unavailable here."""
    (tmp_path / "cli_raising_backend.py").write_text("raise ImportError('libfoo.so not found')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    base = normlab.BackendRecord(
        name="cli_typo",
        module="normlab.backends.numpy_backendd",
        families=frozenset({"numpy"}),
        devices=frozenset({"cpu"}),
        dtypes=frozenset({"float32"}),
        priority=-5,
    )
    plugin = _Plugin(
        [
            base,
            dataclasses.replace(base, name="cli_raises", module="cli_raising_backend"),
            dataclasses.replace(base, name="cli_empty", module="json"),
            dataclasses.replace(
                base,
                name="cli_no_device",
                module="normlab.backends.numpy_backend",
                check=lambda: "no frobnicator here",
            ),
        ]
    )
    normlab.register_plugin(plugin, name="test_cli_unloadable")
    yield
    normlab.unregister_plugin(plugin)


_CANNOT_LOAD = {
    "cli_typo": "cannot be found: no module named 'normlab.backends.numpy_backendd'",
    "cli_raises": "failed to load its module 'cli_raising_backend': ImportError: libfoo",
    "cli_empty": "json defines no layer_norm, to_numpy, from_numpy",
}


@pytest.mark.parametrize(
    ("name", "allow"),
    [
        *((name, allow) for name in _CANNOT_LOAD for allow in (False, True)),
        ("cli_no_device", False),
    ],
)
def test_check_refuses_a_backend_that_cannot_load(
    unloadable_backends: None, capsys: pytest.CaptureFixture[str], name: str, allow: bool
) -> None:
    """One line saying why, exit 1, no test run; --allow-unavailable excuses only a backend
    that is unavailable here, never one that cannot load."""
    says = _CANNOT_LOAD.get(name, "unavailable here: no frobnicator here (--allow-unavailable")
    code = cli.main(["check", name, *(["--allow-unavailable"] if allow else [])])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.err.count("\n") == 1 and says in captured.err, captured.err
    assert "passed" not in captured.out and "skipped" not in captured.out


def test_info_shows_a_backend_whose_module_cannot_be_found_as_unavailable(
    wide: None, unloadable_backends: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["info"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "│ cli_typo " in line)
    assert "unavailable — its module 'normlab.backends.numpy_backendd' cannot be found" in row
    assert "normlab.backends.numpy_backendd" not in sys.modules


def test_check_allow_unavailable_skips(
    unloadable_backends: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["check", "cli_no_device", "--allow-unavailable", "--", "-k", "worked"])
    assert code == 0
    out = capsys.readouterr().out
    assert "skipped" in out and "passed" not in out
    assert "every test of area 'basics' was skipped" in out
    assert "unavailable here: no frobnicator here" in out


@pytest.mark.parametrize("allow", [False, True])
def test_pytest_option_refuses_a_backend_that_cannot_load(
    unloadable_backends: None, capsys: pytest.CaptureFixture[str], allow: bool
) -> None:
    """``pytest --normlab-backend NAME`` stops (usage error) before any test, saying why."""
    import normlab.testing

    code = normlab.testing.check("cli_typo", allow_unavailable=allow, extra_pytest_args=["-q"])
    assert code == pytest.ExitCode.USAGE_ERROR
    assert "no module named 'normlab.backends.numpy_backendd'" in capsys.readouterr().err
    code = normlab.testing.check("cli_no_device", extra_pytest_args=["-q"])
    assert code == pytest.ExitCode.USAGE_ERROR
    assert "unavailable here: no frobnicator here" in capsys.readouterr().err


def test_check_names_an_area_whose_tests_all_skipped(capsys: pytest.CaptureFixture[str]) -> None:
    """A backend that does not provide rms_norm: its rms_norm tests skip; an area holding only
    those is named. Areas with a test that ran are not."""
    code = cli.main(["check", "numpy", "--", "-q", "-k", "rms_norm_worked or test_eps_inside"])
    out = capsys.readouterr().out
    assert code == 0
    assert "every test of area" not in out
    from tests.support.mutants import registered

    with registered("std_plus_eps") as name:  # provides layer_norm only
        code = cli.main(["check", name, "--", "-q", "-k", "test_rms_norm_worked_example"])
    out = capsys.readouterr().out
    assert code == 0
    assert "every test of area 'basics' was skipped (" in out
    assert "does not provide rms_norm" in out


@pytest.mark.parametrize(
    ("flaw", "says"),
    [
        ("control", "add_layer_norm was tested through mutant_control's own fused kernel"),
        (
            "std_plus_eps",
            "add_layer_norm was tested through the core's composition (mutant_std_plus_eps's "
            "record lists layer_norm, not add_layer_norm)",
        ),
    ],
)
def test_check_says_how_the_fused_ops_were_tested(
    capsys: pytest.CaptureFixture[str], flaw: str, says: str
) -> None:
    """The summary names the path the fused tests took: the backend's own kernel, or the
    core's composition around its base op (and a fused op neither reaches)."""
    from tests.support.mutants import registered

    with registered(flaw) as name:
        code = cli.main(["check", name, "--", "-q", "-k", "test_fused_path"])
    out = capsys.readouterr().out
    assert code == 0
    assert says in out
    if flaw == "std_plus_eps":  # provides layer_norm only
        assert "add_rms_norm was not tested: mutant_std_plus_eps provides neither" in out


def test_check_needs_the_test_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    find_spec = importlib.util.find_spec

    def without_hypothesis(name: str, package: str | None = None) -> ModuleSpec | None:
        return None if name == "hypothesis" else find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", without_hypothesis)
    assert cli.main(["check", "numpy"]) == 2
    assert "needs hypothesis: pip install 'normlab[test]'" in capsys.readouterr().err


def test_pytest_args_only_for_check(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["info", "--", "-x"])
    assert exc.value.code == 2
    assert "only 'check'" in capsys.readouterr().err


def test_no_command_prints_help_and_a_status(
    wide: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert "usage: normlab" in out
    assert f"normlab {normlab.__version__}; backends: " in out
    for backend in normlab.list_backends():
        assert backend.name in out
    assert "normlab info" in out


@pytest.mark.parametrize("how", ["python -m normlab", "normlab"])
def test_no_command_imports_neither_numba_nor_cupy(how: str) -> None:
    run = (
        "runpy.run_module('normlab', run_name='__main__')"
        if how != "normlab"
        else ("sys.exit(normlab.cli.main([]))")
    )
    code = textwrap.dedent(
        f"""
        import atexit, runpy, sys
        import normlab.cli

        def report():
            heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("numba", "cupy"))
            print("HEAVY:", heavy)

        atexit.register(report)
        {run}
        """
    )
    env = dict(os.environ, COLUMNS="1000", PYTHONPATH=str(PACKAGE_PARENT))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "usage: normlab" in result.stdout
    assert "HEAVY: []" in result.stdout


def test_kernels(
    wide: None,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    cuda_cache_root: Path,
    cubins: Callable[[str], list[object]],
) -> None:
    cuda_compile = pytest.importorskip("normlab.backends.cuda_compile")
    problem = cuda_compile.nvrtc_problem()
    if problem is not None:
        pytest.skip(problem)
    cubins("sm_90")  # compiled once for every test that needs them (tests/conftest.py)
    monkeypatch.setenv("NORMLAB_CACHE_DIR", str(cuda_cache_root))  # the NVRTC tests' cubins
    status = cli.main(["kernels", "--arch", "sm_90"])
    out = capsys.readouterr().out
    reports = cuda_compile.compile_all("sm_90")  # from the cache the command filled
    for report in reports:
        assert f"│ {report.name} " in out
    assert status == (1 if any(r.spills or r.stack for r in reports) else 0)


@pytest.mark.parametrize(("stack", "spills"), [(16, 0), (0, 8)])
def test_kernels_fail_on_local_memory(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], stack: int, spills: int
) -> None:
    cuda_compile = pytest.importorskip("normlab.backends.cuda_compile")
    report = cuda_compile.KernelReport("ln_f32", "sm_90", 40, stack, spills, spills, 0)
    monkeypatch.setattr(cuda_compile, "compile_all", lambda arch: [report])
    monkeypatch.setattr(cuda_compile, "nvrtc_version", lambda: (13, 0))
    assert cli.main(["kernels", "--arch", "sm_90"]) == 1
    assert "ln_f32" in capsys.readouterr().err


def test_kernels_reports_a_compile_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cuda_compile = pytest.importorskip("normlab.backends.cuda_compile")

    def fail(arch: str) -> list[object]:
        raise cuda_compile.CudaCompileError(f"layer_norm.cu(12): error: nonsense for {arch}")

    monkeypatch.setattr(cuda_compile, "compile_all", fail)
    assert cli.main(["kernels", "--arch", "sm_80"]) == 1
    assert "layer_norm.cu(12): error: nonsense for sm_80" in capsys.readouterr().err


def test_demo(wide: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "[-1.342, -0.447, 0.447, 1.342]" in out
    assert "float32 [8, 128, 768]" in out
    assert "float16 [8, 128, 768]" in out
    for backend in normlab.list_backends():
        if backend.available:
            rows = [line for line in out.splitlines() if line.startswith(f"│ {backend.name} ")]
            assert len(rows) >= 3, backend.name  # the worked example and both batches


def test_python_m_normlab() -> None:
    version = _python_m_normlab("--version")
    assert version.returncode == 0
    assert version.stdout.strip() == f"normlab {normlab.__version__}"
    info = _python_m_normlab("info")
    assert info.returncode == 0, info.stderr
    assert "normlab backends" in info.stdout


def test_info_shows_the_numba_threading_layer(
    wide: None, capsys: pytest.CaptureFixture[str]
) -> None:
    numba = pytest.importorskip("numba")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    if numba.get_num_threads() == 1:
        assert "Numba threading layer: " in out
        return
    assert f"Numba threading layer: {numba.threading_layer()}\n" in out  # started by info


def test_info_in_a_fresh_process_names_the_layer_requested() -> None:
    pytest.importorskip("numba")
    result = _python_m_normlab("info", NUMBA_THREADING_LAYER="workqueue", NUMBA_NUM_THREADS="2")
    assert result.returncode == 0, result.stderr
    assert "Numba threading layer: workqueue" in result.stdout


def test_check_report_is_short_and_in_area_order(capsys: pytest.CaptureFixture[str]) -> None:
    """A backend computing ``std + eps``: no tracebacks, failures by area with the eps test
    named first, each failing test on one line followed by the code reproducing it."""
    from tests.support.mutants import registered

    with registered("std_plus_eps") as name:
        code = cli.main(["check", name, "--", "-k", "eps_inside or worked_example or test_out"])
    out = capsys.readouterr().out
    assert code == 1
    assert "Traceback" not in out and "def test_" not in out
    failed = [line for line in out.splitlines() if line.startswith("FAILED ")]
    assert failed[0].startswith("FAILED test_numerics.py::test_eps_inside_the_root[")
    assert "AssertionError: y (" in failed[0]
    areas = [line for line in out.splitlines() if line in ("[basics]", "[out/in place]")]
    assert areas == ["[basics]", "[out/in place]"]
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("FAILED "):
            assert lines[i + 1].strip() == "Reproduce with:", lines[i : i + 2]


def test_check_verbose_brings_tracebacks_back(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.support.mutants import registered

    with registered("std_plus_eps") as name:
        code = cli.main(["check", name, "--verbose", "--", "-k", "eps_inside_the_root"])
    assert code == 1
    assert "def test_eps_inside_the_root" in capsys.readouterr().out


def test_check_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``normlab check NAME --json FILE`` and ``check(..., json_path=)``: one result per test."""
    import json

    import normlab.testing
    from tests.support.mutants import registered

    path = tmp_path / "results.json"
    with registered("std_plus_eps") as name:
        code = cli.main(["check", name, "--json", str(path), "--", "-k", "worked_example"])
    assert code == 1
    document = json.loads(path.read_text())
    assert {k: v for k, v in document.items() if k != "results"} == {
        "schema": 1,
        "normlab": normlab.__version__,
        "backend": name,
        "provided_by": "register_plugin(tests.support.mutants.std_plus_eps)",
        "profile": "ci",
        "fused": {"add_layer_norm": "composed", "add_rms_norm": None},
    }
    by_outcome: dict[str, list[dict[str, str]]] = {}
    for result in document["results"]:
        assert set(result) == {"id", "area", "outcome", "message", "reproduce"}
        assert result["area"] == "basics"
        by_outcome.setdefault(result["outcome"], []).append(result)
    failed = by_outcome["failed"][0]
    assert failed["id"].startswith("test_numerics.py::test_worked_example[mutant_std_plus_eps-")
    assert failed["message"].startswith("AssertionError: ")
    assert failed["reproduce"].startswith("Reproduce with:\n    import normlab")
    skipped = by_outcome["skipped"][0]  # rms_norm: not provided
    assert "does not provide rms_norm" in skipped["message"] and skipped["reproduce"] is None

    api_path = tmp_path / "api.json"
    code = normlab.testing.check(
        "numpy", json_path=api_path, extra_pytest_args=["-q", "-k", "worked"]
    )
    assert code == 0
    results = json.loads(api_path.read_text())["results"]
    assert results and {r["outcome"] for r in results} == {"passed"}
