"""The ratios of a saved run's calls, their means, and the comparison of two runs.

Each call is compared with the reference points of its op measured beside it on the same
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
numba ("× add+numba"), against the issue's targets (:data:`FUSED_TARGETS`).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Final

from benchmarks.report.runs import COMPOSED, LIMITS, PEERS, Call, calls

__all__ = [
    "AUTO",
    "AUTO_TOLERANCE",
    "FUSED_TARGETS",
    "LARGE_BYTES",
    "REGRESSION_FLOOR",
    "SMALL_BYTES",
    "Change",
    "Dispatch",
    "OptionRow",
    "PeerGap",
    "QuantizedRow",
    "Row",
    "Summary",
    "compare",
    "dispatch",
    "geomean",
    "options",
    "peer_gaps",
    "quantized",
    "rows",
    "size_class",
    "summary",
]

#: Inputs at least this large are bandwidth-bound (beyond a core's cache) ...
LARGE_BYTES: Final = 8 * 2**20
#: ... and below this, latency-bound.
SMALL_BYTES: Final = 2**20
#: Least relative change of the fraction of the copy limit that compare() flags.
REGRESSION_FLOOR: Final = 0.10
#: The speed-ups over the unfused pair on numba (``runs.COMPOSED``) that the fused ops aim at
#: (issue 17): on large inputs (x ≥ 8 MiB, memory-bound: one write and one read of h saved of
#: five transfers, a ceiling near 1.25×) and on small ones (x < 1 MiB, where the second call's
#: fixed cost dominates).
FUSED_TARGETS: Final = {"large": 1.15, "small": 1.4}
_COPY_FOR_MODE: Final = {"alloc": "copy", "out": "copyto", "post": "copy"}

#: The auto rows (normlab's own choice, no backend named) and the family of their inputs.
AUTO: Final = {"auto": "NumPy", "auto-torch": "torch CPU"}
#: An auto row this much slower than the best backend is flagged (the run-to-run spread of the
#: matrix on an idle machine is about as large).
AUTO_TOLERANCE: Final = 1.05


@dataclass(frozen=True, slots=True)
class Row(Call):
    """A timed call with its ratios to the references beside it (``None``: not measured).

    ``of_copy``: its GB/s over the matched copy's; ``vs_torch``, ``vs_textbook``: speed-ups over
    those references; ``vs_peer``: speed-up over the fastest other peer (``runs.PEERS``) on the
    same input; ``vs_composed`` (fused ops): speed-up over the unfused pair on numba
    (``runs.COMPOSED``).
    """

    of_copy: float | None
    vs_torch: float | None
    vs_textbook: float | None
    vs_peer: float | None = None
    vs_composed: float | None = None


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


def _speedup(
    refs: dict[tuple[Any, ...], Call], key: tuple[Any, ...], seconds: float
) -> float | None:
    """How many times faster than the reference at ``key`` (``None``: not measured)."""
    ref = refs.get(key)
    return None if ref is None else ref.seconds / seconds


def _of_copy(refs: dict[tuple[Any, ...], Call], key: tuple[Any, ...], gbps: float) -> float | None:
    """GB/s over the copy's GB/s (``None``: no copy measured)."""
    ref = refs.get(key)
    return None if ref is None else gbps / ref.gbps


def rows(run: dict[str, Any]) -> list[Row]:
    """Every matrix call of ``run``, with its ratios, in the order measured."""
    timed = calls(run)
    refs = {(c.op, c.shape, c.dtype, c.subject): c for c in timed if c.kind == "reference"}
    result = []
    for call in timed:
        op, shape, dtype, seconds = call.op, call.shape, call.dtype, call.seconds
        own = call.subject if call.kind == "reference" else None
        copy_name = _COPY_FOR_MODE[call.mode]
        copy = None if own in LIMITS else _of_copy(refs, (None, shape, dtype, copy_name), call.gbps)
        torch, textbook = (
            None if own == name else _speedup(refs, (op, shape, dtype, name), seconds)
            for name in ("torch", "textbook")
        )
        composed = (
            None if own == COMPOSED else _speedup(refs, (op, shape, dtype, COMPOSED), seconds)
        )
        others = [refs.get((op, shape, dtype, p)) for p in PEERS if p != own]
        best_peer = min((ref.seconds for ref in others if ref is not None), default=None)
        result.append(
            Row(
                **{f.name: getattr(call, f.name) for f in fields(Call)},
                of_copy=copy,
                vs_torch=torch,
                vs_textbook=textbook,
                vs_peer=None if best_peer is None else best_peer / seconds,
                vs_composed=composed,
            )
        )
    return result


def geomean(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None and v > 0]
    if not present:
        return None
    return math.exp(sum(math.log(v) for v in present) / len(present))


def size_class(row: Row) -> str | None:
    """``"large"``, ``"small"`` or None (in between): the input-size classes of the targets."""
    if row.input_bytes >= LARGE_BYTES:
        return "large"
    return "small" if row.input_bytes < SMALL_BYTES else None


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
                gbps=geomean(r.gbps for r in large),
                of_copy=geomean(r.of_copy for r in large),
                vs_torch=geomean(r.vs_torch for r in large),
                vs_textbook=geomean(r.vs_textbook for r in large),
                small_vs_torch=geomean(r.vs_torch for r in small),
                vs_peer=geomean(r.vs_peer for r in large),
                small_vs_peer=geomean(r.vs_peer for r in small),
            )
        )
    return result


@dataclass(frozen=True, slots=True)
class OptionRow:
    """Per-call times (s) of an option of real models' norms on one shape: normlab's call with
    it, normlab's plain call of the same shape and dtypes, torch eager's composition."""

    option: str
    shape: tuple[int, ...]
    option_s: float
    base_s: float
    eager_s: float


def options(run: dict[str, Any]) -> list[OptionRow]:
    """The option rows of ``run`` (benchmarks/options.py), in the order measured."""
    times: dict[tuple[str, tuple[int, ...]], dict[str, float]] = defaultdict(dict)
    for bench in run["benchmarks"]:
        info = bench["extra_info"]
        if info.get("kind") == "option":
            times[info["mode"], tuple(info["shape"])][info["subject"]] = bench["stats"]["min"]
    return [
        OptionRow(option, shape, t["option"], t["base"], t["torch eager"])
        for (option, shape), t in times.items()
        if {"option", "base", "torch eager"} <= t.keys()
    ]


@dataclass(frozen=True, slots=True)
class QuantizedRow:
    """Per-call times (s) of a norm with quantized outputs on one shape and dtype: normlab's
    fused call, the unfused pair (normlab's plain call, then numba's quantizer over its y) and
    torch eager's composition."""

    case: str
    shape: tuple[int, ...]
    dtype: str
    fused_s: float
    pair_s: float
    eager_s: float


def quantized(run: dict[str, Any]) -> list[QuantizedRow]:
    """The quantized rows of ``run`` (benchmarks/quantized.py), in the order measured."""
    times: dict[tuple[str, tuple[int, ...], str], dict[str, float]] = defaultdict(dict)
    for bench in run["benchmarks"]:
        info = bench["extra_info"]
        if info.get("kind") == "quantized":
            key = (info["mode"], tuple(info["shape"]), info["dtype"])
            times[key][info["subject"]] = bench["stats"]["min"]
    return [
        QuantizedRow(case, shape, dtype, t["fused"], t["unfused pair"], t["torch eager"])
        for (case, shape, dtype), t in times.items()
        if {"fused", "unfused pair", "torch eager"} <= t.keys()
    ]


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
    return geomean(values) or math.nan


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
