"""The default choice as a subject of the suite: ``normlab check default`` (``default:FAMILY``).

A user calls ``normlab.layer_norm(x)``, not a backend: the dispatcher composes the able
backends of x's family by cost. The subject ``default:numpy`` (``default:torch``, …) runs the
suite with ``backend=None`` on that family's arrays, so every promise (batch invariance among
them: the choice must not change with the number of rows) is checked for the call the user
makes, with whatever plugins are installed taking part in the choice. The family's own backend
makes and reads its arrays (``from_numpy``/``to_numpy``).

What the subject claims is what holds whichever candidate is chosen: the dtypes and ops any
candidate serves, the capabilities every candidate claims, subnormals flushed when any
candidate flushes them, batch invariance when every candidate promises it.
"""

from __future__ import annotations

from typing import Final

from normlab import registry
from normlab.registry import Backend

__all__ = [
    "EVERY_FAMILY",
    "PREFIX",
    "call_backend",
    "candidates",
    "default_family",
    "default_subjects",
    "flushes_subnormals",
    "is_default",
]

#: The prefix of a default subject's name: ``default:numpy``.
PREFIX: Final = "default:"
#: ``normlab check default``: every installed family's default subject.
EVERY_FAMILY: Final = "default"


def is_default(name: str) -> bool:
    """Whether ``name`` names a default subject (``default:FAMILY``), not a backend."""
    return name.startswith(PREFIX)


def default_family(name: str) -> str:
    """The family of the default subject ``name``."""
    return name.removeprefix(PREFIX)


def call_backend(name: str) -> str | None:
    """What the suite passes as ``backend=`` for subject ``name``: None for a default subject
    (the dispatcher chooses), else the backend's name."""
    return None if is_default(name) else name


def candidates(family: str) -> list[Backend]:
    """The available backends the default call may choose for ``family``'s arrays: those
    serving it as their own family or zero-copy (not those serving it only when named)."""
    return [
        b
        for b in registry.list_backends()
        if family in b.families | b.zero_copy_families and b.available
    ]


def default_subjects() -> list[str]:
    """``default:FAMILY`` for each family that an available backend serves as its own."""
    families = dict.fromkeys(f for b in registry.list_backends() if b.available for f in b.families)
    return [f"{PREFIX}{family}" for family in families if candidates(family)]


def flushes_subnormals(name: str) -> bool:
    """Whether subject ``name`` may flush subnormals (a default: any candidate declares it)."""
    if is_default(name):
        return any(b.flushes_subnormals for b in candidates(default_family(name)))
    return registry.get(name).flushes_subnormals
