"""How normlab reads ``jax.Array`` metadata, and the layout operations it performs on one.

Named by the record (``BackendRecord.inspector``); normlab imports it when it first meets a JAX
array, so JAX is imported already.
"""

from __future__ import annotations

from typing import Any

from normlab.arrays import ArrayInfo, Inspector

__all__ = ["JaxInspector"]


class JaxInspector(Inspector):
    """JAX arrays: immutable, no strides. A tracer (inside ``jit``/``grad``/``vmap``) has no
    concrete device and is named ``"<kind>:traced"``, a sharded array ``"<kind>:sharded"``
    (``<kind>`` is ``"cuda"`` for any GPU platform)."""

    def key(self, x: Any) -> tuple[Any, ...]:
        return (x.dtype, x.shape, self._device(x))

    def info(self, x: Any) -> ArrayInfo:
        device = self._device(x)
        return ArrayInfo(
            family="jax",
            type_name=self.type_name,
            dtype=x.dtype.name,
            shape=tuple(x.shape),
            strides=None,
            itemsize=x.dtype.itemsize,
            device=device,
            device_kind=device.split(":")[0],
            writeable=False,
        )

    def _device(self, x: Any) -> str:
        try:
            devices = x.devices()
        except Exception:  # a tracer: placement is decided by JAX when it runs
            import jax

            return f"{_kind(jax.default_backend())}:traced"
        if len(devices) != 1:
            return f"{_kind(next(iter(devices)).platform)}:sharded"
        device = next(iter(devices))
        return f"{_kind(device.platform)}:{device.id}"

    def permute(self, a: Any, order: tuple[int, ...]) -> Any:
        return a.transpose(order)


def _kind(platform: str) -> str:
    """normlab's device kind of a JAX platform name."""
    return "cuda" if platform in ("gpu", "cuda", "rocm") else platform
