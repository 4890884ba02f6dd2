"""PNG plots of a run: GB/s against hidden size, and time per call against rows for small sizes.

GB/s: one figure per op and dtype, one panel per row count (``[rows, hidden]`` inputs where the
op was measured at two or more hidden sizes), hidden sizes evenly spaced, GB/s on a log scale.
Backends are coloured lines (solid: allocating, dashed: ``out=``); the references and peers are
grey; the copy limit is black (solid: ``x.copy()``, dashed: ``np.copyto``, forwards only).

Time per call (``<stem>-<op>-<dtype>-rows.png``, forwards): one panel per hidden size measured
at :data:`SWEEP_LEAST` or more row counts up to :data:`SWEEP_MAX_ROWS`, rows and time on log
scales: the peers, ``x.copy()`` and normlab's default choice for NumPy input (its allocating
call, whichever backend that is at each size) on one plot."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from benchmarks.report.runs import Call

__all__ = ["render"]

FORWARDS: Final = ("layer_norm", "rms_norm")
PANEL_COLUMNS: Final = 3
_REFERENCE_STYLE: Final = {
    "copy": {"color": "black", "linestyle": "-", "linewidth": 2.0},
    "copyto": {"color": "black", "linestyle": "--", "linewidth": 1.5},
    "torch": {"color": "0.45", "linestyle": ":", "marker": "s"},
    "textbook": {"color": "0.7", "linestyle": ":", "marker": "v"},
    "ort": {"color": "0.3", "linestyle": "-.", "marker": "D"},
    "ort_iobinding": {"color": "0.3", "linestyle": ":", "marker": "d"},
    "torch_compile": {"color": "0.55", "linestyle": "-.", "marker": "^"},
}
#: The rows sweep: hidden sizes measured at this many row counts up to the largest get a panel.
SWEEP_LEAST: Final = 4
SWEEP_MAX_ROWS: Final = 1024
SWEEP_HIDDEN: Final = (768, 1024)
#: The calls of the time-per-call plot besides normlab's default: the copy and the peers.
_SWEEP_REFERENCES: Final = ("copy", "torch", "ort", "ort_iobinding", "torch_compile")
_DEFAULT_STYLE: Final = {"color": "tab:red", "linestyle": "-", "marker": "o", "linewidth": 2.0}


def render(
    rows: Sequence[Call], directory: Path, stem: str, titles: Mapping[str, str]
) -> dict[str, list[Path]]:
    """Write ``<stem>-<op>-<dtype>.png`` into ``directory`` for each op and dtype with a panel.

    ``titles`` names the ops in the figures' titles. Returns the paths drawn, per op.
    """
    directory.mkdir(parents=True, exist_ok=True)
    paths: dict[str, list[Path]] = {}
    for op in dict.fromkeys(r.op for r in rows if r.op is not None):
        for dtype in dict.fromkeys(r.dtype for r in rows):
            chosen = [
                r
                for r in rows
                if r.dtype == dtype
                and len(r.shape) == 2
                and r.op in (op, None)
                and (op in FORWARDS or r.subject != "copyto")  # no out= in the backwards
            ]
            figure = _figure(chosen, op, titles.get(op, op), dtype)
            if figure is None:
                continue
            path = directory / f"{stem}-{op}-{dtype}.png"
            figure.savefig(path, dpi=90, bbox_inches="tight")
            plt.close(figure)
            paths.setdefault(op, []).append(path)
        for dtype in dict.fromkeys(r.dtype for r in rows):
            small = [
                r
                for r in rows
                if r.dtype == dtype
                and len(r.shape) == 2
                and r.shape[0] <= SWEEP_MAX_ROWS
                and r.op in (op, None)
            ]
            figure = _rows_figure(small, op, titles.get(op, op), dtype) if op in FORWARDS else None
            if figure is None:
                continue
            path = directory / f"{stem}-{op}-{dtype}-rows.png"
            figure.savefig(path, dpi=90, bbox_inches="tight")
            plt.close(figure)
            paths.setdefault(op, []).append(path)
    return paths


def _rows_figure(rows: list[Call], op: str, title: str, dtype: str) -> Any:
    """Time per call against rows, one panel per swept hidden size; ``None`` if none was."""
    by_hidden: dict[int, list[Call]] = defaultdict(list)
    for row in rows:
        if row.subject in _SWEEP_REFERENCES or (row.default and row.mode == "alloc"):
            by_hidden[row.shape[1]].append(row)
    panels = sorted(
        h
        for h, group in by_hidden.items()
        if len({r.shape[0] for r in group if r.default}) >= SWEEP_LEAST
    )
    if not panels:
        return None
    figure, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0), squeeze=False)
    for ax, hidden in zip(axes.flat, panels, strict=True):
        lines: dict[str, list[Call]] = defaultdict(list)
        for row in by_hidden[hidden]:
            lines["default" if row.kind != "reference" else row.subject].append(row)
        for name, points in sorted(lines.items()):
            points.sort(key=lambda r: r.shape[0])
            if name == "default":
                chosen = ", ".join(dict.fromkeys(r.subject for r in points))
                label, style = f"normlab default ({chosen})", _DEFAULT_STYLE
            else:
                label, style = points[0].label, _REFERENCE_STYLE[name]
            ax.plot(
                [r.shape[0] for r in points],
                [r.seconds * 1e6 for r in points],
                label=label,
                markersize=4,
                **style,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"hidden {hidden}", fontsize=10)
        ax.set_xlabel("rows")
        ax.set_ylabel("µs per call (best round)")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    figure.suptitle(f"{title}, {dtype}: time per call against rows (small sizes)")
    figure.tight_layout()
    return figure


def _figure(rows: list[Call], op: str, title: str, dtype: str) -> Any:
    by_rows: dict[int, list[Call]] = defaultdict(list)
    for row in rows:
        by_rows[row.shape[0]].append(row)
    # The copy limits alone make no line worth a panel; a row count measured at the sweep's
    # hidden sizes only is drawn in the time-per-call plot instead.
    hiddens = {n: {r.shape[1] for r in group if r.op} for n, group in by_rows.items()}
    panels = sorted(n for n, h in hiddens.items() if len(h) > 1 and not h <= set(SWEEP_HIDDEN))
    if not panels:
        return None
    hidden = sorted({r.shape[1] for r in rows})
    position = {h: i for i, h in enumerate(hidden)}  # evenly spaced: 768, 1000, 1024 apart
    backends = sorted({r.subject for r in rows if r.kind != "reference"})
    colours = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(backends)}
    columns = min(PANEL_COLUMNS, len(panels))
    grid_rows = -(-len(panels) // columns)
    figure, axes = plt.subplots(
        grid_rows, columns, figsize=(4.6 * columns, 3.6 * grid_rows), squeeze=False
    )
    flat = list(axes.flat)
    for ax, n_rows in zip(flat, panels, strict=False):
        lines: dict[tuple[str, str, str], list[Call]] = defaultdict(list)
        for row in by_rows[n_rows]:
            lines[(row.kind, row.subject, row.mode)].append(row)
        for (kind, subject, mode), points in sorted(lines.items()):
            points.sort(key=lambda r: r.shape[1])
            if kind == "reference":
                style = dict(_REFERENCE_STYLE.get(subject, {}))
            else:
                style = {
                    "color": colours[subject],
                    "marker": "o",
                    "linestyle": "--" if mode == "out" else "-",
                }
            ax.plot(
                [position[r.shape[1]] for r in points],
                [r.gbps for r in points],
                label=points[0].label,
                markersize=4,
                **style,
            )
        ax.set_yscale("log")
        ax.set_xticks(range(len(hidden)), [str(h) for h in hidden], fontsize=8)
        ax.set_title(f"{n_rows} row{'s' if n_rows > 1 else ''}", fontsize=10)
        ax.set_xlabel("hidden size")
        ax.set_ylabel("GB/s (x + y)" if op in FORWARDS else "GB/s (x + dy + dx, …)")
        ax.grid(True, which="major", alpha=0.3)
    for ax in flat[len(panels) :]:
        ax.set_visible(False)
    legend: dict[str, Any] = {}
    for ax in flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    figure.suptitle(f"{title}, {dtype}: GB/s against hidden size")
    figure.tight_layout()
    figure.legend(
        list(legend.values()),
        list(legend),
        loc="upper center",
        fontsize=9,
        ncol=min(6, len(legend)),
        bbox_to_anchor=(0.5, 0.0),
        frameon=False,
    )
    return figure
