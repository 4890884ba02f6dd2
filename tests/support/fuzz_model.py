"""The fuzzers' model of the public API: a call as plain data, and what the contract says of it.

A drawn call is plain data (:class:`Forward` for ``layer_norm``/``rms_norm``, :class:`Backward`
for their backward ops, :class:`Fused` for ``add_layer_norm``/``add_rms_norm``) from which the
arrays are made (:meth:`Forward.build`); its repr reruns it. The model, written from the
contract and not from the implementation, says which :class:`~normlab.NormlabError` subclasses
the call may raise (:meth:`Forward.problems`, :meth:`Backward.problems`, :meth:`Fused.problems`;
empty: the call is valid) and what a valid call returns (:func:`check_forward_result`,
:func:`check_backward_result`, :func:`check_fused_result`: kinds, ``out`` identity, values
against the float64 reference within the conformance suite's tolerances, a fused op's ``h``
bitwise the unfused add). The hypothesis
strategies that draw calls are in fuzz_strategies.py, the tests in tests/core/test_fuzz_api.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Final

import numpy as np
import torch

import normlab
from normlab import dispatch, reference, registry
from normlab.constants import MACHINE_EPS, stats_dtype_for
from normlab.testing.conversions import (
    LAYOUTS,
    arrange,
    as_float64,
    conversion,
    dtype_name,
    finfo,
    numpy_dtype,
    numpy_layout,
    to_numpy,
)
from normlab.testing.tolerances import assert_close, conditioning

FLOATS: Final = ("float16", "bfloat16", "float32", "float64")
HALF: Final = frozenset({"float16", "bfloat16"})
#: Scales of the value kinds at the edges of a dtype's range: float64 rows whose squares
#: overflow (``huge``), float32/float64 rows whose squares underflow (``minute``).
RANGE_EDGES: Final = {
    "huge": {"float64": 1e300},
    "minute": {"float32": 1e-25, "float64": 1e-170},
}


#: Where a dtype's spacing becomes 2 (``2**(nmant + 1)``): values ``spaced`` are a few
#: spacings above it, so that a residual below half a spacing rounds away in ``h`` (the fused
#: ops' ``below_spacing`` residual, docs/fused.md "Why h is rounded first").
SPACING_TWO_AT: Final = {
    "float16": 2.0**11,
    "bfloat16": 2.0**8,
    "float32": 2.0**24,
    "float64": 2.0**53,
}


def stats_dtype(dtype: str) -> str:
    """The statistics' dtype for x of ``dtype``."""
    return "float64" if dtype == "float64" else "float32"


# --------------------------------------------------------------------------------------------
# Making arrays of a family, a dtype and a layout


def _values(shape: tuple[int, ...], kind: str, rng: np.random.Generator, dtype: str) -> np.ndarray:
    if kind == "spread" and dtype in FLOATS:  # rows scaled by 2^k, up to max/8 (float64: 2^400)
        top = min(math.log2(float(finfo(dtype).max)) - 3, 400.0)
        k = rng.uniform(-10.0, top, (*shape[:-1], 1)) if shape else rng.uniform(-10.0, top)
        return rng.standard_normal(shape) * np.exp2(k)
    if kind == "offset":
        return 100.0 + 0.01 * rng.standard_normal(shape)
    if kind == "spaced" and dtype in FLOATS:  # exact: C + 0, 2, 4 or 6 where the spacing is 2
        return SPACING_TWO_AT[dtype] + 2.0 * rng.integers(0, 4, shape)
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


def make(
    family: str,
    dtype: str,
    shape: tuple[int, ...],
    rng: np.random.Generator,
    layout: str = "c",
    kind: str = "normal",
    requires_grad: bool = False,
) -> Any:
    """An array of ``family`` with these values, dtype and layout (a NumPy-only layout, say
    ``readonly``, gives a torch tensor in C order)."""
    return laid_out(family, dtype, _values(shape, kind, rng, dtype), layout, requires_grad)


def laid_out(
    family: str, dtype: str, values: Any, layout: str = "c", requires_grad: bool = False
) -> Any:
    """``values`` (float64) as an array of ``family``, ``dtype`` and ``layout`` (see
    :func:`make`)."""
    values = np.asarray(values)
    if dtype not in FLOATS:  # integers, bool, complex, object, datetime: from whole numbers
        values = np.asarray(np.rint(values).astype(np.int64))
    typed = values.astype(numpy_dtype(dtype))
    if family == "numpy":
        return numpy_layout(typed, layout)
    t = arrange(typed, layout if layout in LAYOUTS else "c", conversion("torch"))
    return t.requires_grad_() if requires_grad else t


def is_array(a: Any) -> bool:
    return isinstance(a, (np.ndarray, np.generic, torch.Tensor))


def family_of(a: Any) -> str:
    return "torch" if isinstance(a, torch.Tensor) else "numpy"


def writeable(a: Any) -> bool:
    return bool(a.flags.writeable) if isinstance(a, np.ndarray) else True


def zero_stride(a: Any) -> bool:
    strides = a.stride() if isinstance(a, torch.Tensor) else a.strides
    return math.prod(a.shape) > 0 and any(
        s == 0 and n > 1 for s, n in zip(strides, a.shape, strict=True)
    )


def tracks_grad(a: Any) -> bool:
    return isinstance(a, torch.Tensor) and a.requires_grad


def snapshot(a: Any) -> Any:
    """A copy of ``a``'s values, whatever its dtype (NumPy: its bytes in C order)."""
    return a.detach().clone() if isinstance(a, torch.Tensor) else np.asarray(a).tobytes()


def unchanged(before: Any, a: Any) -> bool:
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


def companion_problems(
    a: Any, x: Any, shape: tuple[int, ...] | None, dtypes: set[str]
) -> set[type[Exception]]:
    """Errors an input array ``a`` beside ``x`` (x is a float array) may raise: x's family, one
    of ``dtypes``, ``shape`` (None: a shape that cannot be told, always wrong)."""
    if not is_array(a):
        return {normlab.ArgumentError}
    if family_of(a) != family_of(x):
        return {normlab.DeviceError}
    problems: set[type[Exception]] = set()
    if isinstance(a, np.ma.MaskedArray) or dtype_name(a) not in dtypes:
        problems.add(normlab.DtypeError)
    if shape is None or tuple(a.shape) != shape:
        problems.add(normlab.ShapeError)
    return problems


def param_problems(p: Any, x: Any, norm_shape: tuple[int, ...] | None) -> set[type[Exception]]:
    """Errors a weight or bias ``p`` may raise for ``x`` (x is a float array)."""
    if p is None:
        return set()
    allowed = {dtype_name(x)} | ({"float32"} if dtype_name(x) in HALF else set())
    return companion_problems(p, x, norm_shape, allowed)


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
    if not is_array(o):
        return {normlab.ArgumentError}
    if family_of(o) != family_of(x):
        return {normlab.DeviceError}
    problems: set[type[Exception]] = set()
    if dtype_name(o) != dtype or isinstance(o, np.ma.MaskedArray):
        problems.add(normlab.DtypeError)
    if tuple(o.shape) != shape:
        problems.add(normlab.ShapeError)
    if not writeable(o) or zero_stride(o) or tracks_grad(o):
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
        and family_of(x) in b.families | b.zero_copy_families | b.explicit_families
        and "cpu" in b.devices
        and dtype_name(x) in b.dtypes
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
        if self.aliases_weight(norm_shape):
            # weight: the first elements of out's memory (out is C-contiguous here)
            kwargs["weight"] = (
                kwargs["out"].reshape(-1)[: math.prod(norm_shape)].reshape(norm_shape)
            )
        if self.backend is not None:
            kwargs["backend"] = self.backend
        return kwargs

    def aliases_weight(self, norm_shape: tuple[int, ...] | None) -> bool:
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
        dtype = stats_dtype(self.dtype)
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
        if not is_array(x):
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
        grad = any(tracks_grad(kwargs.get(k)) for k in ("x", "weight", "bias"))
        found |= self._out_problems(kwargs.get("out"), x, axes)
        found |= backend_problems(self.backend, self.op, x, grad)
        return found

    def _out_problems(self, out: Any, x: Any, axes: tuple[int, ...] | None) -> set[type[Exception]]:
        if out is None:
            return set()
        found: set[type[Exception]] = set()
        if tracks_grad(x):
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
                found |= out_array_problems(s, x, stats_shape, stats_dtype(self.dtype))
        if axes is None and stats:
            found.add(normlab.ShapeError)
        if self.out == "overlap" and math.prod(self.shape) > 0 and self.shape[0] >= 2:
            found.add(normlab.ArgumentError)
        if self.aliases_weight(None if axes is None else self.norm_shape()):
            found.add(normlab.ArgumentError)  # out shares memory with weight
        return found


def check_forward_result(
    f: Forward, kwargs: dict[str, Any], result: Any, x64: np.ndarray, repro: str | None = None
) -> None:
    """Kinds, ``out`` identity and values of a valid call's result (x64: x before the call;
    ``repro``: what reruns the call, by default ``f``'s repr)."""
    x, out = kwargs["x"], kwargs.get("out")
    y, *stats = result if f.return_stats else (result,)
    assert len(stats) == (0 if not f.return_stats else 2 if f.op == "layer_norm" else 1)
    y_out, stats_out = (out[0], out[1:]) if isinstance(out, tuple) else (out, (None,) * len(stats))
    assert y_out is None or y is y_out, "the result is not the out array"
    assert type(y) is type(x) and tuple(y.shape) == f.shape and dtype_name(y) == f.dtype
    if any(tracks_grad(kwargs.get(k)) for k in ("x", "weight", "bias")):
        assert y.requires_grad, "the autograd graph was dropped"
    axes = f._axes()
    assert axes is not None
    stats_shape = tuple(1 if a in axes else n for a, n in enumerate(f.shape))
    for s, s_out in zip(stats, stats_out, strict=True):
        assert s_out is None or s is s_out, "a statistic is not its out array"
        assert type(s) is type(x) and tuple(s.shape) == stats_shape
        assert dtype_name(s) == stats_dtype(f.dtype)
    cols = math.prod(f.shape[a] for a in axes)
    if cols == 0 or math.prod(f.shape) == 0:  # empty: no kernel; statistics of no column NaN
        assert all(np.isnan(as_float64(s)).all() for s in stats)
        if tracks_grad(y):  # the graph is kept: zero gradients, as torch's own layer_norm
            y.sum().backward()
            for name in ("x", "weight", "bias"):
                a = kwargs.get(name)
                if tracks_grad(a) and a.is_leaf:  # x used as out= is no leaf: no .grad
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
            eps = MACHINE_EPS[stats_dtype_for(f.dtype)] if eps is None else float(eps)
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
    repro = repro or f"Rerun with: {f!r}"
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
            representable = want.astype(stats_dtype(f.dtype)).astype(np.float64)
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


# --------------------------------------------------------------------------------------------
# Fused calls: add_layer_norm, add_rms_norm

#: The (output, input) pairs that may be the very same elements: the fused ops' in-place forms
#: (docs/fused.md). Any other overlap of an output with an input or another output is refused.
IN_PLACE: Final = frozenset({("y", "x"), ("y", "residual"), ("h", "residual"), ("h", "x")})
#: Partial overlaps a fused call can be built with, ``"a~b"``: ``a`` is one memory but its
#: first row, ``b`` the same memory but its last (rows overlap when x has two or more).
OVERLAPS: Final = (
    "out~residual_out",
    "out~residual",
    "residual_out~x",
    "residual_out~residual",
    "residual~x",  # two inputs: allowed
)


def memory_view(a: Any) -> np.ndarray:
    """A NumPy array over ``a``'s own memory (a torch tensor's too): addresses to compare."""
    if isinstance(a, torch.Tensor):
        t = a.detach()
        return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return np.asarray(a)


def shares_memory(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` have an element in common (exact; empty arrays share none)."""
    return bool(np.shares_memory(memory_view(a), memory_view(b)))


def same_elements(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same object or views of exactly the same elements."""
    if a is b:
        return True
    va, vb = memory_view(a), memory_view(b)
    where = va.__array_interface__["data"][0], vb.__array_interface__["data"][0]
    return where[0] == where[1] and (va.shape, va.strides, va.itemsize) == (
        vb.shape,
        vb.strides,
        vb.itemsize,
    )


def aliasing_problems(
    x: Any, inputs: dict[str, Any], outputs: dict[str, Any]
) -> set[type[Exception]]:
    """The aliasing rule of the fused ops: no output shares memory with another output or with
    an input, except the :data:`IN_PLACE` pairs when they are the very same elements. Arrays
    not of x's family are left to the other rules (a DeviceError)."""

    def given(arrays: dict[str, Any]) -> list[tuple[str, Any]]:
        return [(n, a) for n, a in arrays.items() if is_array(a) and family_of(a) == family_of(x)]

    given_in, given_out = given(inputs), given(outputs)
    for i, (name, o) in enumerate(given_out):
        for _, other in given_out[:i]:
            if o is other or shares_memory(o, other):
                return {normlab.ArgumentError}
        for in_name, a in given_in:
            if (name, in_name) in IN_PLACE and same_elements(o, a):
                continue
            if shares_memory(o, a):
                return {normlab.ArgumentError}
    return set()


def named_outputs(out: Any, residual_out: Any) -> dict[str, Any]:
    """A fused call's outputs by name: ``y`` (out, or its first entry), the statistics' entries
    of an out tuple, ``h`` (residual_out)."""
    entries = out if isinstance(out, tuple) else (out,)
    named = {"y": entries[0] if entries else None}
    named |= {f"stat{i}": o for i, o in enumerate(entries[1:])}
    return named | {"h": residual_out}


def unfused_add(x: Any, residual: Any) -> Any:
    """``x + residual`` rounded to x's dtype as x's library rounds it (NumPy's float16 and
    ml_dtypes' bfloat16: the float32 sum, rounded), computed from copies made now."""
    if isinstance(x, torch.Tensor):
        return torch.add(x.detach().clone(), residual.detach().clone())
    dtype = numpy_dtype(dtype_name(x))
    xs, rs = np.array(x, dtype=dtype), np.array(residual, dtype=dtype)  # native byte order
    if dtype_name(x) in HALF:
        return (xs.astype(np.float32) + rs.astype(np.float32)).astype(dtype)
    return np.add(xs, rs)


def bits(a: Any) -> np.ndarray:
    """``a``'s elements as unsigned integers in native byte order: equal means bitwise equal."""
    n = to_numpy(a)
    n = np.ascontiguousarray(n.astype(n.dtype.newbyteorder("=")))
    return n.view(f"u{n.dtype.itemsize}")


@dataclass(frozen=True)
class Fused:
    """One call of ``add_layer_norm`` or ``add_rms_norm``: ``call`` holds the arguments the
    fused op shares with its base op (``call.op``; drawn and judged as that op's), the other
    fields the fused ones, all plain values."""

    call: Forward
    residual: str  # ok, x (x itself), x_view, requires_grad, wrong_shape, wrong_dtype,
    #                other_family, list, masked
    residual_layout: str
    residual_values: str  # independent, cancel (-x plus a little), small (below x's spacing),
    #                       below_spacing (below half the spacing of ``spaced`` x: h is x)
    return_residual: Any
    out: str | None  # None: call.out's form; else x, x_view, residual, residual_view
    residual_out: str | None  # None, a layout (a fresh array), x, x_view, residual,
    #                residual_view, out (the out array itself), wrong_shape, wrong_dtype,
    #                other_family, masked, requires_grad, tuple, list, aliases_weight
    overlap: str | None  # one of OVERLAPS
    arrays: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def op(self) -> str:
        return f"add_{self.call.op}"

    def build(self) -> dict[str, Any]:
        """The call's arguments (arrays made from the seed)."""
        kwargs = self.call.build()
        rng = np.random.default_rng([self.call.seed, 17])  # apart from the call's own stream
        kwargs["residual"] = self._residual(kwargs["x"], rng)
        if self.out is not None:
            kwargs["out"] = self._like_x(self.out, kwargs, rng)
        if self.residual_out is not None:
            kwargs["residual_out"] = self._residual_out(kwargs, rng)
        if self.overlap is not None:
            self._overlap(kwargs, rng)
        kwargs["return_residual"] = self.return_residual
        return kwargs

    def _x_like(self, rng: np.random.Generator, **change: Any) -> Any:
        """A fresh array like x (``change``: family, dtype, shape, layout, requires_grad)."""
        c = self.call
        how = {"family": c.family, "dtype": c.dtype, "shape": c.shape, "layout": "c"} | change
        grad = how.pop("requires_grad", False)
        return make(how["family"], how["dtype"], how["shape"], rng, how["layout"], c.values, grad)

    def _residual(self, x: Any, rng: np.random.Generator) -> Any:
        c, kind = self.call, self.residual
        if not is_array(x) or c.dtype not in FLOATS or kind == "x":
            return x
        if kind == "x_view":
            return x[...]
        if kind == "list":
            return [0.0] * max(1, math.prod(c.shape))
        if kind == "wrong_shape":
            return self._x_like(rng, shape=(*c.shape, 2), layout=self.residual_layout)
        if kind == "wrong_dtype":
            others = [d for d in (*FLOATS, "int32") if d != c.dtype]
            return self._x_like(rng, dtype=others[int(rng.integers(len(others)))])
        if kind == "other_family":
            return self._x_like(rng, family="torch" if c.family == "numpy" else "numpy")
        x64 = as_float64(x)
        if self.residual_values == "cancel":  # h small: its rounding is most of it
            values = -x64 + 0.01 * rng.standard_normal(c.shape)
        elif self.residual_values == "small":  # mostly below x's spacing: h rounds to x
            values = np.abs(x64) * 1e-3 * rng.standard_normal(c.shape)
        elif self.residual_values == "below_spacing":  # below half of spaced x's spacing (1)
            values = rng.uniform(-0.9, 0.9, c.shape)
        else:
            values = _values(c.shape, c.values, rng, c.dtype)
        r = laid_out(c.family, c.dtype, values, self.residual_layout, kind == "requires_grad")
        return np.ma.masked_array(r, mask=np.zeros(r.shape, bool)) if kind == "masked" else r

    def _like_x(self, form: str, kwargs: dict[str, Any], rng: np.random.Generator) -> Any:
        """An x-like output of ``form``: x or the residual themselves or views of exactly their
        elements, or a fresh array laid out as ``form`` says."""
        if form in ("x", "residual"):
            return kwargs[form]
        if form in ("x_view", "residual_view"):
            a = kwargs[form.removesuffix("_view")]
            return a[...] if is_array(a) else a
        return self._x_like(
            rng, dtype=self.call.dtype if self.call.dtype in FLOATS else "float32", layout=form
        )

    def _residual_out(self, kwargs: dict[str, Any], rng: np.random.Generator) -> Any:
        c, form = self.call, self.residual_out
        dtype = c.dtype if c.dtype in FLOATS else "float32"
        if form == "out":  # the out array itself (one made for both when out is None)
            out = kwargs.get("out")
            if isinstance(out, tuple) and is_array(out[0]):
                return out[0]
            if is_array(out):
                return out
            shared = self._x_like(rng, dtype=dtype)
            kwargs["out"] = (shared, *out[1:]) if isinstance(out, tuple) else shared
            return shared
        if form == "tuple":
            return (self._x_like(rng, dtype=dtype),)
        if form == "list":
            return [0.0]
        if form == "wrong_shape":
            return self._x_like(rng, dtype=dtype, shape=(*c.shape, 1))
        if form == "wrong_dtype":
            return self._x_like(rng, dtype="float64" if dtype != "float64" else "float32")
        if form == "other_family":
            return self._x_like(
                rng, dtype=dtype, family="torch" if c.family == "numpy" else "numpy"
            )
        if form == "masked":
            return np.ma.masked_array(self._x_like(rng, dtype=dtype))
        if form == "requires_grad":
            return self._x_like(rng, dtype=dtype, requires_grad=c.family == "torch")
        if form == "aliases_weight":  # weight: the first elements of residual_out's memory
            h = self._x_like(rng, dtype=dtype)
            norm_shape = c.norm_shape()
            if norm_shape is not None and c.dtype in FLOATS and math.prod(c.shape) > 0:
                kwargs["weight"] = h.reshape(-1)[: math.prod(norm_shape)].reshape(norm_shape)
            return h
        return self._like_x(form, kwargs, rng)

    def _overlap(self, kwargs: dict[str, Any], rng: np.random.Generator) -> None:
        """Replace the two arguments ``overlap`` names by views of one memory, x's shape and
        dtype: the first all of it but its last row, the second all but its first."""
        c = self.call
        if not c.shape or c.dtype not in FLOATS or not is_array(kwargs["x"]):
            return
        memory = self._x_like(rng, shape=(c.shape[0] + 1, *c.shape[1:]))
        self.arrays["memory"] = memory
        first, second = self.overlap.split("~")  # type: ignore[union-attr]
        kwargs[first], kwargs[second] = memory[:-1], memory[1:]

    def problems(self, kwargs: dict[str, Any]) -> set[type[Exception]]:
        """Every error the model expects (empty: the call is valid): the base op's rules for
        the shared arguments, then the fused ones."""
        found: set[type[Exception]] = set()
        return_residual, residual_out = kwargs["return_residual"], kwargs.get("residual_out")
        if not isinstance(return_residual, bool) or isinstance(residual_out, (tuple, list)):
            found.add(normlab.ArgumentError)
        if residual_out is not None and return_residual is not True:
            found.add(normlab.ArgumentError)  # the post-norm form never writes h
        shared = {k: v for k, v in kwargs.items() if k not in _FUSED_ARGUMENTS}
        found |= self.call.problems(shared)
        x, c = kwargs["x"], self.call
        if not is_array(x) or c.dtype not in FLOATS or not c.shape:
            return found  # x is judged first
        found |= companion_problems(kwargs["residual"], x, c.shape, {c.dtype})
        out = kwargs.get("out")
        if any(tracks_grad(kwargs.get(k)) for k in ("x", "residual", "weight", "bias")):
            if out is not None or residual_out is not None:
                found.add(normlab.ArgumentError)  # the results would be detached
            found |= backend_problems(c.backend, c.op, x, True)
        if residual_out is not None and not isinstance(residual_out, (tuple, list)):
            found |= out_array_problems(residual_out, x, c.shape, c.dtype)
        inputs = {k: kwargs.get(k) for k in ("x", "residual", "weight", "bias")}
        return found | aliasing_problems(x, inputs, named_outputs(out, residual_out))


#: The arguments of a fused op that its base op does not take.
_FUSED_ARGUMENTS: Final = ("residual", "return_residual", "residual_out")


def check_fused_result(fz: Fused, kwargs: dict[str, Any], result: Any, h_want: Any) -> None:
    """A valid fused call's result: its form (docs/fused.md's table), ``h`` (``residual_out``
    itself when given) bitwise ``h_want`` (the unfused add of the inputs before the call), and
    ``y`` and the statistics those of the base op of ``h_want`` (:func:`check_forward_result`);
    with an input that requires grad ``y`` does (``h`` with x or the residual), the statistics
    never."""
    c, x = fz.call, kwargs["x"]
    repro = f"Rerun with: {fz!r}"
    grad = any(tracks_grad(kwargs.get(k)) for k in ("x", "residual", "weight", "bias"))
    stats = (2 if c.op == "layer_norm" else 1) if c.return_stats else 0
    if fz.return_residual:
        assert isinstance(result, tuple) and len(result) == 2 + stats, "not the (y, h, ...) form"
        y, h, *rest = result
        base_result = (y, *rest) if c.return_stats else y
        residual_out = kwargs.get("residual_out")
        assert residual_out is None or h is residual_out, "h is not the residual_out array"
        assert type(h) is type(x) and tuple(h.shape) == c.shape and dtype_name(h) == c.dtype
        assert np.array_equal(bits(h), bits(h_want)), f"h is not the unfused add. {repro}"
        h_grad = any(tracks_grad(kwargs.get(k)) for k in ("x", "residual"))
        assert not h_grad or h.requires_grad, "h dropped the autograd graph"
    else:
        base_result = result
    y, *stats = base_result if c.return_stats else (base_result,)
    assert not grad or (is_array(y) and y.requires_grad), "y dropped the autograd graph"
    assert not any(tracks_grad(s) for s in stats), "a statistic requires grad"
    shared = {k: v for k, v in kwargs.items() if k not in _FUSED_ARGUMENTS} | {"x": h_want}
    check_forward_result(c, shared, base_result, as_float64(h_want), repro)


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
        dtype, shape, family = dtype_name(a), tuple(a.shape), family_of(a)
        if how == "dtype":
            dtype = "float16" if dtype != "float16" else "float64"
        elif how == "shape":
            shape = (*shape, 2)
        elif how == "family":
            family = "torch" if family == "numpy" else "numpy"
        elif how == "strided":  # the same values, every axis strided
            return arrange(np.asarray(to_numpy(a)), "sliced", conversion(family))
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
            dtype = self.dtype if name == "dy" else stats_dtype(self.dtype)
            a = kwargs[name]
            if not is_array(a):
                found.add(normlab.ArgumentError)
            elif family_of(a) != family_of(x):
                found.add(normlab.DeviceError)
            else:
                if dtype_name(a) != dtype:
                    found.add(normlab.DtypeError)
                if tuple(a.shape) != shape or (axes is None and name != "dy"):
                    found.add(normlab.ShapeError)
        norm_shape = None if axes is None else tuple(self.shape[a] for a in axes)
        found |= param_problems(kwargs["weight"], x, norm_shape)
        found |= backend_problems(self.backend, self.op, x, False)
        return found


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
            _, rstd = reference.rms_norm(
                x64, eps=MACHINE_EPS[stats_dtype_for(b.dtype)], axis=b.axis
            )
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
    param_dtype = dtype_name(x if kwargs["weight"] is None else kwargs["weight"])
    cond, wanted = expected_gradients(b, kwargs)
    rows = math.prod(b.shape) // max(1, math.prod(norm_shape))
    repro = f"Rerun with: {b!r}"
    for name, got in zip(known, result, strict=True):
        if name not in kwargs["needs"]:
            assert got is None, f"d{name} was not asked for"
            continue
        want, scale = wanted[name]
        shape, dtype = (b.shape, b.dtype) if name == "x" else (norm_shape, param_dtype)
        assert type(got) is type(x) and tuple(got.shape) == shape and dtype_name(got) == dtype
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


#: A valid fused call (float16 torch rows, independent residual), for tests to vary.
VALID_FUSED: Final = Fused(
    call=Forward(
        op="layer_norm",
        family="torch",
        dtype="float16",
        shape=(3, 4),
        layout="c",
        values="normal",
        normalized_shape=None,
        axis=None,
        weight=None,
        bias=None,
        eps="default",
        return_stats=False,
        out=None,
        out_stats=(None, None),
        backend=None,
        preference=None,
        requires_grad=False,
        seed=0,
    ),
    residual="ok",
    residual_layout="c",
    residual_values="independent",
    return_residual=True,
    out=None,
    residual_out=None,
    overlap=None,
)
