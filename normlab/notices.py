"""The ``normlab.compile`` logger and the numba compile watcher, for the core and the tools.

Defined in :mod:`normlab.backends.compile_notices` (the backends report on it, and they import
nothing above them); this module re-exports its public names.
"""

from __future__ import annotations

from normlab.backends.compile_notices import (
    COMPILE_LOGGER,
    NOTICE_AFTER_S,
    compile_logger,
    compile_notices_silenced,
    watch_numba_compiles,
)

__all__ = [
    "COMPILE_LOGGER",
    "NOTICE_AFTER_S",
    "compile_logger",
    "compile_notices_silenced",
    "watch_numba_compiles",
]
