"""The dtypes of the casting orders of RMSNorm (``casting=``; composed by :mod:`normlab.casting`):
which dtype ``x̂`` is rounded to before the weight multiply, and y's dtype."""

from __future__ import annotations

from typing import Final

from normlab.constants import HALF_DTYPES

__all__ = ["CASTINGS", "normalized_dtype", "promoted", "y_dtype"]

#: The casting orders, the contract's first.
CASTINGS: Final = ("exact", "llama", "t5")
_WIDTH: Final = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


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
    if casting == "llama":
        return x_dtype
    if weight_dtype in HALF_DTYPES:
        return weight_dtype
    return promoted(x_dtype, "float32")


def y_dtype(casting: str, x_dtype: str, weight_dtype: str | None) -> str:
    """The dtype of y: x's for ``"exact"`` or without a weight, else the promotion of the weight's
    dtype and :func:`normalized_dtype`."""
    if casting == "exact" or weight_dtype is None:
        return x_dtype
    return promoted(normalized_dtype(casting, x_dtype, weight_dtype), weight_dtype)
