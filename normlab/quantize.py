"""Quantized outputs: the forward and fused ops returning ``(q, scale)`` in place of y.

In W8A8 serving every norm feeds a quantized matmul. With ``quantize="int8"`` or
``"fp8_e4m3"`` (:mod:`normlab.spec.quantize`) an op returns q, x's shape in the mode's dtype,
and scale, float32 with the statistics' keepdims shape, such that ``q · scale ≈ y``:

- y is the op's y in float32, never rounded to x's dtype: the op of float32 x (its parameters
  as usual); float64 x's y rounded to float32; with ``casting="llama"``, the float32 product of
  x̂ rounded to x's dtype and the weight. A fused op's h is the op's own (x's dtype, or the
  float32 stream), and y the base op's of float32 h;
- scale per row: the static ``quantize_scale`` given, or ``max|y_row| / 127`` (int8) or
  ``/ 448`` (fp8 e4m3fn), a float32 division (NaN in the row: NaN);
- ``v = y / scale`` in float32 (0 where the scale is 0); int8: ``clip(rint(v), -127, 127)``,
  rounded half to even, NaN to 0; fp8: ``clip(v, -448, 448)`` rounded to nearest even in
  e4m3fn (NaN stays NaN).

:func:`reference` is that quantizer in the array's own library; a call is bitwise the chosen
backend's float32 y followed by it. A backend that declares ``"quantize"`` (numba) writes q
and scale in its own pass over each row, with y never in memory (:func:`native`,
:func:`serve`); for the others the core runs the backend's op for y in float32 and quantizes
it (:func:`compose`); :mod:`normlab.pipeline` decides which. Every step is per row: a row's
bits do not depend on its batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import sys
from typing import Any, Final

import array_api_compat

from normlab import arrays, route
from normlab.dispatch import Choice
from normlab.ops import OPS
from normlab.option import BaseRun, Option
from normlab.residual import residual_sum
from normlab.spec import Call
from normlab.spec.aliasing import output_aliasing
from normlab.spec.casting import CASTINGS, promoted
from normlab.spec.quantize import LIMITS, q_dtype

__all__ = ["OPTION", "compose", "e4m3_bits", "native", "q_dtype_of", "reference", "serve"]

#: The smallest normal number of float8 e4m3fn (its largest: ``LIMITS["fp8_e4m3"]``).
_FP8_MIN_NORMAL = 2.0**-6


def native(call: Call, choice: Choice) -> bool:
    """Whether the chosen backend (as the call runs it) can write the quantized outputs of
    ``call`` itself: it declares ``"quantize"``, and the call has no statistics, no graph and
    C-contiguous rows in x's axes (the normalized ones last). It does so only where it takes
    every other option of the call as given too (:mod:`normlab.pipeline`)."""
    plan, op = call.plan, call.op
    return (
        "quantize" in choice.backend.capabilities
        and not plan.return_stats
        and not plan.requires_grad
        and not plan.empty
        and call.permutation is None
        and not call.non_native
        and all(call.strides[name] == (plan.cols, 1) for name in op.like_x)
    )


def serve(call: Call, args: tuple[Any, ...], choice: Choice) -> Any:
    """What the op of ``call`` (with ``quantize``) returns, written by the chosen backend's
    ``quantized`` function: ``(q, scale)``, then h for a fused op with ``return_residual``."""
    outs = _outputs(call, args)
    q, scale, h = _native(call, args, choice, _native_plan(call, choice))
    return _returned(call, outs, q, scale, h, ())


def compose(call: Call, args: tuple[Any, ...], choice: Choice, base_run: BaseRun) -> Any:
    """What the op of ``call`` (with ``quantize``) returns, composed by the core: ``(q,
    scale)``, then h for a fused op with ``return_residual``, then the statistics with
    ``return_stats``; ``base_run`` runs the op for y in float32 (the public route, where it is
    chosen afresh: ``choice``, the call's, is not used)."""
    outs = _outputs(call, args)
    given = dict(zip(call.op.arguments, args, strict=True))
    q, scale, h, stats = _composed(call, given, outs, base_run)
    return _returned(call, outs, q, scale, h, stats)


def described(call: Call, choice: Choice, natively: bool) -> str:
    """explain()'s line on the quantized outputs of ``call``: the mode, the scale, who
    quantizes."""
    scale = (
        "dynamic per-row scale"
        if call.quantize_scale is None
        else f"static scale {call.quantize_scale!r}"
    )
    if natively:
        return (
            f"{call.quantize}, {scale}; {choice.backend.name} writes q and scale in its own pass "
            "over each row (y never in memory)"
        )
    base = call.op.base or call.op.name
    return (
        f"{call.quantize}, {scale}; the core runs {base} for y in float32 (explain it without "
        "quantize= for its choice) and quantizes it with x's library"
    )


def _outputs(call: Call, args: tuple[Any, ...]) -> dict[str, Any]:
    """The caller's arrays for q, scale and the statistics, by name (checked for overlaps with
    the inputs and h); empty when the call gives none."""
    if not call.outputs:
        return {}
    op, plan = call.op, call.plan
    given = dict(zip(op.arguments, args, strict=True))
    out = given["out"]
    entries = out if isinstance(out, tuple) else (out,)
    names = ("q", "scale", *(op.stats_outputs if plan.return_stats else ()))
    outs = dict(zip(names, entries, strict=False))
    inputs = {name: given[name] for name in op.arrays}
    output_aliasing(op, inputs, {**outs, "h": given.get("residual_out")})
    return outs


def _returned(
    call: Call, outs: dict[str, Any], q: Any, scale: Any, h: Any, stats: tuple[Any, ...]
) -> Any:
    """The call's results: q and scale (in the caller's arrays when given), h when returned,
    then the statistics."""
    if outs:
        q = _into(outs.get("q"), q)
        scale = _into(outs.get("scale"), scale)
    head = (q, scale, h) if call.plan.return_residual else (q, scale)
    return (*head, *stats)


def _native_plan(call: Call, choice: Choice) -> Any:
    """The plan the chosen backend's ``quantized`` function gets for ``call``: with
    ``quantize`` and ``quantize_scale`` set; cached on the call, per backend."""
    key = ("quantized", choice.backend)
    if key not in call.routes:
        call.routes[key] = dataclasses.replace(
            call.plan, quantize=call.quantize, quantize_scale=call.quantize_scale
        )
    return call.routes[key]


def _composed(
    call: Call,
    given: dict[str, Any],
    outs: dict[str, Any],
    base_run: BaseRun,
) -> tuple[Any, Any, Any, tuple[Any, ...]]:
    """q, scale, h (None for an op without) and the statistics: the backend's y in float32,
    then :func:`reference`."""
    op, plan = call.op, call.plan
    x = given["x"]
    h = None
    source = x
    if op.base is not None:
        h = source = residual_sum(call, given)
    base = OPS[op.base] if op.base is not None else op
    float32 = _library_dtype(x, "float32")
    widened = {**given}
    if plan.requires_grad:  # q and scale are not differentiable: y is formed outside the graph
        source = arrays.detach(source)
        for name in op.per_feature:
            if given[name] is not None:
                widened[name] = arrays.detach(given[name])
    weight = widened["weight"]
    rounds_in_x_dtype = CASTINGS[call.casting].normalized == "x"
    if rounds_in_x_dtype:  # x̂ alone, of x itself (the weight multiplies it below)
        widened.update(weight=None, casting="exact")
    elif arrays.info(source).dtype != "float64":
        source = arrays.astype(source, float32)
    stats_out = tuple(outs.get(name) for name in op.stats_outputs)
    base_given = {
        **widened,
        "x": source,
        "normalized_shape": None,
        "axis": plan.axes,
        "eps": plan.eps,
        "out": (
            (None, *stats_out)
            if plan.return_stats and any(o is not None for o in stats_out)
            else None
        ),
        "quantize": None,
        "quantize_scale": None,
    }
    result = base_run(base, tuple(base_given[name] for name in base.arguments))
    y, stats = (result[0], tuple(result[1:])) if plan.return_stats else (result, ())
    with _silently(y):  # a float64 y beyond float32's range rounds to inf, as natively
        if rounds_in_x_dtype:
            y = _product_of_rounded(y, weight, x, plan)
        if arrays.info(y).dtype != "float32":
            y = arrays.astype(y, float32)
        q, scale = _quantized(y, call.quantize or "", call.quantize_scale, plan.axes)
    return q, scale, h, stats


def _product_of_rounded(xhat: Any, weight: Any, x: Any, plan: Any) -> Any:
    """y before its quantizer for a casting order that rounds x̂ to x's dtype (``"llama"``):
    ``xhat`` (of a float32 stream's h too) rounded to x's dtype, times the weight in the
    promotion of both and float32, unrounded."""
    if arrays.info(xhat).dtype != plan.dtype:
        xhat = arrays.astype(xhat, x.dtype)
    product = _library_dtype(x, promoted(promoted(plan.dtype, plan.weight_dtype), "float32"))
    # the weight over x's axes: its own on the normalized ones (sorted, as its shape), 1 elsewhere
    spread = tuple(n if a in plan.axes else 1 for a, n in enumerate(plan.shape))
    return arrays.astype(xhat, product) * arrays.reshape(arrays.astype(weight, product), spread)


def _native(
    call: Call, args: tuple[Any, ...], choice: Choice, quantized_plan: Any
) -> tuple[Any, Any, Any]:
    """q, scale and h (None for an op without, or without ``return_residual``) from the
    backend's ``quantized`` function, on 2-D rows of the caller's arrays."""
    op, plan = call.op, call.plan
    index = op.index
    rows = (plan.rows, plan.cols)
    as_rows = plan.shape != rows
    x = args[0]
    residual = given_h = None
    if op.base is not None:
        residual = args[index["residual"]]
        given_h = args[index["residual_out"]]
        if given_h is not None and call.strides["h"] != (plan.cols, 1):
            given_h = None  # written into from a new h below
        if as_rows:
            residual = arrays.reshape(residual, rows)
            given_h = None if given_h is None else arrays.reshape(given_h, rows)
    bias = args[index["bias"]] if "bias" in index else None
    try:
        q, scale, h = choice.backend.function("quantized")(
            arrays.reshape(x, rows) if as_rows else x,
            residual,
            args[index["weight"]],
            bias,
            plan=quantized_plan,
            residual_out=given_h,
        )
    except (Exception, SystemExit) as exc:
        route.reraise(choice.backend, f"{op.name} (quantized)", exc)
    if as_rows:
        q = arrays.reshape(q, plan.shape)
        h = None if h is None else arrays.reshape(h, plan.shape)
    if h is not None and op.base is not None and args[index["residual_out"]] is not None:
        h = _into(args[index["residual_out"]], h)
    return q, arrays.reshape(scale, call.stats_shape), h


def _into(given: Any, result: Any) -> Any:
    """``result`` written into the caller's ``given`` array (returned), or ``result``."""
    if given is None or given is result:
        return result
    arrays.copy_into(given, result)
    return given


def reference(y: Any, mode: str, static: float | None, axes: tuple[int, ...]) -> tuple[Any, Any]:
    """normlab's quantizer: ``(q, scale)`` of float32 ``y`` in ``mode`` (the module docstring
    has the formulas), per row over the normalized ``axes``; ``static``: the scale of every row,
    or None (dynamic). In y's own library, elementwise and per row; silent where IEEE
    arithmetic overflows or meets inf/inf (a tiny static scale, a row of inf): those results
    are the formulas' own."""
    with _silently(y):
        return _quantized(y, mode, static, axes)


def _silently(like: Any) -> contextlib.AbstractContextManager[Any]:
    """A context in which ``like``'s library warns of no floating-point overflow or invalid
    operation (NumPy's ``errstate``; the others do not warn)."""
    if arrays.info(like).family == "numpy":
        return sys.modules["numpy"].errstate(all="ignore")  # type: ignore[no-any-return]
    return contextlib.nullcontext()


def _quantized(y: Any, mode: str, static: float | None, axes: tuple[int, ...]) -> tuple[Any, Any]:
    """:func:`reference` in y's library, whatever it warns. Every array it makes is made like
    one of y's (``*_like``): a tensor that only its library's dispatch knows (a fake tensor)
    gets its like."""
    xp = array_api_compat.array_namespace(y)
    if any(y.shape[a] == 0 for a in axes):  # rows without elements: no value to scale
        scale = xp.full_like(xp.sum(y, axis=axes, keepdims=True), static or 0.0)
    elif static is None:
        amax = xp.max(xp.abs(y), axis=axes, keepdims=True)
        # a NaN makes its row's scale NaN, also where the library's max drops NaN (XLA's CPU
        # max does, its "fast" min/max)
        nan_rows = xp.any(xp.isnan(y), axis=axes, keepdims=True)
        amax = xp.where(nan_rows, xp.full_like(amax, math.nan), amax)
        scale = amax / xp.full_like(amax, LIMITS[mode])
    else:  # the first element of each row: an array of the scale's shape, to make it like
        first = tuple(slice(0, 1) if a in axes else slice(None) for a in range(y.ndim))
        scale = xp.full_like(y[first], static)
    zero = scale == 0
    # divisors of the dividend's own shape: XLA divides by a broadcast divisor through its
    # reciprocal (not IEEE division); a divisor of the same shape it divides exactly
    divisor = xp.broadcast_to(xp.where(zero, xp.ones_like(scale), scale), y.shape)
    v = y / divisor  # 0 where the scale is 0 (below)
    zeros = xp.zeros_like(v)
    if mode == "int8":
        r = xp.clip(xp.round(v), -127.0, 127.0)
        r = xp.where(zero | xp.isnan(r), zeros, r)
        return xp.astype(r, q_dtype_of(y, mode)), scale
    limit = LIMITS[mode]
    r = xp.where(zero, zeros, xp.clip(v, -limit, limit))
    if q_dtype(mode, arrays.info(y).family) == "uint8":  # a library without float8
        return e4m3_bits(r), scale
    return xp.astype(r, q_dtype_of(y, mode)), scale


def e4m3_bits(v: Any) -> Any:
    """The float8 e4m3fn bit patterns (uint8) of float32 ``v`` (a NumPy or CuPy array) already
    within ±448, rounded to nearest even; NaN: 0x7F with v's sign bit. For libraries without a
    float8 dtype."""
    lib = importlib.import_module(type(v).__module__.split(".")[0])
    a = lib.abs(v)
    _, e = lib.frexp(a)  # a = m · 2**e with 0.5 <= m < 1: a's normal exponent is e - 1
    # normal: exponent field e + 6, mantissa rint(a / 2**(e - 4)) - 8 (a carry to 16 moves
    # into the exponent by itself); below 2**-6, units of 2**-9 (8 of them: the smallest normal)
    normal = (e.astype(lib.float32) + 5.0) * 8.0 + lib.rint(lib.ldexp(a, 4 - e))
    subnormal = lib.rint(a * lib.float32(512.0))
    bits = lib.where(a < _FP8_MIN_NORMAL, subnormal, normal)
    bits = lib.where(lib.isnan(v), lib.float32(127.0), bits)
    bits = bits + lib.where(lib.signbit(v), lib.float32(128.0), lib.float32(0.0))
    return bits.astype(lib.uint8)


def q_dtype_of(like: Any, mode: str) -> Any:
    """The dtype object of q for ``mode`` in ``like``'s library."""
    name = q_dtype(mode, arrays.info(like).family)
    xp = array_api_compat.array_namespace(like)
    found = getattr(xp, name, None)
    if found is None:  # NumPy's float8 (checked to be importable: normlab.spec.quantize)
        import ml_dtypes

        found = getattr(ml_dtypes, name)
    return found


def _library_dtype(like: Any, name: str) -> Any:
    """The dtype named ``name`` in ``like``'s library."""
    return getattr(array_api_compat.array_namespace(like), name)


OPTION: Final = Option(
    title="quantized outputs",
    capabilities=frozenset({"quantize"}),
    applies=lambda call: call.quantize is not None,
    native=native,
    describe=described,
    compose=compose,
    serve=serve,
)
