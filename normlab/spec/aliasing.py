"""Memory: outputs that overlap themselves, each other or the inputs.

:func:`overlaps_itself` is decided from an output's shape and strides alone (a rule of the
call's metadata). :func:`output_aliasing` is decided per call (addresses are not metadata), and
only when the caller passes an output: the call without ``out`` never reaches it. Both read only
each array's address, shape and strides, never its data.
"""

from __future__ import annotations

from typing import Any, Final, Literal

from normlab import arrays
from normlab.errors import ArgumentError
from normlab.ops import Op

__all__ = ["OVERLAP_MAX_WORK", "Aliasing", "output_aliasing", "overlaps_itself", "shares_memory"]


def overlaps_itself(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether an array of ``shape`` and ``strides`` (in elements) may place two of its
    elements at one address: unless, with its axes of more than one element sorted by stride,
    each stride reaches past the span of the axes before it (the test of torch's and NumPy's
    output checks for strided views; a layout interleaving its axes without overlapping, such
    as strides (2, 3) on shape (3, 2), counts as overlapping too)."""
    axes = sorted((abs(st), n) for st, n in zip(strides, shape, strict=True) if n > 1)
    if not axes or 0 in shape:
        return False
    span = 1  # elements from the first to one past the last, over the axes so far
    for stride, n in axes:
        if stride < span:
            return True
        span += (n - 1) * stride
    return False


#: Bound on the work of one exact overlap test (``numpy.shares_memory(max_work=...)``).
OVERLAP_MAX_WORK: Final = 1 << 16

#: What :func:`output_aliasing` found: ``y`` is written directly (``"separate"``), in place
#: (``"in_place"``: ``out is x``), or through a temporary because an overlap with an input could
#: not be ruled out within :data:`OVERLAP_MAX_WORK` (``"temporary"``).
Aliasing = Literal["separate", "in_place", "temporary"]


def output_aliasing(op: Op, inputs: dict[str, Any], outputs: dict[str, Any]) -> Aliasing:
    """Check that no output shares memory with an input or with another output, except the
    pairs the op table lists as ``in_place`` for ``op`` when they are the same array (the same
    object, or views of exactly the same elements).

    ``inputs``/``outputs`` map names (``x``, ``weight``, ``bias``; ``y``, ``mean``, ``rstd``) to
    arrays or None. Bounds that lie apart settle the call (:func:`_apart`); else the test is
    exact (element by element, never refusing by bounds: :func:`_exact_aliasing`). It reads
    only each array's address, shape and strides — never its data — and is bounded in work.
    Statistics outputs are always written after the kernel has read every input, so only the
    x-like outputs (``y``; a fused op's ``h``) need a temporary when an overlap is undecided.
    Raises ArgumentError naming both arrays.
    """
    allowed = op.in_place
    given_in = [(n, a) for n, a in inputs.items() if a is not None]
    given_out = [(n, o) for n, o in outputs.items() if o is not None]
    settled = _apart(allowed, given_in, given_out)
    return settled if settled is not None else _exact_aliasing(op, given_in, given_out)


def _exact_aliasing(
    op: Op, given_in: list[tuple[str, Any]], given_out: list[tuple[str, Any]]
) -> Aliasing:
    """:func:`output_aliasing` by the exact test of every pair of the given (named, not None)
    inputs and outputs."""
    allowed = op.in_place
    result: Aliasing = "separate"
    seen: dict[Any, Any] = {}
    for i, (name, o) in enumerate(given_out):
        for other_name, other in given_out[:i]:
            if other is o or shares_memory(o, other, seen) is not False:
                raise ArgumentError(
                    f"{_output_argument(name)} and {_output_argument(other_name)} share memory; "
                    "pass separate arrays"
                )
        for in_name, a in given_in:
            if (name, in_name) in allowed and (o is a or _same_elements(o, a, seen)):
                result = "temporary" if result == "temporary" else "in_place"
                continue
            shared = shares_memory(o, a, seen)
            if shared is None and name in op.outputs:
                result = "temporary"
            elif shared:
                argument = "residual_out" if name == "h" else "out"
                hint = f" ({argument}={in_name} itself is an in-place call)"
                hint = hint if (name, in_name) in allowed else ""
                raise ArgumentError(
                    f"{_output_argument(name)} shares memory with {in_name}{hint}; pass a "
                    "separate array"
                )
    return result


def _apart(
    allowed: Any, given_in: list[tuple[str, Any]], given_out: list[tuple[str, Any]]
) -> Aliasing | None:
    """:func:`output_aliasing`'s answer where bounds settle it: every output's bytes lie apart
    from every other output's and input's (``numpy.may_share_memory`` for NumPy arrays, the
    inspectors' extents, each read once, for the others), but for outputs that are the very
    input objects ``allowed`` lets them be (then ``"in_place"``). None when some bounds meet:
    the exact test decides."""
    np = _numpy()
    named = (*given_out, *given_in)
    spans: list[Any] | None = None  # None: all exact ndarrays
    for _, a in named:
        if type(a) is not np.ndarray:
            spans = [arrays.inspector(type(b)).extent(b) for _, b in named]
            break
    may_share = np.may_share_memory
    result: Aliasing = "separate"
    for i, (name, o) in enumerate(given_out):
        span = None if spans is None else spans[i]  # [first, last + 1) bytes; None: none
        for j, (other_name, other) in enumerate(named):
            if j == i:
                continue
            if other is o:
                if (name, other_name) not in allowed:
                    return None
                result = "in_place"
            elif spans is None:
                if may_share(o, other):
                    return None
            elif (
                span
                and (other_span := spans[j])
                and span[0] < other_span[1]
                and other_span[0] < span[1]
            ):
                return None
    return result


def _output_argument(name: str) -> str:
    """The argument an output arrives in: ``residual_out`` for a fused op's ``h``, else
    ``out (name)``."""
    return "residual_out" if name == "h" else f"out ({name})"


def shares_memory(a: Any, b: Any, seen: dict[Any, Any] | None = None) -> bool | None:
    """Whether ``a`` and ``b`` have an element in common; None when undecided within
    :data:`OVERLAP_MAX_WORK`. Arrays without addressable memory (JAX, Dask) share none.
    ``seen`` keeps each array's extent and memory for the other pairs of one call."""
    np = _numpy()
    if type(a) is np.ndarray and type(b) is np.ndarray:  # the common case: no layouts to read
        if not np.may_share_memory(a, b):  # bounds only: cheap
            return False
        va, vb = (v.view(f"u{v.itemsize}") for v in (a, b))  # bfloat16 as integers
    else:
        seen = {} if seen is None else seen
        ea, eb = _extent(a, seen), _extent(b, seen)
        if ea is None or eb is None or not (ea[0] < eb[1] and eb[0] < ea[1]):
            return False  # bounds only: cheap
        va, vb = _memory_view(_memory(a, seen)), _memory_view(_memory(b, seen))
    try:
        return bool(np.shares_memory(va, vb, max_work=OVERLAP_MAX_WORK))
    except np.exceptions.TooHardError:
        return None


def _same_elements(a: Any, b: Any, seen: dict[Any, Any]) -> bool:
    """Whether ``a`` and ``b`` are views of the very same elements (same first address, shape,
    strides and item size): ``out=x[:, ::2]`` for ``x[:, ::2]`` is an in-place call."""
    np = _numpy()
    if type(a) is np.ndarray and type(b) is np.ndarray and not np.may_share_memory(a, b):
        return False  # bounds only: cheap, and no layouts to read
    extent = _extent(a, seen)
    if extent is None or extent != _extent(b, seen):  # the same elements span the same bytes
        return False
    return bool(_memory(a, seen) == _memory(b, seen))


def _extent(a: Any, seen: dict[Any, Any]) -> tuple[int, int] | None:
    """The bytes ``[first, last + 1)`` ``a`` spans (None: no addressable element), read once per
    array and call."""
    key = id(a)
    if key not in seen:
        seen[key] = arrays.inspector(type(a)).extent(a)
    return seen[key]  # type: ignore[no-any-return]


def _memory(a: Any, seen: dict[Any, Any]) -> arrays.Memory:
    """``a``'s memory (an array :func:`_extent` found elements in), read once per array and
    call."""
    key = (id(a), "memory")
    if key not in seen:
        seen[key] = arrays.inspector(type(a)).memory(a)
    return seen[key]  # type: ignore[no-any-return]


class _AddressOnly:
    """An object NumPy reads as an array at a raw address (``__array_interface__``): NumPy's
    overlap solver sees the address, shape and strides; the memory itself is never read."""

    __slots__ = ("__array_interface__",)

    def __init__(self, interface: dict[str, Any]) -> None:
        self.__array_interface__ = interface


def _memory_view(layout: arrays.Memory) -> Any:
    """A NumPy array of unsigned integers at ``layout``'s address (any family, any device;
    device addresses are only compared, never dereferenced)."""
    address, shape, strides, itemsize = layout
    interface = {
        "version": 3,
        "shape": shape,
        "typestr": f"<u{itemsize}",
        "data": (address, True),
        "strides": strides,
    }
    return _numpy().asarray(_AddressOnly(interface))


def _numpy() -> Any:
    import numpy

    return numpy
