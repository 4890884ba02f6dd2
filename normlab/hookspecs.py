"""The plugin interface: one pluggy hook that returns backend records.

A plugin (a module or object) implements::

    import normlab

    @normlab.hookimpl
    def normlab_backends():
        return [normlab.BackendRecord(name="mine", module="my_pkg.kernels", ...)]

and is found through the ``normlab`` entry-point group, the ``NORMLAB_PLUGINS`` environment
variable, or :func:`normlab.register_plugin`. A record is static metadata: normlab imports
``module`` (and with it the array library) only when the backend is first used.

The module named by a record defines, for each op in ``ops``, a function of that name::

    def layer_norm(x, weight, bias, *, plan, out):
        '''x: 2-D (plan.rows, plan.cols) array of the backend's family, rows normalized
        independently; weight/bias: 1-D (plan.cols,) contiguous arrays or None; out: None, or
        a 2-D array to write y into (only passed when the record claims "out").
        Returns (y, mean, rstd): y 2-D in x's dtype (``out`` itself when given); mean and rstd
        1-D (plan.rows,) in plan.stats_dtype when plan.return_stats, else None.'''

and, for ``rms_norm``, ``rms_norm(x, weight, *, plan, out)`` returning ``(y, rstd)`` (a record
with ``kernel_form=1``, the form of plugins written before it: the signature of
``layer_norm``, ``bias`` always None, returning ``(y, None, rstd)``); for the fused
residual-add ops::

    def add_layer_norm(x, residual, weight, bias, *, plan, out, residual_out):
        '''h = x + residual rounded to x's dtype (bitwise the unfused add), then y = layer_norm(h)
        on that rounded h. residual: 2-D like x. When plan.return_residual, h is written into
        residual_out (2-D like x) or a new array, else h is never written and None is returned
        for it. Returns (y, h, mean, rstd).'''

and ``add_rms_norm(x, residual, weight, *, plan, out, residual_out)`` likewise, returning
``(y, h, rstd)`` (``kernel_form=1``: a ``bias`` always None, returning ``(y, h, None, rstd)``);
with
``inplace``, ``out`` may be the memory of ``x`` or ``residual`` and ``residual_out`` that of
``residual`` or ``x`` (never both the same); for the backward ops::

    def layer_norm_backward(dy, x, mean, rstd, weight, *, plan, needs):
        '''dy, x: 2-D (plan.rows, plan.cols) arrays, read as the record's capabilities allow (a
        C-contiguous copy is made otherwise); mean, rstd: 1-D (plan.rows,) in plan.stats_dtype
        (what the forward returned); weight: 1-D (plan.cols,) or None; needs: a frozenset of
        "x", "weight", "bias". Per row, with x̂ = (x - mean) * rstd and g = dy * weight (g = dy
        without weight): dx = rstd * (g - mean(g) - x̂ * mean(g * x̂)); summed over rows:
        dweight = Σ dy * x̂, dbias = Σ dy, deterministically (no atomics, an order that
        depends on the shape alone, never on the thread count), float16/bfloat16 in float32.
        Returns (dx, dweight, dbias): dx 2-D in x's dtype, dweight and dbias 1-D (plan.cols,)
        in plan.compute_dtype; None for what is not in needs.'''

and ``rms_norm_backward(dy, x, rstd, weight, *, plan, needs)`` likewise with x̂ = x * rstd and
dx = rstd * (g - x̂ * mean(g * x̂)), returning ``(dx, dweight)``. (The op table,
:mod:`normlab.ops`, lists each op's ``kernel_arrays`` and ``kernel_returns``.) Plus
``to_numpy(array) -> numpy.ndarray`` and
``from_numpy(ndarray, like=None)`` (the conformance suite drives every backend through these
two; ``like`` is an array whose device the result should share). Optionally
``explain(x, *, plan) -> str``: lines that :func:`normlab.explain` adds about this backend's
handling of ``x`` (a rechunk, a copy). Optionally ``prepare(op, plan) -> f | None``: for a
forward call whose x-like inputs the backend reads as they are, without ``out``,
``residual_out`` or statistics, a function of the op's arrays (``f(x, weight, bias)``, for the
fused ops ``f(x, residual, weight, bias)``) returning exactly what the op's function returns
for them with its outputs None. The core asks once per call layout and calls ``f`` for every
later call of that layout (None: the op's function, as without ``prepare``), so ``f`` does the
plan's work once; it checks what the plan does not settle (strides, alignment, a weight to
convert) and hands such calls to the op's function.

A backend whose record claims ``"quantize"`` also defines, for the forward and fused ops it
serves, one function writing quantized outputs (:mod:`normlab.quantize`)::

    def quantized(x, residual, weight, bias, *, plan, residual_out):
        '''plan.op's y computed in float32 (never rounded to x's dtype; float64 x: its y
        rounded to float32) and quantized as plan.quantize says: per row s =
        plan.quantize_scale, or max|y_row| / 127 (int8) or / 448 (fp8_e4m3) when it is None;
        q = clip(rint(y / s), ±127) (NaN: 0) or clip(y / s, ±448) rounded to nearest even in
        e4m3fn; q = 0 where s = 0. x, residual (None for layer_norm/rms_norm): 2-D
        C-contiguous like x; weight, bias as for the op; residual_out: None, or a 2-D
        C-contiguous array to write h into (fused ops with plan.return_residual).
        Returns (q, scale, h): q 2-D (plan.rows, plan.cols), int8 or float8 e4m3fn (bits as
        uint8 where the family has no float8 dtype); scale 1-D (plan.rows,) float32; h the
        fused op's h (residual_out itself when given; None for the other ops or without
        plan.return_residual).'''

Its results are bitwise those of the backend's own ``plan.op`` of float32 x (parameters as
given) quantized by normlab's reference quantizer; the core calls it only for calls without
statistics, gradients or casting order, on C-contiguous rows, and composes the others.

A record may also name, in ``inspector``, an :class:`normlab.arrays.Inspector` subclass for the
arrays of its ``families``: how normlab reads their metadata (dtype, shape, strides, device) and
the few layout operations it performs on them (permute, reshape, contiguous, copy into, cast).
It is imported when normlab first meets an array of such a family. A record listing the family
:data:`ARRAY_API` serves, besides, the arrays of every library that normlab reads through the
Array API standard (exposes ``__array_namespace__``, no inspector of its own).

The :class:`~normlab.Plan` a backend receives is public (``normlab.Plan``); a backend may read
the fields in :data:`PLAN_FIELDS` (docs/plugins.md says what each means): ``op``, ``rows``,
``cols``, ``arithmetic`` (what the op computes: :class:`normlab.ops.Arithmetic`, its norm,
direction and the steps before and after the norm; read it rather than the op's name),
``family``, ``requires_grad``, ``dtype``, ``compute_dtype``, ``stats_dtype``, ``eps``,
``return_stats``,
``weight_dtype``, ``bias_dtype``, ``has_weight``, ``has_bias``, ``weight_offset``,
``residual_dtype``, ``quantize``, ``quantize_scale``, ``device``, and for context ``shape``,
``axes``, ``batch_axes`` and
``normalized_shape`` (the caller's view of the call).
The rest of a Plan is the core's routing.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import pluggy

from normlab.errors import ArgumentError
from normlab.ops import OPS, Arithmetic
from normlab.scalars import finite_float, shown

__all__ = [
    "ARRAY_API",
    "CAPABILITIES",
    "PLAN_FIELDS",
    "PROJECT",
    "BackendRecord",
    "CostModel",
    "Plan",
    "cost_table",
    "hookimpl",
    "hookspec",
    "normlab_backends",
]

PROJECT: Final = "normlab"
hookspec: Final = pluggy.HookspecMarker(PROJECT)
hookimpl: Final = pluggy.HookimplMarker(PROJECT)

#: What a backend may claim beyond reading C-contiguous rows.
CAPABILITIES: Final = frozenset(
    {
        "strided",  # reads a 2-D view with any row and column strides, without a copy
        "row_strided",  # reads a 2-D view with any row stride and unit column stride
        "out",  # writes into a caller's 2-D ``out`` (with the same stride rules as x)
        "inplace",  # ``out`` may be the very memory of ``x``
        "autograd",  # records torch's autograd graph itself (without it, a backend that
        # provides an op's backward op is run by the core through normlab's custom ops)
        "weight_offset",  # applies ``plan.weight_offset`` itself: y = x̂ · (offset + weight)
        # (without it, the core passes ``offset + weight`` as the weight, and an offset of 0)
        "residual_stream",  # fused ops: takes a float32 residual (and residual_out) beside
        # half x, ``plan.residual_dtype``: h = float32(x) + residual kept in float32, y the
        # norm of that h in x's dtype (without it, the core adds h and runs the base op on it)
        "parameter_dtypes",  # takes a weight and bias of any float dtype, each its own
        # (``plan.weight_dtype``, ``plan.bias_dtype``), and computes with them converted to the
        # compute dtype; parameter gradients in the compute dtype (without it, the core passes
        # such parameters converted)
        "quantize",  # forward and fused ops: writes quantized outputs itself (the module's
        # ``quantized`` function, ``plan.quantize``/``plan.quantize_scale``; without it, the
        # core quantizes the backend's float32 y)
    }
)


#: The pseudo-family of a record serving any library's arrays through the Array API standard:
#: those of a family that exposes ``__array_namespace__`` and that normlab has no inspector for
#: (``normlab.arrays.array_api_families``); never NumPy, PyTorch, CuPy, JAX or Dask arrays.
ARRAY_API: Final = "array_api"


@dataclass(frozen=True, slots=True)
class Plan:
    """A validated normalization call, as a backend sees it (the fields in :data:`PLAN_FIELDS`).

    The normalized axes (``axes``) are reduced; the other axes (``batch_axes``) index rows.
    ``rows``/``cols`` are the sizes of the 2-D problem a backend sees: the array viewed with the
    batch axes first and the normalized axes last, then as ``(rows, cols)``. Statistics are
    computed in ``compute_dtype`` and returned in ``stats_dtype``. How the core makes those rows
    (permutation, strides, copies, ``out``, byte order, caches) is the core's own
    :class:`normlab.spec.Call`.
    """

    op: str
    family: str
    device: str
    device_kind: str
    dtype: str
    shape: tuple[int, ...]
    axes: tuple[int, ...]
    batch_axes: tuple[int, ...]
    normalized_shape: tuple[int, ...]
    rows: int
    cols: int
    compute_dtype: str
    stats_dtype: str
    weight_dtype: str | None
    bias_dtype: str | None
    eps: float
    return_stats: bool
    requires_grad: bool
    #: Fused ops (``add_layer_norm``/``add_rms_norm``): whether ``h = x + residual`` is written
    #: and returned (False: the post-norm form, ``h`` never written). False for other ops.
    return_residual: bool = False
    #: The weight is used as ``weight_offset + weight``, formed in ``compute_dtype`` (Gemma's
    #: RMSNorm, Transformer Engine's ``zero_centered_gamma``: 1.0). Nonzero only for a backend
    #: that declares the capability ``"weight_offset"``; the others get the sum as the weight.
    weight_offset: float = 0.0
    #: Fused ops: the dtype of ``residual`` and of ``h`` when it is not x's (float32 beside
    #: float16/bfloat16 x: a float32 residual stream, ``h = float32(x) + residual`` kept in
    #: float32 and ``y`` the norm of that ``h`` in x's dtype). Set only for a backend that
    #: declares the capability ``"residual_stream"``; None otherwise.
    residual_dtype: str | None = None
    #: Quantized outputs (``quantize=``): the mode (``"int8"``, ``"fp8_e4m3"``) and the static
    #: scale (a float32 value; None: per row, dynamic). Set only for the ``quantized`` function
    #: of a backend that declares the capability ``"quantize"``; None otherwise.
    quantize: str | None = None
    quantize_scale: float | None = None

    @property
    def arithmetic(self) -> Arithmetic:
        """What the op computes (its row of the op table, :mod:`normlab.ops`)."""
        return OPS[self.op].arithmetic

    @property
    def has_weight(self) -> bool:
        return self.weight_dtype is not None

    @property
    def has_bias(self) -> bool:
        return self.bias_dtype is not None

    @property
    def stats_shape(self) -> tuple[int, ...]:
        """Shape of ``mean``/``rstd`` as returned to the caller: x's shape, 1 on normalized axes."""
        return tuple(1 if a in self.axes else n for a, n in enumerate(self.shape))

    @property
    def empty(self) -> bool:
        return self.rows == 0 or self.cols == 0


#: The fields of a :class:`~normlab.Plan` a backend may read.
PLAN_FIELDS: Final = (
    "op",
    "arithmetic",
    "family",
    "requires_grad",
    "rows",
    "cols",
    "dtype",
    "compute_dtype",
    "stats_dtype",
    "eps",
    "return_stats",
    "return_residual",
    "weight_dtype",
    "bias_dtype",
    "has_weight",
    "has_bias",
    "weight_offset",
    "residual_dtype",
    "quantize",
    "quantize_scale",
    "device",
    "shape",
    "axes",
    "batch_axes",
    "normalized_shape",
)


@dataclass(frozen=True, slots=True)
class CostModel:
    """The time of one call on a backend: ``fixed_us + x_bytes / bytes_per_us[dtype]``
    microseconds, where ``x_bytes`` is the size of x (rows x cols x itemsize) and
    ``bytes_per_us`` the sustained rate per dtype name (a dtype not listed: no estimate).

    ``measured`` (optional) holds, per dtype, the timings the model was fitted from, as
    ``(x_bytes, us)`` pairs sorted by size. Where a dtype has them the estimate follows them
    instead of the line: log-log interpolation between neighbours, the smallest call's time
    below them, time proportional to size beyond them. A straight line cannot follow a
    backend whose rate falls off past some size (torch page-faulting fresh outputs of 32 MiB
    and more); the points can. Fitted from timings of the backend on this kind of machine
    (``normlab calibrate``)."""

    fixed_us: float
    bytes_per_us: Mapping[str, float]
    measured: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)

    def estimate_us(self, x_bytes: float, dtype: str) -> float | None:
        """The estimated time of a call on ``x_bytes`` bytes of x, or None for another dtype."""
        points = self.measured.get(dtype)
        if points:
            return _interpolated_us(points, x_bytes)
        rate = self.bytes_per_us.get(dtype)
        return None if rate is None else self.fixed_us + x_bytes / rate


def _interpolated_us(points: tuple[tuple[float, float], ...], x_bytes: float) -> float:
    """The time at ``x_bytes`` along measured ``(x_bytes, us)`` points sorted by size."""
    first_bytes, first_us = points[0]
    if x_bytes <= first_bytes:
        return first_us
    for (low_bytes, low_us), (high_bytes, high_us) in itertools.pairwise(points):
        if x_bytes <= high_bytes:
            along = math.log(x_bytes / low_bytes) / math.log(high_bytes / low_bytes)
            return low_us * math.pow(high_us / low_us, along)
    last_bytes, last_us = points[-1]
    return last_us * x_bytes / last_bytes


def cost_table(data: Any) -> dict[str, dict[str, CostModel]]:
    """Cost models from their JSON form, ``{"backends": {name: {op: {"fixed_us": f,
    "bytes_per_us": {dtype: rate}, "measured": {dtype: [[x_bytes, us], ...]}}}}}`` (measured
    optional) → ``{name: {op: CostModel}}``; ArgumentError (a ValueError) naming what is
    malformed (every number finite and >= 0, every rate, size and time > 0, sizes
    increasing)."""
    try:
        table = {
            name: {
                op: _cost_model(e["fixed_us"], e["bytes_per_us"], e.get("measured", {}))
                for op, e in ops.items()
            }
            for name, ops in data["backends"].items()
        }
    except ArgumentError:
        raise
    except (KeyError, TypeError, AttributeError) as exc:
        raise ArgumentError(f"not a cost table: {type(exc).__name__}: {exc}") from None
    return table


def _cost_model(fixed_us: Any, rates: Any, measured: Any) -> CostModel:
    fixed = _cost("fixed_us", fixed_us, positive=False)
    speeds = {str(k): _cost(f"bytes_per_us[{k!r}]", v, positive=True) for k, v in rates.items()}
    return CostModel(
        fixed,
        speeds,
        {str(dtype): _measured_points(dtype, p) for dtype, p in measured.items()},
    )


def _measured_points(dtype: Any, points: Any) -> tuple[tuple[float, float], ...]:
    """``points`` as ``(x_bytes, us)`` float pairs; ArgumentError (a ValueError) unless each is
    two finite numbers > 0 and the sizes increase."""
    pairs = tuple(tuple(pair) for pair in points)
    rule = "(x_bytes, us) pairs of finite numbers > 0, sizes increasing"
    if any(len(pair) != 2 for pair in pairs):
        raise ArgumentError(f"measured {dtype}: {rule}, got {shown(points)}")
    floats = tuple(
        (_cost(f"measured {dtype}", size, True), _cost(f"measured {dtype}", us, True))
        for size, us in pairs
    )
    if any(a[0] >= b[0] for a, b in itertools.pairwise(floats)):
        raise ArgumentError(f"measured {dtype}: {rule}, got {shown(points)}")
    return floats


def _cost(name: str, value: Any, positive: bool) -> float:
    """A number of a cost table as a float: finite and >= 0 (> 0 if ``positive``); else an
    ArgumentError (a ValueError) naming it (:func:`normlab.scalars.finite_float`)."""
    rule = "finite and > 0" if positive else "finite and >= 0"
    number = finite_float(name, value, rule, at_least=0.0)
    if positive and number == 0:
        raise ArgumentError(f"{name} must be {rule}, got {shown(value)}")
    return number


@dataclass(frozen=True, slots=True)
class BackendRecord:
    """Static description of one backend, as returned by the ``normlab_backends`` hook.

    Attributes:
        name: unique backend name (``backend="name"`` selects it).
        module: where the op functions and the NumPy converters live: the import path of a
            module (``"pkg.mod"``), or of an object in it (``"pkg.mod:attr"``).
        families: array families served by default (``"numpy"``, ``"torch"``, ``"cupy"``, …).
        devices: device kinds served (``"cpu"``, ``"cuda"``).
        dtypes: dtype names served (``"float16"``, ``"bfloat16"``, ``"float32"``, ``"float64"``).
        ops: op names provided: any of ``"layer_norm"``, ``"rms_norm"``,
            ``"layer_norm_backward"``, ``"rms_norm_backward"``.
        priority: higher wins among backends that can serve an array.
        capabilities: a subset of :data:`CAPABILITIES`.
        explicit_families: further families served only when the caller names this backend
            (zero-copy service of another library's arrays, e.g. numba for torch CPU tensors).
        check: called lazily (never at ``import normlab``); returns ``None`` when the backend can
            run here, else the reason it cannot ("numba is not installed", "no CUDA device").
        library: the distribution whose version ``normlab info`` shows (``"numba"``).
        description: one line for ``normlab info``.
        flushes_subnormals: ``True`` when the backend's platform flushes subnormal inputs or
            results to zero (XLA on the CPU does): the contract's range then excludes subnormal
            inputs for this backend, and the conformance suite skips its subnormal cases,
            saying so.
        batch_invariant: ``True`` (the contract's promise): a row's results are bitwise the same
            whatever the number of rows, its position, its neighbours, x's strides, ``out=``
            and the thread count. ``False`` declares that the backend cannot promise it: the
            suite's batch-invariance area is skipped, saying so, and ``normlab info`` says it.
        zero_copy_families: further families the backend serves without a copy on the same
            device, eligible by default (unlike ``explicit_families``): the dispatcher picks
            between it and the family's own backend by cost when both declare a cost model.
        costs: the :class:`CostModel` of one call, per op name (``"layer_norm"``) or per op and
            family (``"layer_norm:torch"``, preferred when both are given); the dispatcher
            compares the estimates of able backends that both declare one (else priority
            decides).
            ``normlab calibrate`` measures them on the user's machine, overriding these.
        kernel_form: the signatures of the module's op functions (:data:`normlab.ops.
            KERNEL_FORMS`): 2, RMSNorm's functions take no bias and return no mean
            (``rms_norm(x, weight, *, plan, out) -> (y, rstd)``); 1 (the default, the form of
            every plugin written before form 2): they take LayerNorm's arguments, a bias always
            None, and return ``(y, None, rstd)``. The core calls each backend in its own form.
        inspector: the import path (``"pkg.mod:Class"``) of a :class:`normlab.arrays.Inspector`
            subclass for the arrays of ``families``, imported when normlab first meets one;
            ``None``: normlab's own (NumPy, PyTorch and CuPy arrays always get normlab's own).
            Among records supplying one for a family, the highest priority wins.
    """

    name: str
    module: str
    families: frozenset[str]
    devices: frozenset[str]
    dtypes: frozenset[str]
    ops: frozenset[str] = frozenset({"layer_norm"})
    priority: int = 0
    capabilities: frozenset[str] = frozenset()
    explicit_families: frozenset[str] = frozenset()
    check: Callable[[], str | None] | None = None
    library: str | None = None
    description: str = ""
    flushes_subnormals: bool = False
    batch_invariant: bool = True
    zero_copy_families: frozenset[str] = frozenset()
    costs: Mapping[str, CostModel] = field(default_factory=dict, hash=False)
    inspector: str | None = None
    kernel_form: int = 1


@hookspec
def normlab_backends() -> list[BackendRecord]:  # type: ignore[empty-body]
    """Return the backend records this plugin provides."""
