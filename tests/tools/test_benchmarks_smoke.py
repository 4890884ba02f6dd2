"""The benchmark report and compare code on a synthetic saved run (nothing is timed here), and a
tiny real run of the matrix that checks every op's rows appear and the report renders."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import options as bench_options
from benchmarks import quantized as bench_quantized
from benchmarks.report import metrics, runs, tables, terminal
from benchmarks.report.page import FULL_BUDGET_MINUTES, docs_page, fill
from normlab.ops import BACKWARD_OPS, FORWARD_OPS
from tests.support.paths import DATA, ROOT

SHAPES = ([1024, 1024], [1024, 4096], [64, 768], [8, 512, 768])
OPS = FORWARD_OPS + BACKWARD_OPS
#: Seconds of each call on every shape (bytes do not matter to the time ratios), keyed by
#: (kind, op, subject, mode); the copy limits belong to no op.
BASE = {
    ("reference", None, "copy", "alloc"): 2e-3,
    ("reference", None, "copyto", "out"): 1e-3,
    ("reference", "layer_norm", "torch", "alloc"): 3e-3,
    ("reference", "layer_norm", "textbook", "alloc"): 12e-3,
    ("layer_norm", "layer_norm", "numpy", "alloc"): 4e-3,
    ("layer_norm", "layer_norm", "numpy", "out"): 2e-3,
    ("reference", "rms_norm", "torch", "alloc"): 8e-3,
    ("rms_norm", "rms_norm", "numpy", "alloc"): 2e-3,
    ("reference", "layer_norm_backward", "torch", "alloc"): 6e-3,
    ("layer_norm_backward", "layer_norm_backward", "numpy", "alloc"): 3e-3,
}
NBYTES = 2 * 4096 * 1024 * 4
#: A backward moves half as much again as a forward (x and dy read, dx written).
NBYTES_BACKWARD = 3 * 4096 * 1024 * 4


def _bench(
    kind: str, op: str | None, subject: str, mode: str, seconds: float, shape: list[int]
) -> dict[str, Any]:
    info: dict[str, Any] = {
        "kind": kind,
        "op": op,
        "subject": subject,
        "mode": mode,
        "shape": shape,
        "dtype": "float32",
    }
    if kind not in ("dispatch", "option", "quantized"):
        info["bytes"] = NBYTES_BACKWARD if op and op.endswith("_backward") else NBYTES
    stats = {"min": seconds, "median": seconds, "iqr": 0.0, "rounds": 5}
    return {"name": f"test[{subject}-{mode}]", "extra_info": info, "stats": stats}


def _run(
    slower: dict[tuple[str, str | None, str, str], tuple[float, ...]] | None = None,
    ops: tuple[str, ...] = OPS,
    matrix: str = "full",
) -> dict[str, Any]:
    """A saved run: references and numpy calls per shape, a dispatch pair, memory, a skip.

    ``slower`` multiplies a call's times, shape by shape; ``ops`` keeps only those ops' calls.
    """
    factors = slower or {}
    benchmarks = [
        _bench(*key, seconds * factors.get(key, (1.0,) * len(SHAPES))[i], shape)
        for i, shape in enumerate(SHAPES)
        for key, seconds in BASE.items()
        if key[1] is None or key[1] in ops
    ]
    benchmarks += [
        _bench("dispatch", None, "numpy", "normlab", 11e-6, [8, 64]),
        _bench("dispatch", None, "numpy", "direct", 10e-6, [8, 64]),
        _bench("option", None, "option", "weight_offset=1 (bf16)", 9e-6, [1, 4096]),
        _bench("option", None, "base", "weight_offset=1 (bf16)", 8e-6, [1, 4096]),
        _bench("option", None, "torch eager", "weight_offset=1 (bf16)", 18e-6, [1, 4096]),
        _bench("quantized", None, "fused", "rms_norm int8", 10e-6, [32, 4096]),
        _bench("quantized", None, "unfused pair", "rms_norm int8", 15e-6, [32, 4096]),
        _bench("quantized", None, "torch eager", "rms_norm int8", 60e-6, [32, 4096]),
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
            "matrix": matrix,
            "budget_s": 1200.0,
            "elapsed_s": 600.0,
            "load_average": {"start": [0.5, 0.4, 0.3], "end": [1.5, 0.9, 0.5]},
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
    rows = {
        (r.op, r.subject, r.mode, r.kind): r
        for r in metrics.rows(_run())
        if r.shape == (1024, 1024)
    }
    alloc = rows[("layer_norm", "numpy", "alloc", "layer_norm")]
    assert alloc.gbps == pytest.approx(NBYTES / 4e-3 / 1e9)
    assert alloc.of_copy == pytest.approx(0.5)  # x.copy() took 2 ms
    assert alloc.vs_torch == pytest.approx(0.75)
    assert alloc.vs_textbook == pytest.approx(3.0)
    out = rows[("layer_norm", "numpy", "out", "layer_norm")]
    assert out.of_copy == pytest.approx(0.5)  # np.copyto took 1 ms
    torch_row = rows[("layer_norm", "torch", "alloc", "reference")]
    assert torch_row.vs_torch is None and torch_row.of_copy == pytest.approx(2 / 3)
    assert rows[(None, "copy", "alloc", "reference")].of_copy is None


def test_each_op_is_compared_with_its_own_references() -> None:
    rows = {(r.op, r.subject, r.kind): r for r in metrics.rows(_run()) if r.shape == (1024, 1024)}
    rms = rows[("rms_norm", "numpy", "rms_norm")]
    assert rms.vs_torch == pytest.approx(4.0)  # torch F.rms_norm took 8 ms, not F.layer_norm's 3
    assert rms.of_copy == pytest.approx(1.0) and rms.vs_textbook is None
    assert rows[("rms_norm", "torch", "reference")].label == "torch F.rms_norm"
    backward = rows[("layer_norm_backward", "numpy", "layer_norm_backward")]
    assert backward.vs_torch == pytest.approx(2.0)
    # GB/s over the copy's GB/s: 1.5x the bytes in 1.5x the copy's time is the copy's rate.
    assert backward.of_copy == pytest.approx(1.0)
    assert backward.gbps == pytest.approx(NBYTES_BACKWARD / 3e-3 / 1e9)


def test_summary_dispatch_and_tables() -> None:
    run = _run()
    summary = {(s.op, s.label): s for s in metrics.summary(metrics.rows(run))}
    assert summary[("layer_norm", "numpy")].of_copy == pytest.approx(0.5)
    assert summary[("layer_norm", "numpy out=")].vs_torch == pytest.approx(1.5)
    assert summary[("rms_norm", "numpy")].vs_torch == pytest.approx(4.0)
    assert summary[("layer_norm_backward", "numpy")].vs_torch == pytest.approx(2.0)
    (pair,) = metrics.dispatch(run)
    assert pair.overhead_us == pytest.approx(1.0)
    (option,) = metrics.options(run)
    assert (option.option, option.shape) == ("weight_offset=1 (bf16)", (1, 4096))
    assert option.option_s / option.base_s == pytest.approx(1.125)
    table = tables.option_table(run)
    assert table.body == [
        ("weight_offset=1 (bf16)", "1x4096", "9.0", "8.0", "18.0", "1.12", "2.00")
    ]
    (row,) = metrics.quantized(run)
    assert (row.case, row.shape, row.dtype) == ("rms_norm int8", (32, 4096), "float32")
    assert row.pair_s / row.fused_s == pytest.approx(1.5)
    quantized_table = tables.quantized_table(run)
    assert quantized_table.body == [
        ("rms_norm int8", "32x4096", "float32", "10.0", "15.0", "60.0", "1.50", "6.00")
    ]
    titles = [t.title for t in tables.report_tables(run)]
    assert quantized_table.title in titles
    assert titles[:3] == [
        "LayerNorm forward: key ratios (geometric means)",
        "RMSNorm forward: key ratios (geometric means)",
        "LayerNorm backward: key ratios (geometric means)",
    ]
    assert "Not measured" in titles and "RMSNorm forward, float32: every backend call" in titles
    from rich.console import Console

    console = Console(file=io.StringIO(), width=200)
    terminal.print_report(run, console)
    text = console.file.getvalue()
    assert "Synthetic CPU" in text and "numpy out=" in text and "numba is broken" in text
    assert "torch autograd backward" in text and "1.50 / 0.90 / 0.50 at the end" in text


def test_each_auto_row_is_judged_against_its_own_family() -> None:
    """``auto`` against the fastest NumPy row; ``auto-torch`` against the torch backend's and
    numba's on tensors, not against numba on NumPy arrays (which pays no tensor crossing)."""
    shape = [1, 1024]
    run = _run(ops=())
    run["benchmarks"] = [
        _bench("layer_norm", "layer_norm", subject, "alloc", seconds, shape)
        for subject, seconds in (
            ("numba", 3e-6),
            ("numpy", 20e-6),
            ("auto", 3.1e-6),
            ("torch", 8e-6),
            ("numba-torch", 7e-6),
            ("auto-torch", 7.2e-6),
        )
    ]
    table = tables.auto_table(metrics.rows(run))
    ratios = {row[1]: (row[5], float(row[6])) for row in table.body}
    assert ratios["NumPy"][0].startswith("numba ") and ratios["NumPy"][1] == 1.03  # 3.1 / 3
    assert ratios["torch CPU"][0].startswith("numba-torch ")
    assert ratios["torch CPU"][1] == 1.03  # 7.2 / 7, not 7.2 / 3 against numba on NumPy
    assert not table.alerts


def test_the_default_is_judged_against_the_fastest_peer() -> None:
    """Each auto row against the fastest peer on its shape (not a backend, not the copy); the
    summary counts the calls behind by more than the tolerance, small and large apart."""
    small, large = [1, 1024], [4096, 1024]  # 4 KiB and 16 MiB of float32
    run = _run(ops=())
    timed = {  # (subject, kind): seconds at (small, large)
        ("auto", "layer_norm"): (6e-6, 10e-3),
        ("auto-torch", "layer_norm"): (9e-6, 10e-3),
        ("numba", "layer_norm"): (1e-6, 1e-3),  # a backend: never the peer
        ("torch", "reference"): (4e-6, 20e-3),
        ("ort_iobinding", "reference"): (5e-6, 9.6e-3),  # 1.04× at large: within tolerance
        ("copy", "reference"): (1e-6, 1e-3),  # a limit: never the peer
    }
    run["benchmarks"] = [
        _bench(kind, None if subject == "copy" else "layer_norm", subject, mode, t, shape)
        for (subject, kind), times in timed.items()
        for shape, t in zip((small, large), times, strict=True)
        for mode in ["out" if subject == "ort_iobinding" else "alloc"]
    ]
    gaps = {(g.row.subject, tuple(g.row.shape)): g for g in metrics.peer_gaps(metrics.rows(run))}
    assert set(gaps) == {
        (s, tuple(shape)) for s in ("auto", "auto-torch") for shape in (small, large)
    }
    assert gaps[("auto", (1, 1024))].peer.subject == "torch"
    assert gaps[("auto", (1, 1024))].gap_us == pytest.approx(2.0)
    assert gaps[("auto", (4096, 1024))].peer.subject == "ort_iobinding"
    assert not gaps[("auto", (4096, 1024))].behind  # 10 / 9.6 = 1.04
    summary = tables.peer_summary_table(list(gaps.values()))
    by_family = {row[1]: row for row in summary.body}
    # calls, ahead or within, behind small, median gap, behind large, worst ratio
    assert by_family["NumPy"][3:] == ("2", "1", "1", "2.0", "0", "—")
    assert by_family["torch CPU"][3:] == ("2", "1", "1", "5.0", "0", "—")
    assert summary.alerts == {0, 1}
    behind = tables.peer_gap_table(list(gaps.values()))
    assert [(row[1], row[3]) for row in behind.body] == [
        ("NumPy", "1×1024"),
        ("torch CPU", "1×1024"),
    ]
    page = docs_page([("run.json", run)], {})
    paragraph = fill("performance-default-vs-peers").removesuffix("\n")
    assert f"## {summary.title}" in page and paragraph in page


def test_compare_flags_changes_beyond_the_spread() -> None:
    alloc = ("layer_norm", "layer_norm", "numpy", "alloc")
    out = ("layer_norm", "layer_norm", "numpy", "out")
    changes = metrics.compare(_run(), _run({alloc: (2.0, 2.0, 2.0, 2.0)}))
    verdicts = {(c.op, c.label): c.verdict for c in changes}
    assert verdicts == {
        ("layer_norm", "numpy"): "slower",
        ("layer_norm", "numpy out="): "",
        ("layer_norm", "torch F.layer_norm"): "reference",
        ("layer_norm", "textbook NumPy"): "reference",
        ("rms_norm", "numpy"): "",
        ("rms_norm", "torch F.rms_norm"): "reference",
        ("layer_norm_backward", "numpy"): "",
        ("layer_norm_backward", "torch autograd backward"): "reference",
    }
    numpy = next(c for c in changes if (c.op, c.label) == ("layer_norm", "numpy"))
    assert numpy.change == pytest.approx(-0.5) and numpy.shapes == len(SHAPES)
    scattered = metrics.compare(_run(), _run({alloc: (1.6, 0.6, 1.6, 0.7), out: (1.05,) * 4}))
    assert all(c.verdict == "" for c in scattered if not c.reference)  # noise; within the floor
    machine = {key: (1.3,) * 4 for key in BASE if key[0] != "reference" or key[2] == "torch"}
    drifted = metrics.compare(_run(), _run(machine))  # the unchanged peers drifted as much
    assert all(c.verdict in ("", "reference") for c in drifted)
    backward = ("layer_norm_backward", "layer_norm_backward", "numpy", "alloc")
    slower = metrics.compare(_run(), _run({backward: (2.0,) * 4}))
    assert [c.op for c in slower if c.verdict == "slower"] == ["layer_norm_backward"]
    from rich.console import Console

    text = io.StringIO()
    terminal.print_compare(_run(), _run({alloc: (2.0,) * 4}), Console(file=text, width=200))
    assert "1 slower" in text.getvalue()


def test_docs_page_takes_each_op_from_the_first_run_that_measured_it() -> None:
    full = _run(ops=("layer_norm",))
    quick = _run(matrix="quick")
    images = {"layer_norm": ["images/performance-layer_norm-float32.png"]}
    page = docs_page([("results/full.json", full), ("results/quick.json", quick)], images)
    assert page.startswith("# Performance")
    assert "--report results/full.json results/quick.json --write-docs" in page
    assert "do not edit by hand" in page and "Synthetic CPU" in page
    assert "| LayerNorm forward | `results/full.json` |" in page
    for title in ("RMSNorm forward", "LayerNorm backward"):
        assert f"| {title} | `results/quick.json` |" in page and f"\n## {title}\n" in page
    assert "| RMSNorm backward |" not in page  # measured by neither run
    assert "![performance-layer_norm-float32](images/performance-layer_norm-float32.png)" in page
    assert "| numpy | float32 |" in page and "torch autograd backward" in page
    assert "retain_graph=True" in page  # the backward tables say what they time
    assert "load average | not recorded" not in page and "| load average |" in page


#: The page of :func:`_page_runs`, as written before the page's prose moved into templates
#: (benchmarks/report/templates/): a change to the page is a change to this file.
SAVED_PAGE = DATA / "performance-synthetic.md"


def _page_runs() -> list[tuple[str, dict[str, Any]]]:
    """Two saved runs whose page has every part: a quick run with calls made with no backend
    named beside torch alone (the notes on quick runs and on runs without the peers, and the
    default against the peers), and a full run of the fused ops."""
    quick = _run(matrix="quick")
    quick["benchmarks"] += [
        _bench("layer_norm", "layer_norm", "auto", "alloc", 3.5e-3, shape) for shape in SHAPES
    ]
    fused = _fused_run(pair_seconds=3e-3, fused_seconds=2.5e-3)
    return [("results/quick.json", quick), ("results/fused.json", fused)]


def test_the_page_templates_render_the_saved_page() -> None:
    images = {"layer_norm": ["images/performance-layer_norm-float32.png"]}
    page = docs_page(_page_runs(), images)
    assert page == SAVED_PAGE.read_text(encoding="utf-8")
    for part in ("a quick run", "predate the peers", "against the fastest peer", "(fused)"):
        assert part in page


def test_plots_are_drawn(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks import plots

    wide = _run()
    for bench in wide["benchmarks"]:  # a second hidden size for the 1024-row panel
        if bench["extra_info"]["shape"] == [1024, 4096]:
            bench["extra_info"]["shape"] = [1024, 2048]
    drawn = plots.render(metrics.rows(wide), tmp_path, "synthetic", runs.OP_TITLES)
    assert set(drawn) == {"layer_norm", "rms_norm", "layer_norm_backward"}
    (path,) = drawn["rms_norm"]
    assert path.name == "synthetic-rms_norm-float32.png" and path.stat().st_size > 0


def _tiny_matrix_run(saved: Path, matrix: str, budget: float, selection: str) -> dict[str, Any]:
    """Run the real matrix (``matrix``, ``budget`` minutes, tests matching ``selection``) in a
    subprocess saving to ``saved``; return the saved run."""
    # not a pytest-xdist worker's variables: pytest-benchmark would see one and time nothing
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "benchmarks/bench_matrix.py",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--normlab-matrix={matrix}",
            f"--normlab-budget-minutes={budget}",
            f"--benchmark-json={saved}",
            "-k",
            selection,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return json.loads(saved.read_text())  # type: ignore[no-any-return]


def test_a_tiny_matrix_run_has_every_op_and_renders(tmp_path: Path) -> None:
    """The real matrix, one small input, numpy and the references: each op's rows are there."""
    pytest.importorskip("pytest_benchmark")
    run = _tiny_matrix_run(
        tmp_path / "tiny.json",
        "quick",
        0.25,
        "test_matrix and float32-1x1000- and (ref or numpy) and not add_",
    )
    rows = [r for r in metrics.rows(run) if r.subject == "numpy" and r.mode == "alloc"]
    assert {r.op for r in rows} == set(OPS)
    assert all(r.of_copy is not None and r.gbps > 0 for r in rows)
    if importlib.util.find_spec("torch") is not None:
        assert all(r.vs_torch is not None for r in rows)
    assert run["normlab"]["load_average"]["start"]
    page = docs_page([("tiny.json", run)], {})
    for op in OPS:
        assert f"\n## {runs.OP_TITLES[op]}\n" in page


def test_a_tiny_matrix_run_has_the_option_rows(tmp_path: Path) -> None:
    """The real matrix's option rows on one token: every contender of every option is timed
    and the report's options table has a row per option."""
    pytest.importorskip("pytest_benchmark")
    pytest.importorskip("torch")
    pytest.importorskip("numba")
    run = _tiny_matrix_run(tmp_path / "options.json", "quick", 0.25, "test_option and 1x4096")
    found = {(r.option, r.shape) for r in metrics.options(run)}
    assert found == {(option, (1, 4096)) for option in bench_options.OPTIONS}
    assert len(tables.option_table(run).body) == len(bench_options.OPTIONS)


def test_quantized_rows_need_every_contender() -> None:
    """A quantized case whose contenders were not all timed (a skip, a budget cut) has no row;
    each shape and dtype of a case is a row of its own."""
    run = _run(ops=())
    run["benchmarks"] = [
        _bench("quantized", None, subject, "add_rms_norm int8", seconds, shape)
        for shape in ([1, 4096], [8192, 4096])
        for subject, seconds in (("fused", 4e-6), ("unfused pair", 9e-6), ("torch eager", 2e-5))
    ]
    run["benchmarks"][-1]["extra_info"]["dtype"] = "bfloat16"  # the prefill's eager: bf16
    found = [(r.shape, r.dtype) for r in metrics.quantized(run)]
    assert found == [((1, 4096), "float32")]
    assert [row[-2:] for row in tables.quantized_table(run).body] == [("2.25", "5.00")]


def test_a_tiny_matrix_run_has_the_quantized_rows(tmp_path: Path) -> None:
    """The real matrix's quantized rows on one token: every contender of every case, in each
    dtype, is timed and the report's quantized table has a row per case and dtype."""
    pytest.importorskip("pytest_benchmark")
    pytest.importorskip("torch")
    pytest.importorskip("numba")
    run = _tiny_matrix_run(tmp_path / "quantized.json", "quick", 0.25, "test_quantized and 1x4096")
    found = {(r.case, r.shape, r.dtype) for r in metrics.quantized(run)}
    assert found == {
        (case, (1, 4096), dtype)
        for case in bench_quantized.CASES
        for dtype in bench_quantized.DTYPES
    }
    table = tables.quantized_table(run)
    assert len(table.body) == len(bench_quantized.CASES) * len(bench_quantized.DTYPES)
    assert all(float(row[3]) > 0 for row in table.body)


#: The fused ops' contenders in the matrix: (kind, subject, mode).
FUSED_CALLS = (
    ("reference", "add_numba", "alloc"),
    ("reference", "torch", "alloc"),
    ("fused", "numba", "alloc"),
    ("fused", "numba", "post"),
    ("fused", "auto-torch", "alloc"),
)


def test_a_tiny_matrix_run_has_the_fused_rows_and_renders(tmp_path: Path) -> None:
    """The real matrix on the fused ops' small quick input: every contender of both fused ops
    is timed, with its ratio to the unfused pair on numba, and the page has their sections."""
    pytest.importorskip("pytest_benchmark")
    pytest.importorskip("torch")
    import normlab

    numba = normlab.registry.get("numba")
    if not numba.available:
        pytest.skip(f"the fused rows need numba: {numba.reason}")
    run = _tiny_matrix_run(
        tmp_path / "fused.json",
        "quick",
        0.25,
        "test_matrix and float32-1x1000- and (add_ or ref-copy)",
    )
    rows = metrics.rows(run)
    for op in runs.FUSED:
        found = {
            ("reference" if r.kind == "reference" else "fused", r.subject, r.mode): r
            for r in rows
            if r.op == op
        }
        assert set(found) == set(FUSED_CALLS), op
        for key, row in found.items():
            assert row.gbps > 0 and row.of_copy is not None
            assert (row.vs_torch is None) == (key[1] == "torch")
            assert (row.vs_composed is None) == (key[1] == "add_numba")
        x_bytes = 1000 * 4
        assert found[("fused", "numba", "alloc")].nbytes == 4 * x_bytes  # x, residual, h, y
        assert found[("fused", "numba", "post")].nbytes == 3 * x_bytes  # no h
    page = docs_page([("fused.json", run)], {})
    for op in runs.FUSED:
        assert f"\n## {runs.OP_TITLES[op]}\n" in page


def _fused_run(pair_seconds: float, fused_seconds: float) -> dict[str, Any]:
    """A saved run of the fused ops only: on a small and a large input, the unfused pairs (on
    numba: ``pair_seconds``; torch eager: twice that) and numba's fused call."""
    run = _run(ops=())
    for shape in ([32, 768], [8192, 1024]):
        for op in runs.FUSED:
            calls = [
                ("reference", op, "add_numba", "alloc", pair_seconds),
                ("reference", op, "torch", "alloc", 2 * pair_seconds),
                (op, op, "numba", "alloc", fused_seconds),
                (op, op, "numba", "post", fused_seconds),
            ]
            run["benchmarks"] += [_bench(*call, shape) for call in calls]
    return run


def test_fused_ratios_and_targets() -> None:
    """× add+numba is the speed-up over the unfused pair on numba on the same input; the
    fused table judges it against the issue's targets (post-norm rows are not held to them)."""
    fast = _fused_run(pair_seconds=3e-3, fused_seconds=2e-3)  # 1.5×: both targets met
    rows = {(r.op, r.subject, r.mode, tuple(r.shape)): r for r in metrics.rows(fast)}
    fused = rows[("add_layer_norm", "numba", "alloc", (32, 768))]
    assert fused.vs_composed == pytest.approx(1.5) and fused.vs_torch == pytest.approx(3.0)
    assert rows[("add_layer_norm", "add_numba", "alloc", (32, 768))].vs_composed is None
    assert rows[("add_rms_norm", "torch", "alloc", (32, 768))].label == (
        "torch x + r, then F.rms_norm"
    )
    assert rows[("add_rms_norm", "add_numba", "alloc", (32, 768))].label == (
        "torch x + r, then normlab.rms_norm (numba)"
    )
    table = tables.fused_table(metrics.rows(fast), "add_layer_norm")
    by_call = {line[0]: line for line in table.body}
    assert by_call["numba"][3:5] == ("1.5×", "1.5×") and by_call["numba"][-1] == "yes"
    assert not table.alerts
    slow = tables.fused_table(metrics.rows(_fused_run(3e-3, 2.5e-3)), "add_rms_norm")  # 1.2×
    by_call = {line[0]: line for line in slow.body}
    assert by_call["numba"][-1] == "no" and by_call["numba post-norm"][-1] == "no"
    assert slow.alerts == {list(by_call).index("numba")}  # the post-norm row is not flagged
    titles = [t.title for t in tables.report_tables(fast)]
    assert "Residual add + RMSNorm (fused): key ratios (geometric means)" in titles
    page = docs_page([("fused.json", fast)], {})
    assert "| numba | float32 | " in page and "× add+numba (≥ 1.15×)" in page


# --------------------------------------------------------------------------------------------
# The peers of the full matrix (ONNX Runtime, torch.compile): ratios, plots, and the real calls.

#: Seconds of each peer (and normlab's default backend) on every shape, LayerNorm forward.
PEER_TIMES = {"ort": 5e-3, "ort_iobinding": 1.5e-3, "torch_compile": 2.5e-3}


def _run_with_peers() -> dict[str, Any]:
    """A full run whose LayerNorm forward has the peers beside torch, numpy flagged default."""
    run = _run()
    for bench in run["benchmarks"]:
        info = bench["extra_info"]
        if info["kind"] == "layer_norm":
            info["default"] = info["subject"] == "numpy"
    for shape in SHAPES:
        for name, seconds in PEER_TIMES.items():
            mode = "out" if name == "ort_iobinding" else "alloc"
            run["benchmarks"].append(_bench("reference", "layer_norm", name, mode, seconds, shape))
    return run


def test_best_peer_is_the_fastest_other_peer_beside_the_call() -> None:
    run = _run_with_peers()
    rows = {(r.op, r.subject, r.mode): r for r in metrics.rows(run) if r.shape == (1024, 1024)}
    # numpy alloc 4 ms; peers: torch 3, ORT 5, ORT io_binding 1.5, torch.compile 2.5 ms.
    assert rows[("layer_norm", "numpy", "alloc")].vs_peer == pytest.approx(1.5 / 4)
    assert rows[("layer_norm", "numpy", "out")].vs_peer == pytest.approx(1.5 / 2)
    # A peer is compared with the fastest of the others, never with itself.
    assert rows[("layer_norm", "ort_iobinding", "out")].vs_peer == pytest.approx(2.5 / 1.5)
    assert rows[("layer_norm", "ort_iobinding", "out")].of_copy == pytest.approx(1 / 1.5)
    assert rows[("layer_norm", "ort_iobinding", "out")].label == "ORT io_binding"
    assert rows[("rms_norm", "numpy", "alloc")].vs_peer == pytest.approx(4.0)  # torch alone
    assert rows[("layer_norm", "numpy", "alloc")].default
    by_title = {t.title: t for t in tables.report_tables(run)}
    summary = by_title["LayerNorm forward: key ratios (geometric means)"]
    assert "× best peer" in summary.headers and "× best peer (small)" in summary.headers
    labels = [line[0] for line in summary.body]
    assert {"ORT session.run", "ORT io_binding", "torch.compile"} <= set(labels)
    assert "× best peer" not in by_title["RMSNorm forward: key ratios (geometric means)"].headers
    detail = by_title["LayerNorm forward, float32: every backend call"]
    assert any(line[1] == "numpy (default)" for line in detail.body)
    page = docs_page([("full.json", run)], {})
    assert "predate the peers" not in page and "45-minute budget" in page
    assert "predate the peers" in docs_page([("old.json", _run())], {})


def test_the_stated_budget_is_the_full_matrix_default() -> None:
    from benchmarks import conftest

    assert conftest.SETTINGS["full"]["budget_minutes"] == FULL_BUDGET_MINUTES


def test_time_per_call_is_drawn_against_rows_with_the_peers(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks import plots

    run = _run_with_peers()
    first = [b for b in run["benchmarks"] if b["extra_info"]["shape"] == SHAPES[0]]
    for rows in (1, 2, 8, 64):  # a sweep at hidden 768: copies of the 1024x1024 calls
        for bench in first:
            copy = json.loads(json.dumps(bench))
            copy["extra_info"]["shape"] = [rows, 768]
            run["benchmarks"].append(copy)
    drawn = plots.render(metrics.rows(run), tmp_path, "peers", runs.OP_TITLES)
    names = [p.name for p in drawn["layer_norm"]]
    assert "peers-layer_norm-float32-rows.png" in names
    assert not any(n.endswith("-rows.png") for n in names if "rms_norm" in n)
    # Without the default flag there is no normlab line to draw: no time-per-call figure.
    plain = plots.render(metrics.rows(_run()), tmp_path, "plain", runs.OP_TITLES)
    assert not any(p.name.endswith("-rows.png") for ps in plain.values() for p in ps)


def test_the_quick_matrix_has_no_peers_and_the_full_one_skips_them_with_a_reason() -> None:
    from benchmarks import bench_matrix

    quick = [p.id for p in bench_matrix.matrix_params("quick")]
    assert not any("ref-ort" in i or "ref-torch_compile" in i for i in quick)
    full = {p.id: p for p in bench_matrix.matrix_params("full")}
    for name in ("ort", "ort_iobinding", "torch_compile"):
        param = full[f"float32-64x768-layer_norm-ref-{name}"]
        for mark in param.marks:  # skipped only with a reason
            assert mark.name == "skip" and mark.kwargs["reason"].startswith(f"peer {name}: ")
    assert "float32-64x1000-layer_norm-ref-torch_compile" not in full  # not in the subset
    assert "float16-2x1024-rms_norm-ref-ort" in full  # the sweep
    assert "float64-2x1024-rms_norm-ref-ort" not in full
    assert not any("backward-ref-ort" in i for i in full)
    # The fused ops: torch.compile of the unfused pair on every fused shape, and no ORT (their
    # rows run on torch tensors with numba: without those, one skip says why).
    if "fused" in full:
        assert full["fused"].marks[0].kwargs["reason"].startswith("the fused ops' rows ")
        return
    assert "float32-1x768-add_layer_norm-ref-torch_compile" in full
    assert "float16-16384x768-add_rms_norm-ref-torch_compile" in full
    assert not any("add_" in i and "ref-ort" in i for i in full)
    assert "float32-1024x4096-add_layer_norm-numba-post" in quick


def _peer_result(result: Any, dtype: str) -> Any:
    """A peer's output as a float64 NumPy array (bfloat16 OrtValues through their memory)."""
    import ctypes

    import numpy as np

    from normlab.testing.conversions import numpy_dtype

    first = result[0] if isinstance(result, list) else result
    if hasattr(first, "data_ptr") and not isinstance(first, np.ndarray):  # an OrtValue
        if dtype != "bfloat16":
            return first.numpy().astype(np.float64)
        count = int(np.prod(first.shape()))
        bits = np.ctypeslib.as_array((ctypes.c_uint16 * count).from_address(first.data_ptr()))
        return bits.copy().view(numpy_dtype(dtype)).reshape(first.shape()).astype(np.float64)
    if hasattr(first, "detach"):  # a torch tensor
        return first.detach().float().numpy().astype(np.float64)
    return np.asarray(first).astype(np.float64)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_each_peer_computes_the_op_on_a_tiny_input(op: str, dtype: str) -> None:
    """Each peer's call (as the matrix times it) equals normlab's result; nothing is timed."""
    pytest.importorskip("onnxruntime", reason="the peers need onnxruntime (nox -s bench)")
    pytest.importorskip("ml_dtypes")
    import numpy as np

    import normlab
    from benchmarks import peers, workloads

    data = workloads.Workload((5, 64), dtype)
    eps = workloads.EPS  # what every peer is given (normlab's rms_norm defaults to another)
    if op == "layer_norm":
        expected = normlab.layer_norm(
            data.x, weight=data.weight, bias=data.bias, eps=eps, backend="numpy"
        )
    else:
        expected = normlab.rms_norm(data.x, weight=data.weight, eps=eps, backend="numpy")
    tolerance = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 6e-2, "float64": 1e-12}[dtype]
    ran = []
    for name in peers.PEERS[op]:
        if peers.unavailable(op, name, dtype) is not None:
            continue
        call = peers.call(op, name, data)
        got = _peer_result(call(), dtype)
        np.testing.assert_allclose(got, expected.astype(np.float64), atol=tolerance, rtol=0)
        ran.append(name)
    assert {"ort", "ort_iobinding"} <= set(ran)  # ORT has both ops on all four dtypes
    if dtype in peers.COMPILE_DTYPES:
        assert "torch_compile" in ran
    assert peers.onnx_op(op, dtype) in (
        "LayerNormalization",
        "RMSNormalization",
        "SimplifiedLayerNormalization",
    )


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("op", ["add_layer_norm", "add_rms_norm"])
def test_each_fused_contender_computes_the_op(op: str, dtype: str) -> None:
    """Each fused-op call the matrix times returns normlab's ``y`` (and ``h``, but for the
    post-norm form) of the very same input; nothing is timed. torch.compile of the pair (a
    compile per case) is checked where the full matrix's peers are installed."""
    torch = pytest.importorskip("torch")
    import numpy as np

    import normlab

    numba = normlab.registry.get("numba")
    if not numba.available:
        pytest.skip(f"the fused rows need numba: {numba.reason}")
    from benchmarks import peers, workloads

    data = workloads.Workload((5, 64), dtype)
    h_want = torch.from_numpy(data.x) + torch.from_numpy(data.residual)
    weight, bias = torch.from_numpy(data.weight), torch.from_numpy(data.bias)
    if op == "add_layer_norm":
        y_want = normlab.layer_norm(h_want, None, weight, bias, workloads.EPS, backend="torch")
    else:
        y_want = normlab.rms_norm(h_want, None, weight, workloads.EPS, backend="torch")
    tolerance = {"float32": 1e-5, "float16": 1e-2}[dtype]
    calls = [(subject, "alloc") for subject in ("add_numba", "torch", "numba", "auto-torch")]
    calls.append(("numba", "post"))
    for subject, mode in calls:
        result = workloads.fused_call(op, subject, mode, data)()
        y, h = (result, None) if mode == "post" else result
        np.testing.assert_allclose(y.float().numpy(), y_want.float().numpy(), atol=tolerance)
        if h is not None:
            assert torch.equal(h, h_want), subject
    if importlib.util.find_spec("onnxruntime") is None:
        return  # the full matrix's environment (nox -s bench) checks torch.compile too
    y, h = peers.call(op, "torch_compile", data)()
    np.testing.assert_allclose(y.float().numpy(), y_want.float().numpy(), atol=tolerance)
    assert torch.equal(h, h_want)


def test_a_tiny_full_matrix_run_has_the_peers(tmp_path: Path) -> None:
    """The real full matrix on one tiny input, the peers and the copy: rows and ratios appear."""
    pytest.importorskip("pytest_benchmark")
    pytest.importorskip("onnxruntime", reason="the peers need onnxruntime (nox -s bench)")
    run = _tiny_matrix_run(
        tmp_path / "peers.json",
        "full",
        0.5,
        "test_matrix and float32-1x768- and (ref or numpy-alloc)",
    )
    rows = metrics.rows(run)
    subjects = {(r.op, r.subject) for r in rows if r.kind == "reference"}
    for op in ("layer_norm", "rms_norm"):
        assert {(op, "ort"), (op, "ort_iobinding"), (op, "torch_compile")} <= subjects
    ort = [b["extra_info"] for b in run["benchmarks"] if b["extra_info"]["subject"] == "ort"]
    onnx_ops = {i["op"]: i["onnx_op"] for i in ort}
    assert onnx_ops["layer_norm"] == "LayerNormalization"
    assert onnx_ops["rms_norm"] in ("RMSNormalization", "SimplifiedLayerNormalization")
    numpy = [r for r in rows if r.subject == "numpy" and r.op in ("layer_norm", "rms_norm")]
    assert numpy and all(r.vs_peer is not None for r in numpy)
    assert all(
        isinstance(b["extra_info"].get("default"), bool)
        for b in run["benchmarks"]
        if b["extra_info"]["kind"] in ("layer_norm", "rms_norm")
    )
