"""Deliberately wrong backends, to prove the conformance suite has teeth.

Two NumPy kernels, :func:`layer_norm` (the shifted two-pass formula) and :func:`rms_norm`, are
correct unless given a *flaw*; each flaw is one classic bug of one of them. :func:`plugin` makes
a real normlab plugin for one flaw: a module whose ``normlab_backends`` hook returns a record
named ``mutant_<flaw>`` that points at the module itself, which also holds the kernels and the
NumPy converters. A LayerNorm mutant provides layer_norm only; an RMSNorm mutant provides both
ops, its layer_norm correct, so that only the suite's rms_norm tests can fail it.
:func:`registered` registers a plugin for the duration of a ``with`` block.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import numpy as np

import normlab
from normlab.spec import Plan

#: flaw -> what the kernel then does wrong. ``control`` is the correct pair of kernels.
FLAWS: Final = {
    "control": "nothing: mean and population variance per row, shifted two-pass; mean square",
    "std_plus_eps": "divides by sqrt(var) + eps instead of sqrt(var + eps)",
    "ddof1": "uses the sample variance (divides by cols - 1)",
    "naive_moments": "computes var = E[x^2] - E[x]^2, in float32 whatever x's dtype",
    "batch_stats": "takes one mean and variance over the whole batch, not per row",
    "ignored_strides": "reads x's memory as if it were C-contiguous (while claiming 'strided')",
    "half_accumulation": "sums (and adds eps) in x's dtype, float16 included",
    "bias_without_weight": "ignores bias when weight is None",
    "rms_mean_subtracted": "RMSNorm that subtracts the mean (LayerNorm without bias)",
    "rms_variance": "RMSNorm that divides x by sqrt(var + eps), the variance, not the mean square",
    "rms_eps_outside_root": "RMSNorm that divides by sqrt(mean(x^2)) + eps",
}

#: The flaws proper (every one but the control).
MUTANTS: Final = tuple(flaw for flaw in FLAWS if flaw != "control")

#: The flaws of the RMSNorm kernel; the control has both ops too.
RMS_FLAWS: Final = frozenset(flaw for flaw in FLAWS if flaw.startswith("rms_"))


def layer_norm(
    x: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    *,
    plan: Plan,
    out: np.ndarray | None,
    flaw: str = "control",
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """LayerNorm of the rows of the 2-D ``x`` (normlab's backend contract), with ``flaw``."""
    compute = np.dtype(plan.compute_dtype)
    if flaw == "naive_moments":
        compute = np.dtype(np.float32)
    elif flaw == "half_accumulation":
        compute = x.dtype
    if flaw == "ignored_strides":
        x = _as_if_c_contiguous(x)
    xc = x.astype(compute)  # a copy: out may be x's own memory
    eps = compute.type(plan.eps)
    if flaw == "batch_stats":
        mean = np.full((plan.rows, 1), xc.mean(), compute)
        var = np.full((plan.rows, 1), ((xc - mean) ** 2).mean(), compute)
    elif flaw == "naive_moments":
        mean = xc.mean(axis=1, keepdims=True)
        var = (xc * xc).mean(axis=1, keepdims=True) - mean * mean
    else:
        x0 = xc[:, :1]
        mean = x0 + (xc - x0).sum(axis=1, keepdims=True, dtype=compute) / compute.type(plan.cols)
        squares = ((xc - mean) ** 2).sum(axis=1, keepdims=True, dtype=compute)
        var = squares / compute.type(plan.cols - 1 if flaw == "ddof1" else plan.cols)
    root = np.sqrt(var) + eps if flaw == "std_plus_eps" else np.sqrt(var + eps)
    rstd = 1 / root
    z = (xc - mean) * rstd
    if weight is not None:
        z = z * weight.astype(compute)
    if bias is not None and not (flaw == "bias_without_weight" and weight is None):
        z = z + bias.astype(compute)
    y = out if out is not None else np.empty(x.shape, x.dtype)
    y[...] = z
    if not plan.return_stats:
        return y, None, None
    return y, mean[:, 0].astype(plan.stats_dtype), rstd[:, 0].astype(plan.stats_dtype)


def rms_norm(
    x: np.ndarray,
    weight: np.ndarray | None,
    bias: None,
    *,
    plan: Plan,
    out: np.ndarray | None,
    flaw: str = "control",
) -> tuple[np.ndarray, None, np.ndarray | None]:
    """RMSNorm of the rows of the 2-D ``x``, ``x / sqrt(mean(x^2) + eps) * weight``, with
    ``flaw``."""
    compute = np.dtype(plan.compute_dtype)
    xc = x.astype(compute)  # a copy: out may be x's own memory
    eps = compute.type(plan.eps)
    n = compute.type(plan.cols)
    if flaw in ("rms_mean_subtracted", "rms_variance"):
        mean = xc.sum(axis=1, keepdims=True, dtype=compute) / n
        square = ((xc - mean) ** 2).sum(axis=1, keepdims=True, dtype=compute) / n
        if flaw == "rms_mean_subtracted":
            xc = xc - mean
    else:
        square = (xc * xc).sum(axis=1, keepdims=True, dtype=compute) / n
    root = np.sqrt(square) + eps if flaw == "rms_eps_outside_root" else np.sqrt(square + eps)
    rstd = 1 / root
    z = xc * rstd
    if weight is not None:
        z = z * weight.astype(compute)
    y = out if out is not None else np.empty(x.shape, x.dtype)
    y[...] = z
    if not plan.return_stats:
        return y, None, None
    return y, None, rstd[:, 0].astype(plan.stats_dtype)


def _as_if_c_contiguous(x: np.ndarray) -> np.ndarray:
    """x's memory read from its first element as C-contiguous rows, where that stays inside x's
    extent (transposed, sliced views); else x's elements in memory order (reversed, broadcast)."""
    if x.flags.c_contiguous:
        return x
    byte_bounds = getattr(np.lib, "array_utils", np).byte_bounds  # numpy 2 moved it
    low, high = byte_bounds(x)
    if x.__array_interface__["data"][0] == low and high - low >= x.nbytes:
        return np.lib.stride_tricks.as_strided(x, x.shape, (x.shape[1] * x.itemsize, x.itemsize))
    return np.ravel(x, order="K").reshape(x.shape)


def to_numpy(a: np.ndarray) -> np.ndarray:
    return np.asarray(a)


def from_numpy(a: np.ndarray, like: Any = None) -> np.ndarray:
    return np.array(a, copy=True)


def plugin(flaw: str) -> types.ModuleType:
    """A plugin module providing the backend ``mutant_<flaw>``; the module is its own backend
    module (``<this module>.<flaw>``, importable while :func:`registered`)."""
    module_name = f"{__name__}.{flaw}"
    module = types.ModuleType(module_name, f"A mutant that {FLAWS[flaw]}.")
    ops = {"layer_norm", "rms_norm"} if flaw in RMS_FLAWS | {"control"} else {"layer_norm"}
    record = normlab.BackendRecord(
        name=f"mutant_{flaw}",
        module=module_name,
        families=frozenset({"numpy"}),
        devices=frozenset({"cpu"}),
        dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
        ops=frozenset(ops),
        priority=-100,  # never chosen unless named
        capabilities=frozenset({"strided", "out", "inplace"}),
        description=f"a mutant for the suite's teeth: {FLAWS[flaw]}",
    )

    @normlab.hookimpl
    def normlab_backends() -> list[normlab.BackendRecord]:
        return [record]

    module.normlab_backends = normlab_backends  # type: ignore[attr-defined]
    module.layer_norm = functools.partial(layer_norm, flaw=flaw)  # type: ignore[attr-defined]
    module.rms_norm = functools.partial(rms_norm, flaw=flaw)  # type: ignore[attr-defined]
    module.to_numpy = to_numpy  # type: ignore[attr-defined]
    module.from_numpy = from_numpy  # type: ignore[attr-defined]
    return module


@contextmanager
def registered(flaw: str) -> Iterator[str]:
    """Register the plugin of ``flaw`` and yield its backend name; unregister on exit."""
    module = plugin(flaw)
    sys.modules[module.__name__] = module
    normlab.register_plugin(module)
    try:
        yield f"mutant_{flaw}"
    finally:
        normlab.unregister_plugin(module)
        del sys.modules[module.__name__]
