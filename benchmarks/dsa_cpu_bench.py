"""CPU time of one DeepSeek Sparse Attention layer: mla-ops' ops against transformers' DeepSeek-V3.2 attention.

transformers' ``DeepseekV32Attention`` (eager, float32; the version installed, recorded in the JSON) runs a prompt
of S tokens: its indexer scores every (query, key) pair at once, takes a top-k over all S keys per query, folds the
selection into an [S, S] mask and runs MHA over every up-projected key. mla-ops runs the same module's projections
(its own ``nn.Linear`` and norm modules, transformers' RoPE functions) and then its ops: ``plan_prefill(index_topk=K)``,
``index_topk`` (the indexer's chunks, a running top-k) and ``run_prefill(topk_indices=)`` (the sparse request on the
route the cost model picks, ``masked_mha_ratio``: top-k-masked MHA, or absorbed MQA over each query's K selected
latent rows). Both sides produce the attention output; the largest difference is reported beside the times (the
selection is a discrete choice, so a near-tie in the float32 scores may pick another key: ``topk_equal`` says how
many queries selected the same set).

Dims: DeepSeek-V3.2's heads and widths (L = 512, P = 128, R = 64, V = 128, D_I = 128), fewer heads (N = H_I = 16)
and a smaller hidden size (1024) and K_I (256), so a CPU runs it; ``--smoke``: tiny dims. Times: the fastest of
``--reps`` interleaved runs, 2 threads; ``speedup`` is transformers' time over ours. The 1-minute load average is
recorded per row (a shared machine slows both sides, but not equally: every op waits for both threads).

    python -m benchmarks.dsa_cpu_bench --json benchmarks/results/dsa_cpu_bench.json --plot benchmarks/results/dsa_cpu_bench.png
"""

from __future__ import annotations

import math
import os

import torch

import mla_ops
from benchmarks._lib import cli
from benchmarks._lib import plot as plotting
from benchmarks._lib.report import Report
from benchmarks._lib.timing import best_of_interleaved_s, thread_time_samples

DIMS = dict(hidden_size=1024, num_attention_heads=16, q_lora_rank=384, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, index_n_heads=16, index_head_dim=128, index_topk=256)
SMOKE_DIMS = dict(hidden_size=64, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                  qk_rope_head_dim=8, v_head_dim=16, index_n_heads=2, index_head_dim=16, index_topk=16)
PROMPTS, SMOKE_PROMPTS = (512, 1024, 2048, 4096), (48,)


def attention_module(dims: dict, seed: int):
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf

    config = DeepseekV32Config(**dims, num_hidden_layers=1, num_key_value_heads=dims["num_attention_heads"],
                               vocab_size=32, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
                               max_position_embeddings=8192, rope_parameters=dict(rope_type="default",
                                                                                  rope_theta=10000.0))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    attention = hf.DeepseekV32Attention(config, layer_idx=0).eval()
    for p in attention.parameters():  # weights at ~1/sqrt(fan_in): well-conditioned scores
        torch.nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[-1])) if p.dim() == 2 else torch.nn.init.ones_(p)
    return config, attention, hf.DeepseekV32RotaryEmbedding(config), hf


def causal_mask(s: int) -> torch.Tensor:
    """[1, 1, S, S] additive float mask, as transformers' eager attention takes it."""
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    return torch.zeros(s, s).masked_fill(~allowed, torch.finfo(torch.float32).min).view(1, 1, s, s)


def transformers_forward(attention, rotary, x):
    positions = torch.arange(x.shape[1]).unsqueeze(0)
    return attention(x, rotary(x, positions), causal_mask(x.shape[1]), position_ids=positions)[0][0]


def mla_ops_forward(attention, rotary, hf, x, block_size: int = 64):
    """The module's projections, then the ops: [S, hidden] -> [S, hidden], and the top-k it used."""
    s, n = x.shape[1], attention.num_heads
    nope, rope, latent = attention.qk_nope_head_dim, attention.qk_rope_head_dim, attention.kv_lora_rank
    indexer = attention.indexer
    cos, sin = rotary(x, torch.arange(s).unsqueeze(0))
    h = x[0]
    q_resid = attention.q_a_layernorm(attention.q_a_proj(h))
    q = attention.q_b_proj(q_resid).view(s, n, nope + rope)
    kv_c, k_pe = attention.kv_a_proj_with_mqa(h).split([latent, rope], -1)
    kv_c = attention.kv_a_layernorm(kv_c)
    q_pe, k_pe = hf.apply_rotary_pos_emb_interleave(q[..., nope:].transpose(0, 1).unsqueeze(0),
                                                    k_pe.view(1, 1, s, rope), cos, sin)
    q = torch.cat([q[..., :nope], q_pe[0].transpose(0, 1)], -1)
    k_pe = k_pe.view(s, rope)
    q_index = indexer.wq_b(q_resid).view(s, indexer.n_heads, indexer.head_dim)
    k_index = indexer.k_norm(indexer.wk(h))
    q_rot, k_rot = hf.apply_rotary_pos_emb(q_index[..., :rope].unsqueeze(0), k_index[:, :rope].view(1, s, 1, rope),
                                           cos, sin, unsqueeze_dim=2)
    q_index = torch.cat([q_rot[0], q_index[..., rope:]], -1)
    k_index = torch.cat([k_rot.view(s, rope), k_index[:, rope:]], -1)
    weights = indexer.weights_proj(h) * (indexer.n_heads ** -0.5 * indexer.softmax_scale)  # relu(a x) = a relu(x)
    blocks = -(-s // block_size)
    table = torch.arange(blocks, dtype=torch.int32).view(1, blocks)
    plan = mla_ops.plan_prefill(torch.tensor([0, s], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), table,
                                block_size=block_size, index_topk=indexer.index_topk)
    kv_cache = x.new_empty(blocks, block_size, latent + rope)  # no context: never read
    index_cache = x.new_empty(blocks, block_size, indexer.head_dim)
    topk = mla_ops.index_topk(q_index, weights, k_index, index_cache, plan)
    out = mla_ops.run_prefill(q, kv_c, k_pe, kv_cache, attention.kv_b_proj.weight, attention.scaling, plan,
                              topk_indices=topk)
    return attention.o_proj(out.reshape(s, -1)), topk


def transformers_topk(attention, rotary, x):
    """The indices transformers' indexer selects (its forward recomputed on its own)."""
    s = x.shape[1]
    positions = torch.arange(s).unsqueeze(0)
    q_resid = attention.q_a_layernorm(attention.q_a_proj(x))
    return attention.indexer(x, q_resid, rotary(x, positions), causal_mask(s)[:, 0], positions)[0]


@torch.no_grad()
def main(argv=None):
    parser = cli.parser(__doc__)
    cli.add_common_args(parser, reps=5, device="cpu")
    parser.add_argument("--thread-time", action="store_true",
                        help="1 thread, its CPU time (fastest sample per side): the work done, whatever else runs on "
                             "a shared machine (the default: 2 threads, wall time)")
    args = cli.parse_args(parser, argv, "dsa_cpu_bench.json")
    dims, prompts = (SMOKE_DIMS, SMOKE_PROMPTS) if args.smoke else (DIMS, PROMPTS)
    threads = 1 if args.thread_time else 2
    torch.set_num_threads(threads)
    config, attention, rotary, hf = attention_module(dims, seed=0)
    report = Report(args.json, dict(benchmark="dsa_cpu_bench", dims=dims, threads=threads, dtype="float32",
                                    clock="thread CPU time" if args.thread_time else "wall",
                                    transformers=__import__("transformers").__version__,
                                    cpus=os.cpu_count(), load_average_at_start=os.getloadavg()), args.dry_run)
    for s in prompts:
        x = torch.randn(1, s, dims["hidden_size"], generator=torch.Generator().manual_seed(s))
        ours, topk = mla_ops_forward(attention, rotary, hf, x)
        theirs = transformers_forward(attention, rotary, x)
        reference = transformers_topk(attention, rotary, x)
        # transformers' top-k of an early query also holds masked (future) positions: compare the causal ones
        same = sum(set(a[a >= 0].tolist()) == set(b[b <= t].tolist()) for t, (a, b) in enumerate(zip(topk, reference)))
        sides = {"mla_ops": lambda: mla_ops_forward(attention, rotary, hf, x),
                 "transformers": lambda: transformers_forward(attention, rotary, x)}
        if args.thread_time:
            samples, _ = thread_time_samples(sides, args.reps, sample_ns=0, max_calls=1)
            best = {name: min(times) * 1e-9 for name, times in samples.items()}
        else:
            best = best_of_interleaved_s(sides, args.reps)
        row = dict(prompt=s, mla_ops_ms=best["mla_ops"] * 1e3, transformers_ms=best["transformers"] * 1e3,
                   speedup=best["transformers"] / best["mla_ops"], topk_equal=f"{same} / {s}",
                   max_abs_diff=float((ours - theirs).abs().max()), max_abs_out=float(theirs.abs().max()),
                   load_average=os.getloadavg()[0])  # the machine is shared: other processes' load, 1 minute
        report.add(row)
        print(f"S={s:5d}: mla-ops {row['mla_ops_ms']:8.1f} ms  transformers {row['transformers_ms']:8.1f} ms  "
              f"speedup {row['speedup']:.2f}x  top-k equal {row['topk_equal']}  max |diff| {row['max_abs_diff']:.2e} "
              f"(of {row['max_abs_out']:.2e})", flush=True)
    report.finish()
    if args.plot:
        plot(report.results, args.plot, "1 thread, CPU time" if args.thread_time else "2 threads")


def plot(rows: list[dict], path: str, unit: str = "2 threads") -> None:
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    prompts = [r["prompt"] for r in rows]
    for key, label in (("mla_ops_ms", "mla-ops ops"), ("transformers_ms", "transformers (eager)")):
        ax.plot(prompts, [r[key] for r in rows], marker="o", label=label)
    ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel=f"ms per layer (CPU, {unit})",
           title="DSA attention layer on CPU")
    ax.set_xticks(prompts, [str(p) for p in prompts])
    ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
    ax.legend()
    plotting.save(fig, path)


if __name__ == "__main__":
    main()
