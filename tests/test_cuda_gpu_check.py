"""The CPU side of benchmarks/gpu_check.py (the GPU check of the cupy backend): its arguments, the
cases it derives from the planner, the byte counts of its GB/s, and the backward stage run with
--dry-run on CPU stand-ins (the torch backend), which also shows its comparisons can fail."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from normlab.backends import cuda_launch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_stages_and_arguments(gpu_check: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["no_such_stage"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        gpu_check.main(["--help"])
    usage = capsys.readouterr().out
    assert "{correctness,large,backward,bench}" in usage and "--dry-run" in usage


def test_the_forward_cases_reach_only_forward_kernels(gpu_check: ModuleType) -> None:
    cases = gpu_check._every_kernel_cols()
    assert {op for op, *_ in cases} == set(cuda_launch.FORWARD_OPS)
    plans = {
        cuda_launch.plan_launch(op, cols, dtype, param, [0, 0, 0, 0], [cols, cols]).specialisation
        for op, dtype, param, cols in cases
    }
    forward = {s for s in cuda_launch.all_specialisations() if s.op in cuda_launch.FORWARD_OPS}
    assert plans == forward  # every forward kernel, 16-byte and element accesses


def test_backward_bytes(gpu_check: ModuleType) -> None:
    ln = gpu_check.BackwardTiming("layer_norm", "bfloat16", 4096, 1024, {"normlab": 1e-3})
    rms = gpu_check.BackwardTiming("rms_norm", "float32", 4096, 1024, {"normlab": 1e-3})
    assert ln.bytes == (3 * 4096 + 3) * 1024 * 2  # x, dy, dx; weight, dweight, dbias
    assert rms.bytes == (3 * 4096 + 2) * 1024 * 4  # x, dy, dx; weight, dweight
    assert ln.gbps("normlab") == pytest.approx(ln.bytes / 1e-3 / 1e9)


def test_the_backward_stage_runs_dry(gpu_check: ModuleType, tmp_path: Path) -> None:
    assert gpu_check.main(["backward", "--dry-run", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "backward.md").read_text()
    assert "0 failed" in text and "rms_norm float16 70 x 300 through autograd vs torch" in text


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_the_backward_comparison_fails_a_wrong_gradient(
    gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    """A normlab whose y is 1% too large has gradients 1% too large: the stage says so."""
    real = getattr(gpu_check.normlab, op)
    monkeypatch.setattr(gpu_check.normlab, op, lambda *a, **k: real(*a, **k) * 1.01)
    dev = gpu_check.Device(dry=True)
    with pytest.raises(AssertionError, match="too large in dx, dweight"):
        gpu_check._check_autograd(dev, op, "float32", 70, 300)
    monkeypatch.setattr(gpu_check.normlab, op, real)
    assert "dweight" in gpu_check._check_autograd(dev, op, "float32", 70, 300)
