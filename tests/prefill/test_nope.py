"""R = 0 (Mistral Large 4's NoPE layers): the latent rows are L wide, ``k_pe`` is [T, 0] and q is all nope.
``PrefillStep.run`` against a float64 reference over a contiguous L-wide cache and over the first L columns of
an L+R cache (the model's layout for a NoPE layer), through every route: no context, the absorbed path, the
chunk loop and a sparse (DSA) step; and ``attend`` (a KV-sharing layer) writes nothing."""

import pytest
import torch

import mla_ops

N, L, P, V, BLOCK = 4, 32, 24, 16, 4


def reference(q, rows, w, scale, context, allowed=None):
    """[T, N, V]: queries at positions context .. context+T-1 over rows [S, L] (causal; ``allowed`` [T, S])."""
    k, v = (rows @ w.T).view(-1, N, P + V).split([P, V], dim=-1)
    scores = torch.einsum("tnp,snp->nts", q, k) * scale
    visible = torch.arange(rows.shape[0])[None, :] <= (context + torch.arange(q.shape[0]))[:, None]
    if allowed is not None:
        visible = visible & allowed
    return torch.einsum("nts,snv->tnv", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("context, new, options", [
    (0, 9, {}), (8, 5, dict(absorb_max_query_len=64)), (8, 5, dict(absorb_max_query_len=0, workspace_size=4)),
    (10, 11, dict(index_topk=4)),
])
def test_nope_rows(strided, context, new, options):
    g = torch.Generator().manual_seed(context + new)
    total = context + new
    rows = torch.randn(total, L, generator=g, dtype=torch.float64)
    w = torch.randn(N * (P + V), L, generator=g, dtype=torch.float64) / 6
    q = torch.randn(new, N, P, generator=g, dtype=torch.float64)
    cache = torch.zeros(8, BLOCK, L + 8, dtype=torch.float64)[..., :L] if strided else \
        torch.zeros(8, BLOCK, L, dtype=torch.float64)
    cache.view(-1, L)[:context] = rows[:context] if not strided else 0
    for p in range(context):
        cache[p // BLOCK, p % BLOCK] = rows[p]
    table = torch.arange(8, dtype=torch.int32)[None]
    plan = mla_ops.plan_prefill(torch.tensor([0, new], dtype=torch.int32), torch.tensor([context], dtype=torch.int32),
                                table, BLOCK, **options)
    step = mla_ops.begin_step(plan, cache, torch.arange(context, total))
    kwargs, allowed = {}, None
    if options.get("index_topk"):  # each query's 4 latest keys (its own among them)
        topk = torch.stack([torch.arange(4) + context + t - 3 for t in range(new)]).to(torch.int32)
        kwargs["topk_indices"] = topk
        allowed = torch.zeros(new, total, dtype=torch.bool).scatter_(1, topk.long(), True)
    out = step.run(q, rows[context:].clone(), rows.new_zeros(new, 0), cache, w, 0.2, **kwargs)
    torch.testing.assert_close(out, reference(q, rows, w, 0.2, context, allowed))
    torch.testing.assert_close(cache[torch.arange(total) // BLOCK, torch.arange(total) % BLOCK], rows)


def test_attend_writes_nothing_and_run_always_writes():
    rows = torch.randn(6, L, dtype=torch.float64)
    w = torch.randn(N * (P + V), L, dtype=torch.float64) / 6
    q = torch.randn(6, N, P, dtype=torch.float64)
    cache = torch.zeros(2, BLOCK, L, dtype=torch.float64)
    plan = mla_ops.plan_prefill(torch.tensor([0, 6], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                                torch.arange(2, dtype=torch.int32)[None], BLOCK)
    step = mla_ops.begin_step(plan, cache, torch.arange(6))
    out = step.attend(q, rows, rows.new_zeros(6, 0), cache, w, 0.2)
    assert not cache.any()  # the rows are another layer's to write
    torch.testing.assert_close(out, reference(q, rows, w, 0.2, 0))
    with pytest.raises(TypeError, match="unexpected keyword argument 'write'"):  # run writes; attend does not
        step.run(q, rows, rows.new_zeros(6, 0), cache, w, 0.2, write=False)
    assert not cache.any()
