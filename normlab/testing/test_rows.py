"""Rows are independent: NaN and Inf stay in their row; a row's result is bitwise the same
alone, in any batch, at any position."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import normlab
from normlab.spec import FLOAT_DTYPES, HALF_DTYPES
from normlab.testing.cases import POISONED, Case
from normlab.testing.subject import Subject


@pytest.mark.parametrize("cols", [1, 33, 1000])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_nan_and_inf_stay_in_their_row(normlab_subject: Subject, dtype: str, cols: int) -> None:
    """Rows 1, 2, 3 hold a NaN, +inf and -inf: they give no finite y, and every other row is
    exactly as without them."""
    normlab_subject.require_dtype(dtype)
    param = "float32" if dtype in HALF_DTYPES else dtype
    case = Case((6, cols), dtype, "nan_inf", seed=7, weight=param, bias=param)
    poisoned = np.zeros((6, 1), dtype=bool)
    poisoned[list(POISONED)] = True
    case.check(normlab_subject.name, rows=~poisoned)
    y, _, rstd = case.run(normlab_subject.name)
    assert rstd is not None
    leaked = np.isfinite(y.astype(np.float64)) & poisoned
    leaked_stats = np.isfinite(rstd.astype(np.float64)) & poisoned
    assert not leaked.any() and not leaked_stats.any(), (
        f"rows holding NaN/Inf gave finite results at {np.argwhere(leaked | leaked_stats)[:5]}"
        f"\n{case.snippet(normlab_subject.name)}"
    )


@pytest.mark.parametrize("cols", [17, 1000])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_batch_independence(normlab_subject: Subject, dtype: str, cols: int) -> None:
    """A row's y, mean and rstd are bitwise identical alone, in a batch of any size and at any
    position (no statistics across rows, no batch-dependent reduction order)."""
    normlab_subject.require_dtype(dtype)
    name = normlab_subject.name
    rows = 300
    case = Case((rows, cols), dtype, "rowwise", seed=8, weight=dtype, bias=dtype)
    x, weight, bias = case.numpy_inputs()
    assert weight is not None and bias is not None
    params = {
        "weight": normlab_subject.from_numpy(weight),
        "bias": normlab_subject.from_numpy(bias),
    }

    def run(part: np.ndarray) -> list[np.ndarray]:
        result: Any = normlab.layer_norm(
            normlab_subject.from_numpy(part), **params, backend=name, return_stats=True
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
    for label, part in batches.items():
        for what, got, want in zip(("y", "mean", "rstd"), run(x[part]), whole, strict=True):
            if not _same_bits(got, want[part]):
                raise AssertionError(
                    f"{what} of {label} differs bitwise from the same rows in a batch of "
                    f"{rows}\n{case.snippet(name)}    (then x[{part.start}:{part.stop}])\n"
                )


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
