"""normlab.torch.replace_norms on HF transformers models built from small configs: every norm
is swapped (torch's and the model library's own classes), the parameters and state_dict stay,
and the model computes what it did, in float32 and bfloat16."""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the 'models' extra")

import normlab.torch as nt  # noqa: E402  (after the skips: it imports torch)

SMALL: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def _decoder(config_name: str, model_name: str, **extra: Any) -> Any:
    config = getattr(transformers, config_name)(**SMALL, **extra)
    return getattr(transformers, model_name)(config)


def _models() -> dict[str, Any]:
    return {
        "llama": lambda: _decoder("LlamaConfig", "LlamaForCausalLM"),
        "mistral": lambda: _decoder("MistralConfig", "MistralForCausalLM"),
        "qwen2": lambda: _decoder("Qwen2Config", "Qwen2ForCausalLM"),
        "gemma": lambda: _decoder("GemmaConfig", "GemmaForCausalLM"),
        "gemma2": lambda: _decoder("Gemma2Config", "Gemma2ForCausalLM"),
        "t5": lambda: transformers.T5ForConditionalGeneration(
            transformers.T5Config(
                vocab_size=96, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4
            )
        ),
        "gpt2": lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4)
        ),
        "bert": lambda: transformers.BertModel(
            transformers.BertConfig(
                vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=128,
            )
        ),
    }  # fmt: skip


def _norms(model: Any) -> list[str]:
    names = set(nt.MODEL_NORMS) | {"LayerNorm", "RMSNorm"}
    return [
        name
        for name, m in model.named_modules()
        if type(m).__name__ in names and not type(m).__module__.startswith("normlab")
    ]


def _output(model: Any, ids: Any) -> Any:
    if isinstance(model, transformers.T5ForConditionalGeneration):
        return model(input_ids=ids, decoder_input_ids=ids).logits
    out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


#: The largest logit difference allowed, relative to the largest logit: measured on these
#: models (float32 5.5e-7 at most, bfloat16 0: the same bits), with room for other machines.
BOUNDS: dict[str, float] = {"float32": 1e-5, "bfloat16": 2e-2}


def _pair(name: str, dtype: str) -> tuple[Any, Any]:
    """The model with weights moved away from their initial values (Gemma's zeros), and a
    copy of it swapped by replace_norms (checked: every norm, the same parameters and keys)."""
    torch.manual_seed(0)
    stock = _models()[name]().eval().to(getattr(torch, dtype))
    with torch.no_grad():
        for p in stock.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ours = copy.deepcopy(stock)
    keys = ours.state_dict().keys()
    before = {id(p) for p in ours.parameters()}
    assert _norms(ours), "the model has no norm to swap"
    assert nt.replace_norms(ours) is ours
    assert _norms(ours) == [], f"left unswapped: {_norms(ours)}"
    assert ours.state_dict().keys() == keys and {id(p) for p in ours.parameters()} == before
    return stock, ours


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(_models()))
def test_replace_norms(name: str, dtype: str) -> None:
    """Forward: the logits within :data:`BOUNDS`; backward: every parameter's gradient of a
    fixed loss as close (float32)."""
    stock, ours = _pair(name, dtype)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(3))
    got, want = _output(ours, ids), _output(stock, ids)
    scale = want.detach().float().abs().max()
    assert (got.detach().float() - want.detach().float()).abs().max() <= BOUNDS[dtype] * scale
    if dtype != "float32":
        return
    weights = torch.linspace(-1, 1, want.numel()).reshape(want.shape)
    grads = [
        torch.autograd.grad((out * weights).sum(), list(model.parameters()), allow_unused=True)
        for out, model in ((got, ours), (want, stock))
    ]
    for g_ours, g_stock in zip(*grads, strict=True):
        if g_stock is None:
            assert g_ours is None
            continue
        assert (g_ours - g_stock).abs().max() <= 1e-4 * g_stock.abs().max().clamp_min(1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", [n for n in _models() if n != "bert"])
def test_generate(name: str, dtype: str) -> None:
    """Greedy generation: the same tokens in float32; in bfloat16 the same wherever the
    original's top-2 margin exceeds twice the logit bound (elsewhere a tie may go either way)."""
    stock, ours = _pair(name, dtype)
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(4))
    kwargs: dict[str, Any] = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    if name == "t5":
        kwargs["decoder_start_token_id"] = 0
    with torch.no_grad():
        tokens = stock.generate(ids, **kwargs)
        if dtype == "float32":
            assert torch.equal(ours.generate(ids, **kwargs), tokens)
            return
        # bfloat16: each step's prediction, teacher-forced on the original's tokens
        inputs = {"input_ids": tokens}
        if name == "t5":  # T5's generate returns the decoder's tokens
            inputs = {"input_ids": ids, "decoder_input_ids": tokens}
        want, got = stock(**inputs).logits, ours(**inputs).logits
    top2 = want.float().topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    clear = margin > 2 * BOUNDS[dtype] * want.float().abs().max()
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_only_the_model_librarys_classes() -> None:
    """A class of another module that happens to share a name is left alone."""

    class LlamaRMSNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))
            self.variance_epsilon = 1e-6

    module = LlamaRMSNorm()
    assert nt.replace_norms(module) is module


def test_replace_layer_norms_keeps_its_behaviour() -> None:
    """The older call swaps torch's classes only."""
    model = _models()["llama"]()
    nt.replace_layer_norms(model)
    assert any(type(m).__name__ == "LlamaRMSNorm" for m in model.modules())


_CLASSES = {
    "LlamaRMSNorm": "llama",
    "MistralRMSNorm": "mistral",
    "Qwen2RMSNorm": "qwen2",
    "Qwen3RMSNorm": "qwen3",
    "Phi3RMSNorm": "phi3",
    "Olmo2RMSNorm": "olmo2",
    "GemmaRMSNorm": "gemma",
    "Gemma2RMSNorm": "gemma2",
    "Gemma3RMSNorm": "gemma3",
    "T5LayerNorm": "t5",
}


@pytest.mark.parametrize(("x_dtype", "weight_dtype"), [
    ("bfloat16", "bfloat16"), ("float16", "float16"), ("bfloat16", "float32"),
    ("float32", "bfloat16"), ("float32", "float32"),
])  # fmt: skip
@pytest.mark.parametrize("name", sorted(_CLASSES))
def test_each_class_of_the_table(name: str, x_dtype: str, weight_dtype: str) -> None:
    """Each class swapped alone: y of the class's own dtype, and of its values up to one unit
    of y's dtype, in a few elements of a half y (the mean square's order)."""
    assert set(_CLASSES) == set(nt.MODEL_NORMS)
    library = __import__(
        f"transformers.models.{_CLASSES[name]}.modeling_{_CLASSES[name]}", fromlist=[name]
    )
    stock = getattr(library, name)(256).to(getattr(torch, weight_dtype))
    with torch.no_grad():
        stock.weight.copy_(torch.randn(256, generator=torch.Generator().manual_seed(1)))
    ours = nt.replace_norms(copy.deepcopy(stock))
    assert isinstance(ours, nt.RMSNorm)
    x = (3 * torch.randn(64, 256, generator=torch.Generator().manual_seed(2))).to(
        getattr(torch, x_dtype)
    )
    with torch.no_grad():
        got, want = ours(x), stock(x)
    assert got.dtype == want.dtype
    unit = torch.finfo(want.dtype).eps  # a unit in the last place, relative
    diff = (got.double() - want.double()).abs()
    assert (diff <= 2 * unit * want.double().abs() + 1e-6).all()
    if want.dtype != torch.float32:
        assert (got != want).double().mean() < 0.02


#: Models a training set-up checkpoints, each norm's class among them (BERT's LayerNorm, Gemma
#: 3's offset RMSNorm, OLMo-2's RMSNorm in its own order, Llama's), with a loss of their own.
_TRAINED: dict[str, Any] = {
    "bert": lambda: transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128,
        )
    ),
    "gemma3": lambda: _decoder("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "olmo2": lambda: _decoder("Olmo2Config", "Olmo2ForCausalLM"),
    "llama": lambda: _decoder("LlamaConfig", "LlamaForCausalLM"),
}  # fmt: skip


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("name", sorted(_TRAINED))
def test_gradient_checkpointing(name: str, reentrant: bool) -> None:
    """``model.activation_checkpointing_enable()`` (``gradient_checkpointing_enable`` before
    transformers 5) after replace_norms: transformers checkpoints each layer, non-reentrant by
    default, and a layer's last op may be a norm. The loss's gradients are bitwise those of the
    same model without checkpointing."""
    torch.manual_seed(0)
    model = nt.replace_norms(_TRAINED[name]().train())
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(5))

    def gradients() -> list[Any]:
        model.zero_grad()
        with torch.random.fork_rng():
            model(input_ids=ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    want = gradients()
    model.activation_checkpointing_enable({"use_reentrant": reentrant})
    got = gradients()
    assert len(got) == len(want)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
