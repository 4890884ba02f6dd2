"""Every bad input raises its NormlabError subclass, through the backend under test, for each
op the backend provides."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import numpy as np
import pytest

import normlab
from normlab import ArgumentError, BackendError, DeviceError, DtypeError, ShapeError
from normlab.spec import FLOAT_DTYPES, HALF_DTYPES
from normlab.testing.cases import OPS, arrange, numpy_dtype
from normlab.testing.subject import Subject


class ForeignArray:
    """An array of a library no backend serves (its family is ``"normlab"``)."""

    def __init__(self, a: np.ndarray) -> None:
        self.shape = a.shape
        self.dtype = a.dtype


def _array(s: Subject, shape: tuple[int, ...] = (3, 4), dtype: str | None = None) -> Any:
    return s.from_numpy(np.ones(shape, numpy_dtype(dtype or s.dtype)))


def _wrong(s: Subject, right: str) -> str:
    """A float dtype the family can make other than ``right`` (and other than float32, which
    parameters of half x may have); skips when there is none."""
    allowed = {right, "float32"} if right in HALF_DTYPES else {right}
    for dtype in s.dtypes:
        if dtype not in allowed:
            return dtype
    pytest.skip(f"{s.family} arrays of no dtype but {sorted(allowed)} can be made here")


def _stats_dtype(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


#: The error and the call's arguments after x (a function of the subject).
Bad = tuple[type[Exception], Callable[[Subject], dict[str, Any]]]

#: id -> bad input of layer_norm. x is ``_array(s)`` — shape (3, 4) in the subject's float32
#: (else widest) dtype — unless the arguments give ``x``.
BAD: dict[str, Bad] = {
    "x-list": (ArgumentError, lambda s: {"x": [[1.0, 2.0], [3.0, 4.0]]}),
    "x-int": (DtypeError, lambda s: {"x": s.from_numpy(np.ones((3, 4), np.int32))}),
    "x-0d": (ShapeError, lambda s: {"x": s.from_numpy(np.array(1.0, numpy_dtype(s.dtype)))}),
    "x-foreign": (BackendError, lambda s: {"x": ForeignArray(np.ones((3, 4), np.float32))}),
    "unknown-backend": (BackendError, lambda s: {"backend": "no_such_backend"}),
    "shape-mismatch": (ShapeError, lambda s: {"normalized_shape": (5,)}),
    "shape-too-long": (ShapeError, lambda s: {"normalized_shape": (2, 3, 4)}),
    "shape-empty": (ShapeError, lambda s: {"normalized_shape": ()}),
    "shape-float": (ArgumentError, lambda s: {"normalized_shape": 4.0}),
    "shape-str": (ArgumentError, lambda s: {"normalized_shape": "4"}),
    "axis-out-of-range": (ShapeError, lambda s: {"axis": 2}),
    "axis-negative-out-of-range": (ShapeError, lambda s: {"axis": -3}),
    "axis-repeated": (ShapeError, lambda s: {"axis": (1, -1)}),
    "axis-empty": (ShapeError, lambda s: {"axis": ()}),
    "axis-bool": (ArgumentError, lambda s: {"axis": True}),
    "axis-disagrees": (ShapeError, lambda s: {"normalized_shape": (4,), "axis": 0}),
    "weight-shape": (ShapeError, lambda s: {"weight": _array(s, (3,))}),
    "weight-shape-2d": (ShapeError, lambda s: {"weight": _array(s, (1, 4))}),
    "weight-dtype": (
        DtypeError,
        lambda s: {"weight": _array(s, (4,), _wrong(s, s.dtype))},
    ),
    "weight-int": (DtypeError, lambda s: {"weight": s.from_numpy(np.ones(4, np.int32))}),
    "weight-foreign": (DeviceError, lambda s: {"weight": ForeignArray(np.ones(4, np.float32))}),
    "bias-shape": (ShapeError, lambda s: {"bias": _array(s, (5,))}),
    "bias-dtype": (DtypeError, lambda s: {"bias": _array(s, (4,), _wrong(s, s.dtype))}),
    "bias-foreign": (DeviceError, lambda s: {"bias": ForeignArray(np.ones(4, np.float32))}),
    "eps-negative": (ArgumentError, lambda s: {"eps": -1e-5}),
    "eps-nan": (ArgumentError, lambda s: {"eps": float("nan")}),
    "eps-inf": (ArgumentError, lambda s: {"eps": float("inf")}),
    "eps-none": (ArgumentError, lambda s: {"eps": None}),
    "eps-bool": (ArgumentError, lambda s: {"eps": True}),
    "eps-list": (ArgumentError, lambda s: {"eps": [1e-5]}),
    "eps-str": (ArgumentError, lambda s: {"eps": "1e-5"}),
    "return-stats-int": (ArgumentError, lambda s: {"return_stats": 1}),
    "return-stats-str": (ArgumentError, lambda s: {"return_stats": "yes"}),
    "out-shape": (ShapeError, lambda s: {"out": _array(s, (4, 3))}),
    "out-dtype": (DtypeError, lambda s: {"out": _array(s, (3, 4), _wrong(s, s.dtype))}),
    "out-foreign": (DeviceError, lambda s: {"out": ForeignArray(np.ones((3, 4), np.float32))}),
    "out-tuple-without-stats": (ArgumentError, lambda s: {"out": (_array(s), None, None)}),
    "out-tuple-of-two": (
        ArgumentError,
        lambda s: {"out": (_array(s), None), "return_stats": True},
    ),
    "out-mean-dtype": (
        DtypeError,
        lambda s: {
            "out": (None, _array(s, (3, 1), _wrong(s, _stats_dtype(s.dtype))), None),
            "return_stats": True,
        },
    ),
    "out-rstd-shape": (
        ShapeError,
        lambda s: {
            "out": (None, None, _array(s, (3,), _stats_dtype(s.dtype))),
            "return_stats": True,
        },
    ),
}


#: ids of BAD that rms_norm does not share: it has no bias, eps=None is its default, and its
#: ``out`` tuple is ``(y, rstd)``.
_LAYER_NORM_ONLY: Final = frozenset(
    {
        "bias-shape",
        "bias-dtype",
        "bias-foreign",
        "eps-none",
        "out-tuple-without-stats",
        "out-tuple-of-two",
        "out-mean-dtype",
        "out-rstd-shape",
    }
)

#: id -> bad input of rms_norm only. rms_norm has no bias parameter: a bias keyword is Python's
#: TypeError, and a bias passed where layer_norm takes it (after weight) lands on eps.
BAD_RMS_NORM: dict[str, Bad] = {
    "bias-keyword": (TypeError, lambda s: {"bias": _array(s, (4,))}),
    "bias-in-eps-position": (
        ArgumentError,
        lambda s: {"normalized_shape": 4, "weight": _array(s, (4,)), "eps": _array(s, (4,))},
    ),
    "out-tuple-without-stats": (ArgumentError, lambda s: {"out": (_array(s), None)}),
    "out-tuple-of-three": (
        ArgumentError,
        lambda s: {"out": (_array(s), None, None), "return_stats": True},
    ),
    "out-rstd-dtype": (
        DtypeError,
        lambda s: {
            "out": (None, _array(s, (3, 1), _wrong(s, _stats_dtype(s.dtype)))),
            "return_stats": True,
        },
    ),
    "out-rstd-shape": (
        ShapeError,
        lambda s: {"out": (None, _array(s, (3,), _stats_dtype(s.dtype))), "return_stats": True},
    ),
}

#: op -> id -> bad input.
BAD_BY_OP: Final[dict[str, dict[str, Bad]]] = {
    "layer_norm": BAD,
    "rms_norm": {
        **{k: v for k, v in BAD.items() if k not in _LAYER_NORM_ONLY},
        **BAD_RMS_NORM,
    },
}


@pytest.mark.parametrize(("op", "bad"), [(op, bad) for op in OPS for bad in BAD_BY_OP[op]])
def test_bad_input(normlab_subject: Subject, op: str, bad: str) -> None:
    """Each bad argument raises the NormlabError subclass that names the problem."""
    normlab_subject.require_op(op)
    error, arguments = BAD_BY_OP[op][bad]
    kwargs = {"x": _array(normlab_subject), "backend": normlab_subject.name}
    kwargs.update(arguments(normlab_subject))
    with pytest.raises(error):
        getattr(normlab, op)(**kwargs)


@pytest.mark.parametrize("op", OPS)
def test_op_not_provided(normlab_subject: Subject, op: str) -> None:
    """An op the record does not list: the named backend refuses with BackendError, and
    explain() says why."""
    if op in normlab_subject.ops:
        pytest.skip(f"backend {normlab_subject.name!r} provides {op}")
    x = _array(normlab_subject)
    with pytest.raises(BackendError, match=f"does not provide {op}"):
        getattr(normlab, op)(x, backend=normlab_subject.name)
    text = normlab.explain(x, op=op, backend=normlab_subject.name)
    assert f"does not provide {op}" in text, text


def test_dtype_not_served(normlab_subject: Subject) -> None:
    """x of a float dtype the record does not list: BackendError (named backends are strict)."""
    missing = [d for d in FLOAT_DTYPES if d not in normlab_subject.dtypes]
    if not missing:
        pytest.skip(f"backend {normlab_subject.name!r} serves every float dtype")
    try:
        x = _array(normlab_subject, dtype=missing[0])
    except Exception as exc:  # the family itself has no such dtype
        pytest.skip(f"{normlab_subject.family} arrays cannot be {missing[0]}: {exc}")
    with pytest.raises(BackendError):
        normlab.layer_norm(x, backend=normlab_subject.name)


def test_out_zero_stride(normlab_subject: Subject) -> None:
    """A broadcast ``out`` (zero stride, overlapping elements): ArgumentError."""
    normlab_subject.require_layout("broadcast")
    backend = normlab.registry.get(normlab_subject.name)
    out = arrange(np.zeros((3, 4), numpy_dtype(normlab_subject.dtype)), "broadcast", backend)
    with pytest.raises(ArgumentError):
        normlab.layer_norm(_array(normlab_subject), out=out, backend=normlab_subject.name)


def test_out_partly_overlapping_x(normlab_subject: Subject) -> None:
    """``out`` sharing part of x's memory (not x itself): ArgumentError."""
    normlab_subject.require_layout("padded")
    memory = _array(normlab_subject, (3, 5))
    with pytest.raises(ArgumentError):
        normlab.layer_norm(memory[:, 1:], out=memory[:, :4], backend=normlab_subject.name)


def test_family_specific(normlab_subject: Subject) -> None:
    """Bad inputs only some families can express: a NumPy masked array (DtypeError) or
    read-only out (ArgumentError); a torch out= while x requires grad (ArgumentError)."""
    name = normlab_subject.name
    x = _array(normlab_subject)
    if normlab_subject.family == "numpy":
        with pytest.raises(DtypeError):
            normlab.layer_norm(np.ma.masked_array(x, mask=x > 2), backend=name)
        frozen = np.zeros_like(x)
        frozen.flags.writeable = False
        with pytest.raises(ArgumentError):
            normlab.layer_norm(x, out=frozen, backend=name)
    elif normlab_subject.family == "torch":
        x.requires_grad_(True)
        with pytest.raises(ArgumentError):
            normlab.layer_norm(x, out=x.detach().clone(), backend=name)
    else:
        pytest.skip(f"no family-specific bad inputs known for {normlab_subject.family} arrays")
