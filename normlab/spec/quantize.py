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

import importlib.util
import math
import struct
from typing import Any, Final

from normlab.errors import ArgumentError, ArgumentTypeError, DtypeError
from normlab.scalars import finite_float

__all__ = ["LIMITS", "MODES", "check_family", "mode", "q_dtype", "static_scale"]

#: Each mode's largest magnitude of q (the dynamic scale is ``max|y_row| / LIMITS[mode]``).
LIMITS: Final = {"int8": 127.0, "fp8_e4m3": 448.0}
MODES: Final = tuple(LIMITS)
#: Families whose float8 q is held as its bit patterns (they have no float8 dtype).
_FP8_AS_BITS: Final = frozenset({"cupy"})
#: Families with a float8 e4m3fn q (NumPy's through ml_dtypes), or its bits.
_FP8_FAMILIES: Final = frozenset({"numpy", "torch", "jax"}) | _FP8_AS_BITS


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


def check_family(quantize: str | None, family: str) -> None:
    """Refuse a float8 mode for arrays of a family without a float8 dtype (or NumPy without
    ml_dtypes)."""
    if quantize != "fp8_e4m3":
        return
    if family not in _FP8_FAMILIES:
        raise DtypeError(
            f"quantize='fp8_e4m3' needs a float8 e4m3fn dtype; {family} arrays have none "
            "(quantize='int8' is served)"
        )
    if family == "numpy" and importlib.util.find_spec("ml_dtypes") is None:
        raise DtypeError(
            "quantize='fp8_e4m3' on NumPy arrays needs ml_dtypes for its float8_e4m3fn "
            "(pip install 'normlab[bfloat16]')"
        )


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
    scale = finite_float("quantize_scale", value, "finite and > 0")
    as_float32 = _as_float32(scale)
    if not math.isfinite(as_float32) or as_float32 <= 0.0:
        raise ArgumentError(f"quantize_scale must be finite and > 0 as a float32, got {value!r}")
    return as_float32


def _as_float32(value: float) -> float:
    """``value`` rounded to float32 (to nearest even); inf beyond float32's range."""
    try:
        rounded: float = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.inf if value > 0 else -math.inf
    return rounded
