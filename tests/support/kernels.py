"""Calling a built-in backend's op function directly, as the core does (kernel form 2: RMSNorm's
functions take no bias and return no mean), with the results by name."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from normlab.ops import OPS


def kernel_results(
    module: ModuleType, op: str, arrays: dict[str, Any], **keywords: Any
) -> dict[str, Any]:
    """``module``'s function of ``op`` on ``arrays`` (by name, in the op's ``kernel_arrays``;
    absent ones None) and ``keywords`` (``plan``, the outputs); each result by its name in the
    op's ``kernel_returns``, and None for ``mean`` where the op returns none (RMSNorm)."""
    table = OPS[op]
    results = getattr(module, op)(*(arrays.get(name) for name in table.kernel_arrays), **keywords)
    return {"mean": None} | dict(zip(table.kernel_returns, results, strict=True))
