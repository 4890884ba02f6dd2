"""The float16 and bfloat16 conversions the Numba kernels use, chosen once, at import.

float16 converts by the CPU's instructions (:mod:`normlab.backends.half_hw`) where the CPU
Numba compiles for has them (F16C, AVX-512 FP16: :func:`half_hw.converts_float16` asks LLVM),
else on its bit patterns (:mod:`normlab.backends.half_bits`); bfloat16 always on its bit
patterns (see half_hw for why). Both paths give the same results for every non-NaN value,
subnormals included; a NaN stays a NaN of its sign, its payload may differ between them.

The choice follows the CPU name and features that Numba's code is compiled and cached for
(``NUMBA_CPU_NAME``, ``NUMBA_CPU_FEATURES``), so a cached kernel always holds the path its
cache entry's CPU chose.
"""

from __future__ import annotations

from typing import Final

from normlab.backends import half_bits, half_hw

__all__ = [
    "FLOAT16_IN_HARDWARE",
    "PATH",
    "bfloat16_to_float32",
    "float16_to_float32",
    "float32_to_bfloat16",
    "float32_to_float16",
]

#: Whether float16 converts by CPU instructions here (else on bit patterns).
FLOAT16_IN_HARDWARE: Final = half_hw.converts_float16(*half_hw.numba_target())
#: The path in words, for benchmarks and reports.
PATH: Final = "float16 by CPU instructions" if FLOAT16_IN_HARDWARE else "float16 on bit patterns"

_float16: Final = half_hw if FLOAT16_IN_HARDWARE else half_bits
float16_to_float32: Final = _float16.float16_to_float32
float32_to_float16: Final = _float16.float32_to_float16
bfloat16_to_float32: Final = half_bits.bfloat16_to_float32
float32_to_bfloat16: Final = half_bits.float32_to_bfloat16
