"""Loading DeepSeek-V2/V3 checkpoints: config.json + safetensors -> ``MLAForCausalLM``.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or
``model.safetensors.index.json`` with its shards. Both layouts that exist load:

* DeepSeek's release: one tensor per expert (``mlp.experts.{e}.gate_proj.weight``, ``up_proj``,
  ``down_proj``), RoPE rows as interleaved pairs, and for V3 float8_e4m3fn weights with
  ``weight_scale_inv`` [ceil(rows/128), ceil(cols/128)] float32 block scales (dequantized value =
  stored * scale of its 128 x 128 block; edge blocks may be partial: V3's ``kv_a_proj_with_mqa`` has
  576 rows) plus Multi-Token-Prediction layers past ``num_hidden_layers``;
* what transformers 5's ``save_pretrained`` writes: the same per-expert names (it reverts its fused
  experts on save), RoPE rows interleaved too; 3-D ``mlp.experts.gate_up_proj`` / ``down_proj`` are
  accepted as well;
* a multimodal wrapper's (Kimi K2.5, either layout): its text model's tensors under the wrapper's prefixes,
  the vision tower and projector skipped (``mla_ops.models.wrappers``).

Converted once at load, never per step: fp8 blocks dequantized in float32 then cast to the model
dtype; experts stacked into ``experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``; the R rope
rows of each head in ``q_proj`` / ``q_b_proj`` and of ``kv_a_proj_with_mqa`` permuted to halves when
``rope_interleave`` (``mla_ops.models.rope``), and likewise a DSA indexer's rope rows when
``indexer_rope_interleave`` (GLM-5; ``mla_ops.models.indexer``). DeepSeek-V3.2's release has fp8 ``wq_b`` /
``wk`` indexer weights with their block scales, dequantized as every other. MTP layers and ``rotary_emb.inv_freq`` buffers are skipped.
A.X-K1's releases have no ``e_score_correction_bias`` (``MLAConfig.optional_correction_bias``): zeros.

Everything is checked before any weight is allocated or read (names, shapes and dtypes against a model
built on the meta device, all else before it is built), each error one ValueError (TypeError for a value of
the wrong type) naming the key, argument, file or tensor: config.json (``MLAConfig.from_hf``), the
``dtype`` / ``device`` arguments, the files (``checkpoint_files``), the model's size (``check_model_size``:
a config.json whose model is far larger than its checkpoint; ``check_memory``: weights past the memory the
device has left), then the layers and tensors (``checkpoint_names``).
"""

from __future__ import annotations

import math
import os
import re
from collections import defaultdict

import torch

from .. import _checks
from .._env import available_memory
from ..parallel import tensor_parallel
from . import checkpoint_files
from .checkpoint_files import checkpoint_files as tensor_files, open_safetensors, read_json_object
from .checkpoint_names import LAYER, SCALE, Source, check_layers, map_tensors, quant_block
from .config import MLAConfig
from .hf_config import from_hf_dict
from .hyper_connections import HyperConnection, HyperHead
from .indexer import Indexer, convert_interleaved
from .rope import RotaryEmbedding
from .moe import MoEGate
from .rope import deinterleave_index
from .wrappers import unwrap


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                      offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """float8 weight [rows, cols] times the scale of its block -> float32 [rows, cols] (edge blocks partial).

    ``offset``: where ``weight`` starts in the whole weight (a tensor-parallel slice); ``scale_inv`` then
    holds the scale blocks that cover the slice, from the one holding its first element."""
    if weight.dim() != 2:
        raise ValueError(f"block-scaled float8 weights must be 2-D [rows, cols], got shape {list(weight.shape)}")
    rows, cols = weight.shape
    first = [offset[0] // block[0], offset[1] // block[1]]
    expect = [math.ceil((offset[0] + rows) / block[0]) - first[0], math.ceil((offset[1] + cols) / block[1]) - first[1]]
    if tuple(scale_inv.shape) != tuple(expect):
        raise ValueError(
            f"weight_scale_inv must be {expect} for a [{rows}, {cols}] weight in {block[0]}x{block[1]} blocks, "
            f"got {list(scale_inv.shape)}"
        )
    row_block = (torch.arange(rows) + offset[0]) // block[0] - first[0]
    col_block = (torch.arange(cols) + offset[1]) // block[1] - first[1]
    return weight.float() * scale_inv.float()[row_block][:, col_block]


# The attention's projections with RoPE rows; self_attn.{i}: one of LongCat-Flash's two attentions.
_QUERY = re.compile(r"\.self_attn(\.\d+)?\.(q_proj|q_b_proj)\.weight$")
_K_ROPE_NORM = re.compile(r"\.self_attn\.k_rope_only_layernorm\.weight$")
_QUERY_GATE = re.compile(r"\.self_attn\.q_gate_proj\.weight$")
_LATENT = re.compile(r"\.self_attn(\.\d+)?\.kv_a_proj_with_mqa\.weight$")


def _convert(config: MLAConfig, source: Source, tensor: torch.Tensor) -> torch.Tensor:
    """RoPE rows to halves (``tensor`` already dequantized; whole heads, all or a rank's; a NoPE layer has none)."""
    layer = LAYER.match(source.target)
    dims = config.attention_dims(int(layer.group(1))) if layer else config.attention_dims(0)
    P, R = dims.qk_nope_head_dim, dims.qk_rope_head_dim
    if config.rope_interleave and R:
        order = deinterleave_index(R)
        if _QUERY_GATE.search(source.target):  # A.X-K2's fused projection: per head P+R query rows, then V gate rows
            heads = tensor.view(-1, P + R + dims.v_head_dim, tensor.shape[-1])
            tensor = torch.cat([heads[:, :P], heads[:, P:P + R][:, order], heads[:, P + R:]], dim=1).reshape(
                tensor.shape)
        elif _QUERY.search(source.target):
            heads = tensor.view(-1, P + R, tensor.shape[-1])  # [N, P+R, in]
            tensor = torch.cat([heads[:, :P], heads[:, P:][:, order]], dim=1).reshape(tensor.shape)
        elif _LATENT.search(source.target):
            L = dims.kv_lora_rank
            tensor = torch.cat([tensor[:L], tensor[L:][order]])
        elif _K_ROPE_NORM.search(source.target):  # dots3_note's norm of k_pe, before RoPE: permuted with it
            tensor = tensor[order]
    return convert_interleaved(config, source.target, tensor)  # GLM-5's indexer rows


def load_pretrained(cls, path, dtype: torch.dtype | None = None, device=None, *, context_parallel=None):
    """``cls(config)`` (``MLAForCausalLM``) with the weights of checkpoint directory ``path``.

    dtype: None for config.json's (``torch_dtype`` / ``dtype``), else e.g. torch.float32; routers
    stay float32 as in transformers. device: None for the CPU. Every check (module docstring) is made
    before any weight is allocated or read: the arguments, config.json, the files and the layer count
    before the model is built, names, shapes and dtypes against a model on the meta device.
    context_parallel: ``cls(config, context_parallel=...)``, each rank reading only the slices it keeps
    (``safe_open(...).get_slice``; float8 weights dequantized per slice from the scale blocks covering
    it), so no rank ever holds the whole model.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a checkpoint directory (str or os.PathLike), got {type(path).__name__}")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"path must be a checkpoint directory (config.json + safetensors), got {path!r}")
    dtype = _checks.model_dtype(dtype, "dtype")
    device = torch.device("cpu") if device is None else _checks.check_device(device, "device")
    config_file = os.path.join(path, "config.json")
    raw = read_json_object(config_file)
    config = from_hf_dict(raw, config_file)
    try:
        block = quant_block(unwrap(raw)[0])  # a wrapper's text model's
    except (TypeError, ValueError) as e:
        raise type(e)(f"{config_file}: {e}") from e
    dtype = dtype or _checks.model_dtype(config.dtype) or torch.float32
    files = tensor_files(path)

    by_file = {file: checkpoint_files.headers(file) for file in sorted(set(files.values()))}  # file -> its header
    absent = [f"{name} ({os.path.basename(file)})" for name, file in sorted(files.items()) if name not in by_file[file]]
    if absent:
        raise ValueError(f"the index lists tensors its shards lack ({len(absent)}): {', '.join(absent[:8])}")
    headers = {name: by_file[file][name] for name, file in files.items()}
    check_layers(config, headers)

    whole = _meta_model(cls, config, dtype)  # the checkpoint's shapes, checked against the file headers
    check_model_size(whole, headers, config_file)
    sources = map_tensors(config, headers, dict(whole.state_dict(keep_vars=True)), block,
                          whole.model.layer_class.checkpoint_name)
    shard = None
    if context_parallel is not None:
        model = _meta_model(cls, config, dtype, context_parallel=context_parallel)  # checks N % D and the like
        shard = (context_parallel.rank, context_parallel.world_size)
    else:
        model = whole
    check_memory(model, device)

    model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives every module a tensor of its own: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    params = dict(model.state_dict(keep_vars=True))
    if config.optional_correction_bias:  # a checkpoint without the correction bias routes with zeros
        for name, tensor in params.items():
            if name.endswith("mlp.gate.e_score_correction_bias"):
                tensor.detach().zero_()
    by_source_file = defaultdict(list)
    for source in sources:
        by_source_file[files[source.name]].append(source)
    with torch.no_grad():
        for file, group in sorted(by_source_file.items()):
            with open_safetensors(file) as f:
                for source in group:
                    target = params[source.target]  # gate/up rows of a stacked expert: the I (or I / D) it holds
                    tensor = _convert(config, source, _read_shard(f, file, files, source, block, shard))
                    target[source.index(target.shape[1] // 2 if target.dim() == 3 else 0)].copy_(tensor)
    return model.eval()


# A model may hold at most this many times its checkpoint's elements (plus a little: A.X-K1's zero correction
# biases are not stored). Every weight is read from the checkpoint, so a model past it cannot load, and a
# config.json that asks for one (``n_routed_experts: 1e9`` beside a tiny checkpoint) is wrong.
MAX_MODEL_TO_CHECKPOINT = 2
SLACK_ELEMENTS = 2**20


def _tensors(model) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters and persistent buffers, each once (tied weights are one)."""
    seen, out = set(), []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append((name, tensor))
    return out


def check_model_size(model, headers: dict[str, tuple[list, str]], config_file: str) -> None:
    """``model`` (on the meta device: built from config.json, nothing allocated) against the checkpoint's
    tensors (their headers): a model of more than ``MAX_MODEL_TO_CHECKPOINT`` times the checkpoint's elements
    is refused, naming config.json and the model's largest tensor, before anything is allocated."""
    stored = sum(math.prod(shape) for shape, _ in headers.values())
    tensors = _tensors(model)
    wanted = sum(t.numel() for _, t in tensors)
    if wanted > MAX_MODEL_TO_CHECKPOINT * stored + SLACK_ELEMENTS:
        name, largest = max(tensors, key=lambda item: item[1].numel())
        raise ValueError(f"{config_file} describes a model of {wanted:,} parameters, but the checkpoint's tensors "
                         f"hold {stored:,} values: a size in config.json is wrong (the largest tensor, {name}, "
                         f"would be {list(largest.shape)})")


def check_memory(model, device: torch.device) -> None:
    """``model`` (meta; a rank's shard under context parallel) must fit the memory ``device`` has left."""
    wanted = sum(t.numel() * t.element_size() for _, t in _tensors(model))
    available = available_memory(device)
    if available is not None and wanted > available:
        raise ValueError(f"device: the model's weights take {wanted / 2**30:.3g} GiB, more than the "
                         f"{available / 2**30:.3g} GiB available on {device}")


def _meta_model(cls, config: MLAConfig, dtype: torch.dtype, **kwargs):
    with torch.device("meta"):
        model = cls(config, **kwargs)
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, (MoEGate, RotaryEmbedding)):  # routers and learned RoPE frequencies: float32
            module.float()
        elif dtype not in (torch.float16, torch.bfloat16):
            continue
        # as transformers keeps them (_keep_in_fp32_modules): the indexer's head weights, hyper-connections, sinks
        if isinstance(module, Indexer):
            module.weights_proj.float()
        elif isinstance(module, (HyperConnection, HyperHead)):
            module.float()
        elif getattr(module, "sinks", None) is not None:
            module.sinks.data = module.sinks.data.float()
    return model


def _read_shard(f, file: str, files: dict, source: Source, block: tuple[int, int], shard) -> torch.Tensor:
    """Tensor ``source.name``, dequantized if float8: whole, or (``shard`` = (rank, D)) only the slice the
    rank keeps (``tensor_parallel.shard_ranges``), read with ``get_slice``: a float8 slice with the scale
    blocks that cover it."""
    name = source.name
    sharded_as = name if source.part else source.target  # a per-expert tensor, or the model's name
    dim = None if shard is None else tensor_parallel.shard_dim(sharded_as)
    if dim is None:
        tensor = checkpoint_files.read_tensor(f, file, name)
        scale = _scale(f, file, files, name)
        return tensor if scale is None else dequantize_blocks(tensor, scale, block)
    scale_name = name + SCALE
    try:
        piece = f.get_slice(name)
        shape = piece.get_shape()
        parts = []
        for start, stop in tensor_parallel.shard_ranges(sharded_as, shape[dim], *shard):
            part = piece[tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(shape)))]
            if scale_name in files:  # float8, 2-D (checked in map_tensors)
                blocks = slice(start // block[dim], math.ceil(stop / block[dim]))
                scale = _scale_blocks(f, file, files, scale_name, (blocks, slice(None))[:: 1 if dim == 0 else -1])
                part = dequantize_blocks(part, scale, block, (start, 0) if dim == 0 else (0, start))
            parts.append(part)
    except Exception as e:  # SafetensorError, ...
        raise ValueError(f"cannot read tensor {name} from {file}: {e}") from e
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _scale_blocks(f, file: str, files: dict, scale_name: str, index: tuple) -> torch.Tensor:
    """``scale_name[index]``, from the open file ``f`` or its own shard."""
    if files[scale_name] == file:
        return f.get_slice(scale_name)[index]
    with open_safetensors(files[scale_name]) as g:
        return g.get_slice(scale_name)[index]


def _scale(f, file: str, files: dict, name: str) -> torch.Tensor | None:
    """The ``weight_scale_inv`` of ``name``, from the open file ``f`` or its own shard."""
    scale_name = name + SCALE
    if scale_name not in files:
        return None
    if files[scale_name] == file:
        return checkpoint_files.read_tensor(f, file, scale_name)
    with open_safetensors(files[scale_name]) as g:
        return checkpoint_files.read_tensor(g, files[scale_name], scale_name)
