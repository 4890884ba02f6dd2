"""The ordered options of a call, and which of them the core composes.

The options (:class:`normlab.option.Option`) in the order their compositions nest: quantized
outputs (their y is the op's, every other option included), the casting order, the float32
residual stream, the parameters. A call runs as :func:`resolve` says, and
:func:`normlab.explain` says it from the same :class:`Step`:

- every option of the call native on the chosen backend (as the call runs it, and the op not
  composed from its base op): the backend serves the call, through the first option's own
  ``serve`` where one has it, else the op's plain route;
- else the first option of the call, in this order, is composed by the core; the calls it is
  made of go through the public route again, where the next option is decided in turn.

The step is decided once per kind of call and backend (cached on the validated call): a repeat
call iterates no options.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from normlab import casting, parameters, quantize, residual_stream
from normlab.dispatch import Choice
from normlab.option import Option
from normlab.spec import Call

__all__ = ["CAPABILITIES", "PIPELINE", "Step", "resolve"]

PIPELINE: Final = (quantize.OPTION, casting.OPTION, residual_stream.OPTION, parameters.OPTION)
#: Every record capability with which a backend serves an option natively.
CAPABILITIES: Final = frozenset().union(*(option.capabilities for option in PIPELINE))


@dataclass(frozen=True, slots=True)
class Step:
    """How a call with options runs: ``options`` (those of the call, in pipeline order) all
    ``native``, served through ``option`` (one with a ``serve`` of its own; None: the plain
    route), or ``option`` (the first of ``options``) composed by the core."""

    options: tuple[Option, ...]
    native: bool
    option: Option | None


def resolve(call: Call, choice: Choice, composed: bool) -> Step:
    """The :class:`Step` of ``call`` on ``choice`` (the backend as the call runs it);
    ``composed``: the core composes the fused op from its base op, so no option is native."""
    key = ("pipeline", choice.backend, composed)
    step: Step | None = call.routes.get(key)
    if step is None:
        options = tuple(option for option in PIPELINE if option.applies(call))
        native = not options or (
            not composed and all(option.native(call, choice) for option in options)
        )
        if native:
            step = Step(options, True, next((o for o in options if o.serve is not None), None))
        else:
            step = Step(options, False, options[0])
        call.routes[key] = step
    return step
