"""The Numba backend driven directly in the tests of its modules (``test_numba_*.py``): random
inputs, a call of its ``layer_norm`` or ``rms_norm`` with a Plan from ``spec.plan``, and checks
of the results against the float64 reference within the tolerance table of
:mod:`normlab.testing.tolerances`. Arrays stay small: these tests check correctness, never speed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from normlab import reference, spec
from normlab.backends import numba_backend, numba_forward
from normlab.testing.conversions import numpy_dtype
from normlab.testing.tolerances import assert_close, conditioning, y_scale
from tests.support.kernels import kernel_results

__all__ = [
    "DTYPES",
    "Result",
    "as_numpy_array",
    "check",
    "check_rms",
    "dtype_of",
    "long_cols",
    "numba_call",
    "randn",
    "same_bits",
]

DTYPES = ("float32", "float64", "float16", "bfloat16")
Result = tuple[Any, Any, Any]


def dtype_of(name: str) -> np.dtype[Any]:
    if name == "bfloat16":
        pytest.importorskip("ml_dtypes")
    return numpy_dtype(name)


def randn(shape: tuple[int, ...], dtype: str, seed: int = 0, loc: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (loc + rng.standard_normal(shape)).astype(dtype_of(dtype))


def numba_call(
    x: Any,
    weight: Any = None,
    bias: Any = None,
    *,
    eps: float = 1e-5,
    out: Any = None,
    stats: bool = True,
    op: str = "layer_norm",
) -> Result:
    plan = spec.plan(op, x, weight=weight, bias=bias, eps=eps, return_stats=stats, out=out)
    arrays = {"x": x, "weight": weight, "bias": bias}
    got = kernel_results(numba_backend, op, arrays, plan=plan, out=out)
    return got["y"], got["mean"], got["rstd"]


def check_rms(x: Any, weight: Any, eps: float, result: Result) -> None:
    """Assert y and rstd of rms_norm (NumPy) match the reference; mean is None."""
    y, mean, rstd = result
    dtype = x.dtype.name
    want_y, want_rstd = reference.rms_norm(x, None, weight, eps)
    cond = conditioning(None, want_rstd)
    z = reference.to_float64(x) * want_rstd
    scale = y_scale("rms_norm", z, weight)
    assert y.dtype == x.dtype and y.shape == x.shape and mean is None
    assert_close(y, want_y, dtype, cond, what="y", cols=x.shape[1], scale=scale)
    assert rstd.dtype == (np.float64 if dtype == "float64" else np.float32)
    assert_close(
        rstd, want_rstd[:, 0], dtype, cond[:, 0], what="rstd", cols=x.shape[1],
        scale=want_rstd[:, 0],
    )  # fmt: skip


def check(x: Any, weight: Any, bias: Any, eps: float, result: Result) -> None:
    """Assert y, mean and rstd (NumPy) match the reference within the dtype's tolerance."""
    y, mean, rstd = result
    dtype = x.dtype.name
    want_y, want_mean, want_rstd = reference.layer_norm(x, None, weight, bias, eps)
    cond = conditioning(want_mean, want_rstd)
    z = (reference.to_float64(x) - want_mean) * want_rstd
    w = 1.0 if weight is None else np.abs(reference.to_float64(weight))
    b = 0.0 if bias is None else np.abs(reference.to_float64(bias))
    cols = x.shape[1]
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, want_y, dtype, cond, what="y", cols=cols, scale=w * (1 + np.abs(z)) + b)
    stats = np.float64 if dtype == "float64" else np.float32
    assert mean.dtype == stats and rstd.dtype == stats and mean.shape == (x.shape[0],)
    cond1 = cond[:, 0]
    assert_close(
        mean, want_mean[:, 0], dtype, cond1, what="mean", cols=cols, scale=1 / want_rstd[:, 0]
    )
    assert_close(rstd, want_rstd[:, 0], dtype, cond1, what="rstd", cols=cols, scale=want_rstd[:, 0])


def long_cols() -> int:
    """A row length that takes the segmented long-row form in float32, with a partial segment."""
    return numba_forward.LONG_ROW_BYTES // 4 + numba_forward.SEGMENT // 2 + 3


def as_numpy_array(t: Any) -> np.ndarray:
    """The tensor ``t``'s memory as a NumPy array of its dtype (bfloat16: ml_dtypes')."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return t.numpy()  # type: ignore[no-any-return]


def same_bits(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are both None or arrays (or tensors) of the same type and bytes."""
    if a is None or b is None:
        return a is b
    as_bytes = [
        (t if isinstance(t, np.ndarray) else as_numpy_array(t)).view(np.uint8) for t in (a, b)
    ]
    return type(a) is type(b) and np.array_equal(*as_bytes)
