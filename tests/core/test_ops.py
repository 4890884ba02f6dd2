"""The op table (:mod:`normlab.ops`) agrees with the public functions it describes."""

from __future__ import annotations

import inspect
from typing import Any, ClassVar

import numpy as np
import pytest

import normlab
from normlab.ops import BACKWARD_OPS, FORWARD_OPS, FUSED_OPS, OPS, Op


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
