"""Choice: which backend serves this call.

Order of precedence:

1. ``backend=`` names a backend: it must serve the array, else :class:`BackendError` (strict);
2. ``use_backend(name)`` (a :class:`~contextvars.ContextVar`, thread- and async-safe) or the
   ``NORMLAB_BACKEND`` environment variable: a preference, used when that backend can serve;
3. otherwise, among the available backends that serve the op, the array family, the device
   kind, the dtype and (for tensors that require grad) the graph (see :func:`keeps_graph`): the
   highest-priority one — unless it declares a cost model (:mod:`normlab.costs`), in which case,
   among those that declare one, the able backend whose estimates over the row profile of the
   call's row length (:func:`normlab.costs.profile_us`: 1, 4, 16 … rows) are never far from the
   fastest's: the smallest worst ratio to the fastest estimate at any row count (priority
   breaks ties).

**Batch invariance.** The choice never depends on the number of rows: for one op, family,
device kind, dtype, row length and graph need, every batch goes to the same backend, and each
backend gives a row the same bits alone or in any batch; so does the default call.

A backend serves the families of its ``zero_copy_families`` (another library's arrays, read in
place on the same device) like its own; those of its ``explicit_families`` only when named by
``backend=`` or ``use_backend``. There are no implicit device moves and no conversions between
array libraries. Choices are cached per (op, family, device kind, dtype, requires-grad, row
length, named backend, preference): a pure function of metadata and the cost models, never of
timings taken at call time. The ``normlab.dispatch`` logger says at DEBUG what was chosen and why.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Final

from normlab import costs, registry
from normlab.errors import BackendError, NormlabWarning
from normlab.hookspecs import Plan
from normlab.ops import OPS
from normlab.registry import Backend

__all__ = [
    "Choice",
    "backend_named",
    "choose",
    "clear_caches",
    "current_preference",
    "keeps_graph",
    "refusal",
    "use_backend",
]

logger: Final = logging.getLogger("normlab.dispatch")

_preference: ContextVar[str | None] = ContextVar("normlab_backend_preference", default=None)
_UNREAD: Final = object()
_env_preference: Any = _UNREAD
_env_torch_default: Any = _UNREAD
_choices: dict[tuple[Any, ...], Choice] = {}
_generation = -1


@dataclass(frozen=True, slots=True)
class Choice:
    """The backend chosen for a call, and one line per candidate saying why it won or lost.

    ``records_no_graph``: the call is on torch tensors and the backend records no autograd graph
    itself (no ``autograd`` capability); the core runs such a backend through normlab's custom
    ops when a tensor requires grad or a torch trace is in progress (:mod:`normlab.autograd`).
    ``composed``: a fused op that no able backend provides, served by the core's composition on
    the backend chosen for its base op (:mod:`normlab.composition`).
    """

    backend: Backend
    how: str
    notes: tuple[str, ...]
    records_no_graph: bool = False
    composed: bool = False


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Prefer backend ``name`` inside this block (falls back when it cannot serve an array)."""
    backend_named(name)
    token = _preference.set(name)
    try:
        yield
    finally:
        _preference.reset(token)


def current_preference() -> str | None:
    """The preferred backend name: ``use_backend`` first, then ``NORMLAB_BACKEND``."""
    return _preference.get() or _environment_preference()


def backend_named(name: str) -> Backend:
    """``registry.get(name)``; for an unknown name the error also suggests the closest one."""
    try:
        return registry.get(name)
    except BackendError as exc:
        names = list(registry.registry().backends)
        close = difflib.get_close_matches(name, names, n=1) if isinstance(name, str) else []
        if not close:
            raise
        raise BackendError(f"{exc}; did you mean {close[0]!r}?") from None


def _environment_preference() -> str | None:
    global _env_preference
    if _env_preference is _UNREAD:
        name = os.environ.get("NORMLAB_BACKEND") or None
        if name is not None and name not in registry.registry().backends:
            warnings.warn(
                f"NORMLAB_BACKEND={name!r} names no registered backend "
                f"({', '.join(sorted(registry.registry().backends))}); ignoring it",
                NormlabWarning,
                stacklevel=4,
            )
            name = None
        _env_preference = name
    return _env_preference  # type: ignore[no-any-return]


def _torch_to_torch() -> bool:
    """``NORMLAB_TORCH_DEFAULT=torch``: torch tensors go to the torch backend unless a call
    names another (no zero-copy service of them chosen by cost); read once, as
    ``NORMLAB_BACKEND``."""
    global _env_torch_default
    if _env_torch_default is _UNREAD:
        value = os.environ.get("NORMLAB_TORCH_DEFAULT") or "auto"
        if value not in ("torch", "auto"):
            warnings.warn(
                f"NORMLAB_TORCH_DEFAULT={value!r} is neither 'torch' nor 'auto'; using 'auto'",
                NormlabWarning,
                stacklevel=5,
            )
        _env_torch_default = value == "torch"
    return _env_torch_default  # type: ignore[no-any-return]


def clear_caches() -> None:
    """Forget cached choices and re-read ``NORMLAB_BACKEND`` and ``NORMLAB_TORCH_DEFAULT`` on
    the next call."""
    global _env_preference, _env_torch_default
    _choices.clear()
    _env_preference = _UNREAD
    _env_torch_default = _UNREAD


def refusal(backend: Backend, plan: Plan, named: bool) -> str | None:
    """Why ``backend`` cannot serve ``plan`` (``None`` when it can).

    ``named``: the caller named this backend (``backend=`` or a preference).
    """
    why = _mismatch(backend, plan, named)
    if named and not backend.available:  # the caller asked for it: why it cannot run comes first
        unavailable = f"is unavailable: {backend.reason}"
        return unavailable if why is None else f"{unavailable}; besides, it {why}"
    if why is None and not backend.available:  # checked last: the check may import a library
        return f"unavailable: {backend.reason}"
    return why


def _mismatch(backend: Backend, plan: Plan, named: bool) -> str | None:
    """What in ``backend``'s record does not fit ``plan`` (availability aside)."""
    if plan.op not in backend.ops:
        return f"does not provide {plan.op}"
    families = backend.families | backend.zero_copy_families
    if named:
        families |= backend.explicit_families
    elif plan.family == "torch" and "torch" not in backend.families and _torch_to_torch():
        families -= {"torch"}  # NORMLAB_TORCH_DEFAULT=torch
    if plan.family not in families:
        served = ", ".join(sorted(backend.families))
        extra = ""
        if plan.family in backend.explicit_families:
            extra = (
                f"; it serves {plan.family} arrays only when named with backend={backend.name!r}"
            )
        elif plan.family in backend.zero_copy_families:
            extra = "; NORMLAB_TORCH_DEFAULT=torch keeps torch tensors on torch unless named"
        return f"serves {served} arrays, not {plan.family}{extra}"
    if plan.device_kind not in backend.devices:
        return f"serves devices {', '.join(sorted(backend.devices))}, not {plan.device}"
    if plan.dtype not in backend.dtypes:
        return f"serves dtypes {', '.join(sorted(backend.dtypes))}, not {plan.dtype}"
    if plan.requires_grad and not keeps_graph(backend, plan.op):
        return (
            f"does not support autograd (it records no graph and provides no "
            f"{plan.op}_backward for normlab's custom op) and x requires grad (normlab never "
            "detaches silently)"
        )
    return None


def keeps_graph(backend: Backend, op: str) -> bool:
    """Whether torch tensors that require grad keep their autograd graph through ``backend``'s
    ``op``: the backend records graphs itself (the ``autograd`` capability), or the core runs it
    through normlab's custom op, whose gradient is the backend's own backward op (provided).
    A backward op run that way stays in the graph as a leaf op (no double backward)."""
    if "autograd" in backend.capabilities:
        return True
    table = OPS.get(op)
    if table is None or table.gradient_op is None:
        return table is not None  # a backward op: run through its custom op as a graph leaf
    return table.gradient_op in backend.ops


def choose(plan: Plan, named: str | None = None) -> Choice:
    """The backend for ``plan``: ``named`` strictly, else preference, else priority."""
    global _generation
    preference = _preference.get() or _environment_preference()
    if named is not None and not isinstance(named, str):
        raise BackendError(f"unknown backend {named!r}: backend= takes a backend name (str)")
    generation = registry.registry().generation
    if generation != _generation:  # plugins came or went: every cached choice is stale
        _choices.clear()
        _generation = generation
    key = (
        plan.op,
        plan.family,
        plan.device_kind,
        plan.dtype,
        plan.requires_grad,
        # never the number of rows (batch invariance); a symbolic row length (torch.compile
        # with dynamic shapes) is read as its value: the graph is specialized to it, rows stay
        # symbolic
        plan.cols if type(plan.cols) is int else int(plan.cols),
        named,
        preference,
    )
    choice = _choices.get(key)
    if choice is None:
        choice = _decide_or_compose(plan, named, preference)
        if plan.family == "torch" and "autograd" not in choice.backend.capabilities:
            choice = dataclasses.replace(choice, records_no_graph=True)
        _choices[key] = choice
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s: %s", key[:5], "; ".join(choice.notes))
    return choice


def _load_failure(backend: Backend) -> str | None:
    """``None`` when ``backend``'s module loads; else, once (the backend is unavailable from
    then on), a warning that the call falls back, and the reason."""
    try:
        backend.module  # noqa: B018 (loads it)
    except BackendError as exc:
        warnings.warn(f"{exc}; falling back to the next backend", NormlabWarning, stacklevel=5)
        return f"unavailable: {backend.reason}"
    return None


def _cheapest(able: list[tuple[Backend, Profile]]) -> tuple[Backend, float | None]:
    """The backend to use among ``able`` (highest priority first, with their row profiles), and
    its worst ratio when cost decided (None: priority did): the highest-priority one unless it
    has a profile, then, among those that have one, the smallest worst ratio to the fastest
    estimate at each row count (the earlier, higher-priority one on a tie)."""
    first, first_profile = able[0]
    if first_profile is None:
        return first, None
    profiled = [(i, p) for i, (_, p) in enumerate(able) if p is not None]
    if len(profiled) == 1:
        return first, None
    ratio, index = min((_worst_ratio(p, profiled), i) for i, p in profiled)
    return able[index][0], ratio


#: A backend's estimates at the row counts of its row profile (costs.profile_us), or None.
Profile = tuple[float, ...] | None


def _worst_ratio(
    profile: tuple[float, ...], profiled: list[tuple[int, tuple[float, ...]]]
) -> float:
    """The largest ratio, over the row counts, of ``profile``'s estimate to the fastest one of
    ``profiled`` there (1.0: never slower than any other)."""
    worst = 1.0
    for k, estimate in enumerate(profile):
        fastest = min(p[k] for _, p in profiled)
        if estimate > fastest:
            worst = max(worst, estimate / fastest if fastest > 0 else math.inf)
    return worst


def _decide_or_compose(plan: Plan, named: str | None, preference: str | None) -> Choice:
    """:func:`_decide`; for a fused op that no able backend provides, the choice for its base
    op, marked ``composed`` (when even that fails, the base op's error)."""
    base = OPS[plan.op].base if plan.op in OPS else None
    try:
        return _decide(plan, named, preference)
    except BackendError:
        if base is None:
            raise
    base_plan = dataclasses.replace(plan, op=base, return_residual=False)
    return dataclasses.replace(_decide(base_plan, named, preference), composed=True)


def _decide(plan: Plan, named: str | None, preference: str | None) -> Choice:
    if named is not None:
        backend = backend_named(named)
        why = refusal(backend, plan, named=True)
        if why is not None:
            raise BackendError(
                f"backend {named!r} cannot serve this {plan.family} array ({plan.dtype} on "
                f"{plan.device}): it {why}"
            )
        return Choice(backend, NAMED, (f"{named}: named with backend=",))
    notes: list[str] = []
    if preference is not None:
        backend = backend_named(preference)
        why = refusal(backend, plan, named=True) or _load_failure(backend)
        if why is None:
            return Choice(
                backend,
                "preferred (use_backend / NORMLAB_BACKEND)",
                (f"{preference}: preferred and able to serve",),
            )
        notes.append(f"{preference}: preferred but it {why}; falling back to priority")
    able: list[tuple[Backend, Profile]] = []
    for backend in registry.list_backends():
        why = refusal(backend, plan, named=False)
        if why is None:
            able.append((backend, costs.profile_us(backend, plan)))
        else:
            notes.append(f"{backend.name} (priority {backend.priority}): {why}")
    chosen: Backend | None = None
    ratio: float | None = None
    while able and chosen is None:
        candidate, ratio = _cheapest(able)
        failure = _load_failure(candidate)
        if failure is not None:
            notes.append(f"{candidate.name} (priority {candidate.priority}): {failure}")
            able = [(b, p) for b, p in able if b is not candidate]
            continue
        chosen = candidate
        profiled = [(i, p) for i, (_, p) in enumerate(able) if p is not None]
        for backend, profile in able:
            cost = _cost_note(backend, plan, profile, profiled if ratio is not None else [])
            if backend is chosen:
                why = BY_COST if ratio is not None else "highest priority able to serve"
                notes.append(f"{backend.name} (priority {backend.priority}): chosen, {why}{cost}")
            else:
                why = (
                    "slower somewhere in the row profile" if ratio is not None else "lower priority"
                )
                notes.append(
                    f"{backend.name} (priority {backend.priority}): able to serve, {why}{cost}"
                )
    if chosen is None:
        raise BackendError(
            f"no backend can serve a {plan.family} array of {plan.dtype} on {plan.device} for "
            f"{plan.op}: " + "; ".join(notes)
        )
    how = BY_COST if ratio is not None else "highest priority"
    return Choice(chosen, how, tuple(notes))


#: How a choice by ``backend=`` is named in explain() and the notes.
NAMED: Final = "named with backend="
#: How a choice by cost is named in explain() and the notes.
BY_COST: Final = "lowest worst-case cost over the row profile"


def _cost_note(
    backend: Backend,
    plan: Plan,
    profile: Profile,
    profiled: list[tuple[int, tuple[float, ...]]],
) -> str:
    """The estimate of this call on ``backend`` and, when cost decided, its worst ratio to the
    fastest able backend over the row profile."""
    estimate = costs.estimate_us(backend, plan)
    text = "" if estimate is None else f", estimated {estimate:.3g} µs"
    if profile is not None and profiled:
        rows = costs.grid_rows(plan.cols, plan.dtype)
        text += (
            f", at most {_worst_ratio(profile, profiled):.2f}x the fastest for 1..{rows[-1]} rows"
        )
    return text
