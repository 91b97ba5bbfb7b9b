"""Bad checkpoints and configs: one clear error each, raised before the model is built or a weight read.

One bad-input table per surface: config values (``MLAConfig.from_hf`` and ``from_pretrained``), config
values that disagree with the tensors, the config.json file, safetensors files, tensor dtypes, the index
file, shard paths, and ``from_pretrained``'s own arguments. Each case asserts the error type and that the
message names the key, file or tensor. The checkpoints are tiny (a 2-layer MoE model written here with
safetensors, no transformers), so the whole file runs in seconds.
"""

import copy
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

import mla_ops
from mla_ops.models import checkpoint_files
from mla_ops.models.config import IndexerConfig, LayerKinds, MLAConfig, Scalings, grouped

FP8 = torch.float8_e4m3fn
# A DeepSeek-V2-style config.json: q LoRA, YaRN, a dense layer 0 and a MoE layer 1 with 4 experts.
CONFIG = dict(
    model_type="deepseek_v2", vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, n_routed_experts=4,
    num_experts_per_tok=2, n_shared_experts=1, topk_method="greedy", max_position_embeddings=64, rms_norm_eps=1e-6,
    rope_theta=10000.0, rope_interleave=False, tie_word_embeddings=False, torch_dtype="float32",
    attention_bias=False, hidden_act="silu",
    rope_scaling=dict(type="yarn", factor=2.0, original_max_position_embeddings=32, beta_fast=32, beta_slow=1,
                      mscale=0.707, mscale_all_dim=0.707),
)
LAYER1 = "model.layers.1"
Q_B = "model.layers.0.self_attn.q_b_proj.weight"
KV_B = "model.layers.0.self_attn.kv_b_proj.weight"


def release_tensors(config: dict, seed: int = 0) -> dict:
    """A random model of ``config`` as DeepSeek's release names it (one tensor per expert)."""
    torch.manual_seed(seed)
    state = mla_ops.MLAForCausalLM(MLAConfig.from_hf(config)).state_dict()
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name.rsplit(".", 1)[0], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = t[e, :inter], t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.rsplit(".", 1)[0]
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return {name: t.contiguous().clone() for name, t in out.items()}


TENSORS = release_tensors(CONFIG)


def write(path, config=CONFIG, tensors=None, shards=None):
    """config.json + model.safetensors, or with ``shards`` (file -> tensor names) an index and its shards."""
    os.makedirs(path, exist_ok=True)
    tensors = TENSORS if tensors is None else tensors
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if shards is None:
        save_file(tensors, os.path.join(path, "model.safetensors"))
        return str(path)
    weight_map = {}
    for file, names in shards.items():
        os.makedirs(os.path.dirname(os.path.join(path, file)), exist_ok=True)
        save_file({n: tensors[n] for n in names}, os.path.join(path, file))
        weight_map.update({n: file for n in names})
    write_index(path, {"metadata": {}, "weight_map": weight_map})
    return str(path)


def write_index(path, index):
    with open(os.path.join(path, checkpoint_files.INDEX), "w") as f:
        f.write(index if isinstance(index, str) else json.dumps(index))


def two_shards(tensors=TENSORS):
    names = sorted(tensors)
    return {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}


class Counting(mla_ops.MLAForCausalLM):
    built = 0

    def __init__(self, config):
        Counting.built += 1
        super().__init__(config)


@pytest.fixture
def untouched(monkeypatch):
    """Asserts afterwards that no model was built and no tensor read (the error came first)."""
    reads = []
    real = checkpoint_files.read_tensor
    monkeypatch.setattr(checkpoint_files, "read_tensor",
                        lambda f, file, name: reads.append(name) or real(f, file, name))
    Counting.built = 0
    yield lambda: (Counting.built, len(reads))
    assert reads == []


def refused(path, error, names, untouched=None, built_ok=False, **kwargs):
    with pytest.raises(error) as info:
        Counting.from_pretrained(path, **kwargs)
    message = str(info.value)
    for name in names:
        assert name in message, f"{name!r} not in {message!r}"
    if untouched is not None and not built_ok:
        assert untouched()[0] == 0, "the model was built before the error"
    return message


def test_the_tiny_checkpoint_loads_exactly(tmp_path):
    """The base of every case below is good: both layouts load the tensors written, bit for bit."""
    for path in (write(tmp_path / "single"), write(tmp_path / "sharded", shards=two_shards())):
        got = mla_ops.MLAForCausalLM.from_pretrained(path).state_dict()
        assert got.keys() == mla_ops.MLAForCausalLM(MLAConfig.from_hf(CONFIG)).state_dict().keys()
        assert torch.equal(got[f"{LAYER1}.mlp.experts.gate_up_proj"][3],
                           torch.cat([TENSORS[f"{LAYER1}.mlp.experts.3.gate_proj.weight"],
                                      TENSORS[f"{LAYER1}.mlp.experts.3.up_proj.weight"]]))
        for name in ("model.embed_tokens.weight", Q_B, "lm_head.weight", f"{LAYER1}.mlp.gate.weight"):
            assert torch.equal(got[name], TENSORS[name]), name


# ---------------------------------------------------------------------------------------------------------------------
# Config values: (change to config.json, error type, what the message must name)
DELETE = object()


def changed(config, change):
    config = copy.deepcopy(config)
    if callable(change):
        change(config)
        return config
    for key, value in change.items():
        if value is DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    return config


def yarn(**kwargs):
    return lambda c: c["rope_scaling"].update(kwargs)


BAD_CONFIG_VALUES = {
    "heads negative": ({"num_attention_heads": -4}, ValueError, "num_attention_heads"),
    "heads a word": ({"num_attention_heads": "four"}, TypeError, "num_attention_heads"),
    "heads a string number": ({"num_attention_heads": "4"}, TypeError, "num_attention_heads"),
    "heads fractional": ({"num_attention_heads": 4.5}, TypeError, "num_attention_heads"),
    "heads a whole float": ({"num_attention_heads": 4.0}, TypeError, "num_attention_heads"),
    "heads a bool": ({"num_attention_heads": True}, TypeError, "num_attention_heads"),
    "heads missing": ({"num_attention_heads": DELETE}, ValueError, "num_attention_heads"),
    "heads null": ({"num_attention_heads": None}, ValueError, "num_attention_heads"),
    "kv_lora_rank 0": ({"kv_lora_rank": 0}, ValueError, "kv_lora_rank"),
    "kv_lora_rank a list": ({"kv_lora_rank": [16]}, TypeError, "kv_lora_rank"),
    "layers 0": ({"num_hidden_layers": 0}, ValueError, "num_hidden_layers"),
    "layers -1": ({"num_hidden_layers": -1}, ValueError, "num_hidden_layers"),
    "hidden_size 0": ({"hidden_size": 0}, ValueError, "hidden_size"),
    "hidden_size missing": ({"hidden_size": DELETE}, ValueError, "hidden_size"),
    "q_lora_rank 0": ({"q_lora_rank": 0}, ValueError, "q_lora_rank"),
    "q_lora_rank a string": ({"q_lora_rank": "24"}, TypeError, "q_lora_rank"),
    "qk_nope_head_dim 0": ({"qk_nope_head_dim": 0}, ValueError, "qk_nope_head_dim"),
    "qk_rope_head_dim odd": ({"qk_rope_head_dim": 5}, ValueError, "qk_rope_head_dim"),
    "qk_rope_head_dim 0": ({"qk_rope_head_dim": 0}, ValueError, "qk_rope_head_dim"),
    "v_head_dim negative": ({"v_head_dim": -8}, ValueError, "v_head_dim"),
    "intermediate_size float": ({"intermediate_size": 48.5}, TypeError, "intermediate_size"),
    "vocab_size a string": ({"vocab_size": "64"}, TypeError, "vocab_size"),
    "vocab_size 0": ({"vocab_size": 0}, ValueError, "vocab_size"),
    "max_position_embeddings 0": ({"max_position_embeddings": 0}, ValueError, "max_position_embeddings"),
    "rope_theta a word": ({"rope_theta": "fast"}, TypeError, "rope_theta"),
    "rope_theta 0": ({"rope_theta": 0}, ValueError, "rope_theta"),
    "rope_theta NaN": ({"rope_theta": float("nan")}, ValueError, "rope_theta"),
    "rope_theta infinite": ({"rope_theta": float("inf")}, ValueError, "rope_theta"),
    "rope_theta a bool": ({"rope_theta": True}, TypeError, "rope_theta"),
    "rms_norm_eps negative": ({"rms_norm_eps": -1e-6}, ValueError, "rms_norm_eps"),
    "rms_norm_eps a string": ({"rms_norm_eps": "1e-6"}, TypeError, "rms_norm_eps"),
    "initializer_range negative": ({"initializer_range": -0.02}, ValueError, "initializer_range"),
    "rope_interleave a string": ({"rope_interleave": "false"}, TypeError, "rope_interleave"),
    "tie_word_embeddings 1": ({"tie_word_embeddings": 1}, TypeError, "tie_word_embeddings"),
    "attention_bias a string": ({"attention_bias": "no"}, TypeError, "attention_bias"),
    "attention_bias true": ({"attention_bias": True}, ValueError, "attention_bias"),
    "mlp_bias true": ({"mlp_bias": True}, ValueError, "mlp_bias"),
    "hidden_act gelu": ({"hidden_act": "gelu"}, ValueError, "hidden_act"),
    "hidden_act a number": ({"hidden_act": 5}, TypeError, "hidden_act"),
    "model_type a number": ({"model_type": 2}, TypeError, "model_type"),
    "model_type unknown": ({"model_type": "kimi"}, ValueError, "model_type"),
    "torch_dtype unknown": ({"torch_dtype": "float31"}, ValueError, "torch_dtype"),
    "torch_dtype an integer type": ({"torch_dtype": "int64"}, ValueError, "torch_dtype"),
    "dtype a number": ({"dtype": 16}, TypeError, "dtype"),
    "dtype float8": ({"dtype": "float8_e4m3fn"}, ValueError, "dtype"),
    "rope_scaling a string": ({"rope_scaling": "yarn"}, TypeError, "rope_scaling"),
    "rope_scaling type a number": (yarn(type=5), TypeError, "rope_scaling.type"),
    "rope_scaling type linear": (yarn(type="linear"), ValueError, "rope_scaling type 'linear'"),
    "yarn factor a string": (yarn(factor="2"), TypeError, "rope_scaling.factor"),
    "yarn factor negative": (yarn(factor=-2.0), ValueError, "rope_scaling.factor"),
    "yarn original length fractional": (yarn(original_max_position_embeddings=32.5), TypeError,
                                        "rope_scaling.original_max_position_embeddings"),
    "yarn original length 0": (yarn(original_max_position_embeddings=0), ValueError,
                               "rope_scaling.original_max_position_embeddings"),
    "yarn beta_fast 0": (yarn(beta_fast=0), ValueError, "rope_scaling.beta_fast"),
    "yarn beta_slow a string": (yarn(beta_slow="1"), TypeError, "rope_scaling.beta_slow"),
    "yarn mscale a string": (yarn(mscale="0.7"), TypeError, "rope_scaling.mscale"),
    "yarn attention_factor 0": (yarn(attention_factor=0), ValueError, "rope_scaling.attention_factor"),
    "yarn truncate a string": (yarn(truncate="yes"), TypeError, "rope_scaling.truncate"),
    "rope_parameters a list": ({"rope_parameters": [1]}, TypeError, "rope_parameters"),
    "rope_parameters theta a word": ({"rope_parameters": {"rope_type": "default", "rope_theta": "fast"}}, TypeError,
                                     "rope_parameters.rope_theta"),
    "rope_parameters factor a string": ({"rope_scaling": DELETE, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e4, "factor": "x"}}, TypeError, "rope_parameters.factor"),
    "experts negative": ({"n_routed_experts": -1}, ValueError, "n_routed_experts"),
    "experts a string": ({"n_routed_experts": "4"}, TypeError, "n_routed_experts"),
    "experts fractional": ({"n_routed_experts": 2.5}, TypeError, "n_routed_experts"),
    "experts per token 0": ({"num_experts_per_tok": 0}, ValueError, "num_experts_per_tok"),
    "experts per token > experts": ({"num_experts_per_tok": 5}, ValueError, "num_experts_per_tok"),
    "experts per token missing": ({"num_experts_per_tok": DELETE}, ValueError, "num_experts_per_tok"),
    "moe_intermediate_size 0": ({"moe_intermediate_size": 0}, ValueError, "moe_intermediate_size"),
    "n_shared_experts negative": ({"n_shared_experts": -1}, ValueError, "n_shared_experts"),
    "first_k_dense_replace negative": ({"first_k_dense_replace": -1}, ValueError, "first_k_dense_replace"),
    "moe_layer_freq 0": ({"moe_layer_freq": 0}, ValueError, "moe_layer_freq"),
    "n_group 0": ({"n_group": 0}, ValueError, "n_group"),
    "topk_group a string": ({"topk_group": "2"}, TypeError, "topk_group"),
    "scoring_func unknown": ({"scoring_func": "relu"}, ValueError, "scoring_func"),
    "scoring_func a number": ({"scoring_func": 1}, TypeError, "scoring_func"),
    "topk_method unknown": ({"topk_method": "best"}, ValueError, "topk_method"),
    "norm_topk_prob a string": ({"norm_topk_prob": "yes"}, TypeError, "norm_topk_prob"),
    "routed_scaling_factor 0": ({"routed_scaling_factor": 0}, ValueError, "routed_scaling_factor"),
    "routed_scaling_factor a string": ({"routed_scaling_factor": "2.5"}, TypeError, "routed_scaling_factor"),
    "group top-k not dividing": ({"topk_method": "group_limited_greedy", "n_group": 3}, ValueError, "n_group"),
}
# Read only by the loader (MLAConfig has no such field).
BAD_LOADER_CONFIG_VALUES = {
    "quantization_config a string": ({"quantization_config": "fp8"}, TypeError, "quantization_config"),
    "weight_block_size one number": ({"quantization_config": {"weight_block_size": [128]}}, ValueError,
                                     "quantization_config.weight_block_size"),
    "weight_block_size 0": ({"quantization_config": {"weight_block_size": [128, 0]}}, ValueError,
                            "quantization_config.weight_block_size[1]"),
    "weight_block_size a string": ({"quantization_config": {"weight_block_size": ["a", 128]}}, TypeError,
                                   "quantization_config.weight_block_size[0]"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIG_VALUES))
def test_bad_config_values_name_the_key(case, tmp_path, untouched):
    change, error, key = BAD_CONFIG_VALUES[case]
    config = changed(CONFIG, change)
    with pytest.raises(error) as info:
        MLAConfig.from_hf(config)
    assert key in str(info.value)
    path = write(tmp_path / "ckpt", config)
    message = refused(path, error, [key, os.path.join(path, "config.json")], untouched)
    assert message == refused(path, error, [], untouched) and str(info.value) in message
    with pytest.raises(error, match="config.json"):
        MLAConfig.from_hf(path)


@pytest.mark.parametrize("case", list(BAD_LOADER_CONFIG_VALUES))
def test_bad_loader_config_values_name_the_key(case, tmp_path, untouched):
    change, error, key = BAD_LOADER_CONFIG_VALUES[case]
    path = write(tmp_path / "ckpt", changed(CONFIG, change))
    refused(path, error, [key, os.path.join(path, "config.json")], untouched)


ACCEPTED_CONFIGS = {
    "nulls take defaults": {"rms_norm_eps": None, "n_group": None, "topk_group": None, "rope_interleave": None,
                            "initializer_range": None, "max_position_embeddings": None, "torch_dtype": None},
    "experts 0 means dense": {"n_routed_experts": 0, "num_experts_per_tok": None},
    "q_lora_rank null: plain q_proj": {"q_lora_rank": None},
    "integer reals": {"rope_theta": 10000, "routed_scaling_factor": 2, "rms_norm_eps": 0.000001},
    "torch.-prefixed dtype": {"torch_dtype": "torch.bfloat16"},
    "plain RoPE": {"rope_scaling": None},
    "first_k_dense_replace past the layers": {"first_k_dense_replace": 5},
}


@pytest.mark.parametrize("case", list(ACCEPTED_CONFIGS))
def test_accepted_config_values(case):
    config = MLAConfig.from_hf(changed(CONFIG, ACCEPTED_CONFIGS[case]))
    assert isinstance(config.num_attention_heads, int) and isinstance(config.rope_theta, float)


def test_mlaconfig_checks_its_fields_directly():
    tiny = mla_ops.models.config.mla_configs["tiny"]
    for key, value, error in (("num_attention_heads", -4, ValueError), ("kv_lora_rank", 0, ValueError),
                              ("num_hidden_layers", True, TypeError), ("rope_theta", "fast", TypeError),
                              ("n_routed_experts", 0, ValueError), ("dtype", "int8", ValueError),
                              ("rope_scaling", 40, TypeError), ("norm_topk_prob", None, TypeError)):
        with pytest.raises(error, match=key):
            MLAConfig(**{**tiny, key: value})
    assert MLAConfig(**{**tiny, "num_attention_heads": torch.tensor(4).numpy()[()]}).num_attention_heads == 4


def test_mlaconfig_groups_its_optional_parts_into_records():
    tiny = mla_ops.models.config.mla_configs["tiny"]
    flat = {**tiny, "index_topk": 4, "index_n_heads": 2, "index_head_dim": 8, "embedding_scale": 2,
            "indexer_types": ["full", "shared"]}
    config = MLAConfig(**grouped(flat))
    assert config.indexer == IndexerConfig(index_topk=4, index_n_heads=2, index_head_dim=8)
    assert config.index_topk == 4 and config.is_sparse and config.num_index_layers == 1
    assert config.scalings.embedding_scale == 2.0 and isinstance(config.scalings.embedding_scale, float)
    assert config.layer_kinds == LayerKinds(indexer_types=("full", "shared"))  # lists made tuples
    assert MLAConfig(**tiny).indexer is None and MLAConfig(**tiny).scalings == Scalings()
    for part, value, error, match in (("indexer", 4, TypeError, "indexer must be None, a dict or IndexerConfig"),
                                      ("indexer", dict(index_topk=0), ValueError, "index_topk"),
                                      ("indexer", dict(index_topk=2**31), ValueError,
                                       r"index_topk must be at most 2\*\*31 - 1"),
                                      ("scalings", None, TypeError, "scalings must be a dict or a record"),
                                      ("scalings", dict(residual_scale="1"), TypeError, "residual_scale"),
                                      ("layer_kinds", dict(no_rope_layers=[1, 0]), ValueError,
                                       "no_rope_layers / kv_source_layers are Mistral Large 4's")):
        with pytest.raises(error, match=match):
            MLAConfig(**{**tiny, part: value})
    with pytest.raises(TypeError, match=r"indexer and its fields \['index_topk'\] both given"):
        grouped({**tiny, "indexer": dict(index_topk=4), "index_topk": 4})


# ---------------------------------------------------------------------------------------------------------------------
# Config values that are well-formed but disagree with the tensors: the message names a tensor (or the layer) and key.
MISFIT_CONFIGS = {
    "more heads": ({"num_attention_heads": 8}, [Q_B, "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)",
                                                "the model expects [96, 24]"]),
    "other v_head_dim": ({"v_head_dim": 16}, [KV_B, "num_attention_heads * (qk_nope_head_dim + v_head_dim)",
                                              "model.layers.0.self_attn.o_proj.weight",
                                              "num_attention_heads * v_head_dim"]),
    "other qk_nope_head_dim": ({"qk_nope_head_dim": 4}, [Q_B, KV_B]),
    "other qk_rope_head_dim": ({"qk_rope_head_dim": 8}, [
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "kv_lora_rank + qk_rope_head_dim"]),
    "other kv_lora_rank": ({"kv_lora_rank": 8}, ["model.layers.0.self_attn.kv_a_layernorm.weight", "kv_lora_rank"]),
    "other q_lora_rank": ({"q_lora_rank": 12}, ["model.layers.0.self_attn.q_a_proj.weight", "q_lora_rank"]),
    "other hidden_size": ({"hidden_size": 48}, ["model.embed_tokens.weight", "vocab_size, hidden_size"]),
    "other vocab_size": ({"vocab_size": 65}, ["lm_head.weight", "vocab_size"]),
    "other intermediate_size": ({"intermediate_size": 40}, ["model.layers.0.mlp.gate_proj.weight",
                                                            "intermediate_size"]),
    "other moe_intermediate_size": ({"moe_intermediate_size": 8}, [
        f"{LAYER1}.mlp.experts.0.down_proj.weight: the checkpoint has [32, 16], the model expects [32, 8] = "
        "[hidden_size, moe_intermediate_size]", "wrong shapes (15)", "(7 more)"]),
    "other n_shared_experts": ({"n_shared_experts": 2}, [
        f"{LAYER1}.mlp.shared_experts.up_proj.weight", "moe_intermediate_size * n_shared_experts"]),
    "fewer experts": ({"n_routed_experts": 2}, [f"{LAYER1}.mlp.experts.3.up_proj.weight",
                                                "n_routed_experts=2 but the checkpoint has expert 3",
                                                f"{LAYER1}.mlp.gate.weight"]),
    "more experts": ({"n_routed_experts": 8}, [f"{LAYER1}.mlp.experts.7.gate_proj.weight", "missing tensors"]),
    "q_lora_rank null": ({"q_lora_rank": None}, ["model.layers.0.self_attn.q_proj.weight", "q_lora_rank is null"]),
    "all dense": ({"n_routed_experts": None}, [f"{LAYER1}.mlp.gate_proj.weight", "layer 1 is dense"]),
    "all MoE": ({"first_k_dense_replace": 0}, ["model.layers.0.mlp.gate.weight", "layer 0 is MoE"]),
    "fewer layers": ({"num_hidden_layers": 1}, ["num_hidden_layers=1", "decoder layer 1", "model.layers.1."]),
    "more layers": ({"num_hidden_layers": 3}, ["num_hidden_layers=3", "2 decoder layers", "model.layers.2 is absent"]),
    "a million layers": ({"num_hidden_layers": 10**6}, ["num_hidden_layers=1000000"]),
    "tied but other vocab": ({"tie_word_embeddings": True, "vocab_size": 32}, ["model.embed_tokens.weight"]),
}


@pytest.mark.parametrize("case", list(MISFIT_CONFIGS))
def test_config_disagreeing_with_the_tensors_names_both(case, tmp_path, untouched):
    change, names = MISFIT_CONFIGS[case]
    path = write(tmp_path / "ckpt", changed(CONFIG, change))
    layers = "layers" in case
    refused(path, ValueError, names, untouched, built_ok=not layers)  # built on the meta device at most


# ---------------------------------------------------------------------------------------------------------------------
# The config.json file: (contents, written as bytes, or None for no file, or "dir" for a directory)
BAD_CONFIG_FILES = {
    "not JSON": b"{hidden_size: 64",
    "empty": b"",
    "truncated": json.dumps(CONFIG).encode()[:-10],
    "not UTF-8": b"\xff\xfe\x00garbage",
    "a JSON array": b"[1, 2, 3]",
    "a JSON string": b'"config"',
    "JSON null": b"null",
    "absent": None,
    "a directory": "dir",
}


@pytest.mark.parametrize("case", list(BAD_CONFIG_FILES))
def test_bad_config_json_is_one_value_error_naming_the_file(case, tmp_path, untouched):
    path = write(tmp_path / "ckpt")
    file = os.path.join(path, "config.json")
    os.remove(file)
    contents = BAD_CONFIG_FILES[case]
    if contents == "dir":
        os.mkdir(file)
    elif contents is not None:
        with open(file, "wb") as f:
            f.write(contents)
    refused(path, ValueError, [file], untouched)
    with pytest.raises(ValueError) as info:
        MLAConfig.from_hf(path if contents != "dir" else file)
    assert file in str(info.value)


# ---------------------------------------------------------------------------------------------------------------------
# Safetensors files: (how to spoil the file's bytes)
BAD_SAFETENSORS = {
    "empty": lambda data: b"",
    "truncated": lambda data: data[:-7],
    "cut in the header": lambda data: data[:40],
    "header only": lambda data: data[:8 + int.from_bytes(data[:8], "little")],
    "eight bytes": lambda data: data[:8],
    "text": lambda data: b"this is not a safetensors file at all",
    "trailing bytes": lambda data: data + b"\0\0\0",
    "a header that is not JSON": lambda data: (16).to_bytes(8, "little") + b"{not json at all" + data[-64:],
}


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("case", list(BAD_SAFETENSORS))
def test_unreadable_safetensors_name_the_file(case, layout, tmp_path, untouched):
    path = write(tmp_path / "ckpt", shards=two_shards() if layout == "sharded" else None)
    file = os.path.join(path, "model.safetensors" if layout == "single" else "model-00002-of-00002.safetensors")
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(BAD_SAFETENSORS[case](data))
    refused(path, ValueError, [file], untouched)


def test_model_safetensors_that_is_a_directory(tmp_path, untouched):
    path = write(tmp_path / "ckpt")
    file = os.path.join(path, "model.safetensors")
    os.remove(file)
    os.mkdir(file)
    refused(path, ValueError, [file], untouched)


# ---------------------------------------------------------------------------------------------------------------------
# Tensor dtypes: (tensor, its stored form) -> refused naming the tensor and the dtype
def stored_as(name, dtype):
    def change(tensors):
        t = tensors[name]
        tensors[name] = (t * 100).to(dtype) if dtype != torch.bool else t > 0
    return change


def fp8_with_scale(name, scale_change=None, block=16):
    def change(tensors):
        from tests.support.hf_checkpoints import quantize_blocks

        q, scale = quantize_blocks(tensors[name].float(), (block, block))
        tensors[name], tensors[name + "_scale_inv"] = q, scale_change(scale) if scale_change else scale
    return change


BAD_DTYPES = {
    "int64": (stored_as(Q_B, torch.int64), [Q_B, "int64"]),
    "int32": (stored_as("model.embed_tokens.weight", torch.int32), ["model.embed_tokens.weight", "int32"]),
    "int16": (stored_as(KV_B, torch.int16), [KV_B, "int16"]),
    "int8": (stored_as(f"{LAYER1}.mlp.experts.2.down_proj.weight", torch.int8),
             [f"{LAYER1}.mlp.experts.2.down_proj.weight", "int8"]),
    "uint8": (stored_as("model.norm.weight", torch.uint8), ["model.norm.weight", "uint8"]),
    "bool": (stored_as("lm_head.weight", torch.bool), ["lm_head.weight", "bool"]),
    "float8_e5m2 (no scale form)": (stored_as(KV_B, torch.float8_e5m2), [KV_B, "float8_e5m2"]),
    "float8_e4m3fn without scale": (stored_as(KV_B, FP8), [KV_B, "without its"]),
    "a scale on a float32 weight": (lambda t: t.update({KV_B + "_scale_inv": torch.ones(1, 1)}),
                                    [KV_B + "_scale_inv", "scales a float32 tensor"]),
    "an integer scale": (fp8_with_scale(KV_B, lambda s: s.to(torch.int32)), [KV_B + "_scale_inv", "int32"]),
    "a scale of the wrong grid": (fp8_with_scale(KV_B, lambda s: s[:2].contiguous()),
                                  [KV_B + "_scale_inv", "the checkpoint has [2, 1]", "16x16 blocks", "needs [4, 1]"]),
}


@pytest.mark.parametrize("case", list(BAD_DTYPES))
def test_non_floating_weights_are_refused_naming_the_tensor(case, tmp_path, untouched):
    change, names = BAD_DTYPES[case]
    tensors = dict(TENSORS)
    change(tensors)
    config = changed(CONFIG, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}})
    path = write(tmp_path / "ckpt", config, tensors)
    refused(path, ValueError, names, untouched, built_ok=True)  # meta model only: no weight written or read


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, FP8])
def test_floating_weights_load(dtype, tmp_path):
    """Every floating form loads: cast to the model dtype, float8_e4m3fn through its block scales."""
    tensors = dict(TENSORS)
    if dtype == FP8:
        fp8_with_scale(KV_B)(tensors)
        from tests.support.hf_checkpoints import dequantize_reference

        expect = dequantize_reference(tensors[KV_B], tensors[KV_B + "_scale_inv"], (16, 16)).float()
    else:
        tensors[KV_B] = tensors[KV_B].to(dtype)
        expect = tensors[KV_B].float()
    config = changed(CONFIG, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}})
    model = mla_ops.MLAForCausalLM.from_pretrained(write(tmp_path / "ckpt", config, tensors))
    torch.testing.assert_close(model.state_dict()[KV_B], expect, rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------------------------------
# The index file: (its contents) -> one ValueError naming the index
BAD_INDEXES = {
    "not JSON": "{weight_map: ",
    "empty": "",
    "a JSON array": "[]",
    "no weight_map": {"metadata": {}},
    "weight_map null": {"weight_map": None},
    "weight_map a list": {"weight_map": [["lm_head.weight", "model-00001-of-00002.safetensors"]]},
    "weight_map a string": {"weight_map": "model.safetensors"},
    "a shard name a number": {"weight_map": {"lm_head.weight": 1}},
    "a shard name null": {"weight_map": {"lm_head.weight": None}},
    "a shard name a list": {"weight_map": {"lm_head.weight": ["a.safetensors"]}},
}


@pytest.mark.parametrize("case", list(BAD_INDEXES))
def test_bad_index_is_one_value_error_naming_it(case, tmp_path, untouched):
    path = write(tmp_path / "ckpt", shards=two_shards())
    write_index(path, BAD_INDEXES[case])
    refused(path, ValueError, [os.path.join(path, checkpoint_files.INDEX)], untouched)


def test_index_naming_absent_shards_or_tensors(tmp_path, untouched):
    shards = two_shards()
    path = write(tmp_path / "ckpt", shards=shards)
    index = os.path.join(path, checkpoint_files.INDEX)
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    moved = shards["model-00002-of-00002.safetensors"][0]
    write_index(path, {"weight_map": dict(weight_map, **{moved: "model-00003.safetensors"})})
    refused(path, ValueError, [index, "model-00003.safetensors", "does not exist"], untouched)
    write_index(path, {"weight_map": dict(weight_map, **{moved: "model-00001-of-00002.safetensors"})})
    refused(path, ValueError, ["index lists tensors its shards lack", moved, "model-00001-of-00002.safetensors"],
            untouched)
    write_index(path, {"weight_map": dict(weight_map, **{moved: "shards"})})
    os.mkdir(os.path.join(path, "shards"))
    refused(path, ValueError, [index, "'shards'", "is not a file"], untouched)


# ---------------------------------------------------------------------------------------------------------------------
# Shard paths: every shard must lie inside the checkpoint directory.
def shard_outside(kind):
    """Set up ``path`` so that one shard is named by ``kind``'s path; returns (path, names in the error)."""
    def make(tmp_path):
        outside = tmp_path / "outside"
        outside.mkdir()
        shards = two_shards()
        path = write(tmp_path / "ckpt", shards=shards)
        moved = str(outside / "stolen.safetensors")
        shutil.move(os.path.join(path, "model-00002-of-00002.safetensors"), moved)
        with open(os.path.join(path, checkpoint_files.INDEX)) as f:
            weight_map = json.load(f)["weight_map"]
        name = {"absolute": moved, "dot-dot": "../outside/stolen.safetensors",
                "dot-dot inside a path": "sub/../../outside/stolen.safetensors",
                "symlink out": "link.safetensors", "symlinked folder": "folder/stolen.safetensors"}[kind]
        if kind == "symlink out":
            os.symlink(moved, os.path.join(path, name))
        if kind == "symlinked folder":
            os.symlink(str(outside), os.path.join(path, "folder"))
        write_index(path, {"weight_map": {k: (name if v == "model-00002-of-00002.safetensors" else v)
                                          for k, v in weight_map.items()}})
        return path, [name, "the checkpoint directory"]
    return make


def single_symlinked_out(tmp_path):
    path = write(tmp_path / "ckpt")
    (tmp_path / "outside").mkdir()
    moved = str(tmp_path / "outside" / "model.safetensors")
    shutil.move(os.path.join(path, "model.safetensors"), moved)
    os.symlink(moved, os.path.join(path, "model.safetensors"))
    return path, ["model.safetensors", "outside the checkpoint directory", moved]


BAD_SHARD_PATHS = {
    "absolute": shard_outside("absolute"),
    "dot-dot": shard_outside("dot-dot"),
    "dot-dot inside a path": shard_outside("dot-dot inside a path"),
    "symlink resolving outside": shard_outside("symlink out"),
    "through a symlinked folder": shard_outside("symlinked folder"),
    "model.safetensors a symlink out": single_symlinked_out,
}


@pytest.mark.parametrize("case", list(BAD_SHARD_PATHS))
def test_shards_outside_the_directory_are_refused(case, tmp_path, untouched):
    path, names = BAD_SHARD_PATHS[case](tmp_path)
    refused(path, ValueError, names, untouched)


def test_shards_inside_the_directory_load(tmp_path):
    """Sub-folders, symlinks that stay inside, and the Hugging Face hub cache's snapshot -> blob links."""
    names = sorted(TENSORS)
    path = write(tmp_path / "ckpt", shards={"shards/a.safetensors": names[::2], "real/b.safetensors": names[1::2]})
    os.symlink(os.path.join(path, "real", "b.safetensors"), os.path.join(path, "b-link.safetensors"))
    with open(os.path.join(path, checkpoint_files.INDEX)) as f:
        weight_map = json.load(f)["weight_map"]
    write_index(path, {"weight_map": {k: v.replace("real/b", "b-link") for k, v in weight_map.items()}})
    reference = mla_ops.MLAForCausalLM.from_pretrained(path).state_dict()

    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    write(tmp_path / "plain")
    for i, file in enumerate(("config.json", "model.safetensors")):
        shutil.move(str(tmp_path / "plain" / file), str(blobs / f"blob{i}"))
        os.symlink(f"../../blobs/blob{i}", snapshot / file)
    hub = mla_ops.MLAForCausalLM.from_pretrained(snapshot).state_dict()
    assert hub.keys() == reference.keys() and all(torch.equal(hub[k], reference[k]) for k in hub)


# ---------------------------------------------------------------------------------------------------------------------
# from_pretrained's own arguments
BAD_ARGUMENTS = {
    "dtype unknown": (dict(dtype="float31"), ValueError, ["dtype", "float31"]),
    "dtype an integer type": (dict(dtype=torch.int64), ValueError, ["dtype"]),
    "dtype a number": (dict(dtype=32), TypeError, ["dtype"]),
    "device nonsense": (dict(device="nonsense"), ValueError, ["device", "nonsense"]),
    "path a number": (dict(path=5), TypeError, ["path"]),
    "path absent": (dict(path="/nonexistent/checkpoint"), ValueError, ["/nonexistent/checkpoint"]),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments_name_the_argument(case, tmp_path, untouched):
    kwargs, error, names = BAD_ARGUMENTS[case]
    path = kwargs.pop("path", None) or write(tmp_path / "ckpt")
    message = refused(path, error, names, untouched, **kwargs)
    assert "config.json" not in message or "path" in case


# ---------------------------------------------------------------------------------------------------------------------
# Sizes and names nothing else catches cheaply
def test_a_config_far_larger_than_its_checkpoint_is_refused_before_allocating(tmp_path, untouched):
    """``n_routed_experts: 10**9`` beside the tiny checkpoint: refused from the meta model's size (no weight, no
    list of a billion missing tensors), naming config.json and the largest tensor it would make."""
    path = write(tmp_path / "ckpt", changed(CONFIG, {"n_routed_experts": 10**9, "num_experts_per_tok": 2}))
    message = refused(path, ValueError, [os.path.join(path, "config.json"), "1,568,000,019,696 parameters",
                                         "gate_up_proj", "[1000000000, 32, 32]"], untouched, built_ok=True)
    assert "25,968 values" in message


def test_weights_past_the_devices_memory_are_refused():
    """``from_pretrained`` checks the model it is about to allocate (on the meta device: a rank's shard under
    context parallel) against the memory the device has left. A checkpoint that large cannot be written in a
    test, so the check is called on a meta model whose embedding alone takes twice what the CPU has left."""
    from mla_ops._env import available_memory
    from mla_ops.models import checkpoint

    available = available_memory(torch.device("cpu"))
    assert available, "the test needs to know the memory available"
    vocab = 2 * available // (4 * CONFIG["hidden_size"]) + 1
    with torch.device("meta"):
        huge = mla_ops.MLAForCausalLM(MLAConfig.from_hf(changed(CONFIG, {"vocab_size": vocab})))
    with pytest.raises(ValueError, match=r"device: the model's weights take .* GiB, more than the .* GiB "
                                         r"available on cpu"):
        checkpoint.check_memory(huge, torch.device("cpu"))
    with torch.device("meta"):
        checkpoint.check_memory(mla_ops.MLAForCausalLM(MLAConfig.from_hf(CONFIG)), torch.device("cpu"))


def test_a_nul_byte_in_a_shard_name_names_the_index_the_entry_and_the_shard(tmp_path, untouched):
    path = write(tmp_path / "ckpt", shards=two_shards())
    index = os.path.join(path, checkpoint_files.INDEX)
    with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    entry = next(iter(weight_map))
    bad = "model-00001\x00-of-00002.safetensors"
    write_index(path, {"weight_map": dict(weight_map, **{entry: bad})})
    refused(path, ValueError, [index, f"weight_map[{entry!r}]", repr(bad), "NUL"], untouched)
