"""A saved benchmark run turned into ratios, tables, a comparison and the performance page.

A run is the JSON that ``bench_matrix.py`` saves through pytest-benchmark, with the ``normlab``
section that ``conftest.py`` adds. Nothing here imports normlab or times anything, so a saved
run can be reported on any machine.

Every time is the best round (pytest-benchmark's ``min``): on a shared machine noise only adds
time. Each call is compared with the reference points measured beside it on the same input:
the copy matched to the call (``x.copy()`` for allocating calls, ``np.copyto`` for ``out=``),
``torch.nn.functional.layer_norm`` and the textbook NumPy formula. GB/s counts the bytes of
``x`` and ``y``.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from rich.console import Console
from rich.table import Table as RichTable

__all__ = [
    "Change",
    "Dispatch",
    "Row",
    "Summary",
    "Table",
    "compare",
    "compare_table",
    "dispatch",
    "docs_page",
    "load",
    "print_compare",
    "print_report",
    "report_tables",
    "rows",
    "summary",
]

#: Inputs at least this large are bandwidth-bound (beyond a core's cache) ...
LARGE_BYTES: Final = 8 * 2**20
#: ... and below this, latency-bound.
SMALL_BYTES: Final = 2**20
DISPATCH_TARGET_US: Final = 1.5
#: Least relative change of the fraction of the copy limit that compare() flags.
REGRESSION_FLOOR: Final = 0.10
REFERENCE_LABELS: Final = {
    "torch": "torch F.layer_norm",
    "textbook": "textbook NumPy",
    "copy": "x.copy()",
    "copyto": "np.copyto",
}
_COPY_FOR_MODE: Final = {"alloc": "copy", "out": "copyto"}


@dataclass(frozen=True, slots=True)
class Row:
    """One timed call with its ratios to the references beside it (``None``: not measured)."""

    kind: str
    subject: str
    mode: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    seconds: float
    of_copy: float | None
    vs_torch: float | None
    vs_textbook: float | None

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def label(self) -> str:
        if self.kind == "reference":
            return REFERENCE_LABELS.get(self.subject, self.subject)
        return self.subject + (" out=" if self.mode == "out" else "")

    @property
    def key(self) -> tuple[str, str, str, tuple[int, ...], str]:
        return self.kind, self.subject, self.mode, self.shape, self.dtype


@dataclass(frozen=True, slots=True)
class Summary:
    """Geometric means of one call's ratios over the large (and small) inputs of one dtype."""

    label: str
    dtype: str
    gbps: float | None
    of_copy: float | None
    vs_torch: float | None
    vs_textbook: float | None
    small_vs_torch: float | None


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Per-call time of ``normlab.layer_norm`` and of the backend called directly."""

    backend: str
    through_normlab: float
    direct: float

    @property
    def overhead_us(self) -> float:
        return (self.through_normlab - self.direct) * 1e6


@dataclass(frozen=True, slots=True)
class Change:
    """One call (label and dtype) in two runs: how its fraction of the copy limit moved.

    ``change`` is the geometric mean over the shapes measured in both runs; ``threshold`` the
    run-to-run spread it must exceed to count (see :func:`compare`).
    """

    label: str
    dtype: str
    shapes: int
    gbps: tuple[float, float]
    of_copy: tuple[float, float]
    change: float
    threshold: float
    reference: bool

    @property
    def verdict(self) -> str:
        if self.reference:
            return "reference"
        if self.change < -self.threshold:
            return "slower"
        return "faster" if self.change > self.threshold else ""


@dataclass(frozen=True, slots=True)
class Table:
    """A table in no particular format: rendered for the terminal and for Markdown."""

    title: str
    headers: tuple[str, ...]
    body: list[tuple[str, ...]]
    note: str = ""
    alerts: frozenset[int] = frozenset()  # rows to highlight (by index)


# --------------------------------------------------------------------------------------------
# From JSON to rows


def load(path: str | Path) -> dict[str, Any]:
    """A saved run."""
    return json.loads(Path(path).read_text())  # type: ignore[no-any-return]


def _ratio(
    refs: dict[tuple[tuple[int, ...], str, str], dict[str, Any]],
    shape: tuple[int, ...],
    dtype: str,
    name: str,
    seconds: float,
    own: str | None,
) -> float | None:
    """How many times faster than reference ``name`` (``None``: not measured, or itself)."""
    ref = refs.get((shape, dtype, name))
    if ref is None or name == own:
        return None
    return float(ref["min"]) / seconds


def rows(run: dict[str, Any]) -> list[Row]:
    """Every matrix call of ``run``, with its ratios, in the order measured."""
    timed = [
        b for b in run["benchmarks"] if b["extra_info"].get("kind") in ("layer_norm", "reference")
    ]
    refs: dict[tuple[tuple[int, ...], str, str], dict[str, Any]] = {}
    for bench in timed:
        info = bench["extra_info"]
        if info["kind"] == "reference":
            refs[(tuple(info["shape"]), info["dtype"], info["subject"])] = bench["stats"]
    result = []
    for bench in timed:
        info, stats = bench["extra_info"], bench["stats"]
        shape, dtype, seconds = tuple(info["shape"]), info["dtype"], stats["min"]
        own = info["subject"] if info["kind"] == "reference" else None
        copy_name = _COPY_FOR_MODE[info["mode"]]
        result.append(
            Row(
                kind=info["kind"],
                subject=info["subject"],
                mode=info["mode"],
                shape=shape,
                dtype=dtype,
                nbytes=int(info["bytes"]),
                seconds=seconds,
                of_copy=_ratio(refs, shape, dtype, copy_name, seconds, own),
                vs_torch=_ratio(refs, shape, dtype, "torch", seconds, own),
                vs_textbook=_ratio(refs, shape, dtype, "textbook", seconds, own),
            )
        )
    return result


def _geomean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None and v > 0]
    if not present:
        return None
    return math.exp(sum(math.log(v) for v in present) / len(present))


def summary(all_rows: Sequence[Row]) -> list[Summary]:
    """Per call and dtype: geometric means over large inputs, and × torch over small ones."""
    groups: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for row in all_rows:
        if row.kind == "layer_norm" or row.subject in ("torch", "textbook"):
            groups[(row.label, row.dtype)].append(row)
    result = []
    for (label, dtype), group in groups.items():
        large = [r for r in group if r.nbytes // 2 >= LARGE_BYTES]
        small = [r for r in group if r.nbytes // 2 < SMALL_BYTES]
        result.append(
            Summary(
                label=label,
                dtype=dtype,
                gbps=_geomean(r.gbps for r in large),
                of_copy=_geomean(r.of_copy for r in large),
                vs_torch=_geomean(r.vs_torch for r in large),
                vs_textbook=_geomean(r.vs_textbook for r in large),
                small_vs_torch=_geomean(r.vs_torch for r in small),
            )
        )
    return result


def dispatch(run: dict[str, Any]) -> list[Dispatch]:
    """The dispatch-overhead pairs of ``run``, one per backend."""
    times: dict[str, dict[str, float]] = defaultdict(dict)
    for bench in run["benchmarks"]:
        info = bench["extra_info"]
        if info.get("kind") == "dispatch":
            times[info["subject"]][info["mode"]] = bench["stats"]["min"]
    return [
        Dispatch(name, t["normlab"], t["direct"])
        for name, t in times.items()
        if "normlab" in t and "direct" in t
    ]


def compare(
    before: dict[str, Any], after: dict[str, Any], floor: float = REGRESSION_FLOOR
) -> list[Change]:
    """Each call of both runs, judged on its fraction of the copy limit over its shapes.

    That fraction is taken side by side within each run, so it carries across machines and
    load better than a time. A call's change is the geometric mean over its shapes. It counts
    when it exceeds the run-to-run spread: two standard errors of that mean (how much the
    shapes scatter), plus the drift of the references of the same dtype (the torch peer and the
    textbook formula are the same code in both runs, so their drift is the machine's), and at
    least ``floor``.
    """
    old = {r.key: r for r in rows(before)}
    pairs: dict[tuple[str, str], list[tuple[Row, Row]]] = defaultdict(list)
    logs: dict[tuple[str, str], list[float]] = defaultdict(list)
    for row in rows(after):
        prior = old.get(row.key)
        if prior is not None and row.of_copy is not None and prior.of_copy is not None:
            pairs[(row.label, row.dtype)].append((prior, row))
            logs[(row.label, row.dtype)].append(math.log(row.of_copy / prior.of_copy))
    drift: dict[str, float] = defaultdict(float)
    for (label, dtype), values in logs.items():
        if pairs[(label, dtype)][0][1].kind == "reference":
            drift[dtype] = max(drift[dtype], abs(statistics.fmean(values)))
    changes = []
    for (label, dtype), group in pairs.items():
        values = logs[(label, dtype)]
        error = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
        threshold = max(math.log1p(floor), 2 * error + drift[dtype])
        changes.append(
            Change(
                label=label,
                dtype=dtype,
                shapes=len(group),
                gbps=(_mean(a.gbps for a, _ in group), _mean(b.gbps for _, b in group)),
                of_copy=(_mean(a.of_copy for a, _ in group), _mean(b.of_copy for _, b in group)),
                change=math.expm1(statistics.fmean(values)),
                threshold=math.expm1(threshold),
                reference=group[0][1].kind == "reference",
            )
        )
    return changes


def _mean(values: Iterable[float | None]) -> float:
    return _geomean(values) or math.nan


# --------------------------------------------------------------------------------------------
# Tables


def _shape(shape: Sequence[int]) -> str:
    return "×".join(map(str, shape))


def _time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def _gbps(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.0f}%"


def _times(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}×"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def summary_table(all_rows: Sequence[Row]) -> Table:
    body = [
        (
            s.label,
            s.dtype,
            _gbps(s.gbps),
            _pct(s.of_copy),
            _times(s.vs_torch),
            _times(s.vs_textbook),
            _times(s.small_vs_torch),
        )
        for s in summary(all_rows)
    ]
    return Table(
        "Key ratios (geometric means)",
        ("call", "dtype", "GB/s", "% of copy", "× torch", "× textbook", "× torch (small)"),
        body,
        f"Large inputs: x ≥ {LARGE_BYTES // 2**20} MiB; small: x < {SMALL_BYTES // 2**20} MiB. "
        "× torch and × textbook are speed-ups (above 1: faster than the reference).",
    )


def detail_table(all_rows: Sequence[Row], dtype: str) -> Table:
    body = [
        (
            _shape(r.shape),
            r.label,
            _time(r.seconds),
            _gbps(r.gbps),
            _pct(r.of_copy),
            _times(r.vs_torch),
            _times(r.vs_textbook),
        )
        for r in all_rows
        if r.dtype == dtype and r.kind == "layer_norm"
    ]
    return Table(
        f"{dtype}: every backend call",
        ("shape", "call", "time", "GB/s", "% of copy", "× torch", "× textbook"),
        body,
    )


def dispatch_table(run: dict[str, Any]) -> Table:
    pairs = dispatch(run)
    body = [
        (
            d.backend,
            f"{d.through_normlab * 1e6:.2f}",
            f"{d.direct * 1e6:.2f}",
            f"{d.overhead_us:.2f}",
            "yes" if d.overhead_us < DISPATCH_TARGET_US else "no",
        )
        for d in pairs
    ]
    return Table(
        "Dispatch overhead on a tiny array (µs per call)",
        (
            "backend",
            "normlab.layer_norm",
            "backend directly",
            "overhead",
            f"< {DISPATCH_TARGET_US} µs",
        ),
        body,
        "normlab.layer_norm(x, weight=w, bias=b, backend=name) against the backend's "
        "layer_norm(x, w, b, plan=plan, out=None) with a ready plan; best rounds. Where one call "
        "takes milliseconds (JAX, Dask) the difference is within the noise.",
        frozenset(i for i, d in enumerate(pairs) if d.overhead_us >= DISPATCH_TARGET_US),
    )


def memory_table(run: dict[str, Any]) -> Table:
    body = []
    for m in run.get("normlab", {}).get("memory", []):
        label = m["subject"] if m["kind"] == "backend" else REFERENCE_LABELS[m["subject"]]
        body.append(
            (
                label,
                m["dtype"],
                _shape(m["shape"]),
                _mib(m["input_bytes"]),
                _mib(m["rss_extra_bytes"]),
                f"{m['rss_extra_bytes'] / m['input_bytes']:.2f}",
                _mib(m["numpy_peak_bytes"]),
                m["method"],
            )
        )
    return Table(
        "Peak memory of one allocating call",
        (
            "call",
            "dtype",
            "shape",
            "input MiB",
            "peak extra MiB",
            "× input",
            "NumPy peak MiB",
            "method",
        ),
        body,
        "Peak extra: resident-set high-water mark during the call above the resident set "
        "before it (the output alone is 1.00× the input; the textbook formula returns float32 "
        "for half inputs, 2.00×). NumPy peak: tracemalloc.",
    )


def skipped_table(run: dict[str, Any]) -> Table:
    counts: dict[str, int] = defaultdict(int)
    for skip in run.get("normlab", {}).get("skipped", []):
        counts[skip["reason"]] += 1
    return Table(
        "Not measured", ("reason", "cases"), [(reason, str(n)) for reason, n in counts.items()]
    )


def report_tables(run: dict[str, Any]) -> list[Table]:
    """Every table of the report, in order."""
    all_rows = rows(run)
    dtypes = list(dict.fromkeys(r.dtype for r in all_rows))
    tables = [summary_table(all_rows), dispatch_table(run), memory_table(run)]
    tables += [detail_table(all_rows, d) for d in dtypes]
    tables.append(skipped_table(run))
    return [t for t in tables if t.body]


def compare_table(changes: Sequence[Change]) -> Table:
    body = [
        (
            c.label,
            c.dtype,
            str(c.shapes),
            _gbps(c.gbps[0]),
            _gbps(c.gbps[1]),
            _pct(c.of_copy[0]),
            _pct(c.of_copy[1]),
            f"{100 * c.change:+.0f}%",
            f"±{100 * c.threshold:.0f}%",
            c.verdict,
        )
        for c in changes
    ]
    return Table(
        "B against A, on the fraction of the copy limit (geometric means over shapes)",
        (
            "call",
            "dtype",
            "shapes",
            "GB/s A",
            "GB/s B",
            "% of copy A",
            "% of copy B",
            "change",
            "spread",
            "verdict",
        ),
        body,
        "spread: two standard errors of the mean change, plus the drift of the references of "
        "the same dtype, and at least the floor",
        frozenset(i for i, c in enumerate(changes) if c.verdict == "slower"),
    )


def to_rich(table: Table) -> RichTable:
    rich = RichTable(title=table.title, caption=table.note or None, title_justify="left")
    for i, header in enumerate(table.headers):
        rich.add_column(header, justify="left" if i < 2 else "right")
    for i, line in enumerate(table.body):
        rich.add_row(*line, style="red" if i in table.alerts else None)
    return rich


def to_markdown(table: Table, level: int = 3) -> str:
    """``table`` in Markdown, under a heading of ``level`` (0: no heading)."""
    lines = [f"{'#' * level} {table.title}", ""] if level else []
    if table.note:
        lines += [table.note, ""]
    lines.append("| " + " | ".join(table.headers) + " |")
    lines.append("|" + "|".join("---" if i < 2 else "--:" for i in range(len(table.headers))) + "|")
    lines += [
        "| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |" for line in table.body
    ]
    return "\n".join(lines) + "\n"


def print_report(run: dict[str, Any], console: Console) -> None:
    """The report tables, on the terminal."""
    console.print(" · ".join(f"{k}: {v}" for k, v in machine(run)))
    for table in report_tables(run):
        console.print(to_rich(table))


def print_compare(
    before: dict[str, Any], after: dict[str, Any], console: Console, floor: float = REGRESSION_FLOOR
) -> list[Change]:
    """The comparison of two runs, on the terminal; returns the changes."""
    changes = compare(before, after, floor)
    console.print(to_rich(compare_table(changes)))
    old = {d.backend: d for d in dispatch(before)}
    for d in dispatch(after):
        if d.backend in old:
            console.print(
                f"dispatch overhead, {d.backend}: {old[d.backend].overhead_us:.2f} µs "
                f"-> {d.overhead_us:.2f} µs"
            )
    slower = sum(c.verdict == "slower" for c in changes)
    faster = sum(c.verdict == "faster" for c in changes)
    console.print(
        f"{len(changes)} calls (backend or reference, per dtype) in both runs: {slower} slower, "
        f"{faster} faster beyond the spread"
    )
    return changes


# --------------------------------------------------------------------------------------------
# The performance page


def machine(run: dict[str, Any]) -> list[tuple[str, str]]:
    """The machine and software of ``run``, as (what, value) pairs."""
    info = run["machine_info"]
    cpu = info.get("cpu", {})
    libraries = info.get("libraries", {})
    commit = run.get("commit_info", {})
    dirty = " (uncommitted changes)" if commit.get("dirty") else ""
    settings = run.get("normlab", {})
    minutes = f"{settings.get('elapsed_s', 0) / 60:.1f} of {settings.get('budget_s', 0) / 60:.0f}"
    return [
        (
            "CPU",
            f"{cpu.get('brand_raw', info.get('processor') or '?')} "
            f"({info.get('cpu_count', cpu.get('count', '?'))} cores, "
            f"L2 {_mib(cpu.get('l2_cache_size', 0))} MiB, "
            f"L3 {_mib(cpu.get('l3_cache_size', 0))} MiB)",
        ),
        ("memory", f"{info.get('memory_bytes', 0) / 2**30:.0f} GiB"),
        ("system", " ".join(str(info.get(k, "")) for k in ("system", "release", "machine"))),
        ("Python", info.get("python_version", "?")),
        ("libraries", ", ".join(f"{k} {v}" for k, v in libraries.items() if v)),
        ("torch threads", str(info.get("torch_threads"))),
        (
            "normlab",
            f"{info.get('normlab', {}).get('version', '?')} at {commit.get('id', '?')[:10]}{dirty}",
        ),
        (
            "run",
            f"{settings.get('matrix', '?')} matrix on {run.get('datetime', '?')[:16]}, "
            f"{minutes} min budget",
        ),
    ]


def docs_page(run: dict[str, Any], source: str, images: Sequence[str]) -> str:
    """``docs/performance.md`` for ``run`` (saved as ``source``; ``images`` relative to docs/)."""
    parts = [
        "# Performance",
        "",
        f"<!-- Generated by `python benchmarks/run.py --report {source} --write-docs`: "
        "do not edit by hand. -->",
        "",
        "LayerNorm forward is memory-bound: it reads `x` once and writes `y` once. The limit is "
        "a copy of the same bytes on the same machine, measured in the same run, so every "
        "number below is a ratio taken side by side: against that copy (`x.copy()` for "
        "allocating calls, `np.copyto` for `out=`), against `torch.nn.functional.layer_norm` "
        "(the peer, on all cores) and against the textbook NumPy formula "
        "`(x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * w + b` "
        "(single-threaded, like the copy). GB/s counts the bytes of `x` and `y`. Each time is "
        "the best of its rounds: on a shared machine, noise only adds time. The copy is one "
        "NumPy thread, so a parallel kernel can pass 100%.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in machine(run)],
        "",
    ]
    all_rows = rows(run)
    parts.append(to_markdown(summary_table(all_rows), 2))
    if images:
        parts += ["## GB/s against hidden size", ""]
        parts += [f"![{Path(i).stem}]({i})" for i in images]
        parts.append("")
    parts += [to_markdown(dispatch_table(run), 2), to_markdown(memory_table(run), 2)]
    parts += ["## Every backend call", ""]
    for dtype in dict.fromkeys(r.dtype for r in all_rows):
        table = to_markdown(detail_table(all_rows, dtype), 0)
        parts += [f'??? note "{dtype}"', ""]
        parts += [f"    {line}" if line else "" for line in table.splitlines()]
        parts.append("")
    parts.append(to_markdown(skipped_table(run), 2))
    parts += [
        "## Reproduce",
        "",
        "```sh",
        "nox -s bench                 # the full matrix (about 20 minutes), then this page",
        "nox -s bench-quick           # a small subset, in CI",
        "python benchmarks/run.py --full --budget-minutes 30",
        f"python benchmarks/run.py --report {source} --write-docs   # this page again",
        "python benchmarks/run.py --compare A.json B.json            # two runs side by side",
        "```",
        "",
        "`--compare` judges each call per dtype on its fraction of the copy limit, averaged "
        "over the shapes of both runs, and flags a change beyond the run-to-run spread: two "
        "standard errors of that mean plus the drift of the unchanged references.",
        "",
        f"The numbers come from `{source}`; plots and this page are generated from it.",
        "",
    ]
    return "\n".join(parts)
