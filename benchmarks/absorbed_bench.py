"""Absorbed (MQA over the latent cache) versus chunked MHA context attention: where is the break-even?

A sweep over query length x context length (B identical requests each, DeepSeek-V2-Lite dims,
bf16): the context partial by the chunked MHA pipeline (gather, up-project, attend; packed
schedule) and by the absorbed op (Triton, and FlashMLA where ``flash_mla`` imports), side by side
in one run. The suggested ``absorb_max_query_len`` is the largest query length at which the
absorbed path is faster for every context length of the sweep; ``mla_ops.routing`` takes it as
``MEASURED_ABSORB_MAX_QUERY_LEN`` once measured.

    python benchmarks/absorbed_bench.py --json benchmarks/results/gpu_absorbed.json --plot ...png
    python benchmarks/absorbed_bench.py --smoke      # tiny sizes on any device
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mla_ops  # noqa: E402
from benchmarks.kernel_bench import HEADS, LATENT, NOPE, ROPE, VALUE, context_pipeline, full_batch_chunks  # noqa: E402
from benchmarks.kernel_bench import make_inputs, timed, write_report  # noqa: E402

WORKSPACE = 65536


def absorbed_runners(device):
    """name -> fn(x, context_lens_tensor, out, lse) for each absorbed implementation available."""
    runners = {}

    def op(x, lens, out, lse):
        torch.ops.mla_ops.absorbed_context_attention(x["q"], x["kv_cache"], x["block_table"], x["query_start_loc"],
                                                     lens, x["weight"], NOPE ** -0.5, None, out, lse)

    runners["absorbed_triton" if device.type == "cuda" else "absorbed_torch"] = op
    if device.type == "cuda":
        from mla_ops import flashmla

        ok, reason = flashmla.available()
        if ok:
            def fm(x, lens, out, lse):
                flashmla.absorbed_context_attention(x["q"], x["kv_cache"], x["block_table"], x["query_start_loc"],
                                                    lens, x["weight"], NOPE ** -0.5, None, out, lse)
            runners["absorbed_flashmla"] = fm
        else:
            print(f"FlashMLA not measured: {reason}", flush=True)
    return runners


def run(args) -> dict:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.set_grad_enabled(False)
    if args.smoke:
        query_lens_sweep, context_sweep, batch = [1, 8, 32], [64, 256], 2
    else:
        query_lens_sweep, context_sweep, batch = [1, 16, 64, 128, 192, 256, 384, 512], [1024, 8192, 32768], 8
    runners = absorbed_runners(device)
    rows = []
    for c in context_sweep:
        for q in query_lens_sweep:
            context_lens, query_lens = [c] * batch, [q] * batch
            x = make_inputs(context_lens, query_lens, device, dtype)
            lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
            starts, cu = (torch.as_tensor(a, dtype=torch.int32, device=device)
                          for a in full_batch_chunks(context_lens, query_lens, WORKSPACE, "packed"))
            row = dict(context_len=c, query_len=q, requests=batch,
                       mha_ms=timed(lambda: context_pipeline(x, starts, cu, WORKSPACE), device, args.reps))
            out = x["q"].new_empty(sum(query_lens), HEADS, VALUE)
            lse = torch.empty(HEADS, sum(query_lens), device=device)
            for name, fn in runners.items():
                row[f"{name}_ms"] = timed(lambda: fn(x, lens, out, lse), device, args.reps)
            rows.append(row)
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
            del x
    absorbed_names = [f"{n}_ms" for n in runners]

    def absorbed_wins(q):
        return all(min(r[n] for n in absorbed_names) < r["mha_ms"] for r in rows if r["query_len"] == q)

    winners = [q for q in query_lens_sweep if absorbed_wins(q)]
    # The largest query length below which the absorbed path wins at every context length.
    suggested = 0
    for q in query_lens_sweep:
        if q not in winners:
            break
        suggested = q
    return dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                dtype=str(dtype), dims=dict(N=HEADS, L=LATENT, P=NOPE, R=ROPE, V=VALUE), workspace_size=WORKSPACE,
                cost_model_threshold=mla_ops.routing.cost_model_threshold(LATENT, NOPE, ROPE, VALUE),
                suggested_absorb_max_query_len=suggested, results=rows)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context_len"] for r in report["results"]})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
    for ax, c in zip(axes[0], contexts):
        rows = [r for r in report["results"] if r["context_len"] == c]
        qs = [r["query_len"] for r in rows]
        for key in [k for k in rows[0] if k.endswith("_ms")]:
            ax.plot(qs, [r[key] for r in rows], marker="o", label=key[:-3])
        ax.axvline(report["cost_model_threshold"], color="gray", ls="--", label="cost model")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("query tokens per request")
        ax.set_ylabel("context partial, ms")
        ax.set_title(f"{rows[0]['requests']} requests x {c} context tokens")
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['device']}: absorbed vs chunked MHA; suggested absorb_max_query_len = "
                 f"{report['suggested_absorb_max_query_len']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    report = run(args)
    print("suggested absorb_max_query_len:", report["suggested_absorb_max_query_len"],
          "(cost model:", report["cost_model_threshold"], ")")
    write_report(report, args.json, plot, args.plot)


if __name__ == "__main__":
    main()
