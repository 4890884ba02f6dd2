"""How normlab reads ``dask.array.Array`` metadata, and the layout operations it performs on one.

Named by the record (``BackendRecord.inspector``); normlab imports it when it first meets a Dask
array, so Dask is imported already.
"""

from __future__ import annotations

from typing import Any

from normlab.arrays import ArrayInfo, Inspector, family_of

__all__ = ["DaskInspector"]


class DaskInspector(Inspector):
    """Dask arrays: lazy, immutable, no strides; the device is that of the chunk type
    (``_meta``): ``"cuda"`` for CuPy chunks, else ``"cpu"``."""

    def key(self, x: Any) -> tuple[Any, ...]:
        return (x.dtype, x.shape, type(getattr(x, "_meta", None)))

    def info(self, x: Any) -> ArrayInfo:
        device = "cuda" if family_of(getattr(x, "_meta", None)) == "cupy" else "cpu"
        return ArrayInfo(
            family="dask",
            type_name=self.type_name,
            dtype=x.dtype.name,
            shape=tuple(x.shape),
            strides=None,
            itemsize=x.dtype.itemsize,
            device=device,
            device_kind=device,
            writeable=False,
        )

    def permute(self, a: Any, order: tuple[int, ...]) -> Any:
        return a.transpose(order)
