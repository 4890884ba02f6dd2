"""normlab: one correct, fast LayerNorm (and RMSNorm) call for NumPy, PyTorch and CuPy arrays.

``normlab.layer_norm(x)`` picks a backend by the array's type and device and returns the same
kind of array. Backends are pluggy plugins; see :func:`list_backends` and :func:`explain`.
"""

from __future__ import annotations

from normlab.api import (
    add_layer_norm,
    add_rms_norm,
    explain,
    layer_norm,
    layer_norm_backward,
    rms_norm,
    rms_norm_backward,
)
from normlab.dispatch import current_preference, use_backend
from normlab.errors import (
    ArgumentError,
    ArgumentTypeError,
    BackendError,
    DeviceError,
    DtypeError,
    LayoutError,
    NormlabError,
    NormlabWarning,
    ShapeError,
)
from normlab.hookspecs import BackendRecord, Plan, hookimpl
from normlab.precompile import warmup
from normlab.registry import list_backends, plugin_failures, register_plugin, unregister_plugin

__version__ = "0.2.0.dev0"

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "BackendError",
    "BackendRecord",
    "DeviceError",
    "DtypeError",
    "LayoutError",
    "NormlabError",
    "NormlabWarning",
    "Plan",
    "ShapeError",
    "__version__",
    "add_layer_norm",
    "add_rms_norm",
    "current_preference",
    "explain",
    "hookimpl",
    "layer_norm",
    "layer_norm_backward",
    "list_backends",
    "plugin_failures",
    "register_plugin",
    "rms_norm",
    "rms_norm_backward",
    "unregister_plugin",
    "use_backend",
    "warmup",
]
