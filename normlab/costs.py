"""Cost estimates that let the dispatcher pick the cheaper of two able backends.

A backend's :class:`~normlab.hookspecs.CostModel` for an op comes from, in order: the calibration
file ``normlab calibrate`` wrote on this machine (``costs.json`` in normlab's cache directory,
``$NORMLAB_CACHE_DIR/calibration``), else the model its record declares (the built-in backends
ship models measured on a 2-core x86-64 VM, ``normlab/backends/costs.json``). A call's estimate
depends on its metadata alone: the op, the dtype and the log2 bucket of x's size in bytes, never
on timings taken at call time — so a choice is cached, and the same call always goes to the same
backend on one machine.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from pathlib import Path
from typing import Any, Final, NamedTuple

from normlab.backends.cache_dirs import cache_root
from normlab.constants import ITEMSIZE
from normlab.errors import NormlabWarning
from normlab.hookspecs import CostModel, Plan, cost_table
from normlab.registry import Backend

__all__ = [
    "CALIBRATION_FILE",
    "THROUGH_GRAPH_US",
    "bucket",
    "calibration_path",
    "estimate_us",
    "model",
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


def bucket(plan: Plan) -> int:
    """The log2 bucket of x's size in bytes (``bit_length``): calls in one bucket cost alike."""
    return (plan.rows * plan.cols * ITEMSIZE[plan.dtype]).bit_length()


def estimate_us(backend: Backend, plan: Plan) -> float | None:
    """The estimated microseconds of ``plan`` on ``backend`` at the middle of its size bucket
    (plus :func:`through_graph_us` for tensors that require grad on a backend that records no
    graph), or None when the backend declares no model for the op or the dtype."""
    found = model(backend, plan.op, plan.family)
    if found is None:
        return None
    b = bucket(plan)
    x_bytes = 0.0 if b == 0 else 2.0 ** (b - 0.5)  # bytes in [2^(b-1), 2^b)
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
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value >= 0):
        raise ValueError(f"through_graph_us must be a finite number >= 0, got {value!r}")
    return float(value)


def reload() -> None:
    """Read the calibration file again on the next estimate (after ``normlab calibrate``)."""
    _calibrated.cache_clear()
