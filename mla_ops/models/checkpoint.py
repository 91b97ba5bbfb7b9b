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
  accepted as well.

Converted once at load, never per step: fp8 blocks dequantized in float32 then cast to the model
dtype; experts stacked into ``experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``; the R rope
rows of each head in ``q_proj`` / ``q_b_proj`` and of ``kv_a_proj_with_mqa`` permuted to halves when
``rope_interleave`` (``mla_ops.models.rope``). MTP layers and ``rotary_emb.inv_freq`` buffers are skipped.
Every name and shape is checked from the file headers before any tensor is read: a missing,
unexpected or misshapen tensor raises a ValueError that names it.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import defaultdict
from dataclasses import dataclass

import torch

from .config import MLAConfig
from .moe import MoEGate
from .rope import deinterleave_index

FP8 = torch.float8_e4m3fn
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SCALE = "_scale_inv"


def checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file of a checkpoint directory."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise ValueError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """float8 weight [rows, cols] times the scale of its block -> float32 [rows, cols] (edge blocks partial)."""
    if weight.dim() != 2:
        raise ValueError(f"block-scaled float8 weights must be 2-D [rows, cols], got shape {list(weight.shape)}")
    rows, cols = weight.shape
    expect = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_inv.shape) != expect:
        raise ValueError(
            f"weight_scale_inv must be {list(expect)} for a [{rows}, {cols}] weight in {block[0]}x{block[1]} blocks, "
            f"got {list(scale_inv.shape)}"
        )
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


@dataclass(frozen=True)
class _Source:
    """One checkpoint tensor and where it goes: ``target``, or one expert's part of a stacked target."""

    name: str
    target: str
    expert: int | None = None
    part: str | None = None  # "gate_proj", "up_proj" or "down_proj" of that expert

    def index(self, inter: int):
        if self.expert is None:
            return ...
        rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter), "down_proj": slice(None)}[self.part]
        return self.expert, rows


def _source(name: str) -> _Source:
    expert = _EXPERT.match(name)
    if not expert:
        return _Source(name, name)
    prefix, e, part = expert.group(1), int(expert.group(2)), expert.group(3)
    target = f"{prefix}.down_proj" if part == "down_proj" else f"{prefix}.gate_up_proj"
    return _Source(name, target, e, part)


def _plan(config: MLAConfig, headers: dict[str, tuple[list, str]], params: dict) -> list[_Source]:
    """Map checkpoint names to model tensors, checking names, shapes and fp8 scales (headers only:
    name -> (shape, safetensors dtype))."""
    names = set(headers)
    shape_of = lambda name: headers[name][0]  # noqa: E731
    inter = config.moe_intermediate_size
    sources, unexpected, bad = [], [], []
    for name in sorted(names):
        layer = _LAYER.match(name)
        if (layer and int(layer.group(1)) >= config.num_hidden_layers) or name.endswith("rotary_emb.inv_freq"):
            continue  # Multi-Token-Prediction layers; non-persistent buffers of old checkpoints
        if name.endswith(_SCALE):
            if name[: -len(_SCALE)] not in names:
                unexpected.append(name)
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        source = _source(name)
        param = params.get(source.target)
        if param is None or (source.expert is not None and source.expert >= param.shape[0]):
            unexpected.append(name)
            continue
        expect = tuple(param[source.index(inter)].shape)
        if tuple(shape_of(name)) != expect:
            bad.append(f"{name}: the checkpoint has {list(shape_of(name))}, the model expects {list(expect)}")
            continue
        if headers[name][1] == "F8_E4M3" and name + _SCALE not in names:
            bad.append(f"{name}: float8_e4m3fn without its {name}{_SCALE}")
            continue
        if headers[name][1] != "F8_E4M3" and name + _SCALE in names:
            bad.append(f"{name}{_SCALE}: scales a {headers[name][1]} tensor (only float8_e4m3fn weights have scales)")
            continue
        sources.append(source)

    # Every model tensor must be filled: whole, or by every part of every expert.
    have = {(s.target, s.expert, s.part) for s in sources}
    missing = []
    for target, param in params.items():
        if (target == "lm_head.weight" and config.tie_word_embeddings) or (target, None, None) in have:
            continue
        if target.endswith(("experts.gate_up_proj", "experts.down_proj")):
            parts = ("down_proj",) if target.endswith("down_proj") else ("gate_proj", "up_proj")
            prefix = target.rsplit(".", 1)[0]
            missing += [f"{prefix}.{e}.{part}.weight" for e in range(param.shape[0]) for part in parts
                        if (target, e, part) not in have]
        else:
            missing.append(target)

    problems = []
    for title, items in (("missing tensors", missing), ("unexpected tensors", unexpected), ("wrong shapes", bad)):
        if items:
            shown = ", ".join(items[:8]) + (f", ... ({len(items) - 8} more)" if len(items) > 8 else "")
            problems.append(f"{title} ({len(items)}): {shown}")
    if problems:
        raise ValueError("checkpoint does not fit the model: " + "; ".join(problems))
    return sources


def _convert(config: MLAConfig, source: _Source, tensor: torch.Tensor, scale: torch.Tensor | None,
             block: tuple[int, int]) -> torch.Tensor:
    if scale is not None:  # a float8_e4m3fn weight (checked in _plan)
        tensor = dequantize_blocks(tensor, scale, block)
    if config.rope_interleave:
        P, R = config.qk_nope_head_dim, config.qk_rope_head_dim
        order = deinterleave_index(R)
        if source.target.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            heads = tensor.view(config.num_attention_heads, P + R, -1)  # [N, P+R, in]
            tensor = torch.cat([heads[:, :P], heads[:, P:][:, order]], dim=1).reshape(tensor.shape)
        elif source.target.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            L = config.kv_lora_rank
            tensor = torch.cat([tensor[:L], tensor[L:][order]])
    return tensor


def torch_dtype(name) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in config.json")
    return dtype


def load_pretrained(cls, path, dtype: torch.dtype | None = None, device=None):
    """``cls(config)`` (``MLAForCausalLM``) with the weights of checkpoint directory ``path``.

    dtype: None for config.json's (``torch_dtype`` / ``dtype``), else e.g. torch.float32; routers
    stay float32 as in transformers. device: None for the CPU.
    """
    from safetensors import safe_open

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"path must be a checkpoint directory (config.json + safetensors), got {path!r}")
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    config = MLAConfig.from_hf(raw)
    dtype = torch_dtype(dtype) or torch_dtype(config.dtype) or torch.float32
    block = tuple((raw.get("quantization_config") or {}).get("weight_block_size") or (128, 128))
    files = checkpoint_files(path)

    with torch.device("meta"):
        model = cls(config)
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, MoEGate):
            module.float()
    params = dict(model.state_dict(keep_vars=True))

    headers = {}
    for file in sorted(set(files.values())):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                headers[name] = (piece.get_shape(), piece.get_dtype())
    absent = sorted(set(files) - set(headers))
    if absent:
        raise ValueError(f"the index lists tensors its shards lack ({len(absent)}): {', '.join(absent[:8])}")
    sources = _plan(config, {name: headers[name] for name in files}, params)

    model.to_empty(device=device or "cpu")
    params = dict(model.state_dict(keep_vars=True))
    by_file = defaultdict(list)
    for source in sources:
        by_file[files[source.name]].append(source)
    inter = config.moe_intermediate_size
    with torch.no_grad():
        for file, group in sorted(by_file.items()):
            with safe_open(file, framework="pt") as f:
                for source in group:
                    tensor = _convert(config, source, f.get_tensor(source.name), _scale(f, file, files, source.name),
                                      block)
                    params[source.target][source.index(inter)].copy_(tensor)
    return model.eval()


def _scale(f, file: str, files: dict, name: str) -> torch.Tensor | None:
    """The ``weight_scale_inv`` of ``name``, from the open file ``f`` or its own shard."""
    scale_name = name + _SCALE
    if scale_name not in files:
        return None
    if files[scale_name] == file:
        return f.get_tensor(scale_name)
    from safetensors import safe_open

    with safe_open(files[scale_name], framework="pt") as g:
        return g.get_tensor(scale_name)
