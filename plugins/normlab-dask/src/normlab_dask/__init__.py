"""normlab-dask: a normlab backend for ``dask.array.Array``, registered through an entry point.

Importing this module does not import Dask: the record below is static metadata, and normlab
imports :mod:`normlab_dask.backend` (and with it Dask) only when the backend is first used.
"""

from __future__ import annotations

import importlib.util
from typing import Final

import normlab

__all__ = ["RECORD", "normlab_backends"]


def _check() -> str | None:
    """``None`` when Dask can be imported here, else why not."""
    if importlib.util.find_spec("dask") is None:
        return "dask is not installed"
    return None


RECORD: Final = normlab.BackendRecord(
    name="dask",
    module="normlab_dask.backend",
    families=frozenset({"dask"}),
    # Chunks are NumPy ("cpu") or CuPy ("cuda") arrays; each is served by normlab's dispatch.
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
    ops=frozenset({"layer_norm", "rms_norm"}),
    priority=10,
    # Dask arrays have no strides, and their results are lazy: no "out", "inplace", "strided".
    capabilities=frozenset(),
    check=_check,
    # how normlab reads dask arrays (a record field since normlab 0.2)
    inspector="normlab_dask.arrays:DaskInspector",
    library="dask",
    description="lazy dask graph: one normlab call per row chunk, on any scheduler",
)


@normlab.hookimpl
def normlab_backends() -> list[normlab.BackendRecord]:
    """The ``dask`` backend."""
    return [RECORD]
