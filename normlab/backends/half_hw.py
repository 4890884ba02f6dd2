"""float16 <-> float32 by the CPU's own conversion instructions, for Numba nopython code.

Each function is one LLVM conversion (``fpext`` / ``fptrunc`` between ``half`` and ``float``)
emitted through :func:`numba.extending.intrinsic`; LLVM turns it into F16C's ``vcvtph2ps`` /
``vcvtps2ph`` (AVX-512 widens them to 16 lanes; AVX-512 FP16 has its own forms) and vectorises
a loop of them. On a CPU without such instructions LLVM would call a compiler-runtime function
instead, which Numba's JIT cannot link: :func:`converts_float16` says whether the CPU Numba
compiles for has them, and :mod:`normlab.backends.half_convert` chooses this module or
:mod:`normlab.backends.half_bits` by it.

Results equal :mod:`normlab.backends.half_bits`' for every non-NaN input, subnormals included:
float16 -> float32 is exact, float32 -> float16 rounds to nearest, ties to even, under the
default rounding mode (which Numba never changes). A NaN stays a NaN of the same sign, but its
payload may differ (the instructions set the quiet bit).

bfloat16 has no function here: its widening is a 16-bit shift (as cheap as an instruction), and
the AVX-512 BF16 narrowing (``vcvtneps2bf16``) flushes subnormal inputs and results to zero, so
it cannot give half_bits' results.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any, Final, cast

import llvmlite.binding as ll
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import config
from numba.extending import intrinsic

__all__ = ["converts_float16", "float16_to_float32", "float32_to_float16"]

#: The conversions this module emits, as a module of their own for :func:`converts_float16`.
_PROBE_IR: Final = """
define i16 @narrow(float %x) {
  %h = fptrunc float %x to half
  %b = bitcast half %h to i16
  ret i16 %b
}
define float @widen(i16 %x) {
  %h = bitcast i16 %x to half
  %f = fpext half %h to float
  ret float %f
}
"""
#: Compiler-runtime functions are named ``__...`` (``__extendhfsf2``, ``__truncsfhf2``,
#: ``__gnu_h2f_ieee``): one in the probe's assembly means the CPU lacks the instructions.
_RUNTIME_CALL: Final = re.compile(r"\b__\w+")


def numba_target() -> tuple[str, str]:
    """The CPU name and feature string Numba's JIT compiles for, as Numba itself takes them:
    ``NUMBA_CPU_NAME`` and ``NUMBA_CPU_FEATURES`` where set, else the host's."""
    from numba.core import codegen

    settings: Any = config
    name = settings.CPU_NAME if settings.CPU_NAME is not None else ll.get_host_cpu_name()
    features = settings.CPU_FEATURES
    if features is None:
        features = cast(Any, codegen).get_host_cpu_features()
    return str(name), str(features)


@cache
def converts_float16(cpu: str, features: str) -> bool:
    """Whether LLVM compiles float16 <-> float32 for ``cpu`` with ``features`` (see
    :func:`numba_target`) into instructions, with no call to a runtime function."""
    ll.initialize_native_target()
    ll.initialize_native_asmprinter()
    target = ll.Target.from_default_triple()
    machine = target.create_target_machine(cpu=cpu, features=features, opt=0)
    module = ll.parse_assembly(_PROBE_IR)
    module.triple = target.triple
    return _RUNTIME_CALL.search(machine.emit_assembly(module)) is None


def _widen_typed(typingctx: Any, bits: Any) -> Any:
    if bits not in (types.int16, types.uint16):
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


def _narrow_typed(typingctx: Any, value: Any) -> Any:
    if value != types.float32:
        return None

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(value), codegen


#: ``_widen(bits)``: the float32 of float16 bits (int16 or uint16); ``_narrow(value)``: the
#: float16 bits (uint16) of a float32. Intrinsics: callable from jitted code only.
_widen: Final[Any] = intrinsic(_widen_typed)
_narrow: Final[Any] = intrinsic(_narrow_typed)


@njit(error_model="numpy", inline="always")
def float16_to_float32(bits: Any) -> Any:
    """The float32 value of the float16 bit pattern ``bits`` (an int16 or uint16; exact)."""
    return _widen(bits)


@njit(error_model="numpy", inline="always")
def float32_to_float16(value: Any) -> Any:
    """The float16 bit pattern (as uint16) nearest to ``value`` (rounded to float32 first, as
    half_bits does), ties to even."""
    return _narrow(np.float32(value))
