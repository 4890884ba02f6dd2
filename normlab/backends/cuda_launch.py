"""The launch planner of the CUDA kernels in ``kernels/`` (forward: ``layer_norm.cu``, fused
residual add + norm: ``add_norm.cu``, quantized outputs: ``quantize.cu``, backward:
``backward.cu``), in plain Python.

Both ops run the same kernel templates: ``CENTRE = true`` is LayerNorm, ``false`` RMSNorm; so do
their backward ops and the fused ops (``add_normalize_rows``/``add_normalize_loop``, planned on the
forward's rungs: the same shapes, x and the residual read into the same registers), and so do
the quantizing kernels (``norm_quantize_rows``/``norm_quantize_loop``, one pair for the plain and
the fused op), which lay a row out as the float32 (float64) kernels do whatever x's dtype:
:func:`layout_dtype`.
A row of ``cols`` elements is cut into chunks of :func:`vector_width` elements (16 bytes). The
row-resident kernel ``normalize_rows`` gives each row ``threads`` threads holding ``items``
chunks each in registers; :func:`_ladder` lists the (threads, items) rungs, smallest capacity
first, and the planner takes the first rung that holds the row. Rows longer than the top rung go
to ``normalize_loop`` (one block per row, x read twice). The choice depends only on the op, the
row length, the dtypes and the alignment of the pointers, never on the number of rows; and since
the kernels assign chunks to threads the same way with and without 16-byte accesses, alignment
changes the memory instructions, not the arithmetic: a row's result is bitwise the same alone or
in any batch.

The backward (:func:`plan_backward`) computes dx with ``backward_rows`` (the same rungs, each
thread holding half as many chunks: d and g) or ``backward_loop``, and dweight/dbias in two
fixed-order steps: ``weight_partials`` sums each chunk of :data:`~normlab.constants.ROW_CHUNK`
rows per column into a (chunks, cols) workspace, ``sum_chunks`` adds the chunks per column.
The chunks and both grids depend on the shape alone, never on the device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from normlab import ops as table
from normlab.constants import (
    CUDA_LOOP_THREADS,
    CUDA_MIN_BLOCK,
    CUDA_PARTIAL_THREADS,
    CUDA_SUM_COLUMNS,
    CUDA_SUM_LANES,
    ROW_CHUNK,
)

__all__ = [
    "BACKWARD_OPS",
    "FORWARD_OPS",
    "FUSED_OPS",
    "MAX_GRID",
    "OPS",
    "QUANTIZE_OPS",
    "QUANTIZING",
    "SOURCES",
    "STAGES",
    "BackwardLaunch",
    "LaunchPlan",
    "Specialisation",
    "all_specialisations",
    "chunk_width",
    "layout_dtype",
    "param_dtypes",
    "plan_backward",
    "plan_launch",
    "program_of",
    "vector_width",
]

#: The ops of the table with CUDA kernels: the forward, backward and fused ones.
FORWARD_OPS: Final = table.FORWARD_OPS
BACKWARD_OPS: Final = table.BACKWARD_OPS
#: The fused residual add + norm ops (``h = x + residual``, then the forward on h).
FUSED_OPS: Final = table.FUSED_OPS
#: The quantizing kernels (y never written; q and its row scales instead), one per forward
#: op's norm and, given a residual, the fused op's too. They are kernels, not ops of the table.
QUANTIZE_OPS: Final = tuple(f"{op}_quantize" for op in FORWARD_OPS)
#: The quantizing kernel of each forward and fused op.
QUANTIZING: Final = {op: f"{table.OPS[op].base or op}_quantize" for op in FORWARD_OPS + FUSED_OPS}
#: What each kernel computes: an op's arithmetic, a quantizing kernel's that of its op.
_ARITHMETIC: Final = {op: table.OPS[op].arithmetic for op in FORWARD_OPS + BACKWARD_OPS + FUSED_OPS}
_ARITHMETIC.update({q: table.OPS[q.removesuffix("_quantize")].arithmetic for q in QUANTIZE_OPS})
#: The kernels' ops, and the value of their CENTRE template parameter.
OPS: Final = {op: "true" if a.centred else "false" for op, a in _ARITHMETIC.items()}


def _stage(op: str) -> str:
    """The kind of kernel of ``op``: ``"quantize"``, ``"fused"``, ``"backward"``, ``"forward"``."""
    if op in QUANTIZE_OPS:
        return "quantize"
    arithmetic = _ARITHMETIC[op]
    return "fused" if arithmetic.residual_add else arithmetic.direction


#: The source file (in ``kernels/``) and the name of the rows kernels (``<kernel>_rows``,
#: ``<kernel>_loop``) of each kind of kernel.
_SOURCE: Final = {
    "forward": "layer_norm.cu",
    "backward": "backward.cu",
    "fused": "add_norm.cu",
    "quantize": "quantize.cu",
}
_ROWS_KERNEL: Final = {
    "forward": "normalize",
    "backward": "backward",
    "fused": "add_normalize",
    "quantize": "norm_quantize",
}
#: The source file of each op's kernels.
SOURCES: Final = {op: _SOURCE[_stage(op)] for op in OPS}
_KERNEL: Final = {op: _ROWS_KERNEL[_stage(op)] for op in OPS}


def _prefix(op: str) -> str:
    """The prefix of the names of ``op``'s kernels: ``add_`` for a fused op, ``rms_`` for
    RMSNorm, then ``bwd_`` (backward) or ``q_`` (quantizing): ``""``, ``"rms_"``, ``"bwd_"``,
    ``"add_rms_"``, ``"rms_q_"``…"""
    rms = "" if _ARITHMETIC[op].centred else "rms_"
    stage = _stage(op)
    if stage == "fused":
        return "add_" + rms
    return rms + {"forward": "", "backward": "bwd_", "quantize": "q_"}[stage]


_PREFIX: Final = {op: _prefix(op) for op in OPS}
#: The kernels of an op: ``rows`` (over rows: y, or dx; ``items`` 0 is the loop kernel), and for
#: the backward ``partials`` (per-chunk column sums) and ``sum`` (the chunks added per column).
STAGES: Final = ("rows", "partials", "sum")
#: C++ element type of each dtype name (``half``/``bfloat16`` are storage types of the .cu file).
CXX_TYPES: Final = {
    "float16": "normlab::half",
    "bfloat16": "normlab::bfloat16",
    "float32": "float",
    "float64": "double",
}
ITEMSIZE: Final = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_SHORT: Final = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}

#: Largest gridDim.x; the kernels stride over rows beyond it.
MAX_GRID: Final = 2**31 - 1


def vector_width(dtype: str) -> int:
    """Elements per 16-byte chunk of ``dtype``."""
    return 16 // ITEMSIZE[dtype]


def layout_dtype(op: str, dtype: str) -> str:
    """The dtype whose chunks and rungs ``op`` lays out rows of ``dtype`` in: ``dtype`` itself,
    except for the quantizing ops, which lay out every row as float32 rows (float64 ones as
    float64), so that y is bitwise the float32 kernels' y."""
    if op in QUANTIZE_OPS:
        return "float64" if dtype == "float64" else "float32"
    return dtype


def chunk_width(op: str, dtype: str) -> int:
    """Elements per chunk of a row of ``dtype`` in the kernels of ``op``."""
    return vector_width(layout_dtype(op, dtype))


def _max_items(op: str, dtype: str) -> int:
    """Chunks per thread at most: 32 float accumulators (16 doubles) of row per thread; half as
    many chunks for the backward, whose threads hold two arrays (d and g)."""
    forward = 4 if ITEMSIZE[layout_dtype(op, dtype)] == 2 else 8
    return forward // 2 if op in BACKWARD_OPS else forward


def _ladder(op: str, dtype: str) -> tuple[tuple[int, int], ...]:
    """(threads per row, chunks per thread) of the rows kernel of ``op``, smallest capacity
    first."""
    top = _max_items(op, dtype)
    rungs = [(32, items) for items in (1, 2, 4) if items <= top]
    rungs += [(64, min(top, 4)), (128, min(top, 4))]
    if top > 4:
        rungs.append((128, top))
    return (*rungs, (256, top), (512, top))


def param_dtypes(dtype: str) -> tuple[str, ...]:
    """Weight (and bias) dtypes the kernels take for x of ``dtype``."""
    return (dtype, "float32") if ITEMSIZE[dtype] == 2 else (dtype,)


@dataclass(frozen=True, slots=True)
class Specialisation:
    """One compiled kernel: op, element and parameter dtypes, shape class, memory access width.

    ``op`` is a key of :data:`OPS`; ``threads`` the number of threads per row; ``items`` the
    chunks each holds (0 for the loop kernel, which streams); ``vector``: 16-byte loads and
    stores; ``stage`` one of :data:`STAGES` (``partials`` and ``sum``: backward only, with
    ``param_dtype == dtype``, ``items`` 0 and ``threads``
    :data:`~normlab.constants.CUDA_PARTIAL_THREADS` or
    :data:`~normlab.constants.CUDA_SUM_COLUMNS`).
    """

    op: str
    dtype: str
    param_dtype: str
    threads: int
    items: int
    vector: bool
    stage: str = "rows"

    @property
    def loop(self) -> bool:
        """The rows kernel for rows of any length (``normalize_loop``, ``backward_loop``)."""
        return self.stage == "rows" and self.items == 0

    @property
    def source(self) -> str:
        """The file in ``kernels/`` that defines the kernel."""
        return SOURCES[self.op]

    @property
    def name(self) -> str:
        """A short unique name, e.g. ``rows_f16_pf32_t128_i4_vec`` (layer_norm),
        ``rms_loop_f32_pf32_scalar`` (rms_norm), ``bwd_partials_bf16_vec`` or ``rms_bwd_sum_f16``
        (the backward ops)."""
        prefix = _PREFIX[self.op]
        access = "vec" if self.vector else "scalar"
        if self.stage == "partials":
            return f"{prefix}partials_{_SHORT[self.dtype]}_{access}"
        if self.stage == "sum":
            return f"{prefix}sum_{_SHORT[self.dtype]}"
        types = f"{_SHORT[self.dtype]}_p{_SHORT[self.param_dtype]}"
        if self.loop:
            return f"{prefix}loop_{types}_{access}"
        return f"{prefix}rows_{types}_t{self.threads}_i{self.items}_{access}"

    @property
    def expression(self) -> str:
        """The C++ name of the kernel instantiation (an NVRTC name expression)."""
        t, p, centre = CXX_TYPES[self.dtype], CXX_TYPES[self.param_dtype], OPS[self.op]
        v = "true" if self.vector else "false"
        if self.stage == "partials":
            return f"normlab::weight_partials<{t}, {centre}, {v}>"
        if self.stage == "sum":
            return f"normlab::sum_chunks<{'double' if self.dtype == 'float64' else 'float'}>"
        kernel = _KERNEL[self.op]
        if self.loop:
            return f"normlab::{kernel}_loop<{t}, {p}, {centre}, {v}>"
        return f"normlab::{kernel}_rows<{t}, {p}, {centre}, {self.threads}, {self.items}, {v}>"

    @property
    def block(self) -> int:
        """Threads per block."""
        if self.stage == "sum":
            return CUDA_SUM_COLUMNS * CUDA_SUM_LANES
        return (
            self.threads if self.loop or self.stage != "rows" else max(self.threads, CUDA_MIN_BLOCK)
        )

    @property
    def rows_per_block(self) -> int:
        return self.block // self.threads if self.stage == "rows" and not self.loop else 1

    @property
    def capacity(self) -> int | None:
        """Longest row held in registers (``None``: any length)."""
        if self.loop or self.stage != "rows":
            return None
        return self.threads * self.items * chunk_width(self.op, self.dtype)


@functools.cache
def all_specialisations() -> tuple[Specialisation, ...]:
    """Every kernel the planner can choose, grouped by program (see :func:`program_of`)."""
    specs: list[Specialisation] = []
    for op in OPS:
        for dtype in CXX_TYPES:
            for param in param_dtypes(dtype):
                for vector in (True, False):
                    specs.extend(
                        Specialisation(op, dtype, param, threads, items, vector)
                        for threads, items in _ladder(op, dtype)
                    )
                    specs.append(Specialisation(op, dtype, param, CUDA_LOOP_THREADS, 0, vector))
            if op in BACKWARD_OPS:
                specs += [
                    Specialisation(op, dtype, dtype, CUDA_PARTIAL_THREADS, 0, vector, "partials")
                    for vector in (True, False)
                ]
                specs.append(Specialisation(op, dtype, dtype, CUDA_SUM_COLUMNS, 0, False, "sum"))
    return tuple(specs)


def _program_key(spec: Specialisation) -> tuple[str, ...]:
    if spec.op in BACKWARD_OPS:
        return (spec.op, spec.dtype)
    return (spec.op, spec.dtype, spec.param_dtype)


def program_of(spec: Specialisation) -> tuple[Specialisation, ...]:
    """The specialisations compiled in one NVRTC program with ``spec``: those of its op, dtype
    and (forward) parameter dtype; a backward program holds every kernel one call may need (run
    time and :func:`~normlab.backends.cuda_compile.compile_all` share the programs, hence the
    cached cubins)."""
    key = _program_key(spec)
    return tuple(s for s in all_specialisations() if _program_key(s) == key)


@dataclass(frozen=True, slots=True)
class LaunchPlan:
    """How to launch the kernel for rows of one length: a specialisation and its block shape."""

    specialisation: Specialisation
    cols: int

    @property
    def vector_width(self) -> int:
        """Elements per chunk (one access when ``specialisation.vector``: 16 bytes, 8 for a
        half-type row of a quantizing op)."""
        return chunk_width(self.specialisation.op, self.specialisation.dtype)

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
    """The launch of ``op`` (``"layer_norm"``, ``"rms_norm"``, a fused op of
    :data:`FUSED_OPS` or a quantizing op of :data:`QUANTIZE_OPS`) for rows of ``cols`` elements
    of ``dtype``.

    ``param_dtype``: dtype of weight and bias (``None``: neither given). ``addresses``: byte
    addresses of x, out, weight and bias (the fused ops: x, residual, out, h, weight and bias;
    the quantizing ops: x, residual, q, h, weight, bias; ``None`` for those absent);
    ``row_strides``: element strides between rows of x and out (the fused ops: x, residual,
    out and h; the quantizing ops: x, residual and h). Vector accesses (one per chunk) are used
    when every address is a multiple of 16 and ``cols`` and every row stride a multiple of the
    chunk length.
    """
    planned = FORWARD_OPS + FUSED_OPS + QUANTIZE_OPS
    if op not in planned:
        raise ValueError(f"plan_launch plans {', '.join(planned)}, not {op}")
    return _plan_rows(op, cols, dtype, param_dtype, addresses, row_strides)


def _plan_rows(
    op: str,
    cols: int,
    dtype: str,
    param_dtype: str | None,
    addresses: Sequence[int | None],
    row_strides: Sequence[int],
) -> LaunchPlan:
    """The rows kernel of any op (arguments as for :func:`plan_launch`)."""
    if cols < 1:
        raise ValueError(f"cols must be >= 1 (no launch for empty input), got {cols}")
    param = dtype if param_dtype is None else param_dtype
    if param not in param_dtypes(dtype):
        raise ValueError(f"weight/bias of dtype {param} do not go with x of dtype {dtype}")
    width = chunk_width(op, dtype)
    vector = (
        cols % width == 0
        and all(a % 16 == 0 for a in addresses if a is not None)
        and all(s % width == 0 for s in row_strides)
    )
    for threads, items in _ladder(op, dtype):
        if cols <= threads * items * width:
            return LaunchPlan(Specialisation(op, dtype, param, threads, items, vector), cols)
    return LaunchPlan(Specialisation(op, dtype, param, CUDA_LOOP_THREADS, 0, vector), cols)


@dataclass(frozen=True, slots=True)
class BackwardLaunch:
    """How to launch a backward op for rows of one length: ``rows`` computes dx (and each row's
    residual ``res``), ``partials`` the per-chunk column sums, ``sum`` adds the chunks."""

    rows: LaunchPlan
    partials: Specialisation
    sum: Specialisation
    cols: int

    @staticmethod
    def chunks(rows: int) -> int:
        """Chunks of :data:`~normlab.constants.ROW_CHUNK` rows (the last may be short): the rows
        of the partial-sums workspace. A function of ``rows`` alone."""
        if rows < 1:
            raise ValueError(f"rows must be >= 1 (no launch for empty input), got {rows}")
        return -(-rows // ROW_CHUNK)

    def partials_grid(self, rows: int) -> int:
        """Blocks of ``weight_partials``: one per (chunk, tile of columns); blocks stride over
        the pairs beyond MAX_GRID."""
        tile = CUDA_PARTIAL_THREADS * vector_width(self.partials.dtype)
        return min(self.chunks(rows) * -(-self.cols // tile), MAX_GRID)

    def sum_grid(self, outputs: int) -> tuple[int, int]:
        """Blocks of ``sum_chunks`` for ``outputs`` gradients (1: dweight, 2: and dbias)."""
        if outputs not in (1, 2):
            raise ValueError(f"sum_chunks adds 1 or 2 gradients, not {outputs}")
        return min(-(-self.cols // CUDA_SUM_COLUMNS), MAX_GRID), outputs


def plan_backward(
    op: str,
    cols: int,
    dtype: str,
    param_dtype: str | None,
    addresses: Sequence[int | None],
    row_strides: Sequence[int],
) -> BackwardLaunch:
    """The launch of the backward ``op`` (``"layer_norm_backward"``, ``"rms_norm_backward"``)
    for rows of ``cols`` elements of ``dtype``.

    ``param_dtype``: weight's dtype (``None``: no weight). ``addresses``: byte addresses of dy,
    x, dx and weight (``None`` for those absent); ``row_strides``: element strides between rows
    of dy, x and dx. 16-byte accesses, in every kernel, when all are 16-byte aligned and
    ``cols`` is a multiple of the chunk length (the workspace then is too).
    """
    if op not in BACKWARD_OPS:
        raise ValueError(f"plan_backward plans {', '.join(BACKWARD_OPS)}, not {op}")
    rows = _plan_rows(op, cols, dtype, param_dtype, addresses, row_strides)
    vector = rows.specialisation.vector
    return BackwardLaunch(
        rows=rows,
        partials=Specialisation(op, dtype, dtype, CUDA_PARTIAL_THREADS, 0, vector, "partials"),
        sum=Specialisation(op, dtype, dtype, CUDA_SUM_COLUMNS, 0, False, "sum"),
        cols=cols,
    )
