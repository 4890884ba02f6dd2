"""``normlab calibrate``: a fitted cost table in the cache directory, read by the dispatcher."""

from __future__ import annotations

import json
import types
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import normlab
from normlab import calibrate, cli, costs, registry
from normlab.hookspecs import cost_table
from tests.support import plugins_for_tests
from tests.support.plugins_for_tests import FakeArray, record


def _fakelib_without_float64(a: np.ndarray, like: Any = None) -> FakeArray:
    if a.dtype == np.float64:
        raise normlab.DtypeError("fakelib holds no float64")
    return FakeArray(a)


#: A backend module whose family cannot hold float64 although the backend lists it (as JAX
#: without x64 mode).
NO_FLOAT64 = types.SimpleNamespace(
    layer_norm=plugins_for_tests.layer_norm,
    to_numpy=plugins_for_tests.to_numpy,
    from_numpy=_fakelib_without_float64,
)


def test_fit_recovers_a_line() -> None:
    points = [(float(b), 3.0 + b / 2000.0) for b in (1e3, 1e4, 1e5, 1e6)]
    fixed, rate = calibrate.fit(points)
    assert fixed == pytest.approx(3.0, rel=1e-9) and rate == pytest.approx(2000.0, rel=1e-9)


def test_fit_never_gives_a_negative_cost_or_rate() -> None:
    fixed, rate = calibrate.fit([(1e3, 5.0), (1e6, 4.0)])  # noise: larger was faster
    assert fixed >= 0 and rate > 0


def test_calibrate_writes_a_table_the_dispatcher_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NORMLAB_CACHE_DIR", str(tmp_path))
    costs.reload()
    try:
        assert cli.main(["calibrate", "--backends", "numpy", "--dtypes", "float32", "--quick"]) == 0
        path = costs.calibration_path()
        assert path is not None and path.is_file()
        table = cost_table(json.loads(path.read_text()))
        assert set(table) == {"numpy"}
        ops = {"layer_norm", "rms_norm", "layer_norm_backward", "rms_norm_backward"}
        ops |= {"add_layer_norm", "add_rms_norm"}
        assert set(table["numpy"]) == {f"{op}:numpy" for op in ops}
        model = costs.model(registry.get("numpy"), "layer_norm", "numpy")
        assert model == table["numpy"]["layer_norm:numpy"]
        assert model.bytes_per_us["float32"] > 0 and model.fixed_us >= 0
        sizes = [768 * 4 * rows for rows in calibrate.QUICK_SIZES]
        assert [size for size, _ in model.measured["float32"]] == sizes
        assert all(us > 0 for _, us in model.measured["float32"])
    finally:
        costs.reload()


def test_a_dtype_the_family_cannot_hold_is_skipped_and_said(
    tmp_path: Path, register: Callable[..., ModuleType]
) -> None:
    register(record("nof64", module=f"{__name__}:NO_FLOAT64"))
    said: list[str] = []
    path, measurements = calibrate.calibrate(
        ["nof64"],
        ["float32", "float64"],
        quick=True,
        path=tmp_path / "c.json",
        progress=said.append,
    )
    assert {m.dtype for m in measurements} == {"float32"}
    assert "nof64 on fakelib float64: skipped, fakelib holds no float64" in said
    model = cost_table(json.loads(path.read_text()))["nof64"]["layer_norm:fakelib"]
    assert set(model.bytes_per_us) == set(model.measured) == {"float32"}


#: Which backend's layer_norm ran, in order (filled by the two logging backends below).
CALLS: list[str] = []


def _logging_module(name: str) -> types.SimpleNamespace:
    def layer_norm(x: Any, weight: Any, bias: Any, *, plan: Any, out: Any) -> Any:
        CALLS.append(name)
        return plugins_for_tests.layer_norm(x, weight, bias, plan=plan, out=out)

    return types.SimpleNamespace(
        layer_norm=layer_norm,
        to_numpy=plugins_for_tests.to_numpy,
        from_numpy=lambda a, like=None: FakeArray(a),
    )


LOG_A, LOG_B = _logging_module("loga"), _logging_module("logb")


def test_the_backends_of_one_point_are_timed_in_turn(
    tmp_path: Path, register: Callable[..., ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two backends serving one family: each batch of one is followed by a batch of the other
    (a busy moment weighs on both), on the same x."""
    monkeypatch.setattr(calibrate, "_BATCHES", 3)
    monkeypatch.setattr(calibrate, "_BATCH_S", 0.0)  # one call per batch
    register(record("loga", module=f"{__name__}:LOG_A"))
    register(record("logb", module=f"{__name__}:LOG_B"))
    CALLS.clear()
    _, measurements = calibrate.calibrate(
        ["loga", "logb"], ["float32"], quick=True, path=tmp_path / "c.json"
    )
    per_size = 2 * 2 + 3 * 2  # each warmed twice, then three batches of one call each, in turn
    assert len(CALLS) == per_size * len(calibrate.QUICK_SIZES)
    first = CALLS[:per_size]
    assert first[:4] == ["loga", "loga", "logb", "logb"]
    assert first[4:] == ["loga", "logb"] * 3
    assert {(m.backend, m.x_bytes) for m in measurements} == {
        (name, 768 * 4 * rows) for name in ("loga", "logb") for rows in calibrate.QUICK_SIZES
    }


def test_calibrate_measures_what_the_custom_ops_cost_a_training_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a backend that records no graph (numba) and one that does (torch), the table holds
    the training call's extra cost through the custom ops: (numba's step − its forward) −
    (torch's step − its forward), never below 0; the dispatcher reads it."""
    pytest.importorskip("torch")
    if not registry.get("numba").available:
        pytest.skip("numba is not installed")
    monkeypatch.setenv("NORMLAB_CACHE_DIR", str(tmp_path))
    timed: list[list[float]] = [[300.0, 100.0, 20.0, 10.0], [30.0, 100.0, 20.0, 10.0]]
    real = calibrate._medians_us

    def medians(calls: Any) -> list[float]:
        real(calls)  # the calls run: a step through the custom ops must work
        return timed.pop(0)

    monkeypatch.setattr(calibrate, "_measure", lambda *args: iter(()))
    monkeypatch.setattr(calibrate, "_medians_us", medians)
    try:
        for expected in (190.0, 0.0):
            path, _ = calibrate.calibrate(["numba", "torch"], ["float32"], quick=True)
            assert json.loads(path.read_text())["through_graph_us"] == expected
            assert costs.through_graph_us() == expected
        path, _ = calibrate.calibrate(["numpy", "torch"], ["float32"], quick=True)
        assert "through_graph_us" not in json.loads(path.read_text())  # no backend without a graph
        assert costs.through_graph_us() == costs.THROUGH_GRAPH_US
    finally:
        costs.reload()
