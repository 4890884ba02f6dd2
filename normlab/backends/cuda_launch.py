"""The launch planner of the CUDA kernels in ``kernels/layer_norm.cu``, in plain Python.

Both ops run the same two kernel templates: ``CENTRE = true`` is LayerNorm, ``false`` RMSNorm.
A row of ``cols`` elements is cut into chunks of :func:`vector_width` elements (16 bytes). The
row-resident kernel ``normalize_rows`` gives each row ``threads`` threads holding ``items``
chunks each in registers; :func:`_ladder` lists the (threads, items) rungs, smallest capacity
first, and the planner takes the first rung that holds the row. Rows longer than the top rung go
to ``normalize_loop`` (one block per row, x read twice). The choice depends only on the op, the
row length, the dtypes and the alignment of the pointers, never on the number of rows; and since
the kernels assign chunks to threads the same way with and without 16-byte accesses, alignment
changes the memory instructions, not the arithmetic: a row's result is bitwise the same alone or
in any batch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

__all__ = [
    "LOOP_ITEMS",
    "LOOP_THREADS",
    "MAX_GRID",
    "OPS",
    "LaunchPlan",
    "Specialisation",
    "all_specialisations",
    "param_dtypes",
    "plan_launch",
    "program_of",
    "vector_width",
]

#: The ops of the kernels, and the value of their CENTRE template parameter.
OPS: Final = {"layer_norm": "true", "rms_norm": "false"}
#: Prefix of the names of each op's kernels.
_PREFIX: Final = {"layer_norm": "", "rms_norm": "rms_"}
#: C++ element type of each dtype name (``half``/``bfloat16`` are storage types of the .cu file).
CXX_TYPES: Final = {
    "float16": "normlab::half",
    "bfloat16": "normlab::bfloat16",
    "float32": "float",
    "float64": "double",
}
ITEMSIZE: Final = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_SHORT: Final = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}

#: Threads per row and chunks per thread per step of ``normalize_loop`` (as in the .cu file).
LOOP_THREADS: Final = 512
LOOP_ITEMS: Final = 4
#: Largest gridDim.x; the kernels stride over rows beyond it.
MAX_GRID: Final = 2**31 - 1
#: Fewest threads per block of ``normalize_rows`` (short rows share a block).
_MIN_BLOCK: Final = 128


def vector_width(dtype: str) -> int:
    """Elements per 16-byte chunk of ``dtype``."""
    return 16 // ITEMSIZE[dtype]


def _max_items(dtype: str) -> int:
    """Chunks per thread at most: 32 float accumulators (16 doubles) of row per thread."""
    return 4 if ITEMSIZE[dtype] == 2 else 8


def _ladder(dtype: str) -> tuple[tuple[int, int], ...]:
    """(threads per row, chunks per thread) of ``normalize_rows``, smallest capacity first."""
    top = _max_items(dtype)
    rungs = [(32, 1), (32, 2), (32, 4), (64, 4), (128, 4)]
    if top > 4:
        rungs.append((128, top))
    return (*rungs, (256, top), (512, top))


def param_dtypes(dtype: str) -> tuple[str, ...]:
    """Weight (and bias) dtypes the kernels take for x of ``dtype``."""
    return (dtype, "float32") if ITEMSIZE[dtype] == 2 else (dtype,)


@dataclass(frozen=True, slots=True)
class Specialisation:
    """One compiled kernel: op, element and parameter dtypes, shape class, memory access width.

    ``op`` is ``"layer_norm"`` or ``"rms_norm"``; ``threads`` the number of threads per row;
    ``items`` the chunks each holds (0 for the loop kernel, which streams); ``vector``: 16-byte
    loads and stores.
    """

    op: str
    dtype: str
    param_dtype: str
    threads: int
    items: int
    vector: bool

    @property
    def loop(self) -> bool:
        return self.items == 0

    @property
    def name(self) -> str:
        """A short unique name, e.g. ``rows_f16_pf32_t128_i4_vec`` (layer_norm) or
        ``rms_loop_f32_pf32_scalar`` (rms_norm)."""
        types = f"{_SHORT[self.dtype]}_p{_SHORT[self.param_dtype]}"
        access = "vec" if self.vector else "scalar"
        if self.loop:
            return f"{_PREFIX[self.op]}loop_{types}_{access}"
        return f"{_PREFIX[self.op]}rows_{types}_t{self.threads}_i{self.items}_{access}"

    @property
    def expression(self) -> str:
        """The C++ name of the kernel instantiation (an NVRTC name expression)."""
        t, p, centre = CXX_TYPES[self.dtype], CXX_TYPES[self.param_dtype], OPS[self.op]
        v = "true" if self.vector else "false"
        if self.loop:
            return f"normlab::normalize_loop<{t}, {p}, {centre}, {v}>"
        return f"normlab::normalize_rows<{t}, {p}, {centre}, {self.threads}, {self.items}, {v}>"

    @property
    def block(self) -> int:
        """Threads per block."""
        return self.threads if self.loop else max(self.threads, _MIN_BLOCK)

    @property
    def rows_per_block(self) -> int:
        return 1 if self.loop else self.block // self.threads

    @property
    def capacity(self) -> int | None:
        """Longest row held in registers (``None``: the loop kernel takes any length)."""
        return None if self.loop else self.threads * self.items * vector_width(self.dtype)


@functools.cache
def all_specialisations() -> tuple[Specialisation, ...]:
    """Every kernel the planner can choose, grouped by (op, dtype, parameter dtype)."""
    specs: list[Specialisation] = []
    for op in OPS:
        for dtype in CXX_TYPES:
            for param in param_dtypes(dtype):
                for vector in (True, False):
                    specs.extend(
                        Specialisation(op, dtype, param, threads, items, vector)
                        for threads, items in _ladder(dtype)
                    )
                    specs.append(Specialisation(op, dtype, param, LOOP_THREADS, 0, vector))
    return tuple(specs)


def program_of(spec: Specialisation) -> tuple[Specialisation, ...]:
    """The specialisations compiled in one NVRTC program with ``spec``: those of its op, dtype
    and parameter dtype (run time and :func:`~normlab.backends.cuda_compile.compile_all` share
    the programs, hence the cached cubins)."""
    group = (spec.op, spec.dtype, spec.param_dtype)
    return tuple(s for s in all_specialisations() if (s.op, s.dtype, s.param_dtype) == group)


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """How to launch the kernel for rows of one length: a specialisation and its block shape."""

    specialisation: Specialisation
    cols: int

    @property
    def vector_width(self) -> int:
        """Elements per chunk (one 16-byte access when ``specialisation.vector``)."""
        return vector_width(self.specialisation.dtype)

    @property
    def threads_per_row(self) -> int:
        return self.specialisation.threads

    @property
    def block(self) -> int:
        return self.specialisation.block

    @property
    def rows_per_block(self) -> int:
        return self.specialisation.rows_per_block

    def grid(self, rows: int) -> int:
        """Blocks to launch for ``rows`` rows (>= 1); blocks stride over rows beyond MAX_GRID."""
        if rows < 1:
            raise ValueError(f"rows must be >= 1 (no launch for empty input), got {rows}")
        return min(-(-rows // self.rows_per_block), MAX_GRID)


def plan_launch(
    op: str,
    cols: int,
    dtype: str,
    param_dtype: str | None,
    addresses: Sequence[int | None],
    row_strides: Sequence[int],
) -> LaunchPlan:
    """The launch of ``op`` (``"layer_norm"``, ``"rms_norm"``) for rows of ``cols`` elements of
    ``dtype``.

    ``param_dtype``: dtype of weight and bias (``None``: neither given). ``addresses``: byte
    addresses of x, out, weight and bias (``None`` for those absent); ``row_strides``: element
    strides between rows of x and out. 16-byte accesses are used when every address and every
    row stride in bytes is a multiple of 16 and ``cols`` a multiple of the chunk length.
    """
    if op not in OPS:
        raise ValueError(f"the CUDA kernels compute {', '.join(OPS)}, not {op}")
    if cols < 1:
        raise ValueError(f"cols must be >= 1 (no launch for empty input), got {cols}")
    param = dtype if param_dtype is None else param_dtype
    if param not in param_dtypes(dtype):
        raise ValueError(f"weight/bias of dtype {param} do not go with x of dtype {dtype}")
    width, itemsize = vector_width(dtype), ITEMSIZE[dtype]
    vector = (
        cols % width == 0
        and all(a % 16 == 0 for a in addresses if a is not None)
        and all(s * itemsize % 16 == 0 for s in row_strides)
    )
    for threads, items in _ladder(dtype):
        if cols <= threads * items * width:
            return LaunchPlan(Specialisation(op, dtype, param, threads, items, vector), cols)
    return LaunchPlan(Specialisation(op, dtype, param, LOOP_THREADS, 0, vector), cols)
