"""normlab-jax: a normlab backend for ``jax.Array``, registered through the ``normlab`` entry point.

Importing this module does not import JAX: the record below is static metadata, and normlab
imports :mod:`normlab_jax.backend` (and with it JAX) only when the backend is first used.
"""

from __future__ import annotations

import importlib.util
from typing import Final

import normlab

__all__ = ["RECORD", "normlab_backends"]


def _check() -> str | None:
    """``None`` when JAX can be imported here, else why not."""
    for module in ("jax", "jaxlib"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    return None


RECORD: Final = normlab.BackendRecord(
    name="jax",
    module="normlab_jax.backend",
    families=frozenset({"jax"}),
    devices=frozenset({"cpu", "cuda"}),
    # float64 arrays exist only with jax_enable_x64; in JAX's default mode they cannot be made.
    dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
    ops=frozenset({"layer_norm", "rms_norm"}),
    priority=10,
    # JAX arrays are immutable and have no strides: no "out", "inplace", "strided".
    capabilities=frozenset(),
    check=_check,
    # XLA on the CPU flushes subnormal inputs and results to zero, and no flag turns that off
    # (normlab_jax.backend says more); a record speaks for every device its backend serves.
    flushes_subnormals=True,
    # how normlab reads jax arrays (a record field since normlab 0.2)
    inspector="normlab_jax.arrays:JaxInspector",
    library="jax",
    description="jax.jit-compiled XLA kernels on the array's device (CPU or GPU)",
)


@normlab.hookimpl
def normlab_backends() -> list[normlab.BackendRecord]:
    """The ``jax`` backend."""
    return [RECORD]
