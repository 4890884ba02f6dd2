"""The rules of the contract that are not arithmetic, for every op of the table: from a call's
arguments to a validated :class:`~normlab.spec.call.Call`, or a :class:`~normlab.errors.
NormlabError` subclass naming the values involved.

The op table (:mod:`normlab.ops`) says which arguments an op takes and each array's role; one
rule applies per role: x is a floating array of at least one axis; every other x-like array
(residual, dy) matches x's library, device, dtype and shape (a fused op's residual may also be
float32 beside float16/bfloat16 x: a float32 residual stream, whose ``residual_out`` is float32
too, :mod:`normlab.residual_stream`); statistics inputs are x's shape with 1 on the normalized
axes, in the stats dtype; per-feature arrays (weight, bias) are of the normalized shape, in any
float dtype (backends take x's, or float32 for half x: the core converts the others,
:mod:`normlab.parameters`), and ``weight_offset`` needs a weight. Then eps, the flags, the
outputs (:mod:`normlab.spec.aliasing` owns their overlaps) and a backward call's ``needs``. Only
reached when the call's key (:mod:`normlab.spec.keys`) is not cached.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from typing import Any, Final, cast

from normlab import arrays, layout
from normlab.arrays import ArrayInfo
from normlab.constants import FLOAT_DTYPES, HALF_DTYPES, MACHINE_EPS, stats_dtype_for
from normlab.errors import (
    ArgumentError,
    ArgumentTypeError,
    DeviceError,
    DtypeError,
    NormlabError,
    ShapeError,
)
from normlab.hookspecs import Plan
from normlab.ops import Op
from normlab.scalars import finite_float
from normlab.spec.aliasing import overlaps_itself
from normlab.spec.call import Call
from normlab.spec.casting import CASTINGS
from normlab.spec.casting import y_dtype as casting_y_dtype
from normlab.spec.quantize import check_family, q_dtype, static_scale
from normlab.spec.quantize import mode as quantize_mode

__all__ = ["eps_value", "row_call", "validate"]

#: The dtypes a parameter may have, whatever x's (those outside x's dtype, or float32 for half
#: x, are converted to the compute dtype by the core).
FLOATS: Final = set(FLOAT_DTYPES)

#: Calls of rows kept by :func:`row_call`.
_ROW_CALLS: Final = 1024


def validate(op: Op, args: tuple[Any, ...]) -> Call:
    """The :class:`Call` of ``op`` with ``args`` (the op's arguments, in order), or the
    NormlabError of the first rule they break: the flags and ``needs`` first, then x, the other
    arrays by role, eps, the outputs."""
    given = dict(zip(op.arguments, args, strict=True))
    needs = _check_needs(op, given["needs"]) if "needs" in given else frozenset()
    return_residual = given.get("return_residual", False)
    residual_out = given.get("residual_out")
    if "return_residual" in given:
        _check_residual_arguments(return_residual, residual_out)
    x = given["x"]
    xi = _array_info("x", x)
    _check_float("x", xi)
    if xi.ndim == 0:
        raise ShapeError(
            f"x is 0-d (a scalar); {op.name} needs at least one axis to normalize over"
        )
    axes = _normalized_axes(xi.shape, given.get("normalized_shape"), given.get("axis"))
    batch_axes = tuple(a for a in range(xi.ndim) if a not in axes)
    norm_shape = tuple(xi.shape[a] for a in axes)
    compute = stats_dtype_for(xi.dtype)
    stats_shape = tuple(1 if a in axes else n for a, n in enumerate(xi.shape))
    infos = {"x": xi}
    for name in (n for n in op.like_x if n != "x"):
        # a fused op's residual may be a float32 stream beside half x (normlab.residual_stream)
        stream = name == "residual" and xi.dtype in HALF_DTYPES
        dtypes = {xi.dtype, "float32"} if stream else {xi.dtype}
        infos[name] = _check_companion(name, given[name], xi, xi.shape, dtypes, "x's shape")
    h_dtype = infos["residual"].dtype if "residual" in infos else xi.dtype
    for name in op.stats:
        what = "x's shape with 1 on the normalized axes"
        infos[name] = _check_companion(name, given[name], xi, stats_shape, {compute}, what)
    taken = {xi.dtype, "float32"} if xi.dtype in HALF_DTYPES else {xi.dtype}
    composed: set[str] = set()
    for name in op.per_feature:
        if given[name] is not None:
            what = "the normalized shape of x"
            infos[name] = _check_companion(name, given[name], xi, norm_shape, FLOATS, what)
            if infos[name].dtype not in taken:
                composed.add(name)  # converted to the compute dtype (normlab.parameters)
    weight_offset = _weight_offset(op, given.get("weight_offset", 0.0), given.get("weight"))
    if weight_offset:
        composed.add("weight_offset")
    casting = _casting(op, given.get("casting", "exact"), weight_offset)
    if given.get("weight") is None:
        casting = "exact"  # the orders differ only in where the weight multiply happens
    weight_dtype = infos["weight"].dtype if casting != "exact" else None
    y_dtype = casting_y_dtype(casting, xi.dtype, weight_dtype)
    quantize = quantize_mode(given.get("quantize"))
    quantize_scale = static_scale(given.get("quantize_scale"), quantize)
    check_family(quantize, xi.family)
    if quantize is not None and CASTINGS[casting].unquantizable is not None:
        served = " or ".join(repr(c.name) for c in CASTINGS.values() if c.unquantizable is None)
        raise ArgumentError(
            f"quantize= with casting={casting!r} is not served: "
            f"{CASTINGS[casting].unquantizable}; use casting={served}"
        )
    eps = _eps(op, given.get("eps"), compute)
    return_stats = given.get("return_stats", False)
    if not isinstance(return_stats, bool):
        raise ArgumentTypeError(f"return_stats must be True or False, got {return_stats!r}")
    permutation = batch_axes + axes
    permutation_or_none = None if permutation == tuple(range(xi.ndim)) else permutation
    requires_grad = any(info.requires_grad for info in infos.values())
    out = given.get("out")
    if requires_grad and op.base is not None and (out is not None or residual_out is not None):
        raise ArgumentError(
            f"out= and residual_out= cannot be used when an input of {op.name} requires grad "
            "(the results would be detached); leave them None"
        )
    strides = {
        name: layout.row_view_strides(infos[name].shape, infos[name].strides, batch_axes, axes)
        for name in op.like_x
    }
    heads = (
        (("y", y_dtype),)
        if quantize is None
        else (("q", q_dtype(quantize, xi.family)), ("scale", "float32"))
    )
    outputs = _check_out(op, out, xi, return_stats, stats_shape, compute, heads)
    if residual_out is not None:
        outputs["h"] = _check_out_array("residual_out", residual_out, xi, xi.shape, h_dtype)
    for name in ("y", "h"):
        oi = outputs.get(name)
        if oi is not None:  # written through a temporary in non-native byte order
            native = oi.native_byte_order
            strides[name] = (
                layout.row_view_strides(oi.shape, oi.strides, batch_axes, axes) if native else None
            )
    weight, bias = (infos.get(name) for name in ("weight", "bias"))
    plan = _plan(
        op,
        xi,
        axes,
        None if weight is None else weight.dtype,
        None if bias is None else bias.dtype,
        eps,
        return_stats=return_stats,
        requires_grad=requires_grad,
        return_residual=return_residual,
        weight_offset=weight_offset,
        residual_dtype=None if h_dtype == xi.dtype else h_dtype,
    )
    return Call(
        op=op,
        plan=plan,
        permutation=permutation_or_none,
        inverse=None
        if permutation_or_none is None
        else tuple(permutation.index(a) for a in range(xi.ndim)),
        permuted_shape=tuple(xi.shape[a] for a in permutation),
        stats_shape=tuple(xi.shape[a] for a in batch_axes) + (1,) * len(axes),
        strides=strides,
        non_native=frozenset(name for name, i in infos.items() if not i.native_byte_order),
        outputs=frozenset(outputs),
        needs=needs,
        parameters=frozenset(composed),
        residual_stream=h_dtype != xi.dtype,
        casting=casting,
        quantize=quantize,
        quantize_scale=quantize_scale,
        reshaped=bool(composed)
        or h_dtype != xi.dtype
        or casting != "exact"
        or quantize is not None,
    )


def row_call(
    op: Op,
    family: str,
    dtype: str,
    device: str,
    device_kind: str,
    rows: int,
    cols: int,
    weight_dtype: str | None,
    bias_dtype: str | None,
    eps: float,
    strides: tuple[tuple[int, int], ...],
    needs: frozenset[str],
) -> Call:
    """The :class:`Call` of ``op`` on 2-D rows of ``dtype`` that a call validated already
    (normlab's torch custom ops run a backend on the rows of such a call, at the traced row
    count or, exported with dynamic shapes, at another): the x-like inputs' row ``strides`` in
    ``op.like_x`` order, 1-D statistics, statistics returned by forward ops (a backward op needs
    them), a fused op's ``h`` written, nothing requiring grad, no outputs given. No rule runs
    (the caller's call passed them); cached, so a repeated kind of rows gets the same call and
    plan."""
    return _row_call(op, family, dtype, device, device_kind, rows, cols, weight_dtype,
                     bias_dtype, eps, strides, needs)  # fmt: skip


@functools.lru_cache(maxsize=_ROW_CALLS)
def _row_call(
    op: Op,
    family: str,
    dtype: str,
    device: str,
    device_kind: str,
    rows: int,
    cols: int,
    weight_dtype: str | None,
    bias_dtype: str | None,
    eps: float,
    strides: tuple[tuple[int, int], ...],
    needs: frozenset[str],
) -> Call:
    rows_info = ArrayInfo(family, "", dtype, (rows, cols), None, 0, device, device_kind)
    plan = _plan(
        op,
        rows_info,
        (1,),
        weight_dtype,
        bias_dtype,
        eps,
        return_stats=not op.gradients,
        requires_grad=False,
        return_residual=op.base is not None,
    )
    return Call(
        op=op,
        plan=plan,
        permutation=None,
        inverse=None,
        permuted_shape=(rows, cols),
        stats_shape=(rows,),
        strides=dict(zip(op.like_x, strides, strict=True)),
        non_native=frozenset(),
        needs=needs,
    )


def _plan(
    op: Op,
    xi: ArrayInfo,
    axes: tuple[int, ...],
    weight_dtype: str | None,
    bias_dtype: str | None,
    eps: float,
    *,
    return_stats: bool,
    requires_grad: bool,
    return_residual: bool,
    weight_offset: float = 0.0,
    residual_dtype: str | None = None,
) -> Plan:
    """The Plan of a call of ``op`` on x of ``xi`` normalized over ``axes`` (every Plan normlab
    makes is made here)."""
    batch_axes = tuple(a for a in range(len(xi.shape)) if a not in axes)
    normalized_shape = tuple(xi.shape[a] for a in axes)
    compute = stats_dtype_for(xi.dtype)
    return Plan(
        op=op.name,
        family=xi.family,
        device=xi.device,
        device_kind=xi.device_kind,
        dtype=xi.dtype,
        shape=xi.shape,
        axes=axes,
        batch_axes=batch_axes,
        normalized_shape=normalized_shape,
        rows=math.prod(xi.shape[a] for a in batch_axes),
        cols=math.prod(normalized_shape),
        compute_dtype=compute,
        stats_dtype=compute,
        weight_dtype=weight_dtype,
        bias_dtype=bias_dtype,
        eps=eps,
        return_stats=return_stats,
        requires_grad=requires_grad,
        return_residual=return_residual,
        weight_offset=weight_offset,
        residual_dtype=residual_dtype,
    )


# --------------------------------------------------------------------------------------------
# Arguments other than arrays


def _check_needs(op: Op, needs: Any) -> frozenset[str]:
    known = op.gradients
    if isinstance(needs, str) or not isinstance(needs, (tuple, list, set, frozenset)):
        raise ArgumentTypeError(
            f"needs must be a tuple of gradient names ({', '.join(map(repr, known))}), "
            f"got {needs!r}"
        )
    unknown = [n for n in needs if n not in known]
    if unknown:
        raise ArgumentError(
            f"needs names {', '.join(map(repr, unknown))}; {op.name} returns gradients for "
            f"{', '.join(map(repr, known))}"
        )
    return frozenset(needs)


def _check_residual_arguments(return_residual: Any, residual_out: Any) -> None:
    """A fused op's ``return_residual`` and ``residual_out`` agree with each other."""
    if not isinstance(return_residual, bool):
        raise ArgumentTypeError(f"return_residual must be True or False, got {return_residual!r}")
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


def _weight_offset(op: Op, offset: Any, weight: Any) -> float:
    """The call's weight offset (the weight is used as ``offset + weight``): a finite real
    number, nonzero only with a weight; 0 for an op without one."""
    if "weight_offset" not in op.index:
        return 0.0
    value = finite_float("weight_offset", offset, "finite")
    if value and weight is None:
        raise ArgumentError(
            f"weight_offset={offset!r} was given without a weight: the offset is added to the "
            "weight (y = x̂ · (weight_offset + weight)); pass the weight (zeros for "
            "x̂ · weight_offset)"
        )
    return value


def _casting(op: Op, casting: Any, weight_offset: float) -> str:
    """The call's casting order (:mod:`normlab.spec.casting`): one of CASTINGS; a composed one
    takes no weight offset (Gemma's offset weights use the exact order)."""
    if "casting" not in op.index:
        return "exact"
    if not isinstance(casting, str):
        raise ArgumentTypeError(f"casting must be one of {', '.join(CASTINGS)}; got {casting!r}")
    if casting not in CASTINGS:
        raise ArgumentError(f"casting must be one of {', '.join(CASTINGS)}; got {casting!r}")
    if casting != "exact" and weight_offset:
        raise ArgumentError(
            f"weight_offset={weight_offset!r} with casting={casting!r}: models with offset "
            "weights (Gemma) multiply in float32 and round once, casting='exact'"
        )
    return casting


def _eps(op: Op, eps: Any, compute: str) -> float:
    """The eps of the call: 0 for an op without one; the op's default rule for None (its
    ``default_eps`` is None: the compute dtype's machine epsilon, as torch's rms_norm)."""
    if not op.takes_eps:
        return 0.0
    if eps is None and op.default_eps is None:
        return MACHINE_EPS[compute]
    if eps is not None and type(eps) is not float and arrays.is_array(eps):
        eps = eps_value(eps)
    return _check_eps(eps)


def eps_value(eps: Any) -> Any:
    """A one-element host array given as eps (a 0-d NumPy array, a CPU tensor), as a Python
    number, so that the call is keyed by its value and not by the array object."""
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
    return finite_float("eps", eps, "finite and >= 0", at_least=0.0)


def _as_int_tuple(name: str, value: Any) -> tuple[int, ...]:
    items = (value,) if not isinstance(value, Sequence) or isinstance(value, str) else value
    try:
        if any(isinstance(v, bool) for v in items):
            raise TypeError
        return tuple(operator.index(v) for v in cast("Sequence[Any]", items))
    except TypeError:
        raise ArgumentTypeError(
            f"{name} must be an int or a tuple of ints, got {value!r}"
        ) from None


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


# --------------------------------------------------------------------------------------------
# Arrays


def _array_info(name: str, value: Any) -> ArrayInfo:
    if type(value).__module__.split(".")[0] == "pandas":
        raise DtypeError(
            f"{name} is a pandas {type(value).__name__}; normlab takes arrays: convert with "
            f"`{name}.to_numpy()` (normalizing a table's rows over its columns)"
        )
    if not arrays.is_array(value):
        raise ArgumentTypeError(
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


# --------------------------------------------------------------------------------------------
# Outputs


def _check_out(
    op: Op,
    out: Any,
    xi: ArrayInfo,
    return_stats: bool,
    stats_shape: tuple[int, ...],
    stats_dtype: str,
    heads: tuple[tuple[str, str], ...],
) -> dict[str, ArrayInfo]:
    """The outputs given in ``out``, by name, each checked: ``heads`` are the ``(name, dtype)``
    of what comes before the statistics — ``y`` alone, of x's shape, or for quantized outputs
    ``q`` (x's shape) and ``scale`` (the statistics' shape) — and ``out`` is the first of them
    alone or a tuple of them all (and the statistics with ``return_stats``), None entries
    allocated."""
    if out is None:
        return {}
    names = (*(name for name, _ in heads), *(op.stats_outputs if return_stats else ()))
    if isinstance(out, tuple) and (len(names) == 1 or len(out) != len(names)):
        if len(heads) == 1:
            raise ArgumentError(
                f"out may be a tuple only with return_stats=True, as "
                f"({', '.join(('y', *op.stats_outputs))}) with None for entries to allocate; "
                f"got a tuple of {len(out)}"
            )
        raise ArgumentError(
            f"out of a call with quantize= is {names[0]} or a tuple ({', '.join(names)}) with "
            f"None for entries to allocate; got a tuple of {len(out)}"
        )
    if xi.requires_grad:
        raise ArgumentError(
            "out= cannot be used when x requires grad (the result would be detached)"
        )
    entries = out if isinstance(out, tuple) else (out,)
    dtypes = {**dict(heads), **dict.fromkeys(op.stats_outputs, stats_dtype)}
    outputs: dict[str, ArrayInfo] = {}
    for name, o in zip(names, entries, strict=False):  # a bare out: the first alone
        if o is None:
            continue
        first = name == names[0]
        what = "out" if first and (name == "y" or not isinstance(out, tuple)) else f"out ({name})"
        shape = xi.shape if first else stats_shape
        outputs[name] = _check_out_array(what, o, xi, shape, dtypes[name])
    return outputs


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
    if oi.strides is not None and overlaps_itself(oi.shape, oi.strides):
        raise ArgumentError(
            f"{name}'s elements overlap each other (shape {oi.shape}, strides {oi.strides} in "
            "elements): a result could not be written into it; pass an array whose elements "
            "each have memory of their own"
        )
    if oi.requires_grad:
        raise ArgumentError(f"{name} requires grad; normlab cannot write into it in place")
    return oi
