"""The option pipeline (normlab/pipeline.py): a call and explain() take the same step, each
option's composition and native service is named by explain(), and a repeat call iterates no
options."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import normlab
from normlab import pipeline, spec
from normlab.option import Option

_COLS = itertools.count(40)  # a row length per case: a kind of call whose step nothing cached


def _numba() -> None:
    pytest.importorskip("numba", reason="the numba backend serves the options natively")


def _case(op: str, cols: int, **options: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The arguments of a call of ``op`` on 3 x ``cols`` rows, with ``options``: ``stream``
    gives a float32 residual beside float16 x, ``weight`` a weight of that dtype."""
    rng = np.random.default_rng(cols)
    dtype = np.float16 if options.pop("half", False) or options.get("stream") else np.float32
    x = rng.standard_normal((3, cols)).astype(dtype)
    args: tuple[Any, ...] = (x,)
    if op.startswith("add_"):
        residual_dtype = np.float32 if options.pop("stream", False) else dtype
        args = (x, rng.standard_normal((3, cols)).astype(residual_dtype))
    weight = options.pop("weight", None)
    if weight is not None:
        options["weight"] = (1 + rng.standard_normal(cols) / 4).astype(weight)
    return args, options


#: (case id, op, options of the call, backend named, the line explain() gives its step)
STEPS = [
    ("quantize-native", "layer_norm", {"quantize": "int8"}, "numba",
     "quantized outputs: int8, dynamic per-row scale; numba writes q and scale"),
    ("quantize-composed", "layer_norm", {"quantize": "int8"}, "numpy",
     "quantized outputs: int8, dynamic per-row scale; the core runs layer_norm for y"),
    ("quantize-around-casting", "rms_norm",
     {"quantize": "fp8_e4m3", "half": True, "weight": np.float32, "casting": "llama"}, "numba",
     "quantized outputs: fp8_e4m3, dynamic per-row scale; the core runs rms_norm for y"),
    ("casting-composed", "rms_norm", {"half": True, "weight": np.float32, "casting": "llama"},
     "numba", "casting: llama: the core runs rms_norm without the weight"),
    ("stream-native", "add_rms_norm", {"stream": True}, "numba",
     "residual stream: residual is float32 beside float16 x; numba takes it as given"),
    ("stream-composed", "add_rms_norm", {"stream": True}, "numpy",
     "residual stream: residual is float32 beside float16 x; the core adds float32(x)"),
    ("stream-around-parameters", "add_layer_norm",
     {"stream": True, "weight": np.float64}, "numpy",
     "residual stream: residual is float32 beside float16 x; the core adds float32(x)"),
    ("parameters-native", "rms_norm", {"weight": np.float32, "weight_offset": 1.0}, "numba",
     "parameters: numba takes them as given and forms weight_offset + weight"),
    ("parameters-composed", "rms_norm", {"weight": np.float32, "weight_offset": 1.0}, "numpy",
     "parameters: the core forms weight_offset + weight (1.0 + float32) in float32"),
    ("parameters-dtype-composed", "layer_norm", {"weight": np.float64}, "numpy",
     "parameters: the core forms weight (float64) in float32"),
]  # fmt: skip


def _spied(taken: list[tuple[str, str]]) -> tuple[Option, ...]:
    """The pipeline's options, each recording in ``taken`` the step a call takes with it."""

    def spy(option: Option, kind: str, f: Callable[..., Any] | None) -> Any:
        if f is None:
            return None

        def recorded(*args: Any) -> Any:
            taken.append((option.title, kind))
            return f(*args)

        return recorded

    return tuple(
        dataclasses.replace(
            o,
            compose=spy(o, "composed", o.compose),
            formed=spy(o, "composed", o.formed),
            serve=spy(o, "native", o.serve),
        )
        for o in pipeline.PIPELINE
    )


@pytest.mark.parametrize(("op", "options", "backend", "line"),
                         [pytest.param(*case[1:], id=case[0]) for case in STEPS])  # fmt: skip
def test_explain_names_the_step_the_call_takes(
    monkeypatch: pytest.MonkeyPatch, op: str, options: dict[str, Any], backend: str, line: str
) -> None:
    """For each option, served natively and composed: explain() names the step, and the call
    takes that step first (the option's own service or composition)."""
    if backend == "numba":
        _numba()
    taken: list[tuple[str, str]] = []
    monkeypatch.setattr(pipeline, "PIPELINE", _spied(taken))
    args, kwargs = _case(op, next(_COLS), **options)
    text = normlab.explain(*args, op=op, backend=backend, **kwargs)
    assert line in text, text
    title, how = line.split(":")[0], "composed" if "the core" in line else "native"
    getattr(normlab, op)(*args, backend=backend, **kwargs)
    if how == "composed":
        assert taken[:1] == [(title, "composed")], taken
        assert f"  {title}:" in text.splitlines()[3], "the composed option is the first step"
    else:  # served: through the option's own route where it has one, else the op's
        served = next(o for o in pipeline.PIPELINE if o.title == title).serve is not None
        assert taken == ([(title, "native")] if served else []), taken


def test_a_call_served_natively_names_every_option() -> None:
    """A call with several options the backend takes as given: one line for each, in order."""
    _numba()
    args, kwargs = _case(
        "add_rms_norm", next(_COLS), stream=True, weight=np.float64, weight_offset=1.0,
        quantize="int8", return_residual=True,
    )  # fmt: skip
    text = normlab.explain(*args, op="add_rms_norm", backend="numba", **kwargs)
    titles = [line.split(":")[0].strip() for line in text.splitlines()[3:6]]
    assert titles == ["quantized outputs", "residual stream", "parameters"], text
    assert "numba writes q and scale" in text


def test_a_fused_op_no_backend_provides_is_composed_with_its_options() -> None:
    """On a backend without the fused op, no option is native: the first is composed."""
    xp = pytest.importorskip("array_api_strict")
    cols = next(_COLS)
    x = xp.asarray(np.ones((2, cols), np.float32))
    residual = xp.asarray(np.ones((2, cols), np.float32))
    weight = xp.asarray(np.ones(cols, np.float32))
    text = normlab.explain(x, residual, op="add_rms_norm", weight=weight, weight_offset=1.0)
    assert "parameters: the core forms weight_offset + weight" in text, text
    assert "composed: array_api does not provide add_rms_norm" in text, text


def test_reshaped_calls_are_those_with_an_option() -> None:
    """spec's one test of options (Call.reshaped) agrees with the options' own."""
    cols = next(_COLS)
    for _, op, options, _, _ in [*STEPS, ("plain", "layer_norm", {}, "", "")]:
        args, kwargs = _case(op, cols, **dict(options))
        arguments = spec.arguments(op, *args, **kwargs)
        call = spec.validated(normlab.ops.OPS[op], arguments)
        assert call.reshaped == any(o.applies(call) for o in pipeline.PIPELINE), (op, options)


def test_a_repeat_call_iterates_no_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step is decided once per kind of call and backend: a second call asks no option
    whether it applies or is native."""
    asked: list[str] = []

    def counted(o: Option) -> Option:
        def applies(call: Any) -> bool:
            asked.append(o.title)
            return o.applies(call)

        return dataclasses.replace(o, applies=applies)

    monkeypatch.setattr(pipeline, "PIPELINE", tuple(counted(o) for o in pipeline.PIPELINE))
    args, kwargs = _case("rms_norm", next(_COLS), weight=np.float32, weight_offset=1.0)
    first = normlab.rms_norm(*args, backend="numpy", **kwargs)
    assert asked, "the first call resolves its step"
    asked.clear()
    second = normlab.rms_norm(*args, backend="numpy", **kwargs)
    assert asked == []
    np.testing.assert_array_equal(first, second)


def test_options_declare_one_composition_each() -> None:
    """An option forms the arguments or composes the call, never both or neither."""
    with pytest.raises(ValueError, match="give one of compose and formed"):
        dataclasses.replace(pipeline.PIPELINE[0], formed=lambda call, args: args)
    assert [o.title for o in pipeline.PIPELINE] == [
        "quantized outputs", "casting", "residual stream", "parameters"
    ]  # fmt: skip
