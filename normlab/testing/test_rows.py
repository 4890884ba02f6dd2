"""Rows are independent: NaN and Inf stay in their row; a row's result is bitwise the same
alone, in any batch, at any position."""

from __future__ import annotations

import numpy as np
import pytest

from normlab.constants import FLOAT_DTYPES, HALF_DTYPES
from normlab.ops import OPS as TABLE
from normlab.testing.cases import OPS, POISONED, Case
from normlab.testing.subject import Subject


@pytest.mark.parametrize("cols", [1, 33, 1000])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_nan_and_inf_stay_in_their_row(
    normlab_subject: Subject, op: str, dtype: str, cols: int
) -> None:
    """Rows 1, 2, 3 hold a NaN, +inf and -inf, and every other row is exactly as without them.
    layer_norm gives no finite y in those rows. rms_norm gives NaN at the NaN or Inf itself and
    no finite y but 0 elsewhere in the row (x / inf = 0), and an rstd that is NaN or 0."""
    normlab_subject.require_op(op)
    normlab_subject.require_dtype(dtype)
    param = "float32" if dtype in HALF_DTYPES else dtype
    bias = param if op == "layer_norm" else None
    case = Case((6, cols), dtype, "nan_inf", seed=7, weight=param, bias=bias, op=op)
    poisoned = np.zeros((6, 1), dtype=bool)
    poisoned[list(POISONED)] = True
    case.check(normlab_subject.name, rows=~poisoned)
    y, _, rstd = case.run(normlab_subject.name)
    assert rstd is not None
    y64, rstd64, x64 = (a.astype(np.float64) for a in (y, rstd, case.numpy_inputs()[0]))
    if op == "rms_norm":
        leaked = poisoned & ((np.isfinite(y64) & (y64 != 0)) | (~np.isfinite(x64) & ~np.isnan(y64)))
        leaked_stats = poisoned & np.isfinite(rstd64) & (rstd64 != 0)
    else:
        leaked = np.isfinite(y64) & poisoned
        leaked_stats = np.isfinite(rstd64) & poisoned
    assert not leaked.any() and not leaked_stats.any(), (
        f"rows holding NaN/Inf gave finite (rms_norm: finite non-zero) results at "
        f"{np.argwhere(leaked | leaked_stats)[:5]}"
        f"\n{case.snippet(normlab_subject.name)}"
    )


@pytest.mark.parametrize("cols", [17, 1000])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_batch_independence(normlab_subject: Subject, op: str, dtype: str, cols: int) -> None:
    """A row's y and statistics are bitwise identical alone, in a batch of any size and at any
    position (no statistics across rows, no batch-dependent reduction order)."""
    normlab_subject.require_op(op)
    normlab_subject.require_dtype(dtype)
    name = normlab_subject.name
    rows = 300
    bias = dtype if op == "layer_norm" else None
    case = Case((rows, cols), dtype, "rowwise", seed=8, weight=dtype, bias=bias, op=op)
    x, weight, bias_values = case.numpy_inputs()
    params = {
        what: normlab_subject.from_numpy(p)
        for what, p in (("weight", weight), ("bias", bias_values))
        if p is not None
    }

    def run(part: np.ndarray) -> list[np.ndarray]:
        result = case.call(
            normlab_subject.from_numpy(part),
            **params,
            backend=normlab_subject.backend,
            return_stats=True,
        )
        return [normlab_subject.to_numpy(a) for a in result]

    whole = run(x)
    batches = {f"row {i} alone": slice(i, i + 1) for i in (0, 1, rows // 2, rows - 1)}
    batches.update(
        {
            f"rows {s.start}..{s.stop}": s
            for s in (slice(0, 2), slice(0, 7), slice(1, rows), slice(5, rows - 3))
        }
    )
    names = ("y", *TABLE[op].stats_outputs)
    for label, part in batches.items():
        for what, got, want in zip(names, run(x[part]), whole, strict=True):
            if not _same_bits(got, want[part]):
                raise AssertionError(
                    f"{what} of {label} differs bitwise from the same rows in a batch of "
                    f"{rows}\n{case.snippet(name)}    (then x[{part.start}:{part.stop}])\n"
                )


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
