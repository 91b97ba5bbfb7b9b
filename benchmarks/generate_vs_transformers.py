"""Greedy generation on CPU: ``mla_ops.generate`` against transformers' batched ``generate``.

Random DeepSeek-V2-Lite-style checkpoints (MoE after a dense first layer, YaRN, 2 shared experts,
no q LoRA) written by transformers and loaded by both sides (mla-ops with ``from_pretrained``),
float32, weights at ~1/sqrt(fan_in) so that the greedy tokens are far from ties. Sizes: ``tiny``
(hidden 64, 2 layers) and ``small`` (hidden 256, 4 layers, 16 experts). ``--model deepseek_v32``: the
same sizes as DeepSeek-V3.2 (a q LoRA of hidden / 2, the lightning indexer: 16 heads of 32, top-64),
so the long prompts take the sparse path and the short ones the dense route; ``glm_moe_dsa`` (GLM-5) the
same with every other layer "shared" (reusing its full layer's top-k), ``mistral_large4`` (Mistral Large 4,
no q LoRA, a NoPE layer and a shared layer, its multimodal class with a one-layer vision tower) too. Workloads:

* ``shared_prefix``: 8 prompts sharing 512 tokens, 16 of their own each, 32 new tokens (mla-ops
  computes the shared blocks once and reuses them: prefix caching within the call);
* ``long_prompt``: one 1,024-token prompt, 64 new tokens;
* ``many_short``: 16 prompts of 32 tokens, 32 new tokens each.

transformers runs ``model.generate(do_sample=False)`` on the left-padded batch with its default
attention; mla-ops a fresh ``Generator`` per run (eager). Both produce the same number of tokens;
the tokens are compared (``tokens_equal``). The two sides alternate, ``--repeats`` times each at 1
and 2 threads; the medians' ratio is ``speedup`` (transformers' time over ours).

    python -m benchmarks.generate_vs_transformers --json benchmarks/results/generate_vs_transformers.json \
        --plot benchmarks/results/generate_vs_transformers.png
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import mla_ops
from benchmarks._lib import plot as plotting
from benchmarks._lib.report import write_json_atomic

SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                 n_routed_experts=8),
    "small": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=8, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                  n_routed_experts=16),
}
WORKLOADS = {  # name: (prompts, new tokens)
    "shared_prefix": (lambda g, vocab: _shared(g, vocab, 8, 512, 16), 32),
    "long_prompt": (lambda g, vocab: [_tokens(g, vocab, 1024)], 64),
    "many_short": (lambda g, vocab: [_tokens(g, vocab, 32) for _ in range(16)], 32),
}
VOCAB = 512


def _tokens(g, vocab, n):
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def _shared(g, vocab, count, prefix_len, own):
    prefix = _tokens(g, vocab, prefix_len)
    return [prefix + _tokens(g, vocab, own) for _ in range(count)]


MODELS = ("deepseek_v2", "deepseek_v32", "glm_moe_dsa", "mistral_large4")
INDEXER = dict(index_topk=64, index_n_heads=16, index_head_dim=32)


@torch.no_grad()
def write_checkpoint(size: str, path: str, seed: int = 0, model_type: str = "deepseek_v2"):
    """A random V2-Lite-style transformers model (or its DSA twin of ``model_type``), saved to ``path``; returns
    it (eval, float32)."""
    import transformers

    common = dict(
        **SIZES[size], vocab_size=VOCAB, num_key_value_heads=SIZES[size]["num_attention_heads"],
        n_shared_experts=2, num_experts_per_tok=2, norm_topk_prob=False, routed_scaling_factor=1.0,
        first_k_dense_replace=1, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False,
        pad_token_id=0,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=1024,
                             beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
    )
    layers = SIZES[size]["num_hidden_layers"]
    if model_type == "deepseek_v32":
        config = transformers.DeepseekV32Config(**common, q_lora_rank=SIZES[size]["hidden_size"] // 2, n_group=1,
                                                topk_group=1, **INDEXER)
        model_class = transformers.DeepseekV32ForCausalLM
    elif model_type == "glm_moe_dsa":
        config = transformers.GlmMoeDsaConfig(**common, q_lora_rank=SIZES[size]["hidden_size"] // 2, n_group=1,
                                              topk_group=1, **INDEXER,
                                              indexer_types=["full", "shared"] * (layers // 2))
        model_class = transformers.GlmMoeDsaForCausalLM
    elif model_type == "mistral_large4":
        text = {k: v for k, v in common.items() if k not in ("pad_token_id", "tie_word_embeddings", "rope_parameters")}
        config = transformers.MistralLarge4Config(
            text_config=dict(**text, **INDEXER, rope_parameters=dict(  # its YaRN takes no mscale
                rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=1024, beta_fast=32.0,
                beta_slow=1.0, attention_factor=1.0), no_rope_layers=[1, 0] * (layers // 2),
                indexer_types=["full", "shared"] * (layers // 2)),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                               patch_size=14, image_size=28, head_dim=16), tie_word_embeddings=False)
        config.text_config._experts_implementation = "eager"
        model_class = transformers.MistralLarge4ForConditionalGeneration
    else:
        config = transformers.DeepseekV2Config(**common, q_lora_rank=None, topk_method="greedy")
        model_class = transformers.DeepseekV2ForCausalLM
    if model_type != "deepseek_v2":
        config._experts_implementation = "eager"  # as the tests run transformers' DSA models
    torch.manual_seed(seed)
    model = model_class(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith("rotary_emb.alpha"):  # Mistral Large 4's learned RoPE frequencies: kept as initialized
            continue
        p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5 * 1.5 if p.dim() >= 2 else
                1 + 0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    return model


@torch.no_grad()
def hf_generate(model, prompts, new_tokens):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[:, width:].tolist()


def measure(size: str, repeats: int, threads: tuple[int, ...], model_type: str = "deepseek_v2") -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as path:
        reference = write_checkpoint(size, path, model_type=model_type)
        ours = mla_ops.MLAForCausalLM.from_pretrained(path).eval()
        for name, (make, new_tokens) in WORKLOADS.items():
            prompts = make(torch.Generator().manual_seed(7), VOCAB)
            for n in threads:
                torch.set_num_threads(n)
                times = {"mla_ops": [], "transformers": []}
                outputs = {}
                for _ in range(repeats):
                    for side in times:
                        start = time.perf_counter()
                        if side == "mla_ops":
                            outputs[side] = mla_ops.Generator(ours, block_size=16).generate(prompts, new_tokens)
                        else:
                            outputs[side] = hf_generate(reference, prompts, new_tokens)
                        times[side].append(time.perf_counter() - start)
                tokens = len(prompts) * new_tokens
                median = {side: statistics.median(t) for side, t in times.items()}
                rows.append(dict(
                    model=model_type, size=size, workload=name, threads=n, prompts=len(prompts), new_tokens=new_tokens,
                    prompt_tokens=sum(map(len, prompts)),
                    tokens_per_s={side: round(tokens / t, 1) for side, t in median.items()},
                    speedup=round(median["transformers"] / median["mla_ops"], 2),
                    tokens_equal=outputs["mla_ops"] == outputs["transformers"],
                    differing_sequences=sum(a != b for a, b in zip(outputs["mla_ops"], outputs["transformers"])),
                ))
                print(rows[-1], flush=True)
    return rows


def plot(result: dict, path: str) -> None:
    plt = plotting.pyplot()
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [f"{r.get('model', 'deepseek_v2')}\n{r['size']}\n{r['workload']}\n{r['threads']}t" for r in rows]
    ax.bar(range(len(rows)), [r["speedup"] for r in rows])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("speedup over transformers (time ratio)")
    ax.set_title("greedy generate on CPU: mla-ops vs transformers")
    plotting.save(fig, path)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.generate_vs_transformers",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["deepseek_v2"])
    args = parser.parse_args(argv)
    rows = [row for model_type in args.models for size in args.sizes
            for row in measure(size, args.repeats, tuple(args.threads), model_type)]
    result = dict(benchmark="generate_vs_transformers", torch=torch.__version__, rows=rows)
    if args.json:
        write_json_atomic(args.json, result)
    if args.plot:
        plot(result, args.plot)
    return result


if __name__ == "__main__":
    main()
