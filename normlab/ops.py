"""The op table: for each op, what it computes (:class:`Arithmetic`), the role of every array it
takes, which output may alias which input and which input each gradient belongs to.
:mod:`normlab.spec` validates every op from this table and nothing else; a new op (a fused one)
is a new entry here plus its arithmetic in the backends. Every list of ops anywhere (the
backends', the suite's, the benchmarks') is derived from the table (:func:`names`). This is the
bottom layer: backends import it to read an op's arithmetic, never re-deriving it from the
op's name.

Roles of the array arguments:

- ``like_x``: the arrays of x's shape, dtype, library and device (``x`` among them). The core makes
  2-D rows of each (:func:`normlab.layout.rows`), without a copy where the backend reads them.
- ``stats``: statistics inputs, shaped as x with 1 on the normalized axes, in the stats dtype.
- ``per_feature``: arrays of the normalized shape (weight, bias), in x's dtype (or float32 for
  float16/bfloat16 x).

Outputs: ``outputs`` in the order the op returns them: x-like (``y``, ``h``, ``dx``: x's shape)
or per feature (``dweight``, ``dbias``: the normalized shape, in weight's dtype, x's without
weight); ``stats_outputs`` are returned too with ``return_stats=True``. ``output_arguments``
names the argument a caller passes each output's memory in (``out`` takes ``y``, and the
statistics when it is a tuple; ``residual_out`` takes ``h``). ``in_place`` lists the
``(output, input)`` pairs that may be the very same memory (an in-place call); any other overlap
between an output and an input, or between two outputs, is an ArgumentError.

The op's own function (:mod:`normlab.api`) takes ``arguments`` in this order (``backend``
aside): arrays by the roles above, and by name ``normalized_shape``/``axis`` (the normalized
axes), ``eps``, ``return_stats``/``return_residual`` (flags), ``out``/``residual_out``,
``needs`` (the gradients a backward call asks for), ``weight_offset``, ``casting`` and
``quantize``/``quantize_scale`` (quantized outputs, :mod:`normlab.quantize`). A backend's
function for the op takes ``kernel_arrays`` positionally (2-D rows, 1-D statistics and
parameters; an array the call lacks is None), then ``plan`` and, by keyword, its output arrays
(``out``, ``residual_out``) or ``needs``, and returns ``kernel_returns`` (see
:mod:`normlab.hookspecs`). RMSNorm's functions have no bias and no mean; a backend whose record
has ``kernel_form=1`` (every plugin written before that form) takes and returns LayerNorm's
slots instead, a bias always None and a mean None (:meth:`Op.kernel_arrays_of`).

A fused op names its ``base``: the op it applies after its own first step (``add_layer_norm``
normalizes ``h = x + residual`` as ``layer_norm`` does). Its gradients are the base op's
backward plus that step's, and a backend that provides the base op but not the fused one is
served by the core's composition (:mod:`normlab.composition`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

__all__ = ["BACKWARD_OPS", "FORWARD_OPS", "FUSED_OPS", "OPS", "Arithmetic", "Op", "names"]

#: The argument of a forward or fused op that carries each output's memory.
_FORWARD_OUTPUTS: Final = (("y", "out"), ("h", "residual_out"))
#: The norms: LayerNorm (the row's mean subtracted, scaled by ``1/sqrt(var + eps)``, weight and
#: bias) and RMSNorm (scaled by ``1/sqrt(mean(x^2) + eps)``, a weight, no bias).
NORMS: Final = ("layer", "rms")
#: The steps an op may take before its norm: ``"residual_add"``, ``h = x + residual`` rounded
#: to x's dtype (to the float32 stream's beside half x), normalized and returned.
PROLOGUES: Final = ("residual_add",)
#: The kernel forms a backend's record may declare (``BackendRecord.kernel_form``).
KERNEL_FORMS: Final = (1, 2)


@dataclass(frozen=True, slots=True)
class Arithmetic:
    """What an op computes, as data: its norm (:data:`NORMS`), its direction (``"forward"``:
    y from x; ``"backward"``: the gradients from dy), the steps before the norm
    (:data:`PROLOGUES`) and after it (``epilogues``: none among the table's ops)."""

    norm: str
    direction: str = "forward"
    prologue: tuple[str, ...] = ()
    epilogues: tuple[str, ...] = ()

    @property
    def centred(self) -> bool:
        """Whether the row's mean is subtracted (LayerNorm)."""
        return self.norm == "layer"

    @property
    def residual_add(self) -> bool:
        """Whether ``h = x + residual`` comes first (the fused ops)."""
        return "residual_add" in self.prologue


@dataclass(frozen=True, slots=True, eq=False)
class Op:
    """One row of the op table (see the module docstring for the roles). Compared and hashed
    by identity: each op is one entry of the table."""

    name: str
    arguments: tuple[str, ...]
    like_x: tuple[str, ...]
    per_feature: tuple[str, ...]
    outputs: tuple[str, ...]
    kernel_arrays: tuple[str, ...]
    kernel_returns: tuple[str, ...]
    arithmetic: Arithmetic
    #: Forward and fused ops: each input that has a gradient, and the gradient of the backward op
    #: it receives (a fused op's residual receives dx, as x; both also receive the gradient
    #: arriving at h: ``h = x + residual``).
    gradient_map: tuple[tuple[str, str], ...] = ()
    stats: tuple[str, ...] = ()
    stats_outputs: tuple[str, ...] = ()
    in_place: frozenset[tuple[str, str]] = frozenset()
    #: The eps a call without one gets; None: ``finfo(compute dtype).eps`` (float32's for half
    #: x, as torch's rms_norm). Backward ops take none.
    default_eps: float | None = None
    takes_eps: bool = True
    #: Backward ops: the gradients ``needs`` may name, in the order they are returned (the
    #: outputs, position by position).
    gradients: tuple[str, ...] = ()
    #: The outputs of the normalized shape (parameter gradients), in weight's dtype.
    per_feature_outputs: tuple[str, ...] = ()
    #: Fused ops: the op applied after the fused step (its backward op serves the gradients).
    base: str | None = None
    #: Each argument's position in ``arguments``.
    index: dict[str, int] = field(init=False, repr=False, compare=False)
    #: The arguments that carry the caller's output memory: argument name -> the output written
    #: there (``out`` -> ``y``, ``residual_out`` -> ``h``).
    output_arguments: dict[str, str] = field(init=False, repr=False, compare=False)
    #: The arguments that are arrays or hold the caller's output arrays, in argument order
    #: (what torch must see of a call: :func:`normlab.autograd.through_graph`).
    tensors: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        outputs = {arg: name for name, arg in _FORWARD_OUTPUTS if arg in self.arguments}
        arrays = {*self.like_x, *self.stats, *self.per_feature, *outputs}
        object.__setattr__(self, "index", {name: i for i, name in enumerate(self.arguments)})
        object.__setattr__(self, "output_arguments", outputs)
        object.__setattr__(
            self, "tensors", tuple(name for name in self.arguments if name in arrays)
        )

    @property
    def arrays(self) -> tuple[str, ...]:
        """Every array argument, in the order the op's function takes them."""
        return (*self.like_x, *self.stats, *self.per_feature)

    def returned(self, return_stats: bool, return_residual: bool) -> tuple[str, ...]:
        """The names of what the op's function returns, in order: the outputs (``h`` only with
        ``return_residual``), then the statistics with ``return_stats``. Forward and fused ops
        return a single result bare; backward ops always return the tuple of their gradients."""
        names = tuple(o for o in self.outputs if o != "h" or return_residual)
        return names + self.stats_outputs if return_stats else names

    @property
    def gradient_op(self) -> str | None:
        """The backward op that gives this forward or fused op's gradients (its base op's, for
        a fused op); None for a backward op."""
        return None if self.gradients else f"{self.base or self.name}_backward"

    @property
    def bare(self) -> bool:
        """Whether a single returned result is returned as itself, not in a tuple."""
        return not self.gradients

    def kernel_arrays_of(self, form: int) -> tuple[str, ...]:
        """The arrays a backend of kernel ``form`` takes: :attr:`kernel_arrays`, or in form 1
        a forward RMSNorm op's with LayerNorm's bias slot after the weight (always None)."""
        if form != 1 or self.arithmetic.norm != "rms" or self.arithmetic.direction != "forward":
            return self.kernel_arrays
        at = self.kernel_arrays.index("weight") + 1
        return (*self.kernel_arrays[:at], "bias", *self.kernel_arrays[at:])

    def kernel_returns_of(self, form: int) -> tuple[str, ...]:
        """What a backend of kernel ``form`` returns: :attr:`kernel_returns`, or in form 1 a
        forward RMSNorm op's with LayerNorm's mean before rstd (always None)."""
        if form != 1 or self.arithmetic.norm != "rms" or "rstd" not in self.kernel_returns:
            return self.kernel_returns
        at = self.kernel_returns.index("rstd")
        return (*self.kernel_returns[:at], "mean", *self.kernel_returns[at:])


OPS: Final = {
    op.name: op
    for op in (
        Op(
            "layer_norm",
            arguments=(
                "x",
                "normalized_shape",
                "weight",
                "bias",
                "eps",
                "axis",
                "return_stats",
                "out",
                "weight_offset",
                "quantize",
                "quantize_scale",
            ),
            like_x=("x",),
            per_feature=("weight", "bias"),
            outputs=("y",),
            kernel_arrays=("x", "weight", "bias"),
            kernel_returns=("y", "mean", "rstd"),
            arithmetic=Arithmetic("layer"),
            gradient_map=(("x", "x"), ("weight", "weight"), ("bias", "bias")),
            stats_outputs=("mean", "rstd"),
            in_place=frozenset({("y", "x")}),
            default_eps=1e-5,
        ),
        Op(
            "rms_norm",
            arguments=(
                "x",
                "normalized_shape",
                "weight",
                "eps",
                "axis",
                "return_stats",
                "out",
                "weight_offset",
                "casting",
                "quantize",
                "quantize_scale",
            ),
            like_x=("x",),
            per_feature=("weight",),
            outputs=("y",),
            kernel_arrays=("x", "weight"),
            kernel_returns=("y", "rstd"),
            arithmetic=Arithmetic("rms"),
            gradient_map=(("x", "x"), ("weight", "weight")),
            stats_outputs=("rstd",),
            in_place=frozenset({("y", "x")}),
        ),
        Op(
            "add_layer_norm",
            arguments=(
                "x",
                "residual",
                "normalized_shape",
                "weight",
                "bias",
                "eps",
                "axis",
                "return_stats",
                "return_residual",
                "out",
                "residual_out",
                "weight_offset",
                "quantize",
                "quantize_scale",
            ),
            like_x=("x", "residual"),
            per_feature=("weight", "bias"),
            outputs=("y", "h"),
            kernel_arrays=("x", "residual", "weight", "bias"),
            kernel_returns=("y", "h", "mean", "rstd"),
            arithmetic=Arithmetic("layer", prologue=("residual_add",)),
            gradient_map=(("x", "x"), ("residual", "x"), ("weight", "weight"), ("bias", "bias")),
            stats_outputs=("mean", "rstd"),
            in_place=frozenset({("y", "x"), ("y", "residual"), ("h", "residual"), ("h", "x")}),
            default_eps=1e-5,
            base="layer_norm",
        ),
        Op(
            "add_rms_norm",
            arguments=(
                "x",
                "residual",
                "normalized_shape",
                "weight",
                "eps",
                "axis",
                "return_stats",
                "return_residual",
                "out",
                "residual_out",
                "weight_offset",
                "casting",
                "quantize",
                "quantize_scale",
            ),
            like_x=("x", "residual"),
            per_feature=("weight",),
            outputs=("y", "h"),
            kernel_arrays=("x", "residual", "weight"),
            kernel_returns=("y", "h", "rstd"),
            arithmetic=Arithmetic("rms", prologue=("residual_add",)),
            gradient_map=(("x", "x"), ("residual", "x"), ("weight", "weight")),
            stats_outputs=("rstd",),
            in_place=frozenset({("y", "x"), ("y", "residual"), ("h", "residual"), ("h", "x")}),
            base="rms_norm",
        ),
        Op(
            "layer_norm_backward",
            arguments=(
                "dy",
                "x",
                "mean",
                "rstd",
                "weight",
                "normalized_shape",
                "axis",
                "needs",
                "weight_offset",
            ),
            like_x=("dy", "x"),
            stats=("mean", "rstd"),
            per_feature=("weight",),
            outputs=("dx", "dweight", "dbias"),
            kernel_arrays=("dy", "x", "mean", "rstd", "weight"),
            kernel_returns=("dx", "dweight", "dbias"),
            arithmetic=Arithmetic("layer", direction="backward"),
            takes_eps=False,
            gradients=("x", "weight", "bias"),
            per_feature_outputs=("dweight", "dbias"),
        ),
        Op(
            "rms_norm_backward",
            arguments=(
                "dy",
                "x",
                "rstd",
                "weight",
                "normalized_shape",
                "axis",
                "needs",
                "weight_offset",
            ),
            like_x=("dy", "x"),
            stats=("rstd",),
            per_feature=("weight",),
            outputs=("dx", "dweight"),
            kernel_arrays=("dy", "x", "rstd", "weight"),
            kernel_returns=("dx", "dweight"),
            arithmetic=Arithmetic("rms", direction="backward"),
            takes_eps=False,
            gradients=("x", "weight"),
            per_feature_outputs=("dweight",),
        ),
    )
}


def names(
    *, direction: str | None = None, norm: str | None = None, fused: bool | None = None
) -> tuple[str, ...]:
    """The names of the table's ops, in table order, whose arithmetic is of ``direction``
    (``"forward"``, fused ops included, or ``"backward"``), ``norm`` (:data:`NORMS`) and, with
    ``fused``, that add a residual first or not; None: any."""
    return tuple(
        name
        for name, op in OPS.items()
        if (direction is None or op.arithmetic.direction == direction)
        and (norm is None or op.arithmetic.norm == norm)
        and (fused is None or op.arithmetic.residual_add == fused)
    )


#: The forward ops without a prologue, the fused ops, the backward ops.
FORWARD_OPS: Final = names(direction="forward", fused=False)
FUSED_OPS: Final = names(direction="forward", fused=True)
BACKWARD_OPS: Final = names(direction="backward")
