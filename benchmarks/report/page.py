"""``docs/performance.md``, the performance page, from one or more saved runs.

The page's prose is in ``templates/``: ``performance.md.in`` is the page, a
:class:`string.Template` whose ``$names`` this module fills in with the runs' facts, tables and
figures; ``performance-*.md.in`` are the paragraphs that only some pages carry. A line of a
template that holds a ``$name`` alone is a block of generated lines: each block ends with a
blank line, and an empty one (a section with nothing to show) leaves no line at all.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from string import Template
from typing import Any, Final

from benchmarks.report.metrics import FUSED_TARGETS, peer_gaps, rows
from benchmarks.report.runs import OP_TITLES, PEERS, calls, ops
from benchmarks.report.tables import (
    detail_table,
    dispatch_table,
    key_table,
    machine,
    memory_table,
    option_table,
    peer_gap_table,
    peer_summary_table,
    quantized_table,
    skipped_table,
    to_markdown,
)

__all__ = ["FULL_BUDGET_MINUTES", "TEMPLATES", "docs_page", "fill", "sections"]

TEMPLATES: Final = Path(__file__).with_name("templates")
#: The full matrix's time budget (minutes): the default of benchmarks/conftest.py's SETTINGS.
FULL_BUDGET_MINUTES: Final = 45.0
#: A template line holding a ``$name`` alone: a block, whose lines carry their own line ends.
_BLOCK_LINE: Final = re.compile(r"^(\$\w+)\n", re.MULTILINE)


def fill(name: str, **values: str) -> str:
    """The template ``templates/<name>.md.in`` with its ``$names`` filled in from ``values``."""
    text = (TEMPLATES / f"{name}.md.in").read_text(encoding="utf-8")
    return Template(_BLOCK_LINE.sub(r"\1", text)).substitute(values)


def sections(runs: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Which run each op's numbers come from: the first of ``runs`` that measured it."""
    chosen: dict[str, int] = {}
    for i, run in enumerate(runs):
        for op in ops(calls(run)):
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
    return fill(
        "performance",
        sources=" ".join(sources),
        fused_large=f"{FUSED_TARGETS['large']:g}",
        fused_small=f"{FUSED_TARGETS['small']:g}",
        budget_minutes=f"{FULL_BUDGET_MINUTES:.0f}",
        runs=_block(
            *[f"| {OP_TITLES.get(op, op)} | `{sources[i]}` |" for op, i in chosen.items()], ""
        ),
        notes=_block(*_notes(runs, used)),
        machines=_block(*[line for i in used for line in _machine(*runs[i])]),
        ops=_block(*[line for op, i in chosen.items() for line in _section(op, *runs[i], images)]),
        default_vs_peers=_block(*_default_vs_peers(runs, chosen)),
        extras=_block(*_extras(runs)),
        details=_block(*_details(runs, chosen)),
        skipped=_block(*[line for i in used for line in _skipped(*runs[i])]),
        used_sources=", ".join(f"`{sources[i]}`" for i in used),
    )


def _block(*lines: str) -> str:
    """``lines``, each followed by a line end (an entry of several lines, a table, too)."""
    return "".join(f"{line}\n" for line in lines)


def _paragraph(name: str, **values: str) -> str:
    """The template ``name``: one paragraph, without its line end."""
    return fill(name, **values).removesuffix("\n")


def _collapsed(title: str, markdown: str) -> list[str]:
    """``markdown`` in a collapsed note titled ``title``."""
    indented = [f"    {line}" if line else "" for line in markdown.splitlines()]
    return [f'??? note "{title}"', "", *indented, ""]


def _notes(runs: Sequence[tuple[str, dict[str, Any]]], used: Iterable[int]) -> list[str]:
    """What the page says of runs without the peers, and of quick runs."""
    lines = []
    measured_peers = any(
        r.kind == "reference" and r.subject in PEERS[1:] for i in used for r in calls(runs[i][1])
    )
    if not measured_peers:
        lines += [_paragraph("performance-without-peers"), ""]
    quick = [runs[i][0] for i in used if runs[i][1].get("normlab", {}).get("matrix") == "quick"]
    if quick:
        named = ", ".join(f"`{q}`" for q in quick)
        lines += [_paragraph("performance-quick-runs", quick_runs=named), ""]
    return lines


def _machine(source: str, run: dict[str, Any]) -> list[str]:
    """The machine and software of ``run``."""
    pairs = [f"| {what} | {value} |" for what, value in machine(run)]
    return [f"### `{source}`", "", "| | |", "|---|---|", *pairs, ""]


def _section(
    op: str, source: str, run: dict[str, Any], images: Mapping[str, Sequence[str]]
) -> list[str]:
    """The section of ``op``: its key table and its plots."""
    lines = [f"## {OP_TITLES.get(op, op)}", "", f"From `{source}`.", ""]
    lines.append(to_markdown(key_table(rows(run), op), 0))
    if images.get(op):
        lines += [f"![{Path(image).stem}]({image})" for image in images[op]]
        lines.append("")
    return lines


def _default_vs_peers(
    runs: Sequence[tuple[str, dict[str, Any]]], chosen: Mapping[str, int]
) -> list[str]:
    """normlab's default against the fastest peer, for the ops whose runs measured peers."""
    gaps = [g for op, i in chosen.items() for g in peer_gaps(rows(runs[i][1])) if g.row.op == op]
    if not gaps:
        return []
    summary, behind = peer_summary_table(gaps), peer_gap_table(gaps)
    lines = [f"## {summary.title}", "", _paragraph("performance-default-vs-peers"), ""]
    return [*lines, to_markdown(summary, 0), *_collapsed(behind.title, to_markdown(behind, 0))]


def _extras(runs: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """Dispatch overhead and peak memory (LayerNorm forward), the options of real models' norms
    and the norms with quantized outputs, each from the first run with it."""
    lines = []
    for make in (dispatch_table, memory_table, option_table, quantized_table):
        found = next(((source, t) for source, run in runs if (t := make(run)).body), None)
        if found is not None:
            source, table = found
            plain = make in (option_table, quantized_table)
            intro = "From" if plain else "LayerNorm forward, from"
            lines += [f"## {table.title}", "", f"{intro} `{source}`.", ""]
            lines.append(to_markdown(table, 0))
    return lines


def _details(runs: Sequence[tuple[str, dict[str, Any]]], chosen: Mapping[str, int]) -> list[str]:
    """Every backend call, per op and dtype, in collapsed notes."""
    lines = []
    for op, i in chosen.items():
        all_rows = rows(runs[i][1])
        for dtype in dict.fromkeys(r.dtype for r in all_rows if r.op == op):
            markdown = to_markdown(detail_table(all_rows, op, dtype), 0)
            lines += _collapsed(f"{OP_TITLES.get(op, op)}, {dtype}", markdown)
    return lines


def _skipped(source: str, run: dict[str, Any]) -> list[str]:
    """What ``run`` did not measure, and why."""
    return [f"In `{source}`:", "", to_markdown(skipped_table(run), 0)]
