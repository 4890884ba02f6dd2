"""Row counts and widths at the edges of the built-ins' launch and blocking schemes (area
"rows"): more rows than a CUDA grid's 65,535, the backward's row chunk of 32, the numba
backend's serial/parallel threshold, the numpy backend's row blocks, widths just above powers
of two and above 2^16, one long row. Each case stays far below 64 MiB, so runs on slow array
libraries (Dask, JAX, bounds-checked kernels) stay cheap; statistics are compared in each."""

from __future__ import annotations

from typing import Final

import pytest

from normlab.testing.cases import Case
from normlab.testing.subject import Subject

#: name -> (rows, cols). Float32 unless the backend serves no float32.
SHAPES: Final = {
    "rows-65537": (65_537, 4),  # beyond 65,535 rows: a grid dimension's limit
    "rows-31": (31, 40),  # around the backward's row chunk of 32
    "rows-33": (33, 40),
    "rows-32k+1": (32 * 5 + 1, 40),
    "serial-1": (255, 128),  # 2^15 elements -1 row: numba's serial/parallel threshold
    "serial": (256, 128),
    "serial+1": (257, 128),
    "block-1": (2047, 64),  # numpy's rows per block at 64 float32 columns: 2048
    "block+1": (2049, 64),
    "blocks+1": (2 * 2048 + 1, 64),
    "cols-257": (5, 257),  # widths just above powers of two
    "cols-1025": (3, 1025),
    "cols-65537": (2, 65_537),  # above 2^16
    "one-long-row": (1, (1 << 20) + 3),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_boundary_shapes(normlab_subject: Subject, op: str, shape: str) -> None:
    """y and the statistics match the reference in every row, at every block edge."""
    normlab_subject.require_op(op)
    dtype = normlab_subject.dtype
    bias = dtype if op == "layer_norm" else None
    case = Case(SHAPES[shape], dtype, "rowwise", seed=16, weight=dtype, bias=bias, op=op)
    case.check(normlab_subject.name)
