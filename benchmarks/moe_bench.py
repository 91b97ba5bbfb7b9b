"""MoE expert compute on CPU: dense (every expert on every token) vs sorted + grouped GEMM.

Side by side in one run, per (experts E, top-k, hidden H, expert width I, tokens T, dtype):

* ``dense``: ``Experts.dense``: one batched matmul over all E experts, combine weights mostly 0;
* ``masked``: a static loop over the E experts, each on all tokens times its combine column (the
  "per-expert masked" form: same FLOPs as dense, E small GEMMs, less memory);
* ``grouped``: ``Experts.grouped``: pairs sorted by expert, ``torch._grouped_mm`` (useful FLOPs only);
* ``host_loop``: transformers' form (only the hit experts, found with a host read): not compilable,
  the baseline.

Writes JSON (and a PNG when matplotlib is there) under benchmarks/results/. Eager timings; the
compiled forms run the same kernels (Inductor keeps the matmuls as library calls).

    python -m benchmarks.moe_bench --json benchmarks/results/moe_bench.json --plot benchmarks/results/moe_bench.png
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks._lib import plot as plotting
from benchmarks._lib.report import write_json_atomic
from benchmarks._lib.timing import median_ms
from mla_ops.models.config import MLAConfig
from mla_ops.models.moe import MoE

CASES = [  # E, k, H, I
    (8, 2, 64, 32),  # the tests' tiny models
    (64, 6, 256, 64),  # DeepSeek-V2-Lite's routing (64 experts, top-6), narrow
    (256, 8, 256, 32),  # DeepSeek-V3's routing (256 experts, top-8), narrow
]
TOKENS = (1, 16, 256)


def masked(experts, x, weights, indices):
    combine = x.new_zeros(x.shape[0], experts.gate_up_proj.shape[0]).scatter_(1, indices, weights.to(x.dtype))
    out = torch.zeros_like(x)
    for e in range(experts.gate_up_proj.shape[0]):
        h = F.linear(x, experts.gate_up_proj[e])
        out += F.linear(experts._act(h), experts.down_proj[e]) * combine[:, e : e + 1]
    return out


def host_loop(experts, x, weights, indices):
    out = torch.zeros_like(x)
    for e in indices.unique().tolist():  # host read of the routing
        token, slot = torch.where(indices == e)
        h = F.linear(x[token], experts.gate_up_proj[e])
        y = F.linear(experts._act(h), experts.down_proj[e])
        out.index_add_(0, token, y * weights[token, slot, None].to(x.dtype))
    return out


def run(repeats: int) -> list[dict]:
    rows = []
    for E, k, H, I in CASES:
        config = MLAConfig(hidden_size=H, num_attention_heads=1, q_lora_rank=None, kv_lora_rank=8,
                           qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, rope_theta=1e4, rms_norm_eps=1e-6,
                           intermediate_size=I, num_hidden_layers=1, vocab_size=8, n_routed_experts=E,
                           num_experts_per_tok=k, moe_intermediate_size=I, initializer_range=H**-0.5)
        moe = MoE(config).eval()
        for dtype in (torch.float32, torch.bfloat16):
            experts = moe.experts.to(dtype)
            for T in TOKENS:
                x = torch.randn(T, H, dtype=dtype)
                with torch.no_grad():
                    weights, indices = moe.gate(x)
                    forms = {
                        "dense": lambda: experts.dense(x, weights, indices),
                        "masked": lambda: masked(experts, x, weights, indices),
                        "grouped": lambda: experts.grouped(x, weights, indices),
                        "host_loop": lambda: host_loop(experts, x, weights, indices),
                    }
                    ref = forms["host_loop"]().float()
                    row = dict(experts=E, top_k=k, hidden=H, inter=I, tokens=T, dtype=str(dtype).removeprefix("torch."))
                    for name, fn in forms.items():
                        err = (fn().float() - ref).abs().max().item()
                        row[f"{name}_ms"] = round(median_ms(fn, reps=repeats, warmup=1), 4)  # wall time
                        row[f"{name}_max_err"] = err
                rows.append(row)
                print(row)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steady timings on a shared box)")
    parser.add_argument("--json", default="benchmarks/results/moe_bench.json")
    parser.add_argument("--plot", default="benchmarks/results/moe_bench.png")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.repeats)
    write_json_atomic(args.json, {"device": "cpu", "threads": args.threads, "torch": torch.__version__, "rows": rows})
    plt = plotting.pyplot(optional=True)
    if plt is None or not args.plot:
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, dtype in zip(axes, ("float32", "bfloat16")):
        picked = [r for r in rows if r["dtype"] == dtype]
        labels = [f"E{r['experts']}k{r['top_k']}\nT{r['tokens']}" for r in picked]
        for i, name in enumerate(("dense", "masked", "grouped")):
            ax.bar([j + 0.27 * i for j in range(len(picked))], [r[f"{name}_ms"] / r["host_loop_ms"] for r in picked],
                   width=0.27, label=name)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.27 for j in range(len(picked))], labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_title(f"{dtype}: time / host-loop time (CPU)")
    axes[0].legend()
    plotting.save(fig, args.plot, dpi=110)


if __name__ == "__main__":
    main()
