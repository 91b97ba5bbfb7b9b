"""What one DeepSeek Sparse Attention (DSA) prefill step costs per layer against dense MLA: a FLOP and
byte model (DESIGN §1 and §12), computed from the dims; nothing here is measured.

One request of ``c`` cached context tokens and ``q`` new tokens at positions ``c .. c+q-1``; query
``j`` sees the ``c + j + 1`` keys up to itself. Dims: DeepSeek-V3.2 (N=128, L=512, P=128, R=64, V=128;
indexer H_I=64 heads of D_I=128, K_I=2048 keys selected per query).

* **indexer**: scores ``sum_h w[t,h] * relu(q_I[t,h] . k_I[s])`` for every (query, candidate key):
  2*H_I*D_I FLOPs (the dot products) + 2*H_I (weights and sum) per pair. Bytes: the index queries and
  weights, the index key rows read once per index chunk (the plan's schedule: key rows in row chunks
  of W, each scored by the queries that see it, M = budget // W tokens at a time, every piece reading
  its rows again), the top-k indices written; and, apart (``logits_bytes``), the float32 scores of each
  chunk written and read back by a top-k that runs after them (vLLM's ``fp8_mqa_logits`` + top-k: the
  whole tile, causally masked part included); a fused score + top-k kernel moves none of them.
* **sparse attention**: absorbed MQA (FlashMLA's sparse prefill) over the ``min(K_I, c+j+1)`` selected
  keys of each query: 2*(2L+R) FLOPs per (query, key, head), plus the fold of W_UK into the query and
  the unfold of W_UV from the output (2*L*(P+V) per token and head). Bytes: every selected latent row
  read by index, once per query (no reuse between queries: an upper bound), queries, indices, outputs.
* **dense MLA** over the whole context (what the request costs without DSA): the MHA path (up-project
  the c + q latent rows, 2*L*(P+V) per row and head, attend at 2*(P+R+V) per pair and head; bytes: cache
  rows, the workspace written and read, K/V written and read) and the absorbed path (2*(2L+R) per pair
  and head over every candidate, fold and unfold; bytes: every latent row once); ``dense_routed`` is the
  cheaper in FLOPs, as the plan's routing picks.

Requests with ``c + q <= K_I`` select every key: the plan routes them to the dense paths and they skip
the indexer (``short_requests``); vLLM runs the indexer and the sparse kernel for every prefill of a DSA
batch, so its cost for them is indexer + sparse attention over all candidates. Bytes assume the caches'
layout ``--cache-bytes``: an element size (1: float8_e4m3fn with a per-tensor scale, 576-byte latent and
128-byte index rows; 2: bf16), or ``vllm``: vLLM's packed production formats (DESIGN §12), a 656-byte
``fp8_ds_mla`` latent row (512 fp8 + 4 float32 scales + 64 bf16 rope values) and a 132-byte
``fp8_per_token`` index row (128 fp8 + one float32 scale); ``cache_formats`` in the JSON lists every
layout's bytes per token. Activations and workspace are bf16, scores float32; bytes count DRAM traffic,
not cache hits.

    python -m benchmarks.dsa_cost --json benchmarks/results/dsa_cost.json --plot benchmarks/results/dsa_cost.png
"""

from __future__ import annotations

import argparse
from typing import NamedTuple, Sequence

from benchmarks._lib import plot as plotting
from benchmarks._lib.batches import V3, Dims
from benchmarks._lib.report import write_json_atomic

CONTEXTS = (8192, 16384, 32768, 65536, 131072)
QUERIES = (1024, 8192)
SHORT = ((0, 2048), (1024, 1024), (1536, 512), (1920, 128), (2032, 16))  # c + q <= K_I
ACT_BYTES = 2  # bf16 activations, queries, outputs, workspace, K/V
SCORE_BYTES = 4  # float32 scores
INDEX_BYTES = 4  # int32 top-k entries


class Indexer(NamedTuple):
    """DSA's lightning indexer: H_I heads of width D_I, K_I keys kept per query (DeepSeek-V3.2's)."""

    heads: int = 64
    dim: int = 128
    topk: int = 2048


V32_INDEXER = Indexer()


CACHE_LAYOUTS = (1, 2, "vllm")  # --cache-bytes: element sizes, or vLLM's packed formats


def latent_row_bytes(d: Dims, cache_bytes: int | str) -> int:
    """Bytes of one latent cache row: (L+R) elements, or fp8_ds_mla's L fp8 + L/128 float32 scales + R bf16."""
    if cache_bytes == "vllm":
        return d.latent + 4 * (d.latent // 128) + 2 * d.rope
    return (d.latent + d.rope) * cache_bytes


def index_row_bytes(ix: Indexer, cache_bytes: int | str) -> int:
    """Bytes of one index cache row: D_I elements, or fp8_per_token's D_I fp8 + a float32 scale per 128 values."""
    return ix.dim + ix.dim // 128 * 4 if cache_bytes == "vllm" else ix.dim * cache_bytes


def cache_formats(d: Dims, ix: Indexer) -> dict:
    """Every cache layout's bytes per token and layer (latent, index), and vLLM's over per-tensor fp8."""
    layouts = {"bf16": 2, "fp8 (per-tensor k_scale)": 1, "vllm (fp8_ds_mla + fp8_per_token)": "vllm"}
    out = {name: dict(latent=latent_row_bytes(d, b), index=index_row_bytes(ix, b)) for name, b in layouts.items()}
    fp8, vllm = out["fp8 (per-tensor k_scale)"], out["vllm (fp8_ds_mla + fp8_per_token)"]
    out["vllm_over_per_tensor_fp8"] = dict(latent=round(vllm["latent"] / fp8["latent"], 4),
                                           index=round(vllm["index"] / fp8["index"], 4))
    return out


def candidate_pairs(c: int, q: int) -> int:
    """(query, key) pairs with the key at or before the query: sum over j < q of c + j + 1."""
    return q * c + q * (q + 1) // 2


def selected_pairs(c: int, q: int, k: int) -> int:
    """Sum over j < q of min(k, c + j + 1): the keys the sparse attention reads."""
    below = min(q, max(0, k - c))  # queries 0 .. below - 1 have at most k candidates: all selected
    return candidate_pairs(c, below) + (q - below) * k


def index_pieces(c: int, q: int, rows: int, tokens: int) -> list[tuple[int, int, int]]:
    """Per row chunk of the request's c + q keys: (rows, queries that see one of them, pieces of at most
    ``tokens`` queries) -- the plan's index chunks for a lone request, causal skip included."""
    out = []
    for start in range(0, c + q, rows):
        n = min(rows, c + q - start)
        seeing = q - max(0, start - c)  # query j sees position start once c + j >= start
        out.append((n, seeing, -(-seeing // tokens)))
    return out


def indexer_cost(c: int, q: int, ix: Indexer, rows: int, tokens: int, cache_bytes: int | str) -> dict:
    pairs = candidate_pairs(c, q)
    chunks = index_pieces(c, q, rows, tokens)
    key_bytes = sum(n * pieces for n, _, pieces in chunks) * index_row_bytes(ix, cache_bytes)
    query_bytes = q * ix.heads * (ix.dim * ACT_BYTES + 4)  # q_I and float32 weights
    topk_bytes = q * ix.topk * INDEX_BYTES
    logits_bytes = 2 * SCORE_BYTES * sum(n * seeing for n, seeing, _ in chunks)  # written, read by top-k
    return dict(flops=pairs * (2 * ix.heads * ix.dim + 2 * ix.heads), bytes=key_bytes + query_bytes + topk_bytes,
                key_bytes=key_bytes, logits_bytes=logits_bytes, pairs=pairs,
                index_chunks=sum(p for _, _, p in chunks))


def fold_flops(q: int, d: Dims) -> int:
    """W_UK folded into the queries and W_UV unfolded from the outputs: 2*L*(P+V) per token and head."""
    return q * d.heads * 2 * d.latent * (d.nope + d.value)


def absorbed_cost(c: int, q: int, pairs: int, d: Dims, cache_bytes: int | str, *, by_index: bool, topk: int) -> dict:
    """Absorbed MQA over ``pairs`` (query, key) pairs; rows read per pair (by index) or once each."""
    row = latent_row_bytes(d, cache_bytes)
    rows_read = pairs if by_index else c + q
    token_bytes = q * d.heads * ((d.latent + d.rope) + d.latent) * ACT_BYTES  # absorbed queries, latent outputs
    index_bytes = q * topk * INDEX_BYTES if by_index else 0
    return dict(flops=pairs * d.heads * 2 * (2 * d.latent + d.rope) + fold_flops(q, d),
                bytes=rows_read * row + token_bytes + index_bytes, pairs=pairs)


def mha_cost(c: int, q: int, d: Dims, cache_bytes: int | str) -> dict:
    """The chunk loop and suffix attention: up-project the c + q latent rows, attend every candidate."""
    pairs = candidate_pairs(c, q)
    flops = (c + q) * d.heads * 2 * d.latent * (d.nope + d.value) + pairs * d.heads * 2 * (d.nope + d.rope + d.value)
    row = d.latent + d.rope
    bytes_ = (c * latent_row_bytes(d, cache_bytes) + 2 * c * row * ACT_BYTES  # cache rows; workspace written, read
              + 2 * (c + q) * d.heads * (d.nope + d.value) * ACT_BYTES  # K/V written, read
              + q * d.heads * (d.nope + d.rope + 2 * d.value) * ACT_BYTES)  # queries, partial, output
    return dict(flops=flops, bytes=bytes_, pairs=pairs)


def request_cost(c: int, q: int, d: Dims, ix: Indexer, rows: int, tokens: int, cache_bytes: int | str) -> dict:
    """Every path's cost for one request (module doc)."""
    indexer = indexer_cost(c, q, ix, rows, tokens, cache_bytes)
    sparse = absorbed_cost(c, q, selected_pairs(c, q, ix.topk), d, cache_bytes, by_index=True, topk=ix.topk)
    dsa = dict(flops=indexer["flops"] + sparse["flops"], bytes=indexer["bytes"] + sparse["bytes"],
               bytes_with_logits=indexer["bytes"] + indexer["logits_bytes"] + sparse["bytes"])
    mha = mha_cost(c, q, d, cache_bytes)
    absorbed = absorbed_cost(c, q, candidate_pairs(c, q), d, cache_bytes, by_index=False, topk=0)
    routed = "mha" if mha["flops"] <= absorbed["flops"] else "absorbed"
    best = mha if routed == "mha" else absorbed
    return dict(context=c, query=q, indexer=indexer, sparse_attention=sparse, dsa=dsa, dense_mha=mha,
                dense_absorbed=absorbed, dense_routed=routed,
                dsa_over_dense_flops=round(dsa["flops"] / best["flops"], 4),
                dsa_over_dense_bytes=round(dsa["bytes"] / best["bytes"], 4),
                indexer_share_of_dsa_flops=round(indexer["flops"] / dsa["flops"], 4),
                indexer_share_of_dsa_bytes=round(indexer["bytes"] / dsa["bytes"], 4))


def short_request_saving(c: int, q: int, d: Dims, ix: Indexer, rows: int, tokens: int, cache_bytes: int | str) -> dict:
    """A request with c + q <= K_I: the DSA path as vLLM runs it (indexer + sparse attention over every
    candidate) against the plan's dense route (no indexer, the cheaper dense path)."""
    if c + q > ix.topk:
        raise ValueError(f"a short request has c + q <= K_I = {ix.topk}, got c={c}, q={q}")
    cost = request_cost(c, q, d, ix, rows, tokens, cache_bytes)
    best = cost["dense_mha"] if cost["dense_routed"] == "mha" else cost["dense_absorbed"]
    dsa = cost["dsa"]
    return dict(context=c, query=q, dsa_flops=dsa["flops"], dsa_bytes=dsa["bytes"],
                dsa_bytes_with_logits=dsa["bytes_with_logits"], indexer_flops=cost["indexer"]["flops"],
                indexer_bytes=cost["indexer"]["bytes"], dense_routed=cost["dense_routed"],
                dense_flops=best["flops"], dense_bytes=best["bytes"],
                flops_saved=round(1 - best["flops"] / dsa["flops"], 4),
                flops_saved_by_skipping_the_indexer=round(cost["indexer"]["flops"] / dsa["flops"], 4),
                bytes_saved=round(1 - best["bytes"] / dsa["bytes"], 4),
                bytes_saved_with_logits=round(1 - best["bytes"] / dsa["bytes_with_logits"], 4))


def model(contexts: Sequence[int], queries: Sequence[int], short: Sequence[tuple[int, int]], *, dims: Dims = V3,
          indexer: Indexer = V32_INDEXER, workspace_size: int = 65536, scores_budget: int = 1 << 26,
          cache_bytes: int | str = 1) -> dict:
    """The JSON-ready result (module doc)."""
    tokens = max(1, scores_budget // workspace_size)
    rows = [request_cost(c, q, dims, indexer, workspace_size, tokens, cache_bytes) for q in queries for c in contexts]
    return {
        "benchmark": "dsa_cost",
        "kind": "model: FLOPs and bytes computed from the dims (DESIGN §1, §12); nothing measured",
        "dims": dict(dims.header(), H_I=indexer.heads, D_I=indexer.dim, K_I=indexer.topk),
        "bytes_per_element": dict(caches=cache_bytes, activations=ACT_BYTES, scores=SCORE_BYTES, indices=INDEX_BYTES),
        "cache_row_bytes": dict(latent=latent_row_bytes(dims, cache_bytes), index=index_row_bytes(indexer, cache_bytes)),
        "cache_formats": cache_formats(dims, indexer),
        "index_chunks": dict(workspace_size=workspace_size, scores_budget=scores_budget, tokens_per_chunk=tokens),
        "per": "one request, one layer",
        "rows": rows,
        "short_requests": [short_request_saving(c, q, dims, indexer, workspace_size, tokens, cache_bytes)
                           for c, q in short],
    }


def plot(result: dict, path: str) -> None:
    """FLOPs and bytes against the context, per query length; the short requests' saving."""
    plt = plotting.pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2))
    queries = sorted({r["query"] for r in result["rows"]})
    series = (("indexer", "indexer", "tab:orange"), ("sparse_attention", "sparse attention", "tab:blue"),
              ("dsa", "DSA total", "black"), ("dense_mha", "dense MHA", "tab:red"),
              ("dense_absorbed", "dense absorbed", "tab:purple"))
    for ax, kind in zip(axes[:2], ("flops", "bytes")):
        for q, style in zip(queries, ("-", "--", ":")):
            rows = [r for r in result["rows"] if r["query"] == q]
            x = [r["context"] for r in rows]
            for key, label, color in series:
                ax.plot(x, [r[key][kind] for r in rows], style, color=color, marker="o", ms=3,
                        label=f"{label}, q = {q:,}")
            if kind == "bytes":
                ax.plot(x, [r["indexer"]["logits_bytes"] for r in rows], style, color="tab:gray", marker="x",
                        ms=4, label=f"indexer scores (materialized), q = {q:,}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context tokens c")
        ax.set_ylabel("FLOPs per layer" if kind == "flops" else "bytes per layer (DRAM)")
        ax.set_title(f"{'FLOPs' if kind == 'flops' else 'Bytes'}: DSA (K_I = {result['dims']['K_I']:,}) vs dense MLA")
        ax.grid(alpha=0.3, which="both")
        if kind == "flops":
            ax.legend(fontsize=6.5, ncol=2, loc="upper left")
        else:  # the FLOPs panel names the other lines
            ax.legend([line for line in ax.get_lines() if line.get_color() == "tab:gray"],
                      [line.get_label() for line in ax.get_lines() if line.get_color() == "tab:gray"],
                      fontsize=7, loc="lower right")
    ax = axes[2]
    short = result["short_requests"]
    x = range(len(short))
    width = 0.38
    ax.bar([i - width / 2 for i in x], [s["dsa_flops"] for s in short], width, label="DSA path (vLLM: every prefill)",
           color="tab:blue")
    ax.bar([i + width / 2 for i in x], [s["dense_flops"] for s in short], width, label="dense route (plan)",
           color="tab:green")
    for i, s in enumerate(short):
        ax.annotate(f"-{s['flops_saved']:.0%}\n({s['dense_routed']})", (i + width / 2, s["dense_flops"]),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(x), [f"c={s['context']:,}\nq={s['query']:,}" for s in short], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("FLOPs per layer")
    ax.set_title("Requests with c + q <= K_I: the dense route skips the indexer")
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    rows = result["cache_row_bytes"]
    fig.suptitle(f"DeepSeek-V3.2 dims, one request, one layer; cost model, not measured "
                 f"(cache rows {rows['latent']} B latent, {rows['index']} B index)", fontsize=10)
    plotting.save(fig, path, dpi=110)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True, help="where to write the results JSON")
    parser.add_argument("--plot", help="where to write a PNG")
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)), help="context tokens c, comma-separated")
    parser.add_argument("--queries", default=",".join(map(str, QUERIES)), help="new tokens q, comma-separated")
    parser.add_argument("--short", default=",".join(f"{c}:{q}" for c, q in SHORT),
                        help="short requests c:q (c + q <= K_I), comma-separated")
    parser.add_argument("--workspace-size", type=int, default=65536, help="index rows per chunk (W)")
    parser.add_argument("--scores-budget", type=int, default=1 << 26, help="scores per index chunk")
    parser.add_argument("--cache-bytes", default="1", choices=[str(v) for v in CACHE_LAYOUTS],
                        help="the caches: bytes per element, 1 (fp8, per-tensor scale) or 2 (bf16), or vllm "
                             "(vLLM's packed fp8_ds_mla / fp8_per_token rows)")
    args = parser.parse_args(argv)
    short = [tuple(int(v) for v in pair.split(":")) for pair in args.short.split(",") if pair.strip()]
    result = model(_ints(args.contexts), _ints(args.queries), short, workspace_size=args.workspace_size,
                   scores_budget=args.scores_budget,
                   cache_bytes=args.cache_bytes if args.cache_bytes == "vllm" else int(args.cache_bytes))
    write_json_atomic(args.json, result, one_line=("rows", "short_requests"))
    if args.plot:
        plot(result, args.plot)

    print(f"{'c':>8} {'q':>6} {'DSA GFLOP':>10} {'dense GFLOP':>12} {'ratio':>7} {'indexer':>8} "
          f"{'DSA MiB':>9} {'dense MiB':>10} {'scores MiB':>11}")
    for r in result["rows"]:
        best = r["dense_mha"] if r["dense_routed"] == "mha" else r["dense_absorbed"]
        print(f"{r['context']:>8,} {r['query']:>6,} {r['dsa']['flops'] / 1e9:>10,.0f} {best['flops'] / 1e9:>12,.0f} "
              f"{r['dsa_over_dense_flops']:>7.3f} {r['indexer_share_of_dsa_flops']:>8.1%} "
              f"{r['dsa']['bytes'] / 2**20:>9,.0f} {best['bytes'] / 2**20:>10,.0f} "
              f"{r['indexer']['logits_bytes'] / 2**20:>11,.0f}")
    print("cache bytes per token and layer (latent, index):")
    for name, rows in result["cache_formats"].items():
        print(f"  {name}: {rows['latent']}, {rows['index']}")
    print("short requests (c + q <= K_I), dense route against the DSA path:")
    for s in result["short_requests"]:
        print(f"  c={s['context']:>5,} q={s['query']:>5,}: {s['flops_saved']:6.1%} fewer FLOPs "
              f"({s['flops_saved_by_skipping_the_indexer']:.1%} the indexer's), "
              f"{s['bytes_saved']:6.1%} fewer bytes ({s['dense_routed']})")
    return result


if __name__ == "__main__":
    main()
