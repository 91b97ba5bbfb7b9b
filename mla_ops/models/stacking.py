"""Stacked layers (``MLAModel.stack_layers``): each run of consecutive decoder layers of one structure keeps its
weights in one tensor per weight name, ``[layers, *shape]``, and its layers' parameters and buffers are views of
it. Eagerly nothing changes (each layer computes on its views); under a whole-model ``torch.compile``
``mla_ops.models.regions`` runs each run as one ``scan`` over the stacked weights and caches, traced once however
many layers the run has.

A run's layers must be alike in all but their tensors' values (``signature``: their module types, every other
attribute, and their tensors' shapes, dtypes and devices), and stand alone: one latent cache of their own at
consecutive cache layers, nothing taken from the layers before them (a shared top-k, another layer's rows) and
nothing handed on, no indexer, no tensor parallel all-reduce, no module hooks, no tensor shared with another layer.
The stacks follow the model: ``.to()`` (every ``_apply``) and ``load_state_dict`` restack them; a parameter or
buffer set anew on a stacked layer (not a view then) unstacks the model until ``stack_layers()`` is called again.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import NamedTuple

import torch
from torch import nn


class LayerRun(NamedTuple):
    """One run of stacked layers: layers ``start`` .. ``start + count - 1`` attend cache layers ``cache`` ..
    ``cache + count - 1``; ``weights[j]`` is tensor ``names[j]`` of every layer, stacked."""

    start: int
    count: int
    cache: int
    names: tuple[str, ...]
    weights: tuple[torch.Tensor, ...]


# The attributes every module has (its tensors and children are compared apart, its hooks refused).
_MODULE_STATE = frozenset(vars(nn.Module()))


def signature(layer: nn.Module) -> tuple:
    """What a layer's trace depends on besides its tensors' values: each submodule's type and other attributes
    (by ``repr``), and each tensor's name, shape, dtype and device. Two layers of one signature run one trace."""
    parts = tuple((name, type(module), tuple(sorted((k, repr(v)) for k, v in vars(module).items()
                                                    if k not in _MODULE_STATE)))
                  for name, module in layer.named_modules())
    return parts, tuple((n, t.shape, t.dtype, t.device) for n, t in _tensors(layer))


def _tensors(layer: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*layer.named_parameters(remove_duplicate=False), *layer.named_buffers(remove_duplicate=False)]


def refusal(model: nn.Module, i: int, uses: Counter) -> str | None:
    """Why layer ``i`` cannot be stacked (None: it can); ``uses``: how often each tensor (by id) is one of the
    layers'."""
    wiring = model.wiring[i]
    if wiring.index is not None or wiring.reuses_topk:
        return "it has an indexer or reuses another layer's top-k (a sparse model's layers are not stacked yet)"
    if wiring.source is not None or wiring.keeps_rows or len(wiring.latent) != 1:
        return "it shares latent rows with another layer (KV sharing) or has two attentions"
    if any(t.is_meta for _, t in _tensors(model.layers[i])):
        return "its weights are on the meta device"
    modules = list(model.layers[i].modules())
    if any(getattr(m, "tp_group", None) is not None for m in modules):
        return "it is tensor parallel (its all-reduces are not scanned yet)"
    if any(isinstance(v, dict) and v for m in modules for k, v in vars(m).items() if "hook" in k):
        return "it has module hooks (a scan would run the first layer's for every layer)"
    if any(uses[id(t)] > 1 for _, t in _tensors(model.layers[i])):
        return "it shares a tensor with another layer or within itself (tied weights)"
    return None


def spans(model: nn.Module) -> list[tuple[int, int]]:
    """``(start, count)`` of each run: the longest stretches of stackable layers of one signature at consecutive
    cache layers. Refuses, by layer, a model with a layer that cannot be stacked."""
    runs: list[tuple[int, int]] = []
    previous = None
    uses = Counter(id(t) for layer in model.layers for _, t in _tensors(layer))
    for i, layer in enumerate(model.layers):
        why = refusal(model, i, uses)
        if why is not None:
            raise ValueError(f"stack_layers: layer {i} cannot be stacked: {why}")
        key = signature(layer)
        if runs and key == previous and model.wiring[i].latent[0] == model.wiring[i - 1].latent[0] + 1:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
        previous = key
    return runs


def stack(model: nn.Module) -> tuple[LayerRun, ...]:
    """Each run's tensors stacked, one tensor per name, and its layers' parameters and buffers made views of the
    stacks (the same ``Parameter`` objects: optimizers and hooks that hold them keep working). Every layer is
    checked before any is stacked."""
    runs = []
    for start, count in spans(model):
        layers = list(model.layers[start:start + count])
        names = tuple(n for n, _ in _tensors(layers[0]))
        per_layer = [dict(_tensors(layer)) for layer in layers]
        weights = []
        for name in names:
            stacked = torch.stack([tensors[name].detach() for tensors in per_layer])
            for layer, view in zip(layers, stacked.unbind()):
                _point(layer, name, view)
            weights.append(stacked)
        runs.append(LayerRun(start, count, model.wiring[start].latent[0], names, tuple(weights)))
        for layer in layers:
            for module in layer.modules():
                _STACKED[module] = weakref.ref(model)
    _watch_registrations()
    return tuple(runs)


def restack(model: nn.Module) -> tuple[LayerRun, ...] | None:
    """``stack``, where the model's layers can be stacked now (None where not: on the meta device, say)."""
    try:
        return stack(model)
    except ValueError:
        return None


def _point(layer: nn.Module, name: str, view: torch.Tensor) -> None:
    """Tensor ``name`` of ``layer`` made ``view``: a parameter keeps its object (``.data``), a buffer is replaced."""
    path, _, leaf = name.rpartition(".")
    module = layer.get_submodule(path)
    if leaf in module._parameters:
        module._parameters[leaf].data = view
    else:
        module._buffers[leaf] = view


# Every module of a stacked layer -> its model: a tensor registered on one anew unstacks the model.
_STACKED: weakref.WeakKeyDictionary[nn.Module, weakref.ref] = weakref.WeakKeyDictionary()
_WATCHING = False


def _watch_registrations() -> None:
    global _WATCHING
    if not _WATCHING:
        torch.nn.modules.module.register_module_parameter_registration_hook(_registered)
        torch.nn.modules.module.register_module_buffer_registration_hook(_registered)
        _WATCHING = True


def _registered(module: nn.Module, name: str, tensor) -> None:
    """A layer's tensor set anew is no view of its stack: the model is unstacked until ``stack_layers()`` again
    (``load_state_dict(assign=True)`` does it itself)."""
    owner = _STACKED.get(module)
    model = owner() if owner is not None else None
    if model is not None:
        model.layer_runs = None
