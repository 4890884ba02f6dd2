"""The fused ops, ``add_layer_norm`` and ``add_rms_norm``, through the backend under test: its
own kernel where its record lists the op, else the core's composition (x + residual with x's
library, then its base op) — :func:`test_fused_path` says which, and the report names it.

``h`` must be NumPy's ``x + residual`` in x's dtype, bit for bit; ``y`` and the statistics
those of the base op's reference on that rounded ``h``, within the base op's tolerances. Then
the return forms, outputs (``out``, ``residual_out``, returned as the objects passed), the
in-place forms (checked against references taken from copies before the call), inputs never
modified, and the aliasing refusals. Bad residuals are in the errors area
(:mod:`.test_errors`, the fused entries of :data:`.bad_inputs.BAD_INPUTS`).
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import pytest
from hypothesis import given, settings

import normlab
from normlab import ArgumentError, reference
from normlab.constants import FLOAT_DTYPES, HALF_DTYPES
from normlab.ops import OPS
from normlab.testing.backward_cases import BackwardCase
from normlab.testing.bitwise import same_bits
from normlab.testing.cases import Case
from normlab.testing.conversions import arrange, numpy_dtype
from normlab.testing.fused_cases import FUSED_OPS, FusedCase, assert_same_bits
from normlab.testing.strategies import fused_cases
from normlab.testing.subject import Subject
from normlab.testing.tolerances import assert_close, conditioning, y_scale

#: The fused ops, and each one's base op.
FUSED: Final = tuple(FUSED_OPS.values())
BASE: Final = {fused: base for base, fused in FUSED_OPS.items()}

#: (shape, axis, x values, residual values) of the reference cases.
SHAPES: Final[dict[str, tuple[tuple[int, ...], Any, str, str]]] = {
    "2d": ((7, 33), None, "rowwise", "normal"),
    "3d-axes0,2": ((4, 5, 9), (0, 2), "normal", "rowwise"),
    "cols4097": ((3, 4097), None, "offset", "tiny"),
    "nan_inf": ((6, 20), None, "normal", "nan_inf"),
}


def _case(
    subject: Subject,
    op: str,
    dtype: str | None = None,
    *,
    shape: tuple[int, ...] = (8, 40),
    seed: int = 30,
    **changes: Any,
) -> FusedCase:
    """A case of the fused ``op`` with weight (float32 for half x) and, for add_layer_norm, a
    bias; rowwise x, standard normal residual. ``changes``: FusedCase fields, or Case fields
    (``base_<field>``)."""
    base_op = BASE[op]
    dtype = dtype or subject.dtype
    param = "float32" if dtype in HALF_DTYPES else dtype
    base_changes = {k.removeprefix("base_"): v for k, v in changes.items() if k.startswith("base_")}
    fields: dict[str, Any] = {
        "values": "rowwise",
        "seed": seed,
        "weight": param,
        "bias": param if base_op == "layer_norm" else None,
        "op": base_op,
    }
    base = Case(shape, dtype, **{**fields, **base_changes})
    return FusedCase(base, **{k: v for k, v in changes.items() if not k.startswith("base_")})


def _require(subject: Subject, op: str) -> None:
    """Skip unless the fused ``op`` reaches the backend."""
    subject.require_fused(op)


@pytest.mark.parametrize("op", FUSED)
def test_fused_path(normlab_subject: Subject, op: str) -> None:
    """explain() names the path the suite tests: the backend's own fused kernel where its
    record lists the op, else "composed" (the family's add, then the backend's base op)."""
    normlab_subject.require_named("the fused path a backend's record implies")
    path = normlab_subject.require_fused(op)
    case = _case(normlab_subject, op)
    x, residual, kwargs = case.inputs(normlab_subject.name)
    text = normlab.explain(x, residual, **kwargs, backend=normlab_subject.backend, op=op)
    assert f"chosen: {normlab_subject.name} " in text, text
    assert ("composed:" in text) == (path == "composed"), (
        f"the record {'lists' if path == 'kernel' else 'does not list'} {op}, yet explain() "
        f"says:\n{text}"
    )


@pytest.mark.parametrize("op", FUSED)
def test_fused_random_calls(normlab_subject: Subject, normlab_settings: settings, op: str) -> None:
    """Random shapes, axes, dtypes, affine parameters, eps, values and layouts of x and of the
    residual, both return_residual forms: h bitwise, y and the statistics within tolerance."""
    _require(normlab_subject, op)
    name = normlab_subject.name
    drawn = fused_cases(normlab_subject.dtypes, normlab_subject.usable_layouts, op)

    @normlab_settings
    @given(case=drawn)
    def matches(case: FusedCase) -> None:
        case.check(name)

    matches()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", FUSED)
def test_fused_matches_reference(normlab_subject: Subject, op: str, dtype: str, shape: str) -> None:
    """h bitwise NumPy's x + residual in x's dtype; y and the statistics within the base op's
    tolerances of its reference on that h: rows of 33 and 4097, non-trailing axes, NaN and
    infinities in the residual (h compared everywhere, y and the statistics in the other rows,
    which must be as without them)."""
    _require(normlab_subject, op)
    normlab_subject.require_dtype(dtype)
    dims, axis, x_values, residual_values = SHAPES[shape]
    case = _case(
        normlab_subject,
        op,
        dtype,
        shape=dims,
        seed=31,
        base_axis=axis,
        base_values=x_values,
        residual=residual_values,
    )
    rows: np.ndarray | None = None
    if residual_values == "nan_inf":  # rows whose h holds NaN or an infinity are not compared
        rows = np.asarray(np.isfinite(case.h().astype(np.float64)).all(axis=1, keepdims=True))
    y, h, mean, rstd = case.run(normlab_subject.name)
    case.compare(y, h, mean, rstd, backend=normlab_subject.name, rows=rows)


@pytest.mark.parametrize(
    ("layout", "residual_layout"), [("transposed", "c"), ("c", "sliced"), ("padded", "fortran")]
)
@pytest.mark.parametrize("op", FUSED)
def test_fused_layouts(
    normlab_subject: Subject, op: str, layout: str, residual_layout: str
) -> None:
    """x and residual in different memory layouts: h and y as for C-ordered inputs."""
    _require(normlab_subject, op)
    normlab_subject.require_layout(layout)
    normlab_subject.require_layout(residual_layout)
    case = _case(
        normlab_subject, op, shape=(6, 17), seed=32, base_layout=layout,
        residual_layout=residual_layout,
    )  # fmt: skip
    case.check(normlab_subject.name)


@pytest.mark.parametrize("pair", ["absorbed", "cancelling"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", FUSED)
def test_fused_h_rounded_before_normalizing(
    normlab_subject: Subject, op: str, dtype: str, pair: str
) -> None:
    """y is the norm of h *rounded to x's dtype*. "absorbed": x = C + 2k on the dtype's grid
    (float16 C = 2048, bfloat16 256, float32 2^24, float64 2^53: spacing 2 there) plus
    |residual| < 2, so every h rounds: a float16/bfloat16 kernel normalizing the exact sum is
    off by up to 0.1, far outside the tolerance. "cancelling": x = C + a, residual = -C + b:
    the digits cancel (exactly) and h must still be the add's."""
    _require(normlab_subject, op)
    normlab_subject.require_dtype(dtype)
    case = _case(normlab_subject, op, dtype, shape=(8, 64), seed=33, pair=pair)
    case.check(normlab_subject.name)


@pytest.mark.parametrize("return_stats", [False, True])
@pytest.mark.parametrize("return_residual", [True, False])
@pytest.mark.parametrize("op", FUSED)
def test_fused_return_forms(
    normlab_subject: Subject, op: str, return_residual: bool, return_stats: bool
) -> None:
    """``(y, h)``, ``(y, h, *stats)``, ``y``, ``(y, *stats)``: with return_residual=False the
    result has exactly the form of the base op's (``y`` alone, or its statistics tuple)."""
    _require(normlab_subject, op)
    case = _case(
        normlab_subject,
        op,
        seed=34,
        return_residual=return_residual,
        base_return_stats=return_stats,
    )
    y, h, mean, rstd = case.run(normlab_subject.name)  # asserts the form
    case.compare(y, h, mean, rstd, backend=normlab_subject.name)
    if not return_residual:  # the base op called the same way returns the same form
        x, residual, kwargs = case.inputs(normlab_subject.name)
        fused_form = _form(case.call(x, residual, **kwargs, backend=normlab_subject.backend))
        del kwargs["return_residual"]
        base_form = _form(case.base.call(x, **kwargs, backend=normlab_subject.backend))
        assert fused_form == base_form, (
            f"{op}(..., return_residual=False) returns {fused_form}, {BASE[op]} returns "
            f"{base_form}\n{case.snippet(normlab_subject.name)}"
        )


def _form(result: Any) -> str:
    """What a result is: one array, or a tuple of so many."""
    return f"a tuple of {len(result)}" if isinstance(result, tuple) else "one array"


@pytest.mark.parametrize("return_residual", [True, False])
@pytest.mark.parametrize("op", FUSED)
def test_fused_inputs_never_modified(
    normlab_subject: Subject, op: str, return_residual: bool
) -> None:
    """x, residual, weight and bias keep their bits, on the direct path too (2-D C-contiguous,
    called twice: the second call takes the cached route, through the backend's ``prepare``
    where it has one, and returns the first call's bits)."""
    _require(normlab_subject, op)
    case = _case(
        normlab_subject, op, seed=35, return_residual=return_residual, base_return_stats=False
    )
    x, residual, kwargs = case.inputs(normlab_subject.name)
    inputs: dict[str, Any] = {"x": x, "residual": residual}
    inputs.update({k: kwargs[k] for k in ("weight", "bias") if k in kwargs})
    before = {k: normlab_subject.to_numpy(a).tobytes() for k, a in inputs.items()}
    results = []
    for call in ("first", "second"):
        result = case.call(x, residual, **kwargs, backend=normlab_subject.backend)
        for what, a in inputs.items():
            assert same_bits(normlab_subject.to_numpy(a).tobytes(), before[what]), (
                f"{what} was modified by the {call} call\n{case.snippet(normlab_subject.name)}"
            )
        y_given, h_given, _, _ = case.unpack(result)
        y = normlab_subject.to_numpy(y_given)
        h = None if h_given is None else normlab_subject.to_numpy(h_given)
        case.compare(y, h, None, None, backend=normlab_subject.name)
        results.append([None if a is None else a.tobytes() for a in (y, h)])
    assert all(map(same_bits, results[1], results[0])), (
        "the second call (the cached direct route) returned other bits than the first\n"
        + case.snippet(normlab_subject.name)
    )


def _zeros(subject: Subject, shape: tuple[int, ...], dtype: str, layout: str = "c") -> Any:
    return arrange(np.zeros(shape, numpy_dtype(dtype)), layout, subject)


@pytest.mark.parametrize(
    "given", ["out", "residual_out", "both", "out_fortran", "residual_out_sliced", "with_stats"]
)
@pytest.mark.parametrize("op", FUSED)
def test_fused_out(normlab_subject: Subject, op: str, given: str) -> None:
    """``out`` (y; with return_stats ``(y, *stats)``) and ``residual_out`` (h), separate
    arrays in any writable layout: written, returned as the very objects passed; the inputs
    untouched."""
    _require(normlab_subject, op)
    normlab_subject.require_writable()
    layouts = {"out_fortran": "fortran", "residual_out_sliced": "sliced"}
    layout = layouts.get(given, "c")
    normlab_subject.require_layout(layout)
    stats = given == "with_stats"
    case = _case(normlab_subject, op, shape=(6, 33), seed=36, base_return_stats=stats)
    x, residual, kwargs = case.inputs(normlab_subject.name)
    before = {k: normlab_subject.to_numpy(a).tobytes() for k, a in (("x", x), ("r", residual))}
    dtype, shape = case.base.dtype, case.base.shape
    out: Any = None
    residual_out = None
    if given in ("out", "both", "out_fortran", "with_stats"):
        out = _zeros(normlab_subject, shape, dtype, layout)
    if given in ("residual_out", "both", "residual_out_sliced", "with_stats"):
        residual_out = _zeros(normlab_subject, shape, dtype, layout)
    if stats:
        stats_dtype = "float64" if dtype == "float64" else "float32"
        out = (out, *(_zeros(normlab_subject, (6, 1), stats_dtype) for _ in OPS[op].stats_outputs))
    result = case.call(
        x, residual, **kwargs, out=out, residual_out=residual_out, backend=normlab_subject.backend
    )
    repro = case.snippet(normlab_subject.name)
    y, h, mean, rstd = case.unpack(result, repro)
    passed = out if isinstance(out, tuple) else (out,)
    returned = (y, *(a for a in (mean, rstd) if a is not None))
    for got, given_array in zip(returned, passed, strict=True):
        assert given_array is None or got is given_array, f"out entries must be returned\n{repro}"
    assert residual_out is None or h is residual_out, f"residual_out must be returned\n{repro}"
    assert same_bits(normlab_subject.to_numpy(x).tobytes(), before["x"]), f"x was modified\n{repro}"
    assert same_bits(normlab_subject.to_numpy(residual).tobytes(), before["r"]), (
        f"residual was modified\n{repro}"
    )
    host = [None if a is None else normlab_subject.to_numpy(a) for a in (h, mean, rstd)]
    case.compare(normlab_subject.to_numpy(y), *host, backend=normlab_subject.name)


#: In-place forms: name -> (residual is x, out, residual_out), outputs named by the input whose
#: memory they are.
IN_PLACE: Final[dict[str, tuple[bool, str | None, str | None]]] = {
    "out=x,residual_out=residual": (False, "x", "residual"),
    "out=residual,residual_out=x": (False, "residual", "x"),
    "out=x": (False, "x", None),
    "residual_out=residual": (False, None, "residual"),
    "residual=x": (True, None, None),
    "residual=x,out=x": (True, "x", None),
    "residual=x,residual_out=x": (True, None, "x"),
}


@pytest.mark.parametrize("layout", ["c", "padded"])
@pytest.mark.parametrize("form", IN_PLACE)
@pytest.mark.parametrize("op", FUSED)
def test_fused_in_place(normlab_subject: Subject, op: str, form: str, layout: str) -> None:
    """The in-place forms (``out=x, residual_out=residual`` is the serving form): the outputs
    returned are the arrays passed, and hold y and h of the inputs as they were (references
    from copies taken before the call); statistics compared too. ``residual=x`` adds x to
    itself."""
    _require(normlab_subject, op)
    same, out_of, residual_out_of = IN_PLACE[form]
    if out_of is not None or residual_out_of is not None:
        normlab_subject.require_writable()
    normlab_subject.require_layout(layout)
    case = _case(normlab_subject, op, shape=(9, 40), seed=37, base_layout=layout)
    x, residual, kwargs = case.inputs(normlab_subject.name)
    if same:
        residual = x
    arrays = {"x": x, "residual": residual}
    copies = {k: normlab_subject.to_numpy(a).copy() for k, a in arrays.items()}
    out = None if out_of is None else arrays[out_of]
    residual_out = None if residual_out_of is None else arrays[residual_out_of]
    stats_out = (out, *(None for _ in OPS[op].stats_outputs))
    result = case.call(
        x,
        residual,
        **kwargs,
        out=stats_out if out is not None else None,
        residual_out=residual_out,
        backend=normlab_subject.backend,
    )
    repro = case.snippet(normlab_subject.name) + f"    # in place: {form}\n"
    y, h, mean, rstd = case.unpack(result, repro)
    assert out is None or y is out, f"{form}: y must be returned as out itself\n{repro}"
    assert residual_out is None or h is residual_out, (
        f"{form}: h must be returned as residual_out itself\n{repro}"
    )
    for name, a in arrays.items():
        if name not in (out_of, residual_out_of) and not (same and name == "residual"):
            assert same_bits(normlab_subject.to_numpy(a), copies[name]), (
                f"{form}: {name} was modified\n{repro}"
            )
    want_h = np.add(copies["x"], copies["residual"])
    got = [None if a is None else normlab_subject.to_numpy(a) for a in (y, h, mean, rstd)]
    _compare_h(got[1], want_h, repro)
    _, _, weight, bias = case.numpy_inputs()
    assert got[0] is not None
    case.base.compare(
        got[0],
        got[2],
        got[3],
        backend=normlab_subject.name,
        inputs=(want_h, weight, bias),
        repro=repro,
    )


def _compare_h(h: np.ndarray | None, want: np.ndarray, repro: str) -> None:
    assert h is not None, f"h is missing\n{repro}"
    assert_same_bits(h, want, "h", repro)


#: Overlaps refused: name -> what shares memory.
ALIASING: Final = (
    "out_is_residual_out",
    "out_overlaps_residual_out",
    "out_overlaps_weight",
    "residual_out_partly_x",
    "out_partly_residual",
)


@pytest.mark.parametrize("overlap", ALIASING)
@pytest.mark.parametrize("op", FUSED)
def test_fused_aliasing_refused(normlab_subject: Subject, op: str, overlap: str) -> None:
    """Outputs sharing memory other than the in-place forms: ArgumentError, and nothing the
    caller passed is modified."""
    _require(normlab_subject, op)
    normlab_subject.require_layout("padded")  # views into one memory: the family has strides
    s = normlab_subject
    dtype = numpy_dtype(s.dtype)
    rng = np.random.default_rng(38)
    memory = s.from_numpy(rng.standard_normal((4, 36)).astype(dtype))
    x = s.from_numpy(rng.standard_normal((3, 33)).astype(dtype))
    residual = s.from_numpy(rng.standard_normal((3, 33)).astype(dtype))
    weight = s.from_numpy(np.ones(33, dtype))
    out: Any = None
    residual_out: Any = None
    if overlap == "out_is_residual_out":
        out = residual_out = memory[:3, :33]
    elif overlap == "out_overlaps_residual_out":
        out, residual_out = memory[:3, :33], memory[1:, :33]
    elif overlap == "out_overlaps_weight":
        weight, out = memory[0, :33], memory[:3, :33]
    elif overlap == "residual_out_partly_x":
        x, residual_out = memory[:3, 1:34], memory[:3, :33]
    else:
        residual, out = memory[1:, 3:], memory[:3, :33]
    given = {"memory": memory, "x": x, "residual": residual, "weight": weight}
    before = {k: s.to_numpy(a).tobytes() for k, a in given.items()}
    with pytest.raises(ArgumentError):
        getattr(normlab, op)(
            x, residual, weight=weight, out=out, residual_out=residual_out, backend=s.backend
        )
    for what, a in given.items():
        assert same_bits(s.to_numpy(a).tobytes(), before[what]), f"{overlap}: {what} was modified"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", FUSED)
def test_fused_autograd(normlab_subject: Subject, op: str, dtype: str) -> None:
    """Tensors that require grad, where the backend keeps the graph: y's gradient reaches x
    and residual alike as the base op's gradient at the rounded h (the float64 oracle's dx,
    dweight, dbias, within the backward's tolerances), and h's gradient reaches both
    unchanged (bitwise)."""
    s = normlab_subject
    _require(s, op)
    s.require_dtype(dtype)
    s.require_graph(op)
    if s.family != "torch":
        pytest.skip(f"autograd records torch tensors; backend {s.name!r} is tested with {s.family}")
    import torch

    case = _case(s, op, dtype, shape=(33, 40), seed=39, base_return_stats=False)
    backward = BackwardCase(case.base)
    dy_values = backward.numpy_inputs()[1]
    dh_values = np.random.default_rng((39, 3)).standard_normal(dy_values.shape)
    dh_values = dh_values.astype(dy_values.dtype)
    repro = case.snippet(s.name)
    for wrt, grad in (("y", s.from_numpy(dy_values)), ("h", s.from_numpy(dh_values))):
        x, residual, kwargs = case.inputs(s.name)
        leaves = {"x": x.requires_grad_(), "residual": residual.requires_grad_()}
        for name in ("weight", "bias"):
            if name in kwargs:
                leaves[name] = kwargs[name].requires_grad_()
        y, h = case.call(x, residual, **kwargs, backend=s.backend)
        torch.autograd.backward([y if wrt == "y" else h], [grad])
        grads = {
            name: None if leaf.grad is None else np.asarray(s.to_numpy(leaf.grad))
            for name, leaf in leaves.items()
        }
        for name in ("x", "residual"):
            assert grads[name] is not None, f"d{name} is missing (gradient of {wrt})\n{repro}"
        if wrt == "h":
            for name, got in grads.items():
                if name in ("x", "residual"):
                    assert got is not None
                    assert_same_bits(got, dh_values, f"d{name} (gradient of h)", repro)
                else:
                    assert got is None or not got.any(), f"h's gradient reached {name}\n{repro}"
            continue
        dresidual = grads.pop("residual")
        assert dresidual is not None
        backward.compare(grads, backend=s.name, x=case.h(), repro=repro)
        backward.compare({"x": dresidual}, backend=s.name, x=case.h(), repro=repro)


# --------------------------------------------------------------------------------------------
# A float32 residual stream beside half x


@pytest.mark.parametrize("form", ["allocated", "in place", "post-norm"])
@pytest.mark.parametrize("dtype", sorted(HALF_DTYPES))
@pytest.mark.parametrize("base", list(FUSED_OPS))
def test_float32_residual_stream(
    normlab_subject: Subject, base: str, dtype: str, form: str
) -> None:
    """``residual`` float32 beside float16/bfloat16 x (flash-attention's ``residual_in_fp32``):
    ``h = float32(x) + residual`` bitwise, kept in float32; ``y`` in x's dtype is the norm of
    that unrounded ``h`` (against the float64 reference of h), the statistics float32 as well;
    in place (``out=x, residual_out=residual``) and the post-norm form give the same bits; a
    row's bits alone and in the batch."""
    s = normlab_subject
    op = FUSED_OPS[base]
    s.require_fused(op)
    s.require_dtype(dtype)
    s.require_dtype("float32")
    if form == "in place":
        s.require_writable()
    rng = np.random.default_rng(21)
    rows, cols = 41, 320
    offsets = rng.normal(0, 4, (rows, 1))
    x = (rng.standard_normal((rows, cols)) + offsets).astype(numpy_dtype(dtype))
    residual = (100 * rng.standard_normal((rows, cols)) + offsets).astype(np.float32)
    weight = rng.standard_normal(cols).astype(numpy_dtype(dtype))
    bias = rng.standard_normal(cols).astype(np.float32)
    kwargs: dict[str, Any] = {"weight": s.from_numpy(weight), "return_stats": True}
    if base == "layer_norm":
        kwargs["bias"] = s.from_numpy(bias)
    function = getattr(normlab, op)
    repro = (
        f"reproduce: normlab.{op}(x, residual, ...) with {rows}x{cols} {dtype} x and float32 "
        f"residual ({form}), backend={s.backend!r}"
    )

    def call(rows_taken: slice, form: str) -> tuple[Any, Any, list[Any]]:
        xs, rs = (s.from_numpy(a[rows_taken].copy()) for a in (x, residual))
        if form == "in place":
            result = function(xs, rs, out=xs, residual_out=rs, backend=s.backend, **kwargs)
        elif form == "post-norm":
            result = function(xs, rs, return_residual=False, backend=s.backend, **kwargs)
            result = (result[0], None, *result[1:])
        else:
            result = function(xs, rs, backend=s.backend, **kwargs)
        y, h, *stats = (None if r is None else s.to_numpy(r) for r in result)
        return y, h, stats

    y, h, stats = call(slice(None), form)
    want_h = x.astype(np.float32) + residual
    if h is not None:
        assert h.dtype == np.float32, f"h is {h.dtype}, not float32\n{repro}"
        assert same_bits(h, want_h), f"h differs from float32(x) + residual\n{repro}"
    assert y.dtype == numpy_dtype(dtype), f"y is {y.dtype}, not x's {dtype}\n{repro}"
    if base == "layer_norm":
        y_ref, mean_ref, rstd_ref = reference.layer_norm(want_h, weight=weight, bias=bias)
        cond = conditioning(mean_ref, rstd_ref)
        scale = y_scale(base, (want_h - mean_ref) * rstd_ref, weight, bias)
        refs = {"mean": mean_ref, "rstd": rstd_ref}
    else:
        y_ref, rstd_ref = reference.rms_norm(want_h, weight=weight)
        cond = conditioning(None, rstd_ref)
        scale = y_scale(base, want_h * rstd_ref, weight)
        refs = {"rstd": rstd_ref}
    assert_close(y, y_ref, dtype, cond, what="y", cols=cols, scale=scale, repro=repro)
    for (name, ref), got in zip(refs.items(), stats, strict=True):
        assert got.dtype == np.float32, f"{name} is {got.dtype}, not float32\n{repro}"
        assert_close(got, ref, "float32", cond, what=name, cols=cols, repro=repro)
    if form != "allocated":
        y_allocated = call(slice(None), "allocated")[0]
        assert same_bits(y, y_allocated), f"y {form} differs from the allocating call's\n{repro}"
    alone = call(slice(5, 12), form)
    assert same_bits(alone[0], y[5:12]), f"rows 5..11 alone give other bits of y\n{repro}"
