"""The exceptions and the warning class normlab raises.

Every problem with a caller's input is a :class:`NormlabError` subclass whose message names the
values involved. Each subclass also derives from the builtin exception a Python user would expect
(``ValueError`` for bad shapes and values, ``TypeError`` for bad dtypes and wrongly typed
arguments, ``LookupError`` for backends).
"""

from __future__ import annotations

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "BackendError",
    "DeviceError",
    "DtypeError",
    "LayoutError",
    "NormlabError",
    "NormlabWarning",
    "ShapeError",
]


class NormlabError(Exception):
    """Base class of every error normlab raises about its inputs or its backends."""


class ShapeError(NormlabError, ValueError):
    """Shapes, axes or ``normalized_shape`` do not fit together."""


class ArgumentError(NormlabError, ValueError):
    """An argument has a bad value (eps, out, an unknown keyword value)."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of the wrong type (``axis={"axis": -1}``, ``return_stats="yes"``, a list for
    eps): an :class:`ArgumentError` that is also a ``TypeError``, as NumPy and Keras raise for
    a wrongly typed argument (a wrong value of the right type is a ``ValueError``)."""


class DtypeError(NormlabError, TypeError):
    """An array has a dtype (or is a kind of array) that normlab does not accept."""


class LayoutError(DtypeError):
    """A tensor whose memory layout normlab cannot read (nested, sparse): a :class:`DtypeError`,
    so existing ``except DtypeError`` clauses keep catching it."""


class DeviceError(NormlabError, ValueError):
    """Arrays live on different devices or in different array libraries."""


class BackendError(NormlabError, LookupError):
    """No backend by that name, or the backend cannot serve this array."""


class NormlabWarning(UserWarning):
    """Base class of every warning normlab emits (bad plugins, bad ``NORMLAB_BACKEND``)."""
