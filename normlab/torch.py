"""PyTorch integration: normlab's kernels as torch modules, inside autograd, ``torch.compile`` and
``torch.export``.

* :class:`LayerNorm` and :class:`RMSNorm`: drop-in subclasses of ``torch.nn.LayerNorm`` and
  ``torch.nn.RMSNorm`` (same constructor, parameters and ``state_dict`` keys) that compute with
  :func:`normlab.layer_norm` / :func:`normlab.rms_norm`, plus ``backend=``;
  :func:`replace_layer_norms` swaps them into a model, keeping its parameters;
  :func:`replace_norms` also swaps the RMSNorm classes of HF transformers models
  (:data:`MODEL_NORMS`: Llama, Mistral, Qwen2/3, Phi-3, OLMo-2, Gemma 1–3, T5), each for an
  :class:`RMSNorm` of the same arithmetic order (``casting``, ``weight_offset``).
* :class:`AddLayerNorm` and :class:`AddRMSNorm`: the same constructors and ``state_dict``, with
  ``forward(x, residual) -> (y, h)`` computed by :func:`normlab.add_layer_norm` /
  :func:`normlab.add_rms_norm` (``h = x + residual``, ``y`` its norm): a pre-norm block's
  residual add and norm in one call.
* Importing this module also registers the custom ops ``normlab::layer_norm``,
  ``normlab::rms_norm`` and their ``*_backward`` (:mod:`normlab.torch_ops`), through which the
  core runs a backend that records no autograd graph (numba on CPU tensors, cupy on CUDA
  tensors) for tensors that require grad and inside a torch trace: its results stay in the
  graph, and ``torch.compile`` and ``torch.export`` see one opaque op.

Importing this module imports torch; ``import normlab`` does not import it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Final

import torch

import normlab
from normlab import (
    registry,
    torch_ops,  # noqa: F401  (registers the custom ops with torch)
)
from normlab.scalars import finite_float
from normlab.spec.casting import CASTINGS

__all__ = [
    "MODEL_NORMS",
    "AddLayerNorm",
    "AddRMSNorm",
    "LayerNorm",
    "ModelNorm",
    "RMSNorm",
    "replace_layer_norms",
    "replace_norms",
]

Tensor = torch.Tensor


# --------------------------------------------------------------------------------------------
# Modules


# The modules call normlab through these functions, which torch.compile keeps as single
# nodes (allow_in_graph): dynamo does not trace normlab's validation and dispatch, and
# AOTAutograd runs them on fake tensors, which reach the custom ops above (or torch's own
# ops). The route is fixed when a graph is compiled. ``eps`` and ``weight_offset`` may arrive
# as symbolic floats.
# Dynamo matches these functions by identity: they are registered when a module is built.


def _layer_norm_node(
    x: Tensor,
    normalized_shape: tuple[int, ...],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    backend: str | None,
    weight_offset: float = 0.0,
) -> Tensor:
    y: Tensor = normlab.layer_norm(
        x, normalized_shape, weight, bias, float(eps), backend=backend,
        weight_offset=float(weight_offset),
    )  # fmt: skip
    return y


def _rms_norm_node(
    x: Tensor,
    normalized_shape: tuple[int, ...],
    weight: Tensor | None,
    eps: float | None,
    backend: str | None,
    weight_offset: float = 0.0,
    casting: str = "exact",
) -> Tensor:
    eps_value = None if eps is None else float(eps)
    y: Tensor = normlab.rms_norm(
        x, normalized_shape, weight, eps_value, backend=backend,
        weight_offset=float(weight_offset), casting=casting,
    )  # fmt: skip
    return y


def _add_layer_norm_node(
    x: Tensor,
    residual: Tensor,
    normalized_shape: tuple[int, ...],
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    backend: str | None,
    weight_offset: float = 0.0,
) -> tuple[Tensor, Tensor]:
    y, h = normlab.add_layer_norm(
        x, residual, normalized_shape, weight, bias, float(eps), backend=backend,
        weight_offset=float(weight_offset),
    )  # fmt: skip
    return y, h


def _add_rms_norm_node(
    x: Tensor,
    residual: Tensor,
    normalized_shape: tuple[int, ...],
    weight: Tensor | None,
    eps: float | None,
    backend: str | None,
    weight_offset: float = 0.0,
    casting: str = "exact",
) -> tuple[Tensor, Tensor]:
    eps_value = None if eps is None else float(eps)
    y, h = normlab.add_rms_norm(
        x, residual, normalized_shape, weight, eps_value, backend=backend,
        weight_offset=float(weight_offset), casting=casting,
    )  # fmt: skip
    return y, h


def _jit_tracing() -> bool:
    """Whether ``torch.jit.trace`` is recording: it records torch's own ops, and would record a
    kernel outside torch as a constant."""
    return torch._C._get_tracing_state() is not None


@functools.cache
def _allow_nodes_in_graph() -> None:
    """Register the nodes with dynamo: on the first module built, not at import (it imports
    torch._dynamo, seconds that the backends' hooks into this module should not pay)."""
    for node in (_layer_norm_node, _rms_norm_node, _add_layer_norm_node, _add_rms_norm_node):
        torch.compiler.allow_in_graph(node)  # type: ignore[no-untyped-call]


def _configure(module: Any, backend: str | None, weight_offset: Any) -> None:
    """The normlab options of a module built by torch's constructor: its eps checked as the
    functions check it, the backend (checked by name) and the weight offset (a finite number,
    which needs a weight; the weight is initialized again for it)."""
    if module.eps is not None:
        finite_float("eps", module.eps, "finite and >= 0", at_least=0.0)
    if backend is not None:
        registry.get(backend)
    offset = finite_float("weight_offset", weight_offset, "finite")
    if offset and module.weight is None:
        raise normlab.ArgumentError(
            f"weight_offset={weight_offset!r} needs a weight: elementwise_affine=False has none"
        )
    module.backend = backend
    module.weight_offset = offset
    _offset_initialization(module)
    _allow_nodes_in_graph()


def _offset_initialization(module: Any) -> None:
    """A weight used as ``weight_offset + weight`` starts at ``1 - weight_offset`` (torch's
    constructor calls ``reset_parameters`` before the offset is set: it is 0 then)."""
    offset = getattr(module, "weight_offset", 0.0)
    if offset and module.weight is not None:
        with torch.no_grad():
            module.weight.fill_(1.0 - offset)


def _extra_repr(module: Any, torch_repr: str) -> str:
    offset = f", weight_offset={module.weight_offset!r}" if module.weight_offset else ""
    casting = getattr(module, "casting", "exact")
    order = f", casting={casting!r}" if casting != "exact" else ""
    return f"{torch_repr}, backend={module.backend!r}{offset}{order}"


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` computed by :func:`normlab.layer_norm`.

    The constructor, parameters and ``state_dict`` keys are those of ``torch.nn.LayerNorm``;
    ``backend`` (keyword only) names the normlab backend, strictly as ``backend=`` does, or
    None to let normlab choose (``normlab.use_backend`` applies). ``weight_offset`` (keyword
    only): the weight is used as ``weight_offset + weight`` (:func:`normlab.layer_norm`), and is
    initialized to ``1 - weight_offset`` (zeros for 1, as Gemma's and Transformer Engine's
    zero-centered weights), so that a new module scales by 1.
    """

    backend: str | None
    weight_offset: float

    def __init__(
        self,
        normalized_shape: Any,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        backend: str | None = None,
        weight_offset: float = 0.0,
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        _configure(self, backend, weight_offset)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        _offset_initialization(self)

    def forward(self, input: Tensor) -> Tensor:
        if _jit_tracing():  # torch.jit.trace records torch's ops: its own module's
            if not self.weight_offset:
                return super().forward(input)
            weight = self.weight + self.weight_offset  # torch's own arithmetic, as the module's
            return torch.nn.functional.layer_norm(
                input, self.normalized_shape, weight, self.bias, self.eps
            )
        return _layer_norm_node(
            input, self.normalized_shape, self.weight, self.bias, self.eps, self.backend,
            self.weight_offset,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return _extra_repr(self, super().extra_repr())


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by :func:`normlab.rms_norm` (``eps=None``: the machine
    epsilon of the compute dtype, float32's for half input, as torch); constructor,
    parameters and ``state_dict`` as ``torch.nn.RMSNorm``, plus ``backend`` and
    ``weight_offset`` as for :class:`LayerNorm` (``weight_offset=1.0``: Gemma's RMSNorm), and
    ``casting`` as for :func:`normlab.rms_norm` (``"llama"``: HF Llama's order, ``"t5"``)."""

    backend: str | None
    weight_offset: float
    casting: str

    def __init__(
        self,
        normalized_shape: Any,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: Any = None,
        dtype: Any = None,
        *,
        backend: str | None = None,
        weight_offset: float = 0.0,
        casting: str = "exact",
    ) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        _configure(self, backend, weight_offset)
        if casting not in CASTINGS:
            raise normlab.ArgumentError(
                f"casting must be one of {', '.join(CASTINGS)}; got {casting!r}"
            )
        self.casting = casting

    def reset_parameters(self) -> None:
        super().reset_parameters()
        _offset_initialization(self)

    def forward(self, x: Tensor) -> Tensor:
        if _jit_tracing() and self.casting == "exact":  # torch.jit.trace records torch's ops
            if not self.weight_offset:
                return super().forward(x)
            weight = self.weight + self.weight_offset  # torch's own arithmetic, as the module's
            return torch.nn.functional.rms_norm(x, self.normalized_shape, weight, self.eps)
        return _rms_norm_node(
            x, self.normalized_shape, self.weight, self.eps, self.backend, self.weight_offset,
            self.casting,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return _extra_repr(self, super().extra_repr())


class AddLayerNorm(LayerNorm):
    """A residual add and ``torch.nn.LayerNorm`` in one call of :func:`normlab.add_layer_norm`:
    ``forward(x, residual)`` returns ``(y, h)``, ``h = x + residual`` (rounded to x's dtype as
    the add) and ``y = layer_norm(h)``, both in the graph.

    Constructor, parameters and ``state_dict`` keys as ``torch.nn.LayerNorm`` (its checkpoints
    load), plus ``backend`` as for :class:`LayerNorm`.
    """

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        if _jit_tracing():  # the add, then torch's own module (see LayerNorm)
            h = x + residual
            return super().forward(h), h
        return _add_layer_norm_node(
            x, residual, self.normalized_shape, self.weight, self.bias, self.eps, self.backend,
            self.weight_offset,
        )  # fmt: skip


class AddRMSNorm(RMSNorm):
    """A residual add and ``torch.nn.RMSNorm`` in one call of :func:`normlab.add_rms_norm`:
    ``forward(x, residual)`` returns ``(y, h)`` as :class:`AddLayerNorm` does (``eps=None``:
    the machine epsilon of the compute dtype). Constructor, parameters and ``state_dict`` as
    ``torch.nn.RMSNorm``, plus ``backend``."""

    def forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        if _jit_tracing():  # the add, then torch's own module (see LayerNorm)
            h = x + residual
            return super().forward(h), h
        return _add_rms_norm_node(
            x, residual, self.normalized_shape, self.weight, self.eps, self.backend,
            self.weight_offset, self.casting,
        )  # fmt: skip


def replace_layer_norms(model: torch.nn.Module, backend: str | None = None) -> torch.nn.Module:
    """Swap every ``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm`` in ``model`` for normlab's.

    The new modules hold the very same parameter objects (an optimizer built before still
    updates them) and the same training mode. Only modules of exactly those classes are
    swapped: a subclass may override ``forward`` and is left alone. Returns ``model`` (or its
    replacement, when ``model`` itself is one of them).
    """
    return _replaced(model, backend, _swap)


def _replaced(
    model: torch.nn.Module,
    backend: str | None,
    swap: Callable[[torch.nn.Module, str | None], torch.nn.Module],
) -> torch.nn.Module:
    """``model`` with every module (itself included) replaced by ``swap``'s answer for it, each
    new module with the replaced one's hooks (:func:`_with_hooks`)."""
    if backend is not None:
        registry.get(backend)
    names = {id(m): name for name, m in model.named_modules()}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            swapped = swap(child, backend)
            if swapped is not child:
                setattr(parent, name, _with_hooks(swapped, child, f"module {names[id(child)]!r}"))
    swapped = swap(model, backend)
    return model if swapped is model else _with_hooks(swapped, model, "the model")


#: The attributes of ``torch.nn.Module`` that hold its hooks (forward, backward, state_dict):
#: a new module takes the replaced module's very dictionaries, so that the handles the hooks'
#: registration returned still remove them.
_HOOKS: Final = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_is_full_backward_hook",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def _with_hooks(new: torch.nn.Module, old: torch.nn.Module, name: str) -> torch.nn.Module:
    """``new`` with ``old``'s hooks (:data:`_HOOKS`). A forward set on ``old`` itself (as
    accelerate's ``add_hook_to_module`` does) cannot move to a module of another class: an
    ArgumentError naming the module (``name``: where it is) and what replaced its forward."""
    if "forward" in vars(old):
        hook = getattr(old, "_hf_hook", None)
        by = f" by {type(hook).__qualname__} (accelerate)" if hook is not None else ""
        raise normlab.ArgumentError(
            f"{name} ({type(old).__qualname__}) has its forward replaced on the instance{by}; "
            "normlab cannot move that to its own module: replace the norms before adding such "
            "hooks (before accelerate's dispatch_model or cpu_offload, for example)"
        )
    for attribute in _HOOKS:
        if hasattr(old, attribute):
            setattr(new, attribute, getattr(old, attribute))
    return new


def _swap(module: torch.nn.Module, backend: str | None) -> torch.nn.Module:
    new: torch.nn.Module
    if type(module) is torch.nn.LayerNorm:
        new = LayerNorm(
            module.normalized_shape, module.eps, module.elementwise_affine,
            bias=module.bias is not None, device="meta", backend=backend,
        )  # fmt: skip
        new.weight, new.bias = module.weight, module.bias
    elif type(module) is torch.nn.RMSNorm:
        new = RMSNorm(
            module.normalized_shape,
            module.eps,
            module.elementwise_affine,
            device="meta",
            backend=backend,
        )
        new.weight = module.weight
    else:
        return module
    return new.train(module.training)


@dataclasses.dataclass(frozen=True)
class ModelNorm:
    """How normlab computes a model library's norm class: an :class:`RMSNorm` with this
    ``casting`` and ``weight_offset``, its eps read from the attribute ``eps_attribute`` of the
    replaced module (HF names it ``variance_epsilon`` or ``eps``)."""

    casting: str = "exact"
    weight_offset: float = 0.0
    eps_attribute: str = "variance_epsilon"


_LLAMA: Final = ModelNorm(casting="llama")
_GEMMA: Final = ModelNorm(weight_offset=1.0, eps_attribute="eps")
#: The norm classes of HF transformers models that :func:`replace_norms` swaps, by class name
#: (those of ``transformers.models.*`` only); add an entry for another class of the same form
#: (a ``weight`` of the hidden size, an eps attribute). Each entry's order is the class's own
#: ``forward``, as written in transformers 5.
MODEL_NORMS: Final[dict[str, ModelNorm]] = {
    "LlamaRMSNorm": _LLAMA,  # weight * x̂.to(x.dtype)
    "MistralRMSNorm": _LLAMA,
    "Qwen2RMSNorm": _LLAMA,
    "Qwen3RMSNorm": _LLAMA,
    "Phi3RMSNorm": _LLAMA,
    "Olmo2RMSNorm": ModelNorm(),  # (weight * x̂).to(x.dtype): one rounding
    "GemmaRMSNorm": _GEMMA,  # (x̂ * (1 + weight.float())).to(x.dtype)
    "Gemma2RMSNorm": _GEMMA,
    "Gemma3RMSNorm": _GEMMA,
    "T5LayerNorm": ModelNorm(casting="t5"),  # x̂ to a half weight's dtype, then weight * x̂
}


def replace_norms(model: torch.nn.Module, backend: str | None = None) -> torch.nn.Module:
    """Swap every norm of ``model`` that normlab computes: ``torch.nn.LayerNorm`` and
    ``torch.nn.RMSNorm`` (as :func:`replace_layer_norms`) and the HF transformers classes of
    :data:`MODEL_NORMS`, each for an :class:`RMSNorm` of the class's own order.

    The new modules hold the very same parameter objects, under the same ``state_dict`` keys,
    and the same training mode; their results are the replaced modules' up to the order of the
    mean square's sum (a few elements of a half y may differ by one unit). Returns ``model`` (or
    its replacement, when ``model`` itself is one of them).
    """
    return _replaced(model, backend, _swap_any)


def _swap_any(module: torch.nn.Module, backend: str | None) -> torch.nn.Module:
    kind = type(module)
    norm = MODEL_NORMS.get(kind.__name__)
    if norm is None or not kind.__module__.startswith("transformers.models."):
        return _swap(module, backend)
    weight: torch.nn.Parameter = module.weight  # type: ignore[assignment]
    new = RMSNorm(
        tuple(weight.shape),
        float(getattr(module, norm.eps_attribute)),
        device="meta",
        backend=backend,
        weight_offset=norm.weight_offset,
        casting=norm.casting,
    )
    new.weight = weight
    return new.train(module.training)
