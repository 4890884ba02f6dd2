"""Array inspection: family by module name (never importing a library), devices, element strides;
the family operations; inspectors supplied by backend records."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import normlab
from normlab import arrays
from tests.support.plugins_for_tests import FakeArray, record

torch = pytest.importorskip("torch")


class SubArray(np.ndarray):
    """A NumPy subclass defined outside numpy."""


def _type_in_module(module: str, name: str = "ndarray") -> type:
    return type(name, (), {"__module__": module, "shape": (2,), "dtype": np.dtype("float32")})


@pytest.mark.parametrize(
    ("value", "family"),
    [
        (np.zeros(3), "numpy"),
        (np.zeros(3).view(SubArray), "numpy"),
        (np.ma.masked_array(np.zeros(3)), "numpy"),
        (np.float32(1.0), "numpy"),
        (torch.zeros(3), "torch"),
        (torch.nn.Parameter(torch.zeros(3)), "torch"),
        (FakeArray(np.zeros(3)), "fakelib"),
    ],
    ids=["ndarray", "subclass", "masked", "numpy-scalar", "tensor", "parameter", "unknown-lib"],
)
def test_family_of_arrays(value: object, family: str) -> None:
    assert arrays.family_of(value) == family


def test_family_of_memmap(tmp_path: object) -> None:
    m = np.memmap(f"{tmp_path}/m.dat", dtype=np.float32, mode="w+", shape=(2, 3))
    assert arrays.family_of(m) == "numpy"
    assert arrays.info(m).shape == (2, 3)


@pytest.mark.parametrize(
    ("module", "family"),
    [
        ("cupy._core.core", "cupy"),
        ("jaxlib.xla_extension", "jax"),
        ("jax._src.array", "jax"),
        ("dask.array.core", "dask"),
        ("somelib.arrays", "somelib"),
    ],
)
def test_family_is_read_from_module_names_without_importing(module: str, family: str) -> None:
    """No array library is imported; at most a plugin's inspector module (normlab_jax.arrays,
    where that plugin is installed)."""
    cls = _type_in_module(module)
    before = set(sys.modules)
    assert arrays.family_of(cls()) == family
    assert arrays.inspector(cls).family == family
    assert all(name.startswith("normlab_") for name in set(sys.modules) - before)


def test_family_of_subclass_of_unknown_type_uses_the_known_base() -> None:
    base = _type_in_module("cupy._core.core")
    derived = type("Derived", (base,), {"__module__": "myproject.arrays"})
    assert arrays.family_of(derived()) == "cupy"


def test_inspector_is_cached_per_type() -> None:
    assert arrays.inspector(np.ndarray) is arrays.inspector(np.ndarray)
    assert arrays.inspector(np.ndarray) is not arrays.inspector(SubArray)


def test_is_array() -> None:
    assert arrays.is_array(np.zeros(2))
    assert arrays.is_array(torch.zeros(2))
    assert arrays.is_array(FakeArray([1.0]))
    assert not arrays.is_array([1.0, 2.0])
    assert not arrays.is_array(1.0)
    assert not arrays.is_array(None)


def test_numpy_info() -> None:
    x = np.zeros((3, 4), np.float32)
    info = arrays.info(x)
    assert (info.family, info.dtype) == ("numpy", "float32")
    assert (info.shape, info.strides) == ((3, 4), (4, 1))
    assert (info.device, info.device_kind, info.itemsize) == ("cpu", "cpu", 4)
    assert info.writeable and not info.masked and info.native_byte_order
    assert not info.requires_grad
    assert info.type_name == "numpy.ndarray"


def test_numpy_info_flags() -> None:
    frozen = np.zeros(3)
    frozen.flags.writeable = False
    assert not arrays.info(frozen).writeable
    assert arrays.info(np.ma.masked_array(np.zeros(3))).masked
    assert not arrays.info(np.zeros(3, ">f8")).native_byte_order
    assert arrays.info(np.zeros(3, ">f8")).dtype == "float64"
    assert arrays.info(np.zeros(3, ml_dtypes.bfloat16)).dtype == "bfloat16"


def _structured_field() -> np.ndarray:
    """A float64 view with a 12-byte stride: not a whole number of elements."""
    return np.zeros(4, dtype=[("a", "f4"), ("b", "f8")])["b"]


_base = np.zeros((3, 4), np.float32)


@pytest.mark.parametrize(
    ("view", "strides"),
    [
        (_base, (4, 1)),
        (_base.T, (1, 4)),
        (np.asfortranarray(_base), (1, 3)),
        (_base[:, ::2], (4, 2)),
        (_base[::-1], (-4, 1)),
        (np.broadcast_to(_base[0], (5, 4)), (0, 1)),
        (_structured_field(), None),
    ],
    ids=["c", "transposed", "fortran", "sliced", "reversed", "broadcast", "fractional"],
)
def test_numpy_element_strides(view: np.ndarray, strides: tuple[int, ...] | None) -> None:
    assert arrays.info(view).strides == strides


def test_torch_info() -> None:
    t = torch.zeros((3, 4), dtype=torch.bfloat16)
    info = arrays.info(t)
    assert (info.family, info.dtype) == ("torch", "bfloat16")
    assert (info.shape, info.strides) == ((3, 4), (4, 1))
    assert (info.device, info.device_kind, info.itemsize) == ("cpu", "cpu", 2)
    assert info.type_name == "torch.Tensor"
    assert arrays.info(t.T).strides == (1, 4)
    assert arrays.info(t[:1].expand(5, 4)).strides == (0, 1)
    assert arrays.info(t.flip(0)).strides == (4, 1)  # torch.flip copies


def test_torch_requires_grad_and_parameter() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    assert arrays.info(p).requires_grad
    assert arrays.info(p).family == "torch"
    assert not arrays.info(torch.zeros(3)).requires_grad


def test_torch_device_name_and_kind() -> None:
    info = arrays.info(torch.empty(2, device="meta"))
    assert (info.device, info.device_kind) == ("meta", "meta")


@pytest.mark.parametrize(
    ("device", "kind"), [("cpu", "cpu"), ("cuda:1", "cuda"), ("gpu:0", "cuda"), ("tpu:3", "tpu")]
)
def test_device_of_other_libraries(device: str, kind: str) -> None:
    info = arrays.info(FakeArray(np.zeros(2, np.float32), device=device))
    assert (info.device, info.device_kind) == (device, kind)
    assert info.strides is None


def test_device_defaults_to_cpu_when_the_array_names_none() -> None:
    cls = _type_in_module("somelib.arrays")
    assert arrays.info(cls()).device == "cpu"


# --------------------------------------------------------------------------------------------
# The family operations


def _family_arrays() -> list[Any]:
    """A (2, 3, 4) float32 array of each family at hand, holding 0, 1, 2, ..."""
    data = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    found = [data.copy(), torch.from_numpy(data.copy())]
    try:
        import array_api_strict
    except ImportError:
        return found
    return [*found, array_api_strict.asarray(data)]


@pytest.mark.parametrize("a", _family_arrays(), ids=lambda a: arrays.family_of(a))
def test_family_operations(a: Any) -> None:
    """permute, reshape, contiguous, astype and copy_into do what NumPy's equivalents do, in the
    array's own library (array_api_strict arrays have no reshape or astype method)."""
    data = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    permuted = arrays.permute(a, (2, 0, 1))
    assert type(permuted) is type(a)
    np.testing.assert_array_equal(np.from_dlpack(permuted), data.transpose(2, 0, 1))
    flat = arrays.reshape(arrays.contiguous(permuted), (4, 6))
    np.testing.assert_array_equal(np.from_dlpack(flat), data.transpose(2, 0, 1).reshape(4, 6))
    wide = arrays.astype(a, arrays.astype(a, a.dtype).dtype)
    assert wide.dtype == a.dtype
    target = arrays.astype(arrays.reshape(a, (24,)), a.dtype) * 0
    arrays.copy_into(target, arrays.reshape(a, (24,)))
    np.testing.assert_array_equal(np.from_dlpack(target), data.reshape(24))


def test_contiguous_numpy_is_c_ordered_and_native() -> None:
    swapped = np.arange(6.0).reshape(2, 3).astype(">f8").T
    copy = arrays.contiguous(swapped)
    assert copy.flags.c_contiguous and copy.dtype.isnative
    np.testing.assert_array_equal(copy, swapped)


def test_mark_written_bumps_a_tensors_version_only() -> None:
    t = torch.zeros(3)
    before = t._version
    arrays.mark_written(t)
    assert t._version == before + 1
    arrays.mark_written(np.zeros(3))  # nothing to tell NumPy


# --------------------------------------------------------------------------------------------
# Inspectors supplied by backend records (BackendRecord.inspector)


class TaggedInspector(arrays.Inspector):
    """A plugin's inspector for ``fakelib``: reads like the generic one, device renamed."""

    def _device(self, x: Any) -> str:
        return "cpu:tagged"


class OtherInspector(TaggedInspector):
    def _device(self, x: Any) -> str:
        return "cpu:other"


def test_a_record_supplies_its_familys_inspector(register: Callable[..., ModuleType]) -> None:
    assert type(arrays.inspector(FakeArray)) is arrays.Inspector
    plugin = register(record("tagged", inspector=f"{__name__}:TaggedInspector"))
    assert type(arrays.inspector(FakeArray)) is TaggedInspector
    assert arrays.info(FakeArray(np.zeros(2, np.float32))).device == "cpu:tagged"
    normlab.unregister_plugin(plugin)
    assert type(arrays.inspector(FakeArray)) is arrays.Inspector


def test_the_highest_priority_record_supplies_it(register: Callable[..., ModuleType]) -> None:
    register(record("low", priority=1, inspector=f"{__name__}:TaggedInspector"))
    register(record("high", priority=5, inspector=f"{__name__}:OtherInspector"))
    assert type(arrays.inspector(FakeArray)) is OtherInspector


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("no_such_module_here:Inspector", "failed to load: ModuleNotFoundError"),
        (f"{__name__}:FakeArray", "is <class .*FakeArray'>, not a normlab.arrays.Inspector"),
    ],
)
def test_a_broken_inspector_is_warned_about_once_and_passed_over(
    register: Callable[..., ModuleType], path: str, problem: str
) -> None:
    register(record("broken", inspector=path))
    with pytest.warns(normlab.NormlabWarning, match=f"its inspector '{path}' {problem}"):
        assert type(arrays.inspector(FakeArray)) is arrays.Inspector
    arrays.forget_inspectors()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert type(arrays.inspector(FakeArray)) is arrays.Inspector
    assert normlab.layer_norm(FakeArray(np.ones((2, 3), np.float32)), backend="broken") is not None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"inspector": "not a path"}, "inspector must be None or an import path"),
        (
            {"families": frozenset({"numpy"}), "inspector": f"{__name__}:TaggedInspector"},
            "supplies an inspector for numpy, whose arrays normlab always reads itself",
        ),
    ],
)
def test_malformed_inspector_fields_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(normlab.BackendError, match=message):
        normlab.register_plugin(_plugin_of(record("bad_inspector", **fields)))


def _plugin_of(rec: Any) -> ModuleType:
    from tests.support.plugins_for_tests import plugin

    return plugin(rec)
