"""dots3_note's config.json (``dots3_note_text``, and the text model of the multimodal ``dots3_note``): how
transformers' Dots3NoteTextConfig reads it, as ``MLAConfig`` keyword arguments. Its readers only; the model parts
(the sliding layers' geometry, the latent scales, the norm of k_pe, the per-head gate) live in ``layer.py``.

Two forms exist. transformers writes ``layer_types`` ("indexed_attention" / "sliding_attention" per layer),
``per_layer_config`` (per sliding layer, the keys whose values differ from the top level's), ``rope_parameters``
per layer type and ``mlp_layer_types``. The release writes its own keys: ``use_dsa``, ``use_sliding_window``,
``sliding_window_size``, ``swa_*`` (the sliding layers' sizes, defaults 64 heads, q/kv LoRA 1024, P 192, V 128,
head_dim 256), ``swa_rope_theta`` (50,000) beside ``rope_theta`` (80,000,000), ``first_k_dense_replace`` and
``moe_layer_freq``, ``moe_shared_expert_intermediate_size``. Both are read as Dots3NoteTextConfig.__post_init__
reads them: without ``layer_types``, layers 0, 1 and i % 4 == 1 are DSA layers, the others sliding.
"""

from __future__ import annotations

from .. import _checks

# Dots3NoteTextConfig's defaults that differ from hf_config's (the release form may leave them out).
DEFAULTS = {"vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 13824, "moe_intermediate_size": 1536,
            "num_hidden_layers": 46, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
            "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 8,
            "norm_topk_prob": True, "max_position_embeddings": 524288, "rms_norm_eps": 1e-5, "index_topk": 2048,
            "index_head_dim": 128, "index_n_heads": 64, "head_dim": 256}
# The release's sliding-layer keys (swa_<name>) and Dots3NoteTextConfig's defaults for them.
_SWA_DEFAULTS = {"num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1024, "kv_lora_rank": 1024,
                 "head_dim": 256, "qk_nope_head_dim": 192, "v_head_dim": 128}
# per_layer_config keys a sliding layer may set: its geometry (num_key_value_heads must equal its heads).
_GEOMETRY = ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
             "v_head_dim")
_LAYER_TYPES = {"indexed_attention": "full", "full_attention": "full", "sliding_attention": "sliding"}


def _layer_types(c: dict, layers: int) -> list[str]:
    """Dots3NoteTextConfig's ``layer_types`` (transformers' names)."""
    use_dsa = c.get("use_dsa", None if "per_layer_config" in c else True)
    use_sliding = c.get("use_sliding_window", True)
    types = c.get("layer_types")
    if types is None:
        full = "full_attention" if use_dsa is False else "indexed_attention"
        types = [full if not use_sliding or i < 2 or i % 4 == 1 else "sliding_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers:
        raise ValueError(f"layer_types must list num_hidden_layers={layers} layer types, got {types!r}")
    for i, kind in enumerate(types):
        _checks.check_str(kind, f"layer_types[{i}]", tuple(_LAYER_TYPES))
    if use_dsa is not None:
        old, new = ("full_attention", "indexed_attention") if use_dsa else ("indexed_attention", "full_attention")
        types = [new if kind == old else kind for kind in types]
    if "indexed_attention" in types and "full_attention" in types:
        raise ValueError("layer_types mixes 'indexed_attention' and 'full_attention': a dots3_note model's full "
                         "layers are all DSA layers or none")
    return types


def _sliding_geometry(c: dict, types: list[str]) -> dict:
    """The sliding layers' geometry: ``per_layer_config`` (one entry per sliding layer, all alike; none for the
    others) over the top level's values, or the release's ``swa_*`` keys."""
    per_layer = c.get("per_layer_config")
    if per_layer is None:  # the release form
        swa = {name: c.get(f"swa_{name}", default) for name, default in _SWA_DEFAULTS.items()}
        swa["qk_rope_head_dim"] = c.get("swa_qk_rope_head_dim", swa["head_dim"] - swa["qk_nope_head_dim"])
        entries = {i: swa for i, kind in enumerate(types) if kind == "sliding_attention"}
    else:
        _checks.check_object(per_layer, "per_layer_config")
        entries = {}
        for key, value in per_layer.items():
            i = int(key) if isinstance(key, int) or (isinstance(key, str) and key.isdigit()) else None
            if i is None or not 0 <= i < len(types):
                raise ValueError(f"per_layer_config's keys must be layer indices below {len(types)}, got {key!r}")
            entries[i] = _checks.check_object(value, f"per_layer_config[{key}]")
    sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    for i, entry in entries.items():
        if i not in sliding and entry:
            raise ValueError(f"per_layer_config[{i}] changes layer {i}, a {types[i]} layer: only the sliding layers "
                             "have a geometry of their own")
        unknown = sorted(set(entry) - set(_GEOMETRY) - {"num_key_value_heads", "head_dim"})
        if unknown:
            raise ValueError(f"per_layer_config[{i}] sets {unknown}: a sliding layer's entry holds its geometry "
                             f"({', '.join(_GEOMETRY)}, num_key_value_heads, head_dim)")
    first = entries.get(sliding[0], {}) if sliding else {}
    for i in sliding:
        if entries.get(i, {}) != first:
            raise ValueError(f"per_layer_config[{i}] differs from per_layer_config[{sliding[0]}]: every sliding "
                             "layer has one geometry")
    geometry = {name: first.get(name, c.get(name)) for name in _GEOMETRY}
    heads, kv_heads = geometry["num_attention_heads"], first.get("num_key_value_heads", geometry["num_attention_heads"])
    if kv_heads != heads:
        raise ValueError(f"per_layer_config: num_key_value_heads ({kv_heads}) must equal num_attention_heads "
                         f"({heads}) in a sliding layer (MLA)")
    head_dim = first.get("head_dim", c.get("head_dim"))
    if head_dim is not None and head_dim != geometry["qk_nope_head_dim"] + geometry["qk_rope_head_dim"]:
        raise ValueError(f"the sliding layers' head_dim ({head_dim}) must equal qk_nope_head_dim + qk_rope_head_dim "
                         f"({geometry['qk_nope_head_dim']} + {geometry['qk_rope_head_dim']})")
    return geometry


def _rope_thetas(c: dict, types: list[str]) -> tuple[float, float]:
    """(the full layers' rope_theta, the sliding layers'): ``rope_parameters`` per layer type (or one for all), or
    the release's ``rope_theta`` / ``swa_rope_theta``. Only plain RoPE ("default") is read."""
    rope = c.get("rope_parameters") or c.get("rope_scaling")
    full = next((kind for kind in types if kind != "sliding_attention"), "indexed_attention")
    if rope is None:
        return c.get("rope_theta", 80_000_000.0), c.get("swa_rope_theta", 50_000.0)
    _checks.check_object(rope, "rope_parameters")
    nested = set(rope) <= set(_LAYER_TYPES) and bool(rope)
    thetas = []
    for kind in (full, "sliding_attention"):
        params = _checks.check_object(rope.get(kind) or {}, f"rope_parameters.{kind}") if nested else rope
        kind_type = params.get("rope_type", params.get("type", "default"))
        if kind_type != "default":
            raise ValueError(f"rope_parameters.{kind}.rope_type must be 'default' (plain RoPE: dots3_note's), got "
                             f"{kind_type!r}")
        thetas.append(params.get("rope_theta", c.get("rope_theta", 80_000_000.0) if kind == full
                                 else c.get("swa_rope_theta", 50_000.0)))
    return thetas[0], thetas[1]


def _mlp_layer_types(c: dict, layers: int) -> list[str]:
    """Dots3NoteTextConfig's ``mlp_layer_types``: given, or sparse from ``first_k_dense_replace`` (default 1) on,
    every ``moe_layer_freq``-th layer (an int, or a list of one flag per layer)."""
    if c.get("mlp_layer_types") is not None:
        return c["mlp_layer_types"]
    first, freq = c.get("first_k_dense_replace", 1), c.get("moe_layer_freq", 1)
    return ["sparse" if i >= first and (bool(freq[i]) if isinstance(freq, (list, tuple)) else i % freq == 0)
            else "dense" for i in range(layers)]


def prepare(c: dict) -> dict:
    """config.json -> what hf_config reads: the release's keys renamed, the layer kinds and the sliding layers'
    geometry gathered under ``_dots3_note`` (read by ``config_kwargs``), the full layers' RoPE flattened."""
    if "q_lora_rank" in c and c["q_lora_rank"] is None:
        raise ValueError("config.json sets q_lora_rank=null: a dots3_note model's attention always has a q_lora_rank "
                         "(Dots3NoteTextConfig refuses it too)")
    c = {**DEFAULTS, **{k: v for k, v in c.items() if v is not None}}
    layers = _checks.check_int(c["num_hidden_layers"], "num_hidden_layers", 1)
    types = _layer_types(c, layers)
    full_theta, sliding_theta = _rope_thetas(c, types)
    shared = c.get("shared_experts_intermediate_size", c.get("moe_shared_expert_intermediate_size", 1536))
    out = {k: v for k, v in c.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta", "moe_layer_freq",
                                                   "first_k_dense_replace", "layer_types")}
    out.update(rope_parameters={"rope_type": "default", "rope_theta": full_theta},
               mlp_layer_types=_mlp_layer_types(c, layers), first_k_dense_replace=0,
               _dots3_note=dict(types=types, sliding_theta=sliding_theta, shared=shared,
                                window=c.get("sliding_window") or c.get("sliding_window_size", 512),
                                geometry=_sliding_geometry(c, types) if "sliding_attention" in types else None))
    return out


def config_kwargs(c: dict) -> dict:
    """The ``MLAConfig`` values only dots3_note has (``c``: ``prepare``'s): its layer kinds, the sliding layers'
    window, geometry and theta, the indexer of its DSA layers, the shared experts' size and its norms' eps (the
    q/kv LoRA norms and the norm of k_pe take ``rms_norm_eps``)."""
    d = c["_dots3_note"]
    out = dict(attention_types=[_LAYER_TYPES[kind] for kind in d["types"]], shared_expert_intermediate_size=d["shared"],
               lora_norm_eps=c["rms_norm_eps"])
    if d["geometry"] is not None:
        out["sliding_attention"] = dict(d["geometry"], sliding_window=d["window"], rope_theta=d["sliding_theta"])
    else:
        out["attention_types"] = None
    if "indexed_attention" in d["types"]:
        if c.get("index_topk") is None:
            raise ValueError("config.json sets index_topk=null: a dots3_note model's DSA layers select index_topk keys")
        out.update(index_topk=c["index_topk"], index_n_heads=c.get("index_n_heads"),
                   index_head_dim=c.get("index_head_dim"), indexer_rope_interleave=True)
    return out
