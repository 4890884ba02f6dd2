"""What the fused ops' fuzzer (test_fuzz_api.py::test_fused_calls) found, as plain tests.

Each test reruns the drawn call that failed, judged by the fuzzer's own check
(:func:`fuzz_model.check_fused_result`: ``h`` bitwise the unfused add, ``y`` within the
conformance tolerances of the float64 reference of that ``h``). What stays open is an
``xfail(strict=True)`` naming the cause: it fails loudly once fixed.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from fuzz_model import VALID_FUSED, Fused, check_fused_result, unfused_add  # noqa: E402

import normlab  # noqa: E402


def _spaced_row(dtype: str, backend: str | None) -> Fused:
    """x = [C + 6, C + 4] where the dtype's spacing is 2 (C = 2**24 in float32, 2**53 in float64),
    a residual below half a spacing: h = x, a row whose mean is not representable."""
    call = dataclasses.replace(
        VALID_FUSED.call,
        dtype=dtype,
        shape=(2,),
        values="spaced",
        normalized_shape=(2,),
        backend=backend,
    )
    return dataclasses.replace(VALID_FUSED, call=call, residual_values="below_spacing")


def _run(fz: Fused) -> None:
    kwargs = fz.build()
    assert not fz.problems(kwargs)
    h_want = unfused_add(kwargs["x"], kwargs["residual"])
    check_fused_result(fz, kwargs, normlab.add_layer_norm(**kwargs), h_want)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rows_of_unrepresentable_mean_on_numba(dtype: str) -> None:
    """The same rows on numba: within the tolerances (y = [1.414, 0] against [1, -1], allowed
    16 at conditioning 1.7e7)."""
    _run(_spaced_row(dtype, "numba"))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rows_of_unrepresentable_mean_on_torch(dtype: str) -> None:
    """torch's CPU layer_norm (torch 2.13) finds variance 0 for these rows (y = [632.46, 0] =
    2 / sqrt(eps)); the torch backend's row check now flags float32/float64 rows whose rstd is
    eps-dominated and recomputes them in float64, shifted."""
    _run(_spaced_row(dtype, "torch"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_torch_backend_repairs_such_rows_in_layer_norm_itself(dtype: torch.dtype) -> None:
    big = 2.0**24 if dtype == torch.float32 else 2.0**53
    x = torch.tensor([[big + 6, big + 4], [1.0, 2.0]], dtype=dtype)
    y = normlab.layer_norm(x, backend="torch")
    torch.testing.assert_close(y[1], torch.nn.functional.layer_norm(x[1:], (2,))[0])
    assert y[0].abs().max() < 2  # [1, -1] up to the row's conditioning; torch alone: 632
