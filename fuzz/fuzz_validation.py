"""Coverage-guided fuzzing of normlab's validation layer with atheris (libFuzzer).

Each input is decoded into one call of ``layer_norm``, ``rms_norm``, ``explain``,
``layer_norm_backward`` or ``rms_norm_backward`` on small NumPy (and, when installed, torch)
arrays: any shape, dtype, layout, axes, weight, bias, eps, ``out``, backend and preference. The
call must return a result of x's shape and dtype or raise a :class:`normlab.NormlabError`;
anything else (a raw exception, a wrong kind of result) is a finding: atheris stops and writes
the input to ``crash-<sha1>``. Hangs are caught by libFuzzer's ``-timeout``. The hypothesis
fuzz tests (``tests/core/test_fuzz_api.py``) check the values; this harness explores the branches
of ``normlab.spec``, ``dispatch``, ``layout`` and ``backward`` that coverage leads it to.

Run it through nox: ``python3 -m nox -s fuzz`` (CI: replays ``fuzz/corpus/``, then a
fixed-seed search of fixed length) or ``-s fuzz-explore`` (a random seed, ten minutes; crashes
land in ``fuzz/findings/``). By hand (``pip install atheris``)::

    NORMLAB_FUZZ_VERBOSE=1 python fuzz/fuzz_validation.py crash-<sha1>  # rerun one, printed
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, Final

import atheris
import numpy as np

try:
    import torch
except ImportError:  # the harness fuzzes NumPy arrays alone
    torch = None

#: Jitted kernels are compiled from their bytecode: instrumented, Numba could not compile them.
KERNELS: Final = [
    "normlab.backends.numba_forward",
    "normlab.backends.numba_backward",
    "normlab.backends.half_bits",
    "normlab.backends.half_hw",
]

with atheris.instrument_imports(include=["normlab"], exclude=KERNELS):
    import normlab
    import normlab.backends.numba_backend
    import normlab.backends.numpy_backend
    import normlab.layout
    import normlab.route

    if torch is not None:
        import normlab.backends.torch_backend

# Imported after the instrumented block: the test helpers are not what is fuzzed.
from normlab.ops import BACKWARD_OPS, FORWARD_OPS  # noqa: E402
from normlab.testing.conversions import (  # noqa: E402
    NUMPY_LAYOUTS,
    arrange,
    conversion,
    dtype_name,
    numpy_dtype,
    numpy_layout,
    torch_dtype,
)

FAMILIES: Final = ("numpy", "torch") if torch is not None else ("numpy",)
FLOATS: Final = ("float32", "float64", "float16", "bfloat16")
ODD_DTYPES: Final = {
    "numpy": ("int32", "bool", "complex64", "object", "longdouble"),
    "torch": ("int32", "bool", "complex64"),
}
LAYOUTS: Final = ("c", "fortran", "sliced", "reversed", "broadcast", *NUMPY_LAYOUTS, "scalar")
NAMES: Final = ("numpy", "numba", "torch")
ODD_NAMES: Final = ("cupy", "no_such_backend", 7, ("numpy",))
ODD_VALUES: Final = (
    None,
    True,
    False,
    0,
    1,
    -1,
    2.5,
    float("nan"),
    float("inf"),
    -float("inf"),
    "4",
    (),
    [],
    [None],
    (1.0,),
    {2},
    np.int64(2),
    np.float32(1e-3),
    np.bool_(True),
    1j,
    b"x",
    10**30,
)
OPS: Final = (*FORWARD_OPS, "explain", *BACKWARD_OPS)


class Decoder:
    """Turns fuzzer bytes into arguments: mostly valid ones, an odd one now and then. When the
    bytes run out, every choice falls on its first, plain option."""

    def __init__(self, data: bytes) -> None:
        self.fdp = atheris.FuzzedDataProvider(data)

    def pick(self, values: tuple[Any, ...] | list[Any]) -> Any:
        return self.fdp.PickValueInList(list(values))

    def small(self, low: int = 0, high: int = 5) -> int:
        return self.fdp.ConsumeIntInRange(low, high)

    def odd(self) -> bool:
        """True for one choice in eight: take an odd value instead of a plain one."""
        return self.small(0, 7) == 7

    def shape(self) -> tuple[int, ...]:
        return tuple(
            self.small(1, 6) if not self.odd() else self.small(0, 2)
            for _ in range(self.small(1, 4) if not self.odd() else self.small(0, 4))
        )

    def array(
        self,
        shape: tuple[int, ...] | None = None,
        family: str | None = None,
        dtype: str | None = None,
    ) -> Any:
        """An array of ``family`` (else any), ``dtype`` (else any) and ``shape`` (else any)."""
        shape = self.shape() if shape is None else shape
        family = family or self.pick(FAMILIES)
        if dtype is None or self.odd():
            dtype = self.pick(ODD_DTYPES[family] if self.odd() else FLOATS)
        layout = self.pick(LAYOUTS) if self.odd() else "c"
        values = np.asarray(
            self.fdp.ConsumeFloatListInRange(max(1, int(np.prod(shape))), -1e4, 1e4)
        )
        values = np.resize(values, shape) if values.size else np.zeros(shape)
        if family == "torch":
            if layout == "readonly":  # torch has no read-only tensors: the odd case is autograd
                t = torch.from_numpy(np.ascontiguousarray(values)).to(torch_dtype(dtype))
                return t.requires_grad_() if t.is_floating_point() else t
            torch_layout = layout if layout in ("fortran", "sliced", "broadcast") else "c"
            return arrange(values.astype(numpy_dtype(dtype)), torch_layout, conversion("torch"))
        typed = values.astype(numpy_dtype(dtype))
        if layout == "scalar":
            return typed.reshape(-1)[0] if typed.size else typed
        return numpy_layout(typed, layout)

    def dims(self, shape: tuple[int, ...], trailing: bool) -> Any:
        """A normalized_shape (``trailing``) or axis: mostly None or valid, now and then odd."""
        ndim = len(shape)
        if self.odd():
            if self.fdp.ConsumeBool():
                return self.pick(ODD_VALUES)
            return tuple(self.small(-ndim - 2, ndim + 2) for _ in range(self.small(0, 4)))
        if not ndim or self.fdp.ConsumeBool():
            return None
        k = self.small(1, ndim)
        if trailing:
            return shape[ndim - k :] if self.fdp.ConsumeBool() else shape[-1]
        return tuple(self.small(-ndim, ndim - 1) for _ in range(k))

    def eps(self) -> Any:
        if not self.odd():
            return self.fdp.ConsumeProbability() * 10.0 ** -self.small(0, 12)
        kind = self.small(0, 2)
        if kind == 0:
            return self.fdp.ConsumeRegularFloat()
        if kind == 1:
            return self.fdp.ConsumeInt(self.small(1, 64))
        return self.pick(ODD_VALUES)

    def like(self, x: Any, shape: tuple[int, ...]) -> Any:
        """None, an array that fits (x's family and dtype, ``shape``), or an odd one."""
        if self.fdp.ConsumeBool():
            return None
        family, dtype = _family(x), _dtype(x)
        if not self.odd():
            return self.array(shape, family, dtype)
        kind = self.small(0, 3)
        if kind == 0:
            return self.pick(ODD_VALUES)
        if kind == 1:
            return self.array(None, family, dtype)
        return self.array(shape, self.pick(FAMILIES), dtype if kind == 2 else None)

    def backend(self) -> Any:
        if self.fdp.ConsumeBool():
            return None
        return self.pick(ODD_NAMES if self.odd() else NAMES)


def _dtype(a: Any) -> str | None:
    name = dtype_name(a) if hasattr(a, "dtype") else ""
    return name if name in FLOATS else None


def _family(a: Any) -> str:
    return "torch" if torch is not None and isinstance(a, torch.Tensor) else "numpy"


def _call(d: Decoder) -> tuple[Callable[..., Any], Any, dict[str, Any]]:
    """One call decoded from the input: the function, x, and its keyword arguments."""
    op = d.pick(OPS)
    x = d.array()
    shape = tuple(getattr(x, "shape", ()))  # a scalar of an object array is a Python float
    ndim = len(shape)
    kwargs: dict[str, Any] = {"axis": d.dims(shape, False), "backend": d.backend()}
    stats_shape = tuple(n if i < ndim - 1 else 1 for i, n in enumerate(shape))
    if op.endswith("_backward"):
        kwargs.update(
            dy=d.like(x, shape),
            weight=d.like(x, shape[-1:]),
            rstd=d.like(x, stats_shape),
            normalized_shape=d.dims(shape, True),
        )
        if op == "layer_norm_backward":
            kwargs["mean"] = d.like(x, stats_shape)
        kwargs["needs"] = d.pick([("x", "weight"), ("x",), (), "x", None, ["weight"], ("gamma",)])
        return getattr(normlab, op), x, kwargs
    kwargs.update(
        normalized_shape=d.dims(shape, True),
        weight=d.like(x, shape[-1:]),
        eps=d.eps(),
        return_stats=d.pick([False, True, 1, None]),
    )
    if op != "rms_norm":
        kwargs["bias"] = d.like(x, shape[-1:])
    out = d.small(0, 3)
    if out == 1:
        kwargs["out"] = d.like(x, shape)
    elif out == 2:
        kwargs["out"] = x
    elif out == 3:
        kwargs["out"] = tuple(
            d.like(x, shape if i == 0 else stats_shape) for i in range(d.small(2, 3))
        )
    if op == "explain":
        return normlab.explain, x, {**kwargs, "op": d.pick(["layer_norm", "rms_norm", "other"])}
    return getattr(normlab, op), x, kwargs


def test_one_input(data: bytes) -> None:
    d = Decoder(data)
    function, x, kwargs = _call(d)
    preference = d.backend()
    if os.environ.get("NORMLAB_FUZZ_VERBOSE"):
        print(f"{function.__name__}(x={x!r}, **{kwargs!r}) preference={preference}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if preference is None:
                result = function(x=x, **kwargs)
            else:
                with normlab.use_backend(preference):
                    result = function(x=x, **kwargs)
    except normlab.NormlabError:
        return
    if function in (normlab.layer_norm, normlab.rms_norm):
        check_result(result, x, kwargs.get("out"))


def check_result(result: Any, x: Any, out: Any) -> None:
    """y is ``out`` when given, else of x's type, shape and dtype (byte order aside)."""
    y = result[0] if isinstance(result, tuple) else result
    out_y = out[0] if isinstance(out, tuple) else out
    if out_y is not None:
        if y is not out_y:
            raise AssertionError("the result is not the out array")
        return
    if type(y) is not type(x) or tuple(y.shape) != tuple(x.shape) or dtype_name(y) != dtype_name(x):
        raise AssertionError(f"result {type(y)} {y.dtype} {y.shape} for x {x.dtype} {x.shape}")


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
