"""Where RMSNorm's y is rounded relative to the weight multiply: the casting orders models use.

``casting="exact"`` (the default, the contract): ``y = x̂ · weight`` formed in the compute dtype
and rounded once to x's dtype (Gemma's order: ``(x̂ · (1 + w)).to(x.dtype)``, with
``weight_offset=1``). Models written the other way round round the normalized value first and
multiply after, in torch's promotion of the two dtypes:

- ``"llama"`` (Llama, Mistral, Qwen2 and most models of HF transformers; vLLM's native RMSNorm):
  ``x̂`` rounded to x's dtype, then ``weight * x̂`` in ``promote(weight, x)``: bfloat16 x with a
  float32 weight gives float32 y.
- ``"t5"`` (T5LayerNorm): ``x̂`` rounded to the weight's dtype when that is float16/bfloat16
  (else kept in float32, float64 for float64 x), then ``weight * x̂`` in their promotion.

Their dtypes are rules of the call (:mod:`normlab.spec.casting`). The core composes both for
every backend: the backend's ``rms_norm`` without a weight (x̂ in x's dtype, or of x converted
to float32 when x̂ must be rounded elsewhere), the family's conversion and multiply. Every step
is per row or elementwise: a row's bits do not depend on its batch.
"""

from __future__ import annotations

from typing import Any, Final

import array_api_compat

from normlab import arrays, spec
from normlab.dispatch import Choice
from normlab.ops import OPS
from normlab.option import BaseRun, Option
from normlab.spec.aliasing import output_aliasing
from normlab.spec.call import Call
from normlab.spec.casting import normalized_dtype, promoted

__all__ = ["OPTION", "compose"]


def compose(call: Call, args: tuple[Any, ...], choice: Choice, base_run: BaseRun) -> Any:
    """What ``rms_norm``/``add_rms_norm`` return for ``call`` (a composed casting, a weight);
    ``base_run`` runs a call of an op from its arguments in table order (the public route),
    where each is chosen afresh (``choice``, the call's, is not used)."""
    op, plan = call.op, call.plan
    given = dict(zip(op.arguments, args, strict=True))
    if call.outputs:
        output_aliasing(op, {name: given[name] for name in op.arrays}, call.given_outputs(args))
    x, weight, out = given["x"], given["weight"], given["out"]
    assert plan.weight_dtype is not None, "composed only with a weight"
    rounded_to = normalized_dtype(call.casting, plan.dtype, plan.weight_dtype)
    fused = op.base is not None
    # the op without a weight: x̂ in x's dtype, h and the statistics (straight into out's)
    plain = {
        **given,
        "weight": None,
        "out": (None, *out[1:]) if isinstance(out, (tuple, list)) else None,
        "casting": "exact",
    }
    if fused:
        plain["return_residual"] = True  # h is normalized again below, when x̂ goes elsewhere
    result = base_run(op, tuple(plain[name] for name in op.arguments))
    parts = list(result) if isinstance(result, tuple) else [result]
    normalized = parts[0]
    if rounded_to != plan.dtype:  # x̂ of x (or h) widened, rounded once to rounded_to
        source = parts[1] if fused else x
        wide = arrays.astype(source, _library_dtype(promoted(plan.dtype, "float32"), x))
        again = spec.arguments("rms_norm", wide, axis=plan.axes, eps=plan.eps)
        rounded = _library_dtype(rounded_to, x, weight)
        normalized = arrays.astype(base_run(OPS["rms_norm"], again), rounded)
    product = _library_dtype(promoted(rounded_to, plan.weight_dtype), x, weight)
    # the weight over x's axes: its own on the normalized ones (sorted, as its shape), 1 elsewhere
    spread = tuple(n if a in plan.axes else 1 for a, n in enumerate(plan.shape))
    y = arrays.astype(normalized, product) * arrays.reshape(arrays.astype(weight, product), spread)
    y_out = out[0] if isinstance(out, (tuple, list)) else out
    if y_out is not None:
        arrays.copy_into(y_out, y)
        y = y_out
    parts[0] = y
    if fused and not plan.return_residual:
        del parts[1]
    return parts[0] if len(parts) == 1 else tuple(parts)


def _library_dtype(name: str, *like: Any) -> Any:
    """The dtype object named ``name`` in the library of ``like``: one of theirs, else the
    namespace's (float32, float64)."""
    for a in like:
        if arrays.info(a).dtype == name:
            return a.dtype
    return getattr(array_api_compat.array_namespace(like[0]), name)


def described(call: Call, choice: Choice, natively: bool) -> str:
    """explain()'s line on the casting order of ``call``: the core composes every order."""
    plan = call.plan
    assert plan.weight_dtype is not None, "composed only with a weight"
    rounded_to = normalized_dtype(call.casting, plan.dtype, plan.weight_dtype)
    product = promoted(rounded_to, plan.weight_dtype)
    return (
        f"{call.casting}: the core runs {call.op.name} without the weight (explain it without "
        f"weight= and casting= for its choice), rounds x̂ to {rounded_to} and multiplies it by "
        f"the {plan.weight_dtype} weight in {product}"
    )


OPTION: Final = Option(
    title="casting",
    capabilities=frozenset(),
    applies=lambda call: call.casting != "exact",
    native=lambda call, choice: False,  # no backend declares an order of its own
    describe=described,
    compose=compose,
)
