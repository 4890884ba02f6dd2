"""The casting orders of RMSNorm (``casting=``; composed by :mod:`normlab.casting`), as data:
each order is one :class:`Casting`, the rounding point it puts between the norm and the weight
multiply. A new order (an engine's) is a new row of :data:`CASTINGS`, not a new argument."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from normlab.constants import HALF_DTYPES

__all__ = ["CASTINGS", "Casting", "normalized_dtype", "promoted", "y_dtype"]

_WIDTH: Final = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


@dataclass(frozen=True, slots=True)
class Casting:
    """One casting order. ``normalized``: the dtype ``x̂`` is rounded to before the weight
    multiply: None, not rounded (``y = x̂ · weight`` formed in the compute dtype and rounded
    once to x's dtype: the contract); ``"x"``: x's dtype; ``"half weight"``: the weight's
    dtype when it is float16/bfloat16, else the compute dtype (float32; float64 for float64
    x). With a rounding point, ``y = weight * x̂`` is formed in the promotion of the rounded
    dtype and the weight's, and y keeps that dtype. ``unquantizable``: why a quantizer has no
    float32 y to take under this order (None: it has one)."""

    name: str
    normalized: str | None
    unquantizable: str | None = None


#: The casting orders by name, the contract's first.
CASTINGS: Final = {
    order.name: order
    for order in (
        Casting("exact", None),
        Casting("llama", "x"),
        Casting(
            "t5",
            "half weight",
            unquantizable="T5's order rounds x̂ to the weight's dtype, so its float32 y is not "
            "defined",
        ),
    )
}


def promoted(a: str, b: str) -> str:
    """torch's type promotion of two float dtypes: the wider; float32 for float16 with
    bfloat16."""
    if a == b:
        return a
    if {a, b} == {"float16", "bfloat16"}:
        return "float32"
    return a if _WIDTH[a] > _WIDTH[b] else b


def normalized_dtype(casting: str, x_dtype: str, weight_dtype: str) -> str:
    """The dtype ``x̂`` is rounded to before the multiply, for a composed ``casting``."""
    rounded = CASTINGS[casting].normalized
    if rounded == "x":
        return x_dtype
    if rounded == "half weight" and weight_dtype in HALF_DTYPES:
        return weight_dtype
    return promoted(x_dtype, "float32")


def y_dtype(casting: str, x_dtype: str, weight_dtype: str | None) -> str:
    """The dtype of y: x's for an order without a rounding point or without a weight, else the
    promotion of the weight's dtype and :func:`normalized_dtype`."""
    if CASTINGS[casting].normalized is None or weight_dtype is None:
        return x_dtype
    return promoted(normalized_dtype(casting, x_dtype, weight_dtype), weight_dtype)
