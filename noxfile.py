"""Sessions for tests, lint, types, docs, benchmarks and the demo: ``python3 -m nox -l`` lists them.

``python3 -m nox`` alone runs the checks CI runs (see README.md). Each session installs what it
needs into its own virtualenv, with the interpreter that runs nox, and keeps Numba's cache in
its own temporary folder; ``demo`` alone keeps its virtualenv and Numba cache between runs.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from pathlib import Path

import nox

#: What ``python3 -m nox`` runs: the checks of CI.
nox.options.sessions = [
    "lint",
    "types",
    "tests-numpy",
    "tests-all",
    "nvrtc-floor",
    "plugin-jax",
    "plugin-dask",
    "docs",
    "bench-quick",
    "wheel",
    "boundscheck",
    "fuzz",
]

LINT_PATHS = ("normlab", "tests", "benchmarks", "plugins", "fuzz", "noxfile.py")
EXAMPLE_PLUGIN = "./plugins/normlab-example"
RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"
IMPORT_LINTER = "import-linter==2.16"
#: The test sessions run their tests on every core (pytest-xdist; ``-- -n 0`` runs them in
#: one process). Each worker compiles into a Numba cache of its own (tests/conftest.py).
XDIST = "pytest-xdist==3.8.0"
PARALLEL = ("-n", "auto")


def _install(session: nox.Session, *requirements: str) -> None:
    """``pip install --no-compile``: a session's venv is new and most of what it installs is
    never imported (torch's .pyc alone took 18 of the 26 s of its install); Python compiles
    what a session does import when it first imports it."""
    session.install("--no-compile", *requirements)


def _isolate(session: nox.Session) -> None:
    """Point Numba's and NVRTC's caches (and TMPDIR) at this session's own temporary folder."""
    tmp = Path(session.create_tmp())
    session.env["NUMBA_CACHE_DIR"] = str(tmp / "numba-cache")
    session.env["NORMLAB_CACHE_DIR"] = str(tmp / "cuda-cache")


@nox.session(name="tests-numpy")
def tests_numpy(session: nox.Session) -> None:
    """The tests with NumPy only: whatever needs torch, numba or cupy skips, saying why."""
    _isolate(session)
    _install(session, ".[test]", XDIST)
    session.run("pytest", *PARALLEL, *session.posargs)


@nox.session(name="tests-all")
def tests_all(session: nox.Session) -> None:
    """The tests with every backend library and the example plugin installed."""
    _isolate(session)
    _install(session, ".[test,numba,torch,cupy,bfloat16,models]", EXAMPLE_PLUGIN, XDIST)
    session.env["NORMLAB_REQUIRE_MODELS"] = "1"  # the MiniLM test must run, not skip
    session.run("pytest", *PARALLEL, "tests", f"{EXAMPLE_PLUGIN}/tests", *session.posargs)


def _nvrtc_floor() -> str:
    """The oldest nvidia-cuda-nvrtc the cupy extra allows: the release its ``>=`` bound names."""
    found = re.search(r'"nvidia-cuda-nvrtc>=([^,"]+)', Path("pyproject.toml").read_text())
    if found is None:
        raise RuntimeError("pyproject.toml: the cupy extra has no nvidia-cuda-nvrtc>= bound")
    return found.group(1)


@nox.session(name="nvrtc-floor")
def nvrtc_floor(session: nox.Session) -> None:
    """The CUDA kernels nearest the register cap compiled with the oldest NVRTC the cupy extra
    allows, that wheel alone (tests-all compiles every kernel with the newest)."""
    _isolate(session)
    _install(session, ".[test]", f"nvidia-cuda-nvrtc=={_nvrtc_floor()}")
    session.env["NORMLAB_NVRTC_FLOOR"] = "1"
    session.run("pytest", "tests/backends/cuda/test_cuda_nvrtc_floor.py", *session.posargs)


@nox.session(name="plugin-jax")
def plugin_jax(session: nox.Session) -> None:
    """The normlab-jax plugin, installed as a user would: its tests, then the conformance suite
    on it run by pytest (as docs/testing.md shows), so that every core takes a share of it."""
    _isolate(session)
    _install(session, ".[test]", "./plugins/normlab-jax[test]", XDIST)
    in_process = "not test_conformance_suite"  # the plugin's own test runs the suite in one process
    session.run("pytest", *PARALLEL, "plugins/normlab-jax", "-k", in_process, *session.posargs)
    session.run(
        "pytest",
        *PARALLEL,
        "--pyargs",
        "normlab.testing",
        "--normlab-backend=jax",
        *session.posargs,
    )


@nox.session(name="plugin-dask")
def plugin_dask(session: nox.Session) -> None:
    """The normlab-dask plugin: its tests on a 2-process LocalCluster, the suite included."""
    _isolate(session)
    _install(session, ".[test,numba]", "./plugins/normlab-dask[test]")
    session.run("pytest", "plugins/normlab-dask", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint rules and formatting; import-linter: the import layers (pyproject.toml)."""
    _install(session, RUFF, IMPORT_LINTER)
    session.run("ruff", "check", *LINT_PATHS)
    session.run("ruff", "format", "--check", *LINT_PATHS)
    session.run("lint-imports")  # reads the source only: normlab need not be installed


@nox.session
def types(session: nox.Session) -> None:
    """mypy, strict, on the normlab package."""
    _install(session, MYPY, ".[test,numba,torch,bfloat16]")  # typed against the real libraries
    session.run("mypy", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the site strictly (its generated examples run), then test every code example."""
    _isolate(session)
    session.env["NO_MKDOCS_2_WARNING"] = "1"  # Material's banner about MkDocs 2.0
    _install(session, ".[docs,numba,test]", RUFF)  # test: the tests' own needs; ruff: signatures
    site = Path(session.create_tmp()) / "site"
    session.run("mkdocs", "build", "--strict", "--site-dir", str(site))
    session.env["NORMLAB_SITE_DIR"] = str(site)  # test_docs scans the built HTML
    session.run("pytest", "tests/tools/test_docs.py", *session.posargs)


#: The full matrix's peers beside torch (benchmarks/peers.py): bench installs them, bench-quick
#: (CI) does not, so CI's time stays as it is.
BENCH_PEERS = ("onnxruntime==1.31.1", "onnx==1.23.2")


@nox.session
def bench(session: nox.Session) -> None:
    """The full benchmark matrix with its peers, within its 45-minute budget, then the page."""
    _isolate(session)
    _install(session, ".[bench,numba,torch,bfloat16]", *BENCH_PEERS)
    session.run("python", "benchmarks/run.py", "--full", *session.posargs)


@nox.session(name="bench-quick")
def bench_quick(session: nox.Session) -> None:
    """A quick pass over the benchmark matrix."""
    _isolate(session)
    _install(session, ".[bench,numba,torch,bfloat16]")
    session.run("python", "benchmarks/run.py", "--quick", *session.posargs)


@nox.session(reuse_venv=True)
def demo(session: nox.Session) -> None:
    """The worked example and a Transformer batch through every available backend.

    The README's first command, so it starts fast: the virtualenv is reused between runs (this
    session only), normlab is installed editable once and again only when pyproject.toml
    changes (pip's progress shown), and Numba's cache lives in the virtualenv, so a second run
    loads the kernels instead of compiling them.
    """
    venv = Path(session.virtualenv.location)
    session.env["NUMBA_CACHE_DIR"] = str(venv / "numba-cache")
    stamp = venv / "normlab-demo-installed"
    wanted = hashlib.sha256(Path("pyproject.toml").read_bytes()).hexdigest()
    if not stamp.exists() or stamp.read_text() != wanted:
        session.install("--progress-bar", "on", "-e", ".[numba,torch,bfloat16]", silent=False)
        stamp.write_text(wanted)
    session.run("python", "-m", "normlab", "demo")


#: The gating fuzz run (fuzz/replay.py): the committed corpus, then a fixed number of inputs
#: made from it by seeded mutations, with no coverage feedback, so one commit always gives one
#: verdict.
FUZZ_SEED = "20261201"
FUZZ_RUNS = "60000"
FUZZ_CORPUS = "fuzz/corpus"


@nox.session
def fuzz(session: nox.Session) -> None:
    """Replay the committed fuzz corpus, then a fixed-seed search of fixed length."""
    _isolate(session)
    _install(session, ".[test,numba]", "atheris")
    tmp = Path(session.create_tmp())
    session.run(
        "python",
        "fuzz/replay.py",
        f"--seed={FUZZ_SEED}",
        f"--runs={FUZZ_RUNS}",
        f"--artifacts={tmp}",
        FUZZ_CORPUS,
        *session.posargs,
    )


@nox.session(name="fuzz-explore")
def fuzz_explore(session: nox.Session) -> None:
    """Open-ended fuzzing (not in CI): a random seed, ten minutes unless ``-- -max_total_time=N``.

    A crash is written to ``fuzz/findings/``; after fixing it, move it into ``fuzz/corpus/`` so
    the gating ``fuzz`` session replays it from then on.
    """
    _isolate(session)
    _install(session, ".[test,numba]", "atheris")
    seed = str(secrets.randbelow(2**31 - 1) + 1)
    session.log(f"fuzz-explore seed: {seed} (rerun with -- -seed={seed})")
    findings = Path("fuzz/findings")
    findings.mkdir(exist_ok=True)
    scratch = Path(session.create_tmp()) / "fuzz-corpus"  # new inputs; the repo is only read
    scratch.mkdir(exist_ok=True)
    session.run(
        "python",
        "fuzz/fuzz_validation.py",
        f"-seed={seed}",
        "-max_total_time=600",
        "-timeout=120",
        "-rss_limit_mb=4096",
        "-max_len=512",
        f"-artifact_prefix={findings}/",
        str(scratch),
        FUZZ_CORPUS,
        *session.posargs,
    )


@nox.session
def boundscheck(session: nox.Session) -> None:
    """The conformance suite on numba, every kernel compiled afresh with bounds checks, on NumPy
    arrays and on CPU torch tensors (whose small calls take the kernels by address)."""
    _isolate(session)
    _install(session, ".[test,numba,torch]", XDIST)
    session.env["NORMLAB_SLOW_TESTS"] = "1"
    session.run("pytest", *PARALLEL, "tests/backends/numba/test_boundscheck.py", *session.posargs)


@nox.session
def wheel(session: nox.Session) -> None:
    """Build sdist and wheel, install the wheel in a fresh venv, run the suite from there."""
    _install(session, "build")
    session.run("bash", "scripts/check_wheel.sh", "python", external=True)
