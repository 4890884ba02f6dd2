"""The tables of a saved run's report and of a comparison, and the machine a run ran on.

Each table is a :class:`Table` in no particular format, rendered for the terminal
(``terminal.py``) and in Markdown (:func:`to_markdown`, for the performance page).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from benchmarks.report.metrics import (
    AUTO,
    AUTO_TOLERANCE,
    FUSED_TARGETS,
    LARGE_BYTES,
    SMALL_BYTES,
    Change,
    PeerGap,
    Row,
    dispatch,
    geomean,
    options,
    peer_gaps,
    quantized,
    rows,
    size_class,
    summary,
)
from benchmarks.report.runs import FUSED, MODE_LABELS, OP_TITLES, PEERS, ops, reference_label

__all__ = [
    "OP_NOTES",
    "Table",
    "auto_table",
    "compare_table",
    "detail_table",
    "dispatch_table",
    "fused_table",
    "key_table",
    "machine",
    "memory_table",
    "option_table",
    "peer_gap_table",
    "peer_summary_table",
    "quantized_table",
    "report_tables",
    "skipped_table",
    "summary_table",
    "to_markdown",
]

DISPATCH_TARGET_US: Final = 1.5
#: What each op is measured against, for the notes under its tables.
OP_NOTES: Final = {
    "layer_norm": "`normlab.layer_norm(x, weight=w, bias=b)` against "
    "`torch.nn.functional.layer_norm` and the textbook NumPy formula. GB/s counts the bytes of "
    "`x` and `y`.",
    "rms_norm": "`normlab.rms_norm(x, weight=w)` against `torch.nn.functional.rms_norm` (its "
    "weight in x's dtype, as `torch.nn.RMSNorm(dtype=...)` holds it). GB/s counts the bytes of "
    "`x` and `y`.",
    "layer_norm_backward": "The backward alone, for both sides: "
    "`normlab.layer_norm_backward(dy, x, mean, rstd, w)` from the statistics the forward "
    "returned, against `torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)` on a `y = "
    "F.layer_norm(x, ..., w, b)` computed beforehand (the forward is not timed). Both compute "
    "dx, dweight and dbias. GB/s counts `x` and `dy` read and `dx` written, plus the "
    "statistics (`mean`, `rstd`) and `weight` read and `dweight`, `dbias` written; % of copy "
    "is that GB/s over the GB/s of `x.copy()`.",
    "rms_norm_backward": "The backward alone, for both sides: "
    "`normlab.rms_norm_backward(dy, x, rstd, w)` from the statistics the forward returned, "
    "against `torch.autograd.grad(y, (x, w), dy, retain_graph=True)` on a `y = F.rms_norm(x, "
    "..., w)` computed beforehand (the forward is not timed). Both compute dx and dweight. "
    "GB/s counts `x` and `dy` read and `dx` written, plus `rstd` and `weight` read and "
    "`dweight` written; % of copy is that GB/s over the GB/s of `x.copy()`.",
    "add_layer_norm": "`normlab.add_layer_norm(x, r, weight=w, bias=b)` on CPU torch tensors: "
    "numba named, returning `(y, h)`, and its post-norm form (`return_residual=False`, `y` "
    "alone); auto-torch: no backend named. Against the unfused pairs on the same tensors, which "
    "return `(y, h)`: torch eager's `h = x + r` then `normlab.layer_norm(h, ..., "
    "backend='numba')` (× add+numba, the issue's targets), then `F.layer_norm(h, ...)` "
    "(× torch), and in the full matrix `torch.compile` of that torch pair. GB/s counts `x`, `r`, "
    "`h` and `y` (post-norm: `x`, `r`, `y`).",
    "add_rms_norm": "`normlab.add_rms_norm(x, r, weight=w)` on CPU torch tensors, as for "
    "LayerNorm: against torch eager's `h = x + r` then `normlab.rms_norm(h, ..., "
    "backend='numba')` (× add+numba), then `F.rms_norm(h, ...)` (its weight in x's dtype; "
    "× torch), and `torch.compile` of that pair in the full matrix. GB/s counts `x`, `r`, `h` "
    "and `y` (post-norm: `x`, `r`, `y`).",
}


@dataclass(frozen=True, slots=True)
class Table:
    """A table in no particular format: rendered for the terminal and for Markdown."""

    title: str
    headers: tuple[str, ...]
    body: Sequence[tuple[str, ...]]
    note: str = ""
    alerts: frozenset[int] = frozenset()  # rows to highlight (by index)


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


def _has_textbook(all_rows: Sequence[Row], op: str) -> bool:
    return any(r.op == op and r.kind == "reference" and r.subject == "textbook" for r in all_rows)


def _has_peers(all_rows: Sequence[Row], op: str) -> bool:
    """Whether ``op`` was measured beside a peer other than torch eager (a full matrix)."""
    return any(r.op == op and r.kind == "reference" and r.subject in PEERS[1:] for r in all_rows)


def key_table(all_rows: Sequence[Row], op: str) -> Table:
    """The key ratios of ``op``: :func:`fused_table` for a fused op, else
    :func:`summary_table`."""
    return fused_table(all_rows, op) if op in FUSED else summary_table(all_rows, op)


def summary_table(all_rows: Sequence[Row], op: str) -> Table:
    """Key ratios of ``op``: per call and dtype, geometric means over large and small inputs."""
    textbook = _has_textbook(all_rows, op)
    peers = _has_peers(all_rows, op)
    body = []
    for s in summary(all_rows):
        if s.op != op:
            continue
        line = [s.label, s.dtype, _gbps(s.gbps), _pct(s.of_copy), _times(s.vs_torch)]
        line += [_times(s.vs_textbook)] if textbook else []
        line += [_times(s.vs_peer)] if peers else []
        line += [_times(s.small_vs_torch)]
        line += [_times(s.small_vs_peer)] if peers else []
        body.append(tuple(line))
    headers: tuple[str, ...] = ("call", "dtype", "GB/s", "% of copy", "× torch")
    headers += ("× textbook",) if textbook else ()
    headers += ("× best peer",) if peers else ()
    headers += ("× torch (small)",) + (("× best peer (small)",) if peers else ())
    speedups = "× torch and × textbook are speed-ups" if textbook else "× torch is a speed-up"
    peer_note = (
        " × best peer: over the fastest other peer on the same input (torch eager, ORT "
        "session.run, ORT io_binding, torch.compile where measured)."
        if peers
        else ""
    )
    return Table(
        f"{OP_TITLES.get(op, op)}: key ratios (geometric means)",
        headers,
        body,
        f"{OP_NOTES.get(op, '')} Large inputs: x ≥ {LARGE_BYTES // 2**20} MiB; small: x < "
        f"{SMALL_BYTES // 2**20} MiB. {speedups} (above 1: faster than the reference)."
        f"{peer_note}".strip(),
    )


def fused_table(all_rows: Sequence[Row], op: str) -> Table:
    """A fused op's key ratios: per normlab call and dtype, geometric means over the large and
    the small inputs of the speed-up over the unfused pair on numba (the issue's targets,
    :data:`FUSED_TARGETS`), over torch eager's pair and over the best peer."""
    peers = _has_peers(all_rows, op)
    groups: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for r in all_rows:
        if r.op == op and r.kind != "reference":
            groups[(r.label, r.dtype)].append(r)
    body, alerts = [], set()
    for (label, dtype), group in groups.items():
        sized = {c: [r for r in group if size_class(r) == c] for c in FUSED_TARGETS}
        composed = {c: geomean(r.vs_composed for r in sized[c]) for c in FUSED_TARGETS}
        met = [
            composed[c] >= target for c, target in FUSED_TARGETS.items() if composed[c] is not None
        ]
        if met and not all(met) and not label.endswith(MODE_LABELS["post"]):
            alerts.add(len(body))
        line = [label, dtype, _gbps(geomean(r.gbps for r in sized["large"]))]
        line += [_times(composed["large"]), _times(composed["small"])]
        line += [_times(geomean(r.vs_torch for r in sized[c])) for c in FUSED_TARGETS]
        line += (
            [_times(geomean(r.vs_peer for r in sized[c])) for c in FUSED_TARGETS] if peers else []
        )
        line += ["—" if not met else "yes" if all(met) else "no"]
        body.append(tuple(line))
    large, small = (f"{FUSED_TARGETS[c]:g}×" for c in ("large", "small"))
    headers: tuple[str, ...] = (
        "call", "dtype", "GB/s", f"× add+numba (≥ {large})", f"× add+numba (small, ≥ {small})",
        "× torch", "× torch (small)",
    )  # fmt: skip
    headers += ("× best peer", "× best peer (small)") if peers else ()
    headers += ("targets met",)
    return Table(
        f"{OP_TITLES.get(op, op)}: key ratios (geometric means)",
        headers,
        body,
        f"{OP_NOTES.get(op, '')} Large inputs: x ≥ {LARGE_BYTES // 2**20} MiB; small: x < "
        f"{SMALL_BYTES // 2**20} MiB. Speed-ups above 1 are faster than the reference; the "
        f"issue's targets over the unfused pair on numba are {large} on large inputs (the "
        f"memory-bound ceiling is about 1.25×) and {small} on small ones. The post-norm rows "
        "write no `h`, so against a pair that does they are not held to the targets.",
        frozenset(alerts),
    )


def detail_table(all_rows: Sequence[Row], op: str, dtype: str) -> Table:
    """Every backend call of ``op`` on ``dtype`` inputs, shape by shape."""
    textbook = _has_textbook(all_rows, op)
    peers = _has_peers(all_rows, op)
    body = []
    for r in all_rows:
        if r.op == op and r.dtype == dtype and r.kind != "reference":
            label = r.label + (" (default)" if r.default else "")
            line = [_shape(r.shape), label, _time(r.seconds), _gbps(r.gbps), _pct(r.of_copy)]
            line += [_times(r.vs_torch)] + ([_times(r.vs_textbook)] if textbook else [])
            line += [_times(r.vs_composed)] if op in FUSED else []
            line += [_times(r.vs_peer)] if peers else []
            body.append(tuple(line))
    headers = ("shape", "call", "time", "GB/s", "% of copy", "× torch")
    headers += ("× textbook",) if textbook else ()
    headers += ("× add+numba",) if op in FUSED else ()
    headers += ("× best peer",) if peers else ()
    note = (
        "(default): normlab's choice for this NumPy input when no backend is named."
        if any(r.default for r in all_rows if r.op == op)
        else ""
    )
    return Table(f"{OP_TITLES.get(op, op)}, {dtype}: every backend call", headers, body, note)


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


#: The rows on CPU torch tensors besides ``auto-torch``: the torch backend, and backends named
#: on tensors they serve zero-copy (``workloads.ON_TORCH``).
ON_TORCH_ROWS: Final = frozenset({"torch", "numba-torch"})


def _input_family(r: Row) -> str:
    """The family of a backend row's inputs, as :data:`AUTO` names it (the fused ops run on
    CPU tensors only)."""
    if r.subject in AUTO:
        return AUTO[r.subject]
    on_torch = r.subject in ON_TORCH_ROWS or r.op in FUSED
    return AUTO["auto-torch"] if on_torch else AUTO["auto"]


def auto_table(all_rows: Sequence[Row]) -> Table:
    """Per call: the auto rows against the fastest backend named on the same input in the same
    family (an allocating call: NumPy rows for ``auto``, the torch backend's and the
    ``numba-torch`` rows for ``auto-torch``), so that each is judged against the choices it
    has, conversions included."""
    best: dict[tuple[Any, ...], Row] = {}
    for r in all_rows:
        if r.kind == "reference" or r.subject in AUTO or r.mode != "alloc":
            continue
        key = (r.op, r.dtype, r.shape, _input_family(r))
        if key not in best or r.seconds < best[key].seconds:
            best[key] = r
    body, flagged = [], set()
    for r in all_rows:
        fastest = best.get((r.op, r.dtype, r.shape, _input_family(r)))
        if r.subject not in AUTO or fastest is None:
            continue
        ratio = r.seconds / fastest.seconds
        if ratio > AUTO_TOLERANCE:
            flagged.add(len(body))
        body.append(
            (
                OP_TITLES.get(str(r.op), str(r.op)),
                AUTO[r.subject],
                r.dtype,
                _shape(r.shape),
                _time(r.seconds),
                f"{fastest.subject} {_time(fastest.seconds)}",
                f"{ratio:.2f}",
            )
        )
    return Table(
        "normlab's own choice against the fastest backend",
        ("op", "input", "dtype", "shape", "no backend named", "fastest named", "ratio"),
        body,
        "No backend named (dispatch included) against the fastest backend named on the same "
        "input of the same family (NumPy arrays: numba, numpy; CPU tensors: torch, numba "
        f"on the tensors); flagged above {AUTO_TOLERANCE:.2f}×.",
        frozenset(flagged),
    )


def peer_summary_table(gaps: Sequence[PeerGap]) -> Table:
    """Per op, input family and dtype: how many of the default's calls are ahead of (or within
    :data:`AUTO_TOLERANCE` of) the fastest peer, and how far the others are behind, small and
    large inputs apart (a gap of a few µs at every small size is a per-call cost; a ratio that
    holds at large sizes is the kernel's or the allocation's)."""
    groups: dict[tuple[str, str, str], list[PeerGap]] = defaultdict(list)
    for g in gaps:
        groups[(str(g.row.op), AUTO[g.row.subject], g.row.dtype)].append(g)
    order = [*OP_TITLES, *sorted(set(op for op, _, _ in groups) - set(OP_TITLES))]
    body, alerts = [], set()
    for (op, family, dtype), group in sorted(
        groups.items(), key=lambda item: (order.index(item[0][0]), item[0][1])
    ):
        behind = [g for g in group if g.behind]
        small = [g.gap_us for g in behind if size_class(g.row) == "small"]
        large = [g.ratio for g in behind if size_class(g.row) == "large"]
        if behind:
            alerts.add(len(body))
        body.append(
            (
                OP_TITLES.get(op, op),
                family,
                dtype,
                str(len(group)),
                str(len(group) - len(behind)),
                str(len(small)),
                f"{statistics.median(small):.1f}" if small else "—",
                str(len(large)),
                f"{max(large):.2f}" if large else "—",
            )
        )
    return Table(
        "normlab's default against the fastest peer",
        (
            "op",
            "input",
            "dtype",
            "calls",
            f"ahead or within {AUTO_TOLERANCE - 1:.0%}",
            "behind, small",
            "median gap µs (small)",
            "behind, large",
            "worst ratio (large)",
        ),
        body,
        "No backend named (dispatch included) against the fastest peer measured beside it on the "
        "same shape and dtype (torch eager; in the full matrix also ONNX Runtime allocating and "
        "through an io_binding into a preallocated output, and torch.compile). Small inputs: "
        f"x < {SMALL_BYTES // 2**20} MiB; large: x ≥ {LARGE_BYTES // 2**20} MiB; a ratio is "
        "the default's time over the peer's.",
        frozenset(alerts),
    )


def peer_gap_table(gaps: Sequence[PeerGap]) -> Table:
    """Each call where the default is behind the fastest peer by more than the tolerance."""
    body = [
        (
            OP_TITLES.get(str(g.row.op), str(g.row.op)),
            AUTO[g.row.subject],
            g.row.dtype,
            _shape(g.row.shape),
            _time(g.row.seconds),
            f"{reference_label(g.peer.op, g.peer.subject)} {_time(g.peer.seconds)}",
            f"{g.ratio:.2f}",
            f"{g.gap_us:.1f}",
        )
        for g in gaps
        if g.behind
    ]
    return Table(
        "Where the default is behind a peer",
        ("op", "input", "dtype", "shape", "no backend named", "fastest peer", "ratio", "gap µs"),
        body,
        f"Every call of the table above that is more than {AUTO_TOLERANCE - 1:.0%} behind.",
    )


def memory_table(run: dict[str, Any]) -> Table:
    body = []
    for m in run.get("normlab", {}).get("memory", []):
        subject = m["subject"]  # a LayerNorm forward: what the probe times (memory.py)
        label = subject if m["kind"] == "backend" else reference_label("layer_norm", subject)
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


def option_table(run: dict[str, Any]) -> Table:
    body = [
        (
            r.option,
            "x".join(map(str, r.shape)),
            f"{r.option_s * 1e6:.1f}",
            f"{r.base_s * 1e6:.1f}",
            f"{r.eager_s * 1e6:.1f}",
            f"{r.option_s / r.base_s:.2f}",
            f"{r.eager_s / r.option_s:.2f}",
        )
        for r in options(run)
    ]
    return Table(
        "The options of real models' norms, CPU tensors (µs per call)",
        ("option", "shape", "normlab", "plain call", "torch eager", "× plain", "eager ×"),
        body,
        "normlab's call with the option, its plain call of the same shape and dtypes, and torch "
        "eager's composition of the same formula (benchmarks/options.py), best rounds; × plain: "
        "the option's cost over the plain call (1: free); eager ×: how many times slower torch "
        "eager is.",
    )


def quantized_table(run: dict[str, Any]) -> Table:
    body = [
        (
            r.case,
            "x".join(map(str, r.shape)),
            r.dtype,
            f"{r.fused_s * 1e6:.1f}",
            f"{r.pair_s * 1e6:.1f}",
            f"{r.eager_s * 1e6:.1f}",
            f"{r.pair_s / r.fused_s:.2f}",
            f"{r.eager_s / r.fused_s:.2f}",
        )
        for r in quantized(run)
    ]
    return Table(
        "Norm + quantize, fused against the unfused pair and torch eager, CPU tensors "
        "(µs per call)",
        (
            "case",
            "shape",
            "dtype",
            "fused",
            "unfused pair",
            "torch eager",
            "pair ×",
            "eager ×",
        ),
        body,
        "normlab's call with `quantize=` (dynamic per-row scale: q and scale in one pass, y never "
        "in memory), the unfused pair (normlab's plain call, y in x's dtype, then numba's "
        "quantizer over that y) and torch eager's composition of the same formula "
        "(benchmarks/quantized.py), best rounds; pair × and eager ×: how many times slower "
        "than the fused call each is.",
    )


def report_tables(run: dict[str, Any]) -> list[Table]:
    """Every table of the report, in order."""
    all_rows = rows(run)
    dtypes = list(dict.fromkeys(r.dtype for r in all_rows))
    measured = ops(all_rows)
    tables = [key_table(all_rows, op) for op in measured]
    gaps = peer_gaps(all_rows)
    tables += [auto_table(all_rows), peer_summary_table(gaps), peer_gap_table(gaps)]
    tables += [dispatch_table(run), option_table(run), quantized_table(run)]
    tables.append(memory_table(run))
    tables += [detail_table(all_rows, op, d) for op in measured for d in dtypes]
    tables.append(skipped_table(run))
    return [t for t in tables if t.body]


def compare_table(changes: Sequence[Change]) -> Table:
    body = [
        (
            c.label,
            c.dtype,
            OP_TITLES.get(c.op, c.op),
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
            "op",
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
        ("load average", _load_average(settings.get("load_average"))),
    ]


def _load_average(load: dict[str, list[float]] | None) -> str:
    if not load:
        return "not recorded"
    start, end = (" / ".join(f"{v:.2f}" for v in load[k]) for k in ("start", "end"))
    return f"{start} at the start, {end} at the end (1, 5, 15 min)"
