"""Plugins that fail in every way a plugin can, for ``test_faulty_plugins``.

This module is two things:

* a set of plugin objects, each broken in one way (:data:`FAULTS` maps each to what the registry
  must say about it), plus :data:`SURVIVOR`, a good plugin loaded beside them; the tests expose
  them as entry points of a fake installed distribution
  (``tests.support.faulty_plugins:HOOK_RAISES``…);
* a backend module whose ``layer_norm``, ``add_layer_norm`` and ``layer_norm_backward`` raise
  (:data:`KERNEL_RAISES` points at it).

:data:`IMPORT_FAILURES` holds the source of plugin modules that fail on import; the tests write
them to a temporary folder.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import Any, Final

import normlab
from normlab.hookspecs import Plan
from tests.support import plugins_for_tests

MODULE: Final = __name__


def layer_norm(x: Any, weight: Any, bias: Any, *, plan: Plan, out: Any) -> tuple[Any, Any, Any]:
    """The kernel of the ``faulty_kernel`` backend: it crashes on every call."""
    raise RuntimeError("the faulty kernel crashed")


def add_layer_norm(
    x: Any, residual: Any, weight: Any, bias: Any, *, plan: Plan, out: Any, residual_out: Any
) -> tuple[Any, Any, Any, Any]:
    """The fused kernel of the ``faulty_kernel`` backend: it crashes on every call."""
    raise ValueError("the faulty fused kernel crashed")


def layer_norm_backward(
    dy: Any, x: Any, mean: Any, rstd: Any, weight: Any, *, plan: Plan, needs: Any
) -> tuple[Any, Any, Any]:
    """The backward kernel of the ``faulty_kernel`` backend: it crashes on every call."""
    raise ValueError("the faulty backward kernel crashed")


def to_numpy(a: Any) -> Any:
    return a


def from_numpy(a: Any, like: Any = None) -> Any:
    return a


def record(name: str, **fields: Any) -> normlab.BackendRecord:
    """A record serving float32 NumPy arrays whose code is this module (fields override)."""
    values: dict[str, Any] = {
        "module": MODULE,
        "families": frozenset({"numpy"}),
        "devices": frozenset({"cpu"}),
        "dtypes": frozenset({"float32"}),
        "priority": -10,
    }
    values.update(fields)
    return normlab.BackendRecord(name=name, **values)


def plugin(name: str, hook: Callable[..., Any]) -> types.ModuleType:
    """A module-like plugin whose ``normlab_backends`` hook is ``hook``."""
    module = types.ModuleType(name)
    module.normlab_backends = normlab.hookimpl(hook)  # type: ignore[attr-defined]
    return module


def _raise() -> list[normlab.BackendRecord]:
    raise RuntimeError("the plugin's hook is broken")


def _records_then_raise() -> Iterator[normlab.BackendRecord]:
    yield record("faulty_half_done")
    raise ValueError("the plugin's generator broke halfway")


def _check_raises() -> str | None:
    raise OSError("the plugin's probe exploded")


HOOK_RAISES = plugin("hook_raises", _raise)
RETURNS_NONE = plugin("returns_none", lambda: None)
RETURNS_NOTHING = plugin("returns_nothing", lambda: [])
RETURNS_DICTS = plugin("returns_dicts", lambda: [{"name": "faulty_dict"}])
MALFORMED_RECORD = plugin(
    "malformed_record", lambda: [record("faulty_fast", capabilities=frozenset({"warp_speed"}))]
)
SHADOWS_NUMPY = plugin("shadows_numpy", lambda: [record("numpy", priority=1000)])
TWIN_A = plugin("twin_a", lambda: [record("faulty_twin", module=plugins_for_tests.MODULE)])
TWIN_B = plugin("twin_b", lambda: [record("faulty_twin", module=plugins_for_tests.MODULE)])
CHECK_RAISES = plugin("check_raises", lambda: [record("faulty_unwell", check=_check_raises)])
MODULE_MISSING = plugin(
    "module_missing", lambda: [record("faulty_homeless", module="no_such_backend_module_x")]
)
KERNEL_RAISES = plugin(
    "kernel_raises",
    lambda: [
        record(
            "faulty_kernel",
            ops=frozenset({"layer_norm", "add_layer_norm", "layer_norm_backward"}),
        )
    ],
)
#: A good plugin among the bad: its backend computes with the reference (plugins_for_tests).
SURVIVOR = plugin(
    "survivor", lambda: [record("survivor", module=plugins_for_tests.MODULE, priority=-20)]
)

GENERATOR_RAISES = plugin("generator_raises", _records_then_raise)
BAD_SIGNATURE = plugin("bad_signature", lambda config: [record("faulty_signed")])
BAD_LIBRARY = plugin("bad_library", lambda: [record("faulty_library", library=123)])
CHECK_RETURNS_BOOL = plugin(
    "check_returns_bool", lambda: [record("faulty_boolean", check=lambda: True)]
)

#: Source of plugin modules that fail on import (written to a folder on the path by the tests).
IMPORT_FAILURES: Final = {
    "faulty_missing_dependency": "import no_such_dependency_for_normlab\n",
    "faulty_syntax_error": "def normlab_backends(:\n    return []\n",
    "faulty_raises_at_import": "raise RuntimeError('the plugin could not start')\n",
    "faulty_exits_at_import": "raise SystemExit(3)\n",
}

#: Each faulty entry point (name = value) and what the plugin failure it causes must say.
FAULTS: Final = {
    "faulty_not_installed": ("faulty_not_installed_module", "ModuleNotFoundError"),
    "faulty_missing_dependency": ("faulty_missing_dependency", "no_such_dependency_for_normlab"),
    "faulty_syntax_error": ("faulty_syntax_error", "SyntaxError"),
    "faulty_raises_at_import": ("faulty_raises_at_import", "the plugin could not start"),
    "faulty_exits_at_import": ("faulty_exits_at_import", "SystemExit: 3"),
    "faulty_no_such_attribute": (f"{MODULE}:NO_SUCH_PLUGIN", "AttributeError"),
    "hook_raises": (f"{MODULE}:HOOK_RAISES", "RuntimeError: the plugin's hook is broken"),
    "returns_none": (f"{MODULE}:RETURNS_NONE", "must return a list of BackendRecord"),
    "returns_nothing": (f"{MODULE}:RETURNS_NOTHING", "provides no normlab_backends()"),
    "returns_dicts": (f"{MODULE}:RETURNS_DICTS", "returned dict, not a BackendRecord"),
    "malformed_record": (f"{MODULE}:MALFORMED_RECORD", "unknown capabilities"),
    "shadows_numpy": (f"{MODULE}:SHADOWS_NUMPY", "'numpy' from plugin"),
    "twin_b": (f"{MODULE}:TWIN_B", "'faulty_twin' from plugin"),
    "generator_raises": (f"{MODULE}:GENERATOR_RAISES", "generator broke halfway"),
    "bad_signature": (f"{MODULE}:BAD_SIGNATURE", "invalid hook"),
    "bad_library": (f"{MODULE}:BAD_LIBRARY", "library must be"),
}
#: Entry points of plugins that load, though their backends are faulty (or, one, good).
LOADED: Final = {
    "twin_a": f"{MODULE}:TWIN_A",
    "check_raises": f"{MODULE}:CHECK_RAISES",
    "check_returns_bool": f"{MODULE}:CHECK_RETURNS_BOOL",
    "module_missing": f"{MODULE}:MODULE_MISSING",
    "kernel_raises": f"{MODULE}:KERNEL_RAISES",
    "survivor": f"{MODULE}:SURVIVOR",
}
