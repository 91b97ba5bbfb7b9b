"""The CPU engine (mla_ops/ops/cpu_attention.py) down every branch, against float64 softmaxes, LSEs
included: the tuning constants are patched so that each setting forces its branch, and a spy on the
engine asserts that it ran (a setting that stops forcing its branch fails, it does not pass vacuously).

q [T, N, P+R]   k_nope [S, N, P]   k_pe [S, R]   v [S, N, V]   -> out [T, N, V], lse [N, T]
absorbed: q [T, N, P+R], a paged latent cache [num_blocks, block_size, L+R] -> out [T, N, V], lse [N, T]
"""

import math

import pytest
import torch

import mla_ops  # noqa: F401  (registers torch.ops.mla_ops)
from mla_ops.ops import cpu_attention
from mla_ops.ops.cpu_attention import padded_batches
from tests.support.batches import (assert_partial, context_batch, dense_attention, dense_mha_partial, random_varlen,
                                   written_rows)

ops = torch.ops.mla_ops
HUGE = 1 << 62
# Each setting patches cpu_attention's constants to force a branch (checked by `spy` in the tests).
SETTINGS = {
    "defaults": {},  # sizes this small: ATen's fused attention, the one-key shortcut for decode steps
    "key_blocks": {"FLASH_LIMIT": 0},  # one key block per batch, no merge
    "key_blocks_of_7": {"FLASH_LIMIT": 0, "KEY_BLOCK": 7},  # several blocks per request, merged
    "one_padded_batch": {"PAD_SLACK": HUGE, "SCORE_LIMIT": HUGE, "ALONE_LIMIT": HUGE},  # fused, masked padding
    "one_padded_batch_key_blocks_of_7": {"PAD_SLACK": HUGE, "SCORE_LIMIT": HUGE, "ALONE_LIMIT": HUGE,
                                         "FLASH_LIMIT": 0, "KEY_BLOCK": 7},
    "pad_slack_0": {"PAD_SLACK": 0},  # padding at most doubles the work: splits uneven sizes
    "score_limit_88": {"SCORE_LIMIT": 88},  # a key block's scores: splits the batch after 2 requests
    "alone": {"ALONE_LIMIT": 0},  # every request attends alone, its rows read in place
}
SCALES = [0.3, 0.0, -0.7]  # ATen's fused attention masks before it scales: 0 and < 0 must stay exact

# Context chunk: request 0 continues an earlier chunk; 1 has no rows (left untouched); 2 no queries;
# 4 and 6 alike (m 2, s 6) around 5 (m 3, s 1). Decode-like: one query over one key each.
CONTEXT_CASES = {"mixed": ([1, 17, 0, 4, 2, 3, 2], [5, 0, 3, 11, 6, 1, 6], 0), "one_key": ([1, 1, 1], [1, 1, 1], None)}
SUFFIX_CASES = {"mixed": [1, 17, 3, 0, 5, 5], "one_key": [1, 1, 1]}
# The batches the fresh requests of the mixed chunk form, where the setting decides them.
MIXED_BATCHES = {"pad_slack_0": [[3], [5], [4, 6]], "score_limit_88": [[3, 5], [4, 6]],
                 "alone": [[3], [5], [4], [6]], "one_padded_batch": [[3, 4, 5, 6]]}


@pytest.fixture(params=list(SETTINGS))
def spy(request, monkeypatch):
    """Applies the setting; records the engine's batches and how often each branch ran."""
    for name, value in SETTINGS[request.param].items():
        monkeypatch.setattr(cpu_attention, name, value)
    seen = {"setting": request.param, "batches": [], "_one_key": 0, "_flash_attend": 0, "_key_blocks": 0,
            "merges": 0}

    def counted(name):
        fn = getattr(cpu_attention, name)

        def wrapped(*args):
            seen[name] += 1
            return fn(*args)
        monkeypatch.setattr(cpu_attention, name, wrapped)

    for name in ("_one_key", "_flash_attend", "_key_blocks"):
        counted(name)
    batches, merge_into = cpu_attention.padded_batches, cpu_attention.merge_into

    def recorded_batches(*args):
        seen["batches"].append(batches(*args))
        return seen["batches"][-1]

    def counted_merge(partial, block):
        seen["merges"] += partial is not None  # the first block has nothing to merge with
        return merge_into(partial, block)

    monkeypatch.setattr(cpu_attention, "padded_batches", recorded_batches)
    monkeypatch.setattr(cpu_attention, "merge_into", counted_merge)
    return seen


def check_branches(seen, mha: bool):
    """The branches the setting forces did run."""
    setting = seen["setting"]
    flash_off = "FLASH_LIMIT" in SETTINGS[setting]
    if mha:
        assert (seen["_flash_attend"] > 0) != flash_off, seen
        assert (seen["_key_blocks"] > 0) == flash_off, seen
    if "KEY_BLOCK" in SETTINGS[setting]:
        assert seen["merges"] > 0, seen
    elif mha:
        assert seen["merges"] == 0, seen
    if setting.startswith("one_padded_batch"):
        assert all(len(b) <= 1 for b in seen["batches"]), seen["batches"]
        assert any(len(b[0]) > 1 for b in seen["batches"] if b), seen["batches"]
    if setting in ("pad_slack_0", "score_limit_88"):
        assert any(len(b) > 1 for b in seen["batches"]), seen["batches"]
    if setting == "alone" and mha:
        assert all(len(batch) == 1 for b in seen["batches"] for batch in b), seen["batches"]


# ---- MHA: context_attention, suffix_attention ---------------------------------------------------


def run_context(q_lens, k_lens, continuing, dtype, scale, seed=0):
    """ops.context_attention over one chunk against float64 softmaxes; request ``continuing`` (None:
    none) merges into a partial over 5 earlier keys."""
    cu_q, _, _, _, make = random_varlen(q_lens, dtype=dtype, seed=seed)
    cu_k, k_nope, k_pe, v, _ = random_varlen(k_lens, dtype=dtype, seed=seed + 1)
    q = make(sum(q_lens), 2, 12)
    starts = torch.zeros(len(q_lens), dtype=torch.int32)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.full((sum(q_lens), 2, 8), math.nan, dtype=dtype)
    lse = torch.full((2, sum(q_lens)), math.nan, dtype=acc)
    earlier = {}
    if continuing is not None:
        starts[continuing] = 7
        t0, t1 = int(cu_q[continuing]), int(cu_q[continuing + 1])
        _, *earlier_keys, _ = random_varlen([5], dtype=dtype, seed=seed + 2)
        earlier[continuing] = earlier_keys
        prev_out, prev_lse = dense_attention(q[t0:t1], *earlier_keys, scale, False)
        out[t0:t1], lse[:, t0:t1] = prev_out.to(dtype), prev_lse.to(acc)
    ops.context_attention(q, k_nope, k_pe, v, cu_q, cu_k, starts, scale, out, lse)
    for i in range(len(q_lens)):
        t0, t1, s0, s1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if s1 == s0:  # no rows in this chunk: untouched
            assert out[t0:t1].isnan().all() and lse[:, t0:t1].isnan().all(), f"request {i} touched"
            continue
        keys = [k_nope[s0:s1], k_pe[s0:s1], v[s0:s1]]
        if i in earlier:  # merged: equal to attending over both key sets at once
            keys = [torch.cat([e, k]) for e, k in zip(earlier[i], keys)]
        want, want_lse = dense_attention(q[t0:t1], *keys, scale, False)
        assert_attention(out[t0:t1], lse[:, t0:t1], want, want_lse, dtype, f"request {i}")


def run_suffix(lens, dtype, scale, seed=0, num_heads=2):
    """ops.suffix_attention (causal per request) against float64 softmaxes."""
    cu, k_nope, k_pe, v, make = random_varlen(lens, num_heads=num_heads, dtype=dtype, seed=seed)
    q = make(sum(lens), num_heads, 12)
    out = torch.full((sum(lens), num_heads, 8), math.nan, dtype=dtype)
    lse = torch.full((num_heads, sum(lens)), math.nan, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    ops.suffix_attention(q, k_nope, k_pe, v, cu, scale, out, lse)
    for i, (t0, t1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        want, want_lse = dense_attention(q[t0:t1], k_nope[t0:t1], k_pe[t0:t1], v[t0:t1], scale, True)
        assert_attention(out[t0:t1], lse[:, t0:t1], want, want_lse, dtype, f"request {i}")


def assert_attention(out, lse, want, want_lse, dtype, what):
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    err = (out.double() - want).abs().max().item() if out.numel() else 0.0
    lse_err = (lse.double() - want_lse).abs().max().item() if lse.numel() else 0.0
    assert err <= tol and lse_err <= tol, f"{what}: max abs diff out {err:.2e}, lse {lse_err:.2e} (tol {tol:.0e})"


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_mha_engine_branches_match_dense_softmax(spy, dtype, scale):
    for case, (q_lens, k_lens, continuing) in CONTEXT_CASES.items():
        first = len(spy["batches"])  # the call for the fresh requests comes first
        run_context(q_lens, k_lens, continuing, dtype, scale)
        if case == "mixed" and spy["setting"] in MIXED_BATCHES:
            assert spy["batches"][first] == MIXED_BATCHES[spy["setting"]], spy["batches"]
    for lens in SUFFIX_CASES.values():
        run_suffix(lens, dtype, scale)
    check_branches(spy, mha=True)
    assert spy["_one_key"] > 0, spy  # the one_key cases, in every setting


def test_mha_key_blocks_past_4096_keys(monkeypatch):
    """The real KEY_BLOCK (no patch): chunks of 4,100 and 4,097 keys, two blocks each."""
    monkeypatch.setattr(cpu_attention, "FLASH_LIMIT", 0)
    assert cpu_attention.KEY_BLOCK == 4096
    run_context([3, 2], [4100, 7], 0, torch.float64, 0.3)
    run_context([3], [4097], None, torch.float32, -0.7)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_mha_engine_branches_make_a_non_finite_score_nan(spy, value):
    """A non-finite q entry: that (token, head) is NaN, out and lse, in every branch (ATen's fused kernel, which
    would turn it into a finite row, gives the batch to the key-block loop), as the oracle; the rest equal it."""
    from mla_ops.ops.attention import varlen_attention_reference

    for lens_q, lens_k, causal in [([1, 17, 0, 4, 2, 3, 2], [5, 0, 3, 11, 6, 1, 6], False),
                                   ([1, 1, 1], [1, 1, 1], False), ([1, 17, 3, 0, 5, 5], None, True)]:
        cu_k, k_nope, k_pe, v, make = random_varlen(lens_k or lens_q, dtype=torch.float32, seed=3)
        q = make(sum(lens_q), 2, 12)
        cu_q = random_varlen(lens_q)[0]
        poisoned = torch.zeros(q.shape[0], 2, dtype=torch.bool)
        for t, h in [(0, 1), (q.shape[0] // 2, 0), (q.shape[0] - 1, 0), (q.shape[0] - 1, 1)]:
            q[t, h, t % 12] = value
            poisoned[t, h] = True
        out, lse = torch.zeros(q.shape[0], 2, 8), torch.full((2, q.shape[0]), -math.inf)
        if causal:
            ops.suffix_attention(q, k_nope, k_pe, v, cu_q, 0.3, out, lse)
        else:
            ops.context_attention(q, k_nope, k_pe, v, cu_q, cu_k, torch.zeros(len(lens_q), dtype=torch.int32), 0.3,
                                  out, lse)
        want, want_lse = varlen_attention_reference(q, k_nope, k_pe, v, cu_q, cu_k, 0.3, causal)
        seen = torch.repeat_interleave(torch.tensor(lens_k or lens_q) > 0, torch.tensor(lens_q))[:, None]
        assert torch.equal(want.isnan().any(-1), poisoned & seen) and torch.equal(want_lse.t().isnan(), poisoned & seen)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5, equal_nan=True)
        assert out[poisoned & seen].isnan().all()


# ---- absorbed / latent attention -----------------------------------------------------------------

SMALL = dict(N=3, L=32, R=8, P=8, V=8)
# T = 1 and 17 queries, zero context with and without queries, context without queries, a long one.
CONTEXTS, QUERIES = [5, 0, 130, 3, 0, 70, 1], [1, 3, 17, 0, 2, 4, 1]


# The latent engine always loops over key blocks and has no alone rule (its kv width is 0).
@pytest.mark.parametrize("spy", [s for s in SETTINGS if s not in ("key_blocks", "alone")], indirect=True)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("dtype,fp8_scale,tol", [(torch.float64, None, 1e-12), (torch.float32, None, 2e-5),
                                                 (torch.float32, 0.25, 2e-5)])
def test_absorbed_engine_branches_match_dense(spy, dtype, fp8_scale, tol, scale):
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=dtype, fp8_scale=fp8_scale, **SMALL)
    batch.softmax_scale = scale
    out, lse = batch.sentinels(SMALL["V"])
    ops.absorbed_context_attention(*batch.absorbed_args(), out, lse)
    assert_partial(out, lse, *dense_mha_partial(batch), written_rows(batch), tol)
    check_branches(spy, mha=False)


def test_absorbed_key_blocks_past_4096_rows():
    batch = context_batch([4100, 3], [2, 1], block_size=64, **SMALL)
    out, lse = batch.sentinels(SMALL["V"])
    ops.absorbed_context_attention(*batch.absorbed_args(), out, lse)
    assert_partial(out, lse, *dense_mha_partial(batch), written_rows(batch), 1e-12)


# ---- the batching rule -------------------------------------------------------------------------


@pytest.mark.parametrize("pad_slack,score_limit,alone_limit",
                         [(1 << 20, 1 << 20, 1 << 16), (0, 1 << 20, 1 << 16), (1 << 10, 300, 1 << 16), (0, 50, 500)])
def test_padded_batches_partition_the_requests_and_bound_the_padding(monkeypatch, pad_slack, score_limit,
                                                                     alone_limit):
    monkeypatch.setattr(cpu_attention, "PAD_SLACK", pad_slack)
    monkeypatch.setattr(cpu_attention, "SCORE_LIMIT", score_limit)
    monkeypatch.setattr(cpu_attention, "ALONE_LIMIT", alone_limit)
    g = torch.Generator().manual_seed(pad_slack + score_limit)
    for _ in range(20):
        q_lens = torch.randint(0, 40, (12,), generator=g).tolist()
        k_lens = torch.randint(0, 90, (12,), generator=g).tolist()
        width, key_block, kv_width = 24, 32, 10
        batches = padded_batches(q_lens, k_lens, width, key_block, kv_width)
        members = sorted(r for b in batches for r in b)
        assert members == [r for r in range(12) if q_lens[r] and k_lens[r]], "each request with work, once"
        for b in batches:
            assert b == sorted(b)
            if len(b) == 1:
                continue
            m, s = max(q_lens[r] for r in b), max(k_lens[r] for r in b)
            work = sum(q_lens[r] * k_lens[r] for r in b)
            assert len(b) * m * s * width <= 2 * work * width + pad_slack, (b, q_lens, k_lens)
            assert len(b) * m * min(s, key_block) <= score_limit, (b, q_lens, k_lens)
            assert all(k_lens[r] * kv_width <= alone_limit for r in b), (b, k_lens)
