"""Test cases: one :class:`Case` describes a call completely, so any failure can be rerun.

A case names the op (``layer_norm`` or ``rms_norm``), the shape, dtype, kind of values and seed
of ``x``, the normalized axes, the affine parameters, ``eps`` and the memory layout.
:meth:`Case.inputs` builds the arrays of any backend's family through the record's
``from_numpy`` (or the family the backend is driven with, see
:func:`normlab.testing.conversions.drive`); :meth:`Case.expected` is the float64 reference;
:meth:`Case.check` runs the backend and compares, and its failure message is a runnable snippet
(:meth:`Case.snippet`).

The named cases of the design (section 6) are values kinds here (``"offset"``,
``"far_offset"``, ``"constant"``, ``"zeros"``, ``"near_max"``, ``"worked"``, ``"nan_inf"``) plus
the row lengths in :data:`AWKWARD_COLS`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

import normlab
from normlab import reference
from normlab.ops import FORWARD_OPS
from normlab.ops import OPS as TABLE
from normlab.testing.conversions import (
    LAYOUTS,
    LayoutUnavailable,
    arrange,
    conversion,
    driven_family,
    finfo,
    numpy_dtype,
)
from normlab.testing.default_choice import call_backend, flushes_subnormals
from normlab.testing.tolerances import assert_close, conditioning, y_scale

__all__ = [
    "AWKWARD_COLS",
    "LAYOUTS",
    "OPS",
    "POISONED",
    "VALUES",
    "Case",
    "LayoutUnavailable",
    "arrange",
    "numpy_dtype",
    "same_kind",
]

#: The ops the suite tests, each where the backend's record lists it.
OPS: Final = FORWARD_OPS

#: Row lengths that do not fit vector widths, warps or blocks.
AWKWARD_COLS: Final = (1, 3, 17, 127, 1000, 4097)

#: Kinds of values; the first six are drawn at random, the rest are named cases.
VALUES: Final = (
    "normal",  # standard normal
    "offset",  # 100 + 0.01 * normal: defeats E[x^2] - E[x]^2 in float32
    "rowwise",  # each row its own mean (-10..10) and scale (1e-2..1e2): defeats batch statistics
    "tiny",  # 1e-3 * normal: eps is no longer negligible
    "large",  # 1e3 * normal
    "integers",  # small integers: exact sums, ties, sometimes constant rows
    "constant",  # each row one value (its own): LayerNorm gives exactly bias when eps > 0
    "zeros",  # all zero
    "near_max",  # magnitudes 55000..65000 with both signs: float16 sums of squares overflow
    "far_offset",  # 1e4 + normal: the same in float32; its squares overflow float16
    "worked",  # every row [1, 3, 5, 7, ...] (the seed's worked example)
    "nan_inf",  # normal, with a NaN in row 1, +inf in row 2, -inf in row 3
    "subnormal",  # normal scaled to half the dtype's smallest normal: mostly subnormal values
    "dtype_max",  # both signs, magnitudes a quarter to a half of the dtype's max: sums overflow
    "unit_uniform",  # uniform in [0, 1) (Transformer Engine's test inputs): with eps 0.3 eps
    # dominates every row's variance
    "some_constant",  # normal, every other row one value (its own)
)

#: Poisoned rows of the ``"nan_inf"`` values: row -> the value put in it.
POISONED: Final = {1: float("nan"), 2: float("inf"), 3: float("-inf")}


def _values(kind: str, rows: int, cols: int, rng: np.random.Generator, dtype: str) -> np.ndarray:
    """``(rows, cols)`` float64 values of ``kind`` (see :data:`VALUES`) for x of ``dtype``."""
    shape = (rows, cols)
    if kind == "subnormal":
        return float(finfo(dtype).tiny) / 2 * rng.standard_normal(shape)
    if kind == "dtype_max":
        peak = float(finfo(dtype).max)
        return rng.choice([-1.0, 1.0], shape) * rng.uniform(peak / 4, peak / 2, shape)
    if kind == "normal":
        return rng.standard_normal(shape)
    if kind == "offset":
        return 100.0 + 0.01 * rng.standard_normal(shape)
    if kind == "far_offset":
        return 1e4 + rng.standard_normal(shape)
    if kind == "rowwise":
        centre = rng.uniform(-10.0, 10.0, (rows, 1))
        return centre + 10.0 ** rng.uniform(-2.0, 2.0, (rows, 1)) * rng.standard_normal(shape)
    if kind == "tiny":
        return 1e-3 * rng.standard_normal(shape)
    if kind == "large":
        return 1e3 * rng.standard_normal(shape)
    if kind == "integers":
        return rng.integers(-4, 5, shape).astype(np.float64)
    if kind == "constant":
        return np.repeat(rng.uniform(-50.0, 50.0, (rows, 1)), cols, axis=1)
    if kind == "unit_uniform":
        return rng.uniform(0.0, 1.0, shape)
    if kind == "some_constant":
        x = rng.standard_normal(shape)
        x[1::2] = rng.uniform(-50.0, 50.0, (rows // 2, 1))
        return x
    if kind == "zeros":
        return np.zeros(shape)
    if kind == "near_max":
        return rng.choice([-1.0, 1.0], shape) * rng.uniform(55000.0, 65000.0, shape)
    if kind == "worked":
        return np.tile(np.arange(1.0, 2.0 * cols, 2.0), (rows, 1))
    if kind == "nan_inf":
        x = rng.standard_normal(shape)
        for row, value in POISONED.items():
            if row < rows:
                x[row, rng.integers(cols)] = value
        return x
    raise ValueError(f"unknown values kind {kind!r}; known: {', '.join(VALUES)}")


@dataclass(frozen=True)
class Case:
    """One call of ``layer_norm`` or ``rms_norm`` (``op``), completely described by plain values
    (its repr is code).

    ``weight``/``bias`` are the parameters' dtypes, or None for no parameter (rms_norm has no
    bias). ``eps=None`` is rms_norm's default (finfo of the compute dtype). Values come from
    ``numpy.random.default_rng(seed)``; the layout changes strides, never values.
    """

    shape: tuple[int, ...]
    dtype: str = "float32"
    values: str = "normal"
    seed: int = 0
    normalized_shape: int | tuple[int, ...] | None = None
    axis: int | tuple[int, ...] | None = None
    weight: str | None = None
    bias: str | None = None
    eps: float | None = 1e-5
    layout: str = "c"
    return_stats: bool = True
    op: str = "layer_norm"

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown op {self.op!r}; known: {', '.join(OPS)}")
        if self.op == "rms_norm" and self.bias is not None:
            raise ValueError("an rms_norm case has no bias")
        if self.op == "layer_norm" and self.eps is None:
            raise ValueError("a layer_norm case needs an eps")

    @property
    def axes(self) -> tuple[int, ...]:
        """The normalized axes, sorted and non-negative."""
        return reference.normalized_axes(len(self.shape), self.normalized_shape, self.axis)

    @property
    def batch_axes(self) -> tuple[int, ...]:
        return tuple(a for a in range(len(self.shape)) if a not in self.axes)

    @property
    def rows(self) -> int:
        return int(np.prod([self.shape[a] for a in self.batch_axes], dtype=np.int64))

    @property
    def cols(self) -> int:
        return int(np.prod([self.shape[a] for a in self.axes], dtype=np.int64))

    def replace(self, **changes: Any) -> Case:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    # ----------------------------------------------------------------------------------------
    # Inputs

    def numpy_inputs(self) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """``(x, weight, bias)`` as C-ordered NumPy arrays of the case's dtypes."""
        rng = np.random.default_rng(self.seed)
        order = self.batch_axes + self.axes
        permuted = tuple(self.shape[a] for a in order)
        x64 = _values(self.values, self.rows, self.cols, rng, self.dtype).reshape(permuted)
        x64 = x64.transpose(np.argsort(order))
        if self.layout == "broadcast" and self.shape[0] > 0:
            x64 = np.broadcast_to(x64[:1], self.shape)
        x = np.ascontiguousarray(x64).astype(numpy_dtype(self.dtype))
        param_shape = tuple(self.shape[a] for a in self.axes)
        weight = None
        if self.weight is not None:
            weight = rng.standard_normal(param_shape).astype(numpy_dtype(self.weight))
        bias = None
        if self.bias is not None:
            bias = rng.standard_normal(param_shape).astype(numpy_dtype(self.bias))
        return x, weight, bias

    def has_degenerate_row(self) -> bool:
        """Whether eps = 0 would divide 0 by 0 in some row (in the case's dtype): a constant
        row for layer_norm (zero variance), an all-zero row for rms_norm."""
        x = self.numpy_inputs()[0]
        order = self.batch_axes + self.axes
        rows = reference.to_float64(x).transpose(order).reshape(self.rows, self.cols)
        if self.op == "rms_norm":
            return bool(self.rows and (rows == 0).all(axis=1).any())
        return bool(self.rows and (rows.min(axis=1) == rows.max(axis=1)).any())

    def inputs(self, backend: str) -> tuple[Any, dict[str, Any]]:
        """``x`` in the backend's family and layout, and the keyword arguments of the call.

        Raises :class:`LayoutUnavailable` when the family cannot make the layout.
        """
        b = conversion(backend)
        x, weight, bias = self.numpy_inputs()
        kwargs: dict[str, Any] = {"eps": self.eps}
        if self.normalized_shape is not None:
            kwargs["normalized_shape"] = self.normalized_shape
        if self.axis is not None:
            kwargs["axis"] = self.axis
        if weight is not None:
            kwargs["weight"] = b.from_numpy(weight)
        if bias is not None:
            kwargs["bias"] = b.from_numpy(bias)
        return arrange(x, self.layout, b), kwargs

    def expected(
        self, inputs: tuple[np.ndarray, np.ndarray | None, np.ndarray | None] | None = None
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """The float64 reference ``(y, mean, rstd)``; ``mean`` is None for rms_norm.

        ``inputs``: NumPy ``(x, weight, bias)`` to normalize instead of the case's own (a fused
        case's rounded ``h``), with the case's axes and eps.
        """
        x, weight, bias = self.numpy_inputs() if inputs is None else inputs
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            if self.op == "rms_norm":
                y, rstd = reference.rms_norm(
                    x, self.normalized_shape, weight, self.eps, axis=self.axis
                )
                return y, None, rstd
            assert self.eps is not None
            return reference.layer_norm(
                x, self.normalized_shape, weight, bias, self.eps, axis=self.axis
            )

    # ----------------------------------------------------------------------------------------
    # Running and checking

    def call(self, x: Any, **kwargs: Any) -> Any:
        """``normlab.layer_norm`` or ``normlab.rms_norm`` (the case's op) of ``x``."""
        function = normlab.rms_norm if self.op == "rms_norm" else normlab.layer_norm
        return function(x, **kwargs)

    def run(self, backend: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Call the op on ``backend``; results as NumPy ``(y, mean, rstd)`` (``mean`` None for
        rms_norm; both statistics None without return_stats)."""
        b = conversion(backend)
        x, kwargs = self.inputs(backend)
        result = self.call(
            x, **kwargs, backend=call_backend(backend), return_stats=self.return_stats
        )
        y, mean, rstd = self.unpack(result)
        same_kind(y, x, self.snippet(backend))

        def host(a: Any) -> np.ndarray | None:
            return None if a is None else b.to_numpy(a)

        return b.to_numpy(y), host(mean), host(rstd)

    def unpack(self, result: Any) -> tuple[Any, Any, Any]:
        """The op's result as ``(y, mean, rstd)``, None where the op returns no such thing."""
        if not self.return_stats:
            return result, None, None
        if self.op == "rms_norm":
            y, rstd = result
            return y, None, rstd
        y, mean, rstd = result
        return y, mean, rstd

    def check(self, backend: str, *, rows: np.ndarray | None = None) -> None:
        """Run on ``backend`` and assert y (and the statistics) match the reference.

        ``rows``: a boolean mask of the statistics' shape choosing the rows compared (for
        cases whose other rows are poisoned on purpose); all rows by default.
        """
        self.compare(*self.run(backend), backend=backend, rows=rows)

    def compare(
        self,
        y: np.ndarray,
        mean: np.ndarray | None,
        rstd: np.ndarray | None,
        *,
        backend: str,
        rows: np.ndarray | None = None,
        inputs: tuple[np.ndarray, np.ndarray | None, np.ndarray | None] | None = None,
        repro: str | None = None,
    ) -> None:
        """Assert results (NumPy) of this case on ``backend`` match the reference (see check).
        The statistics are compared when ``rstd`` is given (and then ``mean`` for layer_norm).
        ``inputs``: as for :meth:`expected`; ``repro``: the snippet shown on failure (default
        :meth:`snippet`)."""
        x, weight, bias = self.numpy_inputs() if inputs is None else inputs
        want_y, want_mean, want_rstd = self.expected((x, weight, bias))
        repro = self.snippet(backend) if repro is None else repro
        flushed = flushes_subnormals(backend)
        cond = conditioning(want_mean, want_rstd)
        with np.errstate(invalid="ignore"):
            centred = reference.to_float64(x) - (0.0 if want_mean is None else want_mean)
            scale = y_scale(
                self.op,
                centred * want_rstd,
                _reshaped(weight, self.axes, x.ndim),
                _reshaped(bias, self.axes, x.ndim),
            )
        # With rows given the elements compared are picked by a mask (flattened); else whole
        # arrays are compared, and failure messages give indices into x.
        in_stats: Any = ... if rows is None else rows
        in_y: Any = ... if rows is None else np.broadcast_to(rows, x.shape)
        assert_close(
            y[in_y],
            want_y[in_y],
            self.dtype,
            np.broadcast_to(cond, x.shape)[in_y],
            what="y",
            cols=self.cols,
            scale=np.broadcast_to(scale, x.shape)[in_y],
            flushed=flushed,
            repro=repro,
        )
        if rstd is None:
            return
        stats_dtype = "float64" if self.dtype == "float64" else "float32"
        with np.errstate(divide="ignore"):  # rstd is 0 in rows holding an infinity
            stats = {
                "mean": (mean, want_mean, 1.0 / want_rstd),
                "rstd": (rstd, want_rstd, want_rstd),
            }
        for name in TABLE[self.op].stats_outputs:
            got, want, unit = stats[name]
            if got is None or want is None:
                raise AssertionError(f"{name} is missing\n{repro}")
            if got.dtype != numpy_dtype(stats_dtype) or got.shape != want.shape:
                raise AssertionError(
                    f"{name} has dtype {got.dtype} and shape {got.shape}; expected "
                    f"{stats_dtype} {want.shape}\n{repro}"
                )
            assert_close(
                got[in_stats],
                want[in_stats],
                self.dtype,
                cond[in_stats],
                what=name,
                cols=self.cols,
                scale=unit[in_stats],
                flushed=flushed,
                repro=repro,
            )

    def snippet(self, backend: str) -> str:
        """Code that reproduces this case on ``backend`` (shown when a check fails)."""
        family = driven_family(backend)
        driven = (
            ""
            if family is None
            else "    from normlab.testing.conversions import drive\n"
            f"    drive({backend!r}, {family!r})  # {family} arrays, as tested\n"
        )
        return (
            "Reproduce with:\n"
            "    import normlab\n"
            "    from normlab.testing.cases import Case\n"
            f"{driven}"
            f"    case = {self!r}\n"
            f"    x, kwargs = case.inputs({backend!r})  # the backend's arrays, as tested\n"
            f"    result = normlab.{self.op}(x, **kwargs, backend={call_backend(backend)!r}, "
            f"return_stats={self.return_stats})\n"
            "    expected = case.expected()  # float64 reference (y, mean or None, rstd)\n"
            f"    case.check({backend!r})  # the comparison\n"
        )


def _reshaped(p: np.ndarray | None, axes: tuple[int, ...], ndim: int) -> np.ndarray | None:
    """p (float64) with its dims on ``axes`` of an ndim-d x and 1 elsewhere; None stays None."""
    if p is None:
        return None
    shape = [1] * ndim
    for a, n in zip(axes, p.shape, strict=True):
        shape[a] = n
    return reference.to_float64(p).reshape(shape)


def same_kind(result: Any, x: Any, repro: str = "") -> None:
    """Assert ``result`` has x's array type, shape, dtype and device."""
    problems = []
    if type(result) is not type(x):
        problems.append(f"type {type(result).__qualname__}, not {type(x).__qualname__}")
    if tuple(result.shape) != tuple(x.shape):
        problems.append(f"shape {tuple(result.shape)}, not {tuple(x.shape)}")
    if result.dtype != x.dtype:
        problems.append(f"dtype {result.dtype}, not {x.dtype}")
    if _device(result) != _device(x):
        problems.append(f"device {_device(result)}, not {_device(x)}")
    if problems:
        raise AssertionError("the result differs from x: " + "; ".join(problems) + "\n" + repro)


def _device(a: Any) -> str:
    import array_api_compat

    try:
        return str(array_api_compat.device(a))
    except Exception:  # a library array_api_compat does not know
        return str(getattr(a, "device", "cpu"))
