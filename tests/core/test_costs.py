"""Choice by cost: backends that declare cost models are compared by estimate over the row
profile of a call's row length, so one backend serves every row count;
a calibration file overrides the records' models; zero-copy families are eligible by default.

The fake backends serve the made-up library ``fakelib`` (see plugins_for_tests), so no built-in
backend takes part.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

import normlab
from normlab import costs, dispatch, registry, spec
from normlab.hookspecs import CostModel, Plan, cost_table
from normlab.ops import BACKWARD_OPS, FORWARD_OPS
from tests.support.plugins_for_tests import FakeArray, record

Register = Callable[..., ModuleType]
pytestmark = pytest.mark.usefixtures("no_preference")

#: ``quick`` costs little per call and streams slowly; ``wide`` the other way round: quick wins
#: below about 64 KiB of float32 x, wide above.
QUICK = CostModel(fixed_us=2.0, bytes_per_us={"float32": 1000.0})
WIDE = CostModel(fixed_us=20.0, bytes_per_us={"float32": 10000.0})
#: A valid line in JSON form, for tables that differ from it in their measured points.
LINE: dict[str, Any] = {"fixed_us": 1.0, "bytes_per_us": {"float32": 10.0}}


@pytest.fixture(autouse=True)
def own_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty cache directory: no calibration file unless a test writes one."""
    monkeypatch.setenv("NORMLAB_CACHE_DIR", str(tmp_path))
    costs.reload()
    dispatch.clear_caches()
    yield tmp_path / "calibration" / costs.CALIBRATION_FILE
    costs.reload()
    dispatch.clear_caches()


def _fake(rows: int, cols: int = 256) -> FakeArray:
    return FakeArray(np.ones((rows, cols), np.float32))


def _plan(x: Any) -> Plan:
    return spec.plan("layer_norm", x)


def _chosen(x: Any) -> str:
    match = re.search(r"^  chosen: (\w+) ", normlab.explain(x), re.MULTILINE)
    assert match
    return match.group(1)


def _modelled(name: str, model: CostModel, priority: int = 0, **fields: Any) -> Any:
    return record(name, priority=priority, costs={"layer_norm": model}, **fields)


#: ``steady`` is never more than 1.5 times the faster of the two at any size (a rival of
#: ``quick`` at 1 KiB, of ``wide`` at 1 GiB); each of the others is 6 to 10 times slower than
#: ``steady`` somewhere.
STEADY = CostModel(fixed_us=3.0, bytes_per_us={"float32": 7000.0})


def test_one_backend_serves_every_row_count(register: Register) -> None:
    """The choice compares estimates over the row profile of the call's row length (1, 4, 16 …
    rows), never at the call's own size: quick wins small calls and wide large ones, but the
    backend chosen for rows of 256 float32 is the one never far behind at any row count, for
    one row as for 4096."""
    register(_modelled("quick", QUICK, priority=1), _modelled("wide", WIDE, priority=2))
    assert _chosen(_fake(1)) == _chosen(_fake(4096)) == "wide"  # 6.7x behind quick at 1 row
    register(_modelled("steady", STEADY, priority=0))
    assert _chosen(_fake(1)) == _chosen(_fake(4096)) == "steady"
    text = normlab.explain(_fake(1))
    assert "steady (priority 0): chosen, lowest worst-case cost over the row profile" in text
    assert "at most 1.4" in text and "x the fastest for 1..1048576 rows" in text
    assert "quick (priority 1): able to serve, slower somewhere in the row profile" in text
    assert isinstance(normlab.layer_norm(_fake(4096)), FakeArray)


def test_a_plan_s_row_profile_ignores_its_number_of_rows(register: Register) -> None:
    register(_modelled("quick", QUICK))
    quick = registry.get("quick")
    profiles = {costs.profile_us(quick, _plan(_fake(rows))) for rows in (1, 3, 64, 5000)}
    assert len(profiles) == 1 and None not in profiles
    assert costs.profile_us(quick, _plan(_fake(1, cols=512))) not in profiles
    assert costs.grid_rows(256, "float32") == costs.GRID_ROWS  # 1 GiB at 2^20 rows of 1 KiB
    assert costs.grid_rows(2**30, "float64") == (1,)


def test_the_choice_is_cached_per_row_length(register: Register) -> None:
    register(_modelled("quick", QUICK), _modelled("wide", WIDE))
    assert dispatch.choose(_plan(_fake(1))) is dispatch.choose(_plan(_fake(4096)))
    assert dispatch.choose(_plan(_fake(2, cols=8))) is not dispatch.choose(_plan(_fake(2)))


def test_a_top_priority_backend_without_a_model_decides_by_priority(register: Register) -> None:
    register(record("plain", priority=50), _modelled("quick", QUICK), _modelled("wide", WIDE))
    assert _chosen(_fake(1)) == "plain"
    assert _chosen(_fake(4096)) == "plain"
    assert "plain (priority 50): chosen, highest priority able to serve" in normlab.explain(
        _fake(1)
    )


def test_a_model_without_the_dtype_gives_no_estimate(register: Register) -> None:
    half_only = CostModel(fixed_us=0.1, bytes_per_us={"float16": 1e6})
    register(_modelled("halfish", half_only, priority=5), _modelled("wide", WIDE))
    assert _chosen(_fake(1)) == "halfish"  # no float32 estimate: priority decides


def test_a_calibration_file_overrides_the_records(
    register: Register, own_calibration: Path
) -> None:
    register(_modelled("quick", QUICK), _modelled("wide", WIDE))
    assert _chosen(_fake(1)) == "wide"
    own_calibration.parent.mkdir(parents=True)
    slow_wide = {"fixed_us": 1e7, "bytes_per_us": {"float32": 10000.0}}
    own_calibration.write_text(json.dumps({"backends": {"wide": {"layer_norm": slow_wide}}}))
    costs.reload()
    dispatch.clear_caches()
    assert _chosen(_fake(1)) == "quick"


def test_a_malformed_calibration_file_is_ignored_with_a_warning(
    register: Register, own_calibration: Path
) -> None:
    register(_modelled("quick", QUICK), _modelled("wide", WIDE))
    own_calibration.parent.mkdir(parents=True)
    own_calibration.write_text('{"backends": {"quick": {"layer_norm": {"fixed_us": -1}}}}')
    with pytest.warns(
        normlab.NormlabWarning, match="ignoring the calibration .*run 'normlab calibrate'"
    ):
        assert _chosen(_fake(1)) == "wide"


def test_measured_points_are_followed_between_and_beyond() -> None:
    model = CostModel(
        fixed_us=1.0,
        bytes_per_us={"float32": 1000.0},
        measured={"float32": ((1e3, 4.0), (1e5, 40.0), (1e6, 4000.0))},
    )
    assert model.estimate_us(10.0, "float32") == 4.0  # below: the smallest call's time
    assert model.estimate_us(1e4, "float32") == pytest.approx(4.0 * 10**0.5)  # log-log
    assert model.estimate_us(1e5, "float32") == pytest.approx(40.0)
    assert model.estimate_us(1e6, "float32") == pytest.approx(4000.0)
    assert model.estimate_us(4e6, "float32") == pytest.approx(16000.0)  # beyond: by size
    assert model.estimate_us(1e4, "float16") is None
    line_only = CostModel(1.0, {"float32": 1000.0, "float16": 500.0}, model.measured)
    assert line_only.estimate_us(1e4, "float16") == pytest.approx(21.0)  # no points: the line


def test_measured_points_catch_a_rate_that_falls_off(register: Register) -> None:
    """A backend fast up to some size and slow past it (torch's fresh outputs page-faulting):
    its line says it always wins, its points give the large calls to the other."""
    cliff = CostModel(
        fixed_us=2.0,
        bytes_per_us={"float32": 20000.0},
        measured={"float32": ((1024.0, 2.0), (2.0**20, 55.0), (2.0**24, 10000.0))},
    )
    register(_modelled("cliff", cliff, priority=1), _modelled("wide", WIDE, priority=2))
    line = CostModel(cliff.fixed_us, cliff.bytes_per_us)
    plan = _plan(_fake(1))
    profiles = {name: costs.profile_us(registry.get(name), plan) for name in ("cliff", "wide")}
    rows = costs.grid_rows(plan.cols, plan.dtype)
    at = {r: i for i, r in enumerate(rows)}
    assert profiles["cliff"][at[1]] < profiles["wide"][at[1]]  # 1 KiB
    assert profiles["cliff"][at[1024]] < profiles["wide"][at[1024]]  # 1 MiB
    assert profiles["cliff"][at[16384]] > profiles["wide"][at[16384]]  # 16 MiB: the line's
    assert line.estimate_us(2.0**24, "float32") < WIDE.estimate_us(2.0**24, "float32")
    # over the profile: cliff is 6x behind wide at 1 GiB, wide 10x behind cliff at one row
    assert _chosen(_fake(1)) == _chosen(_fake(16384)) == "cliff"


def test_calibration_points_round_trip() -> None:
    data = {
        "backends": {
            "b": {
                "layer_norm": {
                    "fixed_us": 1.0,
                    "bytes_per_us": {"float32": 10.0},
                    "measured": {"float32": [[100, 2.0], [1000, 20.0]]},
                }
            }
        }
    }
    model = cost_table(data)["b"]["layer_norm"]
    assert model.measured == {"float32": ((100.0, 2.0), (1000.0, 20.0))}
    assert model.estimate_us(1000.0, "float32") == 20.0


@pytest.mark.parametrize(
    "data",
    [
        {},
        {"backends": {"b": {"layer_norm": {"fixed_us": 1.0}}}},
        {"backends": {"b": {"layer_norm": {"fixed_us": float("nan"), "bytes_per_us": {}}}}},
        {"backends": {"b": {"layer_norm": {"fixed_us": 1.0, "bytes_per_us": {"float32": 0}}}}},
        {"backends": {"b": {"layer_norm": {"fixed_us": "1", "bytes_per_us": {}}}}},
        {
            "backends": {
                "b": {"layer_norm": {**LINE, "measured": {"float32": [[2, 1.0], [1, 2.0]]}}}
            }
        },
        {"backends": {"b": {"layer_norm": {**LINE, "measured": {"float32": [[1, 0.0]]}}}}},
        {"backends": {"b": {"layer_norm": {**LINE, "measured": {"float32": [[1, "2"]]}}}}},
        {"backends": {"b": {"layer_norm": {**LINE, "measured": {"float32": [[1]]}}}}},
    ],
)
def test_cost_tables_are_checked(data: Any) -> None:
    with pytest.raises(ValueError):
        cost_table(data)


def test_malformed_measured_points_are_named() -> None:
    data = {"backends": {"b": {"layer_norm": {**LINE, "measured": {"float32": [[1]]}}}}}
    with pytest.raises(ValueError, match=r"measured float32: \(x_bytes, us\) pairs"):
        cost_table(data)


def test_zero_copy_families_are_eligible_by_default_explicit_ones_only_when_named(
    register: Register,
) -> None:
    x = np.ones((2, 8), np.float32)
    register(
        record(
            "borrower",
            priority=99,
            families=frozenset({"fakelib"}),
            zero_copy_families=frozenset({"numpy"}),
        ),
        record(
            "asked",
            priority=98,
            families=frozenset({"fakelib"}),
            explicit_families=frozenset({"numpy"}),
        ),
    )
    assert _chosen(x) == "borrower"
    text = normlab.explain(x)
    assert (
        "asked (priority 98): serves fakelib arrays, not numpy; it serves numpy arrays only "
        "when named" in text
    )


# --------------------------------------------------------------------------------------------
# The built-in backends' shipped models


OPS = FORWARD_OPS + BACKWARD_OPS


def test_the_shipped_models_cover_every_builtin_choice() -> None:
    """numpy and numba on NumPy arrays, torch and numba on CPU torch tensors: a model for every
    op and dtype, so that cost, not priority, decides between them."""
    from normlab.backends import BUILTIN_RECORDS

    records = {r.name: r for r in BUILTIN_RECORDS}
    for name, family in (
        ("numpy", "numpy"),
        ("numba", "numpy"),
        ("numba", "torch"),
        ("torch", "torch"),
    ):
        for op in OPS:
            model = records[name].costs[f"{op}:{family}"]
            assert set(model.bytes_per_us) == set(records[name].dtypes), (name, op, family)


def _torch_choice(rows: int, cols: int = 1024) -> str:
    torch = pytest.importorskip("torch")
    return _chosen(torch.ones(rows, cols))


def test_a_cpu_tensor_goes_to_one_of_torch_and_numba_for_every_row_count() -> None:
    """The default for CPU torch tensors of one row length is whichever of torch and numba
    (zero-copy) the shipped models keep closer to the faster at every row count, the same for
    1, 64 and 4096 rows; explain() prints both estimates and worst ratios."""
    torch = pytest.importorskip("torch")
    numba, torch_backend = registry.get("numba"), registry.get("torch")
    if not numba.available:
        pytest.skip("numba is not installed")
    plan = _plan(torch.ones(1, 1024))
    profiles = [(b.name, costs.profile_us(b, plan)) for b in (numba, torch_backend)]
    assert all(p is not None for _, p in profiles)
    worst = {
        name: max(e / min(q[k] for _, q in profiles) for k, e in enumerate(p))  # type: ignore[index]
        for name, p in profiles
    }
    expected = min(worst, key=lambda n: worst[n])
    assert {_torch_choice(rows) for rows in (1, 64, 4096)} == {expected}, worst
    text = normlab.explain(torch.ones(4096, 1024))
    assert "numba (priority 20): " in text and "estimated" in text and "x the fastest" in text


def test_tensors_requiring_grad_pay_the_custom_op_on_a_backend_without_a_graph(
    register: Register,
) -> None:
    """With a tensor that requires grad, a backend that records no graph (run through normlab's
    custom ops) is estimated THROUGH_GRAPH_US dearer; one that records its own is not."""
    torch = pytest.importorskip("torch")
    for name, capabilities in (("plain", frozenset()), ("graphs", frozenset({"autograd"}))):
        register(
            record(name, families=frozenset({"torch"}), capabilities=capabilities, costs={
                "layer_norm": QUICK, "layer_norm_backward": QUICK
            })
        )  # fmt: skip
    x = torch.ones(4, 256)
    plain, graphs = registry.get("plain"), registry.get("graphs")
    without = costs.estimate_us(plain, _plan(x))
    assert without is not None and without == costs.estimate_us(graphs, _plan(x))
    grad = _plan(x.requires_grad_())
    assert costs.estimate_us(plain, grad) == pytest.approx(without + costs.THROUGH_GRAPH_US)
    assert costs.estimate_us(graphs, grad) == without


@pytest.mark.parametrize("measured", [0.0, 42.5])
def test_the_calibrated_cost_of_the_custom_ops_replaces_the_shipped_one(
    register: Register, own_calibration: Path, measured: float
) -> None:
    torch = pytest.importorskip("torch")
    register(record("plain", families=frozenset({"torch"}), costs={"layer_norm": QUICK}))
    plain, x = registry.get("plain"), torch.ones(4, 256)
    without = costs.estimate_us(plain, _plan(x))
    assert without is not None
    own_calibration.parent.mkdir(parents=True)
    own_calibration.write_text(json.dumps({"backends": {}, "through_graph_us": measured}))
    costs.reload()
    assert costs.through_graph_us() == measured
    assert costs.estimate_us(plain, _plan(x.requires_grad_())) == pytest.approx(without + measured)


@pytest.mark.parametrize("value", [-1, "100", True, float("nan"), 10**400])
def test_a_malformed_custom_op_cost_is_ignored_with_a_warning(
    own_calibration: Path, value: Any
) -> None:
    own_calibration.parent.mkdir(parents=True)
    own_calibration.write_text(json.dumps({"backends": {}, "through_graph_us": value}))
    costs.reload()
    with pytest.warns(normlab.NormlabWarning, match="through_graph_us must be"):
        assert costs.through_graph_us() == costs.THROUGH_GRAPH_US


def test_normlab_torch_default_keeps_tensors_on_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("NORMLAB_TORCH_DEFAULT", "torch")
    dispatch.clear_caches()
    assert _torch_choice(4096) == "torch" and _torch_choice(1) == "torch"
    assert "NORMLAB_TORCH_DEFAULT=torch keeps torch tensors on torch" in normlab.explain(
        torch.ones(8, 8)
    )
    if registry.get("numba").available:  # naming numba still works
        assert isinstance(normlab.layer_norm(torch.ones(8, 8), backend="numba"), torch.Tensor)
    monkeypatch.setenv("NORMLAB_TORCH_DEFAULT", "numba")
    dispatch.clear_caches()
    with pytest.warns(normlab.NormlabWarning, match="neither 'torch' nor 'auto'"):
        _torch_choice(8)


def test_a_400_digit_integer_in_a_calibration_file_is_ignored_with_a_warning(
    register: Register, own_calibration: Path
) -> None:
    """A hand-edited costs file with an integer too large for a float: warned about and ignored
    like any malformed file, never a raw OverflowError on every call."""
    register(_modelled("quick", QUICK), _modelled("wide", WIDE))
    own_calibration.parent.mkdir(parents=True)
    huge = {"fixed_us": 10**400, "bytes_per_us": {"float32": 1000.0}}
    own_calibration.write_text(json.dumps({"backends": {"quick": {"layer_norm": huge}}}))
    costs.reload()
    dispatch.clear_caches()
    with pytest.warns(normlab.NormlabWarning, match="ignoring the calibration"):
        assert _chosen(_fake(1)) == "wide"
