"""A saved benchmark run turned into ratios, tables, a comparison and the performance page.

A run is the JSON that ``bench_matrix.py`` saves through pytest-benchmark, with the ``normlab``
section that ``conftest.py`` adds. Nothing here imports normlab or times anything, so a saved
run can be reported on any machine.

Every time is the best round (pytest-benchmark's ``min``): on a shared machine noise only adds
time. Each call is compared with the reference points of its op measured beside it on the same
input: the copy matched to the call (``x.copy()`` for allocating calls, ``np.copyto`` for
``out=``), torch (``F.layer_norm``, ``F.rms_norm``, or autograd's backward of them) and, for
LayerNorm, the textbook NumPy formula. The full matrix adds the forwards' other peers: ONNX
Runtime (``session.run``, and an io_binding into a preallocated output) and ``torch.compile``;
"× best peer" is the call's speed-up over the fastest peer measured beside it (torch eager,
either ORT call, torch.compile). GB/s counts the bytes the op must move (forwards: ``x``
and ``y``; backwards: ``x`` and ``dy`` read, ``dx`` written, plus statistics and parameter
gradients; fused ops: ``x`` and ``residual`` read, ``h`` and ``y`` written, no ``h`` in the
post-norm form); "% of copy" is that GB/s over the copy's. The fused ops are also compared with
the unfused pair that normlab itself would run, torch eager's add then normlab's base op on
numba ("× add+numba"), against the issue's targets (:data:`FUSED_TARGETS`). Runs saved before
the matrix had several ops hold LayerNorm forward calls only, and read as such.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from rich.console import Console
from rich.table import Table as RichTable

__all__ = [
    "FUSED_TARGETS",
    "Change",
    "Dispatch",
    "Row",
    "Summary",
    "Table",
    "compare",
    "compare_table",
    "dispatch",
    "docs_page",
    "fused_table",
    "key_table",
    "load",
    "print_compare",
    "print_report",
    "report_tables",
    "rows",
    "sections",
    "summary",
]

#: Inputs at least this large are bandwidth-bound (beyond a core's cache) ...
LARGE_BYTES: Final = 8 * 2**20
#: ... and below this, latency-bound.
SMALL_BYTES: Final = 2**20
DISPATCH_TARGET_US: Final = 1.5
#: The full matrix's time budget (minutes): the default of benchmarks/conftest.py's SETTINGS.
FULL_BUDGET_MINUTES: Final = 45.0
#: Least relative change of the fraction of the copy limit that compare() flags.
REGRESSION_FLOOR: Final = 0.10
#: The ops of the matrix, in the order of the report, with their titles.
OP_TITLES: Final = {
    "layer_norm": "LayerNorm forward",
    "rms_norm": "RMSNorm forward",
    "layer_norm_backward": "LayerNorm backward",
    "rms_norm_backward": "RMSNorm backward",
    "add_layer_norm": "Residual add + LayerNorm (fused)",
    "add_rms_norm": "Residual add + RMSNorm (fused)",
}
#: The fused ops, and the unfused pair each is judged against: torch eager's add, then
#: normlab's base op on numba.
FUSED: Final = ("add_layer_norm", "add_rms_norm")
COMPOSED: Final = "add_numba"
#: The speed-ups over that pair the fused ops aim at (issue 17): on large inputs (x ≥ 8 MiB,
#: memory-bound: one write and one read of h saved of five transfers, a ceiling near 1.25×) and
#: on small ones (x < 1 MiB, where the second call's fixed cost dominates).
FUSED_TARGETS: Final = {"large": 1.15, "small": 1.4}
#: The copy limits: measured once per input, shared by every op.
LIMITS: Final = ("copy", "copyto")
REFERENCE_LABELS: Final = {
    "textbook": "textbook NumPy",
    "copy": "x.copy()",
    "copyto": "np.copyto",
    "ort": "ORT session.run",
    "ort_iobinding": "ORT io_binding",
    "torch_compile": "torch.compile",
}
#: The peers: what a user could call instead of normlab ("torch" is torch eager).
PEERS: Final = ("torch", "ort", "ort_iobinding", "torch_compile")
TORCH_LABELS: Final = {
    "layer_norm": "torch F.layer_norm",
    "rms_norm": "torch F.rms_norm",
    "layer_norm_backward": "torch autograd backward",
    "rms_norm_backward": "torch autograd backward",
    "add_layer_norm": "torch x + r, then F.layer_norm",
    "add_rms_norm": "torch x + r, then F.rms_norm",
}
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
_COPY_FOR_MODE: Final = {"alloc": "copy", "out": "copyto", "post": "copy"}
_MODE_LABELS: Final = {"out": " out=", "post": " post-norm"}
_ITEMSIZE: Final = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_LEGACY_OP: Final = "layer_norm"  # the op of runs saved before the matrix had several


def reference_label(op: str | None, subject: str) -> str:
    """How the reference point ``subject`` of ``op`` is called in tables."""
    if subject == "torch":
        return TORCH_LABELS.get(op or _LEGACY_OP, f"torch {op}")
    if subject == COMPOSED and op in FUSED:
        return f"torch x + r, then normlab.{op.removeprefix('add_')} (numba)"
    return REFERENCE_LABELS.get(subject, subject)


@dataclass(frozen=True, slots=True)
class Row:
    """One timed call with its ratios to the references beside it (``None``: not measured).

    ``kind`` is ``"reference"`` or the op of a backend call; ``op`` the op it belongs to (None
    for the copy limits, which serve every op). ``vs_peer``: speed-up over the fastest other
    peer (:data:`PEERS`) on the same input; ``default``: normlab chooses this backend for this
    NumPy input when no backend is named; ``vs_composed`` (fused ops): speed-up over the unfused
    pair on numba (:data:`COMPOSED`).
    """

    kind: str
    op: str | None
    subject: str
    mode: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    seconds: float
    of_copy: float | None
    vs_torch: float | None
    vs_textbook: float | None
    vs_peer: float | None = None
    default: bool = False
    vs_composed: float | None = None

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def label(self) -> str:
        if self.kind == "reference":
            return reference_label(self.op, self.subject)
        return self.subject + _MODE_LABELS.get(self.mode, "")

    @property
    def input_bytes(self) -> int:
        """The bytes of ``x``: what makes an input large or small."""
        return math.prod(self.shape) * _ITEMSIZE.get(self.dtype, 4)

    @property
    def key(self) -> tuple[str | None, str, str, str, tuple[int, ...], str]:
        return self.op, self.kind, self.subject, self.mode, self.shape, self.dtype


@dataclass(frozen=True, slots=True)
class Summary:
    """Geometric means of one call's ratios over the large (and small) inputs of one dtype."""

    op: str
    label: str
    dtype: str
    gbps: float | None
    of_copy: float | None
    vs_torch: float | None
    vs_textbook: float | None
    small_vs_torch: float | None
    vs_peer: float | None = None
    small_vs_peer: float | None = None


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
    """One call (op, label and dtype) in two runs: how its fraction of the copy limit moved.

    ``change`` is the geometric mean over the shapes measured in both runs; ``threshold`` the
    run-to-run spread it must exceed to count (see :func:`compare`).
    """

    op: str
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
    body: Sequence[tuple[str, ...]]
    note: str = ""
    alerts: frozenset[int] = frozenset()  # rows to highlight (by index)


# --------------------------------------------------------------------------------------------
# From JSON to rows


def load(path: str | Path) -> dict[str, Any]:
    """A saved run."""
    return json.loads(Path(path).read_text())  # type: ignore[no-any-return]


def _speedup(
    refs: dict[tuple[Any, ...], tuple[float, int]], key: tuple[Any, ...], seconds: float
) -> float | None:
    """How many times faster than the reference at ``key`` (``None``: not measured)."""
    ref = refs.get(key)
    return None if ref is None else ref[0] / seconds


def _of_copy(
    refs: dict[tuple[Any, ...], tuple[float, int]], key: tuple[Any, ...], gbps: float
) -> float | None:
    """GB/s over the copy's GB/s (``None``: no copy measured)."""
    ref = refs.get(key)
    return None if ref is None else gbps / (ref[1] / ref[0] / 1e9)


def _op(info: dict[str, Any]) -> str | None:
    """The op a saved call belongs to (None for a copy limit)."""
    if info["kind"] != "reference":
        return str(info["kind"])
    if info["subject"] in LIMITS:
        return None
    return str(info.get("op") or _LEGACY_OP)


def rows(run: dict[str, Any]) -> list[Row]:
    """Every matrix call of ``run``, with its ratios, in the order measured."""
    timed = [b for b in run["benchmarks"] if "bytes" in b["extra_info"]]
    refs: dict[tuple[Any, ...], tuple[float, int]] = {}
    for bench in timed:
        info = bench["extra_info"]
        if info["kind"] == "reference":
            key = (_op(info), tuple(info["shape"]), info["dtype"], info["subject"])
            refs[key] = (float(bench["stats"]["min"]), int(info["bytes"]))
    result = []
    for bench in timed:
        info, stats = bench["extra_info"], bench["stats"]
        shape, dtype, seconds = tuple(info["shape"]), info["dtype"], float(stats["min"])
        op, nbytes = _op(info), int(info["bytes"])
        own = info["subject"] if info["kind"] == "reference" else None
        copy_name = _COPY_FOR_MODE[info["mode"]]
        gbps = nbytes / seconds / 1e9
        copy = None if own in LIMITS else _of_copy(refs, (None, shape, dtype, copy_name), gbps)
        torch, textbook = (
            None if own == name else _speedup(refs, (op, shape, dtype, name), seconds)
            for name in ("torch", "textbook")
        )
        composed = (
            None if own == COMPOSED else _speedup(refs, (op, shape, dtype, COMPOSED), seconds)
        )
        others = [refs.get((op, shape, dtype, p)) for p in PEERS if p != own]
        best_peer = min((ref[0] for ref in others if ref is not None), default=None)
        result.append(
            Row(
                kind=info["kind"],
                op=op,
                subject=info["subject"],
                mode=info["mode"],
                shape=shape,
                dtype=dtype,
                nbytes=nbytes,
                seconds=seconds,
                of_copy=copy,
                vs_torch=torch,
                vs_textbook=textbook,
                vs_peer=None if best_peer is None else best_peer / seconds,
                default=bool(info.get("default", False)),
                vs_composed=composed,
            )
        )
    return result


def ops(all_rows: Sequence[Row]) -> list[str]:
    """The ops measured in ``all_rows``, in report order (unknown ops last)."""
    found = {r.op for r in all_rows if r.op is not None}
    return [op for op in OP_TITLES if op in found] + sorted(found - set(OP_TITLES))


def _geomean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None and v > 0]
    if not present:
        return None
    return math.exp(sum(math.log(v) for v in present) / len(present))


def summary(all_rows: Sequence[Row]) -> list[Summary]:
    """Per op, call and dtype: geometric means over large inputs, and × torch over small ones."""
    groups: dict[tuple[str, str, str], list[Row]] = defaultdict(list)
    for row in all_rows:
        if row.op is not None and (row.kind != "reference" or row.subject in (*PEERS, "textbook")):
            groups[(row.op, row.label, row.dtype)].append(row)
    result = []
    for (op, label, dtype), group in groups.items():
        large = [r for r in group if r.input_bytes >= LARGE_BYTES]
        small = [r for r in group if r.input_bytes < SMALL_BYTES]
        result.append(
            Summary(
                op=op,
                label=label,
                dtype=dtype,
                gbps=_geomean(r.gbps for r in large),
                of_copy=_geomean(r.of_copy for r in large),
                vs_torch=_geomean(r.vs_torch for r in large),
                vs_textbook=_geomean(r.vs_textbook for r in large),
                small_vs_torch=_geomean(r.vs_torch for r in small),
                vs_peer=_geomean(r.vs_peer for r in large),
                small_vs_peer=_geomean(r.vs_peer for r in small),
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
    shapes scatter), plus the drift of the references of the same dtype (the torch peers and
    the textbook formula are the same code in both runs, so their drift is the machine's), and
    at least ``floor``. Calls are told apart by op, label and dtype.
    """
    old = {r.key: r for r in rows(before)}
    pairs: dict[tuple[str, str, str], list[tuple[Row, Row]]] = defaultdict(list)
    logs: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for row in rows(after):
        prior = old.get(row.key)
        if row.op is None or prior is None or row.of_copy is None or prior.of_copy is None:
            continue
        pairs[(row.op, row.label, row.dtype)].append((prior, row))
        logs[(row.op, row.label, row.dtype)].append(math.log(row.of_copy / prior.of_copy))
    drift: dict[str, float] = defaultdict(float)
    for (op, label, dtype), values in logs.items():
        if pairs[(op, label, dtype)][0][1].kind == "reference":
            drift[dtype] = max(drift[dtype], abs(statistics.fmean(values)))
    changes = []
    for (op, label, dtype), group in pairs.items():
        values = logs[(op, label, dtype)]
        error = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
        threshold = max(math.log1p(floor), 2 * error + drift[dtype])
        changes.append(
            Change(
                op=op,
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


def _size_class(row: Row) -> str | None:
    """``"large"``, ``"small"`` or None (in between): the input-size classes of the targets."""
    if row.input_bytes >= LARGE_BYTES:
        return "large"
    return "small" if row.input_bytes < SMALL_BYTES else None


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
        sized = {c: [r for r in group if _size_class(r) == c] for c in FUSED_TARGETS}
        composed = {c: _geomean(r.vs_composed for r in sized[c]) for c in FUSED_TARGETS}
        met = [
            composed[c] >= target for c, target in FUSED_TARGETS.items() if composed[c] is not None
        ]
        if met and not all(met) and not label.endswith(_MODE_LABELS["post"]):
            alerts.add(len(body))
        line = [label, dtype, _gbps(_geomean(r.gbps for r in sized["large"]))]
        line += [_times(composed["large"]), _times(composed["small"])]
        line += [_times(_geomean(r.vs_torch for r in sized[c])) for c in FUSED_TARGETS]
        line += (
            [_times(_geomean(r.vs_peer for r in sized[c])) for c in FUSED_TARGETS] if peers else []
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


#: The auto rows (normlab's own choice, no backend named) and the family of their inputs.
AUTO: Final = {"auto": "NumPy", "auto-torch": "torch CPU"}
#: The rows on CPU torch tensors besides ``auto-torch``: the torch backend, and backends named
#: on tensors they serve zero-copy (``workloads.ON_TORCH``).
ON_TORCH_ROWS: Final = frozenset({"torch", "numba-torch"})
#: An auto row this much slower than the best backend is flagged (the run-to-run spread of the
#: matrix on an idle machine is about as large).
AUTO_TOLERANCE: Final = 1.05


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


#: What the page says under the default's table against the peers: where the gaps come from
#: (measured and explained in the pages it links to).
DEFAULT_VS_PEERS: Final = (
    "Each call made with no backend named is compared with the fastest peer measured beside it; "
    "the second table lists every call more than the tolerance behind. The gaps are of three "
    "kinds. **Small inputs, a few µs at every size:** the fixed cost of a call made from "
    "Python. On a CPU tensor normlab reads the dtype, shape, strides, device and "
    "`requires_grad` of x, weight and bias for its validation cache and allocates y before its "
    "kernel runs, where `F.layer_norm` makes the same checks in C++ (about 3 µs at one row; "
    "see [the Numba backend](numba.md#per-call-cost)); on NumPy input the peers are torch "
    "eager on a tensor and ONNX Runtime writing into an output it was given. The fused ops' "
    "peer is torch's add and torch's norm, two C++ calls (see "
    "[Fused residual add](fused.md#why-the-small-input-target-is-out-of-reach)). **Large "
    "allocating calls:** a fresh y costs page faults; compare the `numba out=` rows, which "
    "time the kernel into existing memory as ORT's io_binding does (see "
    "[the output pool](numba.md#allocating-calls-the-output-pool)). **Large inputs in half "
    "precision:** numba converts float16 and bfloat16 in the kernel (see "
    "[Half precision](numba.md#half-precision)); where torch or ORT is ahead there, it is by "
    "the ratio shown. Large calls are bound by memory on two cores, where 10–20% moves from run "
    "to run: compare runs with `--compare`."
)


@dataclass(frozen=True, slots=True)
class PeerGap:
    """One auto row (normlab's own choice) beside the fastest peer measured on its input."""

    row: Row
    peer: Row

    @property
    def ratio(self) -> float:
        """The auto call's time over the peer's: above 1, the peer is faster."""
        return self.row.seconds / self.peer.seconds

    @property
    def gap_us(self) -> float:
        return (self.row.seconds - self.peer.seconds) * 1e6

    @property
    def behind(self) -> bool:
        return self.ratio > AUTO_TOLERANCE


def peer_gaps(all_rows: Sequence[Row]) -> list[PeerGap]:
    """Every auto row with the fastest peer (:data:`PEERS`) measured on the same op, shape and
    dtype; rows with no peer beside them are left out."""
    peers: dict[tuple[Any, ...], Row] = {}
    for r in all_rows:
        if r.kind == "reference" and r.subject in PEERS:
            key = (r.op, r.shape, r.dtype)
            if key not in peers or r.seconds < peers[key].seconds:
                peers[key] = r
    return [
        PeerGap(r, peers[(r.op, r.shape, r.dtype)])
        for r in all_rows
        if r.kind != "reference" and r.subject in AUTO and (r.op, r.shape, r.dtype) in peers
    ]


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
        small = [g.gap_us for g in behind if _size_class(g.row) == "small"]
        large = [g.ratio for g in behind if _size_class(g.row) == "large"]
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
        label = m["subject"] if m["kind"] == "backend" else reference_label(None, m["subject"])
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
    measured = ops(all_rows)
    tables = [key_table(all_rows, op) for op in measured]
    gaps = peer_gaps(all_rows)
    tables += [auto_table(all_rows), peer_summary_table(gaps), peer_gap_table(gaps)]
    tables += [dispatch_table(run), memory_table(run)]
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
        f"{len(changes)} calls (backend or reference, per op and dtype) in both runs: "
        f"{slower} slower, {faster} faster beyond the spread"
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
        ("load average", _load_average(settings.get("load_average"))),
    ]


def _load_average(load: dict[str, list[float]] | None) -> str:
    if not load:
        return "not recorded"
    start, end = (" / ".join(f"{v:.2f}" for v in load[k]) for k in ("start", "end"))
    return f"{start} at the start, {end} at the end (1, 5, 15 min)"


def sections(runs: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Which run each op's numbers come from: the first of ``runs`` that measured it."""
    chosen: dict[str, int] = {}
    for i, run in enumerate(runs):
        for op in ops(rows(run)):
            chosen.setdefault(op, i)
    return {op: chosen[op] for op in sorted(chosen, key=list(OP_TITLES).index)}


def docs_page(
    runs: Sequence[tuple[str, dict[str, Any]]], images: Mapping[str, Sequence[str]]
) -> str:
    """``docs/performance.md`` from ``runs`` (each ``(source, run)``, the file it was saved as).

    Each op's section comes from the first run that measured it (:func:`sections`); dispatch
    overhead and peak memory from the first run that has them. ``images``: per op, the plots'
    paths relative to docs/.
    """
    sources = [source for source, _ in runs]
    chosen = sections([run for _, run in runs])
    used = sorted(set(chosen.values()))
    parts = [
        "# Performance",
        "",
        f"<!-- Generated by `python benchmarks/run.py --report {' '.join(sources)} "
        "--write-docs`: do not edit by hand. -->",
        "",
        "LayerNorm and RMSNorm are memory-bound, forward and backward: the forward reads `x` "
        "once and writes `y` once; the backward reads `x` and `dy` and writes `dx` (plus small "
        "per-row statistics and per-column parameter gradients). The limit is a copy of the same "
        "bytes on the same machine, measured in the same run, so every number below is a ratio "
        "taken side by side: against that copy (`x.copy()` for allocating calls, `np.copyto` for "
        "`out=`; % of copy is the call's GB/s over the copy's), against torch on the same input "
        "(the peer, on all cores) and, for the LayerNorm forward, against the textbook NumPy "
        "formula `(x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * w "
        "+ b` (single-threaded, like the copy). Each time is the best of its rounds: on a shared "
        "machine, noise only adds time. The copy is one NumPy thread, so a parallel kernel can "
        "pass 100%.",
        "",
        "The full matrix (`nox -s bench`) also measures the forwards' other peers: ONNX Runtime "
        "on the CPU (`LayerNormalization`, opset 17; for RMSNorm `RMSNormalization`, opset 23, "
        "or ORT's `SimplifiedLayerNormalization` where that has no kernel for the dtype), both "
        "allocating (`session.run`) and through an io_binding into a preallocated output, on "
        "every forward shape and dtype it has a kernel for, its intra-op threads told not to "
        "spin (spinning threads take the cores from the contender timed next; onnxruntime "
        "1.31.1: float32, float16 "
        "and float64 for all three ops; bfloat16 for `LayerNormalization` and "
        "`SimplifiedLayerNormalization` but not `RMSNormalization`, which ORT expands into "
        "operators without a bfloat16 CPU kernel; bfloat16 goes through OrtValues, as NumPy "
        "cannot hand it to `session.run`); and `torch.compile` (inductor, `dynamic=False`, "
        "compiled before the timing) on a subset of shapes (rows 1, 8, 64, 256, 1024, 16384 and "
        "65536 at hidden 768 and 1024), float32 and float16. `× best peer` is a call's speed-up "
        "over the fastest of "
        "them and torch eager on the same input. Its forwards also sweep small sizes (rows 1, "
        "2, 4 … 1024 at hidden 768 and 1024, float32 and float16), drawn as time per call "
        "against rows beside normlab's default choice for NumPy input.",
        "",
        "The fused residual-add ops (`add_layer_norm`, `add_rms_norm`) run on CPU torch tensors "
        "and are judged against the unfused pair normlab would otherwise run, torch eager's add "
        "then normlab's base op on numba, on the same tensors (`× add+numba`; the targets are "
        f"{FUSED_TARGETS['large']:g}× on inputs of 8 MiB or more and {FUSED_TARGETS['small']:g}× "
        "below 1 MiB), besides torch eager's pair and, in the full matrix, `torch.compile` of it.",
        "",
        "## Runs",
        "",
        "| section | from |",
        "|---|---|",
        *[f"| {OP_TITLES.get(op, op)} | `{sources[i]}` |" for op, i in chosen.items()],
        "",
    ]
    measured_peers = any(
        r.kind == "reference" and r.subject in PEERS[1:] for i in used for r in rows(runs[i][1])
    )
    if not measured_peers:
        parts += [
            "The runs below predate the peers and the small-size sweep (or ran without "
            "onnxruntime): their figures come from the next full run on an idle machine.",
            "",
        ]
    quick = [sources[i] for i in used if runs[i][1].get("normlab", {}).get("matrix") == "quick"]
    if quick:
        parts += [
            f"{', '.join(f'`{q}`' for q in quick)}: a quick run (CI's `bench-quick`: a few "
            "shapes, float32 and float16, short rounds). Its ratios are indicative, the more so "
            "where its load average (below) exceeds the core count: a full run on an idle "
            "machine should replace them.",
            "",
        ]
    for i in used:
        source, run = runs[i]
        parts += [f"### `{source}`", "", "| | |", "|---|---|"]
        parts += [f"| {k} | {v} |" for k, v in machine(run)]
        parts.append("")
    for op, i in chosen.items():
        all_rows = rows(runs[i][1])
        table = key_table(all_rows, op)
        parts += [f"## {OP_TITLES.get(op, op)}", "", f"From `{sources[i]}`.", ""]
        parts.append(to_markdown(table, 0))
        if images.get(op):
            parts += [f"![{Path(image).stem}]({image})" for image in images[op]]
            parts.append("")
    gaps = [g for op, i in chosen.items() for g in peer_gaps(rows(runs[i][1])) if g.row.op == op]
    if gaps:
        summary, behind = peer_summary_table(gaps), peer_gap_table(gaps)
        parts += [f"## {summary.title}", "", DEFAULT_VS_PEERS, "", to_markdown(summary, 0)]
        parts += [f'??? note "{behind.title}"', ""]
        parts += [f"    {line}" if line else "" for line in to_markdown(behind, 0).splitlines()]
        parts.append("")
    extras = [
        (dispatch_table, "Dispatch overhead on a tiny array (µs per call)"),
        (memory_table, "Peak memory of one allocating call"),
    ]
    for make, _ in extras:
        found = next(((source, t) for source, run in runs if (t := make(run)).body), None)
        if found is not None:
            source, table = found
            parts += [f"## {table.title}", "", f"LayerNorm forward, from `{source}`.", ""]
            parts.append(to_markdown(table, 0))
    parts += ["## Every backend call", ""]
    for op, i in chosen.items():
        all_rows = rows(runs[i][1])
        for dtype in dict.fromkeys(r.dtype for r in all_rows if r.op == op):
            markdown = to_markdown(detail_table(all_rows, op, dtype), 0)
            parts += [f'??? note "{OP_TITLES.get(op, op)}, {dtype}"', ""]
            parts += [f"    {line}" if line else "" for line in markdown.splitlines()]
            parts.append("")
    parts += ["## Not measured", ""]
    for i in used:
        source, run = runs[i]
        parts += [f"In `{source}`:", "", to_markdown(skipped_table(run), 0)]
    parts += [
        "## Reproduce",
        "",
        "```sh",
        f"nox -s bench                 # the full matrix ({FULL_BUDGET_MINUTES:.0f} min "
        "budget), then this page",
        "nox -s bench-quick           # a small subset, in CI",
        "python benchmarks/run.py --full --budget-minutes 60",
        f"python benchmarks/run.py --report {' '.join(sources)} --write-docs   # this page again",
        "python benchmarks/run.py --compare A.json B.json            # two runs side by side",
        "```",
        "",
        f"`bench` runs the matrix within a {FULL_BUDGET_MINUTES:.0f}-minute budget "
        "(`--budget-minutes`, passed on as pytest's `--normlab-budget-minutes`): each case gets "
        "a share of the time left in proportion to its input size, and the cases still waiting "
        "when the budget is spent are skipped and listed under Not measured. Installing the "
        "session (torch, numba, onnxruntime, onnx) and drawing this page come on top.",
        "",
        "`--report` with several runs takes each op's section from the first run that measured "
        "it. `--compare` judges each call per op and dtype on its fraction of the copy limit, "
        "averaged over the shapes of both runs, and flags a change beyond the run-to-run "
        "spread: two standard errors of that mean plus the drift of the unchanged references.",
        "",
        "The numbers come from "
        + ", ".join(f"`{sources[i]}`" for i in used)
        + "; plots and this page are generated from them.",
        "",
    ]
    return "\n".join(parts)
