"""``normlab calibrate``: a fitted cost table in the cache directory, read by the dispatcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from normlab import calibrate, cli, costs, registry
from normlab.hookspecs import cost_table


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
    finally:
        costs.reload()
