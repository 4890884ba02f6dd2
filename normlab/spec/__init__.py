"""Validation: every rule of the contract that is not arithmetic, checked once per kind of call.

One front door for every op: :func:`validated` takes an op of the table (:mod:`normlab.ops`)
and its arguments in order, and returns the validated :class:`Call` — whose ``plan`` is all a
backend sees — or raises a :class:`~normlab.errors.NormlabError` subclass naming the values
involved. Calls are cached by their arguments' metadata (:mod:`normlab.spec.keys`), so a repeated
kind of call costs one dictionary lookup; the rules themselves (:mod:`normlab.spec.rules`) run
on a miss. Outputs' overlaps are :mod:`normlab.spec.aliasing`'s.
"""

from __future__ import annotations

from typing import Any, Final

from normlab.errors import ArgumentError
from normlab.hookspecs import Plan
from normlab.ops import OPS, Op
from normlab.spec.call import Call
from normlab.spec.keys import KEYS, call_key
from normlab.spec.rules import row_call, validate

__all__ = ["Call", "arguments", "clear_cache", "plan", "row_call", "validated"]

_CACHE_SIZE: Final = 4096

#: Validated calls of every op, keyed by the op and its arguments' metadata.
_cache: dict[tuple[Any, ...], Call] = {}


def validated(op: Op, args: tuple[Any, ...]) -> Call:
    """The validated :class:`Call` of ``op`` with ``args``, the op's arguments in the order of
    ``op.arguments`` (cached by their metadata: a repeated kind of call costs one dictionary
    lookup)."""
    key: tuple[Any, ...] | None
    try:
        keyed = KEYS.get(op.name)  # the key function, looked up here: this runs on every call
        key = keyed(args) if keyed is not None else call_key(op, args)
        cached = _cache.get(key)
    except Exception:  # unhashable, not an array, or an odd tensor: validate the slow way
        key, cached = None, None
    if cached is not None:
        return cached
    result = validate(op, args)
    if key is not None:
        if len(_cache) >= _CACHE_SIZE:
            _cache.clear()
        _cache[key] = result
    return result


def arguments(op: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """The arguments of a call of the op named ``op``, in the order of ``OPS[op].arguments``:
    ``args`` in that order, then ``kwargs`` by name, the rest the op's defaults (eps: the op's
    ``default_eps``; ``return_residual``: True; ``needs``: every gradient; ``weight_offset``:
    0.0; ``casting``: ``"exact"``; others None or False); an argument the op does not take may
    be given as None (rms_norm's bias). For tests and tools; the public functions pass their
    arguments in order."""
    table = OPS.get(op)
    if table is None:
        raise ArgumentError(f"unknown op {op!r}; normlab provides {', '.join(OPS)}")
    if len(args) > len(table.arguments):
        raise ArgumentError(f"{op} takes {len(table.arguments)} arguments, got {len(args)}")
    defaults = {
        "eps": table.default_eps,
        "return_stats": False,
        "return_residual": True,
        "needs": table.gradients,
        "weight_offset": 0.0,
        "casting": "exact",
    }
    unknown = [
        name for name, value in kwargs.items() if name not in table.index and value is not None
    ]
    if unknown:
        raise ArgumentError(f"{op} takes no {', '.join(sorted(unknown))}")
    given = {**defaults, **dict(zip(table.arguments, args, strict=False)), **kwargs}
    return tuple(given.get(name) for name in table.arguments)


def plan(op: str, *args: Any, **kwargs: Any) -> Plan:
    """The :class:`~normlab.hookspecs.Plan` a backend receives for a call of the op named
    ``op`` (its arguments as :func:`arguments` takes them; tests and tools drive backends with
    it)."""
    return validated(OPS[op], arguments(op, *args, **kwargs)).plan


def clear_cache() -> None:
    """Forget every validated call."""
    _cache.clear()
