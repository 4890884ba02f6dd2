"""Tests of the jax backend: the conformance suite, plus what is particular to JAX."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import jax
import jax.numpy as jnp
import normlab
import numpy as np
import pytest
from normlab import arrays, reference, testing
from normlab.testing.cases import Case
from normlab.testing.test_numerics import ACCURACY_ATOL, ACCURACY_RTOL
from normlab.testing.tolerances import assert_close, conditioning

import normlab_jax
from normlab_jax import backend
from normlab_jax.arrays import JaxInspector

DTYPES = ("float16", "bfloat16", "float32")
#: (shape, call arguments): trailing dims, Keras-style axes, a single row.
LAYOUTS = (
    ((4, 3, 17), {}),
    ((2, 5, 8), {"normalized_shape": (5, 8)}),
    ((6, 4, 9), {"axis": (0, 2)}),
    ((1, 4097), {}),
)


def _inputs(
    shape: tuple[int, ...], dtype: str, call: dict[str, Any]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (offset 3, spread 2) and float32 weight and bias of the normalized shape."""
    rng = np.random.default_rng(0)
    x = (3.0 + 2.0 * rng.standard_normal(shape)).astype(jnp.dtype(dtype))
    axes = reference.normalized_axes(len(shape), call.get("normalized_shape"), call.get("axis"))
    param_shape = tuple(shape[a] for a in axes)
    weight = (1.0 + 0.1 * rng.standard_normal(param_shape)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(param_shape)).astype(np.float32)
    return x, weight, bias


def _assert_layer_norm(result: Any, x: np.ndarray, w: Any, b: Any, call: dict[str, Any]) -> None:
    """``result`` = (y, mean, rstd) from normlab matches the float64 reference."""
    y, mean, rstd = result
    want_y, want_mean, want_rstd = reference.layer_norm(x, weight=w, bias=b, **call)
    cond = conditioning(want_mean, want_rstd)
    cols = x.size // max(1, want_mean.size)
    dtype = x.dtype.name
    stats_dtype = jnp.float64 if dtype == "float64" else jnp.float32
    assert isinstance(y, jax.Array) and y.dtype == x.dtype and y.shape == x.shape
    assert mean.dtype == rstd.dtype == stats_dtype and mean.shape == want_mean.shape
    assert_close(np.asarray(y), want_y, dtype, cond, what="y", cols=cols)
    assert_close(
        np.asarray(mean), want_mean, dtype, cond, what="mean", cols=cols, scale=1 / want_rstd
    )
    assert_close(np.asarray(rstd), want_rstd, dtype, cond, what="rstd", cols=cols, scale=want_rstd)


def test_registered_by_its_distribution() -> None:
    (jax_backend,) = [b for b in normlab.list_backends() if b.name == "jax"]
    assert jax_backend.provided_by.startswith("normlab-jax ")
    assert jax_backend.available, jax_backend.reason
    assert jax_backend.capabilities == frozenset()  # no strides, no out=: JAX cannot


def test_normlab_reads_jax_arrays_with_the_plugins_inspector() -> None:
    """The record supplies the inspector (normlab's built-in one is a fallback for older
    versions of this plugin); it names devices, tracers included, and permutes axes."""
    x = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)
    assert type(arrays.inspector(type(x))) is JaxInspector
    info = arrays.info(x)
    assert (info.family, info.dtype, info.device, info.strides) == ("jax", "float32", "cpu:0", None)
    assert not info.writeable
    np.testing.assert_array_equal(np.asarray(arrays.permute(x, (1, 0))), np.asarray(x).T)
    traced = jax.jit(lambda a: jnp.asarray(arrays.info(a).device == "cpu:traced"))(x)
    assert bool(traced)


def test_unavailable_without_jax(monkeypatch: pytest.MonkeyPatch) -> None:
    """The record's check says why, without importing JAX (here: as if it were missing)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "jax" else real(name, *a)
    )
    assert normlab_jax.RECORD.check is not None
    assert normlab_jax.RECORD.check() == "jax is not installed"


def test_conformance_suite() -> None:
    """``normlab check jax``, in x64 mode: float64 arrays exist only there, and the suite makes
    each dtype the record lists (the other dtypes behave the same in either mode). The record
    declares ``flushes_subnormals``: the suite skips its subnormal rows, saying so."""
    with jax.enable_x64(True):
        assert testing.check("jax") == 0


def test_small_outputs_of_rows_far_from_their_first_element() -> None:
    """The corrected mean: float32 rows whose first element lies 3.5 from their mean give every
    element of y within the suite's ``1e-7 + 1.3e-6 * |reference|`` (normlab-jax 0.2.0's
    shifted mean, whose sum of ``x - x0`` rounds at that scale, put y 5.3 times beyond)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((256, 768)).astype(np.float32)
    x[:, 0] = np.where(rng.random(256) < 0.5, -3.5, 3.5)
    y = np.asarray(normlab.layer_norm(jnp.asarray(x), eps=1e-5)).astype(np.float64)
    want = reference.layer_norm(x, eps=1e-5)[0]
    allowed = ACCURACY_ATOL + ACCURACY_RTOL * np.abs(want)
    ratio = float((np.abs(y - want) / allowed).max())
    assert ratio <= 1, f"y up to {ratio:.2f} times the tolerance"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_row_alone_as_in_the_batch(dtype: str) -> None:
    """Each of 2048 rows (each its own mean and spread) called alone gives bitwise its y, mean
    and rstd of the whole batch: no rounded product is left for XLA to contract into a fused
    multiply-add in one kernel and not in another (a guard-free kernel differs in about one
    row in four)."""
    x = Case((2048, 768), dtype, "rowwise", seed=768).numpy_inputs()[0]
    rng = np.random.default_rng(6)
    weight, bias = (jnp.asarray(rng.standard_normal(768), dtype=dtype) for _ in range(2))
    whole = [
        np.asarray(a)
        for a in normlab.layer_norm(jnp.asarray(x), weight=weight, bias=bias, return_stats=True)
    ]
    differ = []
    for i in range(len(x)):
        alone = normlab.layer_norm(
            jnp.asarray(x[i : i + 1]), weight=weight, bias=bias, return_stats=True
        )
        pairs = zip(alone, whole, strict=True)
        if any(np.asarray(a).tobytes() != w[i : i + 1].tobytes() for a, w in pairs):
            differ.append(i)
    assert not differ, f"{len(differ)} rows differ alone, e.g. {differ[:5]}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "call"), LAYOUTS, ids=lambda v: str(v))
def test_layer_norm_matches_reference(
    dtype: str, shape: tuple[int, ...], call: dict[str, Any]
) -> None:
    """In JAX's default mode (the suite runs in x64 mode), float32 parameters for half x."""
    x, w, b = _inputs(shape, dtype, call)
    result = normlab.layer_norm(
        jnp.asarray(x), weight=jnp.asarray(w), bias=jnp.asarray(b), return_stats=True, **call
    )
    _assert_layer_norm(result, x, w, b, call)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "call"), LAYOUTS, ids=lambda v: str(v))
def test_rms_norm_matches_reference(
    dtype: str, shape: tuple[int, ...], call: dict[str, Any]
) -> None:
    x, w, _ = _inputs(shape, dtype, call)
    y, rstd = normlab.rms_norm(jnp.asarray(x), weight=jnp.asarray(w), return_stats=True, **call)
    want_y, want_rstd = reference.rms_norm(x, weight=w, **call)
    cols = x.size // want_rstd.size
    assert y.dtype == x.dtype and rstd.dtype == jnp.float32 and rstd.shape == want_rstd.shape
    ones = np.ones_like(want_rstd)
    assert_close(np.asarray(y), want_y, dtype, ones, what="y", cols=cols)
    assert_close(np.asarray(rstd), want_rstd, dtype, ones, what="rstd", cols=cols, scale=want_rstd)


def test_large_offset_and_constant_rows() -> None:
    """Shifted two-pass: 100 + 0.01·randn stays accurate in float32; a constant row is bias."""
    rng = np.random.default_rng(1)
    x = (100.0 + 0.01 * rng.standard_normal((8, 1000))).astype(np.float32)
    x[3] = 7.25
    bias = np.linspace(-1, 1, 1000, dtype=np.float32)
    result = normlab.layer_norm(jnp.asarray(x), bias=jnp.asarray(bias), return_stats=True)
    _assert_layer_norm(result, x, None, bias, {})
    np.testing.assert_array_equal(np.asarray(result[0])[3], bias)


def test_float16_sum_of_squares_does_not_overflow() -> None:
    x = np.full((2, 4096), 60000.0, dtype=np.float16)
    x[:, ::2] = -60000.0
    y = np.asarray(normlab.layer_norm(jnp.asarray(x)))
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, np.sign(x.astype(np.float32)), rtol=2e-3)


@pytest.mark.parametrize(
    ("magnitude", "eps"),
    [(1e-25, 0.0), (1e-30, 1e-5), (1e30, 1e-5), (1e36, 0.0)],
    ids=["squares_underflow", "eps_dwarfs_the_row", "squares_overflow", "rstd_near_1e-36"],
)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_rows_anywhere_in_the_normal_range(op: str, magnitude: float, eps: float) -> None:
    """float32 rows far from 1 are normalized as rows near 1 are (each row is scaled by a power
    of two first); a constant row among them gives exactly bias (LayerNorm, eps > 0)."""
    rng = np.random.default_rng(4)
    x = (magnitude * rng.uniform(0.5, 2.5, (6, 300)) * np.resize([1, -1, 1], 300)).astype(
        np.float32
    )
    if op == "rms_norm":
        y, rstd = normlab.rms_norm(jnp.asarray(x), eps=eps, return_stats=True)
        want_y, want_rstd = reference.rms_norm(x, eps=eps)
        ones = np.ones_like(want_rstd)
        assert_close(np.asarray(y), want_y, "float32", ones, what="y", cols=300)
        assert_close(np.asarray(rstd), want_rstd, "float32", ones, what="rstd", cols=300)
        return
    if eps > 0:
        x[5] = x[5, 0]  # constant
    bias = np.linspace(-1, 1, 300, dtype=np.float32)
    result = normlab.layer_norm(jnp.asarray(x), bias=jnp.asarray(bias), eps=eps, return_stats=True)
    _assert_layer_norm(result, x, None, bias, {"eps": eps})
    if eps > 0:
        np.testing.assert_array_equal(np.asarray(result[0])[5], bias)


def test_record_declares_the_flushing_it_gets() -> None:
    """``flushes_subnormals=True`` is true here: jitted XLA code on the CPU flushes a subnormal
    input, and a subnormal result, to zero. When a jaxlib stops flushing, drop the declaration."""
    assert normlab_jax.RECORD.flushes_subnormals
    cpu = jax.devices("cpu")[0]
    subnormal = jax.device_put(np.float32(2.0**-140), cpu)
    normal = jax.device_put(np.float32(2.0**-40), cpu)
    assert float(jax.jit(lambda a: a * 2)(subnormal)) == 0.0
    assert float(jax.jit(lambda a: a * 2.0**-100)(normal)) == 0.0


def test_float16_subnormal_rows() -> None:
    """float16 subnormals are normal numbers in float32, where the kernels compute: the rows the
    suite skips for a flushing backend are exact for float16."""
    x = (np.random.default_rng(8).standard_normal((4, 64)) * 2.0**-16).astype(np.float16)
    assert (np.abs(x) < np.finfo(np.float16).smallest_normal).mean() > 0.9
    result = normlab.layer_norm(jnp.asarray(x), eps=0.0, return_stats=True)
    _assert_layer_norm(result, x, None, None, {"eps": 0.0})


def test_result_stays_on_the_device_of_x() -> None:
    device = jax.devices()[-1]
    x = jax.device_put(jnp.ones((3, 5)), device)
    assert normlab.layer_norm(x).devices() == {device}


def test_compiled_once_per_configuration() -> None:
    backend.kernel.cache_clear()
    x = jnp.ones((4, 6))
    for _ in range(3):
        normlab.layer_norm(x, eps=1e-3)
    normlab.layer_norm(jnp.ones((5, 7)), eps=1e-3)  # another shape: the same jitted function
    assert backend.kernel.cache_info().currsize == 1
    normlab.layer_norm(x, eps=1e-4)
    normlab.layer_norm(x, weight=jnp.ones(6), eps=1e-3)
    normlab.layer_norm(x, eps=1e-3, return_stats=True)
    assert backend.kernel.cache_info().currsize == 4


def test_float64_in_x64_mode() -> None:
    x = np.random.default_rng(2).standard_normal((5, 33))
    with jax.enable_x64(True):
        result = normlab.layer_norm(backend.from_numpy(x), return_stats=True)
        _assert_layer_norm(result, x, None, None, {})


def test_float64_refused_without_x64_mode() -> None:
    """JAX's default mode has no float64 arrays: the converter says so instead of downcasting."""
    assert jnp.asarray(np.ones(2)).dtype == jnp.float32  # JAX's own default, not normlab's
    with pytest.raises(normlab.DtypeError, match="x64"):
        backend.from_numpy(np.ones(2))


def test_empty_batch() -> None:
    y, mean, rstd = normlab.layer_norm(jnp.ones((0, 4)), return_stats=True)
    assert isinstance(y, jax.Array) and y.shape == (0, 4) and mean.shape == rstd.shape == (0, 1)


def test_converters_round_trip() -> None:
    a = np.arange(math.prod((3, 4)), dtype=np.float32).reshape(3, 4)
    like = jax.device_put(jnp.ones(1), jax.devices()[0])
    j = backend.from_numpy(a, like=like)
    assert j.devices() == like.devices()
    back = backend.to_numpy(j)
    back[0, 0] = -1  # a copy: writing it changes neither the JAX array nor the source
    assert float(j[0, 0]) == 0 and a[0, 0] == 0


def _textbook(x: jax.Array, w: jax.Array) -> jax.Array:
    """The textbook formula in plain jax.numpy, to compare transformations against."""
    mean = x.mean(axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(x.var(axis=-1, keepdims=True) + 1e-5) * w


@pytest.mark.parametrize("transform", [jax.jit, jax.vmap, jax.grad], ids=lambda t: t.__name__)
def test_composes_with_jax_transformations(transform: Any) -> None:
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 8)), dtype=jnp.float32)
    w = jnp.linspace(0.5, 1.5, 8)
    if transform is jax.grad:
        got = jax.grad(lambda a: (normlab.layer_norm(a, weight=w) ** 3).sum())(x)
        want = jax.grad(lambda a: (_textbook(a, w) ** 3).sum())(x)
    else:
        got = transform(lambda a: normlab.layer_norm(a, weight=w))(x)
        want = _textbook(x, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_out_is_refused_clearly() -> None:
    x = jnp.ones((2, 3))
    with pytest.raises(normlab.NormlabError, match="immutable"):
        normlab.layer_norm(x, out=jnp.empty_like(x))
