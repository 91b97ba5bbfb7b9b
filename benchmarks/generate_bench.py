"""Greedy generation with prefix caching on CPU: tokens/s and cache hit rate, side by side in one run.

A small random DeepSeek-V2-Lite-style model (MoE after one dense layer, YaRN, float32). Workload: a
"system prompt" shared by every request plus a short suffix of its own, N requests, greedy.

* ``no_prefix_cache``: every prompt computed in full;
* ``cold``: prefix caching on, empty cache: the first request computes the shared blocks, the others
  wait one step and reuse them;
* ``warm``: a second call with new suffixes: the shared prefix comes from the cache of the first.

Each configuration runs ``--repeats`` times (fresh ``Generator`` each, interleaved) and reports the
fastest. Writes JSON (and a PNG with matplotlib) under benchmarks/results/.

    python -m benchmarks.generate_bench --json benchmarks/results/generate_bench.json \\
        --plot benchmarks/results/generate_bench.png
"""

from __future__ import annotations

import argparse

import torch

import mla_ops
from benchmarks._lib import plot as plotting
from benchmarks._lib.report import write_json_atomic
from mla_ops.models.config import MLAConfig

CONFIG = dict(
    hidden_size=256, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-6, intermediate_size=512,
    num_hidden_layers=4, vocab_size=1024, max_position_embeddings=8192,
    rope_scaling=dict(type="yarn", factor=4, original_max_position_embeddings=2048, mscale=0.707, mscale_all_dim=0.707),
    n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=128, n_shared_experts=2,
    first_k_dense_replace=1, scoring_func="softmax", topk_method="greedy",
)


def random_model(seed: int = 0) -> mla_ops.MLAForCausalLM:
    torch.manual_seed(seed)
    model = mla_ops.MLAForCausalLM(MLAConfig(**CONFIG)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(std=p.shape[-1] ** -0.5)
    return model


def workload(num_requests: int, prefix_len: int, suffix_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, CONFIG["vocab_size"], (prefix_len,), generator=torch.Generator().manual_seed(0)).tolist()
    return [prefix + torch.randint(0, CONFIG["vocab_size"], (suffix_len,), generator=g).tolist()
            for _ in range(num_requests)]


def measure(model, name: str, args) -> dict:
    generator = mla_ops.Generator(model, block_size=args.block_size, prefix_caching=name != "no_prefix_cache")
    first = workload(args.requests, args.prefix, args.suffix, 1)
    second = workload(args.requests, args.prefix, args.suffix, 2)
    outputs = generator.generate(first, args.new_tokens)
    if name == "warm":
        outputs = generator.generate(second, args.new_tokens)
    s = generator.stats
    return dict(config=name, seconds=s.seconds, steps=s.steps, prompt_tokens=s.prompt_tokens,
                cached_tokens=s.cached_tokens, hit_rate=round(s.hit_rate, 4), generated_tokens=s.generated_tokens,
                tokens_per_s=s.generated_tokens / s.seconds,
                processed_tokens_per_s=(s.prompt_tokens - s.cached_tokens + s.generated_tokens) / s.seconds,
                outputs=outputs)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=512, help="shared prompt tokens")
    parser.add_argument("--suffix", type=int, default=32, help="tokens of each request's own")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steady timings on a shared box)")
    parser.add_argument("--json", default="benchmarks/results/generate_bench.json")
    parser.add_argument("--plot", default="benchmarks/results/generate_bench.png")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = random_model()
    names = ("no_prefix_cache", "cold", "warm")
    best: dict[str, dict] = {}
    measure(model, "cold", args)  # warm-up: first-call costs (allocator, lazy initialisation) out of the way
    for _ in range(args.repeats):
        for name in names:  # interleaved, so load changes hit every configuration alike
            row = measure(model, name, args)
            if name not in best or row["seconds"] < best[name]["seconds"]:
                best[name] = row
    assert best["no_prefix_cache"]["outputs"] == best["cold"]["outputs"], "prefix caching changed the tokens"
    base = best["no_prefix_cache"]["seconds"]
    rows = []
    for name in names:
        row = {k: v for k, v in best[name].items() if k != "outputs"}
        row["speedup_vs_no_prefix_cache"] = round(base / row["seconds"], 3)
        rows.append(row)
        print(row)
    write_json_atomic(args.json, {
        "device": "cpu", "threads": args.threads, "torch": torch.__version__, "model": CONFIG,
        "workload": dict(requests=args.requests, prefix=args.prefix, suffix=args.suffix, new_tokens=args.new_tokens,
                         block_size=args.block_size),
        "rows": rows})
    plt = plotting.pyplot(optional=True)
    if plt is None or not args.plot:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, [r["tokens_per_s"] for r in rows], color=["gray", "tab:blue", "tab:green"])
    for i, r in enumerate(rows):
        ax.text(i, r["tokens_per_s"], f"hit {r['hit_rate']:.0%}", ha="center", va="bottom")
    ax.set_ylim(0, 1.15 * max(r["tokens_per_s"] for r in rows))
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"{args.requests} requests, {args.prefix}-token shared prefix (CPU, {args.threads} thread)")
    plotting.save(fig, args.plot, dpi=110)


if __name__ == "__main__":
    main()
