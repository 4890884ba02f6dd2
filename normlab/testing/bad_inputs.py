"""The table of bad inputs: every misuse of ``layer_norm`` and ``rms_norm`` (and of the fused
ops' residual arguments) a caller can make in any array family, the
:class:`~normlab.NormlabError` subclass it raises and a pattern its message must match.

Each :class:`BadInput` builds its call's arguments from an :class:`Inputs` (the arrays of one
backend's family: x is ``(2, 3, 4)`` ones of the family's test dtype unless the entry gives
``x``); its ``message`` is a regular expression in which ``{dtype}`` (x's dtype), ``{other}``
(a float dtype other than x's, and than float32 for half x), ``{stats}`` (the statistics'
dtype) and ``{other_stats}`` stand for dtype names. The conformance suite runs the table
through the backend under test (normlab/testing/test_errors.py), the project's tests through
the numpy and torch backends (tests/core/test_errors.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import numpy as np
import pytest

import normlab
from normlab import (
    ArgumentError,
    ArgumentTypeError,
    BackendError,
    DeviceError,
    DtypeError,
    ShapeError,
)
from normlab.constants import HALF_DTYPES
from normlab.ops import FUSED_OPS, names
from normlab.testing.conversions import numpy_dtype

__all__ = ["BAD_INPUTS", "BadInput", "ForeignArray", "Inputs", "bad_inputs_of"]

#: The shape of x in the table's calls (unless an entry gives x).
X_SHAPE: Final = (2, 3, 4)


class ArrayFamily(Protocol):
    """What the table needs of a backend under test (the suite's Subject has it)."""

    @property
    def dtype(self) -> str: ...

    @property
    def dtypes(self) -> tuple[str, ...]: ...

    def from_numpy(self, a: np.ndarray) -> Any: ...


class ForeignArray:
    """An array of a library no backend serves (its family is ``"normlab"``)."""

    def __init__(self, shape: tuple[int, ...], dtype: Any = np.float32) -> None:
        self.shape = shape
        self.dtype = np.dtype(dtype)


class Inputs:
    """Arrays of one backend's family and the dtype names the table's messages mention; a
    dtype the family cannot make skips the test that needs it."""

    def __init__(self, family: ArrayFamily) -> None:
        self.family = family

    @property
    def dtype(self) -> str:
        """x's dtype: float32, else the widest the family makes."""
        return self.family.dtype

    def array(self, shape: tuple[int, ...] = X_SHAPE, dtype: str | None = None) -> Any:
        """Ones of ``shape`` and ``dtype`` (default x's) in the family; skips when the family
        makes no such float arrays here."""
        dtype = dtype or self.dtype
        if dtype not in self.family.dtypes:
            pytest.skip(f"the family makes no {dtype} arrays here")
        return self.family.from_numpy(np.ones(shape, numpy_dtype(dtype)))

    def of(self, a: np.ndarray) -> Any:
        """``a`` in the family."""
        return self.family.from_numpy(a)

    def _pick(self, dtypes: list[str], what: str) -> str:
        if not dtypes:
            pytest.skip(
                f"the family makes no {what} here (it makes {', '.join(self.family.dtypes)})"
            )
        return dtypes[0]

    @property
    def other(self) -> str:
        """A float dtype other than x's (and than float32 for half x)."""
        allowed = {self.dtype, "float32"} if self.dtype in HALF_DTYPES else {self.dtype}
        return self._pick([d for d in self.family.dtypes if d not in allowed], "other dtype")

    @property
    def stats(self) -> str:
        return "float64" if self.dtype == "float64" else "float32"

    @property
    def other_stats(self) -> str:
        return self._pick([d for d in self.family.dtypes if d != self.stats], "other dtype")

    def __getitem__(self, name: str) -> str:
        """The dtype names of the messages (``str.format_map``)."""
        if name not in ("dtype", "other", "stats", "other_stats"):
            raise KeyError(name)
        value: str = getattr(self, name)
        return value


@dataclass(frozen=True)
class BadInput:
    """One bad input: the arguments of the call (x included where it is the bad one), the
    error, and a regular expression its message must match (dtype names as ``{name}``)."""

    name: str
    error: type[Exception]
    message: str
    arguments: Callable[[Inputs], dict[str, Any]]
    ops: frozenset[str] = frozenset({"layer_norm", "rms_norm"})

    def call(self, op: str, inputs: Inputs, backend: str | None) -> Any:
        """Make the call of ``op`` on ``backend`` (None: no ``backend=`` unless the entry's)."""
        kwargs: dict[str, Any] = {"x": inputs.array()}
        if op in FUSED:
            kwargs["residual"] = inputs.array()
        if backend is not None:
            kwargs["backend"] = backend
        kwargs.update(self.arguments(inputs))
        return getattr(normlab, op)(**kwargs)

    def pattern(self, inputs: Inputs) -> str:
        """The message's regular expression with the dtype names of ``inputs``."""
        return self.message.format_map(inputs)

    def check(self, op: str, inputs: Inputs, backend: str | None) -> None:
        """Assert the call raises the entry's error with a message matching its pattern."""
        pattern = self.pattern(inputs)
        with pytest.raises(self.error, match=pattern):
            self.call(op, inputs, backend)


LN: Final = frozenset({"layer_norm"})
RMS: Final = frozenset({"rms_norm"})
#: The fused ops: their calls get a residual like x unless the entry gives one.
FUSED: Final = frozenset(FUSED_OPS)
#: The ops with quantized outputs.
FORWARD_AND_FUSED: Final = frozenset(names(direction="forward"))


_BAD: Final = (
    # x
    BadInput("x-list", ArgumentError, "x must be an array", lambda i: {"x": [[1.0, 2.0]]}),
    BadInput("x-int", DtypeError, "int32", lambda i: {"x": i.of(np.ones((2, 3), np.int32))}),
    BadInput("x-bool", DtypeError, "bool", lambda i: {"x": i.of(np.ones((2, 3), bool))}),
    BadInput(
        "x-complex", DtypeError, "complex64", lambda i: {"x": i.of(np.ones((2, 3), np.complex64))}
    ),
    BadInput("x-0d", ShapeError, "0-d", lambda i: {"x": i.array(())}),
    BadInput(
        "x-foreign",
        BackendError,
        "serve.* normlab array of float32 on cpu|serves .* arrays, not normlab",
        lambda i: {"x": ForeignArray((2, 3))},
    ),
    # backend=
    BadInput(
        "backend-unknown",
        BackendError,
        "unknown backend 'no_such_backend'",
        lambda i: {"backend": "no_such_backend"},
    ),
    BadInput("backend-not-a-name", BackendError, "unknown backend", lambda i: {"backend": 3}),
    # normalized_shape
    BadInput(
        "normalized_shape-mismatch",
        ShapeError,
        r"\(5,\).*\(2, 3, 4\)",
        lambda i: {"normalized_shape": (5,)},
    ),
    BadInput(
        "normalized_shape-not-trailing",
        ShapeError,
        r"\(2, 3\).*\(2, 3, 4\)",
        lambda i: {"normalized_shape": (2, 3)},
    ),
    BadInput(
        "normalized_shape-too-long",
        ShapeError,
        r"\(1, 2, 3, 4\)",
        lambda i: {"normalized_shape": (1, 2, 3, 4)},
    ),
    BadInput(
        "normalized_shape-empty",
        ShapeError,
        r"normalized_shape=\(\)",
        lambda i: {"normalized_shape": ()},
    ),
    BadInput(
        "normalized_shape-float",
        ArgumentError,
        "normalized_shape",
        lambda i: {"normalized_shape": 4.0},
    ),
    BadInput(
        "normalized_shape-str",
        ArgumentError,
        "normalized_shape",
        lambda i: {"normalized_shape": "4"},
    ),
    BadInput(
        "normalized_shape-bool",
        ArgumentError,
        "normalized_shape",
        lambda i: {"x": i.array((3, 1)), "normalized_shape": True},
    ),
    # axis
    BadInput("axis-too-large", ShapeError, "axis 3 is out of range", lambda i: {"axis": 3}),
    BadInput(
        "axis-too-negative", ShapeError, "axis -4 is out of range", lambda i: {"axis": (0, -4)}
    ),
    BadInput("axis-repeated", ShapeError, "twice", lambda i: {"axis": (1, 1)}),
    BadInput("axis-repeated-negative", ShapeError, "twice", lambda i: {"axis": (2, -1)}),
    BadInput("axis-empty", ShapeError, r"axis=\(\)", lambda i: {"axis": ()}),
    BadInput("axis-float", ArgumentError, "axis", lambda i: {"axis": 1.0}),
    BadInput("axis-bool", ArgumentError, "axis", lambda i: {"axis": True}),
    BadInput(
        "axis-disagrees",
        ShapeError,
        "disagree",
        lambda i: {"normalized_shape": (3, 4), "axis": (0, 2)},
    ),
    # weight and bias
    BadInput(
        "weight-shape",
        ShapeError,
        r"weight has shape \(3,\).*\(4,\)",
        lambda i: {"weight": i.array((3,))},
    ),
    BadInput(
        "weight-shape-2d",
        ShapeError,
        r"weight has shape \(1, 4\)",
        lambda i: {"weight": i.array((1, 4))},
    ),
    BadInput(
        "weight-shape-with-axis",
        ShapeError,
        r"\(2, 4\)",
        lambda i: {"weight": i.array((4, 2)), "axis": (2, 0)},
    ),
    BadInput(
        "weight-int",
        DtypeError,
        "weight has dtype int32",
        lambda i: {"weight": i.of(np.ones(4, np.int32))},
    ),
    BadInput(
        "weight-offset-without-weight",
        ArgumentError,
        "weight_offset=1.0 was given without a weight",
        lambda i: {"weight_offset": 1.0},
    ),
    BadInput(
        "weight-offset-nan",
        ArgumentError,
        "weight_offset must be finite",
        lambda i: {"weight": i.array((4,)), "weight_offset": float("nan")},
    ),
    BadInput(
        "weight-offset-not-a-number",
        ArgumentTypeError,
        "weight_offset must be a real number",
        lambda i: {"weight": i.array((4,)), "weight_offset": "1"},
    ),
    BadInput(
        "casting-unknown",
        ArgumentError,
        "casting must be one of exact, llama, t5; got 'gemma'",
        lambda i: {"weight": i.array((4,)), "casting": "gemma"},
        RMS,
    ),
    BadInput(
        "casting-not-a-name",
        ArgumentTypeError,
        "casting must be one of",
        lambda i: {"weight": i.array((4,)), "casting": 1},
        RMS,
    ),
    BadInput(
        "casting-with-offset",
        ArgumentError,
        "casting='llama'.*casting='exact'",
        lambda i: {"weight": i.array((4,)), "casting": "llama", "weight_offset": 1.0},
        RMS,
    ),
    BadInput(
        "casting-out-of-x-dtype",
        DtypeError,
        "out has dtype float16; it must be float32",
        lambda i: {
            "x": i.array(X_SHAPE, "float16"),
            "weight": i.array((4,), "float32"),
            "casting": "llama",
            "out": i.array(X_SHAPE, "float16"),
        },
        RMS,
    ),
    BadInput(
        "quantize-unknown",
        ArgumentError,
        "quantize must be None or one of int8, fp8_e4m3; got 'int4'",
        lambda i: {"quantize": "int4"},
        FORWARD_AND_FUSED,
    ),
    BadInput(
        "quantize-not-a-name",
        ArgumentTypeError,
        "quantize must be None or one of",
        lambda i: {"quantize": 8},
        FORWARD_AND_FUSED,
    ),
    BadInput(
        "quantize-scale-not-finite",
        ArgumentError,
        "quantize_scale must be finite and > 0",
        lambda i: {"quantize": "int8", "quantize_scale": float("inf")},
        FORWARD_AND_FUSED,
    ),
    BadInput(
        "quantize-scale-beyond-float32",
        ArgumentError,
        "quantize_scale must be finite and > 0 as a float32, got 1e\\+39",
        lambda i: {"quantize": "int8", "quantize_scale": 1e39},
    ),
    BadInput(
        "quantize-out-tuple-length",
        ArgumentError,
        r"out of a call with quantize= is q or a tuple \(q, scale\)",
        lambda i: {"quantize": "int8", "out": (None, None, None)},
        FORWARD_AND_FUSED,
    ),
    BadInput(
        "quantize-scale-zero",
        ArgumentError,
        "quantize_scale must be finite and > 0",
        lambda i: {"quantize": "fp8_e4m3", "quantize_scale": 0.0},
        FORWARD_AND_FUSED,
    ),
    BadInput(
        "quantize-scale-negative",
        ArgumentError,
        "quantize_scale must be finite and > 0",
        lambda i: {"quantize": "int8", "quantize_scale": -0.5},
    ),
    BadInput(
        "quantize-scale-not-a-number",
        ArgumentTypeError,
        "quantize_scale must be a real number",
        lambda i: {"quantize": "int8", "quantize_scale": "0.1"},
    ),
    BadInput(
        "quantize-scale-without-mode",
        ArgumentError,
        "quantize_scale=0.5 was given without quantize=",
        lambda i: {"quantize_scale": 0.5},
    ),
    BadInput(
        "quantize-out-of-y-dtype",
        DtypeError,
        "out has dtype {dtype}; it must be int8",
        lambda i: {"quantize": "int8", "out": i.array()},
        FORWARD_AND_FUSED,
    ),
    BadInput(
        "quantize-scale-out-wrong-shape",
        ShapeError,
        r"out \(scale\) has shape",
        lambda i: {"quantize": "int8", "out": (None, i.array((2, 3, 4), "float32"))},
    ),
    BadInput(
        "quantize-with-t5",
        ArgumentError,
        "quantize= with casting='t5' is not served",
        lambda i: {"weight": i.array((4,)), "casting": "t5", "quantize": "int8"},
        RMS,
    ),
    BadInput(
        "weight-not-array",
        ArgumentError,
        "weight must be an array",
        lambda i: {"weight": [1.0] * 4},
    ),
    BadInput(
        "weight-foreign",
        DeviceError,
        r"weight is a \S*ForeignArray but x is a",
        lambda i: {"weight": ForeignArray((4,))},
    ),
    BadInput(
        "bias-shape",
        ShapeError,
        r"bias has shape \(4,\).*\(3, 4\)",
        lambda i: {"normalized_shape": (3, 4), "bias": i.array((4,))},
        LN,
    ),
    BadInput(
        "bias-int",
        DtypeError,
        "bias has dtype int32",
        lambda i: {"bias": i.of(np.ones(4, np.int32))},
        LN,
    ),
    BadInput(
        "bias-foreign",
        DeviceError,
        r"bias is a \S*ForeignArray but x is a",
        lambda i: {"bias": ForeignArray((4,))},
        LN,
    ),
    # rms_norm has no bias: a bias keyword is Python's TypeError, and a bias passed where
    # layer_norm takes it (after weight) lands on eps.
    BadInput("bias-keyword", TypeError, "bias", lambda i: {"bias": i.array((4,))}, RMS),
    BadInput(
        "bias-in-eps-position",
        ArgumentError,
        "eps",
        lambda i: {"normalized_shape": 4, "weight": i.array((4,)), "eps": i.array((4,))},
        RMS,
    ),
    # eps
    BadInput("eps-negative", ArgumentError, "eps", lambda i: {"eps": -1e-5}),
    BadInput("eps-nan", ArgumentError, "eps", lambda i: {"eps": float("nan")}),
    BadInput("eps-inf", ArgumentError, "eps", lambda i: {"eps": float("inf")}),
    BadInput("eps-minus-inf", ArgumentError, "eps", lambda i: {"eps": -float("inf")}),
    BadInput("eps-none", ArgumentError, "eps", lambda i: {"eps": None}, LN),
    BadInput("eps-bool", ArgumentError, "eps", lambda i: {"eps": True}),
    BadInput("eps-list", ArgumentError, "eps", lambda i: {"eps": [1e-5]}),
    BadInput("eps-str", ArgumentError, "eps", lambda i: {"eps": "1e-5"}),
    BadInput("eps-too-large-for-a-float", ArgumentError, "eps", lambda i: {"eps": 10**400}),
    # return_stats
    BadInput("return_stats-int", ArgumentError, "return_stats", lambda i: {"return_stats": 1}),
    BadInput("return_stats-str", ArgumentError, "return_stats", lambda i: {"return_stats": "yes"}),
    # out
    BadInput(
        "out-shape", ShapeError, r"out has shape \(2, 3, 5\)", lambda i: {"out": i.array((2, 3, 5))}
    ),
    BadInput(
        "out-dtype",
        DtypeError,
        "out has dtype {other}; it must be {dtype}",
        lambda i: {"out": i.array(X_SHAPE, i.other)},
    ),
    BadInput("out-not-array", ArgumentError, "out must be an array", lambda i: {"out": [0.0]}),
    BadInput(
        "out-foreign",
        DeviceError,
        r"out is a \S*ForeignArray but x is a",
        lambda i: {"out": ForeignArray(X_SHAPE)},
    ),
    BadInput(
        "out-tuple-without-stats",
        ArgumentError,
        "return_stats=True",
        lambda i: {"out": (i.array(), None, None)},
        LN,
    ),
    BadInput(
        "out-tuple-of-two",
        ArgumentError,
        "tuple of 2",
        lambda i: {"out": (i.array(), None), "return_stats": True},
        LN,
    ),
    BadInput(
        "out-mean-dtype",
        DtypeError,
        "mean.*must be {stats}",
        lambda i: {
            "out": (None, i.array((2, 3, 1), i.other_stats), None),
            "return_stats": True,
        },
        LN,
    ),
    BadInput(
        "out-rstd-shape",
        ShapeError,
        r"rstd.*\(2, 3, 1\)",
        lambda i: {"out": (None, None, i.array((2, 3), i.stats)), "return_stats": True},
        LN,
    ),
    BadInput(
        "rms-out-tuple-without-stats",
        ArgumentError,
        "return_stats=True",
        lambda i: {"out": (i.array(), None)},
        RMS,
    ),
    BadInput(
        "rms-out-tuple-of-three",
        ArgumentError,
        "tuple of 3",
        lambda i: {"out": (i.array(), None, None), "return_stats": True},
        RMS,
    ),
    BadInput(
        "rms-out-rstd-dtype",
        DtypeError,
        "rstd.*must be {stats}",
        lambda i: {"out": (None, i.array((2, 3, 1), i.other_stats)), "return_stats": True},
        RMS,
    ),
    BadInput(
        "rms-out-rstd-shape",
        ShapeError,
        r"rstd.*\(2, 3, 1\)",
        lambda i: {"out": (None, i.array((2, 3), i.stats)), "return_stats": True},
        RMS,
    ),
    # the fused ops' residual, residual_out and return_residual
    BadInput(
        "residual-shape",
        ShapeError,
        r"residual has shape \(2, 3, 5\); it must be \(2, 3, 4\)",
        lambda i: {"residual": i.array((2, 3, 5))},
        FUSED,
    ),
    BadInput(
        "residual-broadcastable",
        ShapeError,
        r"residual has shape \(1, 3, 4\); it must be \(2, 3, 4\)",
        lambda i: {"residual": i.array((1, 3, 4))},
        FUSED,
    ),
    BadInput(
        "residual-dtype",
        DtypeError,
        "residual has dtype {other}; it must be {dtype}",
        lambda i: {"residual": i.array(X_SHAPE, i.other)},
        FUSED,
    ),
    BadInput(
        "residual-not-array",
        ArgumentError,
        "residual must be an array",
        lambda i: {"residual": [[1.0] * 4] * 3},
        FUSED,
    ),
    BadInput(
        "residual-foreign",
        DeviceError,
        r"residual is a \S*ForeignArray but x is a",
        lambda i: {"residual": ForeignArray(X_SHAPE)},
        FUSED,
    ),
    BadInput(
        "residual_out-post-norm",
        ArgumentError,
        "residual_out was given with return_residual=False",
        lambda i: {"residual_out": i.array(), "return_residual": False},
        FUSED,
    ),
    BadInput(
        "residual_out-tuple",
        ArgumentError,
        "residual_out must be one array like x",
        lambda i: {"residual_out": (i.array(),)},
        FUSED,
    ),
    BadInput(
        "residual_out-shape",
        ShapeError,
        r"residual_out has shape \(2, 3, 5\)",
        lambda i: {"residual_out": i.array((2, 3, 5))},
        FUSED,
    ),
    BadInput(
        "residual_out-dtype",
        DtypeError,
        "residual_out has dtype {other}; it must be {dtype}",
        lambda i: {"residual_out": i.array(X_SHAPE, i.other)},
        FUSED,
    ),
    BadInput(
        "residual_out-foreign",
        DeviceError,
        r"residual_out is a \S*ForeignArray but x is a",
        lambda i: {"residual_out": ForeignArray(X_SHAPE)},
        FUSED,
    ),
    BadInput(
        "return_residual-not-bool",
        ArgumentError,
        "return_residual must be True or False, got 1",
        lambda i: {"return_residual": 1},
        FUSED,
    ),
)

#: name -> bad input.
BAD_INPUTS: Final = {bad.name: bad for bad in _BAD}


def bad_inputs_of(op: str) -> list[BadInput]:
    """The table's entries for ``op`` (``"layer_norm"``, ``"rms_norm"``, ``"add_layer_norm"``,
    ``"add_rms_norm"``)."""
    return [bad for bad in _BAD if op in bad.ops]
