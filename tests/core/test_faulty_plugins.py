"""Faulty plugins: one bad plugin never takes the rest down.

Every fault of :mod:`tests.support.faulty_plugins` is installed at once, as entry points of a fake
distribution ``faulty-plugins 0.1`` on the path of a child interpreter: plugins that fail to
import, raise in their hook or return malformed records, plus backends whose availability check
raises or returns a bool, whose module is missing or whose kernel crashes. Each failure must
name the plugin and its distribution, ``normlab info`` must show it, and every other backend must
keep giving the reference result.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import numpy as np
import pytest

from tests.support import faulty_plugins
from tests.support.paths import ROOT

pytest.importorskip("torch", reason="the faulty-plugin processes compare torch results too")
import normlab
from normlab import registry
from tests.support.faulty_plugins import FAULTS, IMPORT_FAILURES, LOADED

DISTRIBUTION = "faulty-plugins 0.1"


def install(folder: Path, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """A fake installed distribution ``faulty-plugins 0.1`` in ``folder`` with these entry points
    (name -> value) in the ``normlab`` group, and these plugin modules (name -> source)."""
    info = folder / "faulty_plugins-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: faulty-plugins\nVersion: 0.1\n")
    lines = [f"{name} = {value}" for name, value in entry_points.items()]
    (info / "entry_points.txt").write_text("[normlab]\n" + "\n".join(lines) + "\n")
    for name, source in modules.items():
        (folder / f"{name}.py").write_text(source)


def run_python(
    folder: Path, code: str, *args: str, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess[str]:
    """``python -c code`` (or ``python -m ...`` with ``args``) with ``folder`` on the path."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NORMLAB_")}
    environment.update(PYTHONPATH=os.pathsep.join([str(folder), str(ROOT)]), COLUMNS="1000", **env)
    command = [sys.executable, *(args or ("-c", textwrap.dedent(code)))]
    return subprocess.run(
        command, env=environment, capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.fixture(scope="module")
def faulty_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the fake distribution with every handled fault, and the good plugin."""
    folder = tmp_path_factory.mktemp("site")
    install(
        folder, {**LOADED, **{name: value for name, (value, _) in FAULTS.items()}}, IMPORT_FAILURES
    )
    return folder


#: Run in the child: what loaded, what failed, and what every backend computes.
CHILD = """
import json, warnings
import numpy as np
import normlab
from normlab import reference

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    backends = {b.name: b for b in normlab.list_backends()}
x = np.random.default_rng(0).standard_normal((4, 8))
expected = reference.layer_norm(x)[0]
results = {}
for name in ("numpy", "numba", "torch", "survivor", "faulty_unwell", "faulty_homeless",
             "faulty_kernel", "faulty_twin", "faulty_boolean"):
    array = x.astype(np.float32)
    if name == "torch":
        import torch
        array = torch.from_numpy(array)
    try:
        y = np.asarray(normlab.layer_norm(array, backend=name), dtype=np.float64)
        results[name] = "ok" if np.allclose(y, expected, atol=1e-4) else "wrong"
    except normlab.NormlabError as exc:
        results[name] = f"NormlabError: {exc}"
    except Exception as exc:
        results[name] = f"raw {type(exc).__name__}: {exc}"
default = normlab.layer_norm(x)
print(json.dumps({
    "failures": [[f.plugin, f.source, f.error] for f in normlab.plugin_failures()],
    "warnings": [str(w.message) for w in caught if issubclass(w.category, normlab.NormlabWarning)],
    "backends": {n: [b.provided_by, b.reason] for n, b in backends.items()},
    "results": results,
    "default": bool(np.allclose(default, expected)),
}))
"""


@pytest.fixture(scope="module")
def outcome(faulty_site: Path) -> dict[str, Any]:
    done = run_python(faulty_site, CHILD)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_every_failed_plugin_is_recorded_with_its_source(outcome: dict[str, Any]) -> None:
    failures = {plugin: (source, error) for plugin, source, error in outcome["failures"]}
    for name, (_, says) in FAULTS.items():
        assert name in failures, f"{name} failed silently"
        source, error = failures[name]
        assert source == DISTRIBUTION
        assert says in error, f"{name}: {error!r} does not say {says!r}"


def test_each_failure_is_warned_about_once(outcome: dict[str, Any]) -> None:
    for name in FAULTS:
        warned = [w for w in outcome["warnings"] if f"normlab plugin {name!r}" in w]
        assert len(warned) == 1, (name, outcome["warnings"])


def test_plugins_that_load_keep_their_backends(outcome: dict[str, Any]) -> None:
    backends = outcome["backends"]
    loaded = (
        "survivor",
        "faulty_twin",
        "faulty_unwell",
        "faulty_homeless",
        "faulty_kernel",
        "faulty_boolean",
    )
    for name in loaded:
        assert backends[name][0] == DISTRIBUTION
    assert backends["numpy"][0] == "built-in"  # not shadowed
    refused = ("faulty_half_done", "faulty_fast", "faulty_signed", "faulty_library")
    assert not set(refused) & set(backends)  # a refused plugin registers none of its records
    assert "OSError: the plugin's probe exploded" in backends["faulty_unwell"][1]
    assert "returned True, not None or a reason" in backends["faulty_boolean"][1]


def test_the_other_backends_keep_giving_the_reference(outcome: dict[str, Any]) -> None:
    results = outcome["results"]
    assert outcome["default"]
    for name in ("numpy", "numba", "torch", "survivor", "faulty_twin"):
        if name in ("numba", "torch") and not registry.get(name).available:
            continue
        assert results[name] == "ok", (name, results[name])


def test_broken_backends_say_which_backend_and_why(outcome: dict[str, Any]) -> None:
    results = outcome["results"]
    for name in ("faulty_unwell", "faulty_boolean"):
        assert results[name].startswith(f"NormlabError: backend {name!r}")
        assert "unavailable" in results[name]
    for name, says in (
        ("faulty_homeless", "no_such_backend_module_x"),
        ("faulty_kernel", "RuntimeError: the faulty kernel crashed"),
    ):
        assert results[name].startswith(f"NormlabError: backend {name!r}")
        assert DISTRIBUTION in results[name] and says in results[name]


def test_normlab_info_shows_what_is_wrong(faulty_site: Path) -> None:
    done = run_python(faulty_site, "", "-m", "normlab", "info")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "Plugins that failed to load" in out
    for name, (_, says) in FAULTS.items():
        row = next((line for line in out.splitlines() if f"│ {name} " in line), "")
        assert DISTRIBUTION in row and says in row, f"{name} is not shown: {row!r}"
    unwell = next(line for line in out.splitlines() if "│ faulty_unwell " in line)
    assert "unavailable — availability check raised OSError" in unwell
    assert "NormlabWarning" not in done.stderr


# --------------------------------------------------------------------------------------------
# A kernel that crashes at call time (in this process)


@pytest.fixture
def kernel_raises() -> Iterator[None]:
    normlab.register_plugin(faulty_plugins.KERNEL_RAISES)
    yield
    normlab.unregister_plugin(faulty_plugins.KERNEL_RAISES)


@pytest.mark.usefixtures("kernel_raises")
def test_a_crashing_kernel_leaves_the_other_backends_working() -> None:
    x = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    expected = normlab.layer_norm(x, backend="numpy")
    for _ in range(2):  # a failed call leaves no state behind: the second behaves the same
        with pytest.raises(normlab.BackendError, match="the faulty kernel crashed"):
            normlab.layer_norm(x, backend="faulty_kernel")
        with normlab.use_backend("faulty_kernel"):  # it serves no float64: others do
            wide = normlab.layer_norm(x.astype(np.float64))
        np.testing.assert_allclose(wide, expected, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(normlab.layer_norm(x, backend="numpy"), expected)


@pytest.mark.usefixtures("kernel_raises")
def test_a_crashing_kernel_is_a_backend_error_naming_backend_and_plugin() -> None:
    x = np.ones((3, 5), np.float32)
    with pytest.raises(normlab.BackendError) as info:
        normlab.layer_norm(x, backend="faulty_kernel")
    message = str(info.value)
    assert "faulty_kernel" in message and "register_plugin(kernel_raises)" in message
    assert "the faulty kernel crashed" in message
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.usefixtures("kernel_raises")
@pytest.mark.parametrize(
    ("op", "raised"),
    [
        ("layer_norm", RuntimeError),
        ("add_layer_norm", ValueError),
        ("layer_norm_backward", ValueError),
    ],
)
def test_every_op_reports_a_crashing_kernel_alike(op: str, raised: type) -> None:
    """Forward, fused and backward kernels that raise are one BackendError naming the backend,
    its plugin and the op, the kernel's exception as its cause (a backward kernel's ValueError
    used to reach the caller raw)."""
    x = np.ones((3, 5), np.float32)
    _, mean, rstd = normlab.layer_norm(x, return_stats=True, backend="numpy")
    args = {
        "layer_norm": (x,),
        "add_layer_norm": (x, x),
        "layer_norm_backward": (x, x, mean, rstd),
    }[op]
    with pytest.raises(normlab.BackendError) as info:
        getattr(normlab, op)(*args, backend="faulty_kernel")
    message = str(info.value)
    assert f"backend 'faulty_kernel' (from register_plugin(kernel_raises)) failed in {op}" in (
        message
    )
    assert isinstance(info.value.__cause__, raised)


# --------------------------------------------------------------------------------------------
# Plugins that call normlab while they are loaded, and sys.exit() in plugin code

#: Plugin modules that call normlab while the registry is being built.
REENTRANT: Final = {
    "calls_at_import": "import normlab\nnormlab.list_backends()\n",
    "calls_in_hook": (
        "import numpy as np, normlab\n"
        "@normlab.hookimpl\n"
        "def normlab_backends():\n"
        "    normlab.explain(np.ones((2, 3), np.float32))\n"
        "    return []\n"
    ),
    "swallows_the_error": (
        "import normlab\n"
        "try:\n"
        "    normlab.list_backends()\n"
        "except normlab.BackendError:\n"
        "    pass\n"
        "from tests.support.faulty_plugins import record\n"
        "@normlab.hookimpl\n"
        "def normlab_backends():\n"
        "    return [record('faulty_sly')]\n"
    ),
}


def test_a_plugin_calling_normlab_while_loaded_fails_instead_of_deadlocking(
    tmp_path: Path,
) -> None:
    """Today the first call hangs for ever (the registry's lock is not re-entrant); the timeout
    turns a regression into a failure, not a stuck CI job."""
    install(tmp_path, {name: name for name in REENTRANT}, REENTRANT)
    code = """
    import json, warnings
    import numpy as np, normlab
    warnings.simplefilter("ignore")
    y = normlab.layer_norm(np.ones((2, 3), np.float32))
    print(json.dumps({
        "failures": {f.plugin: f.error for f in normlab.plugin_failures()},
        "backends": sorted(b.name for b in normlab.list_backends()),
    }))
    """
    try:
        done = run_python(tmp_path, code, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the first call deadlocked while plugins called normlab")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    message = "normlab is loading plugins; do not call normlab from a plugin's import or hook"
    assert set(found["failures"]) == set(REENTRANT)
    assert all(message in error for error in found["failures"].values()), found["failures"]
    assert "faulty_sly" not in found["backends"] and "numpy" in found["backends"]


def _exit() -> Any:
    sys.exit(4)


EXITS_IN_HOOK = faulty_plugins.plugin("exits_in_hook", _exit)
EXITS_IN_CHECK = faulty_plugins.plugin(
    "exits_in_check", lambda: [faulty_plugins.record("faulty_quitter", check=_exit)]
)


def test_a_hook_calling_sys_exit_is_a_backend_error() -> None:
    with pytest.raises(normlab.BackendError, match="SystemExit: 4"):
        normlab.register_plugin(EXITS_IN_HOOK)
    assert "exits_in_hook" not in {b.provided_by for b in normlab.list_backends()}


def test_a_check_calling_sys_exit_makes_the_backend_unavailable() -> None:
    normlab.register_plugin(EXITS_IN_CHECK)
    try:
        (backend,) = (b for b in normlab.list_backends() if b.name == "faulty_quitter")
        assert not backend.available
        assert "SystemExit: 4" in str(backend.reason)
        x = np.ones((2, 3), np.float32)
        np.testing.assert_allclose(normlab.layer_norm(x), normlab.layer_norm(x, backend="numpy"))
    finally:
        normlab.unregister_plugin(EXITS_IN_CHECK)


@pytest.fixture
def exiting_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A backend ``faulty_exiting`` whose forward and backward kernels call ``sys.exit``."""
    module = types.ModuleType("faulty_exiting_kernels")
    module.layer_norm = lambda *a, **k: _exit()  # type: ignore[attr-defined]
    module.layer_norm_backward = lambda *a, **k: _exit()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    plugin = faulty_plugins.plugin(
        "exiting_kernels",
        lambda: [
            faulty_plugins.record(
                "faulty_exiting",
                module=module.__name__,
                ops=frozenset({"layer_norm", "layer_norm_backward"}),
            )
        ],
    )
    normlab.register_plugin(plugin)
    yield
    normlab.unregister_plugin(plugin)


@pytest.mark.usefixtures("exiting_kernels")
def test_a_kernel_calling_sys_exit_is_a_backend_error() -> None:
    x = np.ones((2, 3), np.float32)
    with pytest.raises(normlab.BackendError, match=r"faulty_exiting.*SystemExit: 4"):
        normlab.layer_norm(x, backend="faulty_exiting")
    _, mean, rstd = normlab.layer_norm(x, backend="numpy", return_stats=True)
    with pytest.raises(normlab.BackendError, match=r"faulty_exiting.*SystemExit: 4"):
        normlab.layer_norm_backward(x, x, mean, rstd, backend="faulty_exiting")


def test_a_misspelt_backend_name_imports_no_array_library(tmp_path: Path) -> None:
    """Listing the registered names runs no availability check: no CuPy import, no CUDA probe."""
    code = """
    import json, sys
    import numpy as np, normlab
    try:
        normlab.layer_norm(np.ones((2, 3), np.float32), backend="cpuy")
    except normlab.BackendError as exc:
        message = str(exc)
    print(json.dumps({
        "message": message,
        "imported": sorted(m for m in ("cupy", "torch", "numba") if m in sys.modules),
    }))
    """
    done = run_python(tmp_path, code, NORMLAB_DISABLE_PLUGIN_AUTOLOAD="1")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert "unknown backend 'cpuy'" in found["message"] and "cupy" in found["message"]
    assert found["imported"] == []


BROKEN_METADATA = """
import json, warnings
import numpy as np
import normlab
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    y = normlab.layer_norm(np.ones((2, 4), np.float32))
print(json.dumps({
    "failures": [[f.plugin, f.error] for f in normlab.plugin_failures()],
    "backends": sorted(b.name for b in normlab.list_backends()),
}))
"""


@pytest.mark.parametrize(
    "broken",
    ["entry point line without =", "entry_points.txt not UTF-8", "METADATA not UTF-8"],
)
def test_broken_metadata_of_any_distribution_is_reported_and_skipped(
    tmp_path: Path, broken: str
) -> None:
    """A distribution anywhere on the path whose metadata cannot be read (a line of
    entry_points.txt without ``=``, a file that is not UTF-8) is one recorded failure; the
    built-in backends and every other distribution's plugins still load (before: every call
    raised TypeError or UnicodeDecodeError)."""
    install(tmp_path, LOADED, {})
    bad = tmp_path / "broken_dist-1.0.dist-info"
    bad.mkdir()
    metadata = b"Metadata-Version: 2.1\nName: broken-dist\nVersion: 1.0\n"
    entry_points = b"[normlab]\nnonsense line\n"
    if broken == "entry_points.txt not UTF-8":
        entry_points = b"[normlab]\nx = \xff\xfe:mod\n"
    elif broken == "METADATA not UTF-8":
        metadata = b"Metadata-Version: 2.1\nName: broken-\xff\nVersion: 1.0\n"
        entry_points = b"[normlab]\nx = some_module\n"
    (bad / "METADATA").write_bytes(metadata)
    (bad / "entry_points.txt").write_bytes(entry_points)
    done = run_python(tmp_path, BROKEN_METADATA)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert "numpy" in report["backends"] and "survivor" in report["backends"], report
    errors = [error for _, error in report["failures"]]
    assert any("metadata unreadable" in e or "import failed" in e for e in errors), report


def test_a_plugin_that_is_none_is_refused_naming_it() -> None:
    """register_plugin(None), or an entry point resolving to None: a BackendError, not pluggy's
    AssertionError."""
    with pytest.raises(normlab.BackendError, match="is None"):
        normlab.register_plugin(None)


def test_a_plugin_name_registered_twice_names_both_sources() -> None:
    first = faulty_plugins.plugin("twice", lambda: [faulty_plugins.record("twice_first")])
    normlab.register_plugin(first, name="twice-plugin")
    second = faulty_plugins.plugin("twice", lambda: [faulty_plugins.record("twice_second")])
    try:
        with pytest.raises(normlab.BackendError, match="registered before from"):
            normlab.register_plugin(second, name="twice-plugin")
    finally:
        normlab.unregister_plugin("twice-plugin")


#: torch's exceptions that steer its machinery (raised from a hook or mode while a kernel runs).
TORCH_CONTROL_FLOW: Final = (
    ("torch.utils.checkpoint", "_StopRecomputationError", ()),
    ("torch._subclasses.fake_tensor", "DataDependentOutputException", ("func",)),
    ("torch._subclasses.fake_tensor", "DynamicOutputShapeException", ("func",)),
    ("torch.fx.experimental.symbolic_shapes", "GuardOnDataDependentSymNode", ("cond",)),
)


@pytest.mark.usefixtures("kernel_raises")
@pytest.mark.parametrize(("module", "name", "fields"), TORCH_CONTROL_FLOW)
def test_torchs_control_flow_exceptions_pass_through(
    monkeypatch: pytest.MonkeyPatch, module: str, name: str, fields: tuple[str, ...]
) -> None:
    """An exception torch raises to steer its own machinery through a kernel (non-reentrant
    checkpointing stops its recomputation with one) reaches the caller as it is, not as a
    BackendError: torch catches it again."""
    pytest.importorskip("torch")
    kind = getattr(importlib.import_module(module), name)
    raised = kind(*(None for _ in fields))

    def raising(*args: Any, **kwargs: Any) -> Any:
        raise raised

    monkeypatch.setattr(faulty_plugins, "layer_norm", raising)
    with pytest.raises(kind) as info:
        normlab.layer_norm(np.ones((3, 5), np.float32), backend="faulty_kernel")
    assert info.value is raised
