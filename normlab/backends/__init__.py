"""The built-in backends, registered through the same hook a third-party plugin implements.

Nothing here imports an array library: availability checks run lazily, when a backend is
first considered, and each backend module imports its library inside itself.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Final

from normlab.hookspecs import ARRAY_API, BackendRecord, CostModel, cost_table, hookimpl
from normlab.ops import BACKWARD_OPS, FORWARD_OPS, FUSED_OPS

__all__ = ["BUILTIN_RECORDS", "normlab_backends"]

_FLOATS: Final = frozenset({"float16", "bfloat16", "float32", "float64"})
_OPS: Final = frozenset(FORWARD_OPS + BACKWARD_OPS)
#: The fused residual-add ops; a backend without them is served by the core's composition.
_FUSED_OPS: Final = frozenset(FUSED_OPS)


def _shipped_costs() -> dict[str, dict[str, CostModel]]:
    """The built-in backends' cost models: ``normlab calibrate --backends numpy numba torch``
    on a 2-core x86-64 VM, idle, every op (the fused ones included), family and dtype, with the
    timings the estimates follow (``costs.json`` beside this module; a machine's own
    calibration replaces them)."""
    return cost_table(json.loads(Path(__file__).with_name("costs.json").read_text()))


_COSTS: Final = _shipped_costs()


def _installed(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed"
    return None


def _numpy_check() -> str | None:
    return None


def _numba_check() -> str | None:
    return _installed("numba")


def _torch_check() -> str | None:
    return _installed("torch")


def _cupy_check() -> str | None:
    missing = _installed("cupy")
    if missing:
        return missing
    from normlab.backends.cupy_backend import device_problem

    return device_problem()


BUILTIN_RECORDS: Final = (
    BackendRecord(
        name="numpy",
        module="normlab.backends.numpy_backend",
        families=frozenset({"numpy"}),
        devices=frozenset({"cpu"}),
        dtypes=_FLOATS,
        ops=_OPS | _FUSED_OPS,
        priority=10,
        capabilities=frozenset({"strided", "out", "inplace"}),
        check=_numpy_check,
        costs=_COSTS.get("numpy", {}),
        library="numpy",
        description="cache-blocked NumPy ufuncs; float32 accumulation for half types",
        kernel_form=2,
    ),
    BackendRecord(
        name="numba",
        module="normlab.backends.numba_backend",
        families=frozenset({"numpy"}),
        devices=frozenset({"cpu"}),
        dtypes=_FLOATS,
        priority=20,
        ops=_OPS | _FUSED_OPS,
        capabilities=frozenset(
            {
                "strided",
                "out",
                "inplace",
                "weight_offset",
                "parameter_dtypes",
                "residual_stream",
                "quantize",
            }
        ),
        zero_copy_families=frozenset({"torch"}),
        check=_numba_check,
        costs=_COSTS.get("numba", {}),
        library="numba",
        description="fused, parallel Numba JIT kernels (prange over rows)",
        kernel_form=2,
    ),
    BackendRecord(
        name="torch",
        module="normlab.backends.torch_backend",
        families=frozenset({"torch"}),
        devices=frozenset({"cpu", "cuda"}),
        dtypes=_FLOATS,
        ops=_OPS | _FUSED_OPS,
        priority=10,
        capabilities=frozenset({"autograd"}),
        check=_torch_check,
        costs=_COSTS.get("torch", {}),
        library="torch",
        description="torch.nn.functional.layer_norm (autograd kept)",
        kernel_form=2,
    ),
    BackendRecord(
        name="cupy",
        module="normlab.backends.cupy_backend",
        families=frozenset({"cupy"}),
        devices=frozenset({"cuda"}),
        dtypes=_FLOATS,
        ops=_OPS | _FUSED_OPS,
        priority=20,
        capabilities=frozenset({"row_strided", "out", "inplace", "weight_offset", "quantize"}),
        explicit_families=frozenset({"torch"}),
        check=_cupy_check,
        library="cupy-cuda13x",
        description="raw CUDA kernels compiled with NVRTC, loaded through CuPy",
        kernel_form=2,
    ),
    BackendRecord(
        name="array_api",
        module="normlab.backends.array_api_backend",
        # the arrays of any library exposing __array_namespace__ that normlab has no other
        # backend for; the lowest priority, so any backend listing the library itself wins
        families=frozenset({ARRAY_API}),
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({"float16", "float32", "float64"}),
        ops=_OPS,
        priority=-100,
        description="any Array API library's arrays, computed with its own namespace functions",
        # the library's own reductions: their order may follow the memory layout (NumPy's sums
        # over a transposed view differ in the last bits from those over C rows)
        batch_invariant=False,
        kernel_form=2,
    ),
)


@hookimpl
def normlab_backends() -> list[BackendRecord]:
    """The built-in backends."""
    return list(BUILTIN_RECORDS)
