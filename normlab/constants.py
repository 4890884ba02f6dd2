"""Numbers and names shared by the core and the backends (the bottom import layer).

Backends may import this module, :mod:`normlab.errors`, :mod:`normlab.hookspecs` and
``normlab.backends.*``, nothing else of normlab (the ``lint`` session checks it).
"""

from __future__ import annotations

from typing import Final

__all__ = ["FLOAT_DTYPES", "HALF_DTYPES", "ITEMSIZE", "MACHINE_EPS", "ROW_CHUNK", "stats_dtype_for"]

FLOAT_DTYPES: Final = ("float16", "bfloat16", "float32", "float64")
HALF_DTYPES: Final = frozenset({"float16", "bfloat16"})
#: Bytes per element of each dtype.
ITEMSIZE: Final = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
#: ``finfo(dtype).eps``: rms_norm's default eps (as ``torch.nn.functional.rms_norm``).
MACHINE_EPS: Final = {
    "float16": 2.0**-10,
    "bfloat16": 2.0**-7,
    "float32": 2.0**-23,
    "float64": 2.0**-52,
}
#: Rows per partial sum of dweight/dbias in the CPU kernels (a fixed size: never the number of
#: threads). Partial sums are added in float64, chunk after chunk.
ROW_CHUNK: Final = 32


def stats_dtype_for(dtype: str) -> str:
    """The dtype of statistics and accumulation for inputs of ``dtype``."""
    return "float64" if dtype == "float64" else "float32"
