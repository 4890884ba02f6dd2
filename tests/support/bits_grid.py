"""The bits snapshot: SHA-256 of every result of a fixed grid of calls, to hold a refactoring to
"no result changes".

Each entry of :func:`grid` is one call: an op (every forward, fused and backward op) of one
dtype, one option (parameters, statistics, an offset weight, parameters of another dtype, a
float32 residual stream, a casting order, quantized outputs, ``out=``, torch autograd), one
layout (contiguous or every other column) and one size (few rows: the serial kernels; many:
the threads'), on one subject: the numpy, numba or torch backend, or the default choice on
torch tensors. Its hash covers each result's dtype, shape and bytes, in the order returned
(gradients after y for ``autograd``).

The bits of numba, torch and NumPy depend on the machine's vector instructions and the
libraries' versions (reassociated sums, FMA, BLAS kernels), so the snapshot records them
(:func:`machine`): a snapshot is compared only on the machine class and versions it was made
with. ``python -m tests.support.bits_grid --write`` makes it anew (only where a change is meant
to change results; say so in the commit).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Final

import numpy as np

import normlab
from normlab.ops import names
from tests.support.paths import DATA

#: Where the snapshot lies.
SNAPSHOT: Final = DATA / "bits_snapshot.json"
FORWARD: Final = names(direction="forward")
BACKWARD: Final = names(direction="backward")
DTYPES: Final = ("float16", "bfloat16", "float32", "float64")
#: The subjects: (backend name or None for the default choice, family of the arrays).
SUBJECTS: Final = {
    "numpy": ("numpy", "numpy"),
    "numba": ("numba", "numpy"),
    "torch": ("torch", "torch"),
    "default:torch": (None, "torch"),
}
#: Rows of each size: the serial kernels', and enough elements for numba's threads.
ROWS: Final = {"serial": 5, "parallel": 3 << 10}
COLS: Final = 96


@dataclass(frozen=True)
class Entry:
    """One call of the grid (its id: the fields joined by ``-``)."""

    subject: str
    op: str
    dtype: str
    option: str
    layout: str = "contiguous"
    size: str = "serial"

    @property
    def id(self) -> str:
        return "-".join((self.subject, self.op, self.dtype, self.option, self.layout, self.size))


def _options(op: str, dtype: str, family: str) -> Iterator[str]:
    """The options of ``op`` on arrays of ``dtype`` and ``family``."""
    if op in BACKWARD:
        yield from ("plain", "no-weight", "other-dtype-weight")
        return
    yield from ("plain", "no-parameters", "stats", "offset", "other-dtype-parameters", "out")
    yield from ("int8", "fp8")
    if "rms" in op:
        yield "llama"
        if dtype in ("float16", "bfloat16"):
            yield "t5"
    if op.startswith("add_"):
        yield "post-norm"
        if dtype in ("float16", "bfloat16"):
            yield "float32-stream"
    if family == "torch":
        yield "autograd"


def grid() -> list[Entry]:
    """Every call of the snapshot: each option on contiguous serial rows, and the plain call on
    strided rows and on many contiguous rows."""
    entries = []
    for subject, (_, family) in SUBJECTS.items():
        for op in (*FORWARD, *BACKWARD):
            for dtype in DTYPES:
                entries.extend(Entry(subject, op, dtype, o) for o in _options(op, dtype, family))
                entries.append(Entry(subject, op, dtype, "plain", "strided"))
                entries.append(Entry(subject, op, dtype, "plain", "contiguous", "parallel"))
    return entries


# --------------------------------------------------------------------------------------------
# Running an entry


def _other_dtype(dtype: str) -> str:
    """A parameter dtype other than the contract's for x of ``dtype``."""
    return {"float16": "float32", "bfloat16": "float32", "float32": "bfloat16"}.get(
        dtype, "float32"
    )


class _Arrays:
    """Arrays of one family, made from float64 NumPy values."""

    def __init__(self, family: str) -> None:
        self.family = family

    def make(self, values: np.ndarray, dtype: str) -> Any:
        if self.family == "numpy":
            return values.astype(_numpy_dtype(dtype))
        import torch

        return torch.from_numpy(values).to(getattr(torch, dtype))

    def strided(self, a: Any) -> Any:
        """Every other column of a twice-as-wide copy of ``a``."""
        if self.family == "numpy":
            wide = np.zeros((a.shape[0], 2 * a.shape[1]), a.dtype)
        else:
            wide = a.new_zeros((a.shape[0], 2 * a.shape[1]))
        wide[:, ::2] = a
        return wide[:, ::2]

    def empty_like(self, a: Any) -> Any:
        return np.empty_like(a) if self.family == "numpy" else a.new_empty(a.shape)


def _numpy_dtype(dtype: str) -> Any:
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def run(entry: Entry) -> tuple[Any, ...]:
    """The results of ``entry``'s call (gradients after them for ``autograd``)."""
    backend, family = SUBJECTS[entry.subject]
    arrays = _Arrays(family)
    rng = np.random.default_rng(zlib.crc32(f"{entry.op}-{entry.dtype}".encode()))
    rows = ROWS[entry.size]
    shape = (rows, COLS)
    x = arrays.make(rng.standard_normal(shape) * 2 + 0.5, entry.dtype)
    residual_dtype = "float32" if entry.option == "float32-stream" else entry.dtype
    residual = arrays.make(rng.standard_normal(shape), residual_dtype)
    parameter_dtype = "float32" if entry.dtype in ("float16", "bfloat16") else entry.dtype
    if entry.option in ("other-dtype-parameters", "other-dtype-weight"):
        parameter_dtype = _other_dtype(entry.dtype)
    if entry.option == "t5":
        parameter_dtype = entry.dtype
    weight = arrays.make(rng.standard_normal(COLS) * 0.5 + 1.0, parameter_dtype)
    bias = arrays.make(rng.standard_normal(COLS) * 0.1, parameter_dtype)
    if entry.layout == "strided":
        x, residual = arrays.strided(x), arrays.strided(residual)
    if entry.op in BACKWARD:
        return _backward(entry, arrays, x, weight, backend, rng)
    keywords: dict[str, Any] = {"backend": backend}
    if entry.option != "no-parameters":
        keywords["weight"] = weight
        if "layer" in entry.op:
            keywords["bias"] = bias
    keywords.update(
        {
            "stats": {"return_stats": True},
            "offset": {"weight_offset": 1.0},
            "int8": {"quantize": "int8"},
            "fp8": {"quantize": "fp8_e4m3"},
            "llama": {"casting": "llama"},
            "t5": {"casting": "t5"},
            "post-norm": {"return_residual": False},
        }.get(entry.option, {})
    )
    fused = entry.op.startswith("add_")
    args = (x, residual) if fused else (x,)
    if entry.option == "out":
        keywords["out"] = arrays.empty_like(x)
        if fused:
            keywords["residual_out"] = arrays.empty_like(x)
    function = getattr(normlab, entry.op)
    if entry.option != "autograd":
        result = function(*args, **keywords)
        return result if isinstance(result, tuple) else (result,)
    leaves = [x.requires_grad_(), keywords["weight"].requires_grad_()]
    result = function(*args, **keywords)
    y = result[0] if fused else result
    dy = arrays.make(rng.standard_normal(shape), entry.dtype)
    y.backward(dy)
    return (y, *(leaf.grad for leaf in leaves))


def _backward(
    entry: Entry,
    arrays: _Arrays,
    x: Any,
    weight: Any,
    backend: str | None,
    rng: np.random.Generator,
) -> tuple[Any, ...]:
    """The backward op of ``entry`` from the statistics of x of the family's own backend, for a
    random dy."""
    forward = entry.op.removesuffix("_backward")
    w = None if entry.option == "no-weight" else weight
    stats = getattr(normlab, forward)(x, return_stats=True, backend=arrays.family)[1:]
    dy = arrays.make(rng.standard_normal(x.shape), entry.dtype)
    return tuple(getattr(normlab, entry.op)(dy, x, *stats, w, backend=backend))


def digest(results: tuple[Any, ...]) -> str:
    """SHA-256 of each result's dtype, shape and bytes (None as the word), in order."""
    h = hashlib.sha256()
    for r in results:
        if r is None:
            h.update(b"None;")
            continue
        a = _host(r)
        h.update(f"{a.dtype.str}{a.shape};".encode())
        h.update(np.ascontiguousarray(a).view(np.uint8).tobytes())
    return h.hexdigest()


def _host(a: Any) -> np.ndarray:
    """A NumPy array of ``a``'s bytes (torch's 1- and 2-byte floats as unsigned integers)."""
    if isinstance(a, np.ndarray):
        return a
    t = a.detach()
    if t.element_size() in (1, 2) and t.is_floating_point():
        import torch

        t = t.view(torch.uint8 if t.element_size() == 1 else torch.int16)
    values: np.ndarray = t.numpy()
    return values


# --------------------------------------------------------------------------------------------
# The snapshot


def machine() -> dict[str, str]:
    """What the bits depend on besides normlab: the CPU, its vector features as numba's LLVM
    and torch see them, and the versions of the libraries that compute."""
    found = {"cpu": _cpu_name(), "python": platform.python_version()}
    for package in ("numpy", "numba", "llvmlite", "torch", "ml-dtypes"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "absent"
    try:
        import llvmlite.binding as llvm

        found["llvm_cpu"] = llvm.get_host_cpu_name()
    except ImportError:
        pass
    try:
        import torch

        found["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except ImportError:
        pass
    return found


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def available(subject: str) -> str | None:
    """None when ``subject``'s backend and family can run here, else why not."""
    backend, family = SUBJECTS[subject]
    if family == "torch" and "torch" not in _importable():
        return "torch is not installed"
    if backend is not None and not normlab.registry.get(backend).available:
        return f"backend {backend!r} is unavailable: {normlab.registry.get(backend).reason}"
    return None


def _importable() -> set[str]:
    import importlib.util

    return {name for name in ("torch", "numba") if importlib.util.find_spec(name) is not None}


def hashes(subjects: tuple[str, ...] | None = None) -> dict[str, str]:
    """The digest of every grid entry of ``subjects`` (None: every available one)."""
    chosen = subjects or tuple(s for s in SUBJECTS if available(s) is None)
    return {e.id: digest(run(e)) for e in grid() if e.subject in chosen}


def load() -> dict[str, Any]:
    """The committed snapshot: ``{"machine": {...}, "hashes": {id: sha256}}``."""
    data: dict[str, Any] = json.loads(SNAPSHOT.read_text())
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the snapshot anew")
    options = parser.parse_args(argv)
    found = hashes()
    if options.write:
        SNAPSHOT.write_text(
            json.dumps({"machine": machine(), "hashes": found}, indent=1, sort_keys=True) + "\n"
        )
        print(f"wrote {len(found)} hashes to {SNAPSHOT}")
        return 0
    want = load()["hashes"]
    differ = sorted(k for k in found if want.get(k) != found[k])
    print(f"{len(found)} calls, {len(differ)} differ from the snapshot", *differ[:40], sep="\n")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
