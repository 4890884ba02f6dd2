"""Cost estimates that let the dispatcher pick the cheaper of two able backends.

A backend's :class:`~normlab.hookspecs.CostModel` for an op comes from, in order: the calibration
file ``normlab calibrate`` wrote on this machine (``costs.json`` in normlab's cache directory,
``$NORMLAB_CACHE_DIR/calibration``), else the model its record declares (the built-in backends
ship models measured on a 2-core x86-64 VM, ``normlab/backends/costs.json``). Estimates depend on
metadata alone (the op, the dtype, the size of x), never on timings taken at call time.

The choice compares backends over a call's whole row profile, not at its own size: for one op,
dtype and row length, :func:`profile_us` estimates every row count of :data:`GRID_ROWS`, so the
same backend serves every batch of that row length (batch invariance: a row's bits never depend
on the number of rows beside it). The dispatcher takes the backend whose worst ratio to the
fastest able backend, over those row counts, is the smallest.
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path
from typing import Any, Final, NamedTuple

from normlab.backends.cache_dirs import cache_root
from normlab.constants import ITEMSIZE
from normlab.errors import NormlabWarning
from normlab.hookspecs import CostModel, Plan, cost_table
from normlab.registry import Backend
from normlab.scalars import finite_float

__all__ = [
    "CALIBRATION_FILE",
    "GRID_BYTES",
    "GRID_ROWS",
    "THROUGH_GRAPH_US",
    "calibration_path",
    "estimate_us",
    "grid_rows",
    "model",
    "profile_us",
    "reload",
    "through_graph_us",
]

CALIBRATION_FILE: Final = "costs.json"
#: What a call on tensors that require grad costs more on a backend that records no graph
#: itself: the core runs it through normlab's torch custom ops, whose dispatch and backward
#: node cost about this much per training step (measured on the 2-core VM of the shipped
#: models: a 1×768 float32 forward and backward on numba 141 µs, on torch 38 µs). The cost
#: models time calls without grad; this keeps small training calls on torch, large ones where
#: the kernels win (8192×1024: numba 13.9 ms, torch 24.8 ms). ``normlab calibrate`` measures
#: it again on the user's machine (:func:`through_graph_us`).
THROUGH_GRAPH_US: Final = 100.0


#: The row counts a choice compares the backends at, for the call's row length: 1, 4, 16 …
#: 4^10 rows, those whose x stays within :data:`GRID_BYTES` (1 row always).
GRID_ROWS: Final = tuple(4**k for k in range(11))
#: The largest x the row profile looks at (1 GiB): beyond, every model is proportional to size.
GRID_BYTES: Final = 1 << 30


def grid_rows(cols: int, dtype: str) -> tuple[int, ...]:
    """The row counts of :data:`GRID_ROWS` whose x of ``cols`` elements per row of ``dtype``
    fits in :data:`GRID_BYTES` (at least one row)."""
    row_bytes = max(cols, 1) * ITEMSIZE[dtype]
    return tuple(r for r in GRID_ROWS if r == 1 or r * row_bytes <= GRID_BYTES)


def estimate_us(backend: Backend, plan: Plan) -> float | None:
    """The estimated microseconds of ``plan`` on ``backend`` (plus :func:`through_graph_us`
    for tensors that require grad on a backend that records no graph), or None when the backend
    declares no model for the op or the dtype, or the number of rows is symbolic (a trace with
    dynamic shapes: its value is not to be read). For explain(): the choice uses
    :func:`profile_us`."""
    if type(plan.rows) is not int or type(plan.cols) is not int:
        return None
    return _estimate(backend, plan, plan.rows * plan.cols * ITEMSIZE[plan.dtype])


def profile_us(backend: Backend, plan: Plan) -> tuple[float, ...] | None:
    """The estimates of ``plan``'s op on ``backend`` at each row count of :func:`grid_rows`
    (``plan``'s row length, dtype and graph need; its own number of rows plays no part), or
    None when the backend declares no model for the op or the dtype."""
    cols = int(plan.cols)  # a symbolic one (dynamic shapes) as its value
    row_bytes = cols * ITEMSIZE[plan.dtype]
    estimates = []
    for rows in grid_rows(cols, plan.dtype):
        estimate = _estimate(backend, plan, rows * row_bytes)
        if estimate is None:
            return None
        estimates.append(estimate)
    return tuple(estimates)


def _estimate(backend: Backend, plan: Plan, x_bytes: float) -> float | None:
    found = model(backend, plan.op, plan.family)
    if found is None:
        return None
    estimate = found.estimate_us(x_bytes, plan.dtype)
    if estimate is not None and plan.requires_grad and "autograd" not in backend.capabilities:
        estimate += through_graph_us()
    return estimate


def through_graph_us() -> float:
    """What a training call costs more through normlab's custom ops than on a backend that
    records its own graph: this machine's calibration, else :data:`THROUGH_GRAPH_US`."""
    measured = _calibrated().through_graph_us
    return THROUGH_GRAPH_US if measured is None else measured


def model(backend: Backend, op: str, family: str) -> CostModel | None:
    """``backend``'s cost model for ``op`` on arrays of ``family``: this machine's calibration,
    else its record's; the key ``"op:family"`` first (a zero-copy family may cost more per
    call), then ``"op"``."""
    for models in (_calibrated().models.get(backend.name, {}), backend.record.costs):
        found = models.get(f"{op}:{family}") or models.get(op)
        if found is not None:
            return found
    return None


def calibration_path() -> Path | None:
    """Where ``normlab calibrate`` writes and the dispatcher reads this machine's models."""
    root = cache_root("calibration")
    return None if root is None else root / CALIBRATION_FILE


class _Calibration(NamedTuple):
    """This machine's calibration file: cost models by backend and op, and the measured
    :func:`through_graph_us` (None where the file has none)."""

    models: dict[str, dict[str, CostModel]]
    through_graph_us: float | None


@functools.cache
def _calibrated() -> _Calibration:
    path = calibration_path()
    if path is None or not path.is_file():
        return _Calibration({}, None)
    try:
        data = json.loads(path.read_text())
        return _Calibration(cost_table(data), _through_graph(data))
    except (OSError, ValueError) as exc:
        warnings.warn(
            f"ignoring the calibration {path} ({exc}); run 'normlab calibrate' again",
            NormlabWarning,
            stacklevel=2,
        )
        return _Calibration({}, None)


def _through_graph(data: Any) -> float | None:
    value = data.get("through_graph_us")
    if value is None:
        return None
    return finite_float("through_graph_us", value, "finite and >= 0", at_least=0.0)


def reload() -> None:
    """Read the calibration file again on the next estimate (after ``normlab calibrate``)."""
    _calibrated.cache_clear()
