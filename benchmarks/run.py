"""Run the benchmark matrix, save it and report it; or report, or compare, saved runs.

    python benchmarks/run.py --quick                  # a few shapes, float32 + float16 (CI)
    python benchmarks/run.py --full                   # the whole matrix, then the docs page
    python benchmarks/run.py --report FILE.json       # the report again from a saved run
    python benchmarks/run.py --report A.json B.json --write-docs  # the page from two runs
    python benchmarks/run.py --compare A.json B.json  # two saved runs side by side

A run is saved as ``benchmarks/results/<machine>-<date>[-quick].json`` (pytest-benchmark JSON),
its plots beside it. A full run, or any run given ``--write-docs``, also regenerates
``docs/performance.md`` and its images under ``docs/images/``; given several runs, each op's
section of the page comes from the first run that measured it. Arguments this script does not
know go to pytest (``-k float32``, ``-x``). The exit status is pytest's: non-zero when a
benchmark errors, never because of a time.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Final

from rich.console import Console

if __name__ == "__main__":  # run as a script: the path has benchmarks/, not the root holding it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report.metrics import REGRESSION_FLOOR
from benchmarks.report.page import docs_page, sections
from benchmarks.report.runs import OP_TITLES, calls, load
from benchmarks.report.terminal import print_compare, print_report

ROOT: Final = Path(__file__).resolve().parents[1]
RESULTS: Final = ROOT / "benchmarks" / "results"
DOCS: Final = ROOT / "docs"
DOCS_IMAGES: Final = DOCS / "images"
DOCS_STEM: Final = "performance"


def machine_name() -> str:
    """This machine's name, safe in a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", socket.gethostname()).strip("-.") or "machine"


def run_matrix(matrix: str, path: Path, budget: float | None, extra: list[str]) -> int:
    """Run pytest-benchmark over the matrix, saving to ``path``; returns pytest's status."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "benchmarks/bench_matrix.py",
        "-v",
        "-p",
        "no:cacheprovider",
        f"--benchmark-json={path}",
        "--benchmark-quiet",
        "--benchmark-disable-gc",
        f"--normlab-matrix={matrix}",
    ]
    if budget is not None:
        command.append(f"--normlab-budget-minutes={budget}")
    path.parent.mkdir(parents=True, exist_ok=True)
    status = subprocess.call([*command, *extra], cwd=ROOT)
    if path.exists():  # pytest-benchmark indents by four; one level keeps the file small
        path.write_text(json.dumps(load(path), indent=1) + "\n")
    return status


def publish(paths: list[Path], console: Console, docs: bool) -> None:
    """Print the report of each run saved at ``paths`` and draw its plots; maybe the docs page.

    The page takes each op's section, and its plots, from the first run that measured the op.
    """
    from benchmarks import plots

    runs = [load(path) for path in paths]
    drawn = []
    for path, run in zip(paths, runs, strict=True):
        print_report(run, console)
        drawn.append(plots.render(calls(run), path.parent, path.stem, OP_TITLES))
        for png in (png for pngs in drawn[-1].values() for png in pngs):
            console.print(f"plot: {png}")
    if not docs:
        return
    DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
    for old in DOCS_IMAGES.glob(f"{DOCS_STEM}-*.png"):
        old.unlink()
    images: dict[str, list[str]] = {}
    for op, i in sections(runs).items():
        for png in drawn[i].get(op, []):
            target = DOCS_IMAGES / png.name.replace(paths[i].stem, DOCS_STEM, 1)
            shutil.copyfile(png, target)
            images.setdefault(op, []).append(target.relative_to(DOCS).as_posix())
    sources = []
    for path in paths:
        source = path.resolve()
        sources.append(
            source.relative_to(ROOT).as_posix() if source.is_relative_to(ROOT) else str(path)
        )
    page = DOCS / "performance.md"
    page.write_text(docs_page(list(zip(sources, runs, strict=True)), images))
    count = sum(len(v) for v in images.values())
    console.print(f"docs: {page} ({count} images)")


def _is_full(run: dict[str, Any]) -> bool:
    return bool(run.get("normlab", {}).get("matrix") == "full")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Other arguments are passed to pytest.",
    )
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--quick", action="store_true", help="a small subset (about 2 minutes)")
    what.add_argument("--full", action="store_true", help="the whole matrix (about 45 minutes)")
    what.add_argument(
        "--report",
        nargs="+",
        metavar="FILE.json",
        help="report saved runs (the docs page takes each op from the first that measured it)",
    )
    what.add_argument(
        "--compare",
        nargs=2,
        metavar=("A.json", "B.json"),
        help="compare two saved runs (B against A)",
    )
    parser.add_argument(
        "--budget-minutes",
        type=float,
        default=None,
        help="time budget of the run (default: 2 quick, 45 full)",
    )
    parser.add_argument(
        "--machine",
        default=machine_name(),
        help="machine name in the saved file's name (default: host name)",
    )
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help="also regenerate docs/performance.md (always for a full run)",
    )
    parser.add_argument(
        "--threshold",
        type=float,
        default=REGRESSION_FLOOR,
        help="least relative change that --compare flags (default: %(default)s)",
    )
    args, extra = parser.parse_known_args(argv)
    console = Console(width=shutil.get_terminal_size((160, 40)).columns)
    if args.compare:
        before, after = (load(p) for p in args.compare)
        print_compare(before, after, console, args.threshold)
        return 0
    if args.report:
        paths = [Path(p) for p in args.report]
        publish(paths, console, docs=args.write_docs or _is_full(load(paths[0])))
        return 0
    matrix = "quick" if args.quick else "full"
    stamp = time.strftime("%Y-%m-%d-%H%M")
    path = RESULTS / f"{args.machine}-{stamp}{'-quick' if args.quick else ''}.json"
    started = time.perf_counter()
    status = run_matrix(matrix, path, args.budget_minutes, extra)
    console.print(
        f"{matrix} matrix: {(time.perf_counter() - started) / 60:.1f} min, "
        f"pytest exit status {status}"
    )
    if not path.exists():
        console.print(f"[red]no results saved at {path}[/red]")
        return status or 1
    console.print(f"results: {path}")
    publish([path], console, docs=args.full or args.write_docs)
    return status


if __name__ == "__main__":
    sys.exit(main())
