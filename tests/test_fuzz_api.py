"""Fuzzing the public API: every argument of the four public ops, valid and invalid at once.

Each drawn call is plain data (:class:`Forward`, :class:`Backward`) from which the arrays are
made; its repr reruns it. An independent model of the contract (:meth:`Forward.problems`,
:meth:`Backward.problems`) says which errors the call may raise. Every call then either

* raises a :class:`~normlab.NormlabError` subclass that the model expects (never a raw NumPy,
  torch or Numba exception), or
* when the model finds nothing wrong, returns results of the right kind (type, shape, dtype,
  ``out`` itself) whose values match the float64 reference within the conformance suite's
  tolerances, and leaves the caller's other arrays untouched.

``NORMLAB_FUZZ_EXAMPLES`` sets the number of calls per test (default 300; the figures in
docs/reliability.md come from larger runs). The examples are those of the hypothesis profile in
force (tests/conftest.py): the same on every run by default, new ones with
``NORMLAB_HYPOTHESIS_PROFILE=explore``. The bugs the fuzzer found each have a
test below; what stays open (torch's own numerics on CUDA) is an xfail there.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from decimal import Decimal
from fractions import Fraction
from typing import Any, Final

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, given, note, settings
from hypothesis import strategies as st

import normlab
from normlab import dispatch, reference, registry
from normlab.constants import MACHINE_EPS
from normlab.testing.tolerances import assert_close, conditioning

torch = pytest.importorskip("torch")

EXAMPLES: Final = int(os.environ.get("NORMLAB_FUZZ_EXAMPLES", "300"))
FUZZ: Final = settings(
    max_examples=EXAMPLES,
    deadline=None,
    phases=[phase for phase in Phase if phase is not Phase.explain],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

FLOATS: Final = ("float16", "bfloat16", "float32", "float64")
HALF: Final = frozenset({"float16", "bfloat16"})
NOT_FLOATS: Final = {
    "numpy": ("int32", "bool", "complex64", "longdouble", "object", "datetime64[s]"),
    "torch": ("int32", "bool", "complex64", "uint8"),
}
LAYOUTS: Final = {
    "numpy": (
        "c",
        "fortran",
        "transposed",
        "sliced",
        "reversed",
        "broadcast",
        "swapped",
        "readonly",
        "unaligned",
        "odd_strides",
    ),
    "torch": ("c", "fortran", "transposed", "sliced", "broadcast"),
}
DIMS: Final = (0, 1, 2, 3, 5, 8, 17)
#: Scales of the value kinds at the edges of a dtype's range: float64 rows whose squares
#: overflow (``huge``), float32/float64 rows whose squares underflow (``minute``).
RANGE_EDGES: Final = {
    "huge": {"float64": 1e300},
    "minute": {"float32": 1e-25, "float64": 1e-170},
}
MAX_ELEMENTS: Final = 2000
#: Names for ``backend=``: built-ins (cupy has no device here), unknown names, not names at all.
NAMED: Final = ("numpy", "numba", "torch")
BACKEND_NAMES: Final = (None, *NAMED, "cupy", "no_such_backend", 3)
PREFERENCES: Final = (None, "numpy", "numba", "torch", "cupy")


def _numpy_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _torch_dtype(name: str) -> Any:
    return getattr(torch, name)


def _stats_dtype(dtype: str) -> str:
    return "float64" if dtype == "float64" else "float32"


# --------------------------------------------------------------------------------------------
# Making arrays of a family, a dtype and a layout


def _values(shape: tuple[int, ...], kind: str, rng: np.random.Generator, dtype: str) -> np.ndarray:
    if kind == "spread" and dtype in FLOATS:  # rows scaled by 2^k, up to max/8 (float64: 2^400)
        top = min(math.log2(float(ml_dtypes.finfo(_numpy_dtype(dtype)).max)) - 3, 400.0)
        k = rng.uniform(-10.0, top, (*shape[:-1], 1)) if shape else rng.uniform(-10.0, top)
        return rng.standard_normal(shape) * np.exp2(k)
    if kind == "offset":
        return 100.0 + 0.01 * rng.standard_normal(shape)
    if kind == "integers":
        return rng.integers(-3, 4, shape).astype(np.float64)
    if kind == "tiny":
        return 1e-3 * rng.standard_normal(shape)
    if kind in RANGE_EDGES and dtype in FLOATS:  # rows whose squares overflow or underflow
        return rng.uniform(-1.0, 1.0, shape) * RANGE_EDGES[kind].get(dtype, 1.0)
    if kind == "constant":  # rows of one value each (with eps = 0: NaN, 0 / 0)
        row_values = rng.standard_normal((*shape[:-1], 1)) if shape else rng.standard_normal()
        return np.repeat(row_values, shape[-1], axis=-1) if shape else np.asarray(row_values)
    return rng.standard_normal(shape)


def _layout(a: np.ndarray, layout: str) -> np.ndarray:
    """``a`` (C order) re-laid out in NumPy memory; the values may change (broadcast)."""
    if a.ndim == 0:
        return a
    if layout == "fortran":
        return np.asfortranarray(a)
    if layout == "transposed" and a.ndim >= 2:
        return np.ascontiguousarray(np.swapaxes(a, -1, -2)).swapaxes(-1, -2)
    if layout == "sliced":
        big = np.zeros(tuple(2 * n for n in a.shape), a.dtype)
        view = tuple(slice(None, None, 2) for _ in a.shape)
        big[view] = a
        return big[view]
    if layout == "reversed":
        flip = tuple(slice(None, None, -1) for _ in a.shape)
        return np.ascontiguousarray(a[flip])[flip]
    if layout == "broadcast" and a.ndim >= 1 and a.shape[0] > 0:
        return np.broadcast_to(a[:1], a.shape)
    if layout == "swapped" and a.dtype.kind in "fciub" and a.dtype.itemsize > 1:
        return a.astype(a.dtype.newbyteorder())
    if layout == "readonly":
        a = a.copy()
        a.flags.writeable = False
        return a
    if layout == "unaligned" and a.dtype.kind != "O":
        memory = np.zeros(a.nbytes + 1, np.uint8)[1:].view(a.dtype).reshape(a.shape)
        memory[...] = a
        return memory
    if layout == "odd_strides" and a.dtype.kind != "O":
        padded = np.zeros(a.shape, dtype=[("v", a.dtype), ("pad", np.uint8)])
        padded["v"] = a
        return padded["v"]
    return a


def _torch_layout(t: Any, layout: str) -> Any:
    if layout == "fortran":
        order = tuple(range(t.ndim))[::-1]
        return t.permute(order).contiguous().permute(order)
    if layout == "transposed" and t.ndim >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if layout == "sliced":
        big = torch.zeros(tuple(2 * n for n in t.shape), dtype=t.dtype)
        view = tuple(slice(None, None, 2) for _ in t.shape)
        big[view] = t
        return big[view]
    if layout == "broadcast" and t.ndim >= 1 and t.shape[0] > 0:
        return t[:1].expand(t.shape)
    return t


def make(
    family: str,
    dtype: str,
    shape: tuple[int, ...],
    rng: np.random.Generator,
    layout: str = "c",
    kind: str = "normal",
    requires_grad: bool = False,
) -> Any:
    """An array of ``family`` with these values, dtype and layout."""
    values = np.asarray(_values(shape, kind, rng, dtype))
    if dtype not in FLOATS:  # integers, bool, complex, object, datetime: from whole numbers
        values = np.asarray(np.rint(values).astype(np.int64))
    if family == "numpy":
        return _layout(values.astype(_numpy_dtype(dtype)), layout)
    t = torch.from_numpy(values).to(_torch_dtype(dtype))
    t = _torch_layout(t, layout)
    return t.requires_grad_() if requires_grad else t


def as_float64(a: Any) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().to(torch.float64, copy=True).numpy()
    return np.asarray(a).astype(np.float64)


def _is_array(a: Any) -> bool:
    return isinstance(a, (np.ndarray, np.generic, torch.Tensor))


def _family(a: Any) -> str:
    return "torch" if isinstance(a, torch.Tensor) else "numpy"


def _dtype_name(a: Any) -> str:
    if isinstance(a, torch.Tensor):
        return str(a.dtype).removeprefix("torch.")
    return str(a.dtype.name)


def _writeable(a: Any) -> bool:
    return bool(a.flags.writeable) if isinstance(a, np.ndarray) else True


def _zero_stride(a: Any) -> bool:
    strides = a.stride() if isinstance(a, torch.Tensor) else a.strides
    return math.prod(a.shape) > 0 and any(
        s == 0 and n > 1 for s, n in zip(strides, a.shape, strict=True)
    )


def _requires_grad(a: Any) -> bool:
    return isinstance(a, torch.Tensor) and a.requires_grad


def _snapshot(a: Any) -> Any:
    """A copy of ``a``'s values, whatever its dtype (NumPy: its bytes in C order)."""
    return a.detach().clone() if isinstance(a, torch.Tensor) else np.asarray(a).tobytes()


def _unchanged(before: Any, a: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return bool(torch.equal(before, a.detach()))
    return bool(before == np.asarray(a).tobytes())


# --------------------------------------------------------------------------------------------
# The independent model of the contract: which errors a call may raise


def int_tuple(value: Any) -> tuple[int, ...] | None:
    """``value`` as a tuple of ints when it is an int or a tuple/list of ints, else None."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in items):
        return None
    return tuple(int(v) for v in items)


def axes_problems(
    shape: tuple[int, ...], normalized_shape: Any, axis: Any
) -> tuple[tuple[int, ...] | None, set[type[Exception]]]:
    """The sorted normalized axes (None when they cannot be told) and the errors to expect."""
    ndim = len(shape)
    problems: set[type[Exception]] = set()
    from_shape = None
    if normalized_shape is not None:
        ns = int_tuple(normalized_shape)
        if ns is None:
            problems.add(normlab.ArgumentError)
        elif not ns or len(ns) > ndim or shape[ndim - len(ns) :] != ns:
            problems.add(normlab.ShapeError)
        else:
            from_shape = tuple(range(ndim - len(ns), ndim))
    if axis is None:
        if problems:
            return None, problems
        return (from_shape or (ndim - 1,)), problems
    given_axes = int_tuple(axis)
    if given_axes is None:
        problems.add(normlab.ArgumentError)
        return None, problems
    if not given_axes or any(not -ndim <= a < ndim for a in given_axes):
        problems.add(normlab.ShapeError)
        return None, problems
    axes = tuple(sorted(a % ndim for a in given_axes))
    if len(set(axes)) != len(axes) or (normalized_shape is not None and axes != from_shape):
        problems.add(normlab.ShapeError)
    if problems:
        return None, problems
    return axes, problems


def param_problems(p: Any, x: Any, norm_shape: tuple[int, ...] | None) -> set[type[Exception]]:
    """Errors a weight or bias ``p`` may raise for ``x`` (x is a float array)."""
    if p is None:
        return set()
    if not _is_array(p):
        return {normlab.ArgumentError}
    if _family(p) != _family(x):
        return {normlab.DeviceError}
    problems: set[type[Exception]] = set()
    allowed = {_dtype_name(x)} | ({"float32"} if _dtype_name(x) in HALF else set())
    if isinstance(p, np.ma.MaskedArray) or _dtype_name(p) not in allowed:
        problems.add(normlab.DtypeError)
    if norm_shape is None or tuple(p.shape) != norm_shape:
        problems.add(normlab.ShapeError)
    return problems


def eps_problems(eps: Any, op: str) -> set[type[Exception]]:
    if eps is None and op == "rms_norm":
        return set()
    if isinstance(eps, (bool, np.bool_)) or not isinstance(
        eps, (int, float, np.floating, Fraction)
    ):
        return {normlab.ArgumentError}
    if isinstance(eps, int):  # valid when it is a float too (10**400 is not)
        return set() if 0 <= eps < 2**1024 else {normlab.ArgumentError}
    value = float(eps)
    return set() if math.isfinite(value) and value >= 0 else {normlab.ArgumentError}


def out_array_problems(o: Any, x: Any, shape: tuple[int, ...], dtype: str) -> set[type[Exception]]:
    if not _is_array(o):
        return {normlab.ArgumentError}
    if _family(o) != _family(x):
        return {normlab.DeviceError}
    problems: set[type[Exception]] = set()
    if _dtype_name(o) != dtype or isinstance(o, np.ma.MaskedArray):
        problems.add(normlab.DtypeError)
    if tuple(o.shape) != shape:
        problems.add(normlab.ShapeError)
    if not _writeable(o) or _zero_stride(o) or _requires_grad(o):
        problems.add(normlab.ArgumentError)
    return problems


def backend_problems(name: Any, op: str, x: Any, requires_grad: bool) -> set[type[Exception]]:
    """Errors of ``backend=name``, read from the backends' records (None: never an error)."""
    if name is None:
        return set()
    if not isinstance(name, str) or name not in {b.name for b in registry.list_backends()}:
        return {normlab.BackendError}
    b = registry.get(name)
    serves = (
        op in b.ops
        and _family(x) in b.families | b.explicit_families
        and "cpu" in b.devices
        and _dtype_name(x) in b.dtypes
        and (not requires_grad or dispatch.keeps_graph(b, op))
        and b.available
    )
    return set() if serves else {normlab.BackendError}


# --------------------------------------------------------------------------------------------
# Forward calls


@dataclass(frozen=True)
class Param:
    """How a weight or bias is made: ``kind`` and, for kinds that need one, a dtype."""

    kind: str  # ok, float32, wrong_shape, wrong_dtype, other_family, list, masked, strided,
    #            broadcast, swapped, requires_grad
    dtype: str = "float32"


@dataclass(frozen=True)
class Forward:
    """One call of ``layer_norm`` or ``rms_norm``, completely described by plain values."""

    op: str
    family: str
    dtype: str
    shape: tuple[int, ...]
    layout: str
    values: str
    normalized_shape: Any
    axis: Any
    weight: Param | None
    bias: Param | None
    eps: Any  # "default" for no eps argument
    return_stats: Any
    out: str | None
    out_stats: tuple[str | None, str | None]  # with out="tuple": mean and rstd entries
    backend: Any
    preference: str | None
    requires_grad: bool
    seed: int
    arrays: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def build(self) -> dict[str, Any]:
        """The call's arguments (arrays made from the seed)."""
        rng = np.random.default_rng(self.seed)
        if self.dtype == "not_an_array":
            x: Any = [[1.0, 2.0]]
        elif self.out == "overlap":
            x = self._overlapping_x(rng)
        else:
            x = make(
                self.family,
                self.dtype,
                self.shape,
                rng,
                self.layout,
                self.values,
                self.requires_grad,
            )
        kwargs: dict[str, Any] = {"x": x}
        if self.normalized_shape is not None:
            kwargs["normalized_shape"] = self.normalized_shape
        if self.axis is not None:
            kwargs["axis"] = self.axis
        norm_shape = self.norm_shape()
        for name in ("weight", "bias"):
            spec = getattr(self, name)
            if spec is not None:
                kwargs[name] = self._param(spec, norm_shape, rng)
        if self.eps != "default":
            kwargs["eps"] = self.eps
        kwargs["return_stats"] = self.return_stats
        if self.out is not None:
            kwargs["out"] = self._out(x, rng)
        if self._aliases_weight(norm_shape):
            # weight: the first elements of out's memory (out is C-contiguous here)
            kwargs["weight"] = (
                kwargs["out"].reshape(-1)[: math.prod(norm_shape)].reshape(norm_shape)
            )
        if self.backend is not None:
            kwargs["backend"] = self.backend
        return kwargs

    def _aliases_weight(self, norm_shape: tuple[int, ...] | None) -> bool:
        """Whether this call's weight is a view of its ``out`` (``out="aliases_weight"``)."""
        return (
            self.out == "aliases_weight"
            and norm_shape is not None
            and self.dtype in FLOATS
            and math.prod(self.shape) > 0
        )

    def norm_shape(self) -> tuple[int, ...] | None:
        if self.dtype == "not_an_array" or not self.shape:
            return None
        axes, _ = axes_problems(self.shape, self.normalized_shape, self.axis)
        return None if axes is None else tuple(self.shape[a] for a in axes)

    def _overlapping_x(self, rng: np.random.Generator) -> Any:
        """x whose memory the ``out`` of this call overlaps by all rows but one (see _out)."""
        bigger = (self.shape[0] + 1, *self.shape[1:])
        memory = make(self.family, self.dtype, bigger, rng, "c", self.values)
        self.arrays["memory"] = memory
        return memory[:-1]

    def _param(self, p: Param, norm_shape: tuple[int, ...] | None, rng: np.random.Generator) -> Any:
        shape = norm_shape if norm_shape is not None else self.shape[-1:]
        family, dtype = self.family, self.dtype if self.dtype in FLOATS else "float32"
        layout, grad = "c", False
        if p.kind == "float32":
            dtype = "float32"
        elif p.kind == "wrong_shape":
            shape = (*shape, 2)
        elif p.kind == "wrong_dtype":
            dtype = p.dtype
        elif p.kind == "other_family":
            family = "torch" if self.family == "numpy" else "numpy"
        elif p.kind == "list":
            return [1.0] * math.prod(shape)
        elif p.kind in ("strided", "broadcast", "swapped"):
            layout = {"strided": "sliced"}.get(p.kind, p.kind)
        elif p.kind == "requires_grad":
            grad = True
        a = make(family, dtype, shape, rng, layout, "normal", grad)
        if p.kind == "masked":
            return np.ma.masked_array(a, mask=np.zeros(a.shape, bool))
        return a

    def _out(self, x: Any, rng: np.random.Generator) -> Any:
        shape, family = self.shape, self.family
        dtype = self.dtype if self.dtype in FLOATS else "float32"
        if self.out == "x":
            return x
        if self.out == "overlap":
            return self.arrays["memory"][1:]
        if self.out == "list":
            return [0.0]
        if self.out == "tuple":
            y = make(family, dtype, shape, rng)
            axes = self._axes() or ()
            stats_shape = tuple(1 if a in axes else n for a, n in enumerate(shape))
            mean, rstd = (self._stats_out(kind, stats_shape, rng) for kind in self.out_stats)
            return (y, mean, rstd) if self.op == "layer_norm" else (y, rstd)
        if self.out == "other_family":
            family = "torch" if family == "numpy" else "numpy"
        if self.out == "wrong_shape":
            shape = (*shape, 1)
        if self.out == "wrong_dtype":
            dtype = "float64" if dtype != "float64" else "float32"
        layouts = ("fortran", "readonly", "broadcast", "sliced", "swapped")
        out = make(family, dtype, shape, rng, self.out if self.out in layouts else "c")
        if self.out == "masked" and family == "numpy":
            return np.ma.masked_array(out)
        return out

    def _stats_out(self, kind: str | None, shape: tuple[int, ...], rng: np.random.Generator) -> Any:
        if kind is None:
            return None
        dtype = _stats_dtype(self.dtype)
        if kind == "wrong_dtype":
            dtype = "float16"
        if kind == "wrong_shape":
            shape = (*shape, 1)
        return make(self.family, dtype, shape, rng)

    def _axes(self) -> tuple[int, ...] | None:
        return axes_problems(self.shape, self.normalized_shape, self.axis)[0]

    def problems(self, kwargs: dict[str, Any]) -> set[type[Exception]]:
        """Every error the model expects (empty: the call is valid)."""
        x = kwargs["x"]
        if not _is_array(x):
            return {normlab.ArgumentError}
        if self.dtype not in FLOATS:
            return {normlab.DtypeError}
        if not self.shape:
            return {normlab.ShapeError}
        axes, found = axes_problems(self.shape, self.normalized_shape, self.axis)
        norm_shape = None if axes is None else tuple(self.shape[a] for a in axes)
        for name in ("weight", "bias"):
            found |= param_problems(kwargs.get(name), x, norm_shape)
        found |= eps_problems(kwargs.get("eps", 1e-5 if self.op == "layer_norm" else None), self.op)
        if not isinstance(self.return_stats, bool):
            found.add(normlab.ArgumentError)
        grad = any(_requires_grad(kwargs.get(k)) for k in ("x", "weight", "bias"))
        found |= self._out_problems(kwargs.get("out"), x, axes)
        found |= backend_problems(self.backend, self.op, x, grad)
        return found

    def _out_problems(self, out: Any, x: Any, axes: tuple[int, ...] | None) -> set[type[Exception]]:
        if out is None:
            return set()
        found: set[type[Exception]] = set()
        if _requires_grad(x):
            found.add(normlab.ArgumentError)
        entries = 3 if self.op == "layer_norm" else 2
        if isinstance(out, tuple):
            if self.return_stats is not True or len(out) != entries:
                return found | {normlab.ArgumentError}
            y_out, stats = out[0], out[1:]
        else:
            y_out, stats = out, ()
        if y_out is not None:
            found |= out_array_problems(y_out, x, self.shape, self.dtype)
        stats_shape = tuple(1 if a in (axes or ()) else n for a, n in enumerate(self.shape))
        for s in stats:
            if s is not None:
                found |= out_array_problems(s, x, stats_shape, _stats_dtype(self.dtype))
        if axes is None and stats:
            found.add(normlab.ShapeError)
        if self.out == "overlap" and math.prod(self.shape) > 0 and self.shape[0] >= 2:
            found.add(normlab.ArgumentError)
        if self._aliases_weight(None if axes is None else self.norm_shape()):
            found.add(normlab.ArgumentError)  # out shares memory with weight
        return found


#: The arguments a drawn call may get wrong (at most two per call; most calls get none wrong).
ARGUMENTS: Final = (
    "x",
    "rank",
    "normalized_shape",
    "axis",
    "weight",
    "bias",
    "eps",
    "return_stats",
    "out",
    "backend",
)
VALID_EPS: Final = (
    "default",
    1e-5,
    0.0,
    0,
    1e-12,
    1,
    0.5,
    1e30,
    1e300,
    1e-30,
    1e-40,  # a float32 subnormal
    1e-80,  # 1/sqrt(eps) overflows float32
    5e-324,  # the smallest float64 subnormal
    -0.0,
    np.float32(1e-3),
    np.float64(1e-6),
    np.float16(1e-2),
    Fraction(1, 1000),
)
INVALID_EPS: Final = (
    -1e-5,
    float("nan"),
    float("inf"),
    -float("inf"),
    True,
    None,
    "1e-5",
    Decimal("1e-5"),
    1j,
    np.bool_(False),
    -(10**30),
    10**400,  # an int too large for a float
)
VALID_OUT: Final = (None, None, "fresh", "fortran", "sliced", "swapped", "x", "tuple")
INVALID_OUT: Final = (
    "wrong_shape",
    "wrong_dtype",
    "other_family",
    "readonly",
    "broadcast",
    "overlap",
    "aliases_weight",  # thrice: few calls have an out, a weight and elements
    "aliases_weight",
    "aliases_weight",
    "list",
    "masked",
    "bad_tuple",
)
VALID_PARAMS: Final = (None, None, "ok", "ok", "float32", "strided", "broadcast")
INVALID_PARAMS: Final = ("wrong_shape", "wrong_dtype", "other_family", "list")


def _shape(draw: st.DrawFn, rank_ok: bool) -> tuple[int, ...]:
    shape: list[int] = []
    for _ in range(draw(st.integers(1, 4)) if rank_ok else 0):
        most = MAX_ELEMENTS // max(1, math.prod(shape))
        shape.append(draw(st.sampled_from([d for d in DIMS if d <= most])))
    return tuple(shape)


def _signed(draw: st.DrawFn, axes: list[int], ndim: int) -> int | tuple[int, ...]:
    """``axes`` written with some negative, as an int when there is one and a coin says so."""
    signed = [a - ndim if draw(st.booleans()) else a for a in axes]
    return signed[0] if len(signed) == 1 and draw(st.booleans()) else tuple(signed)


def _normalized_shape(draw: st.DrawFn, shape: tuple[int, ...], valid: bool) -> Any:
    """None or trailing dims in any accepted form; or (not valid) ints that may not match, or
    values of the wrong type."""
    ndim = len(shape)
    if not valid:
        ints = st.integers(-6, 20)
        wrong = st.sampled_from(["4", 4.0, True, (2.0,), [None], {3}, (), [], np.array([3])])
        return draw(st.one_of(ints, st.lists(ints, max_size=4).map(tuple), wrong))
    if not ndim or draw(st.booleans()):
        return None
    k = draw(st.integers(1, ndim))
    dims = shape[ndim - k :]
    form = draw(st.sampled_from(["tuple", "list", "int", "size", "np"]))
    if form in ("int", "np") and k == 1:
        return dims[0] if form == "int" else np.int64(dims[0])
    return {"list": list(dims), "size": torch.Size(dims)}.get(form, dims)


def _axis(draw: st.DrawFn, shape: tuple[int, ...], normalized_shape: Any, valid: bool) -> Any:
    """None or axes that agree with ``normalized_shape``; or (not valid) any ints or values."""
    ndim = len(shape)
    if not valid:
        ints = st.integers(-6, 6)
        wrong = st.sampled_from([1.0, True, (), "0", [None]])
        return draw(st.one_of(ints, st.lists(ints, max_size=4).map(tuple), wrong))
    if not ndim or draw(st.booleans()):
        return None
    if normalized_shape is not None:
        k = len(normalized_shape) if isinstance(normalized_shape, (tuple, list)) else 1
        return _signed(draw, list(range(ndim - k, ndim)), ndim)
    chosen = draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True))
    return _signed(draw, chosen, ndim)


def _param(draw: st.DrawFn, family: str, dtype: str, valid: bool) -> Param | None:
    kinds = list(VALID_PARAMS if valid else INVALID_PARAMS)
    if family == "numpy":
        kinds.append("swapped" if valid else "masked")
    elif valid:
        kinds.append("requires_grad")
    kind = draw(st.sampled_from(kinds))
    if kind == "float32" and dtype not in HALF:
        kind = "ok"  # float32 parameters are valid for half x only
    if kind is None:
        return None
    wrong = [d for d in (*FLOATS, "int32") if d not in (dtype, "float32")]
    return Param(kind, draw(st.sampled_from(wrong)) if kind == "wrong_dtype" else "float32")


@st.composite
def forward_calls(draw: st.DrawFn) -> Forward:
    """A call with at most two arguments drawn from their invalid values, the rest valid."""
    wrong = draw(st.sets(st.sampled_from(ARGUMENTS), max_size=2))
    op = draw(st.sampled_from(["layer_norm", "layer_norm", "rms_norm"]))
    family = draw(st.sampled_from(["numpy", "torch"]))
    floats = [*FLOATS] if "x" not in wrong else [*NOT_FLOATS[family], "not_an_array"]
    dtype = draw(st.sampled_from(floats))
    shape = _shape(draw, "rank" not in wrong)
    out = draw(st.sampled_from(INVALID_OUT if "out" in wrong else VALID_OUT))
    layout = draw(st.sampled_from(LAYOUTS[family]))
    if (out == "overlap" and not shape) or dtype == "not_an_array":
        out = None
    stats_kinds = ["wrong_dtype", "wrong_shape"] if out == "bad_tuple" else [None, "ok"]
    normalized_shape = _normalized_shape(draw, shape, "normalized_shape" not in wrong)
    eps_values = (
        INVALID_EPS if "eps" in wrong else VALID_EPS + ((None,) if op == "rms_norm" else ())
    )
    kinds = ["normal", "offset", "integers", "tiny", "spread", "huge", "minute", "constant"]
    backend = draw(
        st.sampled_from(
            ["cupy", "no_such_backend", 3, ["numpy"]]
            if "backend" in wrong
            else [None, None, *NAMED]
        )
    )
    preference = draw(st.sampled_from(PREFERENCES))
    values = draw(st.sampled_from(kinds))
    if values in ("minute", "constant") and "eps" not in wrong:  # eps = 0 as often as not
        eps_values = (0.0,) * len(eps_values) + eps_values
    return Forward(
        op=op,
        family=family,
        dtype=dtype,
        shape=shape,
        layout=layout,
        values=values,
        normalized_shape=normalized_shape,
        axis=_axis(draw, shape, normalized_shape, "axis" not in wrong),
        weight=_param(draw, family, dtype, "weight" not in wrong),
        bias=_param(draw, family, dtype, "bias" not in wrong) if op == "layer_norm" else None,
        eps=draw(st.sampled_from(eps_values)),
        return_stats=draw(
            st.sampled_from([1, None, np.True_] if "return_stats" in wrong else [False, True])
        ),
        out="tuple" if out == "bad_tuple" else out,
        out_stats=(draw(st.sampled_from(stats_kinds)), draw(st.sampled_from(stats_kinds))),
        backend=backend,
        preference=preference,
        requires_grad=family == "torch" and dtype in FLOATS and draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


#: The input classes at the edges of the contract that the fuzzer must generate (each found a
#: silent wrong answer once); their counts are asserted, see test_the_fuzzer_generates_...
INPUT_CLASSES: Final = (
    "huge float64 rows",
    "minute rows, eps too small to hide underflow",
    "constant rows, eps = 0",
    "out sharing memory with weight",
)


def input_classes(f: Forward, kwargs: dict[str, Any]) -> list[str]:
    """The :data:`INPUT_CLASSES` the call ``f`` (built as ``kwargs``) belongs to."""
    if f.dtype not in FLOATS or not f.shape:
        return []
    eps = kwargs.get("eps", 1e-5 if f.op == "layer_norm" else MACHINE_EPS[f.dtype])
    try:
        eps_value = float(eps)
    except (TypeError, ValueError, OverflowError):
        return []
    classes = []
    if f.values == "huge" and f.dtype == "float64":
        classes.append(INPUT_CLASSES[0])
    hidden_below = {"float32": 1e-31, "float64": 1e-292}.get(f.dtype)
    if f.values == "minute" and hidden_below is not None and 0 <= eps_value < hidden_below:
        classes.append(INPUT_CLASSES[1])
    if f.values == "constant" and eps_value == 0:
        classes.append(INPUT_CLASSES[2])
    if f._aliases_weight(f.norm_shape()):
        classes.append(INPUT_CLASSES[3])
    return classes


def _call(f: Forward, kwargs: dict[str, Any]) -> Any:
    function = normlab.layer_norm if f.op == "layer_norm" else normlab.rms_norm
    if f.preference is None:
        return function(**kwargs)
    with normlab.use_backend(f.preference):
        return function(**kwargs)


def check_forward_result(f: Forward, kwargs: dict[str, Any], result: Any, x64: np.ndarray) -> None:
    """Kinds, ``out`` identity and values of a valid call's result (x64: x before the call)."""
    x, out = kwargs["x"], kwargs.get("out")
    y, *stats = result if f.return_stats else (result,)
    assert len(stats) == (0 if not f.return_stats else 2 if f.op == "layer_norm" else 1)
    y_out, stats_out = (out[0], out[1:]) if isinstance(out, tuple) else (out, (None,) * len(stats))
    assert y_out is None or y is y_out, "the result is not the out array"
    assert type(y) is type(x) and tuple(y.shape) == f.shape and _dtype_name(y) == f.dtype
    if any(_requires_grad(kwargs.get(k)) for k in ("x", "weight", "bias")):
        assert y.requires_grad, "the autograd graph was dropped"
    axes = f._axes()
    assert axes is not None
    stats_shape = tuple(1 if a in axes else n for a, n in enumerate(f.shape))
    for s, s_out in zip(stats, stats_out, strict=True):
        assert s_out is None or s is s_out, "a statistic is not its out array"
        assert type(s) is type(x) and tuple(s.shape) == stats_shape
        assert _dtype_name(s) == _stats_dtype(f.dtype)
    cols = math.prod(f.shape[a] for a in axes)
    if cols == 0 or math.prod(f.shape) == 0:  # empty: no kernel; statistics of no column NaN
        assert all(np.isnan(as_float64(s)).all() for s in stats)
        if _requires_grad(y):  # the graph is kept: zero gradients, as torch's own layer_norm
            y.sum().backward()
            for name in ("x", "weight", "bias"):
                a = kwargs.get(name)
                if _requires_grad(a) and a.is_leaf:  # x used as out= is no leaf: no .grad
                    assert a.grad is not None and not a.grad.any(), f"d{name} is not zero"
        return
    w, b = (None if kwargs.get(k) is None else as_float64(kwargs[k]) for k in ("weight", "bias"))
    eps = kwargs.get("eps", 1e-5 if f.op == "layer_norm" else None)
    with np.errstate(all="ignore"):
        if f.op == "layer_norm":
            want_y, want_mean, want_rstd = reference.layer_norm(
                x64, weight=w, bias=b, eps=float(eps), axis=axes
            )
            cond = conditioning(want_mean, want_rstd)
            z = (x64 - want_mean) * want_rstd
            want_stats = {"mean": want_mean, "rstd": want_rstd}
        else:
            eps = MACHINE_EPS[f.dtype] if eps is None else float(eps)
            want_y, want_rstd = reference.rms_norm(x64, weight=w, eps=eps, axis=axes)
            cond = np.ones_like(want_rstd)
            z = x64 * want_rstd
            want_stats = {"rstd": want_rstd}
    # Rows of zero variance with eps = 0 are 0/0: the contract leaves them undefined.
    defined = np.isfinite(want_rstd)
    in_y = np.broadcast_to(defined, f.shape)
    scale = _param_abs(w, axes, f.shape, 1.0) * (1.0 + np.abs(z)) + _param_abs(
        b, axes, f.shape, 0.0
    )
    repro = f"Rerun with: {f!r}"
    assert_close(
        as_float64(y)[in_y],
        want_y[in_y],
        f.dtype,
        np.broadcast_to(cond, f.shape)[in_y],
        what="y",
        cols=cols,
        scale=np.broadcast_to(scale, f.shape)[in_y],
        repro=repro,
    )
    for (name, want), got in zip(
        want_stats.items(), stats or [None] * len(want_stats), strict=True
    ):
        if got is None:  # return_stats=False
            break
        unit = 1.0 / want_rstd if name == "mean" else want_rstd
        with np.errstate(over="ignore"):  # beyond float32's range (rstd at a tiny eps): inf
            representable = want.astype(_stats_dtype(f.dtype)).astype(np.float64)
        assert_close(
            as_float64(got)[defined],
            representable[defined],
            f.dtype,
            cond[defined],
            what=name,
            cols=cols,
            scale=unit[defined],
            repro=repro,
        )


def _param_abs(
    p: np.ndarray | None, axes: tuple[int, ...], shape: tuple[int, ...], missing: float
) -> Any:
    if p is None:
        return missing
    dims = [1] * len(shape)
    for a in axes:
        dims[a] = shape[a]
    return np.abs(p).reshape(dims)


@FUZZ
@given(f=forward_calls())
def test_forward_calls_give_the_reference_or_a_normlab_error(
    f: Forward, no_preference: None
) -> None:
    kwargs = f.build()
    expected = f.problems(kwargs)
    note(f"expected errors: {sorted(e.__name__ for e in expected)}")
    for input_class in input_classes(f, kwargs):
        event(f"input class: {input_class}")
    arrays = {k: v for k, v in kwargs.items() if _is_array(v)} | f.arrays
    before = {k: _snapshot(v) for k, v in arrays.items()}
    x64 = as_float64(kwargs["x"]) if not expected else None
    try:
        result = _call(f, kwargs)
    except normlab.NormlabError as exc:
        event(f"{f.op}: raised {type(exc).__name__}")
        assert expected, f"a valid call raised {type(exc).__name__}: {exc}"
        assert isinstance(exc, tuple(expected)), (
            f"raised {type(exc).__name__} ({exc}); the model expects one of "
            f"{sorted(e.__name__ for e in expected)}"
        )
        for name, snapshot in before.items():  # a refused call modifies nothing
            assert _unchanged(snapshot, arrays[name]), f"{name} was modified by a refused call"
        return
    assert x64 is not None, f"accepted a call the model rejects: {sorted(map(str, expected))}"
    event(f"{f.op}: returned, checked against the reference")
    check_forward_result(f, kwargs, result, x64)
    in_place = kwargs.get("out") is kwargs["x"]
    for name in ("x", "weight", "bias"):
        if name in before and not (name == "x" and in_place):
            assert _unchanged(before[name], arrays[name]), f"{name} was modified"


def test_the_fuzzer_generates_every_input_class() -> None:
    """The strategy of the test above, at the same size, draws every input class of
    :data:`INPUT_CLASSES` (drawn and built only: no call is made, so this costs little)."""
    seen: dict[str, int] = dict.fromkeys(INPUT_CLASSES, 0)

    @FUZZ
    @given(f=forward_calls())
    def draw(f: Forward) -> None:
        for input_class in input_classes(f, f.build()):
            seen[input_class] += 1

    draw()
    assert all(seen.values()), f"input classes never drawn in {EXAMPLES} calls: {seen}"


# --------------------------------------------------------------------------------------------
# Backward calls


@dataclass(frozen=True)
class Backward:
    """One call of ``layer_norm_backward`` or ``rms_norm_backward``: a valid forward, then
    arguments of which some are broken on purpose (``broken``: argument name -> how)."""

    op: str
    family: str
    dtype: str
    shape: tuple[int, ...]
    axis: tuple[int, ...]
    weight: str | None  # None, "x" (x's dtype) or "float32"
    broken: tuple[tuple[str, str], ...]
    needs: Any
    backend: Any
    seed: int

    @property
    def forward_op(self) -> str:
        return self.op.removesuffix("_backward")

    @property
    def stats_names(self) -> tuple[str, ...]:
        return ("mean", "rstd") if self.op == "layer_norm_backward" else ("rstd",)

    def build(self) -> dict[str, Any]:
        """The backward's arguments: a valid forward's, then broken as ``broken`` says."""
        rng = np.random.default_rng(self.seed)
        x = make(self.family, self.dtype, self.shape, rng)
        norm_shape = tuple(self.shape[a] for a in self.axis)
        weight = None
        if self.weight is not None:
            wdtype = "float32" if self.weight == "float32" and self.dtype in HALF else self.dtype
            weight = make(self.family, wdtype, norm_shape, rng)
        forward = normlab.layer_norm if self.forward_op == "layer_norm" else normlab.rms_norm
        _, *stats = forward(x, weight=weight, axis=self.axis, return_stats=True)
        kwargs: dict[str, Any] = {
            "dy": make(self.family, self.dtype, self.shape, rng),
            "x": x,
            **dict(zip(self.stats_names, stats, strict=True)),
            "weight": weight,
            "axis": self.axis,
            "needs": self.needs,
        }
        for name, how in self.broken:
            kwargs[name] = self._break(kwargs[name], how, rng)
        if self.backend is not None:
            kwargs["backend"] = self.backend
        return kwargs

    def _break(self, a: Any, how: str, rng: np.random.Generator) -> Any:
        if how == "none":
            return None
        if how == "list":
            return [0.0]
        if how == "axis":
            return (len(self.shape),)
        if a is None:
            return make(self.family, self.dtype, self.shape[-1:], rng)
        dtype, shape, family = _dtype_name(a), tuple(a.shape), _family(a)
        if how == "dtype":
            dtype = "float16" if dtype != "float16" else "float64"
        elif how == "shape":
            shape = (*shape, 2)
        elif how == "family":
            family = "torch" if family == "numpy" else "numpy"
        elif how == "strided":  # the same values, every axis strided
            return _torch_layout(a, "sliced") if family == "torch" else _layout(a, "sliced")
        return make(family, dtype, shape, rng)

    def problems(self, kwargs: dict[str, Any]) -> set[type[Exception]]:
        x = kwargs["x"]
        found: set[type[Exception]] = set()
        known = ("x", "weight", "bias") if self.op == "layer_norm_backward" else ("x", "weight")
        needs = kwargs["needs"]
        if (
            isinstance(needs, str)
            or not isinstance(needs, (tuple, list, set, frozenset))
            or any(n not in known for n in needs)
        ):
            found.add(normlab.ArgumentError)
        axes, axis_found = axes_problems(self.shape, None, kwargs["axis"])
        found |= axis_found
        stats_shape = tuple(1 if a in (axes or ()) else n for a, n in enumerate(self.shape))
        for name in ("dy", "mean", "rstd"):
            if name not in kwargs:
                continue
            shape = self.shape if name == "dy" else stats_shape
            dtype = self.dtype if name == "dy" else _stats_dtype(self.dtype)
            a = kwargs[name]
            if not _is_array(a):
                found.add(normlab.ArgumentError)
            elif _family(a) != _family(x):
                found.add(normlab.DeviceError)
            else:
                if _dtype_name(a) != dtype:
                    found.add(normlab.DtypeError)
                if tuple(a.shape) != shape or (axes is None and name != "dy"):
                    found.add(normlab.ShapeError)
        norm_shape = None if axes is None else tuple(self.shape[a] for a in axes)
        found |= param_problems(kwargs["weight"], x, norm_shape)
        found |= backend_problems(self.backend, self.op, x, False)
        return found


@st.composite
def backward_calls(draw: st.DrawFn) -> Backward:
    op = draw(st.sampled_from(["layer_norm_backward", "rms_norm_backward"]))
    family = draw(st.sampled_from(["numpy", "torch"]))
    shape = draw(st.lists(st.sampled_from(DIMS[:6]), min_size=1, max_size=3).map(tuple))
    ndim = len(shape)
    axis = tuple(
        sorted(draw(st.lists(st.integers(0, ndim - 1), min_size=1, max_size=ndim, unique=True)))
    )
    names = ["dy", "weight", "rstd", "axis"] + (["mean"] if op == "layer_norm_backward" else [])
    hows = ["dtype", "shape", "family", "strided", "none", "list"]
    broken = draw(
        st.lists(
            st.tuples(st.sampled_from(names), st.sampled_from(hows)),
            max_size=2,
            unique_by=lambda t: t[0],
        )
    )
    broken = [(n, "axis" if n == "axis" else h) for n, h in broken]
    known = ["x", "weight", "bias"] if op == "layer_norm_backward" else ["x", "weight"]
    needs = draw(
        st.one_of(
            st.lists(st.sampled_from(known), unique=True).map(tuple),
            st.sampled_from([("x", "gamma"), "x", None, ["x"], {"weight"}]),
        )
    )
    return Backward(
        op=op,
        family=family,
        dtype=draw(st.sampled_from(FLOATS)),
        shape=shape,
        axis=axis,
        weight=draw(st.sampled_from([None, "x", "float32"])),
        broken=tuple(broken),
        needs=needs,
        backend=draw(st.sampled_from(BACKEND_NAMES)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def expected_gradients(
    b: Backward, kwargs: dict[str, Any]
) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The float64 gradients from exact statistics: ``(conditioning, {name: (want, scale)})``;
    ``scale`` is the size of the terms each element sums (what its rounding error grows with).
    """
    x64, dy64 = as_float64(kwargs["x"]), as_float64(kwargs["dy"])
    norm_shape = tuple(x64.shape[a] for a in b.axis)
    if x64.size == 0:  # no element: dx empty, sums over no row zero
        zeros = np.zeros(norm_shape)
        return np.ones(()), {"x": (x64, x64), "weight": (zeros, zeros), "bias": (zeros, zeros)}
    with np.errstate(all="ignore"):
        if b.op == "layer_norm_backward":
            _, mean, rstd = reference.layer_norm(x64, axis=b.axis)
            cond = conditioning(mean, rstd)
        else:
            _, rstd = reference.rms_norm(x64, eps=MACHINE_EPS[b.dtype], axis=b.axis)
            mean, cond = np.zeros_like(rstd), np.ones_like(rstd)
        xhat = (x64 - mean) * rstd
    dims = [1] * x64.ndim
    for a in b.axis:
        dims[a] = x64.shape[a]
    w = kwargs["weight"]
    g = dy64 * (1.0 if w is None else as_float64(w).reshape(dims))
    batch = tuple(a for a in range(x64.ndim) if a not in b.axis)

    def row_mean(a: np.ndarray) -> np.ndarray:
        return a.mean(axis=b.axis, keepdims=True)

    def column_sum(a: np.ndarray) -> np.ndarray:
        return a.sum(axis=batch).reshape(norm_shape)

    centre = row_mean(g) if b.op == "layer_norm_backward" else 0.0
    dx = rstd * (g - centre - xhat * row_mean(g * xhat))
    dx_scale = rstd * (np.abs(g) + row_mean(np.abs(g)) + np.abs(xhat) * row_mean(np.abs(g * xhat)))
    return cond, {
        "x": (dx, dx_scale),
        "weight": (column_sum(dy64 * xhat), column_sum(np.abs(dy64) * (1.0 + np.abs(xhat)))),
        "bias": (column_sum(dy64), column_sum(np.abs(dy64))),
    }


def check_backward_result(b: Backward, kwargs: dict[str, Any], result: tuple[Any, ...]) -> None:
    """Kinds of the gradients (None where not asked for) and their values."""
    known = ("x", "weight", "bias") if b.op == "layer_norm_backward" else ("x", "weight")
    assert len(result) == len(known)
    x = kwargs["x"]
    norm_shape = tuple(b.shape[a] for a in b.axis)
    param_dtype = _dtype_name(x if kwargs["weight"] is None else kwargs["weight"])
    cond, wanted = expected_gradients(b, kwargs)
    rows = math.prod(b.shape) // max(1, math.prod(norm_shape))
    repro = f"Rerun with: {b!r}"
    for name, got in zip(known, result, strict=True):
        if name not in kwargs["needs"]:
            assert got is None, f"d{name} was not asked for"
            continue
        want, scale = wanted[name]
        shape, dtype = (b.shape, b.dtype) if name == "x" else (norm_shape, param_dtype)
        assert type(got) is type(x) and tuple(got.shape) == shape and _dtype_name(got) == dtype
        if name == "x":
            assert_close(
                as_float64(got),
                want,
                b.dtype,
                cond,
                what="y",
                cols=max(math.prod(norm_shape), 1),
                scale=scale,
                repro=repro,
            )
        else:  # a column sum over rows: its error grows with the number of rows
            assert_close(
                as_float64(got),
                want,
                dtype,
                float(np.max(cond, initial=1.0)),
                what="y",
                cols=max(rows, 1),
                scale=scale,
                repro=repro,
            )


@FUZZ
@given(b=backward_calls())
def test_backward_calls_give_the_reference_or_a_normlab_error(b: Backward) -> None:
    kwargs = b.build()
    expected = b.problems(kwargs)
    note(f"expected errors: {sorted(e.__name__ for e in expected)}")
    function = (
        normlab.layer_norm_backward
        if b.op == "layer_norm_backward"
        else (normlab.rms_norm_backward)
    )
    try:
        result = function(**kwargs)
    except normlab.NormlabError as exc:
        event(f"{b.op}: raised {type(exc).__name__}")
        assert expected, f"a valid call raised {type(exc).__name__}: {exc}"
        assert isinstance(exc, tuple(expected)), (
            f"raised {type(exc).__name__} ({exc}); the model expects one of "
            f"{sorted(e.__name__ for e in expected)}"
        )
        return
    assert not expected, f"accepted a call the model rejects ({sorted(map(str, expected))})"
    event(f"{b.op}: returned, checked against the reference")
    check_backward_result(b, kwargs, result)


# --------------------------------------------------------------------------------------------
# The model itself: it must reject what the contract rejects (else the fuzz tests prove little)


@pytest.mark.parametrize(
    ("normalized_shape", "axis", "error"),
    [
        ((4,), None, None),
        ((3, 4), (-2, -1), None),
        ((5,), None, normlab.ShapeError),
        ((), None, normlab.ShapeError),
        (4.0, None, normlab.ArgumentError),
        (None, (1, 1), normlab.ShapeError),
        (None, 3, normlab.ShapeError),
        ((4,), (0,), normlab.ShapeError),
        (None, True, normlab.ArgumentError),
    ],
)
def test_the_model_of_axes(normalized_shape: Any, axis: Any, error: Any) -> None:
    _, problems = axes_problems((2, 3, 4), normalized_shape, axis)
    assert problems == ({error} if error else set())


# --------------------------------------------------------------------------------------------
# Bugs the fuzzer found: fixed ones, then what stays open


def test_eps_too_large_for_a_float() -> None:
    with pytest.raises(normlab.ArgumentError, match="eps"):
        normlab.layer_norm(np.ones((2, 3), np.float32), eps=10**400)


def test_backend_names_that_are_not_strings() -> None:
    x = np.ones((2, 3), np.float32)
    for name in (["numpy"], {"numpy": 1}, 3):
        with pytest.raises(normlab.BackendError, match="unknown backend"):
            normlab.layer_norm(x, backend=name)
        assert "unknown backend" in normlab.explain(x, backend=name)


#: Where the torch backend keeps torch's own numerics: CUDA, on which no check of the statistics
#: runs (it would wait for the device). Skipped without a CUDA device; strict where torch's
#: float32 arithmetic must fail (squares past 3.4e38), not where it was never measured.
NO_CUDA: Final = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
ON_CUDA: Final = pytest.param(
    "cuda", marks=[NO_CUDA, pytest.mark.xfail(strict=True, reason="torch's numerics on CUDA")]
)
ON_CUDA_UNMEASURED: Final = pytest.param(
    "cuda",
    marks=[NO_CUDA, pytest.mark.xfail(strict=False, reason="torch's numerics, not measured")],
)


@pytest.mark.parametrize("grad_on", ["x", "weight", "bias"])
@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (2, 0, 4)])
def test_empty_input_requiring_grad_keeps_the_graph(grad_on: str, shape: tuple[int, ...]) -> None:
    """As torch's own layer_norm: y is in the graph; dx is empty, dweight and dbias are zero."""
    x = torch.zeros(shape, requires_grad=grad_on == "x")
    weight, bias = (torch.ones(shape[-1:], requires_grad=grad_on == n) for n in ("weight", "bias"))
    y = normlab.layer_norm(x, weight=weight, bias=bias)
    assert y.requires_grad and y.shape == x.shape
    y.sum().backward()
    leaf = {"x": x, "weight": weight, "bias": bias}[grad_on]
    assert leaf.grad is not None and leaf.grad.shape == leaf.shape and not leaf.grad.any()


def test_empty_input_requiring_grad_with_out() -> None:
    """A weight that requires grad allows ``out=``: out is returned, in the graph."""
    weight = torch.ones(4, requires_grad=True)
    out = torch.empty(0, 4)
    y = normlab.layer_norm(torch.zeros(0, 4), weight=weight, out=out)
    assert y is out and y.requires_grad
    y.sum().backward()
    assert weight.grad is not None and not weight.grad.any()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_torch_half_x_with_a_lone_float32_bias_backpropagates(dtype: str) -> None:
    """torch's own CPU backward raises on half x with a float32 bias and no weight ("expected
    scalar type Half but found Float"); the torch backend passes a weight of ones."""
    x = torch.randn(3, 4, dtype=getattr(torch, dtype), requires_grad=True)
    bias = torch.randn(4, requires_grad=True)
    y = normlab.layer_norm(x, bias=bias, backend="torch")
    y.float().sum().backward()
    assert bias.grad is not None and x.grad is not None and x.grad.dtype == x.dtype
    np.testing.assert_array_equal(bias.grad.numpy(), 3.0)


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_out_with_a_parameter_requiring_grad_keeps_the_graph(backend: str) -> None:
    """``out=`` with a bias that requires grad: the core copies the result into out, in the
    graph (numba once refused the call with a BackendError)."""
    if not registry.get(backend).available:
        pytest.skip(f"backend {backend!r} is unavailable here")
    x = torch.randn(3, 4, dtype=torch.float16)
    bias = torch.randn(4, requires_grad=True)
    out = torch.empty(3, 4, dtype=torch.float16)
    y = normlab.layer_norm(x, bias=bias, out=out, backend=backend)
    assert y is out and y.requires_grad
    y.float().sum().backward()
    assert bias.grad is not None
    np.testing.assert_array_equal(bias.grad.numpy(), 3.0)


@pytest.mark.parametrize("backend", ["numpy", "numba", "torch"])
@pytest.mark.parametrize("eps", [1e-80, 1e-40])
def test_constant_rows_with_a_tiny_positive_eps_give_bias(backend: str, eps: float) -> None:
    """eps > 0, so a constant row gives exactly bias, and rstd = 1/sqrt(eps) rounded to float32
    (inf at 1e-80); in float32, eps rounds to 0 or a subnormal, and 1/sqrt(1e-80) overflows."""
    x: Any = np.full((2, 4), 3.0, np.float32)
    bias = np.arange(4, dtype=np.float32)
    if backend == "torch":
        x, bias = torch.from_numpy(x), torch.from_numpy(bias)
    y, mean, rstd = normlab.layer_norm(x, bias=bias, eps=eps, backend=backend, return_stats=True)
    np.testing.assert_array_equal(np.asarray(y), np.tile(np.arange(4.0), (2, 1)))
    np.testing.assert_array_equal(np.asarray(mean), 3.0)
    with np.errstate(over="ignore"):  # 1e40 is inf in float32
        np.testing.assert_array_equal(np.asarray(rstd), np.float32(1 / math.sqrt(eps)))


@pytest.mark.parametrize("backend", ["numpy", "numba", "torch"])
def test_zero_rows_with_a_tiny_positive_eps_give_zero_in_rms_norm(backend: str) -> None:
    x: Any = np.zeros((2, 4), np.float32)
    if backend == "torch":
        x = torch.from_numpy(x)
    y, rstd = normlab.rms_norm(x, eps=1e-80, backend=backend, return_stats=True)
    np.testing.assert_array_equal(np.asarray(y), 0.0)
    np.testing.assert_array_equal(np.asarray(rstd), np.inf)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA_UNMEASURED])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("eps", [1e-5, 1e-9, 1e-12, 1e-30, 1e-80])
def test_torch_half_constant_rows_give_bias(device: str, dtype: str, eps: float) -> None:
    """A constant row gives exactly ``bias`` when eps > 0. torch's CPU kernel for half x misses
    it by its float32 rounding of ``mean * rstd``: -1.6e-5 at eps=1e-5 on rows of 3.1, -0.125 at
    1e-12, -inf at 1e-30; the backend recomputes those (eps-dominated) rows."""
    x = torch.full((2, 8), 3.1, dtype=getattr(torch, dtype), device=device)
    bias = torch.arange(8.0, device=device)
    y = normlab.layer_norm(x, weight=torch.full((8,), 2.0, device=device), bias=bias, eps=eps)
    assert torch.equal(y.float(), bias.expand(2, 8)), y[0, 0]


def test_numpy_backward_is_quiet_about_overflow_as_the_forward_is() -> None:
    """The forward lets NaN and Inf propagate quietly; so does the backward (no RuntimeWarning,
    which would be an exception under ``-W error``)."""
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    _, mean, rstd = normlab.layer_norm(x, return_stats=True, backend="numpy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        huge = np.tile(np.array([3e38, -3e38], np.float32), (2, 2))
        normlab.layer_norm(huge, backend="numpy")
        dx, _, _ = normlab.layer_norm_backward(
            np.full_like(x, 3e38), x, mean, rstd, backend="numpy"
        )
    assert not np.isfinite(dx).all()  # the overflow happened, quietly


@pytest.mark.parametrize("backend", ["numpy", "numba", "torch"])
@pytest.mark.parametrize("spread", [1e20, 1e38, 3e38])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_float32_rows_of_huge_spread(backend: str, spread: float, op: str) -> None:
    """Rows of +-spread normalize to +-1 (the float64 reference), whatever the other rows; in
    float32 the squares (or the differences, or their sums) overflow."""
    x: Any = np.tile(np.array([spread, -spread], np.float32), (3, 2))
    x[1] = np.arange(4, dtype=np.float32)  # an ordinary row between two huge ones
    if backend == "torch":
        x = torch.from_numpy(x)
    y, *stats = getattr(normlab, op)(x, backend=backend, return_stats=True)
    want, *want_stats = getattr(reference, op)(x)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5)
    for got, expected in zip(stats, want_stats, strict=True):
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5)


def test_torch_rms_norm_without_the_private_fused_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU row check reads rstd from ``torch._fused_rms_norm`` (private, present in the
    pinned torch); a torch without it gets ``F.rms_norm``'s results, unchecked."""
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32))
    monkeypatch.delattr(torch, "_fused_rms_norm")
    y, rstd = normlab.rms_norm(x, backend="torch", return_stats=True)
    want, want_rstd = reference.rms_norm(x)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5)
    np.testing.assert_allclose(rstd.numpy(), want_rstd, rtol=1e-5)


@pytest.mark.parametrize("backend", ["numpy", "numba", "torch"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_float64_rows_of_huge_spread(backend: str, op: str) -> None:
    """float64 squares overflow past 1.3e154: such rows are recomputed scaled by a power of two."""
    x: Any = np.array([[1e300, -1e300, 1e300, -1e300], [1.0, 2.0, 3.0, 4.0]])
    if backend == "torch":
        x = torch.from_numpy(x)
    y, *stats = getattr(normlab, op)(x, backend=backend, return_stats=True)
    np.testing.assert_allclose(np.asarray(y)[0], [1.0, -1.0, 1.0, -1.0], rtol=1e-12)
    np.testing.assert_allclose(np.asarray(stats[-1])[0], 1e-300, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(y)[1], getattr(reference, op)(x[1:])[0][0], rtol=1e-12)


@pytest.mark.parametrize("layout", ["c", "fortran"])
def test_numpy_in_place_rows_of_huge_spread(layout: str) -> None:
    """In place (out=x), a row recomputed after the pass still reads x, not the result."""
    x = np.tile(np.array([3e38, -3e38], np.float32), (3, 2))
    x[1] = [1.0, 2.0, 3.0, 5.0]
    x = np.asfortranarray(x) if layout == "fortran" else x
    want = reference.layer_norm(x)[0]
    y = normlab.layer_norm(x, backend="numpy", out=x)
    assert y is x
    np.testing.assert_allclose(x, want, rtol=1e-5)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_torch_rows_recomputed_keep_their_gradients(device: str, op: str) -> None:
    """Rows that the torch backend recomputes (here spread over 1e20, beside ordinary rows) get
    the gradients of the float64 formula, for x, weight and bias; the other rows keep torch's."""
    rng = np.random.default_rng(1)
    x64 = rng.standard_normal((4, 6))
    x64[1] = np.tile([1e20, -1e20, 3e19], 2)
    dy = torch.from_numpy(rng.standard_normal((4, 6)))
    leaves = [torch.from_numpy(a).to(device) for a in (x64, rng.random(6), rng.random(6))]
    wide = [t.clone().requires_grad_() for t in leaves]
    narrow = [t.float().requires_grad_() for t in leaves]
    names = ("x", "weight", "bias") if op == "layer_norm" else ("x", "weight")
    y = getattr(normlab, op)(**dict(zip(names, narrow, strict=False)), eps=1e-5)
    (y.double() * dy.to(device)).sum().backward()
    # the float64 reference: torch's own, in whose float64 squares 1e20 does not overflow
    want = getattr(torch.nn.functional, op)(wide[0], (6,), *wide[1 : len(names)], eps=1e-5)
    (want * dy.to(device)).sum().backward()
    np.testing.assert_allclose(y.detach().double().cpu(), want.detach().cpu(), atol=1e-5)
    for got, ref in zip(narrow[: len(names)], wide[: len(names)], strict=True):
        assert got.grad is not None and ref.grad is not None
        np.testing.assert_allclose(got.grad.double().cpu(), ref.grad.cpu(), rtol=1e-4, atol=1e-5)
