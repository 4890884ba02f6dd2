"""The suite's areas, in the order a plugin author should read failures: the basics first (a
backend computing ``std + eps`` sees the eps test named first), the backward last."""

from __future__ import annotations

from typing import Final

__all__ = ["AREAS", "area_of", "rank_of"]

#: The areas, in report order.
AREAS: Final = (
    "basics",  # worked example, eps, affine parameters, statistics' dtype and shape
    "numerics",  # random calls against the reference, named numerical cases, magnitudes
    "rows",  # NaN/Inf confinement, batch independence, row counts and widths at block edges
    "batch invariance",  # a row's bits alone and in batches, strided, out=, fused, backward
    "layouts",  # strides, x never modified, empty inputs
    "out/in place",  # out=, out= with statistics, out=x
    "errors",  # every bad input raises its NormlabError subclass
    "fused",  # add_layer_norm, add_rms_norm: h bitwise, y of the rounded h, outputs, aliasing
    "parameters",  # weight_offset, weights and biases of any float dtype, on every op
    "quantize",  # quantized outputs (int8, float8 e4m3fn): the float32 y quantized, bitwise
    "backward",  # the backward ops
)

#: Tests whose area is not their module's.
_BY_TEST: Final = {
    "test_worked_example": "basics",
    "test_rms_norm_worked_example": "basics",
    "test_eps_inside_the_root": "basics",
    "test_rms_norm_default_eps": "basics",
    "test_affine_combinations": "basics",
    "test_result_kinds": "basics",
    "test_out": "out/in place",
    "test_out_with_stats": "out/in place",
    "test_in_place": "out/in place",
    "test_in_place_row_views": "out/in place",
}

#: The basics in the order their failures are listed: the test naming a flaw most precisely
#: first (eps inside the root, then the worked example), the rest after them in run order.
_FIRST: Final = (
    "test_eps_inside_the_root",
    "test_worked_example",
    "test_rms_norm_worked_example",
    "test_rms_norm_default_eps",
    "test_affine_combinations",
)

_BY_MODULE: Final = {
    "test_numerics": "numerics",
    "test_results": "basics",
    "test_rows": "rows",
    "test_batch_invariance": "batch invariance",
    "test_boundaries": "rows",
    "test_layouts": "layouts",
    "test_errors": "errors",
    "test_fused": "fused",
    "test_parameters": "parameters",
    "test_quantize": "quantize",
    "test_backward": "backward",
}


def area_of(nodeid: str) -> str | None:
    """The area of the suite test ``nodeid`` (``.../test_layouts.py::test_out[...]``), or
    ``None`` for a test outside the suite."""
    path, _, test = nodeid.partition("::")
    module = path.rsplit("/", 1)[-1].removesuffix(".py")
    if module not in _BY_MODULE:
        return None
    return _BY_TEST.get(test.split("[")[0], _BY_MODULE[module])


def rank_of(nodeid: str) -> tuple[int, int]:
    """The sort key of ``nodeid`` in a report: its area's place in :data:`AREAS`, then the
    test's place in :data:`_FIRST` (others after those, in run order)."""
    area = area_of(nodeid)
    test = nodeid.partition("::")[2].split("[")[0]
    first = _FIRST.index(test) if test in _FIRST else len(_FIRST)
    return (AREAS.index(area) if area is not None else len(AREAS), first)
