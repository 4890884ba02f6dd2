"""Peak memory of one call on a large input, measured in a fresh subprocess.

A good LayerNorm needs the input, the output and a little scratch. The probe (LayerNorm forward,
allocating) builds the input,
warms the call up on a few rows (imports, JIT compilation), then measures one full call:

- the resident-set high-water mark over the call, relative to the resident set just before it
  (Linux: ``VmHWM`` after resetting it through ``/proc/self/clear_refs``; elsewhere
  ``resource.getrusage``, whose mark cannot be reset, so the input is built without
  temporaries larger than a few MiB);
- the peak of NumPy-allocated memory during the call, through :mod:`tracemalloc`.

Run as ``python -m benchmarks.memory`` it prints one JSON record; :func:`measure` runs it that
way.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any, Final

import normlab
from benchmarks.workloads import Workload, backend_call, reference_call
from normlab import registry

__all__ = ["measure"]

_STATUS: Final = Path("/proc/self/status")
_CLEAR_REFS: Final = Path("/proc/self/clear_refs")
_WARM_ROWS: Final = 8


def measure(subject: str, kind: str, dtype: str, shape: tuple[int, ...]) -> dict[str, Any]:
    """Probe ``subject`` (a backend name when ``kind`` is "backend", else a reference name).

    The subprocess imports the same normlab as this process (and the same plugins, through the
    environment), and this package after it; a failure raises RuntimeError with the end of its
    output.
    """
    env = dict(os.environ)
    roots = (Path(normlab.__file__).resolve().parents[1], Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*map(str, roots), env.get("PYTHONPATH")) if p)
    command = [
        sys.executable,
        "-m",
        "benchmarks.memory",
        subject,
        "--kind",
        kind,
        "--dtype",
        dtype,
        "--shape",
        "x".join(map(str, shape)),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"memory probe for {subject} ({dtype}) exited with {done.returncode}:\n"
            f"{(done.stdout + done.stderr)[-3000:]}"
        )
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def _status_bytes(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _reset_high_water_mark() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
        _status_bytes("VmHWM")
    except (OSError, KeyError):
        return False
    return True


def _probe(subject: str, kind: str, dtype: str, shape: tuple[int, ...]) -> dict[str, Any]:
    data = Workload(shape, dtype)
    input_bytes = data.x.nbytes
    warm = Workload((_WARM_ROWS, shape[-1]), dtype)
    if kind == "backend":
        backend = registry.get(subject)
        backend_call("layer_norm", backend, warm, out=False)()
        call = backend_call("layer_norm", backend, data, out=False)
    else:
        reference_call("layer_norm", subject, warm)()
        call = reference_call("layer_norm", subject, data)
    del data, warm  # the call holds what it reads: a backend's own copy, or x itself
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(os.cpu_count() or 1)
    gc.collect()
    resettable = _reset_high_water_mark()
    before = _status_bytes("VmRSS") if resettable else _maxrss_bytes()
    tracemalloc.start()
    result = call()
    traced_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    after = _status_bytes("VmHWM") if resettable else _maxrss_bytes()
    del result
    return {
        "subject": subject,
        "kind": kind,
        "dtype": dtype,
        "shape": list(shape),
        "input_bytes": input_bytes,
        "rss_extra_bytes": max(0, after - before),
        "numpy_peak_bytes": traced_peak,
        "method": "VmHWM" if resettable else "ru_maxrss",
    }


def main(argv: list[str] | None = None) -> None:
    """Command line: probe one subject and print its JSON record."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("subject", help="a backend name, or torch/textbook/copy/copyto")
    parser.add_argument("--kind", choices=("backend", "reference"), default="backend")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shape", default="8192x4096", help="e.g. 8192x4096")
    args = parser.parse_args(argv)
    shape = tuple(int(n) for n in args.shape.split("x"))
    print(json.dumps(_probe(args.subject, args.kind, args.dtype, shape)))


if __name__ == "__main__":
    main()
