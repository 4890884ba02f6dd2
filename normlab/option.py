"""The interface of a call's options: what each option of the public functions declares.

An option (quantized outputs, a casting order, a float32 residual stream, parameters a backend
may not take as given) is one module that defines an :class:`Option`: the call fields that
make it apply, the record capabilities with which a backend serves it natively, what it
serves natively with a route of its own, how the core composes it otherwise, and the line
:func:`normlab.explain` prints for it. Options never import each other: their order, and how a
call is served when several apply, is :mod:`normlab.pipeline`'s alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from normlab.dispatch import Choice
from normlab.ops import Op
from normlab.spec import Call

__all__ = ["BaseRun", "Option"]

#: The public route of a call of an op from its arguments in table order: an option's
#: composition runs the calls it is made of through it (validated, chosen, seen by torch).
BaseRun = Callable[[Op, tuple[Any, ...]], Any]


@dataclass(frozen=True, slots=True)
class Option:
    """One option of a call.

    ``applies(call)``: whether ``call`` uses it. ``native(call, choice)``: whether the chosen
    backend, as the call runs it, serves it itself (its record declares one of
    ``capabilities``, plus the option's own conditions on the call). When every option of a
    call is native, the call runs on the backend's route: the option's ``serve(call, args,
    choice)`` where it has one (a backend function of its own), else the op's plain route.
    Otherwise the core composes the first option of the call: ``formed(call, args)`` gives
    the arguments every backend takes (the call then goes on as a call of those), or
    ``compose(call, args, choice, base_run)`` returns the call's results from calls of its
    own made through ``base_run``. ``describe(call, choice, native)`` is explain()'s line on
    it, after ``title``.
    """

    title: str
    capabilities: frozenset[str]
    applies: Callable[[Call], bool]
    native: Callable[[Call, Choice], bool]
    describe: Callable[[Call, Choice, bool], str]
    compose: Callable[[Call, tuple[Any, ...], Choice, BaseRun], Any] | None = None
    formed: Callable[[Call, tuple[Any, ...]], tuple[Any, ...]] | None = None
    serve: Callable[[Call, tuple[Any, ...], Choice], Any] | None = None

    def __post_init__(self) -> None:
        if (self.compose is None) == (self.formed is None):
            raise ValueError(f"option {self.title!r}: give one of compose and formed")
