"""The core's composition of a fused op on a backend that provides only its base op.

``add_layer_norm`` and ``add_rms_norm`` are ``h = x + residual`` rounded to x's dtype, then the
base op (:data:`normlab.ops.Op.base`) of that rounded ``h``. A backend that provides the fused
op does both in one pass (:mod:`normlab.route`); one that provides only the base op (JAX, Dask,
third parties) is served here: the family's own add, bitwise the unfused add, then the base op
of ``h`` on that backend, validated, seen by torch and routed as any call of the base op
(:func:`normlab.explain` says "composed"). Empty inputs are always composed: no kernel is
launched.
"""

from __future__ import annotations

from typing import Any

from normlab import autograd, route, spec
from normlab.dispatch import Choice
from normlab.ops import OPS
from normlab.residual import residual_sum
from normlab.spec import Call
from normlab.spec.aliasing import output_aliasing

__all__ = ["run"]


def run(call: Call, choice: Choice, args: tuple[Any, ...]) -> Any:
    """What the fused op of ``call`` returns, as the family's add, then the base op of ``h`` on
    the chosen backend (``choice`` is the base op's)."""
    op, plan = call.op, call.plan
    given = dict(zip(op.arguments, args, strict=True))
    if call.outputs:
        output_aliasing(op, {name: given[name] for name in op.arrays}, call.given_outputs(args))
    h = residual_sum(call, given)  # the unfused add itself: rounded to x's dtype
    assert op.base is not None, op.name
    base = OPS[op.base]
    base_given = {**given, "x": h, "normalized_shape": None, "axis": plan.axes, "eps": plan.eps}
    base_args = tuple(base_given[name] for name in base.arguments)
    base_call = spec.validated(base, base_args)
    tensors = tuple(base_given[name] for name in ("weight", "bias") if name in base.arguments)
    names = ("h", "weight", "bias")[: 1 + len(tensors)]
    base_choice = autograd.through_graph(base_call.plan, choice, names, (h, *tensors))
    result = route.run(base_call, base_choice, base_args)
    y, stats = (result[0], tuple(result[1:])) if plan.return_stats else (result, ())
    head = (y, h) if plan.return_residual else (y,)
    if not plan.return_stats and not plan.return_residual:
        return y
    return (*head, *stats)
