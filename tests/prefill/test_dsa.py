"""A DeepSeek Sparse Attention step end to end (DESIGN §12): plan_prefill(index_topk=K), write_index_cache,
index_topk, run_prefill(topk_indices=), against a dense float64 oracle with the top-k mask applied, on both plan
forms, with bf16-free CPU dtypes and fp8 caches. (Each op alone: tests/ops/test_indexer.py, test_sparse.py;
the chunks: tests/planning/test_index_schedule.py.)

Near-ties: every index key is ``a_s * e_0`` with ``a_s`` distinct values exactly representable in float8_e4m3fn
(eight per octave, so neighbours differ by 6% or more), and ``q_index[..., 0] > 0``: a query ranks its candidates by
``a_s`` alone, with gaps no rounding closes; the selections still differ per query, by causality.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mla_ops
from tests.support.batches import FP8, _request_keys, dense_reference, make_batch

D_I, H_I = 8, 2
FP8_LADDER = [(1 + k / 8) * 2.0**e for e in range(-5, 9) for k in range(8)][:-1]  # e4m3 values: 2^-5 .. 448


def index_side(batch, seed, fp8=False):
    """Index queries, weights and keys of the step's new tokens, and the index cache of the contexts, laid out
    with the latent cache's block table: ``(q_index, weights, k_index, index_cache, k_scale_index, keys)``
    where ``keys[r]`` are request r's index keys at every position, float64."""
    g = torch.Generator().manual_seed(seed)
    qsl, ctx = batch.query_start_loc.tolist(), batch.context_lens.tolist()
    T, bs = qsl[-1], batch.kv_cache.shape[1]
    cache = torch.zeros(batch.kv_cache.shape[0], bs, D_I, dtype=torch.float64)
    k_index = torch.zeros(T, D_I, dtype=torch.float64)
    keys = []
    for r, c in enumerate(ctx):
        n = c + qsl[r + 1] - qsl[r]
        assert n <= len(FP8_LADDER)
        a = torch.tensor(FP8_LADDER, dtype=torch.float64)[torch.randperm(len(FP8_LADDER), generator=g)[:n]]
        k = torch.zeros(n, D_I, dtype=torch.float64)
        k[:, 0] = a
        keys.append(k)
        pos = torch.arange(c)
        cache[batch.block_table[r].long()[pos // bs], pos % bs] = k[:c]
        k_index[qsl[r]: qsl[r + 1]] = k[c:]
    q_index = torch.randn(T, H_I, D_I, generator=g, dtype=torch.float64)
    q_index[..., 0] = 0.5 + torch.rand(T, H_I, generator=g, dtype=torch.float64)
    weights = 0.5 + torch.rand(T, H_I, generator=g, dtype=torch.float64)
    dtype = batch.q.dtype
    if fp8:
        return q_index.to(dtype), weights.float(), k_index.to(dtype), cache.to(FP8), 1.0, keys
    return q_index.to(dtype), weights.to(dtype), k_index.to(dtype), cache.to(dtype), None, keys


def oracle_selection(batch, q_index, weights, keys, topk):
    """Per token, the set of positions the float64 indexer selects (every candidate for <= topk of them)."""
    qsl, ctx = batch.query_start_loc.tolist(), batch.context_lens.tolist()
    chosen = []
    for r, c in enumerate(ctx):
        for j in range(qsl[r + 1] - qsl[r]):
            t = qsl[r] + j
            scores = (weights[t].double()[:, None] * torch.relu(q_index[t].double() @ keys[r][: c + j + 1].T)).sum(0)
            chosen.append(set(scores.topk(min(topk, c + j + 1)).indices.tolist()))
    return chosen


def sparse_oracle(batch, chosen, sparse):
    """Float64 [T, N, V], [N, T]: the dense reference, with each sparse request's softmax over its tokens'
    selections only."""
    out, lse = dense_reference(*batch.args(), k_scale=batch.k_scale, return_lse=True)
    qsl, ctx = batch.query_start_loc.tolist(), batch.context_lens.tolist()
    num_heads = batch.q.shape[1]
    w = batch.kv_b_proj_weight.double()
    nope = batch.q.shape[2] - batch.k_pe.shape[1]
    for r, c in enumerate(ctx):
        if not sparse[r]:
            continue
        latent, rope, qr = _request_keys(r, batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.block_table, qsl,
                                         ctx, batch.k_scale)
        kv = (latent @ w.T).view(latent.shape[0], num_heads, -1)
        k = torch.cat([kv[..., :nope], rope[:, None].expand(-1, num_heads, -1)], -1)
        v = kv[..., nope:]
        for j in range(qsl[r + 1] - qsl[r]):
            t = qsl[r] + j
            keep = torch.tensor(sorted(chosen[t]))
            scores = torch.einsum("nd,knd->nk", qr[j], k[keep]) * batch.softmax_scale
            lse[:, t] = torch.logsumexp(scores, -1)
            out[t] = torch.einsum("nk,knd->nd", torch.softmax(scores, -1), v[keep])
    return out, lse


# Requests: dense (c + q <= K) with and without context, sparse with context past W, a sparse prompt.
CONTEXTS, QUERIES, TOPK = [6, 0, 70, 3, 0, 40], [3, 5, 9, 2, 30, 12], 12


@pytest.mark.parametrize("form", ["host", "device"])
@pytest.mark.parametrize("dtype,fp8", [(torch.float64, False), (torch.float32, True)])
def test_a_dsa_step_equals_the_masked_float64_oracle(form, dtype, fp8):
    batch = make_batch(CONTEXTS, QUERIES, seed=3, block_size=4, dtype=dtype, fp8_scale=0.5 if fp8 else None,
                       N=2, L=16, P=8, R=4, V=8)
    q_index, weights, k_index, index_cache, k_scale_index, keys = index_side(batch, seed=4, fp8=fp8)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, block_size=4,
                                workspace_size=16, index_topk=TOPK, index_scores_budget=16 * 5,
                                max_chunks=40 if form == "device" else None)
    assert plan.sparse.tolist() == [False, False, True, False, True, True]
    topk = mla_ops.index_topk(q_index, weights, k_index, index_cache, plan, k_scale_index=k_scale_index)
    chosen = oracle_selection(batch, q_index, weights, keys, TOPK)
    assert topk.shape == (sum(QUERIES), TOPK) and topk.dtype == torch.int32
    for t, row in enumerate(topk.tolist()):
        valid = [s for s in row if s >= 0]
        assert set(valid) == chosen[t] and len(valid) == len(chosen[t]), t
        assert row[len(valid):] == [-1] * (TOPK - len(valid))  # valid positions first
    out, lse = mla_ops.run_prefill(*batch.args()[:4], batch.kv_b_proj_weight, batch.softmax_scale, plan,
                                   k_scale=batch.k_scale, backend="torch", topk_indices=topk, return_lse=True)
    expect_out, expect_lse = sparse_oracle(batch, chosen, plan.sparse.tolist())
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), expect_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), expect_lse, rtol=tol, atol=tol)


def test_begin_step_makes_the_dsa_rows_and_no_layer_changes_the_step(monkeypatch):
    """The sparse requests' rows and the top-k checks' rows are made in begin_step (not on the first layer's call,
    which would write into a shared step); every layer then checks its top-k against them."""
    import dataclasses

    from mla_ops.ops import sparse

    batch = make_batch(CONTEXTS, QUERIES, seed=3, block_size=4, dtype=torch.float64, N=2, L=16, P=8, R=4, V=8)
    q_index, weights, k_index, index_cache, _, _ = index_side(batch, seed=4)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, block_size=4,
                                workspace_size=16, index_topk=TOPK, index_scores_budget=16 * 5)
    step = mla_ops.begin_step(plan, batch.kv_cache, index_cache=index_cache, backend="torch")
    request, seq, checked = step.topk_rows  # before any layer: per token its request, c_r + q_r, whether checked
    assert request.tolist() == [r for r, n in enumerate(QUERIES) for _ in range(n)]
    assert checked.squeeze(1).tolist() == [plan.sparse.tolist()[r] for r in request.tolist()]
    assert torch.equal(step.sparse_rows, plan.sparse)
    held = {f.name: getattr(step, f.name) for f in dataclasses.fields(step)}
    made = []
    monkeypatch.setattr(sparse, "topk_rows", lambda *a: made.append(a))  # begin_step's only
    for _ in range(2):  # two layers
        topk = step.select(q_index, weights, k_index, index_cache)
        step.run(*batch.args()[:4], batch.kv_b_proj_weight, batch.softmax_scale, topk_indices=topk)
    assert not made and all(getattr(step, name) is value for name, value in held.items())
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.topk_rows = None


def test_a_written_index_cache_serves_the_next_step():
    """Index keys written with write_index_cache at the latent cache's slots are the next step's context keys."""
    batch = make_batch([20, 6], [1, 1], seed=5, block_size=4, N=2, L=16, P=8, R=4, V=8)
    q_index, weights, k_index, laid_out, _, keys = index_side(batch, seed=6)
    # The previous step wrote the contexts' keys, at slot block_table[r, p // 4] * 4 + p % 4 of position p.
    slots = torch.cat([batch.block_table[r].long()[torch.arange(c) // 4] * 4 + torch.arange(c) % 4
                       for r, c in enumerate([20, 6])])
    written = torch.zeros_like(laid_out)
    mla_ops.write_index_cache(torch.cat([keys[0][:20], keys[1][:6]]), slots, written)
    assert torch.equal(written, laid_out)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, block_size=4,
                                workspace_size=8, index_topk=8)
    topk = mla_ops.index_topk(q_index, weights, k_index, written, plan)
    assert set(topk[0].tolist()) == set(keys[0][:, 0].topk(8).indices.tolist())
    assert sorted(topk[1, :7].tolist()) == list(range(7)) and topk[1, 7] == -1  # 7 keys <= 8: dense, all of them


def test_a_step_checks_its_index_cache_once_and_each_layer_selects_on_it():
    """``begin_step(..., index_cache=, k_scale_index=)``: the index cache and its scale checked (and the scale made
    a tensor) once a step; ``PrefillStep.select`` is ``index_topk`` on it, ``write_index`` its write."""
    batch = make_batch(CONTEXTS, QUERIES, seed=3, block_size=4, dtype=torch.float32, fp8_scale=0.5,
                       N=2, L=16, P=8, R=4, V=8)
    q_index, weights, k_index, index_cache, k_scale_index, _ = index_side(batch, seed=4, fp8=True)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, block_size=4,
                                workspace_size=16, index_topk=TOPK, index_scores_budget=16 * 5)
    slots = torch.full((sum(QUERIES),), -1, dtype=torch.long)
    slots[:3] = torch.arange(3) + 4 * int(batch.block_table.max() + 1)  # free slots past the contexts
    index = torch.cat([index_cache, torch.zeros_like(index_cache[:4])])  # one free block each
    latent = torch.cat([batch.kv_cache, torch.zeros_like(batch.kv_cache[:4])])
    step = mla_ops.begin_step(plan, latent, slots, k_scale=batch.k_scale, index_cache=index,
                              k_scale_index=k_scale_index)
    assert isinstance(step.k_scale_index, torch.Tensor) and step.k_scale_index.shape == (1,)
    expect = mla_ops.index_topk(q_index, weights, k_index, index_cache, plan, k_scale_index=k_scale_index)
    assert torch.equal(step.select(q_index, weights, k_index, index), expect)
    step.write_index(k_index, index)
    written = index.view(-1, D_I)[slots[:3]].float() * k_scale_index
    torch.testing.assert_close(written, k_index[:3].float(), rtol=0.07, atol=0)  # float8's rounding
    # A scale per layer: a step begun without one takes each layer's, and refuses a layer without one by name.
    per_layer = mla_ops.begin_step(plan, latent, slots, k_scale=batch.k_scale, index_cache=index)
    before = index.clone()
    with pytest.raises(ValueError, match="k_scale_index is required for a float8_e4m3fn index_cache"):
        per_layer.select(q_index, weights, k_index, index)
    with pytest.raises(ValueError, match="k_scale_index is required for a float8_e4m3fn index_cache"):
        per_layer.write_index(k_index, index)
    with pytest.raises(ValueError, match="k_scale_index must be finite and positive"):
        per_layer.write_index(k_index, index, k_scale_index=-1.0)
    assert torch.equal(index.view(torch.uint8), before.view(torch.uint8))
    assert torch.equal(per_layer.select(q_index, weights, k_index, index, k_scale_index=k_scale_index), expect)
    per_layer.write_index(k_index, index, k_scale_index=k_scale_index)
    assert torch.equal(index.view(torch.uint8), before.view(torch.uint8)), "the same bytes as the step's scale wrote"
    with pytest.raises(ValueError, match="index_cache has block_size 2"):
        mla_ops.begin_step(plan, latent, slots, k_scale=batch.k_scale, index_cache=index.view(-1, 2, D_I),
                           k_scale_index=k_scale_index)
    with pytest.raises(ValueError, match="k_scale_index is the scale of a float8 index_cache: pass index_cache"):
        mla_ops.begin_step(plan, latent, slots, k_scale=batch.k_scale, k_scale_index=k_scale_index)



def dsa_layer(pad_cols=2):
    """A float64 DSA step begun with its index cache, new token t at slot t: ``(batch, plan, step, (q_index,
    weights, k_index), index_cache)``."""
    batch = make_batch(CONTEXTS, QUERIES, seed=3, block_size=4, dtype=torch.float64, N=2, L=16, P=8, R=4, V=8,
                       pad_cols=pad_cols)
    q_index, weights, k_index, index_cache, _, _ = index_side(batch, seed=4)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, block_size=4,
                                workspace_size=16, index_topk=TOPK, index_scores_budget=16 * 5)
    step = mla_ops.begin_step(plan, batch.kv_cache, torch.arange(sum(QUERIES)), index_cache=index_cache,
                              backend="torch")
    return batch, plan, step, (q_index, weights, k_index), index_cache


def other_geometry(cache):
    """The same memory viewed as twice the blocks of half the size: [2 * num_blocks, block_size / 2, D_I]."""
    return cache.view(2 * cache.shape[0], cache.shape[1] // 2, cache.shape[2])


# Issue 48 items 2, 7, 8, 9: what a DSA layer's select / write_index gets that its step was not begun with.
BAD_INDEX_LAYERS = {
    "another block geometry": (lambda q, w, k, c: (q, w, k, other_geometry(c)), ValueError,
                               r"index_cache \(\(68, 2, 8\) torch.float64\) is not shaped like the cache the step "
                               r"began with \(\(34, 4\) blocks"),
    "fewer blocks": (lambda q, w, k, c: (q, w, k, c[:3].clone()), ValueError,
                     r"index_cache \(\(3, 4, 8\) .* not shaped like the cache the step began with"),
    "more blocks": (lambda q, w, k, c: (q, w, k, torch.cat([c, c[:1]])), ValueError,
                    r"index_cache \(\(35, 4, 8\) .* not shaped like"),
    "another dtype": (lambda q, w, k, c: (q, w, k, c.float()), ValueError,
                      r"index_cache \(\(34, 4, 8\) torch.float32\) is not shaped like .* blocks of torch.float64"),
    "a float8 cache": (lambda q, w, k, c: (q, w, k, c.to(torch.float8_e4m3fn)), ValueError,
                       r"index_cache .* torch.float8_e4m3fn\) is not shaped like .* blocks of torch.float64"),
}
BAD_WRITES = {  # write_index alone: the keys against the index cache and the step's slots
    "keys of another width": (lambda k: k[:, :4], ValueError, r"index_cache rows must be D_I = 4 wide"),
    "fewer keys than slots": (lambda k: k[:5], ValueError,
                              "k_index and slot_mapping must have one row per new token: k_index has 5, "
                              "slot_mapping 61"),
    "keys of an int dtype": (lambda k: k.to(torch.int32), TypeError, "k_index must be float16, bfloat16"),
    "keys of another rank": (lambda k: k[None], ValueError, r"k_index must be 2-D \[T, D_I\]"),
}


@pytest.mark.parametrize("call", ["select", "write_index"])
@pytest.mark.parametrize("case", list(BAD_INDEX_LAYERS))
def test_a_dsa_layer_whose_index_cache_is_not_the_steps_is_refused_before_anything_runs(case, call):
    """Issue 48 items 2, 7, 8, 9: a layer's index cache is the one the step was checked for, in blocks and dtype
    (``index_topk`` refuses another block size by name; a step checks the index cache once, in begin_step, so
    each layer's must be shaped like it). Refused by name before anything runs or is written: before, a cache too
    small raised an IndexError after part of the keys landed, and another geometry of the same memory selected
    other keys (21 of 61 rows here) or raised an IndexError."""
    batch, plan, step, (q_index, weights, k_index), index_cache = dsa_layer(pad_cols=40)  # room for 2x the blocks
    change, error, match = BAD_INDEX_LAYERS[case]
    q_index, weights, k_index, cache = change(q_index, weights, k_index, index_cache.clone())
    before = cache.clone()
    with pytest.raises(error, match=match):
        if call == "select":
            step.select(q_index, weights, k_index, cache)
        else:
            step.write_index(k_index, cache)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("case", list(BAD_WRITES))
def test_write_index_checks_the_keys_before_anything_is_written(case):
    """Issue 48 item 9 (docs/api.md: a layer's calls are checked before anything is written): write_index checks
    the keys against the index cache and the step's slots, as write_index_cache does."""
    _, _, step, (_, _, k_index), index_cache = dsa_layer()
    change, error, match = BAD_WRITES[case]
    before = index_cache.clone()
    with pytest.raises(error, match=match):
        step.write_index(change(k_index), index_cache)
    assert torch.equal(index_cache, before)
    step.write_index(k_index, index_cache)  # the step's own keys land at its slots
    assert torch.equal(index_cache.view(-1, D_I)[:sum(QUERIES)], k_index)


def test_select_and_write_index_need_a_dsa_step_begun_with_an_index_cache():
    """Issue 48 item 8: on a dense step (a plan without index_topk) select raised an AttributeError and
    write_index wrote; on a DSA step begun without an index cache nothing had checked the layer's cache against
    the plan. Both are refused by name, nothing written."""
    batch, plan, _, (q_index, weights, k_index), index_cache = dsa_layer()
    slots = torch.arange(sum(QUERIES))
    dense = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, block_size=4,
                                 workspace_size=16)
    before = index_cache.clone()
    for step, match in [(mla_ops.begin_step(dense, batch.kv_cache, slots), "plan was made without index_topk: plan "
                         r"the step with plan_prefill\(..., index_topk=K\)"),
                        (mla_ops.begin_step(plan, batch.kv_cache, slots), r"begin the step with "
                         r"begin_step\(..., index_cache=\)")]:
        with pytest.raises(ValueError, match="select .*" + match):
            step.select(q_index, weights, k_index, index_cache)
        with pytest.raises(ValueError, match="write_index .*" + match):
            step.write_index(k_index, index_cache)
    assert torch.equal(index_cache, before)


@pytest.mark.parametrize("form", ["host", "device"])
@pytest.mark.parametrize("where", ["q_index", "index_weights", "index_cache"])
def test_a_non_finite_index_input_gives_nan_in_the_tokens_it_reaches_only(form, where):
    """A NaN index query, an inf weight, a NaN index key: the tokens whose selection they reach come out NaN
    (out and lse) through index_topk and run_prefill; every other token equals the clean step."""
    batch = make_batch(CONTEXTS, QUERIES, seed=3, block_size=4, dtype=torch.float64, N=2, L=16, P=8, R=4, V=8)
    q_index, weights, k_index, index_cache, _, _ = index_side(batch, seed=4)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, block_size=4,
                                workspace_size=16, index_topk=TOPK, index_scores_budget=16 * 5,
                                max_chunks=40 if form == "device" else None)

    def step(q_index, weights, index_cache):
        topk = mla_ops.index_topk(q_index, weights, k_index, index_cache, plan)
        return mla_ops.run_prefill(*batch.args()[:4], batch.kv_b_proj_weight, batch.softmax_scale, plan,
                                   backend="torch", topk_indices=topk, return_lse=True)

    clean_out, clean_lse = step(q_index, weights, index_cache)
    first = int(batch.query_start_loc[2])  # request 2: sparse, context 70
    reached = torch.zeros(sum(QUERIES), dtype=torch.bool)
    if where == "q_index":
        q_index = q_index.clone()
        q_index[first + 3, 0, 1] = float("nan")
        reached[first + 3] = True
    elif where == "index_weights":
        weights = weights.clone()
        weights[first + 3, 1] = float("inf")
        reached[first + 3] = True
    else:
        index_cache = index_cache.clone()
        index_cache[batch.block_table[2, 1], 2, 0] = float("nan")  # position 6 of request 2: all its tokens see it
        reached[first:int(batch.query_start_loc[3])] = True
    out, lse = step(q_index, weights, index_cache)
    assert torch.isnan(out[reached]).all() and torch.isnan(lse[:, reached]).all()
    torch.testing.assert_close(out[~reached], clean_out[~reached], rtol=0, atol=0)
    torch.testing.assert_close(lse[:, ~reached], clean_lse[:, ~reached], rtol=0, atol=0)
    assert not torch.isnan(out[~reached]).any()


class SuffixCalls(TorchDispatchMode):
    """Every ``mla_ops::suffix_attention`` dispatched: ``(query rows, live query tokens)`` (its q's rows and its
    ``query_start_loc[-1]``; rows past the live ones are padding the kernels skip)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.mla_ops.suffix_attention.default:
            self.calls.append((args[0].shape[0], int(args[4][-1])))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("form", ["host", "device"])
def test_the_suffix_attention_skips_the_sparse_requests_tokens(form):
    """Issue 39 item 4: the sparse attention attends a sparse request's own new keys and overwrites its rows, so
    the suffix attention runs over the dense-routed requests' tokens only (host form: just those rows; device
    form: T static rows, the sparse ones past its live tokens); the output still equals the oracle."""
    batch = make_batch(CONTEXTS, QUERIES, seed=3, block_size=4, dtype=torch.float64, N=2, L=16, P=8, R=4, V=8)
    q_index, weights, k_index, index_cache, _, keys = index_side(batch, seed=4)
    plan = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, block_size=4,
                                workspace_size=16, index_topk=TOPK, index_scores_budget=16 * 5,
                                max_chunks=40 if form == "device" else None)
    topk = mla_ops.index_topk(q_index, weights, k_index, index_cache, plan)
    dense_tokens = sum(q for q, s in zip(QUERIES, plan.sparse.tolist()) if not s)  # 3 + 5 + 2
    recorder = SuffixCalls()
    with recorder:
        out = mla_ops.run_prefill(*batch.args()[:4], batch.kv_b_proj_weight, batch.softmax_scale, plan,
                                  backend="torch", topk_indices=topk)
    rows = dense_tokens if form == "host" else sum(QUERIES)
    assert recorder.calls == [(rows, dense_tokens)]
    expect, _ = sparse_oracle(batch, oracle_selection(batch, q_index, weights, keys, TOPK), plan.sparse.tolist())
    torch.testing.assert_close(out, expect, rtol=1e-10, atol=1e-10)
    dense_only = mla_ops.plan_prefill(batch.query_start_loc, batch.context_lens, batch.block_table, block_size=4,
                                      workspace_size=16, index_topk=100)  # no sparse request: the plain suffix
    assert dense_only.suffix_query_start_loc is None and not dense_only.sparse.any()
