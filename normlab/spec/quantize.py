"""The rules of quantized outputs (``quantize=``, ``quantize_scale=`` on the forward and fused
ops; run by :mod:`normlab.quantize`): the modes, the dtype of ``q`` per array family, the static
scale, and the arrays ``out`` may hold.

A mode names the quantized type; a call with ``quantize_scale`` uses that static scale for every
row, a call without it a dynamic per-row scale ``max|y_row| / LIMIT``:

==============  ===========================================  ========
mode            q                                            LIMIT
==============  ===========================================  ========
``"int8"``      int8, symmetric: ``clip(rint(y / s), ±127)``  127
``"fp8_e4m3"``  float8 e4m3fn (finite, saturating at ±448)    448
==============  ===========================================  ========

q's dtype is ``int8`` in every family; for ``"fp8_e4m3"`` it is ``float8_e4m3fn`` (NumPy's through
``ml_dtypes``, torch's own), except for CuPy, which has no float8 dtype: there q holds the e4m3fn
bit patterns as ``uint8``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Final

import numpy as np

from normlab.errors import ArgumentError, ArgumentTypeError

__all__ = ["LIMITS", "MODES", "mode", "q_dtype", "static_scale"]

#: Each mode's largest magnitude of q (the dynamic scale is ``max|y_row| / LIMITS[mode]``).
LIMITS: Final = {"int8": 127.0, "fp8_e4m3": 448.0}
MODES: Final = tuple(LIMITS)
#: Families whose float8 q is held as its bit patterns (they have no float8 dtype).
_FP8_AS_BITS: Final = frozenset({"cupy"})


def q_dtype(mode: str, family: str) -> str:
    """The dtype name of q for ``mode`` in arrays of ``family``."""
    if mode == "int8":
        return "int8"
    return "uint8" if family in _FP8_AS_BITS else "float8_e4m3fn"


def mode(value: Any) -> str | None:
    """The call's quantization mode: None (y as usual) or one of :data:`MODES`."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ArgumentTypeError(
            f"quantize must be None or one of {', '.join(MODES)}; got {value!r}"
        )
    if value not in LIMITS:
        raise ArgumentError(f"quantize must be None or one of {', '.join(MODES)}; got {value!r}")
    return value


def static_scale(value: Any, quantize: str | None) -> float | None:
    """The call's static scale: None (dynamic, per row) or a finite number > 0, held as float32
    (the scale's dtype); only with ``quantize``."""
    if value is None:
        return None
    if quantize is None:
        raise ArgumentError(
            f"quantize_scale={value!r} was given without quantize=; name the mode "
            f"({', '.join(MODES)})"
        )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"quantize_scale must be a real number > 0, got {value!r}")
    scale = float(value)
    with np.errstate(over="ignore"):
        as_float32 = float(np.float32(scale))
    if not math.isfinite(scale) or not math.isfinite(as_float32) or as_float32 <= 0.0:
        raise ArgumentError(f"quantize_scale must be finite and > 0 as a float32, got {value!r}")
    return as_float32
