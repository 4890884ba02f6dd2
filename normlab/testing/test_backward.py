"""Backward: the gradients of layer_norm and rms_norm, where the record lists
``layer_norm_backward`` / ``rms_norm_backward`` (skipped, with the reason, otherwise).

Central differences of the backend's own forward in float64; random calls against the float64
oracle and torch.autograd; large offsets and eps reaching the gradients only through the given
statistics; bitwise repeatable dweight/dbias, run after run and across thread counts; weight or
none; ``needs``; empty inputs; every bad input. Every call also checks what it returns and that
no input is modified (:meth:`~normlab.testing.backward_cases.BackwardCase.run`).
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final

import numpy as np
import pytest
from hypothesis import given, settings

import normlab
from normlab import (
    ArgumentError,
    BackendError,
    DeviceError,
    DtypeError,
    ShapeError,
    reference,
    registry,
)
from normlab.constants import FLOAT_DTYPES, HALF_DTYPES, stats_dtype_for
from normlab.ops import OPS as TABLE
from normlab.ops import names
from normlab.testing.backward_cases import BACKWARD_OPS, BackwardCase
from normlab.testing.bitwise import same_bits
from normlab.testing.cases import OPS, Case
from normlab.testing.conversions import numpy_dtype
from normlab.testing.strategies import backward_cases
from normlab.testing.subject import Subject

#: Central differences: the step is this times (1 + |value|); a gradient may differ from the
#: quotient by this times (its tolerance scale + |quotient|) — float64 rounding of the forward
#: over the step is near 1e-10 of the scale, the truncation error near step².
FD_STEP: Final = 1e-6
FD_RTOL: Final = 1e-6
FD_EPS: Final = 1e-5

#: (shape, normalized_shape, axis): trailing, several trailing, non-trailing axes.
FD_LAYOUTS: Final = [((3, 5), None, None), ((2, 3, 4), (3, 4), None), ((3, 2, 4), None, (0, -1))]


def _require(subject: Subject, op: str) -> str:
    """Skip unless the record lists the backward of ``op``; the backward op's name."""
    backward_op = BACKWARD_OPS[op]
    subject.require_op(backward_op)
    return backward_op


def _param(dtype: str) -> str:
    """weight's dtype for x of ``dtype``: float32 for half types (the common mixed case)."""
    return "float32" if dtype in HALF_DTYPES else dtype


# --------------------------------------------------------------------------------------------
# Numerics


@pytest.mark.parametrize(("shape", "normalized_shape", "axis"), FD_LAYOUTS)
@pytest.mark.parametrize("op", OPS)
def test_backward_finite_differences(
    normlab_subject: Subject,
    op: str,
    shape: tuple[int, ...],
    normalized_shape: Any,
    axis: Any,
) -> None:
    """In float64, dx, dweight (and dbias) equal central differences of ``Σ dy * y`` through
    the backend's own forward (the float64 reference forward where the record lacks it)."""
    _require(normlab_subject, op)
    normlab_subject.require_dtype("float64")
    name = normlab_subject.name
    bias = "float64" if op == "layer_norm" else None
    forward = Case(
        shape, "float64", "rowwise", 21, normalized_shape, axis, "float64", bias, FD_EPS, op=op
    )
    case = BackwardCase(forward)
    grads = case.run(name)
    x, dy, weight = case.numpy_inputs()
    params = {"x": x, "weight": weight, "bias": forward.numpy_inputs()[2]}
    own = op in normlab_subject.ops

    def forward_y(p: dict[str, Any]) -> np.ndarray:
        """y of the forward for the parameters ``p``, as float64 NumPy."""
        if own:
            given = {k: None if v is None else normlab_subject.from_numpy(v) for k, v in p.items()}
            kwargs: dict[str, Any] = {"normalized_shape": normalized_shape, "axis": axis}
            if op == "layer_norm":
                kwargs["bias"] = given["bias"]
            kwargs["backend"] = normlab_subject.backend
            y = forward.call(given["x"], weight=given["weight"], eps=FD_EPS, **kwargs)
            return normlab_subject.to_numpy(y).astype(np.float64)
        if op == "layer_norm":
            return reference.layer_norm(
                p["x"], normalized_shape, p["weight"], p["bias"], FD_EPS, axis=axis
            )[0]
        return reference.rms_norm(p["x"], normalized_shape, p["weight"], FD_EPS, axis=axis)[0]

    scales = case.expected().scales
    repro = case.snippet(name)
    for what, got in grads.items():
        value = params[what]
        assert got is not None and value is not None
        numeric = np.empty_like(value)
        for i in np.ndindex(value.shape):
            h = FD_STEP * (1.0 + abs(value[i]))
            sides = []
            for step in (h, -h):
                moved = value.copy()
                moved[i] += step
                sides.append(float((forward_y({**params, what: moved}) * dy).sum()))
            numeric[i] = (sides[0] - sides[1]) / (2 * h)
        allowed = FD_RTOL * (scales[what] + np.abs(numeric))
        bad = ~(np.abs(got - numeric) <= allowed)
        assert not bad.any(), (
            f"d{what} differs from central differences of the forward at "
            f"{[tuple(int(j) for j in i) for i in np.argwhere(bad)[:5]]}: got "
            f"{got[bad][:5]}, differences give {numeric[bad][:5]}\n{repro}"
        )


@pytest.mark.parametrize("op", OPS)
def test_backward_matches_reference(
    normlab_subject: Subject, normlab_settings: settings, op: str
) -> None:
    """Random shapes, axes, dtypes (float16 and bfloat16 included), weights, eps, values,
    layouts of x and dy, and ``needs``: against the float64 oracle and, where torch is
    installed, torch.autograd in float64; tolerances scaled by each row's conditioning."""
    _require(normlab_subject, op)
    name = normlab_subject.name
    drawn = backward_cases(normlab_subject.dtypes, normlab_subject.usable_layouts, op)

    @normlab_settings
    @given(case=drawn)
    def matches(case: BackwardCase) -> None:
        case.check(name, against_autograd=True)

    matches()


@pytest.mark.parametrize("cols", [17, 1000, 4097])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_autograd_gradients(normlab_subject: Subject, op: str, dtype: str, cols: int) -> None:
    """Tensors that require grad, where the backend keeps the graph: ``y.backward(dy)``
    after ``op(x, weight, bias, backend=NAME)`` gives the float64 oracle's dx, dweight, dbias
    (CUDA tensors through a CUDA backend with ``--normlab-arrays torch``)."""
    s = normlab_subject
    s.require_op(op)
    s.require_dtype(dtype)
    s.require_graph(op)
    if s.family != "torch":
        pytest.skip(f"autograd records torch tensors; backend {s.name!r} is tested with {s.family}")
    param = _param(dtype)
    forward = Case(
        (33, cols),
        dtype,
        "rowwise",
        seed=cols,
        weight=param,
        bias=param if op == "layer_norm" else None,
        op=op,
    )
    _check_autograd(s, forward)


def _check_autograd(s: Subject, forward: Case) -> None:
    """``y.backward(dy)`` after the subject's forward of ``forward`` (x, weight and bias
    requiring grad) against the float64 oracle."""
    case = BackwardCase(forward)
    x, kwargs = forward.inputs(s.name)
    leaves = {"x": x.requires_grad_(), "weight": kwargs["weight"].requires_grad_()}
    if "bias" in kwargs:
        leaves["bias"] = kwargs["bias"].requires_grad_()
    y = forward.call(x, **kwargs, backend=s.backend)
    y.backward(s.from_numpy(case.numpy_inputs()[1]))
    grads: dict[str, np.ndarray | None] = {}
    for name, leaf in leaves.items():
        assert leaf.grad is not None, f"d{name} is missing\n{case.snippet(s.name)}"
        grads[name] = s.to_numpy(leaf.grad)
    case.compare(grads, backend=s.name)


#: The forward ops a training region ends with, fused ones included.
CHECKPOINTED_OPS: Final = names(direction="forward")


@pytest.mark.parametrize("last", [True, False], ids=["norm-last", "norm-inside"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", CHECKPOINTED_OPS)
def test_activation_checkpointing(
    normlab_subject: Subject, op: str, dtype: str, reentrant: bool, last: bool
) -> None:
    """A region ``x * 1.5 -> op`` (the norm its last op, or followed by another) under
    ``torch.utils.checkpoint`` (reentrant and not: torch stops a non-reentrant recomputation
    by raising through the norm's saved-tensor hooks) gives the gradients of x and the
    parameters bitwise as without checkpointing."""
    s = normlab_subject
    if s.family != "torch":
        pytest.skip(f"activation checkpointing is torch's; {s.name!r} is tested with {s.family}")
    s.require_dtype(dtype)
    if op.startswith("add_"):
        s.require_fused(op)
    else:
        s.require_op(op)
    s.require_graph(op.removeprefix("add_"))
    import torch.utils.checkpoint

    rng = np.random.default_rng(28)
    given = {
        "x": rng.standard_normal((6, 96)).astype(numpy_dtype(dtype)),
        "residual": rng.standard_normal((6, 96)).astype(numpy_dtype(dtype)),
        "weight": rng.standard_normal(96).astype(np.float32),
        "bias": rng.standard_normal(96).astype(np.float32),
    }
    fused, centred = op.startswith("add_"), "layer" in op

    def gradients(checkpointed: bool) -> dict[str, np.ndarray]:
        leaves = {
            name: s.from_numpy(a).requires_grad_()
            for name, a in given.items()
            if (fused or name != "residual") and (centred or name != "bias")
        }
        rest = {name: t for name, t in leaves.items() if name != "x"}

        def region(x: Any) -> Any:
            inputs = [x * 1.5, *([rest["residual"]] if fused else [])]
            params = {name: t for name, t in rest.items() if name != "residual"}
            y = getattr(normlab, op)(*inputs, **params, backend=s.backend)
            y = y[0] if fused else y
            return y if last else y * 2.0

        x = leaves["x"]
        if checkpointed:
            out = torch.utils.checkpoint.checkpoint(region, x, use_reentrant=reentrant)
        else:
            out = region(x)
        out.float().square().sum().backward()
        return {name: s.to_numpy(t.grad) for name, t in leaves.items()}

    want, got = gradients(False), gradients(True)
    for name in want:
        assert same_bits(got[name], want[name]), (
            f"d{name} under checkpointing (use_reentrant={reentrant}) differs from without\n"
            f"reproduce: normlab.{op} on 6x96 {dtype} rows, backend={s.backend!r}, "
            "inside torch.utils.checkpoint.checkpoint"
        )


#: Rows of the half-precision parameter-gradient cases: a float16 or bfloat16 running sum of
#: terms near 1 stops growing long before this (bfloat16 adds nothing to 256, float16 nothing
#: to 2048); Transformer Engine's and Liger's tests have this many tokens.
HALF_SUM_ROWS: Final = 4096


@pytest.mark.parametrize("route", ["backward op", "autograd"])
@pytest.mark.parametrize("param", ["x's dtype", "float32"])
@pytest.mark.parametrize("dtype", sorted(HALF_DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_half_parameter_gradients_sum_in_float32(
    normlab_subject: Subject, op: str, dtype: str, param: str, route: str
) -> None:
    """dweight and dbias of 4096 rows of float16/bfloat16 x, with parameters in x's dtype or
    float32, against the float64 oracle: the sums over rows must run in float32 (the contract),
    rounded once into the parameter's dtype; a half-precision sum of 4096 terms stalls or
    drifts far beyond the tolerance. Through the backward op where the record lists it, and
    through torch autograd of the forward where the family is torch and the graph is kept."""
    s = normlab_subject
    s.require_dtype(dtype)
    _require_route(s, op, route)
    weight = dtype if param == "x's dtype" else "float32"
    forward = Case(
        (HALF_SUM_ROWS, 64),
        dtype,
        "rowwise",
        seed=26,
        weight=weight,
        bias=weight if op == "layer_norm" else None,
        op=op,
    )
    _check_route(s, forward, route)


def _require_route(s: Subject, op: str, route: str) -> None:
    """Skip, saying why, unless ``s`` serves ``route``: the backward op of ``op``, or torch
    autograd of the forward (a torch family whose graph is kept)."""
    if route == "backward op":
        _require(s, op)
        return
    s.require_op(op)
    s.require_graph(op)
    if s.family != "torch":
        pytest.skip(f"autograd records torch tensors; {s.name!r} is tested with {s.family}")


def _check_route(s: Subject, forward: Case, route: str) -> None:
    """The gradients of ``forward`` through ``route`` against the float64 oracle."""
    if route == "backward op":
        BackwardCase(forward).check(s.name)
    else:
        _check_autograd(s, forward)


#: Half-precision batches whose rows are constant or eps-dominated, every row of the call or
#: some: the values kind and eps of each named case. A backend that repairs such rows after
#: torch's kernels (rstd beyond 0.5/sqrt(eps)) must carry the gradients through the repair,
#: also when no row is left to torch (Transformer Engine's inputs: uniform [0, 1), eps 0.3).
CONSTANT_ROWS: Final = {
    "every-row-zeros": ("zeros", 1e-5),
    "every-row-constant": ("constant", 1e-5),
    "every-row-eps-dominated": ("unit_uniform", 0.3),
    "some-rows-constant": ("some_constant", 1e-5),
}


@pytest.mark.parametrize("route", ["backward op", "autograd"])
@pytest.mark.parametrize("rows", CONSTANT_ROWS)
@pytest.mark.parametrize("param", ["x's dtype", "float32"])
@pytest.mark.parametrize("dtype", sorted(HALF_DTYPES))
@pytest.mark.parametrize("op", OPS)
def test_half_backward_of_constant_rows(
    normlab_subject: Subject, op: str, dtype: str, param: str, rows: str, route: str
) -> None:
    """float16/bfloat16 rows that are constant or whose variance eps dominates, in every row
    or in some: dx, dweight and dbias against the float64 oracle, through the backward op and
    through torch autograd of the forward (parameters in x's dtype or float32)."""
    s = normlab_subject
    s.require_dtype(dtype)
    _require_route(s, op, route)
    values, eps = CONSTANT_ROWS[rows]
    weight = dtype if param == "x's dtype" else "float32"
    forward = Case(
        (8, 768),
        dtype,
        values,
        seed=27,
        weight=weight,
        bias=weight if op == "layer_norm" else None,
        eps=eps,
        op=op,
    )
    _check_route(s, forward, route)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_backward_large_offset(normlab_subject: Subject, op: str, dtype: str) -> None:
    """Rows of ``1e4 + N(0, 1)``: the backward must work from the given mean and rstd —
    E[x²]−E[x]² recomputed in float32 loses every digit, and in float16 the squares
    overflow."""
    _require(normlab_subject, op)
    normlab_subject.require_dtype(dtype)
    for weight in (None, _param(dtype)):
        forward = Case((16, 1000), dtype, "far_offset", seed=22, weight=weight, op=op)
        BackwardCase(forward).check(normlab_subject.name)


#: Row counts around the built-ins' backward row chunk of 32, and beyond 65,535 rows.
BOUNDARY_ROWS = (31, 33, 32 * 5 + 1, 65_537)


@pytest.mark.parametrize("rows", BOUNDARY_ROWS)
@pytest.mark.parametrize("op", OPS)
def test_backward_boundary_rows(normlab_subject: Subject, op: str, rows: int) -> None:
    """dx, dweight and dbias at row counts where chunked row sums have a partial last chunk."""
    _require(normlab_subject, op)
    dtype = normlab_subject.dtype
    cols = 4 if rows > 65_535 else 40
    forward = Case((rows, cols), dtype, "rowwise", seed=25, weight=dtype, op=op)
    BackwardCase(forward).check(normlab_subject.name)


@pytest.mark.parametrize("eps", [1e-4, 1e-2])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_backward_uses_given_rstd(
    normlab_subject: Subject, op: str, dtype: str, eps: float
) -> None:
    """Rows of variance 1e-6 normalized with a large eps: the backward has no eps argument, so
    only the given rstd can bring eps into the gradients."""
    _require(normlab_subject, op)
    normlab_subject.require_dtype(dtype)
    forward = Case((8, 64), dtype, "tiny", seed=23, weight=_param(dtype), eps=eps, op=op)
    BackwardCase(forward).check(normlab_subject.name)


#: (x dtype, weight dtype or None): x's dtype, float32 for half x, or no weight.
WEIGHTS: Final = [
    pytest.param(dtype, w, id=f"{dtype}-weight_{w or 'none'}")
    for dtype in FLOAT_DTYPES
    for w in (None, *dict.fromkeys((dtype, _param(dtype))))
]


@pytest.mark.parametrize(("dtype", "w"), WEIGHTS)
@pytest.mark.parametrize("op", OPS)
def test_backward_affine(normlab_subject: Subject, op: str, dtype: str, w: str | None) -> None:
    """With a weight (x's dtype, or float32 for half x) or none. bias never enters the
    gradients, so "bias only" and "neither" are the same backward call, without weight:
    dweight and dbias are then those of implicit parameters, in x's dtype."""
    _require(normlab_subject, op)
    normlab_subject.require_dtype(dtype)
    forward = Case((6, 33), dtype, "rowwise", seed=24, weight=w, op=op)
    BackwardCase(forward).check(normlab_subject.name)


def _subsets(op: str) -> list[tuple[str, ...]]:
    names = TABLE[BACKWARD_OPS[op]].gradients
    return [c for k in range(len(names) + 1) for c in itertools.combinations(names, k)]


@pytest.mark.parametrize(
    ("op", "needs"),
    [(op, needs) for op in OPS for needs in _subsets(op)],
    ids=[f"{op}-{'+'.join(needs) or 'nothing'}" for op in OPS for needs in _subsets(op)],
)
def test_backward_needs(normlab_subject: Subject, op: str, needs: tuple[str, ...]) -> None:
    """A gradient is None exactly when ``needs`` leaves it out (checked by ``run``); the
    others are bitwise those of the full call, and ``needs`` may be a list or a set too."""
    _require(normlab_subject, op)
    dtype = normlab_subject.dtype
    forward = Case((40, 24), dtype, "rowwise", seed=25, weight=dtype, op=op)
    full = BackwardCase(forward).run(normlab_subject.name)
    for given_needs in (needs, list(needs), set(needs)):
        case = BackwardCase(forward, tuple(needs))
        args, kwargs = case.inputs(normlab_subject.name)
        kwargs["needs"] = given_needs
        result = case.call(*args, **kwargs, backend=normlab_subject.backend)
        for what, got in zip(case.names, result, strict=True):
            if what not in needs:
                assert got is None, f"d{what} is not None with needs={given_needs!r}"
                continue
            want = full[what]
            assert want is not None and got is not None
            assert same_bits(normlab_subject.to_numpy(got), want), (
                f"d{what} with needs={given_needs!r} differs from the full call\n"
                f"{case.snippet(normlab_subject.name)}"
            )
    BackwardCase(forward, tuple(needs)).check(normlab_subject.name)


@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (2, 0, 4)])
@pytest.mark.parametrize("op", OPS)
def test_backward_empty(normlab_subject: Subject, op: str, shape: tuple[int, ...]) -> None:
    """No rows or no columns: an empty dx of x's shape, and dweight/dbias all zero."""
    _require(normlab_subject, op)
    dtype = normlab_subject.dtype
    s = normlab_subject
    x = s.from_numpy(np.zeros(shape, numpy_dtype(dtype)))
    stats = s.from_numpy(np.zeros((*shape[:-1], 1), numpy_dtype(stats_dtype_for(dtype))))
    weight = s.from_numpy(np.ones(shape[-1:], numpy_dtype(dtype)))
    args = (x, x, stats, stats, weight) if op == "layer_norm" else (x, x, stats, weight)
    result = getattr(normlab, BACKWARD_OPS[op])(*args, backend=s.backend)
    dx, *sums = (None if g is None else s.to_numpy(g) for g in result)
    assert dx is not None and dx.shape == shape and dx.dtype == numpy_dtype(dtype), dx
    for g in sums:
        assert g is not None and g.shape == shape[-1:] and g.dtype == numpy_dtype(dtype), g
        assert not g.any(), f"a sum over no rows is not zero: {g}"


# --------------------------------------------------------------------------------------------
# Determinism


def _bits(case: BackwardCase, backend: str) -> dict[str, bytes]:
    return {k: v.tobytes() for k, v in case.run(backend).items() if v is not None}


#: (x dtype or "widest", weight): float32 with its weight, float16 without (sums in float32).
REPEAT_CASES: Final = [("float32", True), ("float16", False)]


def _repeat_case(subject: Subject, op: str, dtype: str, weight: bool) -> BackwardCase:
    subject.require_dtype(dtype)
    # Large enough for parallel kernels (normlab's run rows in parallel from 2**15 elements).
    forward = Case((1000, 160), dtype, "normal", seed=26, weight=dtype if weight else None, op=op)
    return BackwardCase(forward)


@pytest.mark.parametrize(("dtype", "weight"), REPEAT_CASES)
@pytest.mark.parametrize("op", OPS)
def test_backward_repeatable(normlab_subject: Subject, op: str, dtype: str, weight: bool) -> None:
    """dx, dweight and dbias are the same bits in four runs: no atomics, no order that
    changes from run to run."""
    _require(normlab_subject, op)
    case = _repeat_case(normlab_subject, op, dtype, weight)
    runs = [_bits(case, normlab_subject.name) for _ in range(4)]
    differ = sorted({k for run in runs[1:] for k in run if run[k] != runs[0][k]})
    assert not differ, f"{differ} differ between runs\n{case.snippet(normlab_subject.name)}"


def _numba_knob() -> tuple[Callable[[], int], Callable[[int], None], tuple[int, ...]]:
    numba = importlib.import_module("numba")
    most = int(numba.config.NUMBA_NUM_THREADS)
    return numba.get_num_threads, numba.set_num_threads, tuple(sorted({1, min(3, most), most}))


def _torch_knob() -> tuple[Callable[[], int], Callable[[int], None], tuple[int, ...]]:
    torch = importlib.import_module("torch")
    return torch.get_num_threads, torch.set_num_threads, (1, 2, 3)


#: library (a record's ``library``) -> () -> (get, set, thread counts to try).
THREAD_KNOBS: Final = {"numba": _numba_knob, "torch": _torch_knob}


@contextmanager
def _thread_count(
    knob: tuple[Callable[[], int], Callable[[int], None], Any],
) -> Iterator[Callable[[int], None]]:
    """The knob's setter; the thread count is restored afterwards."""
    get, set_, _ = knob
    before = get()
    try:
        yield set_
    finally:
        set_(before)


@pytest.mark.parametrize(("dtype", "weight"), REPEAT_CASES)
@pytest.mark.parametrize("op", OPS)
def test_backward_thread_counts(
    normlab_subject: Subject, op: str, dtype: str, weight: bool
) -> None:
    """The same bits with 1, 2 or 3 threads (and the library's most), where the backend's
    library has a thread-count knob (numba, torch): partial sums may not follow threads."""
    _require(normlab_subject, op)
    normlab_subject.require_named("a backend library's thread-count knob")
    library = registry.get(normlab_subject.name).record.library
    if library not in THREAD_KNOBS:
        pytest.skip(
            f"backend {normlab_subject.name!r}: no thread-count knob known for its library "
            f"{library!r} (known: {', '.join(THREAD_KNOBS)})"
        )
    knob = THREAD_KNOBS[library]()
    counts = knob[2]
    if len(counts) < 2:
        pytest.skip(f"{library} can run only one thread here")
    case = _repeat_case(normlab_subject, op, dtype, weight)
    with _thread_count(knob) as set_threads:
        runs = {}
        for n in (*counts, *reversed(counts)):
            set_threads(n)
            runs[n] = _bits(case, normlab_subject.name)
    first = runs[counts[0]]
    differ = {n: sorted(k for k in run if run[k] != first[k]) for n, run in runs.items()}
    differ = {n: names for n, names in differ.items() if names}
    assert not differ, (
        f"with {library} threads {differ} (compared with {counts[0]}) the gradients differ\n"
        f"{case.snippet(normlab_subject.name)}"
    )


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("op", OPS)
def test_autograd_thread_counts(normlab_subject: Subject, op: str, dtype: str) -> None:
    """Through torch autograd of the forward (the route training takes), x, weight and bias
    requiring grad: the parameter gradients (and dx) are the same bits with 1, 2 or 3 torch
    threads and numba's counts, the default choice included: torch's own CPU backward splits
    its column sums by the thread count."""
    s = normlab_subject
    if s.family != "torch":
        pytest.skip(f"autograd records torch tensors; {s.name!r} is tested with {s.family}")
    s.require_op(op)
    s.require_dtype(dtype)
    s.require_graph(op)
    knobs = [THREAD_KNOBS[name]() for name in THREAD_KNOBS if importlib.util.find_spec(name)]
    forward = Case(
        (1000, 160),
        dtype,
        "normal",
        seed=29,
        weight=dtype,
        bias=dtype if op == "layer_norm" else None,
        op=op,
    )
    case = BackwardCase(forward)
    runs = {}
    before = [get() for get, _, _ in knobs]
    try:
        for n in (1, 2, 3, 1):
            for _, set_, counts in knobs:
                set_(min(n, max(counts)))
            x, kwargs = forward.inputs(s.name)
            leaves = {"x": x.requires_grad_()}
            leaves.update(
                {k: kwargs[k].requires_grad_() for k in ("weight", "bias") if k in kwargs}
            )
            y = forward.call(x, **kwargs, backend=s.backend)
            y.backward(s.from_numpy(case.numpy_inputs()[1]))
            runs[n] = {name: s.to_numpy(leaf.grad).tobytes() for name, leaf in leaves.items()}
    finally:
        for (_, set_, _), count in zip(knobs, before, strict=True):
            set_(count)
    differ = sorted({k for run in runs.values() for k in run if run[k] != runs[1][k]})
    assert not differ, (
        f"the gradients of {differ} change with the thread count\n{case.snippet(s.name)}"
    )


# --------------------------------------------------------------------------------------------
# Errors


class _Foreign:
    """An array of a library no backend serves."""

    def __init__(self, a: np.ndarray) -> None:
        self.shape = a.shape
        self.dtype = a.dtype


def _other(s: Subject, right: str) -> str:
    """A dtype the family can make other than ``right`` (and float32 for half ``right``)."""
    allowed = {right, "float32"} if right in HALF_DTYPES else {right}
    for dtype in s.dtypes:
        if dtype not in allowed:
            return dtype
    pytest.skip(f"{s.family} arrays of no dtype but {sorted(allowed)} can be made here")


#: Arguments of a good call on x of shape (3, 4): "dy", "x", "mean", "rstd", "weight".
Args = dict[str, Any]

#: id -> (error, op or None for both, change of the arguments of a good call).
BAD: Final[dict[str, tuple[type[Exception], str | None, Callable[[Subject, Args], Args]]]] = {
    "dy-shape": (ShapeError, None, lambda s, a: {"dy": _ones(s, (3, 3))}),
    "dy-transposed": (ShapeError, None, lambda s, a: {"dy": _ones(s, (4, 3))}),
    "dy-dtype": (DtypeError, None, lambda s, a: {"dy": _ones(s, (3, 4), _other(s, s.dtype))}),
    "dy-list": (ArgumentError, None, lambda s, a: {"dy": [[1.0] * 4] * 3}),
    "dy-foreign": (DeviceError, None, lambda s, a: {"dy": _Foreign(np.ones((3, 4)))}),
    "x-int": (DtypeError, None, lambda s, a: {"x": s.from_numpy(np.ones((3, 4), np.int32))}),
    "mean-flat": (ShapeError, "layer_norm", lambda s, a: {"mean": _stats(s, (3,))}),
    "mean-other-axis": (ShapeError, "layer_norm", lambda s, a: {"mean": _stats(s, (1, 4))}),
    "mean-dtype": (
        DtypeError,
        "layer_norm",
        lambda s, a: {"mean": _ones(s, (3, 1), _other_stats(s))},
    ),
    "mean-missing": (ArgumentError, "layer_norm", lambda s, a: {"mean": None}),
    "rstd-flat": (ShapeError, None, lambda s, a: {"rstd": _stats(s, (3,))}),
    "rstd-rows": (ShapeError, None, lambda s, a: {"rstd": _stats(s, (2, 1))}),
    "rstd-dtype": (DtypeError, None, lambda s, a: {"rstd": _ones(s, (3, 1), _other_stats(s))}),
    "rstd-foreign": (DeviceError, None, lambda s, a: {"rstd": _Foreign(np.ones((3, 1)))}),
    "weight-shape": (ShapeError, None, lambda s, a: {"weight": _ones(s, (3,))}),
    "weight-int": (
        DtypeError,
        None,
        lambda s, a: {"weight": s.from_numpy(np.ones(4, np.int32))},
    ),
    "weight-offset-without-weight": (
        ArgumentError,
        None,
        lambda s, a: {"weight": None, "weight_offset": 1.0},
    ),
    "normalized-shape": (ShapeError, None, lambda s, a: {"normalized_shape": (5,)}),
    "axis-out-of-range": (ShapeError, None, lambda s, a: {"axis": 2}),
    "needs-unknown": (ArgumentError, None, lambda s, a: {"needs": ("x", "gamma")}),
    "needs-str": (ArgumentError, None, lambda s, a: {"needs": "x"}),
    "needs-none": (ArgumentError, None, lambda s, a: {"needs": None}),
    "needs-bias": (ArgumentError, "rms_norm", lambda s, a: {"needs": ("x", "bias")}),
}


def _ones(s: Subject, shape: tuple[int, ...], dtype: str | None = None) -> Any:
    return s.from_numpy(np.ones(shape, numpy_dtype(dtype or s.dtype)))


def _stats(s: Subject, shape: tuple[int, ...]) -> Any:
    return _ones(s, shape, stats_dtype_for(s.dtype))


def _other_stats(s: Subject) -> str:
    """A float dtype other than the statistics dtype that the family can make."""
    right = stats_dtype_for(s.dtype)
    for dtype in ("float64", "float32", *s.dtypes):
        if dtype != right and dtype in s.dtypes:
            return dtype
    pytest.skip(f"{s.family} arrays of no dtype but {right} can be made here")


@pytest.mark.parametrize(
    ("op", "bad"),
    [(op, bad) for op in OPS for bad, (_, only, _) in BAD.items() if only in (None, op)],
)
def test_backward_bad_input(normlab_subject: Subject, op: str, bad: str) -> None:
    """Each bad argument raises the NormlabError subclass that names the problem, and leaves
    the good arguments untouched."""
    _require(normlab_subject, op)
    s = normlab_subject
    error, _, change = BAD[bad]
    good = BackwardCase(Case((3, 4), s.dtype, seed=27, weight=s.dtype, op=op))
    args, _ = good.inputs(s.name)
    names = ("dy", "x", "mean", "rstd", "weight") if op == "layer_norm" else ("dy", "x", "rstd")
    call: Args = dict(zip(names, args, strict=False))
    call["weight"] = args[-1]
    before = {k: s.to_numpy(v).tobytes() for k, v in call.items()}
    originals = dict(call)
    call.update(change(s, call))
    with pytest.raises(error):
        getattr(normlab, BACKWARD_OPS[op])(**call, backend=s.backend)
    changed = [k for k, v in originals.items() if s.to_numpy(v).tobytes() != before[k]]
    assert not changed, f"a failed call modified {changed}"


@pytest.mark.parametrize("op", OPS)
def test_backward_not_provided(normlab_subject: Subject, op: str) -> None:
    """A backward op the record does not list: the named backend refuses with BackendError."""
    backward_op = BACKWARD_OPS[op]
    if backward_op in normlab_subject.ops:
        pytest.skip(f"backend {normlab_subject.name!r} provides {backward_op}")
    s = normlab_subject
    x = _ones(s, (3, 4))
    stats = _stats(s, (3, 1))
    args = (x, x, stats, stats) if op == "layer_norm" else (x, x, stats)
    with pytest.raises(BackendError, match=f"does not provide {backward_op}"):
        getattr(normlab, backward_op)(*args, backend=s.backend)
