"""The benchmark report and compare code on a synthetic saved run (nothing is timed here)."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SHAPES = ([1024, 1024], [1024, 4096], [64, 768], [8, 512, 768])
#: Seconds of each call on every shape (bytes do not matter to the ratios).
BASE = {
    ("reference", "copy", "alloc"): 2e-3,
    ("reference", "copyto", "out"): 1e-3,
    ("reference", "torch", "alloc"): 3e-3,
    ("reference", "textbook", "alloc"): 12e-3,
    ("layer_norm", "numpy", "alloc"): 4e-3,
    ("layer_norm", "numpy", "out"): 2e-3,
}
NBYTES = 2 * 4096 * 1024 * 4


def _load(name: str) -> ModuleType:
    """A module of benchmarks/ (not a package), under a name of its own."""
    spec = importlib.util.spec_from_file_location(
        f"normlab_bench_{name}", BENCHMARKS / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


report = _load("report")


def _bench(kind: str, subject: str, mode: str, seconds: float, shape: list[int]) -> dict[str, Any]:
    info = {"kind": kind, "subject": subject, "mode": mode, "shape": shape, "dtype": "float32"}
    if kind != "dispatch":
        info["bytes"] = NBYTES
    stats = {"min": seconds, "median": seconds, "iqr": 0.0, "rounds": 5}
    return {"name": f"test[{subject}-{mode}]", "extra_info": info, "stats": stats}


def _run(slower: dict[tuple[str, str, str], tuple[float, ...]] | None = None) -> dict[str, Any]:
    """A saved run: references and two numpy calls per shape, a dispatch pair, memory, a skip.

    ``slower`` multiplies a call's times, shape by shape.
    """
    factors = slower or {}
    benchmarks = [
        _bench(*key, seconds * factors.get(key, (1.0,) * len(SHAPES))[i], shape)
        for i, shape in enumerate(SHAPES)
        for key, seconds in BASE.items()
    ]
    benchmarks += [
        _bench("dispatch", "numpy", "normlab", 11e-6, [8, 64]),
        _bench("dispatch", "numpy", "direct", 10e-6, [8, 64]),
    ]
    return {
        "machine_info": {
            "cpu": {"brand_raw": "Synthetic CPU", "count": 2},
            "cpu_count": 2,
            "memory_bytes": 8 * 2**30,
            "system": "Linux",
            "python_version": "3.11.0",
            "libraries": {"numpy": "2.0", "torch": "2.13.0"},
            "torch_threads": 2,
            "normlab": {"version": "0.1.0"},
        },
        "commit_info": {"id": "0123456789abcdef", "dirty": False},
        "datetime": "2026-01-02T03:04:05",
        "benchmarks": benchmarks,
        "normlab": {
            "matrix": "full",
            "budget_s": 1200.0,
            "elapsed_s": 600.0,
            "memory": [
                {
                    "subject": "numpy",
                    "kind": "backend",
                    "dtype": "float32",
                    "shape": SHAPES[0],
                    "input_bytes": 2**24,
                    "rss_extra_bytes": 2**24,
                    "numpy_peak_bytes": 2**24,
                    "method": "VmHWM",
                },
            ],
            "skipped": [{"id": "test_matrix[numba]", "reason": "numba is broken"}],
        },
    }


def test_ratios_are_taken_against_the_matched_references() -> None:
    rows = {(r.subject, r.mode, r.kind): r for r in report.rows(_run()) if r.shape == (1024, 1024)}
    alloc = rows[("numpy", "alloc", "layer_norm")]
    assert alloc.gbps == pytest.approx(NBYTES / 4e-3 / 1e9)
    assert alloc.of_copy == pytest.approx(0.5)  # x.copy() took 2 ms
    assert alloc.vs_torch == pytest.approx(0.75)
    assert alloc.vs_textbook == pytest.approx(3.0)
    out = rows[("numpy", "out", "layer_norm")]
    assert out.of_copy == pytest.approx(0.5)  # np.copyto took 1 ms
    torch_row = rows[("torch", "alloc", "reference")]
    assert torch_row.vs_torch is None and torch_row.of_copy == pytest.approx(2 / 3)
    assert rows[("copy", "alloc", "reference")].of_copy is None


def test_summary_dispatch_and_tables() -> None:
    run = _run()
    summary = {s.label: s for s in report.summary(report.rows(run))}
    assert summary["numpy"].of_copy == pytest.approx(0.5)
    assert summary["numpy out="].vs_torch == pytest.approx(1.5)
    (pair,) = report.dispatch(run)
    assert pair.overhead_us == pytest.approx(1.0)
    titles = [t.title for t in report.report_tables(run)]
    assert titles[0].startswith("Key ratios") and "Not measured" in titles
    from rich.console import Console

    console = Console(file=io.StringIO(), width=160)
    report.print_report(run, console)
    text = console.file.getvalue()
    assert "Synthetic CPU" in text and "numpy out=" in text and "numba is broken" in text


def test_compare_flags_changes_beyond_the_spread() -> None:
    alloc, out = ("layer_norm", "numpy", "alloc"), ("layer_norm", "numpy", "out")
    changes = report.compare(_run(), _run({alloc: (2.0, 2.0, 2.0, 2.0)}))
    verdicts = {c.label: c.verdict for c in changes}
    assert verdicts == {
        "numpy": "slower",
        "numpy out=": "",
        "torch F.layer_norm": "reference",
        "textbook NumPy": "reference",
    }
    numpy = next(c for c in changes if c.label == "numpy")
    assert numpy.change == pytest.approx(-0.5) and numpy.shapes == len(SHAPES)
    scattered = report.compare(_run(), _run({alloc: (1.6, 0.6, 1.6, 0.7), out: (1.05,) * 4}))
    assert all(c.verdict == "" for c in scattered if not c.reference)  # noise; within the floor
    machine = {key: (1.3,) * 4 for key in BASE if key[0] != "reference" or key[1] == "torch"}
    drifted = report.compare(_run(), _run(machine))  # the unchanged peer drifted as much
    assert all(c.verdict in ("", "reference") for c in drifted)
    from rich.console import Console

    text = io.StringIO()
    report.print_compare(_run(), _run({alloc: (2.0,) * 4}), Console(file=text, width=160))
    assert "1 slower" in text.getvalue()


def test_docs_page_is_generated_from_the_run() -> None:
    page = report.docs_page(_run(), "benchmarks/results/x.json", ["images/performance-f.png"])
    assert page.startswith("# Performance")
    assert "do not edit by hand" in page and "benchmarks/results/x.json" in page
    assert "Synthetic CPU" in page and "![performance-f](images/performance-f.png)" in page
    assert "| numpy | float32 |" in page


def test_plots_are_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plots = _load("plots")
    (path,) = plots.render(report.rows(_run()), tmp_path, "synthetic")
    assert path.name == "synthetic-float32.png" and path.stat().st_size > 0
