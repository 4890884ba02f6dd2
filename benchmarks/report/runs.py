"""A saved benchmark run: its JSON, the names in it, and its timed calls as saved.

A run is the JSON that ``bench_matrix.py`` saves through pytest-benchmark, with the ``normlab``
section that ``conftest.py`` adds (settings, load average, peak memory, skips). Each timed call
says what it is (``extra_info``: kind, op, subject, mode, shape, dtype, bytes moved) and how long
its rounds took; every time here is the best round (pytest-benchmark's ``min``): on a shared
machine noise only adds time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

__all__ = [
    "COMPOSED",
    "FUSED",
    "LIMITS",
    "MODE_LABELS",
    "OP_TITLES",
    "PEERS",
    "Call",
    "calls",
    "load",
    "ops",
    "reference_label",
]

#: The ops of the matrix, in the order of the report, with their titles.
OP_TITLES: Final = {
    "layer_norm": "LayerNorm forward",
    "rms_norm": "RMSNorm forward",
    "layer_norm_backward": "LayerNorm backward",
    "rms_norm_backward": "RMSNorm backward",
    "add_layer_norm": "Residual add + LayerNorm (fused)",
    "add_rms_norm": "Residual add + RMSNorm (fused)",
}
#: The fused ops, and the unfused pair each is judged against: torch eager's add, then
#: normlab's base op on numba.
FUSED: Final = ("add_layer_norm", "add_rms_norm")
COMPOSED: Final = "add_numba"
#: The copy limits: measured once per input, shared by every op.
LIMITS: Final = ("copy", "copyto")
#: The peers: what a user could call instead of normlab ("torch" is torch eager).
PEERS: Final = ("torch", "ort", "ort_iobinding", "torch_compile")
REFERENCE_LABELS: Final = {
    "textbook": "textbook NumPy",
    "copy": "x.copy()",
    "copyto": "np.copyto",
    "ort": "ORT session.run",
    "ort_iobinding": "ORT io_binding",
    "torch_compile": "torch.compile",
}
TORCH_LABELS: Final = {
    "layer_norm": "torch F.layer_norm",
    "rms_norm": "torch F.rms_norm",
    "layer_norm_backward": "torch autograd backward",
    "rms_norm_backward": "torch autograd backward",
    "add_layer_norm": "torch x + r, then F.layer_norm",
    "add_rms_norm": "torch x + r, then F.rms_norm",
}
MODE_LABELS: Final = {"out": " out=", "post": " post-norm"}
_ITEMSIZE: Final = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def reference_label(op: str | None, subject: str) -> str:
    """How the reference point ``subject`` of ``op`` is called in tables."""
    if subject == "torch" and op is not None:
        return TORCH_LABELS.get(op, f"torch {op}")
    if subject == COMPOSED and op in FUSED:
        return f"torch x + r, then normlab.{op.removeprefix('add_')} (numba)"
    return REFERENCE_LABELS.get(subject, subject)


@dataclass(frozen=True, slots=True)
class Call:
    """One timed call as saved: a backend's call of an op, or a reference point beside it.

    ``kind`` is ``"reference"`` or the op of a backend call; ``op`` the op it belongs to (None
    for the copy limits, which serve every op); ``nbytes`` the bytes it must move; ``seconds``
    its best round; ``default``: normlab chooses this backend for this NumPy input when no
    backend is named.
    """

    kind: str
    op: str | None
    subject: str
    mode: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    seconds: float
    default: bool

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def label(self) -> str:
        if self.kind == "reference":
            return reference_label(self.op, self.subject)
        return self.subject + MODE_LABELS.get(self.mode, "")

    @property
    def input_bytes(self) -> int:
        """The bytes of ``x``: what makes an input large or small."""
        return math.prod(self.shape) * _ITEMSIZE.get(self.dtype, 4)

    @property
    def key(self) -> tuple[str | None, str, str, str, tuple[int, ...], str]:
        return self.op, self.kind, self.subject, self.mode, self.shape, self.dtype


def load(path: str | Path) -> dict[str, Any]:
    """A saved run."""
    return json.loads(Path(path).read_text())  # type: ignore[no-any-return]


def _op(info: dict[str, Any]) -> str | None:
    """The op a saved call belongs to (None for a copy limit)."""
    if info["kind"] != "reference":
        return str(info["kind"])
    if info["subject"] in LIMITS:
        return None
    return str(info["op"])


def calls(run: dict[str, Any]) -> list[Call]:
    """Every timed call of the matrix in ``run`` (not the dispatch pairs), in the order measured."""
    result = []
    for bench in run["benchmarks"]:
        info = bench["extra_info"]
        if "bytes" not in info:
            continue
        result.append(
            Call(
                kind=info["kind"],
                op=_op(info),
                subject=info["subject"],
                mode=info["mode"],
                shape=tuple(info["shape"]),
                dtype=info["dtype"],
                nbytes=int(info["bytes"]),
                seconds=float(bench["stats"]["min"]),
                default=bool(info.get("default", False)),
            )
        )
    return result


def ops(timed: Sequence[Call]) -> list[str]:
    """The ops measured in ``timed``, in report order (unknown ops last)."""
    found = {c.op for c in timed if c.op is not None}
    return [op for op in OP_TITLES if op in found] + sorted(found - set(OP_TITLES))
