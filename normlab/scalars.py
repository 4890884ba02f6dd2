"""The numbers normlab takes as floats: eps, ``weight_offset``, ``quantize_scale``, the torch
modules' constructor arguments, the costs of a cost table.

Each is a real number (an ``int``, ``float``, ``Fraction``, NumPy scalar…; not a bool, not a
string) whose float value is finite. Anything else is an
:class:`~normlab.errors.ArgumentTypeError` (not a number) or an
:class:`~normlab.errors.ArgumentError` (beyond a float's range, NaN, infinite) naming the
argument and its value, never the ``OverflowError`` or ``ValueError`` that ``float()`` raises.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Final

from normlab.errors import ArgumentError, ArgumentTypeError

__all__ = ["finite_float", "shown"]

#: The longest value a message repeats whole (a 400-digit int is shortened).
_SHOWN_CHARACTERS: Final = 40


def finite_float(name: str, value: Any, rule: str, *, at_least: float | None = None) -> float:
    """``value`` as a finite float (not below ``at_least`` when given); else an error naming
    ``name`` and the value: ArgumentTypeError when it is not a real number, ArgumentError
    saying that it must be ``rule`` (``"finite and >= 0"``) otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a real number ({rule}), got {shown(value)}")
    try:
        result = float(value)
    except (OverflowError, ValueError, TypeError):  # a huge int or Fraction, a broken __float__
        raise ArgumentError(
            f"{name} must be {rule}, got {shown(value)}, beyond a float's range"
        ) from None
    if not math.isfinite(result) or (at_least is not None and result < at_least):
        raise ArgumentError(f"{name} must be {rule}, got {shown(value)}")
    return result


def shown(value: Any) -> str:
    """``repr(value)`` for a message, its middle elided when it is long."""
    text = repr(value)
    if len(text) <= _SHOWN_CHARACTERS:
        return text
    half = _SHOWN_CHARACTERS // 2
    return f"{text[:half]}…{text[-half:]} ({len(text)} characters)"
