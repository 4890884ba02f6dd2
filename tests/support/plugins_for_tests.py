"""Fake plugins, a fake backend module and a fake array library for the registry and dispatch tests.

This module is three things at once:

* a backend module: every record made by :func:`record` points at it, so ``backend="fake…"``
  runs :func:`layer_norm` below, which computes with :mod:`normlab.reference` and appends each
  call to :data:`CALLS` (tests assert on what a backend received, or that it was never called);
* a plugin: its own ``normlab_backends`` hook provides the backend ``env_plugin`` (loaded by the
  ``NORMLAB_PLUGINS`` and entry-point tests as ``tests.support.plugins_for_tests``);
* a made-up array library ``fakelib`` (:class:`FakeArray`), which no built-in backend serves, so
  dispatch tests can rank fake backends without the built-ins taking part.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import normlab
from normlab import reference
from normlab.hookspecs import Plan

MODULE = __name__
FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})


class FakeArray:
    """An array of the library ``fakelib``: a NumPy array in a wrapper, with a device name."""

    __module__ = "fakelib.core"

    def __init__(self, data: Any, device: str = "cpu") -> None:
        self.data = np.asarray(data)
        self.device = device

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.data.dtype

    def reshape(self, *shape: int) -> FakeArray:
        return FakeArray(self.data.reshape(*shape), self.device)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.data if dtype is None else self.data.astype(dtype)


@dataclass(frozen=True)
class Call:
    """What a fake backend's ``layer_norm`` received."""

    x: Any
    weight: Any
    bias: Any
    plan: Plan
    out: Any


CALLS: list[Call] = []


def layer_norm(x: Any, weight: Any, bias: Any, *, plan: Plan, out: Any) -> tuple[Any, Any, Any]:
    """The fake backends' op: the float64 reference, rounded to x's dtype; records the call."""
    CALLS.append(Call(x, weight, bias, plan, out))
    data = np.asarray(x)
    y, mean, rstd = reference.layer_norm(
        data,
        weight=None if weight is None else np.asarray(weight),
        bias=None if bias is None else np.asarray(bias),
        eps=plan.eps,
    )
    y = y.astype(data.dtype)
    if out is not None:
        out[...] = y
        y = out
    if isinstance(x, FakeArray):
        y = FakeArray(y, x.device)
    if not plan.return_stats:
        return y, None, None
    return y, mean[:, 0].astype(plan.stats_dtype), rstd[:, 0].astype(plan.stats_dtype)


def to_numpy(a: Any) -> np.ndarray:
    return np.array(a, copy=True)


def from_numpy(a: np.ndarray, like: Any = None) -> Any:
    return FakeArray(a) if isinstance(like, FakeArray) else np.array(a, copy=True)


def record(
    name: str,
    *,
    families: frozenset[str] = frozenset({"fakelib"}),
    devices: frozenset[str] = frozenset({"cpu"}),
    dtypes: frozenset[str] = FLOATS,
    priority: int = 0,
    capabilities: frozenset[str] = frozenset(),
    explicit_families: frozenset[str] = frozenset(),
    check: Callable[[], str | None] | None = None,
    module: str = MODULE,
    **fields: Any,
) -> normlab.BackendRecord:
    """A record of a fake backend whose code is this module (fields default to ``fakelib``/cpu)."""
    return normlab.BackendRecord(
        name=name,
        module=module,
        families=families,
        devices=devices,
        dtypes=dtypes,
        priority=priority,
        capabilities=capabilities,
        explicit_families=explicit_families,
        check=check,
        **fields,
    )


def plugin(*records: Any, name: str | None = None) -> types.ModuleType:
    """A module-like plugin whose hook returns ``records`` (as given, malformed or not)."""
    module = types.ModuleType(name or f"fake_plugin_{records[0].name}")

    @normlab.hookimpl
    def normlab_backends() -> list[Any]:
        return list(records)

    module.normlab_backends = normlab_backends  # type: ignore[attr-defined]
    return module


def raising_plugin(name: str) -> types.ModuleType:
    """A plugin whose hook raises."""
    module = types.ModuleType(name)

    @normlab.hookimpl
    def normlab_backends() -> list[Any]:
        raise RuntimeError("the fake plugin's hook is broken")

    module.normlab_backends = normlab_backends  # type: ignore[attr-defined]
    return module


#: Loaded through entry points as ``tests.support.plugins_for_tests:ENTRY_POINT_PLUGIN``.
ENTRY_POINT_PLUGIN = plugin(record("entry_point_backend"), name="entry_point_plugin")
#: Loaded through entry points as ``tests.support.plugins_for_tests:RAISING_PLUGIN``.
RAISING_PLUGIN = raising_plugin("raising_entry_point_plugin")


@normlab.hookimpl
def normlab_backends() -> list[normlab.BackendRecord]:
    """This module as a plugin (``NORMLAB_PLUGINS=tests.support.plugins_for_tests``)."""
    return [record("env_plugin")]


#: This module's functions as an attribute, for records whose module is ``"pkg.mod:attr"``.
AS_ATTRIBUTE = types.SimpleNamespace(
    layer_norm=layer_norm, to_numpy=to_numpy, from_numpy=from_numpy
)
