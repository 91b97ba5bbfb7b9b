"""What the DeepSeek Sparse Attention families' tests (DeepSeek-V3.2, GLM-5) check beyond the MLA family's
(``tests.support.families``): that the test data has no near-ties in the indexer's scores, that the indexer
selects what transformers' selects, and the caches' bookkeeping.

A near-tie (a K-th and (K+1)-th score closer than rounding) would let either implementation pick either key,
so ``index_score_gap`` measures the smallest gap over every layer and query with more than K candidates, from
the model's own float64 index queries, weights and keys; the tests assert it is clear before comparing.
"""

import torch

import mla_ops
from tests.support.families import prompts_of, spread_weights, step, transformers_greedy


@torch.no_grad()
def indexer_outputs(model, prompt):
    """{layer: (q_index, weights, k_index)} of one no-cache step over ``prompt``, from the layers' indexers
    (the index queries times their learned per-head scale where the model has one: Mistral Large 4's)."""
    outputs, hooks = {}, []
    logs = (torch.arange(len(prompt), dtype=torch.float64) + 1).log()  # the step's positions are 0 .. n-1

    def record(module, args, out, i):
        q, weights, k = out
        outputs[i] = (module.scaled_queries(q, logs.to(q.dtype)), weights, k)

    for i, layer in enumerate(model.model.layers):
        if layer.self_attn.indexer is not None:
            hooks.append(layer.self_attn.indexer.register_forward_hook(
                lambda module, args, out, i=i: record(module, args, out, i)))
    try:
        blocks = -(-len(prompt) // 4)
        step(model, model.allocate_kv_caches(blocks, 4), [prompt], [0], block_size=4, max_blocks=blocks,
             index_topk=model.config.index_topk)
    finally:
        for hook in hooks:
            hook.remove()
    return outputs


def dense_scores(q_index, weights, k_index):
    """[T, T] float64 scores ``sum_h w[t, h] relu(q[t, h] . k[s])``, -inf past each query (causal)."""
    dots = torch.einsum("thd,sd->ths", q_index.double(), k_index.double())
    scores = (weights.double()[:, :, None] * dots.relu()).sum(1)
    return scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))


def index_score_gap(model, prompts) -> float:
    """The smallest (K-th - (K+1)-th) score gap over the prompts' queries with more than K candidates, relative
    to their largest score; inf if no query has more than K."""
    K, worst = model.config.index_topk, float("inf")
    for prompt in prompts:
        for q_index, weights, k_index in indexer_outputs(model, prompt).values():
            scores = dense_scores(q_index, weights, k_index)[K:]  # rows with K+1 candidates or more
            if scores.numel():
                top = scores.topk(K + 1, dim=-1).values
                worst = min(worst, float(((top[:, K - 1] - top[:, K]) / top[:, 0].abs().clamp_min(1e-30)).min()))
    return worst


@torch.no_grad()
def check_selection(model, hf, prompt) -> None:
    """Each full layer's top-k of one whole-sequence step equals transformers' (as sets of positions), the
    model's indexer outputs giving the same top-k as ``mla_ops.index_topk``."""
    selected = {}
    for i, layer in enumerate(getattr(hf.model, "language_model", hf.model).layers):  # a wrapper's text model
        if getattr(layer.self_attn, "indexer", None) is not None:
            layer.self_attn.indexer.register_forward_hook(
                lambda module, args, out, i=i: selected.__setitem__(i, out[0].long().sort(-1).values))
    hf(torch.tensor([prompt]))
    ours = indexer_outputs(model, prompt)
    assert sorted(ours) == sorted(selected), "the layers with an indexer differ"
    K = model.config.index_topk
    for i, (q_index, weights, k_index) in ours.items():
        mine = dense_scores(q_index, weights, k_index).topk(min(K, len(prompt)), dim=-1).indices.sort(-1).values
        for t in range(len(prompt)):
            n = min(K, t + 1)  # a row of fewer candidates is padded with masked keys past t (either side)
            assert mine[t, :n].tolist() == selected[i][t, :n].tolist(), f"layer {i}, token {t}: top-k differs"


def check_cache_bookkeeping(path, hf, num_blocks=15) -> list[int]:
    """Three ``generate`` calls (prompts A, B, A) with too few blocks to keep every prefix: the second call evicts
    some of the first's cached blocks (latent and index rows alike, one block id naming both) and the third
    rewrites them, and every call still generates transformers' tokens. Nothing leaks: between calls no block
    is in use and every block is cached or free. Returns the calls' cached-token counts."""
    model = mla_ops.MLAForCausalLM.from_pretrained(path, dtype=torch.float32)
    first, second = prompts_of([14, 11, 13], 96, seed=6), prompts_of([15, 10], 96, seed=7)
    calls = [(p, transformers_greedy(hf.to(torch.float32), p, 5, pad_token_id=95)) for p in (first, second, first)]
    generator = mla_ops.Generator(model, block_size=4, num_blocks=num_blocks)
    hits = []
    for prompts, expect in calls:
        assert generator.generate(prompts, len(expect[0])) == expect
        usage = generator.cache_usage
        assert usage.in_use == 0 and usage.cached + usage.free == usage.total == num_blocks, usage
        hits.append(generator.stats.cached_tokens)
    caches = generator.kv_caches
    assert isinstance(caches, mla_ops.KVCaches) and caches.index is not None
    assert caches.latent[0].shape[:2] == caches.index[0].shape[:2] == (num_blocks, 4)
    return hits


def check_preset_runs(name: str) -> None:
    """``MLAConfig.from_name(name)`` builds and runs one prompt to finite logits."""
    model = mla_ops.MLAForCausalLM(mla_ops.MLAConfig.from_name(name)).eval()
    prompt = prompts_of([11], model.config.vocab_size, seed=3)[0]
    with torch.no_grad():
        (logits,) = step(model, model.allocate_kv_caches(4, 4), [prompt], [0], index_topk=model.config.index_topk)
    assert logits.shape == (11, model.config.vocab_size) and bool(logits.isfinite().all())


@torch.no_grad()
def check_regional_compile(name: str) -> None:
    """``compile_layers`` on preset ``name``: the attentions' projections (an output gate's with them) and the MLPs
    compiled (aot_eager: the graphs, not Inductor's code, are what is checked), the family's other parts eager
    between them; float64 logits equal eager's."""
    torch.manual_seed(0)
    model = spread_weights(mla_ops.MLAForCausalLM(mla_ops.MLAConfig.from_name(name)).double(), 3)
    prompts = prompts_of([13, 5, 1], model.config.vocab_size, seed=1)

    def run():
        return torch.cat(step(model, model.allocate_kv_caches(24, 4), prompts, [0, 0, 0],
                              index_topk=model.config.index_topk))

    expect = run()
    model.compile_layers(backend="aot_eager")
    torch.testing.assert_close(run(), expect, rtol=1e-12, atol=1e-12)
    assert all(region.compiled for region in model.model.compiled_regions)
