"""``h = x + residual``, the first step of every fused op, as the core forms it.

In x's dtype (the add rounded to it, bitwise the unfused add), or, for a float32 residual
stream beside half x (:attr:`normlab.spec.Call.residual_stream`), ``float32(x) + residual``
kept in float32; written into ``residual_out`` when the caller gave it. Used by every
composition that needs h: the fused op from its base op (:mod:`normlab.composition`), the
float32 stream (:mod:`normlab.residual_stream`) and quantized outputs (:mod:`normlab.quantize`).
"""

from __future__ import annotations

from typing import Any

from normlab import arrays
from normlab.spec import Call

__all__ = ["residual_sum"]


def residual_sum(call: Call, given: dict[str, Any]) -> Any:
    """h of the fused call ``call`` from its arguments by name (``given``): the caller's
    ``residual_out`` holding it when given, else a new array."""
    x, residual = given["x"], given["residual"]
    h = arrays.astype(x, residual.dtype) + residual if call.residual_stream else x + residual
    out = given["residual_out"]
    if out is None:
        return h
    arrays.copy_into(out, h)
    return out
