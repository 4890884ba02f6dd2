"""The CUDA kernels with the oldest NVRTC the ``cupy`` extra allows (its ``nvidia-cuda-nvrtc>=``
bound in pyproject.toml; torch 2.13's CUDA wheels pin 13.0.88): the kernels nearest the register
cap compile with no spills and no stack frame, and the NVRTC wheel alone (no cuda-pathfinder)
is enough. The nox session ``nvrtc-floor`` installs that release and sets
``NORMLAB_NVRTC_FLOOR=1``; elsewhere those tests skip. test_cuda_kernels.py compiles every kernel
with the NVRTC installed (in CI, the newest)."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final

import pytest

from normlab.backends import cuda_compile
from normlab.backends.cuda_launch import (
    QUANTIZE_OPS,
    Specialisation,
    all_specialisations,
    program_of,
)
from tests.support.paths import ROOT

FLOOR_RUN: Final = os.environ.get("NORMLAB_NVRTC_FLOOR", "") not in ("", "0")
ARCHS = ("sm_80", "sm_90")


def nvrtc_floor() -> str:
    """The release named by the ``>=`` bound of ``nvidia-cuda-nvrtc`` in the cupy extra."""
    text = (ROOT / "pyproject.toml").read_text()
    extra = re.search(r"^cupy = \[(.*)\]$", text, re.MULTILINE)
    assert extra is not None, "no cupy extra in pyproject.toml"
    bound = re.search(r'"nvidia-cuda-nvrtc>=([^,"]+)', extra.group(1))
    assert bound is not None, "the cupy extra has no nvidia-cuda-nvrtc>= bound"
    return bound.group(1)


def nearest_the_cap() -> list[tuple[Specialisation, ...]]:
    """Per NVRTC program of the quantizing ops, its kernels of the top rung (8 chunks per thread,
    the row's y held until max|y| is reduced: at or near the cap of 128 registers with every
    NVRTC 13.x) with the fewest threads (the wider ones differ only in constants)."""
    chosen = []
    for program in dict.fromkeys(program_of(s) for s in all_specialisations()):
        if program[0].op in QUANTIZE_OPS:
            top = max(s.items for s in program)
            fewest = min(s.threads for s in program if s.items == top)
            chosen.append(tuple(s for s in program if (s.items, s.threads) == (top, fewest)))
    return chosen


def test_the_floor_is_one_release() -> None:
    # pip installs it with ==, so the bound names a release (13.0.48), not a series (13)
    assert re.fullmatch(r"\d+\.\d+\.\d+", nvrtc_floor())


@pytest.mark.skipif(not FLOOR_RUN, reason="set NORMLAB_NVRTC_FLOOR=1 (nox -s nvrtc-floor)")
@pytest.mark.parametrize("arch", ARCHS)
def test_the_kernels_nearest_the_cap_compile_with_the_oldest_nvrtc(
    arch: str, tmp_path: Path
) -> None:
    floor = nvrtc_floor()
    assert importlib.metadata.version("nvidia-cuda-nvrtc") == floor
    major, minor, _ = (int(part) for part in floor.split("."))
    assert cuda_compile.nvrtc_version() == (major, minor)  # that wheel's library, not another
    programs = nearest_the_cap()
    compile_program = functools.partial(
        cuda_compile.compile_kernels, target=arch, cache_dir=tmp_path
    )
    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        modules = list(pool.map(compile_program, programs))
    reports = [r for m in modules for r in m.reports]
    assert reports and len(reports) == sum(map(len, programs))
    bad = [r for r in reports if r.spills or r.stack]
    assert not bad, f"spills or stack frames with NVRTC {floor}: {bad}"
