"""The op table (:mod:`normlab.ops`) agrees with the public functions it describes."""

from __future__ import annotations

import inspect

import pytest

import normlab
from normlab.ops import BACKWARD_OPS, FORWARD_OPS, OPS


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


def test_forward_and_backward_ops_partition_the_table() -> None:
    assert set(FORWARD_OPS) | set(BACKWARD_OPS) == set(OPS)
    assert not set(FORWARD_OPS) & set(BACKWARD_OPS)
    assert all(f"{name}_backward" in BACKWARD_OPS for name in FORWARD_OPS)
