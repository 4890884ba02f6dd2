"""The array_api backend, driven by array_api_strict as a real client: what it serves (and never
shadows), how such arrays are named in messages, and the parts of a call the conformance suite
does not reach for a family without strides (out=, axes moved by the core, devices)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest

import normlab
from normlab import arrays, dispatch, reference, registry
from normlab.backends import array_api_backend
from tests.support.plugins_for_tests import record

xp = pytest.importorskip("array_api_strict")


def _x(shape: tuple[int, ...] = (3, 8), seed: int = 0, dtype: str = "float64", **kw: Any) -> Any:
    data = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    return xp.asarray(data, **kw), data


def _chosen(x: Any) -> str:
    """The backend ``normlab.explain`` says it chooses for ``layer_norm(x)``."""
    line = next(line for line in normlab.explain(x).splitlines() if "chosen:" in line)
    return line.split("chosen:")[1].split()[0]


def test_array_api_strict_arrays_are_served_by_the_array_api_backend() -> None:
    x, data = _x()
    assert _chosen(x) == "array_api"
    y = normlab.layer_norm(x)
    assert type(y) is type(x) and y.dtype == xp.float64 and y.device == x.device
    np.testing.assert_allclose(np.from_dlpack(y), reference.layer_norm(data)[0], rtol=1e-12)


def test_dtype_and_device_are_named_plainly() -> None:
    info = arrays.info(xp.asarray([1.0, 2.0], dtype=xp.float32))
    assert (info.family, info.dtype, info.itemsize) == ("array_api_strict", "float32", 4)
    assert (info.device, info.device_kind) == ("CPU_DEVICE", "cpu")
    with pytest.raises(normlab.DtypeError, match=r"^x has dtype int64; normlab normalizes"):
        normlab.layer_norm(xp.asarray([[1, 2, 3]]))


def test_a_weight_on_another_device_is_refused_by_name() -> None:
    x, _ = _x()
    weight = xp.ones(8, dtype=xp.float64, device=xp.Device("device1"))
    with pytest.raises(normlab.DeviceError, match="weight is on device device1 but x is on CPU"):
        normlab.layer_norm(x, weight=weight)


def test_never_shadows_numpy_torch_or_jax(no_preference: None) -> None:
    """Arrays of the libraries with backends of their own are never served by array_api, named
    or preferred, even though NumPy and JAX arrays expose ``__array_namespace__``."""
    candidates: list[Any] = [np.ones((2, 4))]
    for module, make in [("torch", "ones"), ("jax.numpy", "ones")]:
        try:
            library = importlib.import_module(module)
        except ImportError:
            continue
        candidates.append(getattr(library, make)((2, 4)))
    for a in candidates:
        family = arrays.family_of(a)
        assert not isinstance(arrays.inspector(type(a)), arrays.ArrayApiInspector)
        assert family not in registry.get("array_api").families
        with pytest.raises(normlab.BackendError, match=f"serves array_api.* not {family}"):
            normlab.layer_norm(a, backend="array_api")
        with dispatch.use_backend("array_api"):
            assert _chosen(a) != "array_api"


def test_a_backend_for_the_library_itself_wins(register: Callable[..., ModuleType]) -> None:
    register(record("strict_lib", families=frozenset({"array_api_strict"})))
    assert _chosen(_x()[0]) == "strict_lib"


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_out_axes_and_statistics(op: str) -> None:
    """Axes the core moves (axis=(0, 2)) and out= (written by the core through a temporary):
    the numpy backend's answer, x untouched, statistics keepdims-shaped in float64."""
    x, data = _x((4, 3, 5), seed=1)
    weight = np.linspace(0.5, 1.5, 20).reshape(4, 5)
    out = xp.zeros((4, 3, 5), dtype=xp.float64)
    out_rstd = xp.zeros((1, 3, 1), dtype=xp.float64)
    function = getattr(normlab, op)
    result = function(
        x,
        weight=xp.asarray(weight),
        axis=(0, 2),
        return_stats=True,
        out=(out, *[None] * (op == "layer_norm"), out_rstd),
    )
    expected = function(data.copy(), weight=weight, axis=(0, 2), return_stats=True, backend="numpy")
    assert result[0] is out and result[-1] is out_rstd
    for got, want in zip(result, expected, strict=True):
        assert got.shape == want.shape and got.dtype == xp.float64
        np.testing.assert_allclose(np.from_dlpack(got), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.from_dlpack(x), data)


def test_backward_matches_the_numpy_backend() -> None:
    x, data = _x((5, 6), seed=2)
    dy, dy_data = _x((5, 6), seed=3)
    weight = np.linspace(0.5, 1.5, 6)
    _, mean, rstd = normlab.layer_norm(data, weight=weight, return_stats=True, backend="numpy")
    expected = normlab.layer_norm_backward(dy_data, data, mean, rstd, weight, backend="numpy")
    got = normlab.layer_norm_backward(dy, x, xp.asarray(mean), xp.asarray(rstd), xp.asarray(weight))
    for g, e in zip(got, expected, strict=True):
        assert type(g) is type(x)
        np.testing.assert_allclose(np.from_dlpack(g), e, rtol=1e-10, atol=1e-12)


def test_statistics_in_the_compute_dtype_on_a_device_without_float64() -> None:
    """On a device without float64 the rows-sized statistics stay in float32 (array_api_strict
    raises on any float64 array there), and the result is still right."""
    device = xp.Device("no_float64")
    x, data = _x((4, 16), dtype="float32", device=device)
    plan = SimpleNamespace(
        rows=4, cols=16, compute_dtype="float32", stats_dtype="float32", eps=1e-5, return_stats=True
    )
    y, mean, rstd = array_api_backend.layer_norm(x, None, None, plan=plan, out=None)
    want_y, want_mean, want_rstd = reference.layer_norm(data)
    assert y.device == device and mean.dtype == rstd.dtype == xp.float32
    np.testing.assert_allclose(np.from_dlpack(y), want_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.from_dlpack(mean), want_mean[:, 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.from_dlpack(rstd), want_rstd[:, 0], rtol=1e-5)
