"""The cache key of a call: its arguments' metadata, so a repeated kind of call skips the rules.

Two calls with equal keys pass or fail the rules alike and get the same validated call: the key
holds everything the rules read — each array's type and its inspector's key (dtype, shape,
strides, device; a torch tensor's ``requires_grad``), an output's writeability, the dims of
``normalized_shape``/``axis`` with their element types (``(4.0,)`` equals ``(4,)`` in Python,
but only one is valid), each other scalar with its type where its value alone is ambiguous
(``1 == True``) — and never an array's values or address.

The key is built on every call, so each op's key function is generated once from its table
entry (:func:`_generated`): one expression per argument, by its kind, in a single function —
what a hand-written key for that op would be, at a tenth of a µs per argument.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from normlab import arrays
from normlab.ops import OPS, Op
from normlab.spec.rules import eps_value

__all__ = ["KEYS", "call_key"]

#: The key expression of each kind of argument (``{a}``: the argument's name); the call's
#: first array is ``{first}``, keyed by ``key_of`` of its own type ``t``.
_EXPRESSIONS: Final = {
    "first": "key_of({a})",
    "array": "None if {a} is None else key_of({a}) if type({a}) is t else _array_key({a})",
    "dims": "None if {a} is None else _dims_key({a})",
    "eps": "{a} if type({a}) is float or {a} is None else _eps_key({a})",
    "flag": "{a} if {a} is True or {a} is False else (type({a}), {a})",
    "out": "None if {a} is None else _out_key({a})",
    "needs": "(type({a}), tuple({a}) if isinstance({a}, (tuple, list)) else {a})",
    "number": "{a} if type({a}) is float else (type({a}), {a})",
    "name": "{a} if type({a}) is str else (type({a}), {a})",
}
#: The kind of each argument that is not an array.
_KINDS: Final = {
    "normalized_shape": "dims",
    "axis": "dims",
    "eps": "eps",
    "return_stats": "flag",
    "return_residual": "flag",
    "out": "out",
    "residual_out": "out",
    "needs": "needs",
    "weight_offset": "number",
    "casting": "name",
    "quantize": "name",
    "quantize_scale": "number",
}


def _generated(op: Op) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """``op``'s key function: ``key(args)`` for its arguments in table order."""
    names = op.arguments
    first = names[0]
    parts = [
        _EXPRESSIONS[
            "first" if name == first else "array" if name in op.arrays else _KINDS[name]
        ].format(a=name)
        for name in names
    ]
    source = (
        "def key(args):\n"
        f"    ({', '.join(names)},) = args\n"
        f"    t = type({first})\n"
        "    key_of = inspector(t).key\n"
        f"    return ({op.name!r}, t, {', '.join(parts)})\n"
    )
    namespace: dict[str, Any] = {
        "inspector": arrays.inspector,
        "_array_key": _array_key,
        "_dims_key": _dims_key,
        "_eps_key": _eps_key,
        "_out_key": _out_key,
    }
    exec(compile(source, f"<normlab.spec.keys: {op.name}>", "exec"), namespace)
    return namespace["key"]  # type: ignore[no-any-return]


def call_key(op: Op, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The key of a call of ``op`` with ``args`` (the op's arguments in order): ``KEYS[op.name]``,
    generated now for an op added to the table since. Raises when an argument cannot be keyed
    (unhashable, not an array, an odd tensor): the caller then validates without the cache."""
    key = KEYS.get(op.name)
    if key is None:
        key = KEYS[op.name] = _generated(op)
    return key(args)


def _array_key(a: Any) -> tuple[Any, ...]:
    """The key of an array of another type than the call's first array."""
    return type(a), arrays.inspector(type(a)).key(a)


def _dims_key(value: Any) -> Any:
    """Dims with their element types: (4.0,) == (4,) in Python, but only one is valid."""
    if type(value) is int:
        return value
    if type(value) is tuple and len(value) == 1 and type(value[0]) is int:
        return value  # the common (cols,): ints only, unlike any key below (a type first)
    if isinstance(value, (tuple, list)):
        return (type(value), *((type(v), v) for v in value))
    return type(value), value


def _eps_key(eps: Any) -> tuple[Any, Any]:
    """An eps that is not a float: with its type; a one-element host array by its value."""
    if eps is not None and arrays.is_array(eps):
        eps = eps_value(eps)
    return type(eps), eps


def _out_key(out: Any) -> Any:
    """An output argument: each array's key and whether it is writeable (a tuple entry by
    entry)."""
    if isinstance(out, tuple):
        return tuple(None if o is None else _out_key(o) for o in out)
    key = arrays.inspector(type(out)).key(out)
    writeable = getattr(getattr(out, "flags", None), "writeable", True)
    return type(out), key, writeable


#: Each op's key function, generated from its table entry: ``KEYS[name](args)``.
KEYS: Final = {name: _generated(op) for name, op in OPS.items()}
