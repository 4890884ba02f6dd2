"""normlab's public calls inside ``torch.compile``: one opaque node of dynamo's graph each.

Dynamo compiles a function by tracing the Python it calls. Traced, a normlab call would be
re-derived symbolically: validation, dispatch and the route with guards on normlab's caches,
the backends and numba's compiler behind them, graph breaks wherever those do what dynamo
cannot follow. So every public call asks :func:`traces` first. Dynamo runs that function for
real while it traces (``_dynamo_marked_constant``, what ``torch._dynamo.assume_constant_result``
sets) and takes its answer as a constant of the trace, so the compiled graph keeps no check;
outside a trace it answers False after one dictionary lookup (in a process that never loaded
``torch._dynamo``) or one flag read.

Answering True, it registers the core's node functions (:func:`register_node`) with
``torch.compiler.allow_in_graph`` the first time, and the call goes to its node: dynamo writes
the node into the graph as one call, without tracing it. What runs there is the call as it
runs outside a trace: with ``backend="eager"`` on the real tensors; under AOTAutograd
(``aot_eager``, inductor) on fake tensors, which reach normlab's custom ops
(:mod:`normlab.torch_ops`) or torch's own ops, so the graph AOTAutograd records holds those.
``torch.export`` (non-strict) and ``make_fx`` do not use dynamo: their fake tensors reach the
same ops through the node function, called as a plain function.

Importing this module imports nothing; torch's modules are read from ``sys.modules``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Final

__all__ = ["register_node", "traces"]

#: The module whose presence means dynamo may be tracing (it is loaded before any trace).
_DYNAMO: Final = "torch._dynamo"

#: The functions that dynamo keeps as single nodes, registered on the first trace.
_nodes: list[Callable[..., Any]] = []
_registered = False
#: ``torch.compiler.is_compiling``, looked up once torch._dynamo is loaded.
_is_compiling: Callable[[], bool] | None = None


def register_node(node: Callable[..., Any]) -> Callable[..., Any]:
    """Keep ``node`` as one node of dynamo's graphs (from the first trace on); returns it."""
    _nodes.append(node)
    if _registered:
        sys.modules["torch"].compiler.allow_in_graph(node)
    return node


def traces() -> bool:
    """Whether torch's compiler is tracing the caller: dynamo (which runs this function for
    real and keeps its answer as a constant), or an export or AOTAutograd trace. The first True
    registers the nodes with dynamo."""
    global _registered, _is_compiling
    if _DYNAMO not in sys.modules:
        return False
    if _is_compiling is None:
        _is_compiling = sys.modules["torch"].compiler.is_compiling
    if not _is_compiling():
        return False
    if not _registered:
        for node in _nodes:
            sys.modules["torch"].compiler.allow_in_graph(node)
        _registered = True
    return True


traces._dynamo_marked_constant = True  # type: ignore[attr-defined]
