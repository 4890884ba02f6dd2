"""Whether the suite can run against a backend at all, said in one line before any test runs.

A backend whose module cannot be found or imported, or lacks a function its record declares,
fails the check outright (it could never serve a call); one that is unavailable here (no
device, library not installed) fails it too, unless the caller allows that, in which case its
tests skip with the reason (third-party CI on machines without the device).
"""

from __future__ import annotations

from normlab import registry
from normlab.errors import BackendError
from normlab.testing.default_choice import candidates, default_family, is_default

__all__ = ["obstacle"]

#: The functions every backend module defines besides its ops.
CONVERTERS = ("to_numpy", "from_numpy")


def obstacle(name: str, *, allow_unavailable: bool = False) -> str | None:
    """Why the conformance suite cannot check backend ``name`` here (one line), or ``None``.

    ``allow_unavailable``: a backend that is unavailable here for a reason other than a
    missing module is no obstacle (its tests are skipped with the reason).
    """
    if is_default(name):
        family = default_family(name)
        if not candidates(family):
            return f"{name}: no available backend serves {family} arrays by default"
        return None
    try:
        backend = registry.get(name)
    except BackendError as exc:
        return str(exc)
    missing_module = registry.module_problem(backend.record.module)
    if missing_module is not None:
        return f"backend {name!r}: {missing_module} (record from {backend.provided_by})"
    if not backend.available:
        if allow_unavailable:
            return None
        return (
            f"backend {name!r} is unavailable here: {backend.reason} (--allow-unavailable "
            "skips its tests instead)"
        )
    try:
        module = backend.module
    except BackendError as exc:
        return str(exc)
    declared = (*sorted(backend.ops), *CONVERTERS)
    missing = [fn for fn in declared if not callable(getattr(module, fn, None))]
    if missing:
        return (
            f"backend {name!r}: {backend.record.module} defines no {', '.join(missing)} "
            f"(its record declares ops {', '.join(sorted(backend.ops))}; every backend module "
            "also defines to_numpy and from_numpy)"
        )
    return None
