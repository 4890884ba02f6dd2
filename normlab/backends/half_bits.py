"""float16 and bfloat16 <-> float32, on the raw 16-bit patterns, for Numba nopython code.

Numba cannot load ``numpy.float16`` or ``ml_dtypes.bfloat16`` elements, so the kernels read them
as 16-bit integers and convert here. Each function is branch-free (selects only), so a loop
over a row vectorises. The results equal NumPy's and ml_dtypes' casts bit for bit:

* to float32 is exact (every half value is a float32 value), NaN payloads are kept;
* from float32 rounds to nearest, ties to even; too large → ±inf; results below the smallest
  normal become subnormals (or ±0); NaN stays NaN with its sign — float16 keeps the top payload
  bits as NumPy does (0x7c01 if none survive), bfloat16 gives the quiet NaN 0x7fc0 as ml_dtypes.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
from numba import njit

from normlab.backends import numba_cache  # noqa: F401  (places the kernels' cache; first)

__all__ = ["bfloat16_to_float32", "float16_to_float32", "float32_to_bfloat16", "float32_to_float16"]

_F32_SIGN: Final = 0x80000000
_F32_ABS: Final = 0x7FFFFFFF
_F32_INF: Final = 0x7F800000
_F16_EXP_SHIFT: Final = 13  # float32 has 13 more mantissa bits than float16
_F16_REBIAS: Final = (127 - 15) << 23  # float32 exponent bias minus float16's, in place
_F16_INF: Final = 0x7C00
_F16_MIN_NORMAL: Final = 0x0400
#: |x| >= 2**16 (as float32 bits) is an infinity or NaN in float16, whatever the rounding.
_F32_F16_OVERFLOW: Final = 0x47800000
#: |x| < 2**-14 (float16's smallest normal) becomes a float16 subnormal or zero.
_F32_F16_SUBNORMAL: Final = 0x38800000
#: 0.5 as float32: its unit in the last place is 2**-24, float16's subnormal step, so adding it
#: rounds a tiny |x| to a float16 subnormal (nearest, ties to even) in the low mantissa bits.
_F16_SUBNORMAL_MAGIC: Final = 0x3F000000
_BF16_QUIET_NAN: Final = 0x7FC0


@njit(cache=True, error_model="numpy")
def float16_to_float32(bits: Any) -> np.float32:
    """The float32 value of the float16 bit pattern ``bits`` (exact; NaN payload kept)."""
    h = _u32(bits & 0xFFFF)
    magnitude = _u32(h & 0x7FFF)
    shifted = _u32(magnitude << _F16_EXP_SHIFT)
    special = _u32(shifted | _F32_INF)  # inf or NaN: all exponent bits set, payload kept
    wide = special if magnitude >= _F16_INF else _u32(shifted + _F16_REBIAS)
    # Below float16's smallest normal the value is magnitude * 2**-24: an exact float32 product.
    subnormal = np.float32(np.float32(magnitude) * np.float32(2.0**-24)).view(np.uint32)
    result = subnormal if magnitude < _F16_MIN_NORMAL else wide
    return np.uint32(result | _u32(_u32(h & 0x8000) << 16)).view(np.float32)


@njit(cache=True, error_model="numpy")
def float32_to_float16(value: Any) -> np.uint16:
    """The float16 bit pattern (as uint16) nearest to the float32 ``value``, ties to even."""
    f = np.float32(value).view(np.uint32)
    a = _u32(f & _F32_ABS)
    # NaN: keep the top payload bits, and at least one bit so that it stays a NaN.
    payload = _u32(_u32(a >> _F16_EXP_SHIFT) & 0x3FF)
    nan = _u32(_F16_INF | (payload if payload != 0 else _u32(1)))
    big = nan if a > _F32_INF else _u32(_F16_INF)
    tiny_sum = np.uint32(a).view(np.float32) + np.uint32(_F16_SUBNORMAL_MAGIC).view(np.float32)
    tiny = _u32(np.float32(tiny_sum).view(np.uint32) - _F16_SUBNORMAL_MAGIC)
    odd = _u32(_u32(a >> _F16_EXP_SHIFT) & 1)
    normal = _u32(_u32(a - _F16_REBIAS + 0xFFF + odd) >> _F16_EXP_SHIFT)
    small = tiny if a < _F32_F16_SUBNORMAL else normal
    result = big if a >= _F32_F16_OVERFLOW else small
    return np.uint16(result | _u32(f >> 16) & 0x8000)


@njit(cache=True, error_model="numpy")
def bfloat16_to_float32(bits: Any) -> np.float32:
    """The float32 value of the bfloat16 bit pattern ``bits`` (its top 16 bits; exact)."""
    return np.uint32(_u32(bits & 0xFFFF) << 16).view(np.float32)


@njit(cache=True, error_model="numpy")
def float32_to_bfloat16(value: Any) -> np.uint16:
    """The bfloat16 bit pattern (as uint16) nearest to the float32 ``value``, ties to even."""
    f = np.float32(value).view(np.uint32)
    rounded = _u32(_u32(f + 0x7FFF + _u32(_u32(f >> 16) & 1)) >> 16)
    nan = _u32(_u32(_u32(f >> 16) & 0x8000) | _BF16_QUIET_NAN)
    return np.uint16(nan if _u32(f & _F32_ABS) > _F32_INF else rounded)


@njit(cache=True, error_model="numpy", inline="always")
def _u32(value: Any) -> np.uint32:
    """``value`` truncated to uint32: Numba widens integer arithmetic to 64 bits, and these
    truncations let LLVM keep the conversions in 32-bit SIMD lanes."""
    return np.uint32(value)
