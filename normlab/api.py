"""The public functions. Each is thin: validate (spec) → choose (dispatch) → run (route), the
same three steps for every op of the table (:func:`_run`)."""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable
from typing import Any, Final

from normlab import arrays, autograd, composition, dispatch, dynamo, pipeline, registry, route, spec
from normlab.errors import ArgumentError, NormlabError
from normlab.ops import OPS, Op

__all__ = [
    "add_layer_norm",
    "add_rms_norm",
    "explain",
    "layer_norm",
    "layer_norm_backward",
    "rms_norm",
    "rms_norm_backward",
]

_LAYER_NORM: Final = OPS["layer_norm"]
_RMS_NORM: Final = OPS["rms_norm"]
_ADD_LAYER_NORM: Final = OPS["add_layer_norm"]
_ADD_RMS_NORM: Final = OPS["add_rms_norm"]
_LAYER_NORM_BACKWARD: Final = OPS["layer_norm_backward"]
_RMS_NORM_BACKWARD: Final = OPS["rms_norm_backward"]


def _tensors_of(op: Op) -> Callable[[tuple[Any, ...]], Any]:
    """The function taking the arguments torch must see (:data:`normlab.ops.Op.tensors`) out
    of ``op``'s arguments."""
    getter = operator.itemgetter(*(op.index[t] for t in op.tensors))
    return getter if len(op.tensors) > 1 else lambda args: (getter(args),)


#: Per op name, :func:`_tensors_of` (made on the first call of an op added since).
_TENSORS: Final = {name: _tensors_of(op) for name, op in OPS.items()}


def run(op: str, *args: Any, backend: str | None = None, **kwargs: Any) -> Any:
    """A call of any op of the table (:mod:`normlab.ops`) by its name: ``args`` and ``kwargs``
    bound by the table (:func:`normlab.spec.arguments`: ``OPS[op].arguments`` in order, the
    rest by name, defaults for what is not given), ``backend`` as for every op. The public
    functions above are these calls with their signatures and documentation."""
    table = OPS.get(op)
    if table is None:
        raise ArgumentError(f"unknown op {op!r}; normlab provides {', '.join(OPS)}")
    return _run(table, spec.arguments(op, *args, **kwargs), backend)


def _run(op: Op, args: tuple[Any, ...], named: str | None) -> Any:
    """A call of ``op`` with ``args`` (its arguments in table order): validate, choose, run;
    while torch's compiler traces it, one node of its graph (:func:`_in_graph`)."""
    if dynamo.traces():
        return _in_graph(op.name, args, named)
    # _validated_run's lines, written out: a call outside a trace takes one frame fewer
    call = spec.validated(op, args)
    if call.reshaped:
        return _reshaped(op, call, args, named)
    return _routed(op, call, dispatch.choose(call.plan, named), args, args)


@dynamo.register_node
def _in_graph(op: str, args: tuple[Any, ...], named: str | None) -> Any:
    """A call of the op named ``op`` as one node of a ``torch.compile`` graph
    (:mod:`normlab.dynamo`): dynamo does not trace it; it runs as outside a trace."""
    return _validated_run(OPS[op], args, named)


def _validated_run(op: Op, args: tuple[Any, ...], named: str | None) -> Any:
    """:func:`_run` of a call: a call the core reshapes first goes through :func:`_reshaped`."""
    call = spec.validated(op, args)
    if call.reshaped:
        return _reshaped(op, call, args, named)
    return _routed(op, call, dispatch.choose(call.plan, named), args, args)


def _reshaped(op: Op, call: spec.Call, args: tuple[Any, ...], named: str | None) -> Any:
    """A call with options (:mod:`normlab.pipeline`): served by the chosen backend, as the call
    runs it, when it takes every option as given; else the core composes the first, whose own
    calls go through :func:`_run` again (the parameters: the call of the formed arguments,
    validated and chosen again, a backward op's parameter gradients in the caller's dtypes)."""
    choice = dispatch.choose(call.plan, named)
    composed = _composed(op, call, choice)
    seen = choice if composed else _seen(op, call, choice, args)
    step = pipeline.resolve(call, seen, composed)
    option = step.option
    if step.native:
        if option is not None and option.serve is not None:
            return option.serve(call, args, seen)
        return _ran(op, call, seen, args, args)
    assert option is not None, "a composed step has its option"
    if option.formed is not None:
        result = _run(op, option.formed(call, args), named)
        return _in_parameter_dtype(op, args, result) if op.per_feature_outputs else result
    assert option.compose is not None, option.title
    return option.compose(call, args, seen, lambda base, base_args: _run(base, base_args, named))


def _routed(
    op: Op, call: spec.Call, choice: dispatch.Choice, args: tuple[Any, ...], given: tuple[Any, ...]
) -> Any:
    """``call`` (of ``args``) run on ``choice``: a fused op that no able backend provides, or an
    empty one, composed by the core (:func:`_composed`); else :func:`_ran` as torch must see the
    call (:func:`_seen`)."""
    if _composed(op, call, choice):
        return composition.run(call, choice, args)
    return _ran(op, call, _seen(op, call, choice, args), args, given)


def _composed(op: Op, call: spec.Call, choice: dispatch.Choice) -> bool:
    """Whether the core composes the fused op of ``call`` from its base op: no able backend
    provides it (``choice.composed``), or it is empty."""
    return op.base is not None and (choice.composed or call.plan.empty)


def _seen(op: Op, call: spec.Call, choice: dispatch.Choice, args: tuple[Any, ...]) -> Any:
    """``choice`` as the call runs: on torch tensors, what torch must see of it (autograd,
    transforms: :func:`normlab.autograd.through_graph`)."""
    if call.plan.family != "torch":
        return choice
    tensors = _TENSORS.get(op.name) or _TENSORS.setdefault(op.name, _tensors_of(op))
    return autograd.through_graph(call.plan, choice, op.tensors, tensors(args))


def _ran(
    op: Op, call: spec.Call, choice: dispatch.Choice, args: tuple[Any, ...], given: tuple[Any, ...]
) -> Any:
    """``call`` (of ``args``) run on ``choice`` as :func:`_seen` gave it; a backward op's
    parameter gradients in the dtypes of ``given``'s parameters."""
    result = route.run(call, choice, args)
    if op.per_feature_outputs:
        return _in_parameter_dtype(op, given, result)
    return result


def _in_parameter_dtype(op: Op, args: tuple[Any, ...], gradients: tuple[Any, ...]) -> Any:
    """A backward op's gradients with those of the parameters (computed in the compute dtype) in
    weight's dtype, x's without weight: torch gives a parameter's gradient in its own dtype."""
    like = args[op.index["weight"]]
    like = args[op.index["x"]] if like is None else like
    return tuple(
        arrays.astype(g, like.dtype)
        if name in op.per_feature_outputs and g is not None and g.dtype != like.dtype
        else g
        for name, g in zip(op.outputs, gradients, strict=True)
    )


def layer_norm(
    x: Any,
    normalized_shape: Any = None,
    weight: Any = None,
    bias: Any = None,
    eps: float = 1e-5,
    *,
    axis: Any = None,
    backend: str | None = None,
    return_stats: bool = False,
    out: Any = None,
    weight_offset: float = 0.0,
    quantize: str | None = None,
    quantize_scale: float | None = None,
) -> Any:
    """Layer normalization: ``y = (x - mean) / sqrt(var + eps) * weight + bias``.

    Statistics are per row: the mean and the population variance over the normalized axes only
    (never across batch or sequence positions). The normalized axes are ``normalized_shape``
    (PyTorch: the trailing dims, an int or a tuple) or ``axis`` (Keras: exactly these axes, an
    int or a tuple); given neither, the last axis. ``weight`` and ``bias`` are optional, each of
    the normalized shape, in any float dtype: the arithmetic is in the compute dtype (float32,
    float64 for float64 x) whatever their dtypes, the output in x's dtype. x's dtype (or float32
    for float16/bfloat16 x) is the fast path; others are converted to the compute dtype first.

    Args:
        x: a NumPy, PyTorch or CuPy array (or any family a plugin serves) of a float dtype.
        normalized_shape: the trailing dims to normalize over.
        weight: the per-feature scale, or None.
        bias: the per-feature shift, or None.
        eps: added to the variance inside the square root; finite and >= 0.
        axis: the axes to normalize over (any axes; must agree with normalized_shape if both).
        backend: a backend name; strict: an error if it cannot serve ``x``.
        return_stats: also return ``mean`` and ``rstd = 1/sqrt(var + eps)``, keepdims-shaped,
            in float32 (float64 for float64 x).
        out: an array like ``x`` to write the result into (may be ``x`` itself); with
            ``return_stats``, a tuple ``(y, mean, rstd)`` whose entries may be None.
        weight_offset: the weight is used as ``weight_offset + weight``, formed in the compute
            dtype (1.0: Gemma's RMSNorm, Transformer Engine's ``zero_centered_gamma``); needs
            a weight. Gradients are those of ``weight`` itself.
        quantize: None, or ``"int8"`` / ``"fp8_e4m3"``: return the quantized y and its
            per-row scale ``(q, scale)`` instead of y (docs/quantized.md): y in float32 (never
            rounded to x's dtype) divided by the scale, rounded half to even and saturated
            (int8: ±127; fp8 e4m3fn: ±448). ``out`` is then q or ``(q, scale)`` (with the
            statistics after them with ``return_stats``). Not differentiable.
        quantize_scale: a static scale (a number > 0) for every row; None: a dynamic one,
            ``max|y_row| / 127`` (int8) or ``/ 448`` (fp8), float32, 0 for a row of zeros.

    Returns:
        ``y`` — same array type, device, shape and dtype as ``x`` — or ``(y, mean, rstd)``;
        with ``quantize``, ``(q, scale)`` or ``(q, scale, mean, rstd)``: q of x's shape
        (int8, or float8_e4m3fn: uint8 bits on CuPy), scale float32 keepdims-shaped as the
        statistics. ``x`` is never modified (unless it is ``out``).

    Raises:
        NormlabError: a subclass naming the problem (ShapeError, DtypeError, DeviceError,
            ArgumentError, BackendError).
    """
    args = (
        x, normalized_shape, weight, bias, eps, axis, return_stats, out, weight_offset,
        quantize, quantize_scale,
    )  # fmt: skip
    return _run(_LAYER_NORM, args, backend)


def rms_norm(
    x: Any,
    normalized_shape: Any = None,
    weight: Any = None,
    eps: float | None = None,
    *,
    axis: Any = None,
    backend: str | None = None,
    return_stats: bool = False,
    out: Any = None,
    weight_offset: float = 0.0,
    casting: str = "exact",
    quantize: str | None = None,
    quantize_scale: float | None = None,
) -> Any:
    """RMS normalization: ``y = x / sqrt(mean(x^2) + eps) * weight``.

    No mean is subtracted and there is no bias. The statistic is per row over the normalized
    axes, exactly as for :func:`layer_norm` (``normalized_shape``/``axis``, default the last
    axis); ``eps=None`` means the machine epsilon of the compute dtype (float32's for float16,
    bfloat16 and float32 x, float64's for float64), as ``torch.nn.functional.rms_norm``.
    float16/bfloat16 accumulate in float32, so the sum of squares cannot overflow. ``weight``
    (any float dtype) and ``weight_offset`` are as for :func:`layer_norm`.

    ``casting`` is where y is rounded relative to the weight multiply: ``"exact"`` (the
    contract: ``x̂ · weight`` in the compute dtype, rounded once to x's dtype; Gemma's order),
    ``"llama"`` (x̂ rounded to x's dtype, then ``weight * x̂`` in torch's promotion of the two
    dtypes: HF Llama, Mistral, Qwen2) or ``"t5"`` (x̂ rounded to the weight's dtype when that is
    half, then the multiply: HF T5). With a composed order y's dtype is that promotion (a
    float32 weight beside bfloat16 x gives float32 y), ``out`` must have it, and no
    ``weight_offset`` is taken; see docs/conventions.md. ``quantize``/``quantize_scale`` as for
    :func:`layer_norm` (with ``casting="llama"`` the quantized y is the float32 product of the
    rounded x̂ and the weight; ``"t5"`` takes no quantize).

    Returns:
        ``y`` (same array type, device, shape and dtype as ``x``), or ``(y, rstd)`` with
        ``return_stats=True``: ``rstd = 1/sqrt(mean(x^2) + eps)`` keepdims-shaped, float32
        (float64 for float64 x). ``out`` may be an array, or ``(y, rstd)`` with return_stats.

    Raises:
        NormlabError: a subclass naming the problem, as for :func:`layer_norm`.
    """
    args = (
        x, normalized_shape, weight, eps, axis, return_stats, out, weight_offset, casting,
        quantize, quantize_scale,
    )  # fmt: skip
    return _run(_RMS_NORM, args, backend)


def add_layer_norm(
    x: Any,
    residual: Any,
    normalized_shape: Any = None,
    weight: Any = None,
    bias: Any = None,
    eps: float = 1e-5,
    *,
    axis: Any = None,
    backend: str | None = None,
    return_stats: bool = False,
    return_residual: bool = True,
    out: Any = None,
    residual_out: Any = None,
    weight_offset: float = 0.0,
    quantize: str | None = None,
    quantize_scale: float | None = None,
) -> Any:
    """Residual add fused with layer normalization: ``h = x + residual``, ``y = layer_norm(h)``.

    ``h`` is rounded to x's dtype exactly as the unfused add (bitwise equal to ``x + residual``
    in x's library); ``y`` and the statistics are those of :func:`layer_norm` on that rounded
    ``h``, with the same ``normalized_shape``/``axis``, ``weight``, ``bias`` and ``eps`` rules.
    One pass over the rows where the backend provides the fused op, else the family's add
    followed by the backend's ``layer_norm`` (:func:`explain` says "composed"). The arguments
    not listed below are :func:`layer_norm`'s. If any input requires grad, ``out`` and
    ``residual_out`` must be None; ``h`` is differentiable, the statistics are not.

    Args:
        x: the block's output (a NumPy, PyTorch or CuPy array, or a family a plugin serves).
        residual: the stream added to it: x's array type, device, dtype and shape exactly (no
            promotion, no broadcasting).
        return_residual: True (pre-norm blocks): also return ``h``; False (post-norm blocks,
            ``LayerNorm(hidden + input)``): ``h`` is never written and the result has the form
            of :func:`layer_norm`'s.
        out: as for :func:`layer_norm` (``y``, or ``(y, mean, rstd)`` with ``return_stats``);
            ``h`` never goes into ``out``. May be ``x`` or ``residual`` itself.
        residual_out: None (allocate ``h``) or one writable array like ``x`` to write ``h``
            into; may be ``residual`` or ``x`` itself (``out=x, residual_out=residual`` is the
            in-place serving form), never the memory of ``out``. Only with
            ``return_residual=True``.
        quantize: as for :func:`layer_norm`: ``(q, scale)`` replaces ``y`` in the result
            (``(q, scale, h)``, ...); y is the norm of ``h`` in float32.
        quantize_scale: as for :func:`layer_norm`.

    Returns:
        ``(y, h)``; ``(y, h, mean, rstd)`` with ``return_stats``; with
        ``return_residual=False``: ``y`` or ``(y, mean, rstd)``. Arrays passed as outputs are
        returned as the same objects. Inputs are never modified unless passed as outputs.

    Raises:
        NormlabError: a subclass naming the problem, as for :func:`layer_norm`; any overlap of
            outputs with inputs or with each other other than the in-place forms above is an
            ArgumentError.
    """
    args = (
        x, residual, normalized_shape, weight, bias, eps, axis, return_stats, return_residual,
        out, residual_out, weight_offset, quantize, quantize_scale,
    )  # fmt: skip
    return _run(_ADD_LAYER_NORM, args, backend)


def add_rms_norm(
    x: Any,
    residual: Any,
    normalized_shape: Any = None,
    weight: Any = None,
    eps: float | None = None,
    *,
    axis: Any = None,
    backend: str | None = None,
    return_stats: bool = False,
    return_residual: bool = True,
    out: Any = None,
    residual_out: Any = None,
    weight_offset: float = 0.0,
    casting: str = "exact",
    quantize: str | None = None,
    quantize_scale: float | None = None,
) -> Any:
    """Residual add fused with RMS normalization: ``h = x + residual``, ``y = rms_norm(h)``.

    As :func:`add_layer_norm`, with :func:`rms_norm`'s arithmetic (no mean, no bias;
    ``eps=None``: the compute dtype's machine epsilon; ``casting`` as for :func:`rms_norm`).
    Returns ``(y, h)``; ``(y, h, rstd)`` with ``return_stats``; with ``return_residual=False``:
    ``y`` or ``(y, rstd)``.
    """
    args = (
        x, residual, normalized_shape, weight, eps, axis, return_stats, return_residual, out,
        residual_out, weight_offset, casting, quantize, quantize_scale,
    )  # fmt: skip
    return _run(_ADD_RMS_NORM, args, backend)


def layer_norm_backward(
    dy: Any,
    x: Any,
    mean: Any,
    rstd: Any,
    weight: Any = None,
    normalized_shape: Any = None,
    *,
    axis: Any = None,
    backend: str | None = None,
    needs: Any = ("x", "weight", "bias"),
    weight_offset: float = 0.0,
) -> tuple[Any, Any, Any]:
    """The gradients of :func:`layer_norm`: ``(dx, dweight, dbias)`` for the upstream ``dy``.

    With ``x̂ = (x - mean) * rstd`` and ``g = dy * weight`` (``g = dy`` without weight), per row
    over the normalized axes: ``dx = rstd * (g - mean(g) - x̂ * mean(g * x̂))``; summed over
    rows: ``dweight = Σ dy * x̂`` and ``dbias = Σ dy``. The sums are deterministic: bitwise equal
    from run to run and whatever the number of threads. float16/bfloat16 accumulate in float32.

    Args:
        dy: the gradient of the loss with respect to ``y``; x's array type, shape and dtype.
        x: the forward's input.
        mean: the mean ``layer_norm(..., return_stats=True)`` returned (keepdims shape;
            float32, or float64 for float64 x).
        rstd: the ``rstd`` it returned, likewise.
        weight: the forward's weight, or None (bias does not enter the gradients).
        weight_offset: the forward's ``weight_offset`` (``g = dy * (weight_offset + weight)``;
            ``dweight`` is the gradient of ``weight`` itself, the same for any offset).
        normalized_shape: the forward's trailing normalized dims, as for :func:`layer_norm`.
        axis: the forward's normalized axes, as for :func:`layer_norm`.
        backend: a backend name; strict, as for :func:`layer_norm`.
        needs: the gradients to compute, any of ``"x"``, ``"weight"``, ``"bias"``.

    Returns:
        ``(dx, dweight, dbias)``: ``dx`` like ``x``; ``dweight`` and ``dbias`` of the
        normalized shape, in weight's dtype (x's dtype when there is no weight), as torch gives
        a parameter's gradient in the parameter's dtype. An entry not in ``needs`` is None.

    Raises:
        NormlabError: a subclass naming the problem (a shape, dtype or device that does not
            match x, an unknown ``needs`` entry, a backend that cannot serve the call).
    """
    args = (dy, x, mean, rstd, weight, normalized_shape, axis, needs, weight_offset)
    return _run(_LAYER_NORM_BACKWARD, args, backend)  # type: ignore[no-any-return]


def rms_norm_backward(
    dy: Any,
    x: Any,
    rstd: Any,
    weight: Any = None,
    normalized_shape: Any = None,
    *,
    axis: Any = None,
    backend: str | None = None,
    needs: Any = ("x", "weight"),
    weight_offset: float = 0.0,
) -> tuple[Any, Any]:
    """The gradients of :func:`rms_norm`: ``(dx, dweight)`` for the upstream ``dy``.

    With ``x̂ = x * rstd`` and ``g = dy * weight`` (``g = dy`` without weight), per row:
    ``dx = rstd * (g - x̂ * mean(g * x̂))``; summed over rows: ``dweight = Σ dy * x̂``.
    ``rstd`` is what ``rms_norm(..., return_stats=True)`` returned; the other arguments, the
    dtypes and the errors are as for :func:`layer_norm_backward` (``needs``: ``"x"``,
    ``"weight"``).
    """
    args = (dy, x, rstd, weight, normalized_shape, axis, needs, weight_offset)
    return _run(_RMS_NORM_BACKWARD, args, backend)  # type: ignore[no-any-return]


def explain(*args: Any, op: str = "layer_norm", **kwargs: Any) -> str:
    """Say which backend a call would use and why, without running it.

    Takes the arguments of the op ``op`` (any op of :mod:`normlab.ops`), bound as the op's own
    function binds them: ``explain(x, weight=w, backend="numba")``,
    ``explain(dy, x, mean, rstd, op="layer_norm_backward")``. The text lists every registered
    backend with the reason it was or was not chosen, the preference in force, and whether the
    call copies its inputs.
    """
    if op not in OPS:
        raise ArgumentError(f"unknown op {op!r}; normlab provides {', '.join(OPS)}")
    table = OPS[op]
    if op in _FUNCTIONS:  # bound as the op's own function binds them
        try:
            bound = _signature(op).bind(*args, **kwargs)
        except TypeError as exc:
            raise ArgumentError(f"explain(op={op!r}): {exc}") from None
        bound.apply_defaults()
        arguments = bound.arguments
    else:  # an op without a function of its own: bound by the table, as run() binds them
        named_backend = kwargs.pop("backend", None)
        arguments = dict(zip(table.arguments, spec.arguments(op, *args, **kwargs), strict=True))
        arguments["backend"] = named_backend
    named = arguments["backend"]
    args = tuple(arguments[name] for name in table.arguments)
    x = arguments["x"]
    lines = [f"normlab.{op} on {type(x).__module__}.{type(x).__qualname__}"]
    call = spec.validated(table, args)
    plan = call.plan
    lines.append(
        f"  x: {plan.dtype} {plan.shape} on {plan.device}"
        f"{', requires grad' if plan.requires_grad else ''}; normalized axes {plan.axes} "
        f"-> {plan.rows} rows x {plan.cols} cols"
    )
    preference = dispatch.current_preference()
    lines.append(f"  named backend: {named or 'none'}; preference: {preference or 'none'}")
    try:
        choice = dispatch.choose(plan, named)
        if call.reshaped:
            composed = _composed(table, call, choice)
            seen = choice if composed else _seen(table, call, choice, args)
            step = pipeline.resolve(call, seen, composed)
            if not step.native:
                option = step.option
                assert option is not None, "a composed step has its option"
                lines.append(f"  {option.title}: {option.describe(call, seen, False)}")
                if option.formed is None:  # its own calls explain themselves
                    return "\n".join(lines)
                call = spec.validated(table, option.formed(call, args))
                plan = call.plan
                choice = dispatch.choose(plan, named)
            else:
                lines.extend(f"  {o.title}: {o.describe(call, seen, True)}" for o in step.options)
    except NormlabError as exc:
        lines.append(f"  no choice: {exc}")
        return "\n".join(lines)
    lines.append(f"  chosen: {choice.backend.name} ({choice.how})")
    lines.append(f"  rows: {_invariance(choice.backend, named is not None)}")
    if choice.composed:
        lines.append(
            f"  composed: {choice.backend.name} does not provide {op}; the core adds x + "
            f"residual with x's library, then runs {choice.backend.name}'s {table.base}"
        )
    lines.append("  candidates:")
    if named is None:
        lines.extend(f"    {note}" for note in choice.notes)
    else:
        for b in registry.list_backends():
            why = dispatch.refusal(b, plan, named=b.name == named)
            state = "able to serve" if why is None else why
            lines.append(f"    {b.name} (priority {b.priority}): {state}")
    if plan.empty:
        lines.append("  empty input: no kernel is launched")
        return "\n".join(lines)
    if not choice.composed:
        try:
            lines.extend(f"  {line}" for line in route.describe(call, choice))
        except NormlabError as exc:
            lines.append(f"  the chosen backend cannot run: {exc}")
            return "\n".join(lines)
    backend_notes = getattr(choice.backend.module, "explain", None)
    if backend_notes is not None:
        notes = backend_notes(x, plan=plan)
        lines.extend(f"  {line}" for line in notes.splitlines())
    return "\n".join(lines)


def _invariance(backend: registry.Backend, named: bool) -> str:
    """explain()'s line on batch invariance: the choice, and the chosen backend's promise."""
    choice = (
        "named, so every batch goes to it"
        if named
        else "the same choice for any number of rows of this op, dtype and row length"
    )
    if backend.batch_invariant:
        return f"{choice}; {backend.name} gives a row the same bits in any batch (batch invariant)"
    return (
        f"{choice}; {backend.name} declares batch_invariant=False: a row's bits may depend on "
        "the rest of its batch"
    )


_FUNCTIONS: Final[dict[str, Callable[..., Any]]] = {
    "layer_norm": layer_norm,
    "rms_norm": rms_norm,
    "add_layer_norm": add_layer_norm,
    "add_rms_norm": add_rms_norm,
    "layer_norm_backward": layer_norm_backward,
    "rms_norm_backward": rms_norm_backward,
}


@functools.cache
def _signature(op: str) -> inspect.Signature:
    return inspect.signature(_FUNCTIONS[op])
