"""PNG plots of a run: GB/s against hidden size, per backend, with the copy limit as a line.

One figure per op and dtype, one panel per row count (``[rows, hidden]`` inputs where the op
was measured at two or more hidden sizes), hidden sizes evenly spaced, GB/s on a log scale.
Backends are coloured lines (solid: allocating, dashed: ``out=``); the references are grey; the
copy limit is black (solid: ``x.copy()``, dashed: ``np.copyto``, forwards only)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from report import Row

__all__ = ["render"]

FORWARDS: Final = ("layer_norm", "rms_norm")
PANEL_COLUMNS: Final = 3
_REFERENCE_STYLE: Final = {
    "copy": {"color": "black", "linestyle": "-", "linewidth": 2.0},
    "copyto": {"color": "black", "linestyle": "--", "linewidth": 1.5},
    "torch": {"color": "0.45", "linestyle": ":", "marker": "s"},
    "textbook": {"color": "0.7", "linestyle": ":", "marker": "v"},
}


def render(
    rows: Sequence[Row], directory: Path, stem: str, titles: Mapping[str, str]
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
    return paths


def _figure(rows: list[Row], op: str, title: str, dtype: str) -> Any:
    by_rows: dict[int, list[Row]] = defaultdict(list)
    for row in rows:
        by_rows[row.shape[0]].append(row)
    panels = sorted(  # the copy limits alone make no line worth a panel
        n for n, group in by_rows.items() if len({r.shape[1] for r in group if r.op}) > 1
    )
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
        lines: dict[tuple[str, str, str], list[Row]] = defaultdict(list)
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
