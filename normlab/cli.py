"""The ``normlab`` command (also ``python -m normlab``).

``info`` shows every backend and why it can or cannot run here (and the threading layer of
numba's parallel kernels); ``check NAME`` runs the
conformance suite against one backend; ``kernels`` compiles the CUDA kernels with NVRTC and
reports their register use; ``demo`` runs the worked example ``[1, 3, 5, 7]`` and a
Transformer-sized batch through every available backend.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

import normlab
from normlab import arrays, dispatch, reference, registry
from normlab.constants import FLOAT_DTYPES
from normlab.errors import BackendError, NormlabWarning
from normlab.precompile import DIRECTIONS
from normlab.registry import Backend

__all__ = ["main"]

Handler = Callable[[argparse.Namespace, Console, list[str]], int]

#: The worked example of the contract: mean 4, population variance 5.
WORKED_EXAMPLE: Final = (1.0, 3.0, 5.0, 7.0)
#: A Transformer activation: [batch, sequence, hidden].
BATCH_SHAPE: Final = (8, 128, 768)
#: Console width when stdout is not a terminal.
PIPE_WIDTH: Final = 200
#: Seconds of timed calls per batch of repeats in ``demo``, and the number of batches: enough
#: that the median of two runs on an idle machine agree within 20% (about 0.5 s a row).
_TIMING_BATCH_S: Final = 0.025
_TIMING_BATCHES: Final = 21


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    pytest_args: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, pytest_args = args[:cut], args[cut + 1 :]
    parser = _parser()
    ns = parser.parse_args(args)
    if pytest_args and ns.command != "check":
        parser.error("arguments after -- go to pytest; only 'check' takes them")
    if ns.command is None:
        return _overview(parser, _console())
    handler: Handler = ns.handler
    return handler(ns, _console(), pytest_args)


def _console() -> Console:
    """A console for stdout; wide when writing to a file or pipe, so tables do not wrap."""
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=PIPE_WIDTH)
    return console


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="normlab", description="One correct, fast LayerNorm call on any array library."
    )
    parser.add_argument("--version", action="version", version=f"normlab {normlab.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    info = commands.add_parser(
        "info",
        help="show every backend and whether it can run here",
        description="Show every backend and whether it can run here; with NAME, all that one "
        "backend declares (version, devices, dtypes, ops, capabilities).",
    )
    info.add_argument("name", metavar="NAME", nargs="?", help="one backend to describe in full")
    info.set_defaults(handler=_info)
    check = commands.add_parser(
        "check",
        help="run the conformance suite against one backend",
        description="Run the conformance suite against backend NAME. Arguments after -- are "
        "passed to pytest.",
    )
    check.add_argument(
        "name",
        metavar="NAME",
        help="a backend name (see 'normlab info'); default:FAMILY for the default choice on "
        "FAMILY's arrays (no backend named); default for every installed family's",
    )
    check.add_argument(
        "--profile",
        choices=("ci", "full"),
        default="ci",
        help="ci: fast, the same cases every run (default); full: many more, new each run",
    )
    check.add_argument(
        "--allow-unavailable",
        action="store_true",
        help="a backend unavailable here (no device, library missing): skip its tests, exit 0",
    )
    check.add_argument(
        "--arrays",
        metavar="FAMILY",
        help="drive the backend with FAMILY arrays, which its record serves beside its own, on its "
        "device (cupy: --arrays torch tests CUDA tensors)",
    )
    check.add_argument(
        "--json", metavar="FILE", help="also write every test's result to FILE as JSON"
    )
    check.add_argument(
        "--verbose",
        action="store_true",
        help="pytest's full report, tracebacks included (default: one line per failing test, "
        "by area, with the code reproducing it)",
    )
    check.set_defaults(handler=_check)
    kernels = commands.add_parser(
        "kernels", help="compile the CUDA kernels with NVRTC and report registers and spills"
    )
    kernels.add_argument("--arch", default="sm_90", help="target architecture (default sm_90)")
    kernels.set_defaults(handler=_kernels)
    warm = commands.add_parser(
        "warmup",
        help="compile the numba kernels ahead of time (for a Docker build step)",
        description="Compile numba's kernels for dtypes x {contiguous, strided} x {serial, "
        "parallel} x {forward, backward, fused, quantized} into numba's on-disk cache, so that "
        "first calls later load them instead of compiling. The cache is tied to this CPU model: "
        "see docs/numba.md.",
    )
    warm.add_argument(
        "--dtypes", nargs="+", choices=FLOAT_DTYPES, default=list(FLOAT_DTYPES), metavar="DTYPE"
    )
    warm.add_argument(
        "--ops",
        nargs="+",
        choices=DIRECTIONS,
        default=list(DIRECTIONS),
    )
    warm.add_argument("--cache-dir", help="numba's cache directory (NUMBA_CACHE_DIR)")
    warm.set_defaults(handler=_warmup)
    calibrate = commands.add_parser(
        "calibrate",
        help="measure each backend's cost on this machine, for the dispatcher's choice",
        description="Time every available backend on a few sizes of x per op and dtype, fit a "
        "fixed cost per call and a rate in bytes per microsecond, and store them in normlab's "
        "cache directory, where the dispatcher reads them in place of the shipped models. "
        "Run it on an idle machine (about a minute).",
    )
    calibrate.add_argument("--backends", nargs="+", metavar="NAME", help="default: every one")
    calibrate.add_argument(
        "--dtypes", nargs="+", choices=FLOAT_DTYPES, default=list(FLOAT_DTYPES), metavar="DTYPE"
    )
    calibrate.add_argument("--quick", action="store_true", help="two sizes only (a smoke test)")
    calibrate.add_argument("--output", metavar="FILE", help="write here, not to the cache")
    calibrate.set_defaults(handler=_calibrate)
    demo = commands.add_parser(
        "demo", help="run the worked example and a Transformer batch through every backend"
    )
    demo.set_defaults(handler=_demo)
    return parser


def _error(message: str) -> None:
    Console(stderr=True).print(Text(f"normlab: {message}", style="bold red"), soft_wrap=True)


def _calibrate(ns: argparse.Namespace, console: Console, pytest_args: list[str]) -> int:
    """Measure the cost models and say where they went (``normlab.calibrate``)."""
    from pathlib import Path

    from normlab import calibrate
    from normlab.errors import NormlabError

    try:
        path, measurements = calibrate.calibrate(
            ns.backends,
            ns.dtypes,
            quick=ns.quick,
            path=Path(ns.output) if ns.output else None,
            progress=lambda line: console.print(line, highlight=False),
        )
    except NormlabError as exc:
        _error(str(exc))
        return 2
    console.print(f"{len(measurements)} measurements; cost models written to {path}")
    return 0


# --------------------------------------------------------------------------------------------
# no command


def _overview(parser: argparse.ArgumentParser, console: Console) -> int:
    """The help and a short status: the registered backends and their libraries' versions.

    Reads package metadata only: no backend's availability check runs, so neither numba nor
    cupy is imported (``normlab info`` runs the checks).
    """
    console.print(parser.format_help(), highlight=False, markup=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NormlabWarning)
        backends = normlab.list_backends()
        failures = normlab.plugin_failures()
    described = []
    for b in backends:
        library = b.record.library
        installed = f"{library} {b.version}" if b.version else f"{library} not installed"
        described.append(f"{b.name} ({installed})" if library else b.name)
    console.print(f"normlab {normlab.__version__}; backends: {', '.join(described)}")
    if failures:
        console.print(f"{len(failures)} plugin(s) failed to load; see 'normlab info'")
    console.print("Which can run here, and why not: normlab info")
    return 0


# --------------------------------------------------------------------------------------------
# info


def _info(ns: argparse.Namespace, console: Console, pytest_args: list[str]) -> int:
    """Print the backend table (or one backend in full), the plugin failures and the preference
    in force."""
    if ns.name is not None:
        return _info_one(ns.name, console)
    _print_backends(console)
    console.print("All that one backend declares: normlab info NAME")
    if any(b.name == "numba" and b.available for b in normlab.list_backends()):
        from normlab.backends import numba_backend  # starts numba's threads to learn the layer

        console.print(f"Numba threading layer: {numba_backend.threading_layer(start=True)}")
    preference = dispatch.current_preference()
    if preference is not None:
        console.print(f"Preferred backend (use_backend / NORMLAB_BACKEND): {preference}")
    return 0


def _print_backends(console: Console) -> None:
    with warnings.catch_warnings():  # plugin failures are shown in their own table
        warnings.simplefilter("ignore", NormlabWarning)
        backends = normlab.list_backends()
        failures = normlab.plugin_failures()
    console.print(_backend_table(backends))
    if failures:
        table = Table(title="Plugins that failed to load (skipped)", title_style="bold red")
        for column in ("plugin", "source", "error"):
            table.add_column(column)
        for failure in failures:
            table.add_row(Text(failure.plugin), Text(failure.source), Text(failure.error))
        console.print(table)


def _backend_table(backends: Iterable[Backend]) -> Table:
    """A table of ``backends`` that fits 80 columns: availability (the reason wraps), what
    each serves, its priority and source. ``normlab info NAME`` shows the rest."""
    table = Table(
        title="normlab backends",
        caption="+ served zero-copy, chosen by cost; * served only when named: backend=NAME or "
        "use_backend(NAME)",
    )
    table.add_column("backend", no_wrap=True)
    table.add_column("status", overflow="fold", ratio=3)
    table.add_column("families", overflow="fold", ratio=2)
    table.add_column("priority", justify="right", no_wrap=True)
    table.add_column("provided by", overflow="fold", ratio=2)
    for b in backends:
        table.add_row(
            Text(b.name, style="bold"),
            _status(b),
            Text(", ".join(_families(b))),
            Text(str(b.priority)),
            Text(b.provided_by),
        )
    return table


def _status(b: Backend) -> Text:
    if b.reason is None:
        return Text("available", style="green")
    return Text(f"unavailable — {b.reason}", style="red")


def _families(b: Backend) -> list[str]:
    zero_copy = [f"{f}+" for f in sorted(b.zero_copy_families)]
    return sorted(b.families) + zero_copy + [f"{f}*" for f in sorted(b.explicit_families)]


def _info_one(name: str, console: Console) -> int:
    """Everything backend ``name`` declares, one field a line (values wrap)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NormlabWarning)
        try:
            b = dispatch.backend_named(name)
        except BackendError as exc:
            _error(str(exc))
            return 2
    table = Table(title=f"normlab backend {b.name}", show_header=False)
    table.add_column("field", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    fields = (
        ("status", _status(b)),
        ("description", Text(b.record.description or "—")),
        ("version", Text(f"{b.record.library} {b.version}" if b.version else "—")),
        ("families", Text(", ".join(_families(b)))),
        ("devices", Text(", ".join(sorted(b.devices)))),
        ("dtypes", Text(", ".join(_dtype_order(b.dtypes)))),
        ("ops", Text(", ".join(sorted(b.ops)))),
        ("capabilities", Text(", ".join(sorted(b.capabilities)) or "—")),
        ("flushes subnormals", Text(_flushing(b))),
        ("batch invariant", Text(_invariance(b))),
        ("priority", Text(str(b.priority))),
        ("provided by", Text(b.provided_by)),
    )
    for field, value in fields:
        table.add_row(field, value)
    console.print(table)
    if b.zero_copy_families:
        console.print("+ served zero-copy, chosen by cost against the family's own backend")
    if b.explicit_families:
        console.print("* served only when named: backend=NAME or use_backend(NAME)")
    return 0


def _flushing(b: Backend) -> str:
    if b.flushes_subnormals:
        return "yes — subnormal inputs are outside its contract (flushes_subnormals)"
    return "no"


def _invariance(b: Backend) -> str:
    if b.batch_invariant:
        return "yes — a row's bits never depend on the rest of the batch"
    return "no — declared batch_invariant=False: a row's bits may depend on its batch"


def _dtype_order(dtypes: Iterable[str]) -> list[str]:
    known = {name: i for i, name in enumerate(FLOAT_DTYPES)}
    return sorted(dtypes, key=lambda d: (known.get(d, len(known)), d))


# --------------------------------------------------------------------------------------------
# check


def _check(ns: argparse.Namespace, console: Console, pytest_args: list[str]) -> int:
    """Run ``normlab.testing.check`` on one backend and return its exit status: 2 when the
    backend is unknown or the suite's dependencies are missing, 1 when the backend cannot load
    (or is unavailable here, without ``--allow-unavailable``), each said in one line."""
    from normlab.testing.default_choice import EVERY_FAMILY, default_subjects, is_default

    if ns.name != EVERY_FAMILY and not is_default(ns.name):
        try:
            registry.get(ns.name)
        except BackendError as exc:
            _error(str(exc))
            return 2
    missing = [name for name in ("pytest", "hypothesis") if importlib.util.find_spec(name) is None]
    if missing:
        _error(f"the conformance suite needs {' and '.join(missing)}: pip install 'normlab[test]'")
        return 2
    from normlab import testing
    from normlab.testing.preflight import obstacle

    names = default_subjects() if ns.name == EVERY_FAMILY else [ns.name]
    problems = [obstacle(name, allow_unavailable=ns.allow_unavailable) for name in names]
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        _error(problem)
        return 1
    short = () if ns.verbose else ("-q", "--tb=no", "-rN", "--disable-warnings")
    code = testing.check(
        ns.name,
        profile=ns.profile,
        allow_unavailable=ns.allow_unavailable,
        arrays=ns.arrays,
        json_path=ns.json,
        extra_pytest_args=(*short, *pytest_args),
    )
    return int(code)


# --------------------------------------------------------------------------------------------
# kernels


def _kernels(ns: argparse.Namespace, console: Console, pytest_args: list[str]) -> int:
    """Compile every CUDA kernel for ``--arch``; fail when one does not compile, spills
    registers or uses a stack frame (local memory)."""
    from normlab.backends import cuda_compile

    try:
        reports = cuda_compile.compile_all(ns.arch)
        major, minor = cuda_compile.nvrtc_version()
    except cuda_compile.CudaCompileError as exc:
        _error(str(exc))
        return 1
    table = Table(title=f"CUDA kernels compiled with NVRTC {major}.{minor} for {ns.arch}")
    for column in ("kernel", "arch", "registers", "stack (bytes)", "spills (bytes)", "result"):
        table.add_column(column, justify="left" if column in ("kernel", "arch") else "right")
    for r in reports:
        problem = "spills" if r.spills else "stack" if r.stack else None
        result = Text(problem, style="red") if problem else Text("ok", style="green")
        numbers = (str(r.registers), str(r.stack), str(r.spills))
        table.add_row(Text(r.name), Text(r.arch), *(Text(n) for n in numbers), result)
    console.print(table)
    spilling = [r.name for r in reports if r.spills]
    if spilling:
        _error(f"registers spill to local memory in {', '.join(spilling)}")
        return 1
    stacked = [r.name for r in reports if r.stack]
    if stacked:
        _error(f"a stack frame (local memory) in {', '.join(stacked)}")
        return 1
    if not reports:
        _error("NVRTC reported no kernels")
        return 1
    return 0


# --------------------------------------------------------------------------------------------
# warmup


#: Seconds an idle machine takes to compile one call of the warm-up set (measured: 1-2 s).
_COMPILE_S_IDLE: Final = (1, 2)


def _warmup(ns: argparse.Namespace, console: Console, pytest_args: list[str]) -> int:
    """Compile the warm-up set with a progress bar; say what was compiled and loaded."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from normlab import precompile
    from normlab.errors import NormlabError

    low, high = _COMPILE_S_IDLE
    console.print(
        f"Compiling numba kernels for {', '.join(ns.dtypes)} ({' and '.join(ns.ops)}): about "
        f"{low}-{high} s a call on an idle machine, milliseconds for one already cached"
    )

    def bar(calls: Iterator[precompile.WarmupCall], total: int) -> Iterator[Any]:
        columns = (
            TextColumn("{task.description:<40}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=console, transient=False) as progress:
            task = progress.add_task("warming up", total=total)
            for call in calls:
                progress.update(task, description=call.label)
                yield call
                progress.advance(task)

    try:
        warmed = precompile.warmup(ns.dtypes, ns.ops, cache_dir=ns.cache_dir, progress=bar)
    except NormlabError as exc:
        _error(str(exc))
        return 2
    console.print(
        f"{warmed.calls} calls in {warmed.seconds:.1f} s: {warmed.compiled} kernels compiled, "
        f"{warmed.loaded} loaded from the cache ({warmed.cache_dir})"
    )
    for what in warmed.skipped:
        console.print(f"skipped: {what}")
    return 0


# --------------------------------------------------------------------------------------------
# demo


@dataclass(frozen=True, slots=True)
class _Case:
    """One demo input as NumPy arrays (converted to each backend's family), and its answer."""

    x: np.ndarray
    weight: np.ndarray | None
    bias: np.ndarray | None
    expected: np.ndarray

    @classmethod
    def of(
        cls, x: np.ndarray, weight: np.ndarray | None = None, bias: np.ndarray | None = None
    ) -> _Case:
        """The case of these arrays, answered by the float64 reference."""
        return cls(x, weight, bias, reference.layer_norm(x, weight=weight, bias=bias)[0])

    @property
    def label(self) -> str:
        affine = " with weight and bias" if self.weight is not None else ""
        return f"{self.x.dtype} {list(self.x.shape)}{affine}"

    @property
    def bound(self) -> float:
        """A sanity bound on the error (the conformance suite holds the real tolerances)."""
        scale = max(1.0, float(np.abs(self.expected).max()))
        return float(16 * np.finfo(self.x.dtype).eps * scale)


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What one backend did with one case: its result and time per call, or what went wrong."""

    array_type: str
    y: np.ndarray | None = None
    seconds: float | None = None
    spread: float | None = None
    problem: str | None = None


def _demo(ns: argparse.Namespace, console: Console, pytest_args: list[str]) -> int:
    """Run the worked example and Transformer-sized batches through every available backend."""
    console.print(
        f"normlab {normlab.__version__}: y = (x - mean) / sqrt(var + eps) * weight + bias, with "
        "the mean and population variance of each row over the last axis; eps = 1e-5"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NormlabWarning)
        backends = [b for b in normlab.list_backends() if b.available and "layer_norm" in b.ops]
    failed = False

    worked = _Case.of(np.array(WORKED_EXAMPLE, dtype=np.float32))
    expected = _vector(worked.expected)
    _heading(console, f"The worked example: layer_norm([1, 3, 5, 7]) ≈ {expected}")
    table = Table()
    for column in ("backend", "array", "y", "max |error|"):
        table.add_column(column)
    for b in backends:
        outcome = _run(b, worked, timed=False)
        failed |= not _fits(outcome, worked)
        y = "—" if outcome.y is None else _vector(outcome.y)
        table.add_row(
            Text(b.name, style="bold"),
            Text(outcome.array_type),
            Text(y),
            _error_cell(outcome, worked),
        )
    console.print(table)

    _heading(console, f"A Transformer activation {list(BATCH_SHAPE)}: batch, sequence, hidden")
    table = Table(
        caption="error: max |y - reference| (float64 oracle); time: the median of "
        f"{_TIMING_BATCHES} batches of calls, ± half the spread between their quartiles; GB/s: "
        "bytes of x + y per second at the median"
    )
    timed = ("time per call", "±", "GB/s")
    for column in ("backend", "array", "input", "max |error|", *timed):
        table.add_column(column, justify="right" if column in timed else "left")
    for case in _batch_cases():
        for b in backends:
            outcome = _run(b, case, timed=True)
            failed |= not _fits(outcome, case)
            rate = "—"
            if outcome.seconds is not None:
                rate = f"{2 * case.x.nbytes / outcome.seconds / 1e9:.1f}"
            table.add_row(
                Text(b.name, style="bold"),
                Text(outcome.array_type),
                Text(case.label),
                _error_cell(outcome, case),
                Text(_duration(outcome.seconds)),
                Text("—" if outcome.spread is None else f"{outcome.spread:.0%}"),
                Text(rate),
            )
    console.print(table)
    console.print()
    _print_backends(console)
    if failed:
        _error("some backends failed or exceeded the error bound (see the tables above)")
    return 1 if failed else 0


def _heading(console: Console, text: str) -> None:
    console.print()
    console.print(Text(text, style="bold"))


def _vector(values: np.ndarray) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in values.tolist()) + "]"


def _batch_cases() -> list[_Case]:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(BATCH_SHAPE) * 2.0 + 0.5).astype(np.float32)
    weight = (1.0 + 0.1 * rng.standard_normal(BATCH_SHAPE[-1])).astype(np.float32)
    bias = (0.1 * rng.standard_normal(BATCH_SHAPE[-1])).astype(np.float32)
    # float16 x takes float32 weight and bias (the contract allows both x's dtype and float32).
    return [_Case.of(x, weight, bias), _Case.of(x.astype(np.float16), weight, bias)]


_UNMAKEABLE: Final = "cannot make"
#: Outcomes that are no failure: the case is outside what the backend or its family offers.
_NOT_TRIED: Final = ("does not serve", _UNMAKEABLE)


def _run(backend: Backend, case: _Case, *, timed: bool) -> _Outcome:
    """Convert ``case`` to the backend's family, call layer_norm through it, convert back."""
    dtype = case.x.dtype.name
    if dtype not in backend.dtypes:
        return _Outcome("—", problem=f"does not serve {dtype}")
    try:
        x = backend.from_numpy(case.x)
    except Exception as exc:  # its family has no such arrays here (array_api_strict: no float16)
        return _Outcome("—", problem=f"{_UNMAKEABLE} {dtype} arrays: {type(exc).__name__}: {exc}")
    try:
        kind = f"{arrays.family_of(x)}.{type(x).__qualname__}"
        w = None if case.weight is None else backend.from_numpy(case.weight, like=x)
        b = None if case.bias is None else backend.from_numpy(case.bias, like=x)

        def call() -> Any:
            return normlab.layer_norm(x, weight=w, bias=b, backend=backend.name)

        seconds, spread = _time_per_call(call, _synchronizer(x)) if timed else (None, None)
        y = np.asarray(backend.to_numpy(call()), dtype=np.float64)
    except Exception as exc:  # the demo reports a broken backend and goes on with the others
        return _Outcome("—", problem=f"{type(exc).__name__}: {exc}")
    return _Outcome(kind, y, seconds, spread)


def _fits(outcome: _Outcome, case: _Case) -> bool:
    if outcome.problem is not None:
        return outcome.problem.startswith(_NOT_TRIED)
    return outcome.y is not None and _max_error(outcome.y, case) <= case.bound


def _max_error(y: np.ndarray, case: _Case) -> float:
    return float(np.abs(y - case.expected).max())


def _error_cell(outcome: _Outcome, case: _Case) -> Text:
    if outcome.problem is not None:
        style = "dim" if outcome.problem.startswith(_NOT_TRIED) else "red"
        return Text(outcome.problem, style=style)
    assert outcome.y is not None
    error = _max_error(outcome.y, case)
    return Text(f"{error:.1e}", style="green" if error <= case.bound else "red")


def _time_per_call(call: Callable[[], Any], synchronize: Callable[[], None]) -> tuple[float, float]:
    """The median time per call over batches of calls, after one warm-up call (JIT, caches),
    and the spread: half the distance between the batches' quartiles, relative to the median."""
    call()
    synchronize()
    start = time.perf_counter()
    call()
    synchronize()
    once = max(time.perf_counter() - start, 1e-7)
    repeats = max(1, int(_TIMING_BATCH_S / once))
    times = []
    for _ in range(_TIMING_BATCHES):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        synchronize()
        times.append((time.perf_counter() - start) / repeats)
    low, median, high = np.percentile(times, [25, 50, 75])
    return float(median), float((high - low) / 2 / median)


def _synchronizer(x: Any) -> Callable[[], None]:
    """A function that waits for the work queued on ``x``'s device (nothing on the CPU)."""
    family = arrays.family_of(x)
    if arrays.info(x).device_kind == "cpu":
        return lambda: None
    if family == "cupy":
        import cupy

        stream = cupy.cuda.get_current_stream()
    elif family == "torch":
        import torch

        stream = torch.cuda.current_stream(x.device)
    else:
        raise NotImplementedError(f"the demo cannot time {family} arrays on a device")

    def synchronize() -> None:
        stream.synchronize()

    return synchronize


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    return f"{seconds * 1e3:.2f} ms"
