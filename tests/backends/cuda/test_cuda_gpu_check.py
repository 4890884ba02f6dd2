"""The CPU side of benchmarks/gpu_check.py (the large-input and speed stages of the GPU check of
the cupy backend): its arguments, the byte counts of its GB/s, the whole check run with
--dry-run on CPU stand-ins (the torch backend), and the large-input comparison failing a wrong
result."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.paths import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


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
        gpu_check.main(["correctness"])  # checked by the conformance suite now
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        gpu_check.main(["--help"])
    usage = capsys.readouterr().out
    assert "{large,bench}" in usage and "--dry-run" in usage


def test_backward_bytes(gpu_check: ModuleType) -> None:
    ln = gpu_check.BackwardTiming("layer_norm", "bfloat16", 4096, 1024, {"normlab": 1e-3})
    rms = gpu_check.BackwardTiming("rms_norm", "float32", 4096, 1024, {"normlab": 1e-3})
    assert ln.bytes == (3 * 4096 + 3) * 1024 * 2  # x, dy, dx; weight, dweight, dbias
    assert rms.bytes == (3 * 4096 + 2) * 1024 * 4  # x, dy, dx; weight, dweight
    assert ln.gbps("normlab") == pytest.approx(ln.bytes / 1e-3 / 1e9)


def test_the_check_runs_dry(gpu_check: ModuleType, tmp_path: Path) -> None:
    """``gpu_check.py --dry-run``: every stage, on CPU tensors through the torch backend."""
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 0
    large = (tmp_path / "large.md").read_text()
    assert "0 failed" in large and "rms_norm 8 x 4097 bfloat16 (torch tensors)" in large
    bench = (tmp_path / "bench.md").read_text()
    assert "### layer_norm" in bench and "### rms_norm backward" in bench


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_the_large_comparison_fails_a_wrong_result(
    gpu_check: ModuleType, monkeypatch: pytest.MonkeyPatch, op: str
) -> None:
    """A normlab whose y is 1% too large: the large stage says so."""
    real = getattr(gpu_check.normlab, op)

    def wrong(*args: object, **kwargs: object) -> object:
        y, *stats = real(*args, **kwargs)
        return (y * 1.01, *stats)

    dev = gpu_check.Device(dry=True)
    assert "of the allowed error" in gpu_check._check_large(dev, op, 8, 300, "float32")
    monkeypatch.setattr(gpu_check.normlab, op, wrong)
    with pytest.raises(AssertionError, match="error / allowed"):
        gpu_check._check_large(dev, op, 8, 300, "float32")
