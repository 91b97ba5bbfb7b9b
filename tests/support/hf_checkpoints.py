"""Tiny random DeepSeek-V2/V3 checkpoints written here, with transformers as the reference.

Two styles, both with MoE after a dense first layer and YaRN (factor 4 over 32 positions, so the
frequencies differ from plain RoPE at every position):

* "v2": DeepSeek-V2-Lite's shape (no q LoRA, softmax gate, greedy top-k, 2 shared experts,
  mscale 0.707), the config form transformers 5 writes (``rope_parameters``, ``dtype``);
* "v3": DeepSeek-V3's (q LoRA, sigmoid gate with a random ``e_score_correction_bias``,
  group-limited top-k over 4 groups, norm_topk_prob, routed_scaling_factor 2.5).

``save_release_fp8`` writes a model in DeepSeek's V3 release layout itself: float8_e4m3fn weights
with block scales (partial edge blocks), the released config.json form, two shards with an index,
and a Multi-Token-Prediction layer past ``num_hidden_layers``.
"""

import json
import math
import os

import torch

from tests.support.families import spread_weights

FP8 = torch.float8_e4m3fn
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32,
            beta_fast=32, beta_slow=1)
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
              first_k_dense_replace=1, max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
# num_hidden_layers=2: layer 0 has the dense MLP, layer 1 the experts.


def hf_config(kind: str):
    import transformers

    if kind == "v2":
        return transformers.DeepseekV2Config(
            **COMMON, q_lora_rank=None, qk_rope_head_dim=8, n_routed_experts=8, n_shared_experts=2,
            num_experts_per_tok=2, topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0,
            rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.707),
        )
    if kind == "v2-group":
        return transformers.DeepseekV2Config(
            **COMMON, q_lora_rank=None, qk_rope_head_dim=8, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4, topk_group=2,
            routed_scaling_factor=1.5, rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.707),
        )
    if kind == "v3":
        return transformers.DeepseekV3Config(
            **COMMON, q_lora_rank=32, qk_rope_head_dim=16, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
            rope_interleave=True, rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0),
        )
    raise ValueError(kind)


@torch.no_grad()
def make_hf_model(kind: str, seed: int = 0):
    """A transformers DeepSeek model with weights at ~1/sqrt(fan_in), so attention and routing are
    far from uniform (the default std 0.02 makes every softmax nearly flat)."""
    import transformers

    cls = transformers.DeepseekV3ForCausalLM if kind == "v3" else transformers.DeepseekV2ForCausalLM
    config = hf_config(kind)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return spread_weights(cls(config), seed + 1)


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]):
    """float8 weight and its [ceil(rows/b0), ceil(cols/b1)] scales (dequantized = stored * scale)."""
    rows, cols = weight.shape
    scale = torch.empty(math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    q = torch.empty(rows, cols, dtype=FP8)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = weight[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]].float()
            scale[i, j] = tile.abs().max().clamp_min(1e-12) / 448.0
            q[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = (tile / scale[i, j]).to(FP8)
    return q, scale


def dequantize_reference(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float64: element (i, j) times the scale of block (i // b0, j // b1)."""
    rows, cols = torch.arange(q.shape[0])[:, None] // block[0], torch.arange(q.shape[1])[None, :] // block[1]
    return q.double() * scale.double()[rows, cols]


def _quantized(name: str, tensor: torch.Tensor) -> bool:
    """DeepSeek-V3 keeps embeddings, lm_head, norms and the router in high precision (V3.2 its indexer's
    head weights too)."""
    return tensor.dim() == 2 and ".layers." in name and ".mlp.gate." not in name and "layernorm" not in name \
        and ".indexer.weights_proj." not in name


@torch.no_grad()
def save_release_fp8(hf_model, path: str, block=(16, 16), released_keys: dict | None = None) -> None:
    """DeepSeek-V3 release layout; the weights of ``hf_model`` are replaced by their dequantized
    values, so it stays the reference for what was written. ``released_keys``: config.json keys added or
    replaced (another model type's release: DeepSeek-V3.2's)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tmp = os.path.join(path, "hf")
    hf_model.save_pretrained(tmp)  # per-expert names, as a release has them
    from safetensors.torch import load_file

    hf_tensors = load_file(os.path.join(tmp, "model.safetensors"))
    for file in os.listdir(tmp):
        os.remove(os.path.join(tmp, file))
    os.rmdir(tmp)

    tensors, dequantized = {}, {}
    for name, t in hf_tensors.items():
        if _quantized(name, t):
            q, scale = quantize_blocks(t, block)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize_reference(q, scale, block).float()
        else:
            tensors[name] = t
    c = hf_model.config
    mtp = f"model.layers.{c.num_hidden_layers}"
    g = torch.Generator().manual_seed(7)
    for suffix, shape in (("enorm.weight", [c.hidden_size]), ("hnorm.weight", [c.hidden_size]),
                          ("eh_proj.weight", [c.hidden_size, 2 * c.hidden_size]),
                          ("self_attn.kv_a_proj_with_mqa.weight", [c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size]),
                          ("shared_head.head.weight", [c.vocab_size, c.hidden_size])):
        tensors[f"{mtp}.{suffix}"] = torch.randn(shape, generator=g)

    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n].contiguous() for n in part}, os.path.join(path, file))
        weight_map.update({n: file for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    rope = c.rope_parameters
    released = dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", torch_dtype="bfloat16",
        rope_theta=rope["rope_theta"], rope_scaling={"type": "yarn", **{k: v for k, v in rope.items()
                                                                        if k not in ("rope_type", "rope_theta")}},
        scoring_func="sigmoid", topk_method="noaux_tc", num_nextn_predict_layers=1, moe_layer_freq=1,
        quantization_config=dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8", weight_block_size=list(block)),
        **{k: getattr(c, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace", "max_position_embeddings", "rms_norm_eps",
            "tie_word_embeddings", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
            "topk_group", "norm_topk_prob", "routed_scaling_factor", "bos_token_id", "eos_token_id")},
    )
    released.update(released_keys or {})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(released, f, indent=1)

    # The reference computes with exactly the values that were written.
    state = hf_model.state_dict()
    for name, value in dequantized.items():
        expert = name.split(".mlp.experts.")
        if len(expert) == 2:  # per-expert name -> transformers' fused 3-D parameter
            e, proj = expert[1].split(".")[:2]
            prefix = expert[0] + ".mlp.experts."
            inter = c.moe_intermediate_size
            if proj == "down_proj":
                state[prefix + "down_proj"][int(e)].copy_(value)
            else:
                rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                state[prefix + "gate_up_proj"][int(e), rows].copy_(value)
        else:
            state[name].copy_(value)
