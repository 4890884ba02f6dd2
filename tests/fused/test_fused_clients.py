"""The fused ops in real transformers (issue 17's clients), against the unpatched models.

- all-MiniLM-L6-v2, a post-norm BERT: each ``BertSelfOutput``/``BertOutput`` computes
  ``LayerNorm(dropout(dense(h)) + input)`` as one ``add_layer_norm(..., return_residual=False)``.
- A seeded, randomly initialised small Llama, pre-norm: each decoder layer's residual add and
  ``post_attention_layernorm`` are one :class:`normlab.torch.AddRMSNorm` call, whose ``(y, h)``
  feed the MLP and the next residual add.

The comparison is test_torch_module's for MiniLM: the output and every parameter gradient of
the patched float32 model are, norm-wise, as close to a float64 copy of the unpatched model as
the unpatched float32 model is (three times its error, plus the table's float32 ``compute``
tolerance of the reference's norm). Both need the ``models`` extra (see transformer_models).
"""

from __future__ import annotations

import copy
import math
import types
from collections.abc import Callable
from typing import Any

import pytest

from normlab import dispatch, registry
from normlab.testing.tolerances import TOLERANCES
from tests.support.transformer_models import fuse_bert_outputs, load_minilm, models_extra

torch = pytest.importorskip("torch")
nt = pytest.importorskip("normlab.torch")


@pytest.fixture(params=[None, "numba"])
def backend(request: pytest.FixtureRequest) -> str | None:
    """normlab's own choice, or numba named (through normlab's custom ops)."""
    if request.param == "numba":
        numba = registry.get("numba")
        if not numba.available:
            pytest.skip(f"backend 'numba' is unavailable here: {numba.reason}")
        if not all(dispatch.keeps_graph(numba, op) for op in ("layer_norm", "rms_norm")):
            pytest.skip("numba provides no layer_norm_backward/rms_norm_backward")
    name: str | None = request.param
    return name


def _output_and_grads(model: Any, run: Callable[[Any], Any]) -> list[Any]:
    """The model's last hidden state and the gradient of a fixed loss for every parameter."""
    hidden = run(model).last_hidden_state
    weights = torch.linspace(-1, 1, hidden.numel(), dtype=hidden.dtype).reshape(hidden.shape)
    params = list(model.parameters())
    grads = torch.autograd.grad(
        (hidden * weights).sum(), params, allow_unused=True, materialize_grads=True
    )
    return [hidden.detach(), *grads]


def _assert_as_close_as_torch(model: Any, patched: Any, run: Callable[[Any], Any]) -> None:
    """``patched`` (float32) is norm-wise as close to a float64 copy of ``model`` as ``model``
    itself is, for the output and every parameter gradient (see the module docstring)."""
    oracle = _output_and_grads(copy.deepcopy(model).double(), run)
    stock = _output_and_grads(model, run)
    mine = _output_and_grads(patched, run)
    names = ["last_hidden_state", *(name for name, _ in model.named_parameters())]
    compute = TOLERANCES["float32"].compute
    for name, want, theirs, got in zip(names, oracle, stock, mine, strict=True):
        torch_error = float((theirs.double() - want).norm())
        our_error = float((got.double() - want).norm())
        allowed = 3 * torch_error + compute * float(want.norm())
        assert math.isfinite(our_error) and our_error <= allowed, (
            f"{name}: patched error {our_error:.3g}, unpatched error {torch_error:.3g} (norms)"
        )


# --------------------------------------------------------------------------------------------
# all-MiniLM-L6-v2: post-norm, add_layer_norm(..., return_residual=False)


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any]]:
    return load_minilm(tmp_path_factory.mktemp("hf"))


def test_minilm_post_norm_fused(minilm: tuple[Any, dict[str, Any]], backend: str | None) -> None:
    model, batch = minilm
    patched = copy.deepcopy(model)
    calls: list[str] = []
    assert fuse_bert_outputs(patched, backend, calls) == 12
    _assert_as_close_as_torch(model, patched, lambda m: m(**batch))
    assert calls.count("BertSelfOutput") == calls.count("BertOutput") == 6  # one forward each


# --------------------------------------------------------------------------------------------
# A small Llama: pre-norm, AddRMSNorm's (y, h)


LLAMA_SEED = 1234


@pytest.fixture(scope="module")
def llama() -> tuple[Any, Any]:
    """A randomly initialised (seeded) 3-layer Llama, hidden 96, eval mode, with random RMSNorm
    weights (not ones: a weight that went missing shows), and a batch of token ids."""
    transformers = models_extra("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        attn_implementation="eager",
    )
    generator = torch.manual_seed(LLAMA_SEED)
    model = transformers.LlamaModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=generator))
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=generator)
    return model, ids


def fuse_llama_layers(model: Any, backend: str | None, calls: list[int]) -> int:
    """Swap each decoder layer's ``post_attention_layernorm`` for an :class:`AddRMSNorm` holding
    its weight, and give the layer a forward where the attention's residual add and that norm
    are one call of it (each call appends the layer's index to ``calls``); returns how many
    layers were patched."""
    for index, layer in enumerate(model.layers):
        stock = layer.post_attention_layernorm
        fused = nt.AddRMSNorm(
            stock.weight.shape[0], stock.variance_epsilon, device="meta", backend=backend
        )
        fused.weight = stock.weight
        layer.post_attention_layernorm = fused
        layer.forward = types.MethodType(_fused_llama_layer(index, calls), layer)
    return len(model.layers)


def _fused_llama_layer(index: int, calls: list[int]) -> Callable[..., Any]:
    def forward(
        self: Any,
        hidden_states: Any,
        attention_mask: Any = None,
        position_ids: Any = None,
        cache: Any = None,
        use_cache: bool | None = False,
        position_embeddings: Any = None,
        **kwargs: Any,
    ) -> Any:
        calls.append(index)
        attended, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        normed, residual = self.post_attention_layernorm(attended, hidden_states)
        return residual + self.mlp(normed)

    return forward


def test_llama_pre_norm_fused(llama: tuple[Any, Any], backend: str | None) -> None:
    model, ids = llama
    patched = copy.deepcopy(model)
    calls: list[int] = []
    assert fuse_llama_layers(patched, backend, calls) == 3
    assert list(patched.state_dict()) == list(model.state_dict())
    _assert_as_close_as_torch(model, patched, lambda m: m(input_ids=ids))
    assert calls == [0, 1, 2]
