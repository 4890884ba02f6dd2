"""The fused ops on a float32 residual stream beside float16/bfloat16 x.

Models that keep their residual stream in float32 while the blocks compute in half precision
(flash-attention's ``residual_in_fp32``, vLLM's pre-norm residual) add each block's output to
the stream in float32: ``h = float32(x) + residual``, kept in float32 (written to
``residual_out``, returned), and ``y`` is the norm of that unrounded ``h``, in x's dtype.

A backend whose record declares the capability ``"residual_stream"`` (the numba backend) takes
such a call as given (``plan.residual_dtype``: :func:`native`). For the others (and under
normlab's custom ops) the core serves it (:func:`compose`): the family's conversion and add, then
the base op (``layer_norm``/``rms_norm``) of the float32 ``h`` as any call of it (validated,
chosen, parameters formed, seen by torch's autograd), then ``y`` rounded to x's dtype (written
into ``out`` when given). Every step is elementwise or per
row, so a row's bits do not depend on its batch.
"""

from __future__ import annotations

from typing import Any, Final

from normlab import arrays
from normlab.dispatch import Choice
from normlab.ops import OPS
from normlab.option import BaseRun, Option
from normlab.residual import residual_sum
from normlab.spec import Call
from normlab.spec.aliasing import output_aliasing

__all__ = ["OPTION", "compose", "native"]


def native(call: Call, choice: Choice) -> bool:
    """Whether the chosen backend (as the call runs it) takes the float32 stream of ``call``
    as given: it declares ``"residual_stream"``."""
    return "residual_stream" in choice.backend.capabilities


def compose(call: Call, args: tuple[Any, ...], choice: Choice, base_run: BaseRun) -> Any:
    """What the fused op of ``call`` (its residual float32, x half) returns; ``base_run`` runs
    a call of the base op from its arguments in table order (the public route), where it is
    chosen afresh (``choice``, the fused call's, is not used)."""
    op, plan = call.op, call.plan
    given = dict(zip(op.arguments, args, strict=True))
    if call.outputs:
        output_aliasing(op, {name: given[name] for name in op.arrays}, call.given_outputs(args))
    x, out = given["x"], given["out"]
    h = residual_sum(call, given)
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


def described(call: Call, choice: Choice, natively: bool) -> str:
    """explain()'s line on the float32 stream of ``call``: taken as given, or composed."""
    plan = call.plan
    if natively:
        return (
            f"residual is float32 beside {plan.dtype} x; {choice.backend.name} takes it as "
            "given: h = float32(x) + residual kept in float32, y the norm of that h in x's dtype"
        )
    base = call.op.base
    return (
        f"residual is float32 beside {plan.dtype} x; the core adds float32(x) + residual in "
        f"float32 with x's library, runs {base} of that h as a call of its own "
        f"(explain(h, op={base!r}) shows its choice) and rounds y to x's dtype"
    )


OPTION: Final = Option(
    title="residual stream",
    capabilities=frozenset({"residual_stream"}),
    applies=lambda call: call.residual_stream,
    native=native,
    describe=described,
    compose=compose,
)
