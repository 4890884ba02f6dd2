"""A minimal normlab plugin: one backend, ``example``, in plain NumPy.

normlab finds this module through the ``normlab`` entry-point group and calls its hook. The hook
returns static metadata only; the arithmetic lives in :mod:`normlab_example.backend`, which
normlab imports the first time the backend is used.
"""

from __future__ import annotations

import normlab

__all__ = ["normlab_backends"]


@normlab.hookimpl
def normlab_backends() -> list[normlab.BackendRecord]:
    """The ``example`` backend: NumPy arrays on the CPU, every float dtype, low priority."""
    return [
        normlab.BackendRecord(
            name="example",
            module="normlab_example.backend",
            families=frozenset({"numpy"}),
            devices=frozenset({"cpu"}),
            dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
            priority=1,
            library="numpy",
            description="plain NumPy, shifted two-pass (the example plugin)",
        )
    ]
