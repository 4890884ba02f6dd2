"""Numbers and names shared by the core and the backends (the bottom import layer).

Backends may import this module, :mod:`normlab.errors`, :mod:`normlab.hookspecs` and
``normlab.backends.*``, nothing else of normlab (the ``lint`` session checks it).
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "CUDA_LOOP_ITEMS",
    "CUDA_LOOP_THREADS",
    "CUDA_MACROS",
    "CUDA_MIN_BLOCK",
    "CUDA_PARTIAL_THREADS",
    "CUDA_SUM_COLUMNS",
    "CUDA_SUM_LANES",
    "FLOAT_DTYPES",
    "HALF_DTYPES",
    "ITEMSIZE",
    "MACHINE_EPS",
    "ROW_CHUNK",
    "stats_dtype_for",
]

FLOAT_DTYPES: Final = ("float16", "bfloat16", "float32", "float64")
HALF_DTYPES: Final = frozenset({"float16", "bfloat16"})
#: Bytes per element of each dtype.
ITEMSIZE: Final = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
#: ``finfo(dtype).eps``; rms_norm's default eps is that of the compute dtype (float32 for half
#: x), as ``torch.nn.functional.rms_norm``'s.
MACHINE_EPS: Final = {
    "float16": 2.0**-10,
    "bfloat16": 2.0**-7,
    "float32": 2.0**-23,
    "float64": 2.0**-52,
}
#: Rows per partial sum of dweight/dbias in the CPU kernels and the CUDA kernels (a fixed size:
#: never the number of threads). Partial sums are added in float64, chunk after chunk. The Numba
#: kernels take it as an argument (numba would freeze a global into its cached kernels).
ROW_CHUNK: Final = 32

# The CUDA kernels' launch shapes. The planner (normlab.backends.cuda_launch) reads them here and
# the kernels (normlab/backends/kernels/*.cu) are compiled with them as macros (CUDA_MACROS).
#: Threads per row of the kernels for rows of any length (normalize_loop, backward_loop).
CUDA_LOOP_THREADS: Final = 512
#: 16-byte chunks per thread per step of normalize_loop.
CUDA_LOOP_ITEMS: Final = 4
#: Fewest threads per block of the row-resident kernels (short rows share a block).
CUDA_MIN_BLOCK: Final = 128
#: Threads per block of weight_partials (one 16-byte chunk of columns each).
CUDA_PARTIAL_THREADS: Final = 128
#: Columns per block of sum_chunks, and lanes per column that share out the chunks.
CUDA_SUM_COLUMNS: Final = 32
CUDA_SUM_LANES: Final = 32

#: The constants the CUDA kernels are compiled with: ``NAME`` (``CUDA_`` prefix dropped) is
#: given to NVRTC as ``-DNORMLAB_NAME=<its value here>`` (``cuda_compile.kernel_macros``).
CUDA_MACROS: Final = (
    "ROW_CHUNK",
    "CUDA_LOOP_THREADS",
    "CUDA_LOOP_ITEMS",
    "CUDA_MIN_BLOCK",
    "CUDA_PARTIAL_THREADS",
    "CUDA_SUM_COLUMNS",
    "CUDA_SUM_LANES",
)


def stats_dtype_for(dtype: str) -> str:
    """The dtype of statistics and accumulation for inputs of ``dtype``."""
    return "float64" if dtype == "float64" else "float32"
