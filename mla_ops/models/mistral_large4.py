"""Mistral Large 4 (transformers' ``mistral_large4``): a multimodal wrapper around a DeepSeek Sparse Attention
text model (``mistral_large4_text``), and what that text model has that GLM-5's lacks.

T new tokens   N num_attention_heads   H_I index_n_heads   R qk_rope_head_dim   L kv_lora_rank   P qk_nope_head_dim

Each a named part of ``mla_ops.models`` (DESIGN §11), turned on by ``MLAConfig`` fields this module's
``config_kwargs`` reads from config.json's text config:

* no q-LoRA (a plain ``q_proj``); the indexer's queries come from a LayerNorm of the layer input
  (``indexer.q_input_norm``, ``MLAConfig.indexer_q_norm``), its RoPE interleaved as GLM-5's (permuted at load);
  ``indexer_types`` full / shared as GLM-5's;
* ``query_scale.LogPositionScale`` (``learned_query_scale``): the query heads of the attention and of the indexer times
  ``s[h] * log(position + 1) + b[h]``, learned (transformers' ``softmax_scaling``, the release's
  ``ssmax_scaling.s`` / ``.b``);
* learned RoPE frequencies (``learned_rope_frequencies``): YaRN's inverse frequencies times ``exp(alpha)``,
  ``alpha`` [R/2] one tensor of the model (``model.rotary_emb.alpha``, the release's ``lerope.alpha``);
* NoPE layers (``no_rope_layers[i]`` 0): no rotation, the query and key heads are all nope (P + R), the latent
  row is L wide (R = 0), and the indexer does not rotate either;
* KV sharing (``kv_source_layers[i]`` < i): the layer has no ``kv_a_proj_with_mqa`` / ``kv_a_layernorm``, writes
  no latent cache and attends its source layer's (with its own ``kv_b_proj``, queries and indexer);
* the gate: softmax scores in float32, Mistral 4's group top-2 (its record in ``families.FAMILIES``);
* the logits soft-capped: ``c * tanh(logits / c)``, ``final_logit_softcapping`` (30; ``parts.softcap``).

Checkpoint names: transformers' ``save_pretrained`` writes the release's own (Mistral's native names:
``layers.{i}.attention.wq``, ``wkv_a_with_mqa``, ``wkv_b``, ``wo``, ``feed_forward.w1``, ``experts.{e}.w1``,
``tok_embeddings``, ``output``, ...), which ``native_name`` maps to the decoder's; the names of transformers'
model itself (``model.language_model.*``, stacked experts) load too. The vision tower, the projector and the
release's multi-token-prediction head (``mtp_dspark.*``) are skipped.
"""

from __future__ import annotations

import re


def config_kwargs(c: dict) -> dict:
    """MLAConfig keyword arguments from the keys only Mistral Large 4's text config has (values checked by
    MLAConfig, each error naming the key)."""
    rope = c.get("no_rope_layers")
    layers = c.get("num_hidden_layers")
    if rope is None and isinstance(layers, int) and layers >= 1:  # transformers' default: every 4th layer NoPE
        rope = [int((i + 1) % 4 != 0) for i in range(layers)]
    elif isinstance(rope, list) and isinstance(layers, int) and len(rope) > layers:
        rope = rope[:layers]  # "at least the same length as the number of layers"
    cap = c.get("final_logit_softcapping", 30.0)
    return dict(indexer_q_norm=True, learned_query_scale=True, learned_rope_frequencies=True, no_rope_layers=rope,
                kv_source_layers=c.get("kv_source_layers"), final_logit_softcapping=cap,
                lora_norm_eps=c.get("rms_norm_eps"))  # its kv_a_layernorm's eps is the model's


def defaults(c: dict) -> dict:
    """What MistralLarge4TextConfig fills in where config.json is silent (one gate group, eps 1e-5, GLM-5's
    indexer defaults; its ``indexer_types`` schedule: its record in ``families.FAMILIES``)."""
    c = {"n_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5, "index_topk": 2048, "index_n_heads": 32,
         "index_head_dim": 128, "first_k_dense_replace": 1, "max_position_embeddings": 1048576, "n_shared_experts": 1,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2048.0,
                             "original_max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0,
                             "attention_factor": 1.0},
         **c}
    if c.get("q_lora_rank") is not None:
        raise ValueError(f"config.json sets q_lora_rank={c['q_lora_rank']!r}: Mistral Large 4's attention has no "
                         "q-LoRA (a plain wq / q_proj)")
    if c.get("rope_interleave") is False:
        raise ValueError("config.json sets rope_interleave=false: Mistral Large 4 always interleaves its RoPE rows")
    return {**c, "rope_interleave": True}


# The release's (and transformers' save_pretrained's) names -> the decoder's, applied in order.
_TOP = (("tok_embeddings.", "model.embed_tokens."), ("lerope.alpha", "model.rotary_emb.alpha"),
        ("layers.", "model.layers."), ("norm.", "model.norm."), ("output.", "lm_head."),
        ("model.language_model.", "model."), ("lm_head.", "lm_head."))
_INFIX = tuple((re.compile(a), b) for a, b in (
    (r"\.(feed_forward|shared_experts)\.w1\.", r".\1.gate_proj."),
    (r"\.(feed_forward|shared_experts)\.w2\.", r".\1.down_proj."),
    (r"\.(feed_forward|shared_experts)\.w3\.", r".\1.up_proj."),
    (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
    (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
    (r"\.attention\.", ".self_attn."), (r"\.wq\.", ".q_proj."), (r"\.wkv_a_with_mqa\.", ".kv_a_proj_with_mqa."),
    (r"\.wkv_b\.", ".kv_b_proj."), (r"\.wo\.", ".o_proj."), (r"\.attention_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"\.kv_a_norm\.", ".kv_a_layernorm."),
    (r"\.feed_forward\.", ".mlp."), (r"\.gate\.", ".mlp.gate."), (r"\.experts\.", ".mlp.experts."),
    (r"\.shared_experts\.", ".mlp.shared_experts."),
    (r"\.ssmax_scaling\.s$", ".softmax_scaling.scale"), (r"\.ssmax_scaling\.b$", ".softmax_scaling.bias"),
))


def native_name(name: str) -> str | None:
    """Checkpoint tensor ``name`` -> the decoder's name; None for the wrapper's other tensors (the vision tower,
    the projector, the multi-token-prediction head)."""
    prefix = next((p for p in _TOP if name.startswith(p[0])), None)
    if prefix is None:
        return None
    if prefix[0] in ("model.language_model.", "lm_head."):  # transformers' own module names: the decoder's
        return prefix[1] + name[len(prefix[0]):]
    out = prefix[1] + name[len(prefix[0]):]
    for pattern, repl in _INFIX:
        out = pattern.sub(repl, out)
    return out

