"""Checkpoint tensor names -> model tensors, and the checks of a checkpoint against the model, from
the file headers alone (nothing is read or allocated):

* layers: ``num_hidden_layers`` must equal the number of decoder layers in the checkpoint (the layers
  past it must be Multi-Token-Prediction layers: ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head``);
* tensors: a missing, unexpected or misshapen tensor is named, a shape mismatch with the config keys
  that give the expected shape (``num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)``, ...)
  and a hint where a key disagrees with the tensors found (``q_lora_rank``, ``n_routed_experts``, ...);
  weights must be stored as float64, float32, float16 or bfloat16, or as float8_e4m3fn with a floating
  ``weight_scale_inv`` of the block-grid shape (integer, bool and other float8 tensors are refused,
  never cast); ``quantization_config.weight_block_size``: two integers >= 1.

Per-expert tensors (``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``) map to a part of
the stacked ``experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``; every other name maps to the
model tensor of the same name. A multimodal wrapper's text model (``config.wrapper``) is read under its
prefixes (``models.wrappers.text_names``), the wrapper's other tensors left out. The layer structure's
``checkpoint_name`` has the last word (LongCat-Flash renames its router and skips its identity experts' and
Multi-Token-Prediction tensors; DeepSeek's layer places A.X-K1's ``post_mlp_layernorm``). With
``optional_correction_bias`` (A.X-K1) a missing ``e_score_correction_bias`` is zeros, not an error.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

from .. import _checks
from .checkpoint_files import dtype_name
from .config import MLAConfig
from .wrappers import text_names

SCALE = "_scale_inv"  # the suffix of a float8 weight's block scales
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP = re.compile(r"^model\.layers\.\d+\.(enorm|hnorm|eh_proj|shared_head)\.")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# safetensors dtypes that load: weights are cast to the model dtype; F8_E4M3 needs its block scales.
_FLOATS = ("F64", "F32", "F16", "BF16")


def _scale_shape(shape, block) -> list[int]:
    return [math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])]


@dataclass(frozen=True)
class Source:
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


def _source(name: str, model_name: str) -> Source:
    """Checkpoint tensor ``name``, ``model_name`` by the decoder's names."""
    expert = _EXPERT.match(model_name)
    if not expert:
        return Source(name, model_name)
    prefix, e, part = expert.group(1), int(expert.group(2)), expert.group(3)
    target = f"{prefix}.down_proj" if part == "down_proj" else f"{prefix}.gate_up_proj"
    return Source(name, target, e, part)


_HEAD_QK = "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)"
# The config.json keys that give each model tensor's shape (by the end of its name).
_SHAPE_KEYS = {
    "self_attn.q_proj.weight": [_HEAD_QK, "hidden_size"],
    "self_attn.q_a_proj.weight": ["q_lora_rank", "hidden_size"],
    "self_attn.q_a_layernorm.weight": ["q_lora_rank"],
    "self_attn.q_b_proj.weight": [_HEAD_QK, "q_lora_rank"],
    "self_attn.q_gate_proj.weight": ["num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)",
                                     "2 * q_lora_rank"],
    "self_attn.gate_proj.weight": ["num_attention_heads * v_head_dim", "hidden_size"],
    "self_attn.kv_a_proj_with_mqa.weight": ["kv_lora_rank + qk_rope_head_dim", "hidden_size"],
    "self_attn.kv_a_layernorm.weight": ["kv_lora_rank"],
    "self_attn.kv_b_proj.weight": ["num_attention_heads * (qk_nope_head_dim + v_head_dim)", "kv_lora_rank"],
    "self_attn.o_proj.weight": ["hidden_size", "num_attention_heads * v_head_dim"],
    "self_attn.indexer.wq_b.weight": ["index_n_heads * index_head_dim", "q_lora_rank"],
    "self_attn.indexer.wk.weight": ["index_head_dim", "hidden_size"],
    "self_attn.indexer.k_norm.weight": ["index_head_dim"],
    "self_attn.indexer.k_norm.bias": ["index_head_dim"],
    "self_attn.indexer.weights_proj.weight": ["index_n_heads", "hidden_size"],
    "input_layernorm.weight": ["hidden_size"],
    "post_attention_layernorm.weight": ["hidden_size"],
    "post_mlp_layernorm.weight": ["hidden_size"],
    "mlp.gate_proj.weight": ["intermediate_size", "hidden_size"],
    "mlp.up_proj.weight": ["intermediate_size", "hidden_size"],
    "mlp.down_proj.weight": ["hidden_size", "intermediate_size"],
    "mlp.shared_experts.gate_proj.weight": ["moe_intermediate_size * n_shared_experts", "hidden_size"],
    "mlp.shared_experts.up_proj.weight": ["moe_intermediate_size * n_shared_experts", "hidden_size"],
    "mlp.shared_experts.down_proj.weight": ["hidden_size", "moe_intermediate_size * n_shared_experts"],
    "mlp.gate.weight": ["n_routed_experts", "hidden_size"],
    "mlp.gate.e_score_correction_bias": ["n_routed_experts"],
    "mlp.experts.gate_up_proj": ["n_routed_experts", "2 * moe_intermediate_size", "hidden_size"],
    "mlp.experts.down_proj": ["n_routed_experts", "hidden_size", "moe_intermediate_size"],
    "embed_tokens.weight": ["vocab_size", "hidden_size"],
    "lm_head.weight": ["vocab_size", "hidden_size"],
    "model.norm.weight": ["hidden_size"],
}
_EXPERT_KEYS = {"gate_proj": ["moe_intermediate_size", "hidden_size"],
                "up_proj": ["moe_intermediate_size", "hidden_size"],
                "down_proj": ["hidden_size", "moe_intermediate_size"]}


def _shape_keys(source: Source) -> str:
    if source.part is not None:
        keys = _EXPERT_KEYS[source.part]
    else:
        keys = next((v for k, v in _SHAPE_KEYS.items() if source.target.endswith(k)), None)
    return f" = [{', '.join(keys)}] of config.json" if keys else ""


def map_tensors(config: MLAConfig, headers: dict[str, tuple[list, str]], params: dict,
          block: tuple[int, int] = (128, 128),
          rename: Callable[[MLAConfig, str], str | None] | None = None) -> list[Source]:
    """Map checkpoint names to model tensors, checking names, shapes, dtypes and fp8 scales (headers only:
    name -> (shape, safetensors dtype)). ``rename(config, name)``: the model's name of a decoder tensor,
    None to skip it (the layer class's ``checkpoint_name``; None: the names are the model's)."""
    names = set(headers)
    model_names = text_names(config.wrapper, names)  # checkpoint name -> the decoder's
    shape_of = lambda name: headers[name][0]  # noqa: E731
    inter = config.moe_intermediate_size
    sources, unexpected, bad, bad_dtypes, found = [], [], [], [], set()
    for name in sorted(model_names):
        model_name = model_names[name]
        layer = LAYER.match(model_name)
        if (layer and int(layer.group(1)) >= config.num_hidden_layers) or name.endswith("rotary_emb.inv_freq"):
            continue  # Multi-Token-Prediction layers (checked in check_layers); buffers of old checkpoints
        if name.endswith(SCALE):
            if name[: -len(SCALE)] not in names:
                unexpected.append(name)
            continue
        if model_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if rename is not None:
            model_name = rename(config, model_name)
            if model_name is None:
                continue
        source = _source(name, model_name)
        param = params.get(source.target)
        if param is None or (source.expert is not None and source.expert >= param.shape[0]):
            unexpected.append(name)
            continue
        found.add((source.target, source.expert, source.part))  # present: never reported missing, only bad
        expect = tuple(param[source.index(inter)].shape)
        if tuple(shape_of(name)) != expect:
            bad.append(f"{name}: the checkpoint has {list(shape_of(name))}, the model expects {list(expect)}"
                       f"{_shape_keys(source)}")
            continue
        dtype = headers[name][1]
        if dtype not in _FLOATS + ("F8_E4M3",):
            bad_dtypes.append(f"{name}: stored as {dtype_name(dtype)}; weights must be float64, float32, float16 or "
                       f"bfloat16, or float8_e4m3fn with its {name}{SCALE} (never cast from another dtype)")
            continue
        if dtype == "F8_E4M3" and name + SCALE not in names:
            bad_dtypes.append(f"{name}: float8_e4m3fn without its {name}{SCALE}")
            continue
        if dtype != "F8_E4M3" and name + SCALE in names:
            bad_dtypes.append(f"{name}{SCALE}: scales a {dtype_name(dtype)} tensor (only float8_e4m3fn weights "
                              "have scales)")
            continue
        if dtype == "F8_E4M3":
            scale_shape, scale_dtype = headers[name + SCALE]
            if len(shape_of(name)) != 2:
                bad.append(f"{name}: a block-scaled float8_e4m3fn weight must be 2-D, got {list(shape_of(name))}")
                continue
            if scale_dtype not in _FLOATS:
                bad_dtypes.append(f"{name}{SCALE}: stored as {dtype_name(scale_dtype)}, block scales must be "
                                  "floating")
                continue
            if list(scale_shape) != _scale_shape(shape_of(name), block):
                bad.append(f"{name}{SCALE}: the checkpoint has {list(scale_shape)}, a {list(shape_of(name))} "
                           f"weight in {block[0]}x{block[1]} blocks (quantization_config.weight_block_size) needs "
                           f"{_scale_shape(shape_of(name), block)}")
                continue
        sources.append(source)

    # Every model tensor must be filled: whole, or by every part of every expert.
    missing = []
    for target, param in params.items():
        if (target == "lm_head.weight" and config.tie_word_embeddings) or (target, None, None) in found:
            continue
        if config.optional_correction_bias and target.endswith("mlp.gate.e_score_correction_bias"):
            continue  # zeros (checkpoint.load_pretrained), as transformers' A.X-K1 loads a release without one
        if target.endswith(("experts.gate_up_proj", "experts.down_proj")):
            parts = ("down_proj",) if target.endswith("down_proj") else ("gate_proj", "up_proj")
            prefix = target.rsplit(".", 1)[0]
            missing += [f"{prefix}.{e}.{part}.weight" for e in range(param.shape[0]) for part in parts
                        if (target, e, part) not in found]
        else:
            missing.append(target)

    problems = []
    for title, items in (("missing tensors", missing), ("unexpected tensors", unexpected), ("wrong shapes", bad),
                         ("wrong dtypes", bad_dtypes)):
        if items:
            shown = ", ".join(items[:8]) + (f", ... ({len(items) - 8} more)" if len(items) > 8 else "")
            problems.append(f"{title} ({len(items)}): {shown}")
    if problems:
        hints = _hints(config, [model_names[name] for name in unexpected])
        raise ValueError("checkpoint does not fit the model: " + "; ".join(problems)
                         + (f" (config.json: {'; '.join(hints)})" if hints else ""))
    return sources


def _hints(config: MLAConfig, unexpected: list[str]) -> list[str]:
    """Config keys that disagree with the tensors the checkpoint has."""
    hints = []
    if config.q_lora_rank is None and any(n.endswith("self_attn.q_a_proj.weight") for n in unexpected):
        hints.append("q_lora_rank is null (a plain q_proj) but the checkpoint has q_a_proj / q_b_proj")
    if config.q_lora_rank is not None and any(n.endswith("self_attn.q_proj.weight") for n in unexpected):
        hints.append(f"q_lora_rank={config.q_lora_rank} but the checkpoint has a plain q_proj (q_lora_rank null)")
    experts = [int(m.group(2)) for m in map(_EXPERT.match, unexpected) if m]
    if experts and config.n_routed_experts is not None and max(experts) >= config.n_routed_experts:
        hints.append(f"n_routed_experts={config.n_routed_experts} but the checkpoint has expert {max(experts)}")
    misplaced = []  # MoE tensors in a layer the config makes dense, or dense MLP tensors in a MoE layer
    for name in unexpected:
        layer = LAYER.match(name)
        if layer and ".mlp." in name:
            moe_tensor = any(part in name for part in (".mlp.experts.", ".mlp.gate.", ".mlp.shared_experts."))
            if moe_tensor != config.is_moe_layer(int(layer.group(1))):
                misplaced.append(int(layer.group(1)))
    if misplaced:
        layer = min(misplaced)
        types = config.layer_kinds.mlp_layer_types
        by = (f"mlp_layer_types[{layer}]={types[layer]!r}" if types is not None
              else f"n_routed_experts={config.n_routed_experts}, first_k_dense_replace={config.first_k_dense_replace}, "
                   f"moe_layer_freq={config.moe_layer_freq}")
        hints.append(f"layer {layer} is {'MoE' if config.is_moe_layer(layer) else 'dense'} by {by}, but the "
                     "checkpoint's is not")
    return hints


def check_layers(config: MLAConfig, names) -> None:
    """num_hidden_layers against the checkpoint's decoder layers; the layers past it must be MTP layers."""
    layers = defaultdict(list)
    for name in text_names(config.wrapper, names).values():
        m = LAYER.match(name)
        if m:
            layers[int(m.group(1))].append(name)
    mtp = {i for i, group in layers.items() if any(_MTP.match(n) for n in group)}
    decoder = sorted(set(layers) - mtp)
    n = config.num_hidden_layers
    extra = [i for i in decoder if i >= n]
    if extra:
        raise ValueError(f"num_hidden_layers={n} in config.json, but the checkpoint has decoder layer {extra[0]} "
                         f"(e.g. {sorted(layers[extra[0]])[0]}; {len(decoder)} decoder layers in all)")
    if len(decoder) < n:
        first = next(i for i in range(n) if i not in set(decoder))
        why = "holds Multi-Token-Prediction tensors" if first in mtp else "is absent"
        raise ValueError(f"num_hidden_layers={n} in config.json, but the checkpoint has {len(decoder)} decoder "
                         f"layers (model.layers.{first} {why})")


def quant_block(raw: dict) -> tuple[int, int]:
    """config.json's ``quantization_config.weight_block_size`` (default 128 x 128)."""
    q = raw.get("quantization_config")
    if q is None:
        return (128, 128)
    if not isinstance(q, dict):
        raise TypeError(f"quantization_config must be an object, got {q!r} ({type(q).__name__})")
    method = q.get("quant_method")
    if method is not None and method != "fp8":  # Kimi K2.5's int4 experts: compressed-tensors
        raise ValueError(f"quantization_config.quant_method is {method!r}: only 'fp8' (float8 block scales) loads")
    block = q.get("weight_block_size")
    if block is None:
        return (128, 128)
    key = "quantization_config.weight_block_size"
    if not isinstance(block, (list, tuple)) or len(block) != 2:
        raise ValueError(f"{key} must be [rows, cols], got {block!r}")
    return tuple(_checks.check_int(b, f"{key}[{i}]", 1) for i, b in enumerate(block))
