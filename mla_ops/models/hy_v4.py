"""HY-V4's config readers and checkpoint names (model types ``hy_v4``, ``hy_v4_vl_text``, and the multimodal
``hy_v4_vl`` around the latter; their records in ``families.FAMILIES``).

The model is GLM-5's sparse layers (DESIGN §12) with: a per-head, per-dim sigmoid output gate from the attention's
input (``output_gate="hidden"``), a learned attention sink per head (``attention_sinks``), hyper-connections
(``decoder_layer="hyper"``, ``mla_ops.models.hyper_connections``), routed experts whose SwiGLU is clamped
(``swiglu_limit``), an indexer whose RoPE rotates the last R dims of each head (``indexer_rope_last``) with
``k_norm`` at ``rms_norm_eps``; its "full" indexers on layer 0 and where (l - 1) % 4 == 0, "shared" elsewhere;
the first layer dense, the rest sparse. ``hy_v4_vl_text`` differs only in its latent norms' eps (``rms_norm_eps``,
where ``hy_v4`` fixes 1e-6) and its multimodal RoPE, which for text (equal t/h/w positions) is the plain one.

Checkpoint names: the releases' (``learnable_sink_param``, ``linear_gate``, ``hc_attn_layer.hc_fn``,
``hc_head_fn``, ...), as transformers' save_pretrained writes them too, renamed to its module names the way its
loader does (``transformers_name``); the multimodal checkpoint's vision tower (``vit.*``) is skipped.
"""

from __future__ import annotations

import re

from .. import _checks

# transformers' conversion_mapping "hy_v4" renames, in its order (release name -> its module name).
_RENAMES = tuple((re.compile(pattern), repl) for pattern, repl in (
    (r"\.hc_pre\.hc_", ".hc_"),
    (r"\.learnable_sink_param", ".sinks"),
    (r"\.linear_gate", ".gate_proj"),  # the attention's output gate, and every MLP's gate_proj as written
    (r"\.hc_attn_layer\.hc_(fn|base|scale)", r".attn_hc.\1"),
    (r"\.hc_mlp_layer\.hc_(fn|base|scale)", r".ffn_hc.\1"),
    (r"\.hc_head_(fn|base|scale)", r".hc_\1"),
))


def transformers_name(name: str) -> str:
    """A release (or save_pretrained) tensor name -> transformers' module name, which the model uses."""
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


def vl_text_name(name: str) -> str | None:
    """A ``hy_v4_vl`` checkpoint's tensor -> the text model's name; None for the vision tower (``vit.*``, as the
    release and save_pretrained write it, or ``model.vision_tower.*``)."""
    if name.startswith(("vit.", "model.vision_tower.")):
        return None
    return "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name


def _indexer_types(layers) -> list[str] | None:
    return layers and ["full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(layers)]


def defaults(c: dict) -> dict:
    """HYV4Config's per-layer defaults where the file is silent: the first layer dense, the rest sparse; full
    indexers on layer 0 and where (l - 1) % 4 == 0."""
    layers = c.get("num_hidden_layers")
    layers = layers if isinstance(layers, int) and not isinstance(layers, bool) and layers >= 1 else None
    derived = {"mlp_layer_types": layers and ["dense"] + ["sparse"] * (layers - 1), "indexer_types": _indexer_types(layers)}
    return {**c, **{key: value for key, value in derived.items() if c.get(key) is None}}


def config_kwargs(c: dict) -> dict:
    """``MLAConfig`` keyword arguments from HY-V4's own keys: the hyper-connections, the clamp, the indexer's norm.
    A ``swiglu_limit`` of 0 or less is refused: HYV4Config's docstring says it turns the clamp off, its code clamps
    to it (every up value to 0)."""
    limit = _checks.check_real(c.get("swiglu_limit", 10.0), "swiglu_limit", None)
    if limit <= 0:
        raise ValueError(f"swiglu_limit must be > 0, got {limit}: transformers' HY-V4 documents 0 or less as no "
                         "clamp but clamps to it; not supported")
    return dict(hc_mult=c.get("hc_mult", 4), hc_magnitude=c.get("hc_magnitude", 2.0), hc_eps=c.get("hc_eps", 1e-6),
                swiglu_limit=limit, indexer_norm_eps=c.get("rms_norm_eps", 1e-5))


def vl_text_config_kwargs(c: dict) -> dict:
    """``hy_v4_vl_text``: HY-V4's keys, and its latent norms at ``rms_norm_eps``."""
    return dict(config_kwargs(c), lora_norm_eps=c.get("rms_norm_eps", 1e-5))


# MLAConfig values every HY-V4 model has, whatever its config.json says.
FIXED = dict(rope_interleave=True, decoder_layer="hyper", output_gate="hidden", attention_sinks=True,
             indexer_rope_last=True)
