"""normlab.testing.conversions: dtypes by name, the layouts tests make, NumPy copies of any
family's arrays, and the suite's option to drive a backend with arrays of a family it serves
beside its own (``--normlab-arrays``, ``check(arrays=)``)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from normlab import testing
from normlab.testing.cases import Case
from normlab.testing.conversions import (
    LAYOUTS,
    LayoutUnavailable,
    arrange,
    as_float64,
    conversion,
    drive,
    driven_family,
    dtype_name,
    numpy_dtype,
    numpy_layout,
    to_numpy,
)
from normlab.testing.subject import Subject

torch = pytest.importorskip("torch")

X = np.arange(24.0).reshape(2, 3, 4).astype(np.float32)


def test_dtypes_by_name() -> None:
    assert numpy_dtype("bfloat16") == np.dtype(ml_dtypes.bfloat16)
    assert numpy_dtype("float16") == np.float16
    assert dtype_name(torch.zeros(2, dtype=torch.bfloat16)) == "bfloat16"
    assert dtype_name(np.zeros(2, np.dtype(np.float32).newbyteorder())) == "float32"


@pytest.mark.parametrize("family", ["numpy", "torch"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_keep_the_values_and_change_the_strides(family: str, layout: str) -> None:
    maker = conversion(family)
    try:
        a = arrange(X, layout, maker)
    except LayoutUnavailable:
        assert (family, layout) == ("torch", "reversed")  # torch has no negative strides
        return
    values = to_numpy(a)
    expected = np.broadcast_to(X[:1], X.shape) if layout == "broadcast" else X
    np.testing.assert_array_equal(values, expected)
    strides = a.stride() if family == "torch" else tuple(s // 4 for s in a.strides)
    c_order = (12, 4, 1)
    wanted = {
        "c": c_order,
        "fortran": (1, 2, 6),
        "transposed": (12, 1, 3),
        "sliced": (96, 16, 2),
        "padded": (21, 7, 1),
        "reversed": (-12, -4, -1),
        "broadcast": (0, 4, 1),
    }
    assert tuple(strides) == wanted[layout]


def test_numpy_only_layouts() -> None:
    assert numpy_layout(X, "swapped").dtype.byteorder not in ("=", "|")
    assert not numpy_layout(X, "readonly").flags.writeable
    assert not numpy_layout(X, "unaligned").flags.aligned
    odd = numpy_layout(X, "odd_strides")
    assert odd.strides[-1] == 5  # a float32 field beside one padding byte
    for layout in ("swapped", "readonly", "unaligned", "odd_strides"):
        np.testing.assert_array_equal(numpy_layout(X, layout), X)


def test_copies_to_numpy() -> None:
    t = torch.arange(6.0, dtype=torch.bfloat16).reshape(2, 3)
    assert to_numpy(t).dtype == numpy_dtype("bfloat16")
    np.testing.assert_array_equal(as_float64(t), np.arange(6.0).reshape(2, 3))


def test_a_backend_is_driven_only_with_a_family_it_serves_beside_its_own() -> None:
    with pytest.raises(ValueError, match="backend 'numpy' is not driven by torch arrays"):
        drive("numpy", "torch")
    assert driven_family("numpy") is None


def test_driving_numba_with_torch_tensors() -> None:
    """numba serves CPU tensors when named: the suite's arrays become tensors, and the snippet
    of a failing case says how they were made."""
    drive("numba", "torch")
    try:
        assert Subject.of("numba").family == "torch"
        x, kwargs = Case((3, 5), weight="float32").inputs("numba")
        assert isinstance(x, torch.Tensor) and isinstance(kwargs["weight"], torch.Tensor)
        assert "drive('numba', 'torch')" in Case((3, 5)).snippet("numba")
    finally:
        drive("numba", None)
    assert isinstance(Case((3, 5)).inputs("numba")[0], np.ndarray)


def test_the_suite_runs_numba_on_torch_tensors() -> None:
    """``check(name, arrays=...)``: a part of the suite passes, and the backend gets its own
    arrays back after the run."""
    pytest.importorskip("numba")
    args = ["-q", "-k", "test_results or test_bad_input and eps"]
    assert testing.check("numba", arrays="torch", extra_pytest_args=args) == 0
    assert driven_family("numba") is None


def test_the_suite_refuses_a_family_the_backend_does_not_serve() -> None:
    assert testing.check("numpy", arrays="torch", extra_pytest_args=["-q"]) == 4  # usage error


def test_driven_arrays_move_to_the_backend_device(register: Any) -> None:
    """A backend whose record lists a device other than the CPU (``meta`` here, ``cuda`` for
    cupy) gets the family's arrays on that device; they read back through the family's owner."""
    from tests.support.plugins_for_tests import record

    register(
        record("ondevice", devices=frozenset({"meta"}), explicit_families=frozenset({"torch"}))
    )
    drive("ondevice", "torch")
    try:
        made = conversion("ondevice").from_numpy(X)
        assert isinstance(made, torch.Tensor) and made.device.type == "meta"
        assert conversion("ondevice").family == "torch"
        cpu = conversion("ondevice").to_numpy(torch.from_numpy(X))
        np.testing.assert_array_equal(cpu, X)
    finally:
        drive("ondevice", None)
