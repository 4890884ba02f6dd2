"""The conformance suite has teeth: every deliberately wrong backend of :mod:`mutants` (forward
and backward) fails it, and the same kernels without a flaw pass it — so failures come from the
suite's checks, not from the harness."""

from __future__ import annotations

import os
from typing import Final
from unittest import mock

import numpy as np
import pytest

import normlab.testing
from normlab import costs, dispatch, reference, registry
from normlab.constants import FLOAT_DTYPES
from normlab.hookspecs import Plan
from normlab.registry import Backend
from normlab.testing.cases import Case
from normlab.testing.fused_cases import FusedCase
from tests.support import mutants

#: flaw -> the suite tests written to catch it; each must be among the tests that fail.
CATCHERS: Final[dict[str, frozenset[str]]] = {
    "std_plus_eps": frozenset({"test_eps_inside_the_root", "test_worked_example"}),
    "ddof1": frozenset({"test_worked_example", "test_matches_reference"}),
    "naive_moments": frozenset({"test_large_offsets", "test_constant_rows_give_bias"}),
    "batch_stats": frozenset({"test_batch_independence", "test_matches_reference"}),
    "ignored_strides": frozenset({"test_layout", "test_matches_reference"}),
    "half_accumulation": frozenset({"test_near_float16_max", "test_half_zeros_tiny_eps"}),
    "bias_without_weight": frozenset({"test_affine_combinations", "test_constant_rows_give_bias"}),
    "reads_x_after_writing": frozenset({"test_in_place_row_views"}),
    "writes_into_x": frozenset({"test_x_never_modified_on_the_direct_path"}),
    "prepared_one_ulp_off": frozenset({"test_x_never_modified_on_the_direct_path"}),
    "rows_past_65535": frozenset({"test_boundary_shapes"}),
    "drops_tail_block": frozenset({"test_boundary_shapes"}),
    "stats_wrap_65536": frozenset({"test_boundary_shapes"}),
    "overflow_squares": frozenset({"test_magnitudes"}),
    "flush_subnormals": frozenset({"test_magnitudes"}),
    "rms_mean_subtracted": frozenset(
        {"test_rms_norm_worked_example", "test_rms_norm_constant_rows_give_weight_times_sign"}
    ),
    "rms_variance": frozenset({"test_rms_norm_worked_example", "test_matches_reference"}),
    "rms_eps_outside_root": frozenset({"test_eps_inside_the_root", "test_half_zeros_tiny_eps"}),
    "bwd_no_mean_g": frozenset(
        {"test_backward_finite_differences", "test_backward_matches_reference"}
    ),
    "bwd_rstd_squared": frozenset({"test_backward_finite_differences", "test_backward_affine"}),
    "bwd_dbias_from_dx": frozenset(
        {"test_backward_finite_differences", "test_backward_matches_reference"}
    ),
    "bwd_recomputed_stats": frozenset(
        {"test_backward_large_offset", "test_backward_uses_given_rstd"}
    ),
    "bwd_unordered_sums": frozenset({"test_backward_repeatable"}),
    "bwd_thread_chunks": frozenset({"test_backward_thread_counts"}),
    "bwd_overwrites_dy": frozenset({"test_backward_affine", "test_backward_finite_differences"}),
    "bwd_ignores_needs": frozenset({"test_backward_needs"}),
    "bwd_rms_mean_g": frozenset(
        {"test_backward_finite_differences", "test_backward_matches_reference"}
    ),
    "row_count_order": frozenset({"test_a_row_alone_and_in_any_batch"}),
    "two_roundings": frozenset({"test_float32_small_outputs_as_accurate_as_torch"}),
    "bwd_row_count_order": frozenset({"test_backward_rows_alone_and_in_any_batch"}),
    "bwd_half_sums": frozenset({"test_half_parameter_gradients_sum_in_float32"}),
    "torch_half_sums": frozenset({"test_half_parameter_gradients_sum_in_float32"}),
    "normalize_before_rounding": frozenset({"test_fused_h_rounded_before_normalizing"}),
    "forgets_h": frozenset({"test_fused_out", "test_fused_in_place"}),
    "h_into_out": frozenset({"test_fused_in_place"}),
    "offset_in_x_dtype": frozenset({"test_weight_offset"}),
    "offset_ignored": frozenset({"test_weight_offset"}),
    "offset_on_bias": frozenset({"test_weight_offset"}),
    "stream_rounded_h": frozenset({"test_float32_residual_stream"}),
    "quant_round_half_away": frozenset({"test_quantized_ties_round_half_to_even"}),
    "quant_scale_from_half_y": frozenset({"test_quantized_outputs"}),
    "quant_no_saturation": frozenset({"test_quantized_outputs"}),
    "quant_per_tensor_scale": frozenset({"test_quantized_outputs"}),
}


class Failures:
    """A pytest plugin noting, for each failed test of a suite run, the exception's type."""

    def __init__(self) -> None:
        self.by_test: dict[str, str] = {}

    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> None:
        passing = (pytest.skip.Exception, pytest.xfail.Exception)
        if call.excinfo is not None and not call.excinfo.errisinstance(passing):
            self.by_test[item.nodeid] = call.excinfo.typename

    def functions(self) -> set[str]:
        """The failed test functions, without module and parameters."""
        return {nodeid.split("::")[-1].split("[")[0] for nodeid in self.by_test}


def _run_suite(flaw: str) -> tuple[int, Failures]:
    """The suite's run on the mutant of ``flaw`` (only the tests of mutants.ONLY where given),
    as on a CI machine: there pytest explains failed comparisons in full (``CI`` set), which
    once made a failing bitwise check run for hours."""
    failures = Failures()
    only = ("-k", mutants.ONLY[flaw]) if flaw in mutants.ONLY else ()
    with mock.patch.dict(os.environ, {"CI": "1"}), mutants.registered(flaw) as name:
        code = normlab.testing.check(
            name, extra_pytest_args=("-q", "--tb=no", *only), plugins=[failures]
        )
    return code, failures


def test_mutants_cover_every_catcher() -> None:
    assert set(CATCHERS) == set(mutants.MUTANTS)


def test_control_passes() -> None:
    """The kernel without a flaw passes the whole suite: the harness does not fail correct code."""
    code, failures = _run_suite("control")
    assert code == pytest.ExitCode.OK, failures.by_test


@pytest.mark.parametrize("flaw", mutants.MUTANTS)
def test_mutant_fails(flaw: str) -> None:
    """Each flawed kernel fails the suite, by failed checks (AssertionError), in the tests
    written for its flaw, and only in the area of the op it breaks."""
    if flaw == "bwd_thread_chunks":
        pytest.importorskip("numba", reason="this mutant follows numba's thread count")
    if flaw in mutants.TORCH_FLAWS:
        pytest.importorskip("torch", reason="this mutant serves torch tensors")
    code, failures = _run_suite(flaw)
    assert code == pytest.ExitCode.TESTS_FAILED, f"the suite passed a kernel that {flaw}"
    crashes = {test: kind for test, kind in failures.by_test.items() if kind != "AssertionError"}
    assert not crashes, f"failures that are not the suite's checks: {crashes}"
    missed = CATCHERS[flaw] - failures.functions()
    assert not missed, f"{sorted(missed)} did not catch {mutants.FLAWS[flaw]}"
    caught = mutants.ESCAPES.get(flaw, frozenset()) & failures.functions()
    assert not caught, f"{sorted(caught)} caught a flaw only the newer tests are said to catch"
    if flaw in mutants.RMS_FLAWS:  # its layer_norm is correct: only rms_norm tests may fail
        stray = [test for test in failures.by_test if "rms_norm" not in test]
        assert not stray, f"tests of layer_norm failed an rms_norm flaw: {stray}"
    if flaw in mutants.BACKWARD_FLAWS:  # its forward ops are correct
        stray = [
            test
            for test in failures.by_test
            if "test_backward.py::" not in test
            and "::test_backward" not in test
            and "_backward-" not in test  # a backward op's case of another area
        ]
        assert not stray, f"tests of the forward ops failed a backward flaw: {stray}"
    if flaw in mutants.FUSED_FLAWS:  # its layer_norm is correct: only fused tests may fail
        stray = [test for test in failures.by_test if "add_layer_norm" not in test]
        assert not stray, f"tests of other ops failed a fused flaw: {stray}"
    if flaw in mutants.OFFSET_FLAWS:  # only the offset is wrong
        stray = [test for test in failures.by_test if "::test_weight_offset[" not in test]
        assert not stray, f"tests without an offset failed an offset flaw: {stray}"
    if flaw in mutants.STREAM_FLAWS:  # only the stream is wrong
        stray = [test for test in failures.by_test if "::test_float32_residual_stream[" not in test]
        assert not stray, f"tests without a float32 stream failed a stream flaw: {stray}"
    if flaw in mutants.QUANTIZE_FLAWS:  # only the quantizer is wrong
        stray = [test for test in failures.by_test if "test_quantize.py::" not in test]
        assert not stray, f"tests without quantize= failed a quantizer flaw: {stray}"
    if flaw.startswith("bwd_rms_"):  # its layer_norm_backward is correct
        stray = [test for test in failures.by_test if "rms_norm" not in test]
        assert not stray, f"tests of layer_norm_backward failed an rms_norm flaw: {stray}"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_absorbed_pair_separates_normalizing_before_rounding(dtype: str) -> None:
    """The numbers behind test_fused_h_rounded_before_normalizing: in the "absorbed" pair
    nearly every h rounds, and y of the exact sum (what a kernel normalizing before rounding h
    gives) is outside the tolerance around the reference of the rounded h, which y of the
    rounded h (rounded once more to x's dtype) is within."""
    case = FusedCase(
        Case((8, 64), dtype, seed=33, weight="float32", bias="float32"), pair="absorbed"
    )
    x, residual, weight, bias = case.numpy_inputs()
    exact = x.astype(np.float64) + residual.astype(np.float64)
    h = case.h()
    assert (h.astype(np.float64) != exact).mean() > 0.9
    for summed in (h, exact):
        y = reference.layer_norm(summed, None, weight, bias, 1e-5)[0].astype(x.dtype)
        if summed is h:
            case.compare(y, h, None, None, backend="numpy")
        else:
            with pytest.raises(AssertionError, match=r"^y \(" + dtype):
                case.compare(y, h, None, None, backend="numpy")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_cancelling_pair_sums_exactly(dtype: str) -> None:
    """x = C + a and residual = -C + b cancel exactly (Sterbenz): the rounded h is the exact
    sum, so that pair tests the add, and only the absorbed pair can catch a kernel normalizing
    before rounding h."""
    case = FusedCase(Case((8, 64), dtype, seed=33), pair="cancelling")
    x, residual, _, _ = case.numpy_inputs()
    exact = x.astype(np.float64) + residual.astype(np.float64)
    assert np.array_equal(case.h().astype(np.float64), exact)
    assert np.abs(exact).max() < 16 < np.abs(x.astype(np.float64)).min()


class _Forgetful(dict):  # type: ignore[type-arg]
    """A choice cache that keeps nothing: every call is chosen afresh."""

    def __setitem__(self, key: object, value: object) -> None:
        pass


def test_a_choice_by_size_fails_the_default_subject(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default choice is a subject of the suite (``default:torch``): a dispatcher choosing
    by the call's size (numba below 64 rows, torch from 64 on, each correct alone) fails its
    batch-invariance area, which the same suite passes with the row-independent choice."""
    pytest.importorskip("torch")
    if not registry.get("numba").available:
        pytest.skip("the choice by size here is between numba and torch")
    failures = Failures()
    code = normlab.testing.check(
        "default:torch", extra_pytest_args=("-q", "--tb=no", "-k", "row_alone"), plugins=[failures]
    )
    assert code == pytest.ExitCode.OK, failures.by_test
    by_size = {"numba": lambda plan: plan.rows < 64, "torch": lambda plan: plan.rows >= 64}

    def profile_at_the_call_s_size(backend: Backend, plan: Plan) -> tuple[float, ...] | None:
        cheap = by_size.get(backend.name)
        return None if cheap is None else (1.0 if cheap(plan) else 2.0,)

    monkeypatch.setattr(costs, "profile_us", profile_at_the_call_s_size)
    monkeypatch.setattr(dispatch, "_choices", _Forgetful())
    failures = Failures()
    code = normlab.testing.check(
        "default:torch", extra_pytest_args=("-q", "--tb=no", "-k", "row_alone"), plugins=[failures]
    )
    assert code == pytest.ExitCode.TESTS_FAILED, "the suite passed a choice that changes with rows"
    assert failures.functions() == {"test_a_row_alone_and_in_any_batch"}, failures.by_test
