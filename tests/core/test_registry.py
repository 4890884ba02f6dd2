"""The plugin registry: built-ins through the hook, run-time plugins, conflicts, malformed records,
environment-loaded plugins, entry points, and lazy availability."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import numpy as np
import pytest

import normlab
from normlab import backends, registry
from normlab.ops import OPS
from normlab.registry import Registry
from tests.support import plugins_for_tests
from tests.support.paths import ROOT
from tests.support.plugins_for_tests import CALLS, FakeArray, plugin, raising_plugin, record

Register = Callable[..., ModuleType]


def _names() -> set[str]:
    return {b.name for b in normlab.list_backends()}


def test_builtins_are_registered_through_the_hook() -> None:
    manager = registry.registry().manager
    assert manager.get_plugin("normlab.backends") is backends
    records = [r for result in manager.hook.normlab_backends() for r in result]
    assert set(backends.BUILTIN_RECORDS) <= set(records)
    by_name = {b.name: b for b in normlab.list_backends()}
    for rec in backends.BUILTIN_RECORDS:
        assert by_name[rec.name].record is rec
        assert by_name[rec.name].provided_by == "built-in"


def test_register_plugin_adds_its_backends(register: Register) -> None:
    register(record("fake_a", priority=3), record("fake_b"), name="fake_pair")
    by_name = {b.name: b for b in normlab.list_backends()}
    assert by_name["fake_a"].priority == 3
    assert by_name["fake_a"].provided_by == "register_plugin(fake_pair)"
    assert by_name["fake_b"].families == frozenset({"fakelib"})


def test_registered_backend_runs_its_module_function(register: Register) -> None:
    register(record("fake_numpy", families=frozenset({"numpy"})))
    x = np.arange(12.0).reshape(3, 4)
    y = normlab.layer_norm(x, backend="fake_numpy")
    assert len(CALLS) == 1 and CALLS[0].plan.rows == 3
    np.testing.assert_allclose(y, normlab.layer_norm(x, backend="numpy"), atol=1e-12)


def test_register_plugin_returns_its_backends(register: Register) -> None:
    plugin_module = plugin(record("fake_returned"))
    try:
        (backend,) = normlab.register_plugin(plugin_module)
        assert backend is registry.get("fake_returned")
    finally:
        normlab.unregister_plugin(plugin_module)


def test_a_module_is_a_plugin() -> None:
    normlab.register_plugin(plugins_for_tests)
    try:
        assert (
            registry.get("env_plugin").provided_by
            == "register_plugin(tests.support.plugins_for_tests)"
        )
    finally:
        normlab.unregister_plugin(plugins_for_tests)
    assert "env_plugin" not in _names()


def test_duplicate_names_are_refused_naming_both_sources(register: Register) -> None:
    register(record("fake_dup"), name="first_plugin")
    with pytest.raises(normlab.BackendError) as info:
        register(record("fake_other"), record("fake_dup"), name="second_plugin")
    message = str(info.value)
    assert "fake_dup" in message
    assert "register_plugin(first_plugin)" in message
    assert "second_plugin" in message
    assert "fake_other" not in _names()  # all or nothing
    assert registry.get("fake_dup").provided_by == "register_plugin(first_plugin)"


def test_duplicate_names_within_one_plugin_are_refused(register: Register) -> None:
    with pytest.raises(normlab.BackendError, match="fake_twice"):
        register(record("fake_twice"), record("fake_twice", priority=1))
    assert "fake_twice" not in _names()


@pytest.mark.parametrize("name", ["numpy", "torch", "numba", "cupy"])
def test_a_builtin_cannot_be_shadowed(register: Register, name: str) -> None:
    with pytest.raises(normlab.BackendError, match=f"'{name}'.*already provided by built-in"):
        register(record(name, families=frozenset({"numpy"}), priority=1000), name="shadow")
    assert registry.get(name).provided_by == "built-in"


def test_the_same_plugin_cannot_be_registered_twice(register: Register) -> None:
    plugin_module = register(record("fake_once"))
    with pytest.raises(normlab.BackendError, match="already registered"):
        normlab.register_plugin(plugin_module)


@pytest.mark.parametrize(
    ("bad", "pattern"),
    [
        ({"name": "numpy", "families": ["numpy"]}, "not a BackendRecord"),
        (record("fake_bad", capabilities=frozenset({"fast"})), r"unknown capabilities \['fast'\]"),
        (record("fake_bad", families=["fakelib"]), "families must be a frozenset"),  # type: ignore[arg-type]
        (record("fake_bad", dtypes="float32"), "dtypes must be a frozenset"),  # type: ignore[arg-type]
        (record("fake_bad", devices=frozenset({1})), "devices must be a frozenset of str"),  # type: ignore[arg-type]
        (record("fake_bad", ops=("layer_norm",)), "ops must be a frozenset"),  # type: ignore[arg-type]
        (record("fake_bad", priority="high"), "priority must be an int"),  # type: ignore[arg-type]
        (record("fake_bad", flushes_subnormals="yes"), "flushes_subnormals must be a bool"),
        (record("fake bad"), "not an identifier"),
        (record("fake_bad", module=""), "module must be an import path"),
    ],
    ids=[
        "dict",
        "capability",
        "families",
        "dtypes",
        "devices",
        "ops",
        "priority",
        "flushes_subnormals",
        "name",
        "path",
    ],
)
def test_malformed_records_are_refused(register: Register, bad: Any, pattern: str) -> None:
    with pytest.raises(normlab.BackendError, match=pattern) as info:
        register(record("fake_good"), bad, name="malformed_plugin")
    assert "malformed_plugin" in str(info.value)
    assert "fake_good" not in _names()


def test_a_mutable_set_field_is_refused(register: Register) -> None:
    with pytest.raises(normlab.BackendError, match="families must be a frozenset"):
        register(record("fake_set", families={"fakelib"}))  # type: ignore[arg-type]


@pytest.mark.parametrize(("result", "pattern"), [(None, "must return a list"), ([], "provides no")])
def test_hook_results_that_are_not_records(result: Any, pattern: str) -> None:
    module = ModuleType("empty_plugin")
    module.normlab_backends = normlab.hookimpl(lambda: result)  # type: ignore[attr-defined]
    with pytest.raises(normlab.BackendError, match=pattern):
        normlab.register_plugin(module)


def test_a_hook_that_raises_names_the_plugin() -> None:
    with pytest.raises(normlab.BackendError, match=r"broken_plugin.*RuntimeError.*broken"):
        normlab.register_plugin(raising_plugin("broken_plugin"))
    assert not registry.registry().manager.has_plugin("broken_plugin")


def test_a_refused_plugin_leaves_nothing_behind(register: Register) -> None:
    with pytest.raises(normlab.BackendError):
        register(record("fake_retry", capabilities=frozenset({"fast"})), name="retry_plugin")
    register(record("fake_retry"), name="retry_plugin")
    assert "fake_retry" in _names()


@pytest.mark.parametrize("by_name", [False, True])
def test_unregister(register: Register, by_name: bool) -> None:
    plugin_module = register(record("fake_gone"), name="gone_plugin")
    normlab.unregister_plugin("gone_plugin" if by_name else plugin_module)
    assert "fake_gone" not in _names()
    with pytest.raises(normlab.BackendError, match="unknown backend 'fake_gone'"):
        normlab.layer_norm(FakeArray(np.ones((2, 3))), backend="fake_gone")
    with pytest.raises(normlab.BackendError, match="not registered"):
        normlab.unregister_plugin(plugin_module)


def test_unregister_refuses_builtins_and_strangers() -> None:
    with pytest.raises(normlab.BackendError, match="built-in"):
        normlab.unregister_plugin("normlab.backends")
    with pytest.raises(normlab.BackendError, match="not registered"):
        normlab.unregister_plugin("no_such_plugin")
    assert {"numpy", "torch"} <= _names()


def test_a_reregistered_backend_name_runs_the_new_module(register: Register) -> None:
    x = np.ones((2, 3))
    first = register(record("fake_again", families=frozenset({"numpy"})), name="first")
    normlab.layer_norm(x, backend="fake_again")
    normlab.unregister_plugin(first)
    register(
        record("fake_again", families=frozenset({"numpy"}), module="no_such_module_x"),
        name="second",
    )
    with pytest.raises(normlab.BackendError, match="no_such_module_x"):
        normlab.layer_norm(x, backend="fake_again")


# --------------------------------------------------------------------------------------------
# Lazy availability and lazy loading


def test_availability_is_checked_lazily_and_once(register: Register) -> None:
    checks: list[int] = []

    def check() -> str | None:
        checks.append(1)
        return "no fake accelerator"

    register(record("fake_lazy", check=check))
    assert checks == []
    backend = registry.get("fake_lazy")
    assert not backend.available
    assert backend.reason == "no fake accelerator"
    assert checks == [1]


def test_a_check_that_raises_makes_the_backend_unavailable(register: Register) -> None:
    def check() -> str | None:
        raise OSError("driver exploded")

    register(record("fake_bad_check", check=check))
    assert "OSError: driver exploded" in (registry.get("fake_bad_check").reason or "")


def test_a_module_that_fails_to_import_names_backend_and_module(register: Register) -> None:
    register(record("fake_missing", module="no_such_module_for_normlab"))
    with pytest.raises(normlab.BackendError, match=r"fake_missing.*no_such_module_for_normlab"):
        normlab.layer_norm(FakeArray(np.ones((2, 3))), backend="fake_missing")


def test_a_declared_op_without_a_function(register: Register) -> None:
    register(record("fake_no_op", module="json"))
    with pytest.raises(normlab.BackendError, match="defines no function 'layer_norm'"):
        normlab.layer_norm(FakeArray(np.ones((2, 3))), backend="fake_no_op")


def test_a_module_that_cannot_be_found_is_unavailable_without_importing(
    register: Register, monkeypatch: pytest.MonkeyPatch
) -> None:
    """find_spec, not an import: ``list_backends()`` and ``normlab info`` show it unavailable."""
    imported: list[str] = []
    real_import = importlib.import_module
    monkeypatch.setattr(
        importlib, "import_module", lambda n, *a: imported.append(n) or real_import(n, *a)
    )
    register(record("fake_typo", module="plugins_for_testz.kernels"))
    backend = next(b for b in normlab.list_backends() if b.name == "fake_typo")
    assert not backend.available
    assert backend.reason == (
        "its module 'plugins_for_testz.kernels' cannot be found: no module named "
        "'plugins_for_testz' (record from register_plugin(fake_plugin_fake_typo))"
    )
    assert imported == []


def test_a_failed_import_makes_the_backend_unavailable_and_calls_fall_back(
    register: Register, no_preference: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The module is found but raises on import: the first default call warns once and falls
    back to the next backend; from then on the backend is unavailable with the error as its
    reason, cached choices are dropped, and no further warning is given."""
    (tmp_path / "fake_raising_kernels.py").write_text("raise OSError('libfake.so: no such file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    register(
        record("fake_first", module="fake_raising_kernels", priority=5),
        record("fake_second", priority=1),
    )
    first = registry.get("fake_first")
    assert first.available  # found; not imported yet
    generation = registry.registry().generation
    x = FakeArray(np.ones((2, 3)))
    with pytest.warns(normlab.NormlabWarning, match="fake_first.*libfake.so.*falling back"):
        normlab.layer_norm(x)
    assert len(CALLS) == 1  # fake_second served it
    assert not first.available
    assert "OSError: libfake.so: no such file" in (first.reason or "")
    assert registry.registry().generation > generation
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        normlab.layer_norm(x)
    assert len(CALLS) == 2
    with pytest.raises(normlab.BackendError, match=r"unavailable: .*libfake\.so"):
        normlab.layer_norm(x, backend="fake_first")


def test_a_module_path_may_name_an_attribute(register: Register) -> None:
    register(record("fake_attr", module="tests.support.plugins_for_tests:AS_ATTRIBUTE"))
    backend = registry.get("fake_attr")
    assert backend.available
    assert backend.function("layer_norm") is plugins_for_tests.layer_norm
    y = normlab.layer_norm(FakeArray(np.arange(6.0).reshape(2, 3)), backend="fake_attr")
    assert len(CALLS) == 1 and isinstance(y, FakeArray)


@pytest.mark.parametrize(
    "path", ["tests.support.plugins_for_tests:", "a..b", "a:b:c", "a-b.c", ":attr"]
)
def test_a_malformed_module_path_is_refused(register: Register, path: str) -> None:
    with pytest.raises(normlab.BackendError, match="module must be an import path"):
        register(record("fake_bad_path", module=path))


@pytest.mark.parametrize("shape", [(2, 3), (5,), ()])
def test_converters_round_trip(lib: registry.Backend, shape: tuple[int, ...]) -> None:
    a = np.arange(float(np.prod(shape))).reshape(shape)
    converted = lib.from_numpy(a)
    assert tuple(converted.shape) == shape
    np.testing.assert_array_equal(lib.to_numpy(converted), a)


# --------------------------------------------------------------------------------------------
# Plugins from the environment and from entry points (a fresh Registry, not the process one)


class _FakeDistribution:
    """An installed distribution ``fake-plugins 0.1`` holding these entry points."""

    metadata: Final = {"Name": "fake-plugins"}
    version: Final = "0.1"

    def __init__(self, points: list[importlib.metadata.EntryPoint]) -> None:
        self.entry_points = importlib.metadata.EntryPoints(points)


def _distributions(*values: str) -> Callable[..., list[_FakeDistribution]]:
    """A stand-in for ``importlib.metadata.distributions``: one distribution whose ``normlab``
    entry points are ``values`` (``module:attr``, named after the attribute)."""
    points = [importlib.metadata.EntryPoint(v.split(":")[-1], v, "normlab") for v in values]
    return lambda: [_FakeDistribution(points)]


def test_normlab_plugins_loads_modules_and_records_failures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(
        "NORMLAB_PLUGINS", "tests.support.plugins_for_tests, no_such_plugin_module ,"
    )
    monkeypatch.setenv("NORMLAB_DISABLE_PLUGIN_AUTOLOAD", "1")
    fresh = Registry()
    with pytest.warns(normlab.NormlabWarning, match="no_such_plugin_module"):
        fresh.load_defaults()
    assert (
        fresh.backends["env_plugin"].provided_by
        == "NORMLAB_PLUGINS (tests.support.plugins_for_tests)"
    )
    assert {"numpy", "torch"} <= set(fresh.backends)
    (failure,) = fresh.failures
    assert failure.plugin == "no_such_plugin_module"
    assert "import failed: ModuleNotFoundError" in failure.error


def test_a_plugin_that_fails_to_import_is_warned_about_at_its_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The warning points at the plugin's own file, not at normlab/registry.py."""
    broken = tmp_path / "fake_broken_plugin.py"
    broken.write_text("raise RuntimeError('half-installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("NORMLAB_PLUGINS", "fake_broken_plugin")
    monkeypatch.setenv("NORMLAB_DISABLE_PLUGIN_AUTOLOAD", "1")
    with pytest.warns(normlab.NormlabWarning, match="half-installed") as warned:
        Registry().load_defaults()
    assert [w.filename for w in warned] == [str(broken)]


def test_normlab_plugins_shows_the_distribution_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin loaded through NORMLAB_PLUGINS names its distribution and version, as an
    entry-point one does (normlab info shows provided_by)."""
    pytest.importorskip("normlab_example", reason="the example plugin is installed in tests-all")
    version = importlib.metadata.version("normlab-example")
    monkeypatch.setenv("NORMLAB_PLUGINS", "normlab_example")
    monkeypatch.setenv("NORMLAB_DISABLE_PLUGIN_AUTOLOAD", "1")
    fresh = Registry()
    fresh.load_defaults()
    assert fresh.backends["example"].provided_by == (
        f"NORMLAB_PLUGINS (normlab_example), normlab-example {version}"
    )


def test_register_plugin_shows_the_distribution_version() -> None:
    normlab_example = pytest.importorskip(
        "normlab_example", reason="the example plugin is installed in tests-all"
    )

    version = importlib.metadata.version("normlab-example")
    fresh = Registry()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "_registry", fresh)
        (backend,) = normlab.register_plugin(normlab_example)
    assert backend.provided_by == (f"register_plugin(normlab_example), normlab-example {version}")


def test_a_hook_without_hookimpl_gets_a_hint() -> None:
    module = ModuleType("fake_undecorated_plugin")
    module.normlab_backends = lambda: [record("fake_undecorated")]  # type: ignore[attr-defined]
    with pytest.raises(normlab.BackendError, match=r"without the @normlab\.hookimpl decorator"):
        normlab.register_plugin(module)


@pytest.mark.parametrize("dtype", ["fp32", "float", "Float32", "f4"])
def test_a_dtype_that_is_no_dtype_name_is_refused(register: Register, dtype: str) -> None:
    with pytest.raises(normlab.BackendError, match=rf"dtypes \['{dtype}'\] are not dtype names"):
        register(record("fake_fp32", dtypes=frozenset({"float32", dtype})))
    assert "fake_fp32" not in _names()


def test_a_dtype_normlab_does_not_serve_is_ignored_with_a_warning(register: Register) -> None:
    """The rest of the record (and the plugin) stays; the warning points at the plugin's hook."""
    with pytest.warns(normlab.NormlabWarning, match=r"\['int8', 'uint8'\].*ignoring") as warned:
        register(record("fake_int8", dtypes=frozenset({"float32", "int8", "uint8"})))
    assert registry.get("fake_int8").dtypes == frozenset({"float32"})
    assert [w.filename for w in warned] == [plugins_for_tests.__file__]


def test_entry_points_load_and_failures_are_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NORMLAB_PLUGINS", raising=False)
    monkeypatch.delenv("NORMLAB_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.setattr(
        importlib.metadata,
        "distributions",
        _distributions(
            "tests.support.plugins_for_tests:ENTRY_POINT_PLUGIN",
            "tests.support.plugins_for_tests:RAISING_PLUGIN",
        ),
    )
    fresh = Registry()
    with pytest.warns(normlab.NormlabWarning, match="RAISING_PLUGIN.*RuntimeError"):
        fresh.load_defaults()
    assert "entry_point_backend" in fresh.backends
    (failure,) = fresh.failures
    assert failure.plugin == "RAISING_PLUGIN"


@pytest.mark.parametrize("value", ["1", "yes"])
def test_disable_plugin_autoload(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("NORMLAB_PLUGINS", "tests.support.plugins_for_tests")
    monkeypatch.setenv("NORMLAB_DISABLE_PLUGIN_AUTOLOAD", value)
    monkeypatch.setattr(
        importlib.metadata,
        "distributions",
        _distributions("tests.support.plugins_for_tests:ENTRY_POINT_PLUGIN"),
    )
    fresh = Registry()
    fresh.load_defaults()
    assert "env_plugin" in fresh.backends  # NORMLAB_PLUGINS still counts
    assert "entry_point_backend" not in fresh.backends
    assert fresh.failures == []


def _run_python(code: str, **env: str) -> dict[str, Any]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("NORMLAB_")}
    environment["PYTHONPATH"] = str(ROOT)
    environment.update(env)
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_import_is_light_and_fast() -> None:
    """Neither ``import normlab`` nor building the registry imports an array library."""
    result = _run_python(
        "import json, sys, time\n"
        "heavy = lambda: [m for m in ('torch', 'numba', 'cupy', 'jax') if m in sys.modules]\n"
        "t = time.perf_counter()\n"
        "import normlab\n"
        "elapsed = time.perf_counter() - t\n"
        "at_import = heavy()\n"
        "names = sorted(b.name for b in normlab.list_backends())\n"
        "print(json.dumps({'elapsed': elapsed, 'heavy': [at_import, heavy()], 'names': names}))\n",
        NORMLAB_DISABLE_PLUGIN_AUTOLOAD="1",
    )
    assert result["heavy"] == [[], []]
    assert result["elapsed"] < 1.0
    assert {"numpy", "numba", "torch", "cupy"} <= set(result["names"])


def test_bad_environment_never_breaks_import() -> None:
    result = _run_python(
        "import json, warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as at_import:\n"
        "    import normlab\n"
        "    import numpy as np\n"
        "with warnings.catch_warnings(record=True) as at_use:\n"
        "    y = normlab.layer_norm(np.ones((2, 3)), backend='numpy')\n"
        "print(json.dumps({\n"
        "    'at_import': len(at_import),\n"
        "    'at_use': sorted(f'{w.category.__name__}: {w.message}' for w in at_use),\n"
        "    'failures': [f.plugin for f in normlab.plugin_failures()],\n"
        "    'names': [b.name for b in normlab.list_backends()],\n"
        "    'shape': list(y.shape),\n"
        "}))\n",
        NORMLAB_PLUGINS="tests.support.plugins_for_tests,no_such_plugin_module",
        NORMLAB_BACKEND="no_such_backend",
    )
    assert result["at_import"] == 0
    assert result["shape"] == [2, 3]
    assert result["failures"] == ["no_such_plugin_module"]
    assert "env_plugin" in result["names"]
    warned = "\n".join(result["at_use"])
    assert "NormlabWarning: normlab plugin 'no_such_plugin_module'" in warned
    assert "NormlabWarning: NORMLAB_BACKEND='no_such_backend'" in warned


def test_the_plan_holds_no_routing() -> None:
    """The core's routing is its validated call's, not the Plan's: the Plan has none of the
    former routing fields, and the documented fields read without a warning."""
    from normlab import spec
    from normlab.hookspecs import PLAN_FIELDS

    x = np.ones((2, 3, 4), np.float32).transpose(0, 2, 1)
    call = spec.validated(OPS["layer_norm"], spec.arguments("layer_norm", x, axis=1))
    for name in ("permutation", "x_strides", "out_strides", "routes", "non_native"):
        assert not hasattr(call.plan, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in PLAN_FIELDS:
            getattr(call.plan, name)
