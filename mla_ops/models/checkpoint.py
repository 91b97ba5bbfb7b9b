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

Everything is checked before any weight is allocated or read (names, shapes and dtypes against a model
built on the meta device, all else before it is built), each error one ValueError (TypeError for a value of
the wrong type) naming the key, argument, file or tensor:

* config.json: missing, not JSON or not an object (naming the file); every value it holds that is used
  (``MLAConfig``: type and range, the key named; ``quantization_config.weight_block_size``: two
  integers >= 1); ``dtype`` / ``device`` arguments;
* files: ``model.safetensors.index.json`` must be a JSON object with a ``weight_map`` object of tensor name
  -> shard file name (strings); every shard, named by the index or found, must lie inside the
  checkpoint directory (no absolute path, no ``..``, no symlink resolving outside it; the one exception
  is the Hugging Face hub cache, whose ``snapshots/<rev>/`` files link to the same repository's
  ``blobs/``) and be a readable safetensors file (a truncated, empty or foreign file names its path);
* layers: ``num_hidden_layers`` must equal the number of decoder layers in the checkpoint (the layers
  past it must be Multi-Token-Prediction layers: ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head``);
* tensors (from the file headers): a missing, unexpected or misshapen tensor is named, a shape
  mismatch with the config keys that give the expected shape (``num_attention_heads * (qk_nope_head_dim
  + qk_rope_head_dim)``, ...) and a hint where a key disagrees with the tensors found (``q_lora_rank``,
  ``n_routed_experts``, ...); weights must be stored as float64, float32, float16 or bfloat16, or as
  float8_e4m3fn with a floating ``weight_scale_inv`` of the block-grid shape (integer, bool and other
  float8 tensors are refused, never cast).
"""

from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..parallel import tensor_parallel
from .config import MLAConfig, check_int, model_dtype, read_json_object
from .moe import MoEGate
from .rope import deinterleave_index

FP8 = torch.float8_e4m3fn
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_MTP = re.compile(r"^model\.layers\.\d+\.(enorm|hnorm|eh_proj|shared_head)\.")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SCALE = "_scale_inv"
# safetensors dtypes that load: weights are cast to the model dtype; F8_E4M3 needs its block scales.
_FLOATS = ("F64", "F32", "F16", "BF16")
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64", "I32": "int32",
                       "I16": "int16", "I8": "int8", "U8": "uint8", "U16": "uint16", "U32": "uint32",
                       "U64": "uint64", "BOOL": "bool"}


def _dtype_name(dtype: str) -> str:
    return _SAFETENSORS_DTYPES.get(dtype, dtype)


@contextmanager
def _open(file: str):
    """``safe_open(file)``: any failure to open it (missing, empty, truncated, not safetensors) is a
    ValueError naming the file."""
    from safetensors import safe_open

    try:
        f = safe_open(file, framework="pt")
    except Exception as e:  # SafetensorError, OSError, ...
        raise ValueError(f"cannot open {file} as safetensors: {e}") from e
    with f:
        yield f


def _read(f, file: str, name: str) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except Exception as e:
        raise ValueError(f"cannot read tensor {name} from {file}: {e}") from e


def _headers(file: str) -> dict[str, tuple[list, str]]:
    """Tensor name -> (shape, safetensors dtype) of one file, from its header."""
    with _open(file) as f:
        try:
            out = {}
            for name in f.keys():
                piece = f.get_slice(name)
                out[name] = (list(piece.get_shape()), piece.get_dtype())
            return out
        except Exception as e:
            raise ValueError(f"cannot read the header of {file}: {e}") from e


def _shard(path: str, name: str, index: str | None) -> str:
    """The file ``name`` of checkpoint directory ``path``, refused unless it lies inside it."""
    where = f"{index} names shard {name!r}" if index else f"{name!r}"
    parts = re.split(r"[\\/]", name)
    if os.path.isabs(name) or ".." in parts or not name or name in (".",):
        raise ValueError(f"{where}: shard files must lie inside the checkpoint directory {path} "
                         "(a file name relative to it, without '..')")
    full = os.path.join(path, name)
    root, real = os.path.realpath(path), os.path.realpath(full)
    if os.path.commonpath([root, real]) != root and not _in_hub_blobs(root, real):
        raise ValueError(f"{where}: {full} resolves to {real}, outside the checkpoint directory {root}")
    if not os.path.isfile(full):
        raise ValueError(f"{where}: {full} " + ("is not a file" if os.path.exists(full) else "does not exist"))
    return full


def _in_hub_blobs(root: str, real: str) -> bool:
    """The Hugging Face hub cache: ``<repo>/snapshots/<rev>/<file>`` links to ``<repo>/blobs/<hash>``."""
    snapshots = os.path.dirname(root)
    if os.path.basename(snapshots) != "snapshots":
        return False
    blobs = os.path.join(os.path.dirname(snapshots), "blobs")
    return os.path.dirname(real) == blobs


def checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file of a checkpoint directory (the index checked, every shard inside
    the directory; tensor names of a single file from its header)."""
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        raw = read_json_object(index, "the index")
        weight_map = raw.get("weight_map")
        if weight_map is None:
            raise ValueError(f"the index {index} has no 'weight_map' (tensor name -> shard file)")
        if not isinstance(weight_map, dict):
            raise ValueError(f"the index {index}: 'weight_map' must be an object of tensor name -> shard file, "
                             f"got {type(weight_map).__name__}")
        for name, file in weight_map.items():
            if not isinstance(file, str):
                raise ValueError(f"the index {index}: weight_map[{name!r}] must be a shard file name (a string), "
                                 f"got {file!r}")
        shards = {file: _shard(path, file, index) for file in sorted(set(weight_map.values()))}
        return {name: shards[file] for name, file in weight_map.items()}
    single = os.path.join(path, SINGLE)
    if not os.path.lexists(single):
        raise ValueError(f"{path} has neither {SINGLE} nor {INDEX}")
    single = _shard(path, SINGLE, None)
    return {name: single for name in _headers(single)}


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


def _scale_shape(shape, block) -> list[int]:
    return [math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])]


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


_HEAD_QK = "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)"
# The config.json keys that give each model tensor's shape (by the end of its name).
_SHAPE_KEYS = {
    "self_attn.q_proj.weight": [_HEAD_QK, "hidden_size"],
    "self_attn.q_a_proj.weight": ["q_lora_rank", "hidden_size"],
    "self_attn.q_a_layernorm.weight": ["q_lora_rank"],
    "self_attn.q_b_proj.weight": [_HEAD_QK, "q_lora_rank"],
    "self_attn.kv_a_proj_with_mqa.weight": ["kv_lora_rank + qk_rope_head_dim", "hidden_size"],
    "self_attn.kv_a_layernorm.weight": ["kv_lora_rank"],
    "self_attn.kv_b_proj.weight": ["num_attention_heads * (qk_nope_head_dim + v_head_dim)", "kv_lora_rank"],
    "self_attn.o_proj.weight": ["hidden_size", "num_attention_heads * v_head_dim"],
    "input_layernorm.weight": ["hidden_size"],
    "post_attention_layernorm.weight": ["hidden_size"],
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


def _shape_keys(source: _Source) -> str:
    if source.part is not None:
        keys = _EXPERT_KEYS[source.part]
    else:
        keys = next((v for k, v in _SHAPE_KEYS.items() if source.target.endswith(k)), None)
    return f" = [{', '.join(keys)}] of config.json" if keys else ""


def _plan(config: MLAConfig, headers: dict[str, tuple[list, str]], params: dict,
          block: tuple[int, int] = (128, 128)) -> list[_Source]:
    """Map checkpoint names to model tensors, checking names, shapes, dtypes and fp8 scales (headers only:
    name -> (shape, safetensors dtype))."""
    names = set(headers)
    shape_of = lambda name: headers[name][0]  # noqa: E731
    inter = config.moe_intermediate_size
    sources, unexpected, bad, bad_dtypes, found = [], [], [], [], set()
    for name in sorted(names):
        layer = _LAYER.match(name)
        if (layer and int(layer.group(1)) >= config.num_hidden_layers) or name.endswith("rotary_emb.inv_freq"):
            continue  # Multi-Token-Prediction layers (checked in _check_layers); buffers of old checkpoints
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
        found.add((source.target, source.expert, source.part))  # present: never reported missing, only bad
        expect = tuple(param[source.index(inter)].shape)
        if tuple(shape_of(name)) != expect:
            bad.append(f"{name}: the checkpoint has {list(shape_of(name))}, the model expects {list(expect)}"
                       f"{_shape_keys(source)}")
            continue
        dtype = headers[name][1]
        if dtype not in _FLOATS + ("F8_E4M3",):
            bad_dtypes.append(f"{name}: stored as {_dtype_name(dtype)}; weights must be float64, float32, float16 or "
                       f"bfloat16, or float8_e4m3fn with its {name}{_SCALE} (never cast from another dtype)")
            continue
        if dtype == "F8_E4M3" and name + _SCALE not in names:
            bad_dtypes.append(f"{name}: float8_e4m3fn without its {name}{_SCALE}")
            continue
        if dtype != "F8_E4M3" and name + _SCALE in names:
            bad_dtypes.append(f"{name}{_SCALE}: scales a {_dtype_name(dtype)} tensor (only float8_e4m3fn weights "
                              "have scales)")
            continue
        if dtype == "F8_E4M3":
            scale_shape, scale_dtype = headers[name + _SCALE]
            if len(shape_of(name)) != 2:
                bad.append(f"{name}: a block-scaled float8_e4m3fn weight must be 2-D, got {list(shape_of(name))}")
                continue
            if scale_dtype not in _FLOATS:
                bad_dtypes.append(f"{name}{_SCALE}: stored as {_dtype_name(scale_dtype)}, block scales must be "
                                  "floating")
                continue
            if list(scale_shape) != _scale_shape(shape_of(name), block):
                bad.append(f"{name}{_SCALE}: the checkpoint has {list(scale_shape)}, a {list(shape_of(name))} "
                           f"weight in {block[0]}x{block[1]} blocks (quantization_config.weight_block_size) needs "
                           f"{_scale_shape(shape_of(name), block)}")
                continue
        sources.append(source)

    # Every model tensor must be filled: whole, or by every part of every expert.
    missing = []
    for target, param in params.items():
        if (target == "lm_head.weight" and config.tie_word_embeddings) or (target, None, None) in found:
            continue
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
        hints = _hints(config, unexpected)
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
        layer = _LAYER.match(name)
        if layer and ".mlp." in name:
            moe_tensor = any(part in name for part in (".mlp.experts.", ".mlp.gate.", ".mlp.shared_experts."))
            if moe_tensor != config.is_moe_layer(int(layer.group(1))):
                misplaced.append(int(layer.group(1)))
    if misplaced:
        layer = min(misplaced)
        hints.append(f"layer {layer} is {'MoE' if config.is_moe_layer(layer) else 'dense'} by n_routed_experts="
                     f"{config.n_routed_experts}, first_k_dense_replace={config.first_k_dense_replace}, "
                     f"moe_layer_freq={config.moe_layer_freq}, but the checkpoint's is not")
    return hints


def _check_layers(config: MLAConfig, names) -> None:
    """num_hidden_layers against the checkpoint's decoder layers; the layers past it must be MTP layers."""
    layers = defaultdict(list)
    for name in names:
        m = _LAYER.match(name)
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


def _block_size(raw: dict) -> tuple[int, int]:
    """config.json's ``quantization_config.weight_block_size`` (default 128 x 128)."""
    q = raw.get("quantization_config")
    if q is None:
        return (128, 128)
    if not isinstance(q, dict):
        raise TypeError(f"quantization_config must be an object, got {q!r} ({type(q).__name__})")
    block = q.get("weight_block_size")
    if block is None:
        return (128, 128)
    key = "quantization_config.weight_block_size"
    if not isinstance(block, (list, tuple)) or len(block) != 2:
        raise ValueError(f"{key} must be [rows, cols], got {block!r}")
    return tuple(check_int(f"{key}[{i}]", b) for i, b in enumerate(block))


def _convert(config: MLAConfig, source: _Source, tensor: torch.Tensor) -> torch.Tensor:
    """RoPE rows to halves (``tensor`` already dequantized; whole heads, all or a rank's)."""
    if config.rope_interleave:
        P, R = config.qk_nope_head_dim, config.qk_rope_head_dim
        order = deinterleave_index(R)
        if source.target.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            heads = tensor.view(-1, P + R, tensor.shape[-1])  # [N, P+R, in]
            tensor = torch.cat([heads[:, :P], heads[:, P:][:, order]], dim=1).reshape(tensor.shape)
        elif source.target.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            L = config.kv_lora_rank
            tensor = torch.cat([tensor[:L], tensor[L:][order]])
    return tensor


def torch_dtype(name, key: str = "dtype") -> torch.dtype | None:
    """A model dtype or its name (float16, bfloat16, float32, float64) as a torch.dtype; None stays None.
    Anything else is a ValueError (TypeError for a non-string) naming ``key``."""
    return model_dtype(name, key)


def _device(device) -> torch.device:
    if device is None:
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
        torch.empty(0, device=resolved)  # allocates nothing; fails here for a device this machine lacks
    except (RuntimeError, TypeError, AssertionError, ValueError) as e:
        raise ValueError(f"device {str(device)!r} is not usable here: {e}") from e
    return resolved


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
    dtype = torch_dtype(dtype, "dtype")
    device = _device(device)
    config_file = os.path.join(path, "config.json")
    raw = read_json_object(config_file)
    config = MLAConfig._from_hf_dict(raw, config_file)
    try:
        block = _block_size(raw)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{config_file}: {e}") from e
    dtype = dtype or torch_dtype(config.dtype) or torch.float32
    files = checkpoint_files(path)

    by_file = {file: _headers(file) for file in sorted(set(files.values()))}  # file -> its header
    absent = [f"{name} ({os.path.basename(file)})" for name, file in sorted(files.items()) if name not in by_file[file]]
    if absent:
        raise ValueError(f"the index lists tensors its shards lack ({len(absent)}): {', '.join(absent[:8])}")
    headers = {name: by_file[file][name] for name, file in files.items()}
    _check_layers(config, headers)

    whole = _meta_model(cls, config, dtype)  # the checkpoint's shapes, checked against the file headers
    sources = _plan(config, headers, dict(whole.state_dict(keep_vars=True)), block)
    shard = None
    if context_parallel is not None:
        model = _meta_model(cls, config, dtype, context_parallel=context_parallel)  # checks N % D and the like
        shard = (context_parallel.rank, context_parallel.world_size)
    else:
        model = whole

    model.to_empty(device=device)
    params = dict(model.state_dict(keep_vars=True))
    by_source_file = defaultdict(list)
    for source in sources:
        by_source_file[files[source.name]].append(source)
    with torch.no_grad():
        for file, group in sorted(by_source_file.items()):
            with _open(file) as f:
                for source in group:
                    target = params[source.target]  # gate/up rows of a stacked expert: the I (or I / D) it holds
                    tensor = _convert(config, source, _read_shard(f, file, files, source, block, shard))
                    target[source.index(target.shape[1] // 2 if target.dim() == 3 else 0)].copy_(tensor)
    return model.eval()


def _meta_model(cls, config: MLAConfig, dtype: torch.dtype, **kwargs):
    with torch.device("meta"):
        model = cls(config, **kwargs)
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, MoEGate):
            module.float()
    return model


def _read_shard(f, file: str, files: dict, source: _Source, block: tuple[int, int], shard) -> torch.Tensor:
    """Tensor ``source.name``, dequantized if float8: whole, or (``shard`` = (rank, D)) only the slice the
    rank keeps (``tensor_parallel.shard_ranges``), read with ``get_slice``: a float8 slice with the scale
    blocks that cover it."""
    name = source.name
    sharded_as = name if source.part else source.target  # a per-expert tensor, or the model's name
    dim = None if shard is None else tensor_parallel.shard_dim(sharded_as)
    if dim is None:
        tensor = _read(f, file, name)
        scale = _scale(f, file, files, name)
        return tensor if scale is None else dequantize_blocks(tensor, scale, block)
    scale_name = name + _SCALE
    try:
        piece = f.get_slice(name)
        shape = piece.get_shape()
        parts = []
        for start, stop in tensor_parallel.shard_ranges(sharded_as, shape[dim], *shard):
            part = piece[tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(shape)))]
            if scale_name in files:  # float8, 2-D (checked in _plan)
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
    with _open(files[scale_name]) as g:
        return g.get_slice(scale_name)[index]


def _scale(f, file: str, files: dict, name: str) -> torch.Tensor | None:
    """The ``weight_scale_inv`` of ``name``, from the open file ``f`` or its own shard."""
    scale_name = name + _SCALE
    if scale_name not in files:
        return None
    if files[scale_name] == file:
        return _read(f, file, scale_name)
    with _open(files[scale_name]) as g:
        return _read(g, files[scale_name], scale_name)
