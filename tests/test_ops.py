"""The op table (:mod:`normlab.ops`) agrees with the public functions it describes."""

from __future__ import annotations

import inspect

import pytest

import normlab
from normlab.ops import BACKWARD_OPS, FORWARD_OPS, FUSED_OPS, OPS


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
