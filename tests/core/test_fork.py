"""Calling normlab, then forking, then calling again in the children.

Thread pools do not survive ``fork()``: the child has one thread, and a pool the parent started
is gone. What each backend does in a forked child after the parent has used it:

* numpy: no threads of its own; works.
* numba: a child forked after the parent started numba's parallel kernels runs the serial
  kernels, on its one thread, whatever the input size (``os.register_at_fork`` marks it; see
  ``numba_pool.Pool``). Parallel kernels there would kill it under the ``omp`` threading
  layer (GNU OpenMP: "fork() called from a process already using GNU OpenMP, this is unsafe"),
  torch DataLoader workers that normalize NumPy arrays included.
* torch: torch's own intra-op pool hangs in a forked child unless the child sets
  ``torch.set_num_threads(1)``, as DataLoader workers do; normlab adds nothing to that.

``spawn`` and ``forkserver`` children start fresh and work with every backend. Each scenario
runs in a fresh interpreter (the parent) so that what the parent used is known.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import ROOT

pytest.importorskip("numba")
pytest.importorskip("torch")

CHILD_TIMEOUT_S = 60

#: The parent: uses every backend (numba's parallel kernels and torch's pool included), then,
#: while ``threads`` threads keep calling normlab, starts a child with the given start method
#: that makes each kind of call. Prints the child's exit status (0: every call matched the
#: reference; "hung": killed after the timeout) and whether the parent still works.
PARENT = """
import json, multiprocessing, sys, threading
import numpy as np
import normlab
from normlab import reference

SMALL = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
LARGE = np.random.default_rng(1).standard_normal((256, 512)).astype(np.float32)


def call(kind):
    import torch
    x = LARGE if kind.endswith("large") else SMALL
    if kind.startswith("torch"):
        torch.set_num_threads(1)  # what DataLoader workers do; torch's pool is gone in a child
        return x, normlab.layer_norm(torch.from_numpy(x)).numpy()
    backend = kind.split("-")[0]
    return x, normlab.layer_norm(x, backend=None if backend == "default" else backend)


def child(kinds):
    # each kind of call in turn; exit status 10 + i when call i does not match the reference
    for i, kind in enumerate(kinds):
        x, y = call(kind)
        if not np.allclose(y, reference.layer_norm(x)[0], atol=1e-4):
            sys.exit(10 + i)


def busy(stop):
    while not stop.is_set():
        normlab.layer_norm(SMALL, backend="numba")
        normlab.layer_norm(LARGE, backend="numpy")


if __name__ == "__main__":
    method, kinds, threads = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
    for kind in ("numpy-large", "numba-large", "numba-small", "torch-large"):
        call(kind)  # every kernel the threads below run is compiled before they start
    stop = threading.Event()
    workers = [threading.Thread(target=busy, args=(stop,)) for _ in range(threads)]
    for t in workers:
        t.start()
    process = multiprocessing.get_context(method).Process(target=child, args=(kinds,))
    process.start()
    process.join(TIMEOUT)
    if process.is_alive():
        process.kill()
        process.join()
    outcome = {"child": "hung" if process.exitcode == -9 else process.exitcode}
    stop.set()
    for t in workers:
        t.join()
    outcome["parent afterwards"] = int(not np.allclose(call("numba-large")[1],
                                                       reference.layer_norm(LARGE)[0], atol=1e-4))
    print(json.dumps(outcome))
"""

#: DataLoader workers (forked) normalizing in ``__getitem__``; the parent used normlab first.
DATALOADER = """
import json, sys
import numpy as np, torch
from torch.utils.data import DataLoader, Dataset
import normlab

KIND = sys.argv[1]
LARGE = np.random.default_rng(1).standard_normal((256, 512)).astype(np.float32)

class Normalized(Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        if KIND == "tensors":
            return normlab.layer_norm(torch.from_numpy(LARGE) + i)
        return torch.from_numpy(normlab.layer_norm(LARGE + i))

if __name__ == "__main__":
    normlab.layer_norm(LARGE)
    normlab.layer_norm(torch.from_numpy(LARGE))
    loader = DataLoader(Normalized(), batch_size=2, num_workers=2, timeout=TIMEOUT,
                        multiprocessing_context="fork")
    try:
        batches = [tuple(b.shape) for b in loader]
    except RuntimeError as exc:
        batches = str(exc)
    print(json.dumps(batches))
"""


def run_parent(tmp_path: Path, script: str, *args: str) -> Any:
    """Run ``script`` as the main module of a fresh interpreter; its last line is JSON."""
    path = tmp_path / "parent.py"
    path.write_text(script.replace("TIMEOUT", str(CHILD_TIMEOUT_S)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("NORMLAB_")}
    env.update(PYTHONPATH=str(ROOT), NORMLAB_DISABLE_PLUGIN_AUTOLOAD="1")
    done = subprocess.run(
        [sys.executable, str(path), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=6 * CHILD_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_forked_children_call_normlab(tmp_path: Path) -> None:
    """Children forked while four parent threads are inside normlab calls."""
    kinds = ["numpy-large", "numba-small", "torch-small", "torch-large", "default-small"]
    outcome = run_parent(tmp_path, PARENT, "fork", ",".join(kinds), "4")
    assert outcome == {"child": 0, "parent afterwards": 0}


def test_numba_parallel_kernels_in_forked_children(tmp_path: Path) -> None:
    """Large inputs in a child forked after the parent went parallel run the serial kernels."""
    # default-large: numba is the backend chosen for NumPy arrays when it is installed
    outcome = run_parent(tmp_path, PARENT, "fork", "default-large,numba-large", "0")
    assert outcome == {"child": 0, "parent afterwards": 0}


def test_forkserver_children_call_every_backend(tmp_path: Path) -> None:
    """Fresh children (forkserver; spawn starts them the same way) use every backend."""
    kinds = ["numba-large", "default-large", "torch-large"]
    outcome = run_parent(tmp_path, PARENT, "forkserver", ",".join(kinds), "0")
    assert outcome == {"child": 0, "parent afterwards": 0}


def test_dataloader_workers_normalizing_tensors(tmp_path: Path) -> None:
    assert run_parent(tmp_path, DATALOADER, "tensors") == [[2, 256, 512]] * 2


def test_dataloader_workers_normalizing_numpy_arrays(tmp_path: Path) -> None:
    assert run_parent(tmp_path, DATALOADER, "arrays") == [[2, 256, 512]] * 2
