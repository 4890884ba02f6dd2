"""Every number normlab takes as a float is refused with an ArgumentError naming it when it is
beyond a float's range, NaN or not a number — never a raw OverflowError or ValueError — and a
good one is taken: eps, weight_offset, quantize_scale, the torch modules' constructors, the
numbers of a cost table and of the calibration file."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path
from typing import Any, Final

import numpy as np
import pytest

import normlab
from normlab import costs
from normlab.hookspecs import cost_table
from normlab.scalars import finite_float, shown

#: Numbers a float cannot hold or that are not numbers, each with the error it must raise.
BAD: Final = {
    "huge-int": (10**400, normlab.ArgumentError),
    "huge-fraction": (Fraction(10**400, 3), normlab.ArgumentError),
    "nan": (float("nan"), normlab.ArgumentError),
    "inf": (float("-inf"), normlab.ArgumentError),
    "string": ("1", normlab.ArgumentTypeError),
    "bool": (True, normlab.ArgumentTypeError),
}
X: Final = np.linspace(-1.0, 1.0, 24, dtype=np.float32).reshape(3, 8)
W: Final = np.ones(8, np.float32)


def _calls(value: Any) -> dict[str, Any]:
    """Each public argument taken as a float, given ``value``."""
    return {
        "eps": lambda: normlab.layer_norm(X, eps=value),
        "rms eps": lambda: normlab.add_rms_norm(X, X, eps=value),
        "weight_offset": lambda: normlab.rms_norm(X, weight=W, weight_offset=value),
        "quantize_scale": lambda: normlab.layer_norm(X, quantize="int8", quantize_scale=value),
    }


@pytest.mark.parametrize("argument", list(_calls(0)))
@pytest.mark.parametrize("bad", BAD)
def test_public_arguments(argument: str, bad: str) -> None:
    value, error = BAD[bad]
    name = argument.removeprefix("rms ")
    with pytest.raises(error, match=f"^{name} must be"):
        _calls(value)[argument]()


@pytest.mark.parametrize("argument", list(_calls(0)))
def test_numbers_of_other_types_are_taken(argument: str) -> None:
    """A Fraction and a NumPy scalar are real numbers like a float."""
    for value in (Fraction(1, 4), np.float32(0.25)):
        np.testing.assert_array_equal(
            np.asarray(_calls(value)[argument]()[0]), np.asarray(_calls(0.25)[argument]()[0])
        )


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("module", ["LayerNorm", "RMSNorm", "AddLayerNorm", "AddRMSNorm"])
@pytest.mark.parametrize("argument", ["eps", "weight_offset"])
def test_the_torch_modules_constructors(argument: str, module: str, bad: str) -> None:
    pytest.importorskip("torch")
    import normlab.torch as nt

    value, error = BAD[bad]
    with pytest.raises(error, match=f"^{argument} must be"):
        getattr(nt, module)(8, **{argument: value})


@pytest.mark.parametrize("bad", [b for b in BAD if b != "huge-fraction"])  # not JSON
@pytest.mark.parametrize("field", ["fixed_us", "bytes_per_us", "measured"])
def test_cost_tables(field: str, bad: str) -> None:
    value, error = BAD[bad]
    model: dict[str, Any] = {"fixed_us": 1.0, "bytes_per_us": {"float32": 2.0}}
    if field == "fixed_us":
        model["fixed_us"] = value
    elif field == "bytes_per_us":
        model["bytes_per_us"] = {"float32": value}
    else:
        model["measured"] = {"float32": [[1024, 3.0], [4096, value]]}
    with pytest.raises(error):
        cost_table({"backends": {"b": {"layer_norm": model}}})


@pytest.mark.parametrize("bad", ["huge-int", "nan", "string"])
def test_the_calibration_files_number_is_warned_about_and_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.setenv("NORMLAB_CACHE_DIR", str(tmp_path))
    path = costs.calibration_path()
    assert path is not None
    path.parent.mkdir(parents=True, exist_ok=True)
    value = BAD[bad][0]
    path.write_text(json.dumps({"backends": {}, "through_graph_us": value}))
    costs.reload()
    try:
        with pytest.warns(normlab.NormlabWarning, match="through_graph_us must be"):
            assert costs.through_graph_us() == costs.THROUGH_GRAPH_US
    finally:
        costs.reload()


def test_long_values_are_shortened_in_messages() -> None:
    with pytest.raises(normlab.ArgumentError) as info:
        finite_float("eps", 10**400, "finite")
    assert len(str(info.value)) < 120 and "(401 characters)" in str(info.value)
    assert shown(1.5) == "1.5"
