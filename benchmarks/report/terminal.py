"""The report of a saved run, and the comparison of two, on the terminal (rich)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table as RichTable

from benchmarks.report.metrics import REGRESSION_FLOOR, Change, compare, dispatch
from benchmarks.report.tables import Table, compare_table, machine, report_tables

__all__ = ["print_compare", "print_report", "to_rich"]


def to_rich(table: Table) -> RichTable:
    rich = RichTable(title=table.title, caption=table.note or None, title_justify="left")
    for i, header in enumerate(table.headers):
        rich.add_column(header, justify="left" if i < 2 else "right")
    for i, line in enumerate(table.body):
        rich.add_row(*line, style="red" if i in table.alerts else None)
    return rich


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
