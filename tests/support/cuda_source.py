"""What the CUDA kernel sources declare, for the launch tests without a GPU: a kernel's
parameter names in order, so that a fake kernel reads its arguments by name, as the real one
does."""

from __future__ import annotations

import re

from normlab.backends import cuda_compile


def parameter_names(source: str, kernel: str) -> tuple[str, ...]:
    """The parameter names of ``kernel`` as the file ``source`` of ``kernels/`` declares them,
    in order."""
    text = (cuda_compile.KERNEL_DIR / source).read_text()
    match = re.search(rf"\n{kernel}\((.*?)\) \{{", text, re.S) or re.search(
        rf"void __launch_bounds__\([^)]*\) {kernel}\((.*?)\) \{{", text, re.S
    )
    assert match, f"{kernel} is not defined in {source}"
    declared = re.sub(r"//[^\n]*", "", match.group(1))
    return tuple(re.findall(r"(\w+)\s*$", piece.strip())[0] for piece in declared.split(","))
