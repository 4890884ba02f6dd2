"""The fused ops on a float32 residual stream beside float16/bfloat16 x.

Models that keep their residual stream in float32 while the blocks compute in half precision
(flash-attention's ``residual_in_fp32``, vLLM's pre-norm residual) add each block's output to
the stream in float32: ``h = float32(x) + residual``, kept in float32 (written to
``residual_out``, returned), and ``y`` is the norm of that unrounded ``h``, in x's dtype.

A backend whose record declares the capability ``"residual_stream"`` (the numba backend) takes
such a call as given (``plan.residual_dtype``: :func:`native`). For the others (and under
normlab's custom ops) the core serves it (:func:`run`): the family's conversion and add, then
the base op (``layer_norm``/``rms_norm``) of the float32 ``h`` as any call of it (validated,
chosen, parameters formed, seen by torch's autograd), then ``y`` rounded to x's dtype (written
into ``out`` when given). Every step is elementwise or per
row, so a row's bits do not depend on its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from normlab import arrays
from normlab.dispatch import Choice
from normlab.ops import OPS, Op
from normlab.spec import Call
from normlab.spec.aliasing import output_aliasing

__all__ = ["native", "run"]


def native(call: Call, choice: Choice) -> bool:
    """Whether the chosen backend (as the call runs it) takes ``call`` as given: no float32
    stream, or a backend that declares ``"residual_stream"``."""
    return not call.residual_stream or "residual_stream" in choice.backend.capabilities


def run(call: Call, args: tuple[Any, ...], base_run: Callable[[Op, tuple[Any, ...]], Any]) -> Any:
    """What the fused op of ``call`` (its residual float32, x half) returns; ``base_run`` runs
    a call of the base op from its arguments in table order (the public route)."""
    op, plan = call.op, call.plan
    given = dict(zip(op.arguments, args, strict=True))
    if call.outputs:
        output_aliasing(op, {name: given[name] for name in op.arrays}, call.given_outputs(args))
    x, residual, out = given["x"], given["residual"], given["out"]
    h = arrays.astype(x, residual.dtype) + residual
    if given["residual_out"] is not None:
        arrays.copy_into(given["residual_out"], h)
        h = given["residual_out"]
    assert op.base is not None, op.name
    base = OPS[op.base]
    # y goes into out after its rounding; the statistics (float32 either way) straight there
    stats_out = (None, *out[1:]) if isinstance(out, (tuple, list)) else None
    base_given = {
        **given,
        "x": h,
        "normalized_shape": None,
        "axis": plan.axes,
        "eps": plan.eps,
        "out": stats_out,
    }
    result = base_run(base, tuple(base_given[name] for name in base.arguments))
    y, stats = (result[0], tuple(result[1:])) if plan.return_stats else (result, ())
    y = arrays.astype(y, x.dtype)
    y_out = out[0] if isinstance(out, (tuple, list)) else out
    if y_out is not None:
        arrays.copy_into(y_out, y)
        y = y_out
    head = (y, h) if plan.return_residual else (y,)
    if not plan.return_stats and not plan.return_residual:
        return y
    return (*head, *stats)
