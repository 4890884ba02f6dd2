"""The core's composition of parameters (normlab.parameters): an offset weight and parameters of
any float dtype, as the default call and the named backends see them, and the native path of a
backend that declares the capability ``"weight_offset"``."""

from __future__ import annotations

from typing import Any, Final

import ml_dtypes
import numpy as np
import pytest

import normlab
from normlab.hookspecs import Plan
from normlab.testing.bitwise import same_bits
from normlab.testing.conversions import to_numpy
from tests.support import mutants

ROWS, COLS = 48, 200


def _x(dtype: Any = np.float32, rows: int = ROWS, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, COLS)) * 2 + 1).astype(dtype)


def _weight(dtype: Any = np.float32) -> np.ndarray:
    return (0.1 * np.random.default_rng(1).standard_normal(COLS)).astype(dtype)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("backend", [None, "numpy"])
def test_offset_is_added_in_the_compute_dtype(op: str, backend: str | None) -> None:
    """bfloat16 x and weight: ``1 + w`` needs more bits than bfloat16 has; the call's bits are
    those of the float32 weight ``1 + float32(w)``, and differ from a bfloat16 sum's."""
    x, w = _x(ml_dtypes.bfloat16), _weight(ml_dtypes.bfloat16)
    function = getattr(normlab, op)
    got = function(x, weight=w, weight_offset=1.0, backend=backend)
    formed = function(x, weight=w.astype(np.float32) + np.float32(1), backend=backend)
    rounded = function(x, weight=w + ml_dtypes.bfloat16(1), backend=backend)
    assert same_bits(got, formed)
    assert not same_bits(got, rounded)


def test_the_default_call_is_batch_invariant_with_composed_parameters() -> None:
    """A row's bits alone and in its batch, with an offset and a weight of another dtype."""
    x = _x(np.float32, rows=1024)
    kwargs = {"weight": _weight(ml_dtypes.bfloat16), "weight_offset": 1.0}
    whole = normlab.rms_norm(x, **kwargs)
    for rows in (1, 7, 64, 300):
        part = normlab.rms_norm(x[:rows], **kwargs)
        assert same_bits(part, whole[:rows]), rows


def test_parameters_are_read_afresh_and_never_modified() -> None:
    """Nothing is cached across calls (a NumPy weight changed in place is seen), and the
    caller's parameters keep their bits."""
    x, w = _x(), _weight(np.float64)
    before = w.copy()
    first = normlab.layer_norm(x, weight=w, weight_offset=1.0)
    assert same_bits(w, before)
    w *= 2
    second = normlab.layer_norm(x, weight=w, weight_offset=1.0)
    want = normlab.layer_norm(x, weight=w.astype(np.float32) + np.float32(1))
    assert same_bits(second, want) and not same_bits(second, first)


def test_strided_and_non_native_parameters() -> None:
    """A weight viewed with a stride and a bias in non-native byte order are converted like
    any other."""
    x = _x()
    w = np.repeat(_weight(np.float64), 2)[::2]
    b = _weight(np.float64).astype(">f8")
    got = normlab.layer_norm(x, weight=w, bias=b, weight_offset=0.5)
    want = normlab.layer_norm(
        x, weight=w.astype(np.float32) + np.float32(0.5), bias=b.astype(np.float32)
    )
    assert same_bits(got, want)


def test_backward_gradients_in_the_weights_dtype() -> None:
    """The backward ops give dweight (and dbias) in the weight's dtype; dx uses the offset."""
    x, dy = _x(), _x(seed=3)
    w = _weight(ml_dtypes.bfloat16)
    _, mean, rstd = normlab.layer_norm(x, return_stats=True)
    dx, dw, db = normlab.layer_norm_backward(dy, x, mean, rstd, w, weight_offset=1.0)
    assert (dx.dtype, dw.dtype, db.dtype) == (np.float32, w.dtype, w.dtype)
    formed = w.astype(np.float32) + np.float32(1)
    want = normlab.layer_norm_backward(dy, x, mean, rstd, formed)
    assert same_bits(dx, want[0])
    assert same_bits(dw, want[1].astype(w.dtype))


def test_explain_says_who_forms_the_parameters() -> None:
    """numba declares ``weight_offset`` and ``parameter_dtypes``: it forms them itself; for the
    numpy backend (neither) the core does."""
    pytest.importorskip("numba")
    x, w = _x(), _weight(ml_dtypes.bfloat16)
    text = normlab.explain(x, weight=w, weight_offset=1.0, backend="numba")
    assert "numba takes them as given and forms weight_offset + weight (1.0 + bfloat16)" in text
    text = normlab.explain(x, weight=w, weight_offset=1.0, backend="numpy")
    assert "parameters: the core forms weight_offset + weight (1.0 + bfloat16) in float32" in text


#: (x's dtype, the weight's, the bias's) for numba's own forming of the parameters.
NATIVE_DTYPES: Final = (
    (ml_dtypes.bfloat16, ml_dtypes.bfloat16, ml_dtypes.bfloat16),
    (np.float32, np.float16, np.float64),
    (np.float32, ml_dtypes.bfloat16, ml_dtypes.bfloat16),
    (np.float16, np.float64, np.float32),
    (np.float64, np.float32, np.float32),
)


@pytest.mark.parametrize("arrays", ["numpy", "torch"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
@pytest.mark.parametrize("rows", [1, 5, 4096])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_numba_forms_the_parameters_as_the_core_does(
    arrays: str, op: str, rows: int, offset: float
) -> None:
    """numba's own forming (the weight converted to the compute dtype, the offset added there,
    in its pass over the parameters) gives the bits of the core's, zeros' signs included: one
    token, a few rows on the calling thread, many on the pool's threads; half, float32 and
    float64 x beside parameters of every float dtype; NumPy arrays and CPU tensors (whose
    C-contiguous rows go to the kernels by address, parameters of another type included)."""
    pytest.importorskip("numba")
    convert = _converter(arrays)
    function = getattr(normlab, op)
    for x_dtype, w_dtype, b_dtype in NATIVE_DTYPES:
        compute = np.dtype(np.float64 if x_dtype is np.float64 else np.float32)
        x = convert(_x(x_dtype, rows=rows))
        extra = (convert(_x(x_dtype, rows=rows, seed=5)),) if op.startswith("add_") else ()
        w = _weight(w_dtype)
        w[:3] = -0.0
        b = _weight(b_dtype) if op.endswith("layer_norm") else None
        given = {"weight": convert(w)} if b is None else {"weight": convert(w), "bias": convert(b)}
        native = function(x, *extra, weight_offset=offset, backend="numba", **given)
        formed_weight = w.astype(compute) + compute.type(offset) if offset else w.astype(compute)
        formed = {"weight": convert(formed_weight)}
        if b is not None:
            formed["bias"] = convert(b.astype(compute))
        want = function(x, *extra, backend="numba", **formed)
        pairs = zip(native, want, strict=True) if extra else [(native, want)]
        assert all(same_bits(to_numpy(a), to_numpy(b)) for a, b in pairs), (op, rows, x_dtype)


def _converter(arrays: str) -> Any:
    """The function giving a NumPy array as the family ``arrays`` holds it."""
    if arrays == "numpy":
        return lambda a: a
    pytest.importorskip("torch")
    from normlab.backends.torch_backend import from_numpy

    return from_numpy


def test_a_backend_declaring_the_capability_gets_the_offset() -> None:
    """A backend whose record declares ``"weight_offset"`` receives the caller's weight and
    ``plan.weight_offset``; one that does not receives the formed weight and an offset of 0."""
    seen: list[tuple[float, Any]] = []
    x, w = _x(), _weight()
    with mutants.registered("control") as name:
        module = mutants.sys.modules[f"{mutants.__name__}.control"]
        kernel = module.layer_norm

        def spy(x: Any, weight: Any, bias: Any, *, plan: Plan, out: Any) -> Any:
            seen.append((plan.weight_offset, weight))
            return kernel(x, weight, bias, plan=plan, out=out)

        module.layer_norm = spy
        native = normlab.layer_norm(x, weight=w, weight_offset=1.0, backend=name)
    assert seen[0][0] == 1.0 and seen[0][1] is w
    formed = normlab.layer_norm(x, weight=w, weight_offset=1.0, backend="numpy")
    np.testing.assert_allclose(native, formed, rtol=0, atol=2e-6)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"weight_offset": 1.0}, normlab.ArgumentError, "without a weight"),
        ({"weight": "w", "weight_offset": float("inf")}, normlab.ArgumentError, "finite"),
        ({"weight": "w", "weight_offset": True}, normlab.ArgumentTypeError, "real number"),
        ({"weight": "w", "weight_offset": np.ones(1)}, normlab.ArgumentTypeError, "real number"),
    ],
)
def test_bad_offsets(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    if kwargs.get("weight") == "w":
        kwargs = {**kwargs, "weight": _weight()}
    for op in ("layer_norm", "rms_norm"):
        with pytest.raises(error, match=message):
            getattr(normlab, op)(_x(), **kwargs)


def test_an_offset_of_zero_is_the_plain_call() -> None:
    """``weight_offset=0`` (int or float) without a weight is allowed: the textbook call."""
    x = _x()
    assert same_bits(normlab.layer_norm(x, weight_offset=0), normlab.layer_norm(x))
