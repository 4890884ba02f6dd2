"""Validation: every rule of the contract that is not arithmetic, checked once per call shape.

:func:`plan` turns the arguments of a normalization call into a :class:`Plan` (rows, cols, axes,
dtypes, eps, layout) or raises a :class:`~normlab.errors.NormlabError` subclass that names the
values involved. Plans are cached by the arguments' metadata (type, dtype, shape, strides,
device), so a repeated call costs one dictionary lookup. Backends receive a validated Plan and
never re-check.
"""

from __future__ import annotations

import itertools
import math
import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, cast

from normlab import arrays
from normlab.arrays import ArrayInfo
from normlab.constants import FLOAT_DTYPES, HALF_DTYPES, MACHINE_EPS, stats_dtype_for
from normlab.errors import ArgumentError, DeviceError, DtypeError, NormlabError, ShapeError
from normlab.hookspecs import Plan
from normlab.ops import BACKWARD_OPS, FORWARD_OPS, FUSED_OPS, OPS

__all__ = [
    "FLOAT_DTYPES",
    "HALF_DTYPES",
    "Aliasing",
    "Layout",
    "Plan",
    "non_native",
    "output_aliasing",
    "plan",
    "row_view_strides",
    "split_out",
    "stats_dtype_for",
    "stats_names",
    "validated",
    "validated_backward",
    "validated_fused",
]

_PLAN_CACHE_SIZE: Final = 4096


def non_native(**inputs: Any) -> frozenset[str]:
    """The byte-order rule, one for every op and every array argument.

    Returns the names of the given input arrays (``x``, ``weight``, ``bias``, ``dy``, ``mean``,
    ``rstd``; None entries ignored) whose dtype is in non-native byte order (NumPy's ``>f4`` on
    a little-endian machine). The core converts each of them once per call into a native copy
    (:func:`normlab.layout.native`) before any backend runs, so backends only ever see native
    arrays. An output (``out`` and its statistics entries) in non-native byte order is written
    through a native temporary and copied in, never handed to a backend.
    """
    return frozenset(
        name for name, a in inputs.items() if a is not None and not arrays.info(a).native_byte_order
    )


def row_view_strides(
    shape: tuple[int, ...],
    strides: tuple[int, ...] | None,
    batch_axes: tuple[int, ...],
    axes: tuple[int, ...],
) -> tuple[int, int] | None:
    """Element strides ``(row, col)`` of a 2-D ``(rows, cols)`` view, or ``None`` if none exists.

    The batch axes must collapse into one stride and the normalized axes into another (axes of
    size 1 do not matter). A size-1 side gets the stride that a C-contiguous array would have.
    """
    if strides is None:
        return None
    cols_stride = _collapsed_stride([(shape[a], strides[a]) for a in axes], default=1)
    if cols_stride is None:
        return None
    cols = math.prod(shape[a] for a in axes)
    rows_stride = _collapsed_stride([(shape[a], strides[a]) for a in batch_axes], default=cols)
    if rows_stride is None:
        return None
    return rows_stride, cols_stride


def _collapsed_stride(dims: list[tuple[int, int]], default: int) -> int | None:
    dims = [(n, s) for n, s in dims if n != 1]
    if not dims:
        return default
    for (_, outer), (inner_n, inner) in itertools.pairwise(dims):
        if outer != inner * inner_n:
            return None
    return dims[-1][1]


@dataclass(frozen=True, slots=True)
class Layout:
    """How the core runs one validated call, for any op (core-only: backends see ``plan``).

    The caller's arrays are viewed with the batch axes first and the normalized axes last
    (``permutation``, None when that is already the order), then as 2-D ``(rows, cols)``.
    ``strides`` maps each x-like input (x, dy, …) to the element strides ``(row, col)`` of that
    view, or None when no such view exists (a copy is needed); ``out_strides`` likewise for
    ``out``, and ``residual_out_strides`` for a fused op's ``residual_out`` (``has_residual_out``).
    ``non_native`` names the inputs in non-native byte order (the core hands backends
    native copies). ``needs``: the gradients a backward call asks for. ``routes`` caches, per
    backend, how this call runs on it (:func:`normlab.layout.route`).
    """

    plan: Plan
    permutation: tuple[int, ...] | None
    inverse: tuple[int, ...] | None
    permuted_shape: tuple[int, ...]
    strides: dict[str, tuple[int, int] | None]
    non_native: frozenset[str]
    has_out: bool
    out_strides: tuple[int, int] | None
    out_stats: tuple[bool, bool]
    needs: frozenset[str] = frozenset()
    has_residual_out: bool = False
    residual_out_strides: tuple[int, int] | None = None
    routes: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def x_strides(self) -> tuple[int, int] | None:
        return self.strides["x"]

    @property
    def x_native(self) -> bool:
        return "x" not in self.non_native

    @property
    def dispatch_key(self) -> tuple[Any, ...]:
        """What the choice of backend depends on, besides size (:func:`normlab.dispatch.choose`)."""
        p = self.plan
        return (p.op, p.family, p.device_kind, p.dtype, p.requires_grad)


#: Plans of every op, keyed by the op's name and its arguments' metadata.
_cache: dict[tuple[Any, ...], Any] = {}


def validated(
    op: str,
    x: Any,
    normalized_shape: Any,
    weight: Any,
    bias: Any,
    eps: Any,
    axis: Any,
    return_stats: Any,
    out: Any,
) -> Layout:
    """Validate a forward call and return its :class:`Layout` (cached by the arguments'
    metadata; a repeated call costs one dictionary lookup)."""
    if eps is not None and type(eps) is not float and arrays.is_array(eps):
        eps = _eps_from_array(eps)
    key: tuple[Any, ...] | None
    try:
        array_type = type(x)
        key_of = arrays.inspector(array_type).key
        key = (
            op,
            array_type,
            key_of(x),
            normalized_shape if normalized_shape is None else _dims_key(normalized_shape),
            axis if axis is None else _dims_key(axis),
            # _param_key_like, inlined (a call per parameter is a tenth of a µs on every call)
            None if weight is None
            else (array_type, key_of(weight)) if type(weight) is array_type
            else _param_key(weight),
            None if bias is None
            else (array_type, key_of(bias)) if type(bias) is array_type
            else _param_key(bias),
            eps,
            type(eps),
            return_stats,
            type(return_stats),
            None if out is None else _out_key(out),
        )  # fmt: skip
        cached = _cache.get(key)
    except Exception:  # unhashable, not an array, or an odd tensor: validate the slow way
        key, cached = None, None
    if cached is not None:
        return cast("Layout", cached)
    result = _validate(op, x, normalized_shape, weight, bias, eps, axis, return_stats, out)
    _remember(key, result)
    return result


def plan(
    op: str,
    x: Any,
    normalized_shape: Any,
    weight: Any,
    bias: Any,
    eps: Any,
    axis: Any,
    return_stats: Any,
    out: Any,
) -> Plan:
    """The :class:`Plan` a backend receives for a forward call (tests and tools drive backends
    with it)."""
    return validated(op, x, normalized_shape, weight, bias, eps, axis, return_stats, out).plan


def validated_fused(
    op: str,
    x: Any,
    residual: Any,
    normalized_shape: Any,
    weight: Any,
    bias: Any,
    eps: Any,
    axis: Any,
    return_stats: Any,
    return_residual: Any,
    out: Any,
    residual_out: Any,
) -> Layout:
    """Validate a fused call (``add_layer_norm``, ``add_rms_norm``) and return its
    :class:`Layout` (cached as :func:`validated`)."""
    if eps is not None and type(eps) is not float and arrays.is_array(eps):
        eps = _eps_from_array(eps)
    key: tuple[Any, ...] | None
    try:
        array_type = type(x)
        key_of = arrays.inspector(array_type).key
        key = (
            op,
            array_type,
            key_of(x),
            _param_key_like(residual, array_type, key_of),
            normalized_shape if normalized_shape is None else _dims_key(normalized_shape),
            axis if axis is None else _dims_key(axis),
            _param_key_like(weight, array_type, key_of),
            _param_key_like(bias, array_type, key_of),
            eps,
            type(eps),
            return_stats,
            type(return_stats),
            return_residual,
            type(return_residual),
            None if out is None else _out_key(out),
            None if residual_out is None else _out_key(residual_out),
        )
        cached = _cache.get(key)
    except Exception:  # unhashable, not an array, or an odd tensor: validate the slow way
        key, cached = None, None
    if cached is not None:
        return cast("Layout", cached)
    if op not in FUSED_OPS:
        raise ArgumentError(f"unknown op {op!r}; normlab's fused ops are {', '.join(FUSED_OPS)}")
    if "bias" not in OPS[op].per_feature and bias is not None:
        raise ArgumentError(f"{op} takes no bias (y = h / sqrt(mean(h^2) + eps) * weight)")
    if not isinstance(return_residual, bool):
        raise ArgumentError(f"return_residual must be True or False, got {return_residual!r}")
    if residual_out is not None and not return_residual:
        raise ArgumentError(
            "residual_out was given with return_residual=False: the post-norm form never "
            "writes h; drop residual_out or pass return_residual=True"
        )
    if isinstance(residual_out, (tuple, list)):
        raise ArgumentError(
            "residual_out must be one array like x (h never goes into a tuple; the statistics "
            "go into out)"
        )
    inputs = {"x": x, "residual": residual, "weight": weight, "bias": bias}
    result = _validate_call(
        op, inputs, normalized_shape, axis, eps, return_stats, out, frozenset(),
        return_residual=return_residual, residual_out=residual_out,
    )  # fmt: skip
    _remember(key, result)
    return result


def validated_backward(
    op: str,
    dy: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    weight: Any,
    normalized_shape: Any,
    axis: Any,
    needs: Any,
) -> Layout:
    """Validate a backward call and return its :class:`Layout` (cached as :func:`validated`)."""
    key: tuple[Any, ...] | None
    try:
        key = (
            op,
            *(None if a is None else _param_key(a) for a in (dy, x, mean, rstd, weight)),
            normalized_shape if normalized_shape is None else _dims_key(normalized_shape),
            axis if axis is None else _dims_key(axis),
            type(needs),
            tuple(needs) if isinstance(needs, (tuple, list)) else needs,
        )
        cached = _cache.get(key)
    except Exception:  # unhashable, not an array, or an odd tensor: validate the slow way
        key, cached = None, None
    if cached is not None:
        return cast("Layout", cached)
    result = _validate_backward(op, dy, x, mean, rstd, weight, normalized_shape, axis, needs)
    _remember(key, result)
    return result


def _remember(key: tuple[Any, ...] | None, result: Any) -> None:
    if key is not None:
        if len(_cache) >= _PLAN_CACHE_SIZE:
            _cache.clear()
        _cache[key] = result


def clear_cache() -> None:
    """Forget every cached plan."""
    _cache.clear()


def _dims_key(value: Any) -> Any:
    """Dims with their element types: (4.0,) == (4,) in Python, but only one is valid."""
    if type(value) is int:
        return value
    if type(value) is tuple and len(value) == 1 and type(value[0]) is int:
        return value  # the common (cols,): ints only, unlike any key below (a type first)
    if isinstance(value, (tuple, list)):
        return (type(value), *((type(v), v) for v in value))
    return type(value), value


def _param_key(p: Any) -> Any:
    return type(p), arrays.inspector(type(p)).key(p)


def _param_key_like(p: Any, array_type: type, key_of: Any) -> Any:
    """:func:`_param_key` of an optional ``p`` (None: None), with ``key_of``, the key function
    of ``array_type``'s inspector, for ``p`` of that type (mostly so: weight and bias of x's)."""
    if p is None:
        return None
    return (array_type, key_of(p)) if type(p) is array_type else _param_key(p)


def _out_key(out: Any) -> Any:
    if out is None:
        return None
    if isinstance(out, tuple):
        return tuple(_out_key(o) for o in out)
    key = arrays.inspector(type(out)).key(out)
    writeable = getattr(getattr(out, "flags", None), "writeable", True)
    return type(out), key, writeable


# --------------------------------------------------------------------------------------------
# The rules, for every op of the table. Only reached on a cache miss.


def _validate(
    op: str,
    x: Any,
    normalized_shape: Any,
    weight: Any,
    bias: Any,
    eps: Any,
    axis: Any,
    return_stats: Any,
    out: Any,
) -> Layout:
    """A forward call's :class:`Layout`."""
    if op not in FORWARD_OPS:
        raise ArgumentError(f"unknown op {op!r}; normlab provides {', '.join(FORWARD_OPS)}")
    if "bias" not in OPS[op].per_feature and bias is not None:
        raise ArgumentError(f"{op} takes no bias (y = x / sqrt(mean(x^2) + eps) * weight)")
    inputs = {"x": x, "weight": weight, "bias": bias}
    return _validate_call(op, inputs, normalized_shape, axis, eps, return_stats, out, frozenset())


def _validate_backward(
    op: str,
    dy: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    weight: Any,
    normalized_shape: Any,
    axis: Any,
    needs: Any,
) -> Layout:
    """A backward call's :class:`Layout`."""
    if op not in BACKWARD_OPS:
        raise ArgumentError(f"unknown op {op!r}; normlab provides {', '.join(BACKWARD_OPS)}")
    wanted = _check_needs(op, needs)
    inputs = {"dy": dy, "x": x, "mean": mean, "rstd": rstd, "weight": weight}
    return _validate_call(op, inputs, normalized_shape, axis, 0.0, False, None, wanted)


def _validate_call(
    op: str,
    inputs: dict[str, Any],
    normalized_shape: Any,
    axis: Any,
    eps: Any,
    return_stats: Any,
    out: Any,
    needs: frozenset[str],
    *,
    return_residual: bool = False,
    residual_out: Any = None,
) -> Layout:
    """The rules of the op table for ``op``: x first, then every other input by its role, then
    eps, return_stats, out and (fused ops) residual_out."""
    table = OPS[op]
    x = inputs["x"]
    xi = _array_info("x", x)
    _check_float("x", xi)
    if xi.ndim == 0:
        raise ShapeError(f"x is 0-d (a scalar); {op} needs at least one axis to normalize over")
    axes = _normalized_axes(xi.shape, normalized_shape, axis)
    batch_axes = tuple(a for a in range(xi.ndim) if a not in axes)
    norm_shape = tuple(xi.shape[a] for a in axes)
    compute = stats_dtype_for(xi.dtype)
    stats_shape = tuple(1 if a in axes else n for a, n in enumerate(xi.shape))
    infos = {"x": xi}
    for name in (n for n in table.like_x if n != "x"):
        infos[name] = _check_companion(name, inputs[name], xi, xi.shape, {xi.dtype}, "x's shape")
    for name in table.stats:
        what = "x's shape with 1 on the normalized axes"
        infos[name] = _check_companion(name, inputs[name], xi, stats_shape, {compute}, what)
    param_dtypes = {xi.dtype, "float32"} if xi.dtype in HALF_DTYPES else {xi.dtype}
    for name in table.per_feature:
        if inputs[name] is not None:
            what = "the normalized shape of x"
            infos[name] = _check_companion(name, inputs[name], xi, norm_shape, param_dtypes, what)
    if not table.takes_eps:
        eps_value = 0.0
    elif eps is None and table.default_eps is None:
        eps_value = MACHINE_EPS[xi.dtype]
    else:
        eps_value = _check_eps(eps)
    if not isinstance(return_stats, bool):
        raise ArgumentError(f"return_stats must be True or False, got {return_stats!r}")
    permutation = batch_axes + axes
    permutation_or_none = None if permutation == tuple(range(xi.ndim)) else permutation
    requires_grad = any(info.requires_grad for info in infos.values())
    if requires_grad and table.base is not None and (out is not None or residual_out is not None):
        raise ArgumentError(
            f"out= and residual_out= cannot be used when an input of {op} requires grad (the "
            "results would be detached); leave them None"
        )
    out_y, out_stats = _check_out(out, xi, return_stats, stats_shape, compute, op)
    out_strides = None
    if out_y is not None and out_y.native_byte_order:  # else written through a temporary
        out_strides = row_view_strides(out_y.shape, out_y.strides, batch_axes, axes)
    residual_out_strides = None
    if residual_out is not None:
        hi = _check_out_array("residual_out", residual_out, xi, xi.shape, xi.dtype)
        if hi.native_byte_order:
            residual_out_strides = row_view_strides(hi.shape, hi.strides, batch_axes, axes)
    strides = {
        name: row_view_strides(infos[name].shape, infos[name].strides, batch_axes, axes)
        for name in table.like_x
    }
    weight, bias = (infos.get(name) for name in ("weight", "bias"))
    plan = Plan(
        op=op,
        family=xi.family,
        device=xi.device,
        device_kind=xi.device_kind,
        dtype=xi.dtype,
        shape=xi.shape,
        axes=axes,
        batch_axes=batch_axes,
        normalized_shape=norm_shape,
        rows=math.prod(xi.shape[a] for a in batch_axes),
        cols=math.prod(norm_shape),
        compute_dtype=compute,
        stats_dtype=compute,
        weight_dtype=None if weight is None else weight.dtype,
        bias_dtype=None if bias is None else bias.dtype,
        eps=eps_value,
        return_stats=return_stats,
        requires_grad=requires_grad,
        return_residual=return_residual,
    )
    result = Layout(
        plan=plan,
        permutation=permutation_or_none,
        inverse=None
        if permutation_or_none is None
        else tuple(permutation.index(a) for a in range(xi.ndim)),
        permuted_shape=tuple(xi.shape[a] for a in permutation),
        strides=strides,
        non_native=non_native(**inputs),
        has_out=out_y is not None,
        out_strides=out_strides,
        out_stats=out_stats,
        needs=needs,
        has_residual_out=residual_out is not None,
        residual_out_strides=residual_out_strides,
    )
    object.__setattr__(plan, "_layout", result)  # for Plan's deprecated routing fields
    return result


def _check_needs(op: str, needs: Any) -> frozenset[str]:
    known = OPS[op].gradients
    if isinstance(needs, str) or not isinstance(needs, (tuple, list, set, frozenset)):
        raise ArgumentError(
            f"needs must be a tuple of gradient names ({', '.join(map(repr, known))}), "
            f"got {needs!r}"
        )
    unknown = [n for n in needs if n not in known]
    if unknown:
        raise ArgumentError(
            f"needs names {', '.join(map(repr, unknown))}; {op} returns gradients for "
            f"{', '.join(map(repr, known))}"
        )
    return frozenset(needs)


def _array_info(name: str, value: Any) -> ArrayInfo:
    if type(value).__module__.split(".")[0] == "pandas":
        raise DtypeError(
            f"{name} is a pandas {type(value).__name__}; normlab takes arrays: convert with "
            f"`{name}.to_numpy()` (normalizing a table's rows over its columns)"
        )
    if not arrays.is_array(value):
        raise ArgumentError(
            f"{name} must be an array (numpy.ndarray, torch.Tensor, cupy.ndarray, …), "
            f"got {type(value).__name__}"
        )
    try:
        return arrays.info(value)
    except NormlabError:
        raise
    except Exception as exc:
        raise DtypeError(
            f"{name} ({type(value).__module__}.{type(value).__qualname__}) cannot be read as an "
            f"array: {type(exc).__name__}: {exc}"
        ) from exc


def _check_float(name: str, info: ArrayInfo) -> None:
    if info.masked:
        raise DtypeError(
            f"{name} is a numpy masked array; its mask would be ignored silently. "
            f"Pass x.filled(...) or x.data explicitly"
        )
    if info.dtype not in FLOAT_DTYPES:
        raise DtypeError(
            f"{name} has dtype {info.dtype}; normlab normalizes floating-point arrays only "
            f"({', '.join(FLOAT_DTYPES)})"
        )


def _as_int_tuple(name: str, value: Any) -> tuple[int, ...]:
    items = (value,) if not isinstance(value, Sequence) or isinstance(value, str) else value
    try:
        if any(isinstance(v, bool) for v in items):
            raise TypeError
        return tuple(operator.index(v) for v in cast("Sequence[Any]", items))
    except TypeError:
        raise ArgumentError(f"{name} must be an int or a tuple of ints, got {value!r}") from None


def _normalized_axes(shape: tuple[int, ...], normalized_shape: Any, axis: Any) -> tuple[int, ...]:
    ndim = len(shape)
    from_shape: tuple[int, ...] | None = None
    if normalized_shape is not None:
        ns = _as_int_tuple("normalized_shape", normalized_shape)
        if not ns:
            raise ShapeError("normalized_shape=() names no axis; give at least one trailing dim")
        if len(ns) > ndim or shape[ndim - len(ns) :] != ns:
            raise ShapeError(
                f"normalized_shape {ns} does not match the trailing dims of x with shape {shape}"
            )
        from_shape = tuple(range(ndim - len(ns), ndim))
    if axis is None:
        return from_shape if from_shape is not None else (ndim - 1,)
    given = _as_int_tuple("axis", axis)
    if not given:
        raise ShapeError("axis=() names no axis; give at least one axis to normalize over")
    for a in given:
        if not -ndim <= a < ndim:
            raise ShapeError(f"axis {a} is out of range for x with {ndim} dims (shape {shape})")
    axes = tuple(sorted(a % ndim for a in given))
    if len(set(axes)) != len(axes):
        raise ShapeError(f"axis {given} names an axis twice (x has shape {shape})")
    if from_shape is not None and axes != from_shape:
        raise ShapeError(
            f"axis {given} and normalized_shape {normalized_shape} disagree for x with shape "
            f"{shape}: normalized_shape names axes {from_shape}"
        )
    return axes


def _check_companion(
    name: str, a: Any, xi: ArrayInfo, shape: tuple[int, ...], dtypes: set[str], what: str
) -> ArrayInfo:
    """The one rule for an array beside x (an input or an output): x's library and device (one
    device rule, :func:`normlab.arrays.comparable_devices`), one of ``dtypes``, ``shape``
    (``what`` says what that shape is)."""
    ai = _array_info(name, a)
    if ai.family != xi.family:
        raise DeviceError(
            f"{name} is a {ai.type_name} but x is a {xi.type_name}; pass {name} from the same "
            f"array library as x (normlab never converts between libraries)"
        )
    if not arrays.comparable_devices(ai.device, xi.device):
        raise DeviceError(f"{name} is on device {ai.device} but x is on {xi.device}")
    allowed = " or ".join(sorted(dtypes))
    if ai.masked:
        raise DtypeError(f"{name} is a numpy masked array; pass a plain {allowed} array")
    if ai.dtype not in dtypes:
        raise DtypeError(
            f"{name} has dtype {ai.dtype}; it must be {allowed} (x has dtype {xi.dtype})"
        )
    if ai.shape != shape:
        raise ShapeError(
            f"{name} has shape {ai.shape}; it must be {shape} ({what}; x has shape {xi.shape})"
        )
    return ai


def _eps_from_array(eps: Any) -> Any:
    """A one-element host array given as eps (a 0-d NumPy array, a CPU tensor), as a Python
    number, so that the plan cache keys on its value and not on the array object."""
    try:
        info = arrays.info(eps)
    except NormlabError:
        raise
    except Exception:  # not readable as an array: _check_eps names it
        return eps
    if math.prod(info.shape) != 1:
        raise ArgumentError(
            f"eps must be a finite number >= 0, got an array of shape {info.shape}; eps is one "
            "number for every row"
        )
    if info.requires_grad:
        raise ArgumentError(
            "eps is a tensor that requires grad; normlab treats eps as a constant and gives it "
            "no gradient: pass eps.item() or a float"
        )
    if info.device_kind != "cpu":
        raise ArgumentError(
            f"eps is an array on {info.device}; pass a Python float (eps.item() copies it to "
            "the host, which waits for the device)"
        )
    return eps.item() if hasattr(eps, "item") else eps


def _check_eps(eps: Any) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise ArgumentError(f"eps must be a finite number >= 0, got {eps!r}")
    try:
        value = float(eps)
    except OverflowError:
        raise ArgumentError(f"eps must be a finite number >= 0, got {eps!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ArgumentError(f"eps must be a finite number >= 0, got {eps!r}")
    return value


def stats_names(op: str) -> tuple[str, ...]:
    """The statistics an op returns with ``return_stats``, in order."""
    return OPS[op].stats_outputs


def split_out(op: str, out: Any) -> tuple[Any, Any, Any]:
    """``out`` as ``(y, mean, rstd)`` (entries None when not given); the tuple form is
    ``(y, mean, rstd)`` for layer_norm and ``(y, rstd)`` for rms_norm (likewise their fused
    ops)."""
    if not isinstance(out, tuple):
        return out, None, None
    if "mean" not in OPS[op].stats_outputs:
        y_out, rstd_out = out
        return y_out, None, rstd_out
    y_out, mean_out, rstd_out = out
    return y_out, mean_out, rstd_out


def _check_out(
    out: Any,
    xi: ArrayInfo,
    return_stats: bool,
    stats_shape: tuple[int, ...],
    stats_dtype: str,
    op: str,
) -> tuple[ArrayInfo | None, tuple[bool, bool]]:
    if out is None:
        return None, (False, False)
    if isinstance(out, tuple):
        names = ("y", *stats_names(op))
        if not return_stats or len(out) != len(names):
            raise ArgumentError(
                f"out may be a tuple only with return_stats=True, as ({', '.join(names)}) with "
                f"None for entries to allocate; got a tuple of {len(out)}"
            )
    y_out, mean_out, rstd_out = split_out(op, out)
    if xi.requires_grad:
        raise ArgumentError(
            "out= cannot be used when x requires grad (the result would be detached)"
        )
    yi = None
    if y_out is not None:
        yi = _check_out_array("out", y_out, xi, xi.shape, xi.dtype)
    for name, o in (("out (mean)", mean_out), ("out (rstd)", rstd_out)):
        if o is not None:
            _check_out_array(name, o, xi, stats_shape, stats_dtype)
    return yi, (mean_out is not None, rstd_out is not None)


def _check_out_array(
    name: str, o: Any, xi: ArrayInfo, shape: tuple[int, ...], dtype: str
) -> ArrayInfo:
    what = "x's shape" if shape == xi.shape else "x's shape with 1 on the normalized axes"
    oi = _check_companion(name, o, xi, shape, {dtype}, what)
    if not oi.writeable:
        immutable = " (its array library has immutable arrays)" if oi.strides is None else ""
        raise ArgumentError(f"{name} is read-only{immutable}")
    zero_stride = oi.strides is not None and any(
        s == 0 and n > 1 for s, n in zip(oi.strides, oi.shape, strict=True)
    )
    if zero_stride and math.prod(oi.shape) > 0:
        raise ArgumentError(f"{name} has a zero stride (a broadcast view); its elements overlap")
    if oi.requires_grad:
        raise ArgumentError(f"{name} requires grad; normlab cannot write into it in place")
    return oi


# --------------------------------------------------------------------------------------------
# Outputs sharing memory with inputs. Per call (addresses are not metadata), and only when the
# caller passes an output: the call without ``out`` never reaches this.

#: Bound on the work of one exact overlap test (``numpy.shares_memory(max_work=...)``).
OVERLAP_MAX_WORK: Final = 1 << 16

#: What :func:`output_aliasing` found: ``y`` is written directly (``"separate"``), in place
#: (``"in_place"``: ``out is x``), or through a temporary because an overlap with an input could
#: not be ruled out within :data:`OVERLAP_MAX_WORK` (``"temporary"``).
Aliasing = Literal["separate", "in_place", "temporary"]


def output_aliasing(op: str, inputs: dict[str, Any], outputs: dict[str, Any]) -> Aliasing:
    """Check that no output shares memory with an input or with another output, except the
    pairs the op table lists as ``in_place`` for ``op`` when they are the same array (the same
    object, or views of exactly the same elements).

    ``inputs``/``outputs`` map names (``x``, ``weight``, ``bias``; ``y``, ``mean``, ``rstd``) to
    arrays or None. Bounds that lie apart settle the call (:func:`_apart`); else the test is
    exact (element by element, never refusing by bounds: :func:`_exact_aliasing`). It reads
    only each array's address, shape and strides — never its data — and is bounded in work.
    Statistics outputs are always written after the kernel has read every input, so only the
    x-like outputs (``y``; a fused op's ``h``) need a temporary when an overlap is undecided.
    Raises ArgumentError naming both arrays.
    """
    allowed = OPS[op].in_place
    given_in = [(n, a) for n, a in inputs.items() if a is not None]
    given_out = [(n, o) for n, o in outputs.items() if o is not None]
    settled = _apart(allowed, given_in, given_out)
    return settled if settled is not None else _exact_aliasing(op, given_in, given_out)


def _exact_aliasing(
    op: str, given_in: list[tuple[str, Any]], given_out: list[tuple[str, Any]]
) -> Aliasing:
    """:func:`output_aliasing` by the exact test of every pair of the given (named, not None)
    inputs and outputs."""
    allowed = OPS[op].in_place
    result: Aliasing = "separate"
    seen: dict[Any, Any] = {}
    for i, (name, o) in enumerate(given_out):
        for other_name, other in given_out[:i]:
            if other is o or _shares_memory(o, other, seen) is not False:
                raise ArgumentError(
                    f"{_output_argument(name)} and {_output_argument(other_name)} share memory; "
                    "pass separate arrays"
                )
        for in_name, a in given_in:
            if (name, in_name) in allowed and (o is a or _same_elements(o, a, seen)):
                result = "temporary" if result == "temporary" else "in_place"
                continue
            shared = _shares_memory(o, a, seen)
            if shared is None and name in OPS[op].outputs:
                result = "temporary"
            elif shared:
                argument = "residual_out" if name == "h" else "out"
                hint = f" ({argument}={in_name} itself is an in-place call)"
                hint = hint if (name, in_name) in allowed else ""
                raise ArgumentError(
                    f"{_output_argument(name)} shares memory with {in_name}{hint}; pass a "
                    "separate array"
                )
    return result


def _apart(
    allowed: Any, given_in: list[tuple[str, Any]], given_out: list[tuple[str, Any]]
) -> Aliasing | None:
    """:func:`output_aliasing`'s answer where bounds settle it: every output's bytes lie apart
    from every other output's and input's (``numpy.may_share_memory`` for NumPy arrays, the
    inspectors' extents, each read once, for the others), but for outputs that are the very
    input objects ``allowed`` lets them be (then ``"in_place"``). None when some bounds meet:
    the exact test decides."""
    np = _numpy()
    named = (*given_out, *given_in)
    spans: list[Any] | None = None  # None: all exact ndarrays
    for _, a in named:
        if type(a) is not np.ndarray:
            spans = [arrays.inspector(type(b)).extent(b) for _, b in named]
            break
    may_share = np.may_share_memory
    result: Aliasing = "separate"
    for i, (name, o) in enumerate(given_out):
        span = None if spans is None else spans[i]  # [first, last + 1) bytes; None: none
        for j, (other_name, other) in enumerate(named):
            if j == i:
                continue
            if other is o:
                if (name, other_name) not in allowed:
                    return None
                result = "in_place"
            elif spans is None:
                if may_share(o, other):
                    return None
            elif (
                span
                and (other_span := spans[j])
                and span[0] < other_span[1]
                and other_span[0] < span[1]
            ):
                return None
    return result


def _output_argument(name: str) -> str:
    """The argument an output arrives in: ``residual_out`` for a fused op's ``h``, else
    ``out (name)``."""
    return "residual_out" if name == "h" else f"out ({name})"


def _shares_memory(a: Any, b: Any, seen: dict[Any, Any] | None = None) -> bool | None:
    """Whether ``a`` and ``b`` have an element in common; None when undecided within
    :data:`OVERLAP_MAX_WORK`. Arrays without addressable memory (JAX, Dask) share none.
    ``seen`` keeps each array's extent and memory for the other pairs of one call."""
    np = _numpy()
    if type(a) is np.ndarray and type(b) is np.ndarray:  # the common case: no layouts to read
        if not np.may_share_memory(a, b):  # bounds only: cheap
            return False
        va, vb = (v.view(f"u{v.itemsize}") for v in (a, b))  # bfloat16 as integers
    else:
        seen = {} if seen is None else seen
        ea, eb = _extent(a, seen), _extent(b, seen)
        if ea is None or eb is None or not (ea[0] < eb[1] and eb[0] < ea[1]):
            return False  # bounds only: cheap
        va, vb = _memory_view(_memory(a, seen)), _memory_view(_memory(b, seen))
    try:
        return bool(np.shares_memory(va, vb, max_work=OVERLAP_MAX_WORK))
    except np.exceptions.TooHardError:
        return None


def _same_elements(a: Any, b: Any, seen: dict[Any, Any]) -> bool:
    """Whether ``a`` and ``b`` are views of the very same elements (same first address, shape,
    strides and item size): ``out=x[:, ::2]`` for ``x[:, ::2]`` is an in-place call."""
    np = _numpy()
    if type(a) is np.ndarray and type(b) is np.ndarray and not np.may_share_memory(a, b):
        return False  # bounds only: cheap, and no layouts to read
    extent = _extent(a, seen)
    if extent is None or extent != _extent(b, seen):  # the same elements span the same bytes
        return False
    return bool(_memory(a, seen) == _memory(b, seen))


def _extent(a: Any, seen: dict[Any, Any]) -> tuple[int, int] | None:
    """The bytes ``[first, last + 1)`` ``a`` spans (None: no addressable element), read once per
    array and call."""
    key = id(a)
    if key not in seen:
        seen[key] = arrays.inspector(type(a)).extent(a)
    return seen[key]  # type: ignore[no-any-return]


def _memory(a: Any, seen: dict[Any, Any]) -> arrays.Memory:
    """``a``'s memory (an array :func:`_extent` found elements in), read once per array and
    call."""
    key = (id(a), "memory")
    if key not in seen:
        seen[key] = arrays.inspector(type(a)).memory(a)
    return seen[key]  # type: ignore[no-any-return]


class _AddressOnly:
    """An object NumPy reads as an array at a raw address (``__array_interface__``): NumPy's
    overlap solver sees the address, shape and strides; the memory itself is never read."""

    __slots__ = ("__array_interface__",)

    def __init__(self, interface: dict[str, Any]) -> None:
        self.__array_interface__ = interface


def _memory_view(layout: arrays.Memory) -> Any:
    """A NumPy array of unsigned integers at ``layout``'s address (any family, any device;
    device addresses are only compared, never dereferenced)."""
    address, shape, strides, itemsize = layout
    interface = {
        "version": 3,
        "shape": shape,
        "typestr": f"<u{itemsize}",
        "data": (address, True),
        "strides": strides,
    }
    return _numpy().asarray(_AddressOnly(interface))


def _numpy() -> Any:
    import numpy

    return numpy
