"""Fuzzing the public API: every argument of the six public ops (the forward ops, their backward
ops, the fused residual-add ops), valid and invalid at once.

Each drawn call is plain data (:class:`Forward`, :class:`Backward`, :class:`Fused`) from which
the arrays are made; its repr reruns it. An independent model of the contract
(:meth:`Forward.problems`, :meth:`Backward.problems`, :meth:`Fused.problems`) says which errors
the call may raise. Every call then either

* raises a :class:`~normlab.NormlabError` subclass that the model expects (never a raw NumPy,
  torch or Numba exception), or
* when the model finds nothing wrong, returns results of the right kind (type, shape, dtype,
  ``out`` itself) whose values match the float64 reference within the conformance suite's
  tolerances (a fused op's ``h`` bitwise the unfused add), and leaves the caller's other
  arrays untouched.

``NORMLAB_FUZZ_EXAMPLES`` sets the number of calls per test (default 300; the figures in
docs/reliability.md come from larger runs). The examples are those of the hypothesis profile in
force (tests/conftest.py): the same on every run by default, new ones with
``NORMLAB_HYPOTHESIS_PROFILE=explore``. The model is in tests/support/fuzz_model.py, the strategies
in tests/support/fuzz_strategies.py. Each bug the fuzzer found has a test in the module of what it
concerns (core/test_range.py, core/test_errors.py, torch/test_autograd_edges.py,
fused/test_fused.py); what stays open (torch's own numerics on CUDA, torch's CPU layer_norm at
conditioning 1/eps) is an xfail there.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Final

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, given, note, settings

import normlab

torch = pytest.importorskip("torch")

from normlab.testing.conversions import as_float64  # noqa: E402
from tests.support.fuzz_model import (  # noqa: E402
    VALID_FUSED,
    Backward,
    Forward,
    Fused,
    aliasing_problems,
    axes_problems,
    check_backward_result,
    check_forward_result,
    check_fused_result,
    is_array,
    named_outputs,
    shares_memory,
    snapshot,
    unchanged,
    unfused_add,
)
from tests.support.fuzz_strategies import (  # noqa: E402
    FUSED_FORMS,
    INPUT_CLASSES,
    LARGE_SHAPES,
    backward_calls,
    forward_calls,
    fused_calls,
    fused_forms,
    input_classes,
)

EXAMPLES: Final = int(os.environ.get("NORMLAB_FUZZ_EXAMPLES", "300"))
FUZZ: Final = settings(
    max_examples=EXAMPLES,
    deadline=None,
    phases=[phase for phase in Phase if phase is not Phase.explain],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _call(f: Forward, kwargs: dict[str, Any]) -> Any:
    function = normlab.layer_norm if f.op == "layer_norm" else normlab.rms_norm
    if f.preference is None:
        return function(**kwargs)
    with normlab.use_backend(f.preference):
        return function(**kwargs)


@FUZZ
@given(f=forward_calls())
def test_forward_calls_give_the_reference_or_a_normlab_error(
    f: Forward, no_preference: None
) -> None:
    kwargs = f.build()
    expected = f.problems(kwargs)
    note(f"expected errors: {sorted(e.__name__ for e in expected)}")
    for input_class in input_classes(f, kwargs):
        event(f"input class: {input_class}")
    arrays = {k: v for k, v in kwargs.items() if is_array(v)} | f.arrays
    before = {k: snapshot(v) for k, v in arrays.items()}
    x64 = as_float64(kwargs["x"]) if not expected else None
    try:
        result = _call(f, kwargs)
    except normlab.NormlabError as exc:
        _check_refusal(f.op, exc, expected, before, arrays)
        return
    assert x64 is not None, f"accepted a call the model rejects: {sorted(map(str, expected))}"
    event(f"{f.op}: returned, checked against the reference")
    check_forward_result(f, kwargs, result, x64)
    in_place = kwargs.get("out") is kwargs["x"]
    for name in ("x", "weight", "bias"):
        if name in before and not (name == "x" and in_place):
            assert unchanged(before[name], arrays[name]), f"{name} was modified"


def _check_refusal(
    op: str,
    exc: normlab.NormlabError,
    expected: set[type[Exception]],
    before: dict[str, Any],
    arrays: dict[str, Any],
) -> None:
    """A refused call: one of the errors the model expects, and nothing it was passed modified."""
    event(f"{op}: raised {type(exc).__name__}")
    assert expected, f"a valid call raised {type(exc).__name__}: {exc}"
    assert isinstance(exc, tuple(expected)), (
        f"raised {type(exc).__name__} ({exc}); the model expects one of "
        f"{sorted(e.__name__ for e in expected)}"
    )
    for name, saved in before.items():
        assert unchanged(saved, arrays[name]), f"{name} was modified by a refused call"


@FUZZ
@given(fz=fused_calls())
def test_fused_calls(fz: Fused, no_preference: None) -> None:
    """``add_layer_norm``/``add_rms_norm`` calls: a NormlabError the model expects, or ``h``
    bitwise the unfused add of the inputs as they were, ``y`` and the statistics the base op's
    of that ``h``, outputs passed returned as themselves, every other array untouched."""
    kwargs = fz.build()
    expected = fz.problems(kwargs)
    note(f"expected errors: {sorted(e.__name__ for e in expected)}")
    for form in fused_forms(fz, kwargs, expected):
        event(f"fused form: {form}")
    arrays = {k: v for k, v in kwargs.items() if is_array(v)} | fz.call.arrays | fz.arrays
    before = {k: snapshot(v) for k, v in arrays.items()}
    h_want = unfused_add(kwargs["x"], kwargs["residual"]) if not expected else None
    function = normlab.add_layer_norm if fz.call.op == "layer_norm" else normlab.add_rms_norm
    try:
        if fz.call.preference is None:
            result = function(**kwargs)
        else:
            with normlab.use_backend(fz.call.preference):
                result = function(**kwargs)
    except normlab.NormlabError as exc:
        _check_refusal(fz.op, exc, expected, before, arrays)
        return
    assert h_want is not None, f"accepted a call the model rejects: {sorted(map(str, expected))}"
    event(f"{fz.op}: returned, checked against the reference")
    if fz.call.shape in LARGE_SHAPES:
        event(f"large rows {fz.call.shape}: returned, checked")
    outputs = [o for o in named_outputs(kwargs.get("out"), kwargs.get("residual_out")).values()]
    for name, saved in before.items():  # only the outputs' memory is written
        if not any(is_array(o) and shares_memory(o, arrays[name]) for o in outputs):
            assert unchanged(saved, arrays[name]), f"{name} was modified"
    check_fused_result(fz, kwargs, result, h_want)


def test_the_fuzzer_generates_every_input_class() -> None:
    """The strategy of the test above, at the same size, draws every input class of
    :data:`INPUT_CLASSES` (drawn and built only: no call is made, so this costs little)."""
    seen: dict[str, int] = dict.fromkeys(INPUT_CLASSES, 0)

    @FUZZ
    @given(f=forward_calls())
    def draw(f: Forward) -> None:
        for input_class in input_classes(f, f.build()):
            seen[input_class] += 1

    draw()
    assert all(seen.values()), f"input classes never drawn in {EXAMPLES} calls: {seen}"


def test_the_fuzzer_generates_every_fused_form() -> None:
    """The strategy of test_fused_calls, at the same size, draws every form of
    :data:`FUSED_FORMS` (drawn, built and judged by the model only: no call is made)."""
    seen: dict[str, int] = dict.fromkeys(FUSED_FORMS, 0)

    @FUZZ
    @given(fz=fused_calls())
    def draw(fz: Fused) -> None:
        kwargs = fz.build()
        for form in fused_forms(fz, kwargs, fz.problems(kwargs)):
            seen[form] += 1

    draw()
    assert all(seen.values()), f"fused forms never drawn in {EXAMPLES} calls: {seen}"


@FUZZ
@given(b=backward_calls())
def test_backward_calls_give_the_reference_or_a_normlab_error(b: Backward) -> None:
    kwargs = b.build()
    expected = b.problems(kwargs)
    note(f"expected errors: {sorted(e.__name__ for e in expected)}")
    function = (
        normlab.layer_norm_backward
        if b.op == "layer_norm_backward"
        else (normlab.rms_norm_backward)
    )
    try:
        result = function(**kwargs)
    except normlab.NormlabError as exc:
        event(f"{b.op}: raised {type(exc).__name__}")
        assert expected, f"a valid call raised {type(exc).__name__}: {exc}"
        assert isinstance(exc, tuple(expected)), (
            f"raised {type(exc).__name__} ({exc}); the model expects one of "
            f"{sorted(e.__name__ for e in expected)}"
        )
        return
    assert not expected, f"accepted a call the model rejects ({sorted(map(str, expected))})"
    event(f"{b.op}: returned, checked against the reference")
    check_backward_result(b, kwargs, result)


# --------------------------------------------------------------------------------------------
# The model itself: it must reject what the contract rejects (else the fuzz tests prove little)


@pytest.mark.parametrize(
    ("normalized_shape", "axis", "error"),
    [
        ((4,), None, None),
        ((3, 4), (-2, -1), None),
        ((5,), None, normlab.ShapeError),
        ((), None, normlab.ShapeError),
        (4.0, None, normlab.ArgumentError),
        (None, (1, 1), normlab.ShapeError),
        (None, 3, normlab.ShapeError),
        ((4,), (0,), normlab.ShapeError),
        (None, True, normlab.ArgumentError),
    ],
)
def test_the_model_of_axes(normalized_shape: Any, axis: Any, error: Any) -> None:
    _, problems = axes_problems((2, 3, 4), normalized_shape, axis)
    assert problems == ({error} if error else set())


def _aliasing_case(case: str) -> set[type[Exception]]:
    """The model's verdict on one aliasing form of a fused call on (3, 4) float32 arrays."""
    rng = np.random.default_rng(0)
    memory = rng.standard_normal((4, 4)).astype(np.float32)
    x, residual = rng.standard_normal((2, 3, 4)).astype(np.float32)
    weight = np.ones(4, np.float32)
    fresh = np.empty_like(x)
    out, h = {
        "serving": (x, residual),
        "mirror": (residual, x),
        "views_of_the_same_elements": (x[...], residual[...]),
        "out_and_h_the_same": (fresh, fresh),
        "out_x_and_h_x": (x, x),
        "h_overlaps_weight": (None, memory[:3]),
        "out_overlaps_residual": (memory[1:], None),
        "out_reversed_x": (x[::-1], None),
    }[case]
    if case == "h_overlaps_weight":
        weight = memory[0]
    if case == "out_overlaps_residual":
        residual = memory[:-1]
    inputs = {"x": x, "residual": residual, "weight": weight, "bias": None}
    return aliasing_problems(x, inputs, {"y": out, "h": h})


@pytest.mark.parametrize(
    ("case", "refused"),
    [
        ("serving", False),
        ("mirror", False),
        ("views_of_the_same_elements", False),
        ("out_and_h_the_same", True),
        ("out_x_and_h_x", True),
        ("h_overlaps_weight", True),
        ("out_overlaps_residual", True),
        ("out_reversed_x", True),  # x's elements, not the same ones
    ],
)
def test_the_model_of_fused_aliasing(case: str, refused: bool) -> None:
    assert _aliasing_case(case) == ({normlab.ArgumentError} if refused else set())


def _seed(seed: int) -> Forward:
    return dataclasses.replace(VALID_FUSED.call, seed=seed)


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({}, None),
        ({"out": "x", "residual_out": "residual"}, None),
        ({"residual": "x", "out": "x"}, None),
        ({"residual": "requires_grad"}, None),
        ({"return_residual": False}, None),
        ({"residual": "wrong_dtype"}, normlab.DtypeError),  # bfloat16 (the seed's draw)
        ({"residual": "wrong_dtype", "call": _seed(4)}, normlab.DtypeError),  # float32
        ({"residual": "wrong_shape"}, normlab.ShapeError),
        ({"residual": "other_family"}, normlab.DeviceError),
        ({"residual": "list"}, normlab.ArgumentError),
        ({"return_residual": 1}, normlab.ArgumentError),
        ({"return_residual": False, "residual_out": "c"}, normlab.ArgumentError),
        ({"residual_out": "tuple"}, normlab.ArgumentError),
        ({"residual": "requires_grad", "residual_out": "c"}, normlab.ArgumentError),
        ({"residual": "requires_grad", "out": "x_view"}, normlab.ArgumentError),
        ({"residual": "x", "out": "x", "residual_out": "residual"}, normlab.ArgumentError),
        ({"residual_out": "out"}, normlab.ArgumentError),
        ({"residual_out": "aliases_weight"}, normlab.ArgumentError),
        ({"overlap": "out~residual"}, normlab.ArgumentError),
        ({"overlap": "residual~x"}, None),  # inputs may overlap
    ],
)
def test_the_model_of_fused_calls(change: dict[str, Any], error: Any) -> None:
    """The model rejects what docs/fused.md rejects, and only that."""
    fz = dataclasses.replace(VALID_FUSED, **change)
    if "call" in change:  # float32, a weight's dtype for float16 x, is not a residual's
        assert fz.build()["residual"].dtype == torch.float32
    assert fz.problems(fz.build()) == ({error} if error else set())
