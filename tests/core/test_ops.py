"""The op table (:mod:`normlab.ops`) agrees with the public functions it describes."""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import numpy as np
import pytest

import normlab
from normlab import registry
from normlab.backends import numpy_backend
from normlab.ops import (
    BACKWARD_OPS,
    FORWARD_OPS,
    FUSED_OPS,
    NORMS,
    OPS,
    PROLOGUES,
    Arithmetic,
    Op,
    names,
)


@pytest.mark.parametrize("name", list(OPS))
def test_every_array_of_the_table_is_a_parameter_of_the_public_function(name: str) -> None:
    op = OPS[name]
    parameters = inspect.signature(getattr(normlab, name)).parameters
    assert set(op.arrays) <= set(parameters), f"{name} lacks {set(op.arrays) - set(parameters)}"
    assert ("eps" in parameters) == op.takes_eps
    assert ("needs" in parameters) == bool(op.gradients)
    assert "x" in op.like_x


@pytest.mark.parametrize("name", list(OPS))
def test_in_place_pairs_name_an_output_and_an_x_like_input(name: str) -> None:
    op = OPS[name]
    for output, given in op.in_place:
        assert output in op.outputs and given in op.like_x


def test_forward_backward_and_fused_ops_partition_the_table() -> None:
    assert set(FORWARD_OPS) | set(BACKWARD_OPS) | set(FUSED_OPS) == set(OPS)
    assert len(FORWARD_OPS) + len(BACKWARD_OPS) + len(FUSED_OPS) == len(OPS)
    assert all(f"{name}_backward" in BACKWARD_OPS for name in FORWARD_OPS)


@pytest.mark.parametrize("name", FUSED_OPS)
def test_a_fused_op_extends_its_base_op(name: str) -> None:
    """Same per-feature inputs and statistics as the base op; x and residual in, y and h out."""
    op, base = OPS[name], OPS[OPS[name].base or ""]
    assert op.per_feature == base.per_feature and op.stats_outputs == base.stats_outputs
    assert op.like_x == ("x", "residual") and op.outputs == ("y", "h")
    assert op.default_eps == base.default_eps
    parameters = inspect.signature(getattr(normlab, name)).parameters
    base_parameters = inspect.signature(getattr(normlab, op.base or "")).parameters
    assert set(base_parameters) <= set(parameters)
    assert {"residual", "return_residual", "residual_out"} <= set(parameters)


# --------------------------------------------------------------------------------------------
# A new op is its table entry, its arithmetic in a backend, and its tests: nothing else


#: A test-only op: each row of x times a per-feature weight (``y = x * weight``).
SCALED_COPY = Op(
    "scaled_copy",
    arguments=("x", "weight", "axis", "out"),
    like_x=("x",),
    per_feature=("weight",),
    outputs=("y",),
    kernel_arrays=("x", "weight"),
    kernel_returns=("y",),
    arithmetic=Arithmetic("scale"),
    in_place=frozenset({("y", "x")}),
    takes_eps=False,
)


class Scaler:
    """A test plugin's backend of ``scaled_copy`` on NumPy arrays: its arithmetic alone."""

    calls: ClassVar[list[tuple[tuple[int, ...], bool]]] = []

    @staticmethod
    def scaled_copy(x: np.ndarray, weight: np.ndarray, *, plan: Any, out: Any) -> tuple[Any]:
        Scaler.calls.append((x.shape, out is not None))
        return (np.multiply(x, weight, out=out),)

    @staticmethod
    def to_numpy(a: np.ndarray) -> np.ndarray:
        return a

    @staticmethod
    def from_numpy(a: np.ndarray, like: Any = None) -> np.ndarray:
        return a


def test_a_new_op_is_its_table_entry_its_arithmetic_and_its_tests(
    monkeypatch: pytest.MonkeyPatch, register: Any
) -> None:
    """Added through the table from a test plugin, with no other change to normlab: the op is
    validated, chosen, routed (the normalized axis moved last, rows made and restored, out=
    written by the backend, in place allowed, an overlap refused) and explained."""
    from tests.support.plugins_for_tests import record

    monkeypatch.setitem(OPS, "scaled_copy", SCALED_COPY)
    register(
        record(
            "scaler",
            module=f"{__name__}:Scaler",
            families=frozenset({"numpy"}),
            ops=frozenset({"scaled_copy"}),
            capabilities=frozenset({"out", "inplace"}),
        )
    )
    Scaler.calls.clear()
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 4)).astype(np.float32)
    weight = rng.standard_normal(5).astype(np.float32)
    want = x * weight[:, None]
    np.testing.assert_array_equal(normlab.api.run("scaled_copy", x, weight, axis=1), want)
    assert Scaler.calls[-1] == ((8, 5), False)  # rows of the normalized axis, batch axes first
    rows = rng.standard_normal((6, 5)).astype(np.float32)
    out = np.empty_like(rows)
    assert normlab.api.run("scaled_copy", rows, weight, out=out) is out
    np.testing.assert_array_equal(out, rows * weight)
    assert Scaler.calls[-1] == ((6, 5), True)  # written by the backend itself
    assert normlab.api.run("scaled_copy", rows, weight, out=rows) is rows  # in place
    np.testing.assert_array_equal(rows, out)  # rows * weight, written over rows
    with pytest.raises(normlab.ArgumentError, match="shares memory with x"):
        normlab.api.run("scaled_copy", rows[:3], weight, out=rows[1:4])
    with pytest.raises(normlab.ShapeError, match="weight has shape"):
        normlab.api.run("scaled_copy", rows, weight[:3])
    text = normlab.explain(x, weight, axis=1, op="scaled_copy")
    assert "chosen: scaler" in text and "layout: copy of x" in text


# --------------------------------------------------------------------------------------------
# What an op computes is data on its row, which backends read


@pytest.mark.parametrize("name", list(OPS))
def test_every_op_states_its_arithmetic(name: str) -> None:
    """The norm and direction of each op, and of its relatives: a fused op adds a residual
    first and normalizes as its base op; a backward op is of its forward op's norm."""
    arithmetic = OPS[name].arithmetic
    assert arithmetic.norm in NORMS and arithmetic.direction in ("forward", "backward")
    assert set(arithmetic.prologue) <= set(PROLOGUES) and arithmetic.epilogues == ()
    assert arithmetic.centred == ("bias" in OPS[name].per_feature or "mean" in OPS[name].stats)
    base = OPS[name].base
    assert arithmetic.residual_add == (base is not None)
    if base is not None:
        assert OPS[base].arithmetic.norm == arithmetic.norm
    gradient_op = OPS[name].gradient_op
    if gradient_op is not None:
        assert OPS[gradient_op].arithmetic.norm == arithmetic.norm
        assert OPS[gradient_op].arithmetic.direction == "backward"


@pytest.mark.parametrize("name", names(direction="forward"))
def test_the_gradient_map_names_every_input_and_a_gradient_of_the_backward_op(name: str) -> None:
    op = OPS[name]
    mapped = dict(op.gradient_map)
    assert set(mapped) == set(op.like_x) | set(op.per_feature)
    assert set(mapped.values()) <= set(OPS[op.gradient_op or ""].gradients)


def test_the_lists_of_ops_are_selections_of_the_table() -> None:
    assert names() == tuple(OPS)
    assert names(norm="rms", direction="forward") == ("rms_norm", "add_rms_norm")
    assert names(fused=True) == FUSED_OPS
    assert set(names(norm="layer")) | set(names(norm="rms")) == set(OPS)


@pytest.mark.parametrize("name", list(OPS))
def test_kernel_form_1_gives_rms_ops_layer_norms_slots(name: str) -> None:
    """Form 2 is each op's own; form 1 (plugins written before it) adds a bias slot to a
    forward RMSNorm op's arrays and a mean before its rstd, nothing to the others."""
    op = OPS[name]
    assert op.kernel_arrays_of(2) == op.kernel_arrays
    assert op.kernel_returns_of(2) == op.kernel_returns
    legacy = op.arithmetic.norm == "rms" and op.arithmetic.direction == "forward"
    assert ("bias" in op.kernel_arrays_of(1)) == (legacy or "bias" in op.kernel_arrays)
    centred = OPS[name.replace("rms_norm", "layer_norm")]
    if legacy:
        assert op.kernel_arrays_of(1) == centred.kernel_arrays
        assert op.kernel_returns_of(1) == centred.kernel_returns
    else:
        assert op.kernel_arrays_of(1) == op.kernel_arrays


class LegacyRms:
    """A plugin module written before kernel form 2: RMSNorm with LayerNorm's slots (a bias
    always None, a mean None), the numpy backend's arithmetic."""

    @staticmethod
    def rms_norm(x: np.ndarray, weight: Any, bias: None, *, plan: Any, out: Any) -> Any:
        assert bias is None
        y, rstd = numpy_backend.rms_norm(x, weight, plan=plan, out=out)
        return y, None, rstd

    @staticmethod
    def add_rms_norm(
        x: np.ndarray, residual: Any, weight: Any, bias: None, *, plan: Any, out: Any,
        residual_out: Any,
    ) -> Any:  # fmt: skip
        assert bias is None
        y, h, rstd = numpy_backend.add_rms_norm(
            x, residual, weight, plan=plan, out=out, residual_out=residual_out
        )
        return y, h, None, rstd

    to_numpy = staticmethod(np.asarray)
    from_numpy = staticmethod(lambda a, like=None: np.array(a))


def test_a_plugin_of_kernel_form_1_is_called_in_its_form(register: Any) -> None:
    """Today's plugins keep working: the core calls a form-1 record's RMSNorm functions with a
    bias slot and takes their mean slot, on every route (direct, statistics, out=)."""
    from tests.support.plugins_for_tests import record

    register(
        record(
            "legacy_rms",
            module=f"{__name__}:LegacyRms",
            families=frozenset({"numpy"}),
            ops=frozenset({"rms_norm", "add_rms_norm"}),
            capabilities=frozenset({"out", "strided"}),
        )
    )
    assert registry.get("legacy_rms").record.kernel_form == 1
    rng = np.random.default_rng(4)
    x, r = (rng.standard_normal((5, 8)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(8).astype(np.float32)
    for kwargs in ({}, {"return_stats": True}, {"out": np.empty_like(x)}):
        got = normlab.rms_norm(x, weight=w, backend="legacy_rms", **kwargs)
        want = normlab.rms_norm(x, weight=w, backend="numpy", **kwargs)
        for a, b in zip(
            got if isinstance(got, tuple) else (got,),
            want if isinstance(want, tuple) else (want,),
            strict=True,
        ):
            np.testing.assert_array_equal(a, b)
    y, h, rstd = normlab.add_rms_norm(x, r, weight=w, return_stats=True, backend="legacy_rms")
    want_y, want_h, want_rstd = normlab.add_rms_norm(
        x, r, weight=w, return_stats=True, backend="numpy"
    )
    for a, b in ((y, want_y), (h, want_h), (rstd, want_rstd)):
        np.testing.assert_array_equal(a, b)


def test_a_record_of_an_unknown_kernel_form_is_refused(register: Any) -> None:
    from tests.support.plugins_for_tests import record

    with pytest.raises(normlab.BackendError, match="kernel_form must be one of"):
        register(record("future", kernel_form=3))
