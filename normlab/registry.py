"""The plugin registry: pluggy, built-in backends, entry points, ``NORMLAB_PLUGINS``.

The registry is built on first use (never at ``import normlab``). Sources, in order:

1. the built-in backends (:mod:`normlab.backends`), through the same hook a plugin implements;
2. modules named in ``NORMLAB_PLUGINS`` (comma-separated import paths);
3. the ``normlab`` entry-point group, unless ``NORMLAB_DISABLE_PLUGIN_AUTOLOAD=1``.

A plugin that fails to import, raises in its hook or returns malformed records is recorded as a
:class:`PluginFailure` (shown by ``normlab info``), reported once as a :class:`NormlabWarning`
and skipped. A backend name already taken is refused with an error naming both sources.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Final

import pluggy

from normlab import arrays, hookspecs
from normlab.errors import BackendError, NormlabWarning
from normlab.hookspecs import ARRAY_API, CAPABILITIES, BackendRecord
from normlab.ops import KERNEL_FORMS, Op

__all__ = [
    "Backend",
    "PluginFailure",
    "get",
    "list_backends",
    "module_problem",
    "plugin_failures",
    "register_plugin",
    "unregister_plugin",
]

BUILTIN: Final = "built-in"
#: Why a plugin may not call normlab while it is loaded.
LOADING: Final = "normlab is loading plugins; do not call normlab from a plugin's import or hook"
ENTRY_POINT_GROUP: Final = "normlab"

#: What a dtype name looks like (NumPy's and ml_dtypes' names): "fp32" is none, "int8" is one
#: (which normlab does not serve: warned about and dropped from the record).
_DTYPE_NAME: Final = re.compile(
    r"(bool|u?int(2|4|8|16|32|64)|float(16|32|64|80|96|128)|complex(64|128|160|192|256)"
    r"|bfloat16|float[468]_e\d+m\d+[a-z]*)"
)


@dataclass(frozen=True, slots=True)
class PluginFailure:
    """A plugin that could not be used: where it came from and what went wrong."""

    plugin: str
    source: str
    error: str


class Backend:
    """A registered backend: its record, where it came from, and its lazily loaded code."""

    def __init__(self, record: BackendRecord, provided_by: str) -> None:
        self.record = record
        self.provided_by = provided_by
        self._reason: str | None = None
        self._checked = False
        self._module: Any = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        state = "available" if self.available else f"unavailable: {self.reason}"
        return f"<Backend {self.name!r} ({state}) from {self.provided_by}>"

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def families(self) -> frozenset[str]:
        """The families the record lists; with :data:`~normlab.hookspecs.ARRAY_API` among them,
        also every family met so far that normlab reads through the Array API."""
        families = self.record.families
        if ARRAY_API in families:
            return families | arrays.array_api_families()
        return families

    @property
    def explicit_families(self) -> frozenset[str]:
        return self.record.explicit_families

    @property
    def zero_copy_families(self) -> frozenset[str]:
        return self.record.zero_copy_families

    @property
    def devices(self) -> frozenset[str]:
        return self.record.devices

    @property
    def dtypes(self) -> frozenset[str]:
        return self.record.dtypes

    @property
    def ops(self) -> frozenset[str]:
        return self.record.ops

    @property
    def capabilities(self) -> frozenset[str]:
        return self.record.capabilities

    @property
    def priority(self) -> int:
        return self.record.priority

    @property
    def description(self) -> str:
        return self.record.description

    @property
    def flushes_subnormals(self) -> bool:
        return self.record.flushes_subnormals

    @property
    def batch_invariant(self) -> bool:
        return self.record.batch_invariant

    def kernel_arrays(self, op: Op) -> tuple[str, ...]:
        """The arrays this backend's function of ``op`` takes, in its record's kernel form."""
        return op.kernel_arrays_of(self.record.kernel_form)

    def kernel_returns(self, op: Op) -> tuple[str, ...]:
        """What this backend's function of ``op`` returns, in its record's kernel form."""
        return op.kernel_returns_of(self.record.kernel_form)

    @property
    def available(self) -> bool:
        """Whether this backend can run here (checked once, lazily)."""
        return self.reason is None

    @property
    def reason(self) -> str | None:
        """Why this backend cannot run here, or ``None`` when it can."""
        if not self._checked:
            with self._lock:
                if not self._checked:
                    self._reason = self._run_check()
                    self._checked = True
        return self._reason

    @property
    def version(self) -> str | None:
        """The installed version of the backend's library, if it names one and it is installed."""
        if self.record.library is None:
            return None
        try:
            return importlib.metadata.version(self.record.library)
        except importlib.metadata.PackageNotFoundError:
            return None

    def _run_check(self) -> str | None:
        missing = module_problem(self.record.module)
        if missing is not None:
            return f"{missing} (record from {self.provided_by})"
        if self.record.check is None:
            return None
        try:
            reason = self.record.check()
        except (Exception, SystemExit) as exc:  # a broken check: the backend is unavailable
            return f"availability check raised {type(exc).__name__}: {exc}"
        if reason is None or isinstance(reason, str):
            return reason
        return f"availability check returned {reason!r}, not None or a reason"

    @property
    def module(self) -> Any:
        """What holds the backend's functions, loaded on first use: the module ``record.module``
        (``"pkg.mod"``), or an attribute of it (``"pkg.mod:attr"``).

        A failed load raises BackendError and makes the backend unavailable, the error its
        reason; cached dispatch choices are then stale (the registry's generation moves on).
        """
        if self._module is None:
            try:
                loaded = _import_object(self.record.module)
            except KeyboardInterrupt:
                # A half-imported library cannot be imported again in this process.
                self._mark_unavailable(f"{self.name}'s import was interrupted; restart the process")
                raise
            except (Exception, SystemExit) as exc:
                error = f"{type(exc).__name__}: {exc}"
                self._mark_unavailable(f"its module {self.record.module!r} failed to load: {error}")
                raise BackendError(
                    f"backend {self.name!r} (from {self.provided_by}) failed to load its module "
                    f"{self.record.module!r}: {error}"
                ) from exc
            self._module = loaded
        return self._module

    def _mark_unavailable(self, reason: str) -> None:
        with self._lock:
            self._reason, self._checked = reason, True
        # cached choices that named this backend are stale
        if _registry is not None and _registry.backends.get(self.name) is self:
            _registry.generation += 1

    def function(self, op: str) -> Callable[..., Any]:
        """The backend's implementation of ``op``."""
        fn = getattr(self.module, op, None)
        if fn is None:
            raise BackendError(
                f"backend {self.name!r} declares op {op!r} but {self.record.module} defines no "
                f"function {op!r}"
            )
        return fn  # type: ignore[no-any-return]

    def prepared(self, op: str, plan: Any) -> Callable[..., Any] | None:
        """The backend's function for the direct route of ``plan`` (its optional ``prepare``;
        see :mod:`normlab.hookspecs`), or None: its function for ``op``."""
        prepare = getattr(self.module, "prepare", None)
        return None if prepare is None else prepare(op, plan)

    def to_numpy(self, a: Any) -> Any:
        """Convert an array of this backend's family to NumPy (used by the conformance suite)."""
        return self.module.to_numpy(a)

    def from_numpy(self, a: Any, like: Any = None) -> Any:
        """Convert a NumPy array to this backend's family (on ``like``'s device when given)."""
        return self.module.from_numpy(a, like=like)


class Registry:
    """All backends known to this process, and the plugins that failed."""

    def __init__(self) -> None:
        self.manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.manager.add_hookspecs(hookspecs)
        self.backends: dict[str, Backend] = {}
        self.failures: list[PluginFailure] = []
        #: plugin name -> where it was registered from (its distribution, NORMLAB_PLUGINS…)
        self.sources: dict[str, str] = {}
        self.generation = 0
        #: A plugin being loaded called normlab (refused with :data:`LOADING`).
        self.called_while_loading = False

    def load_defaults(self) -> None:
        from normlab import backends as builtin

        self.register(builtin, source=BUILTIN, name="normlab.backends")
        for module_name in _env_list("NORMLAB_PLUGINS"):
            self._register_safely(
                functools.partial(importlib.import_module, module_name),
                module_name,
                f"NORMLAB_PLUGINS ({module_name}){_distribution_of(module_name)}",
            )
        if os.environ.get("NORMLAB_DISABLE_PLUGIN_AUTOLOAD", "") not in ("", "0"):
            return
        for ep, source in self._entry_points():
            self._register_safely(ep.load, ep.name, source, where=ep.value)

    def _entry_points(self) -> list[tuple[importlib.metadata.EntryPoint, str]]:
        """The ``normlab`` entry points of the installed distributions, with their sources,
        read one distribution at a time: a distribution whose metadata cannot be read (an
        ``entry_points.txt`` line without ``=``, a file that is not UTF-8) is recorded as a
        failure and skipped, never fatal to the others. A distribution found twice on the path
        counts once (the first), as ``importlib.metadata.entry_points`` does."""
        found: list[tuple[importlib.metadata.EntryPoint, str]] = []
        seen: set[str] = set()
        for dist in importlib.metadata.distributions():
            try:
                name = dist.metadata["Name"] or "?"
                key = name.lower().replace("-", "_")
                if key in seen:
                    continue
                seen.add(key)
                eps = list(dist.entry_points.select(group=ENTRY_POINT_GROUP))
                source = f"{name} {dist.version}"
            except Exception as exc:
                where = getattr(dist, "_path", None)
                label = f"distribution at {where}" if where is not None else "a distribution"
                self._fail(label, label, f"metadata unreadable: {type(exc).__name__}: {exc}", None)
                continue
            found.extend((ep, source) for ep in eps)
        return found

    def _register_safely(
        self, load: Callable[[], Any], name: str, source: str, where: str | None = None
    ) -> None:
        """Register what ``load`` returns; a failure is recorded and warned about at the
        plugin's file (``where``: its import path, default ``name``)."""
        self.called_while_loading = False
        try:
            plugin = load()
        except (Exception, SystemExit) as exc:
            self._fail(name, source, f"import failed: {type(exc).__name__}: {exc}", where)
            return
        try:
            admitted = self.register(plugin, source=source, name=name)
        except BackendError as exc:
            self._fail(name, source, LOADING if self.called_while_loading else str(exc), where)
            return
        if self.called_while_loading:  # it caught the BackendError, but it is still refused
            self.manager.unregister(plugin)
            for backend in admitted:
                del self.backends[backend.name]
            self.generation += 1
            self._fail(name, source, LOADING, where)

    def _fail(self, plugin: str, source: str, error: str, where: str | None) -> None:
        self.failures.append(PluginFailure(plugin, source, error))
        message = f"normlab plugin {plugin!r} ({source}) skipped: {error}"
        _warn_at_plugin(message, where or plugin)

    def register(self, plugin: Any, *, source: str, name: str | None = None) -> list[Backend]:
        """Register ``plugin`` and its backends; all-or-nothing, BackendError on any problem."""
        plugin_name = name or getattr(plugin, "__name__", None) or repr(plugin)
        if plugin is None:
            raise BackendError(
                f"plugin {plugin_name!r} is None (an entry point or register_plugin() given "
                "nothing): a plugin is a module or object with a normlab_backends hook"
            )
        if self.manager.is_registered(plugin) or self.manager.has_plugin(plugin_name):
            before = self.sources.get(plugin_name)
            also = f" (registered before from {before})" if before else ""
            raise BackendError(f"plugin {plugin_name!r} is already registered{also}")
        try:
            self.manager.register(plugin, name=plugin_name)
        except pluggy.PluginValidationError as exc:
            raise BackendError(f"plugin {plugin_name!r} has an invalid hook: {exc}") from exc
        try:
            records = self._records_of(plugin, plugin_name)
            new = self._admit(records, plugin_name, source)
        except BackendError:
            self.manager.unregister(plugin)
            raise
        for backend in new:
            self.backends[backend.name] = backend
        self.sources[plugin_name] = source
        self.generation += 1
        arrays.forget_inspectors()  # a new record may supply a family's inspector
        return new

    def _records_of(self, plugin: Any, plugin_name: str) -> list[tuple[Any, Callable[..., Any]]]:
        """The plugin's records, each with the hook function that returned it."""
        records: list[tuple[Any, Callable[..., Any]]] = []
        for impl in self.manager.hook.normlab_backends.get_hookimpls():
            if impl.plugin is not plugin:
                continue
            try:
                result = impl.function()
                if not isinstance(result, Iterable):
                    raise BackendError(
                        f"plugin {plugin_name!r}: normlab_backends() must return a list of "
                        f"BackendRecord, got {type(result).__name__}"
                    )
                records.extend((record, impl.function) for record in result)  # may raise
            except BackendError:
                raise
            except (Exception, SystemExit) as exc:
                raise BackendError(
                    f"plugin {plugin_name!r}: normlab_backends() raised {type(exc).__name__}: {exc}"
                ) from exc
        if not records:
            hint = ""
            if callable(getattr(plugin, "normlab_backends", None)):
                hint = (
                    "; it defines normlab_backends without the @normlab.hookimpl decorator, "
                    "which normlab needs to find it"
                )
            raise BackendError(
                f"plugin {plugin_name!r} provides no normlab_backends() records{hint}"
            )
        return records

    def _admit(
        self, records: list[tuple[Any, Callable[..., Any]]], plugin_name: str, source: str
    ) -> list[Backend]:
        new: list[Backend] = []
        for record, hook in records:
            _check_record(record, plugin_name)
            record = _served_dtypes_only(record, plugin_name, hook)
            taken = self.backends.get(record.name) or next(
                (b for b in new if b.name == record.name), None
            )
            if taken is not None:
                raise BackendError(
                    f"backend name {record.name!r} from plugin {plugin_name!r} ({source}) is "
                    f"already provided by {taken.provided_by}; names must be unique"
                )
            new.append(Backend(record, provided_by=source))
        return new

    def unregister(self, plugin: Any) -> None:
        """Remove ``plugin`` (the object, or its name) and its backends."""
        obj = self.manager.get_plugin(plugin) if isinstance(plugin, str) else plugin
        if obj is None or not self.manager.is_registered(obj):
            raise BackendError(f"plugin {plugin!r} is not registered")
        name = self.manager.get_name(obj)
        if name == "normlab.backends":
            raise BackendError("the built-in backends cannot be unregistered")
        names = {r.name for r, _ in self._records_of(obj, str(name))}
        self.manager.unregister(obj)
        for backend_name in names:
            self.backends.pop(backend_name, None)
        self.sources.pop(str(name), None)
        self.generation += 1
        arrays.forget_inspectors()


def _check_record(record: Any, plugin_name: str) -> None:
    if not isinstance(record, BackendRecord):
        raise BackendError(
            f"plugin {plugin_name!r} returned {type(record).__name__}, not a BackendRecord"
        )
    problems = []
    if not isinstance(record.name, str) or not record.name.isidentifier():
        problems.append(f"name {record.name!r} is not an identifier")
    for field_name in ("families", "devices", "dtypes", "ops", "capabilities", "explicit_families"):
        value = getattr(record, field_name)
        if not isinstance(value, frozenset) or not all(isinstance(v, str) for v in value):
            problems.append(f"{field_name} must be a frozenset of str, got {value!r}")
    if isinstance(record.dtypes, frozenset):
        not_dtypes = sorted(d for d in record.dtypes if not _DTYPE_NAME.fullmatch(str(d)))
        if not_dtypes:
            problems.append(
                f"dtypes {not_dtypes} are not dtype names (normlab serves float16, bfloat16, "
                "float32, float64)"
            )
    if isinstance(record.capabilities, frozenset) and record.capabilities - CAPABILITIES:
        problems.append(f"unknown capabilities {sorted(record.capabilities - CAPABILITIES)}")
    if record.library is not None and not isinstance(record.library, str):
        problems.append(f"library must be a distribution name or None, got {record.library!r}")
    if not isinstance(record.priority, int):
        problems.append(f"priority must be an int, got {record.priority!r}")
    if not isinstance(record.flushes_subnormals, bool):
        problems.append(f"flushes_subnormals must be a bool, got {record.flushes_subnormals!r}")
    if not isinstance(record.batch_invariant, bool):
        problems.append(f"batch_invariant must be a bool, got {record.batch_invariant!r}")
    if type(record.kernel_form) is not int or record.kernel_form not in KERNEL_FORMS:
        problems.append(f"kernel_form must be one of {KERNEL_FORMS}, got {record.kernel_form!r}")
    if not isinstance(record.module, str) or not _is_module_path(record.module):
        problems.append(
            f"module must be an import path ('pkg.mod' or 'pkg.mod:attr'), got {record.module!r}"
        )
    if record.inspector is not None:
        if not isinstance(record.inspector, str) or not _is_module_path(record.inspector):
            problems.append(
                f"inspector must be None or an import path ('pkg.mod:Class'), got "
                f"{record.inspector!r}"
            )
        listed = record.families if isinstance(record.families, frozenset) else frozenset()
        core = sorted(arrays.CORE_FAMILIES & listed)
        if core:
            problems.append(
                f"it supplies an inspector for {', '.join(core)}, whose arrays normlab always "
                "reads itself"
            )
    if problems:
        raise BackendError(
            f"plugin {plugin_name!r}: malformed record {getattr(record, 'name', '?')!r}: "
            + "; ".join(problems)
        )


def _served_dtypes_only(
    record: BackendRecord, plugin_name: str, hook: Callable[..., Any]
) -> BackendRecord:
    """``record`` without the dtypes normlab does not serve (a warning names them)."""
    from normlab.constants import FLOAT_DTYPES

    unserved = record.dtypes - frozenset(FLOAT_DTYPES)
    if not unserved:
        return record
    _warn_at(
        f"normlab plugin {plugin_name!r}: backend {record.name!r} lists dtypes "
        f"{sorted(unserved)}, which normlab does not serve (it serves "
        f"{', '.join(FLOAT_DTYPES)}); ignoring them",
        hook,
    )
    return dataclasses.replace(record, dtypes=record.dtypes - unserved)


def _warn_at(message: str, where: Callable[..., Any]) -> None:
    """A NormlabWarning attributed to the plugin's function ``where`` (its file and line), so
    that it points at the plugin, not at normlab."""
    code = getattr(inspect.unwrap(where), "__code__", None)
    filename = code.co_filename if code is not None else "<normlab plugin>"
    lineno = code.co_firstlineno if code is not None else 1
    module = getattr(where, "__module__", None) or "normlab.plugin"
    warnings.warn_explicit(message, NormlabWarning, filename, lineno, module=module)


def _warn_at_plugin(message: str, plugin: str) -> None:
    """A NormlabWarning attributed to the file of the plugin named ``plugin`` (a module name or
    an entry point's ``pkg.mod:attr``), where that file can be found without importing."""
    module = plugin.partition(":")[0]
    filename = "<normlab plugin>"
    parent = module.rpartition(".")[0]
    if not parent or parent in sys.modules:  # else find_spec would import the parent
        try:
            spec = importlib.util.find_spec(module)
        except Exception:  # a half-imported module; the warning then names no file
            spec = None
        if spec is not None and spec.origin:
            filename = spec.origin
    warnings.warn_explicit(message, NormlabWarning, filename, 1, module=module or plugin)


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()  # type: ignore[return-value]


def _distribution_of(module_name: str) -> str:
    """``", <distribution> <version>"`` of the installed distribution holding the top-level
    package of ``module_name``, or ``""`` (a module outside any distribution)."""
    top = module_name.partition(".")[0].partition(":")[0]
    names = list(dict.fromkeys(_packages_distributions().get(top, [])))
    if len(names) != 1:
        return ""
    try:
        return f", {names[0]} {importlib.metadata.version(names[0])}"
    except importlib.metadata.PackageNotFoundError:
        return ""


def _import_object(path: str) -> Any:
    """The module ``"pkg.mod"``, or the object ``"pkg.mod:attr.sub"`` in it (imported)."""
    module, _, attr = path.partition(":")
    loaded: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        loaded = getattr(loaded, part)
    return loaded


#: Inspector import paths that failed (warned about once): path -> why.
_broken_inspectors: dict[str, str] = {}


def _supplied_inspector(family: str) -> type[arrays.Inspector] | None:
    """The :class:`~normlab.arrays.Inspector` subclass that a record supplies for ``family``:
    that of the highest-priority record listing the family and an ``inspector`` that loads.
    One that fails to load, or is not an Inspector subclass, is warned about once and passed
    over (normlab's own reading of the family is used instead)."""
    for backend in list_backends():
        path = backend.record.inspector
        if path is None or family not in backend.record.families or path in _broken_inspectors:
            continue
        try:
            found = _import_object(path)
        except (Exception, SystemExit) as exc:
            problem = f"failed to load: {type(exc).__name__}: {exc}"
        else:
            if isinstance(found, type) and issubclass(found, arrays.Inspector):
                return found
            problem = f"is {found!r}, not a normlab.arrays.Inspector subclass"
        _broken_inspectors[path] = problem
        _warn_at_plugin(
            f"backend {backend.name!r} (from {backend.provided_by}): its inspector {path!r} "
            f"{problem}; normlab reads {family} arrays with its own inspector",
            path,
        )
    return None


arrays.use_supplied_inspectors(_supplied_inspector)


def _is_module_path(path: str) -> bool:
    module, colon, attr = path.partition(":")
    dotted = [module, *([attr] if colon else [])]
    return all(part and all(p.isidentifier() for p in part.split(".")) for part in dotted)


def module_problem(path: str) -> str | None:
    """Why the module of a record's ``module`` path (``"pkg.mod"`` or ``"pkg.mod:attr"``) cannot
    be found, or ``None``; imports nothing (``importlib.util.find_spec`` on each package already
    imported, stopping at the first that is not)."""
    parts = path.partition(":")[0].split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name in sys.modules:
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None  # it exists but cannot be looked into without importing it
        if spec is None:
            return f"its module {path!r} cannot be found: no module named {name!r}"
        return None  # deeper names need this package imported
    return None


def _env_list(name: str) -> list[str]:
    return [part.strip() for part in os.environ.get(name, "").split(",") if part.strip()]


_registry: Registry | None = None
_registry_lock = threading.Lock()
#: The thread building the registry and the registry it builds, while it does.
_building: tuple[int, Registry] | None = None


def registry() -> Registry:
    """The process-wide registry, built on first use.

    A plugin that calls normlab while it is loaded (at import or in its hook) gets a
    BackendError and is recorded as failed: waiting for the registry would wait for itself.
    """
    global _registry, _building
    if _registry is None:
        building = _building
        if building is not None and building[0] == threading.get_ident():
            building[1].called_while_loading = True
            raise BackendError(LOADING)
        with _registry_lock:
            if _registry is None:
                fresh = Registry()
                _building = (threading.get_ident(), fresh)
                try:
                    fresh.load_defaults()
                finally:
                    _building = None
                _registry = fresh
    return _registry


def list_backends() -> list[Backend]:
    """Every registered backend, highest priority first (availability is checked lazily)."""
    return sorted(registry().backends.values(), key=lambda b: (-b.priority, b.name))


def get(name: str) -> Backend:
    """The backend called ``name``, or a BackendError listing the registered names.

    Listing them runs no availability check: a misspelt name imports no library and probes no
    device.
    """
    backends = registry().backends
    try:
        return backends[name]
    except (KeyError, TypeError):
        registered = ", ".join(b.name for b in list_backends()) or "none"
        raise BackendError(f"unknown backend {name!r}; registered backends: {registered}") from None


def plugin_failures() -> list[PluginFailure]:
    """Plugins that were skipped, with the reason."""
    return list(registry().failures)


def register_plugin(plugin: Any, name: str | None = None) -> list[Backend]:
    """Register a plugin object or module at run time; returns its backends.

    Raises BackendError if it is malformed or a backend name is taken (nothing is registered).
    """
    source = f"register_plugin({name or _name_of(plugin)})"
    module = getattr(plugin, "__module__", None) if not isinstance(plugin, ModuleType) else None
    return registry().register(
        plugin, source=source + _distribution_of(module or _name_of(plugin)), name=name
    )


def unregister_plugin(plugin: Any) -> None:
    """Remove a plugin registered with :func:`register_plugin` (object or name)."""
    registry().unregister(plugin)


def _name_of(plugin: Any) -> str:
    return str(getattr(plugin, "__name__", None) or type(plugin).__name__)
