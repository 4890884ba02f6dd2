"""Compilation of the CUDA kernels in ``kernels/`` (``layer_norm.cu``, ``add_norm.cu``,
``quantize.cu``, ``backward.cu``) with NVRTC, without a GPU.

NVRTC is loaded with ctypes from NVIDIA's ``nvidia-cuda-nvrtc`` wheel (or, failing that, from
``cuda-pathfinder`` or a CUDA toolkit on the library path). :func:`compile_kernels` is the one
compile function: the CuPy backend calls it at run time for the device's architecture and the
tests call it (through :func:`compile_all`) for explicit architectures. For a real architecture
(``sm_90``) it produces a cubin and asks ptxas for a resource report (``--ptxas-options=-v``),
parsed into one :class:`KernelReport` per kernel. The launch shapes the kernels share with the
planner come from :mod:`normlab.constants` as ``-D`` options (:func:`kernel_macros`). Results are
cached on disk, keyed by the source, the headers, the options (those macros included), the kernel
names and the NVRTC version.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import hashlib
import json
import os
import re
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from normlab import constants
from normlab.backends.cache_dirs import cache_root, make_private_dirs
from normlab.backends.cuda_launch import Specialisation, all_specialisations, program_of

__all__ = [
    "KERNEL_DIR",
    "SOURCE",
    "CompiledModule",
    "CudaCompileError",
    "KernelReport",
    "compile_all",
    "compile_kernels",
    "default_cache_dir",
    "kernel_macros",
    "nvrtc_problem",
    "nvrtc_version",
    "parse_ptxas_log",
    "supported_archs",
    "target_for",
]

KERNEL_DIR: Final = Path(__file__).parent / "kernels"
#: The forward kernels' source (each op's file: :data:`~normlab.backends.cuda_launch.SOURCES`).
SOURCE: Final = "layer_norm.cu"
_CACHE_FORMAT: Final = "1"


class CudaCompileError(RuntimeError):
    """NVRTC is missing, refused an option, or the kernel source did not compile."""


@dataclass(frozen=True, slots=True)
class KernelReport:
    """ptxas's resource use of one kernel: registers per thread, bytes of stack, spills, smem."""

    name: str
    arch: str
    registers: int
    stack: int
    spill_stores: int
    spill_loads: int
    shared: int

    @property
    def spills(self) -> int:
        """Bytes spilled to local memory (stores plus loads); 0 for a clean kernel."""
        return self.spill_stores + self.spill_loads


@dataclass(frozen=True, slots=True)
class CompiledModule:
    """One NVRTC program: its image (cubin, or PTX for a ``compute_XX`` target), the lowered
    (mangled) name of each kernel by specialisation name, ptxas reports, and the log."""

    image: bytes
    target: str
    functions: dict[str, str]
    reports: tuple[KernelReport, ...]
    log: str


# --------------------------------------------------------------------------------------------
# The NVRTC library


def _candidates() -> list[str]:
    """Paths or names of libnvrtc to try, most preferred first."""
    found: list[str] = []
    try:
        import nvidia  # the namespace package of NVIDIA's wheels

        for root in nvidia.__path__:
            for pattern in (
                "cu*/lib/libnvrtc.so.*",
                "cuda_nvrtc/lib/libnvrtc.so.*",
                "cu*/bin/nvrtc64_*.dll",
                "cuda_nvrtc/bin/nvrtc64_*.dll",
            ):
                matches = sorted(glob.glob(os.path.join(root, pattern)), reverse=True)
                found.extend(m for m in matches if "builtins" not in os.path.basename(m))
    except ImportError:
        pass
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        found.append(load_nvidia_dynamic_lib("nvrtc").abs_path)
    except Exception:  # not installed, or it found nothing: the next candidates remain
        pass
    system = ctypes.util.find_library("nvrtc")
    if system:
        found.append(system)
    for variable in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(variable)
        if root:
            found.extend(
                sorted(glob.glob(os.path.join(root, "lib64", "libnvrtc.so*")), reverse=True)
            )
    return found


def _load_builtins_beside(path: str) -> None:
    """Load the ``libnvrtc-builtins.so.*`` in the folder of the NVRTC library ``path``, if any.
    NVRTC opens it by name when it compiles; the 13.0 wheels' libnvrtc does not look in its own
    folder, and so finds it only loaded already."""
    folder = os.path.dirname(path)
    if not folder:
        return
    for builtins in sorted(glob.glob(os.path.join(folder, "libnvrtc-builtins.so.*")), reverse=True):
        try:
            ctypes.CDLL(builtins)
        except OSError:
            continue
        return


@functools.lru_cache(maxsize=1)
def _load() -> ctypes.CDLL | str:
    """The NVRTC library with its prototypes set, or the reason it cannot be loaded."""
    candidates = _candidates()
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        _load_builtins_beside(path)
        p, c_int_p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)
        char_pp, size_p = ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)
        prototypes: dict[str, list[Any]] = {
            "nvrtcVersion": [c_int_p, c_int_p],
            "nvrtcGetNumSupportedArchs": [c_int_p],
            "nvrtcGetSupportedArchs": [c_int_p],
            "nvrtcCreateProgram": [
                ctypes.POINTER(p),
                ctypes.c_char_p,
                ctypes.c_char_p,
                ctypes.c_int,
                char_pp,
                char_pp,
            ],
            "nvrtcDestroyProgram": [ctypes.POINTER(p)],
            "nvrtcAddNameExpression": [p, ctypes.c_char_p],
            "nvrtcCompileProgram": [p, ctypes.c_int, char_pp],
            "nvrtcGetProgramLogSize": [p, size_p],
            "nvrtcGetProgramLog": [p, ctypes.c_char_p],
            "nvrtcGetCUBINSize": [p, size_p],
            "nvrtcGetCUBIN": [p, ctypes.c_char_p],
            "nvrtcGetPTXSize": [p, size_p],
            "nvrtcGetPTX": [p, ctypes.c_char_p],
            "nvrtcGetLoweredName": [p, ctypes.c_char_p, char_pp],
        }
        for name, argtypes in prototypes.items():
            function = getattr(lib, name)
            function.argtypes = argtypes
            function.restype = ctypes.c_int
        lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    if not candidates:
        return "the NVRTC library is not installed (pip install nvidia-cuda-nvrtc)"
    return f"the NVRTC library could not be loaded (tried {', '.join(candidates)})"


def nvrtc_problem() -> str | None:
    """Why NVRTC cannot be used here, or ``None`` when it can."""
    lib = _load()
    return lib if isinstance(lib, str) else None


def _nvrtc() -> ctypes.CDLL:
    lib = _load()
    if isinstance(lib, str):
        raise CudaCompileError(lib)
    return lib


def _check(lib: ctypes.CDLL, result: int, what: str) -> None:
    if result != 0:
        message = lib.nvrtcGetErrorString(result).decode()
        raise CudaCompileError(f"{what} failed: {message}")


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the loaded NVRTC."""
    lib = _nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def supported_archs() -> tuple[int, ...]:
    """The architectures NVRTC compiles for, as compute capabilities (``90`` for sm_90)."""
    lib = _nvrtc()
    count = ctypes.c_int()
    _check(lib, lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)), "nvrtcGetNumSupportedArchs")
    archs = (ctypes.c_int * count.value)()
    _check(lib, lib.nvrtcGetSupportedArchs(archs), "nvrtcGetSupportedArchs")
    return tuple(archs)


def target_for(capability: int) -> str:
    """The compile target for a device of compute capability ``capability`` (``90``): a cubin
    (``sm_90``) when NVRTC knows the architecture, else PTX for the newest one below it
    (``compute_XX``), which the driver compiles when loading."""
    archs = supported_archs()
    if capability in archs:
        return f"sm_{capability}"
    older = [a for a in archs if a <= capability]
    if not older:
        major, minor = nvrtc_version()
        raise CudaCompileError(
            f"NVRTC {major}.{minor} compiles for compute capabilities {archs}, none of them at "
            f"or below the device's {capability}"
        )
    return f"compute_{max(older)}"


# --------------------------------------------------------------------------------------------
# ptxas reports

_ENTRY: Final = re.compile(r"Compiling entry function '([^']+)'")
_FRAME: Final = re.compile(
    r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_USED: Final = re.compile(r"Used (\d+) registers")
_SMEM: Final = re.compile(r"(\d+) bytes smem")


def parse_ptxas_log(log: str) -> dict[str, dict[str, int]]:
    """Resource use per mangled kernel name from an NVRTC log of ``--ptxas-options=-v``:
    ``{name: {"registers", "stack", "spill_stores", "spill_loads", "shared"}}``."""
    kernels: dict[str, dict[str, int]] = {}
    current: dict[str, int] | None = None
    for line in log.splitlines():
        entry = _ENTRY.search(line)
        if entry:
            current = kernels.setdefault(
                entry.group(1),
                {
                    "registers": 0,
                    "stack": 0,
                    "spill_stores": 0,
                    "spill_loads": 0,
                    "shared": 0,
                },
            )
            continue
        if current is None:
            continue
        frame = _FRAME.search(line)
        if frame:
            current["stack"], current["spill_stores"], current["spill_loads"] = (
                int(g) for g in frame.groups()
            )
        used = _USED.search(line)
        if used:
            current["registers"] = int(used.group(1))
            smem = _SMEM.search(line)
            current["shared"] = int(smem.group(1)) if smem else 0
    return kernels


# --------------------------------------------------------------------------------------------
# Compilation


def default_cache_dir() -> Path:
    """``$NORMLAB_CACHE_DIR/cuda``, else ``$XDG_CACHE_HOME/normlab/cuda`` (default
    ``~/.cache/normlab/cuda``); with no home directory, a folder that cannot exist (every kernel
    is compiled afresh)."""
    return cache_root("cuda") or Path(os.devnull) / "normlab-cuda"


def _legacy_cache_dir() -> Path | None:
    """Where earlier normlab versions kept cubins: ``$NORMLAB_CACHE_DIR`` itself (read, never
    written)."""
    explicit = os.environ.get("NORMLAB_CACHE_DIR")
    return Path(explicit) if explicit else None


def _read_sources(name: str) -> tuple[str, dict[str, str]]:
    """The kernel source ``name`` and its headers (every ``*.cuh`` beside it), passed to NVRTC in
    memory."""
    source = (KERNEL_DIR / name).read_text()
    headers = {p.name: p.read_text() for p in sorted(KERNEL_DIR.glob("*.cuh"))}
    return source, headers


def kernel_macros() -> list[str]:
    """The NVRTC options that give the kernels their launch shapes:
    ``-DNORMLAB_<NAME>=<value>`` for each name of :data:`normlab.constants.CUDA_MACROS` (without
    its ``CUDA_`` prefix), with the value :mod:`normlab.constants` holds now."""
    return [
        f"-DNORMLAB_{name.removeprefix('CUDA_')}={int(getattr(constants, name))}"
        for name in constants.CUDA_MACROS
    ]


def compile_kernels(
    specs: Sequence[Specialisation], target: str, cache_dir: Path | None = None
) -> CompiledModule:
    """Compile the kernels ``specs`` for ``target`` (``sm_90``: cubin; ``compute_90``: PTX) in
    one NVRTC program; they must share a source file. Cached in ``cache_dir`` (default
    :func:`default_cache_dir`); a cache that cannot be written is skipped. Raises
    :class:`CudaCompileError` with the NVRTC log."""
    files = {s.source for s in specs}
    if len(files) != 1:
        raise ValueError(f"one NVRTC program compiles one source file, not {sorted(files)}")
    (filename,) = files
    source, headers = _read_sources(filename)
    options = [f"--gpu-architecture={target}", "--std=c++17", *kernel_macros()]
    if target.startswith("sm_"):
        options.append("--ptxas-options=-v")
    expressions = [s.expression for s in specs]
    key = hashlib.sha256(
        json.dumps([_CACHE_FORMAT, nvrtc_version(), source, headers, options, expressions]).encode()
    ).hexdigest()
    directory = default_cache_dir() if cache_dir is None else cache_dir
    cached = _read_cache(directory, key)
    legacy = _legacy_cache_dir() if cache_dir is None else None
    if cached is None and legacy is not None:
        cached = _read_cache(legacy, key, legacy=True)
        if cached is not None:  # carried into the new layout, with its digest
            _write_cache(directory, key, *cached)
    if cached is None:
        image, lowered, log = _compile(filename, source, headers, options, expressions)
        _write_cache(directory, key, image, {"lowered": lowered, "log": log})
    else:
        image, meta = cached
        lowered, log = meta["lowered"], meta["log"]
    functions = {s.name: lowered[s.expression] for s in specs}
    usage = parse_ptxas_log(log)
    reports = tuple(
        KernelReport(name=s.name, arch=target, **usage[functions[s.name]])
        for s in specs
        if functions[s.name] in usage
    )
    return CompiledModule(image=image, target=target, functions=functions, reports=reports, log=log)


def _compile(
    filename: str, source: str, headers: dict[str, str], options: list[str], expressions: list[str]
) -> tuple[bytes, dict[str, str], str]:
    lib = _nvrtc()
    program = ctypes.c_void_p()
    names = (ctypes.c_char_p * len(headers))(*(n.encode() for n in headers))
    texts = (ctypes.c_char_p * len(headers))(*(t.encode() for t in headers.values()))
    _check(
        lib,
        lib.nvrtcCreateProgram(
            ctypes.byref(program), source.encode(), filename.encode(), len(headers), texts, names
        ),
        "nvrtcCreateProgram",
    )
    try:
        for expression in expressions:
            _check(
                lib,
                lib.nvrtcAddNameExpression(program, expression.encode()),
                f"nvrtcAddNameExpression({expression})",
            )
        encoded = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        result = lib.nvrtcCompileProgram(program, len(options), encoded)
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetProgramLogSize(program, ctypes.byref(size)), "nvrtcGetProgramLog")
        buffer = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetProgramLog(program, buffer), "nvrtcGetProgramLog")
        log = buffer.value.decode(errors="replace")
        if result != 0:
            message = lib.nvrtcGetErrorString(result).decode()
            raise CudaCompileError(f"NVRTC {' '.join(options)}: {message}\n{log}")
        cubin = options[0].startswith("--gpu-architecture=sm_")
        get_size, get = (
            (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN)
            if cubin
            else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
        )
        _check(lib, get_size(program, ctypes.byref(size)), "nvrtcGet{CUBIN,PTX}Size")
        image = ctypes.create_string_buffer(size.value)
        _check(lib, get(program, image), "nvrtcGet{CUBIN,PTX}")
        lowered = {}
        for expression in expressions:
            name = ctypes.c_char_p()
            _check(
                lib,
                lib.nvrtcGetLoweredName(program, expression.encode(), ctypes.byref(name)),
                f"nvrtcGetLoweredName({expression})",
            )
            lowered[expression] = (name.value or b"").decode()
        return image.raw, lowered, log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


def _read_cache(
    directory: Path, key: str, legacy: bool = False
) -> tuple[bytes, dict[str, Any]] | None:
    """The cached image and metadata for ``key``, or ``None`` when absent or not intact: the
    image's size and SHA-256 must match those its metadata records. ``legacy``: entries written
    by normlab before digests were recorded are accepted (and re-stored with one)."""
    try:
        meta = json.loads((directory / f"{key}.json").read_text())
        image = (directory / f"{key}.bin").read_bytes()
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or not isinstance(meta.get("lowered"), dict):
        return None
    recorded = (meta.pop("size", None), meta.pop("sha256", None))
    if recorded == (None, None) and legacy:
        return image, meta
    if recorded != (len(image), hashlib.sha256(image).hexdigest()):
        return None
    return image, meta


def _write_cache(directory: Path, key: str, image: bytes, meta: dict[str, Any]) -> None:
    """Write atomically (temporary file, then rename): concurrent processes may share the cache.
    The image goes first, so a metadata file always has its image; the metadata records the
    image's size and SHA-256. Folders are created 0700; a cache that cannot be written is
    skipped."""
    record = {**meta, "size": len(image), "sha256": hashlib.sha256(image).hexdigest()}
    try:
        make_private_dirs(directory)
        for name, data in ((f"{key}.bin", image), (f"{key}.json", json.dumps(record).encode())):
            temporary = directory / f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"
            temporary.write_bytes(data)
            os.replace(temporary, directory / name)
    except OSError:
        pass


def compile_all(
    arch: str, cache_dir: Path | None = None, workers: int | None = None
) -> list[KernelReport]:
    """Compile every specialisation for ``arch`` (``sm_80``), one NVRTC program per
    :func:`~normlab.backends.cuda_launch.program_of`, programs in parallel; one report per
    kernel, in :func:`~normlab.backends.cuda_launch.all_specialisations` order."""
    programs = list(dict.fromkeys(program_of(s) for s in all_specialisations()))
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        modules = list(pool.map(lambda p: compile_kernels(p, arch, cache_dir), programs))
    reports = {r.name: r for m in modules for r in m.reports}
    return [reports[s.name] for s in all_specialisations()]
