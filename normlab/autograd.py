"""The core keeps torch's autograd graph, once, for backends that record none.

A backend that computes outside torch (numba on CPU tensors, the cupy backend's CUDA kernels)
returns tensors without a ``grad_fn``, and cannot run on the fake tensors that ``torch.compile``
and ``torch.export`` trace with. For such a backend (:attr:`normlab.dispatch.Choice.
records_no_graph`), when a tensor of the call requires grad or a torch trace is in progress, the
core runs the chosen backend through normlab's custom ops (:mod:`normlab.torch_ops`): validation
(spec) and dispatch ran once, for the caller's arguments; layout makes the rows as for any call;
the op rebuilds the backend's row plan from its scalar arguments and calls the backend's own
function. Backends never call up into torch integration.

Importing this module does not import torch; :func:`through_graph` imports
:mod:`normlab.torch_ops` the first time a call needs it.
"""

from __future__ import annotations

import sys

from normlab.dispatch import Choice
from normlab.hookspecs import Plan

__all__ = ["through_graph", "torch_tracing"]


def torch_tracing() -> bool:
    """Whether ``torch.compile`` or ``torch.export`` is tracing (torch's own flag, set for the
    whole compile, AOTAutograd included); False when torch is not imported."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.compiler.is_compiling())


def through_graph(plan: Plan, choice: Choice) -> Choice:
    """``choice``, or its backend run through normlab's custom ops when the backend records no
    graph and the call needs one (a tensor requires grad, or a torch trace is in progress)."""
    if choice.records_no_graph and (plan.requires_grad or torch_tracing()):
        from normlab import torch_ops

        return torch_ops.in_graph(choice)
    return choice
