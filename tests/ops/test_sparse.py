"""The sparse attention op (DSA, DESIGN §12) on CPU against a float64 dense computation with the top-k
mask applied, its checks, and its Triton kernel on a GPU.

q [T, N, P+R]   kv_c [T, L]   k_pe [T, R]   kv_cache [num_blocks, block_size, L+R]
block_table [B, max_blocks] int32   query_start_loc [B+1] int32   context_lens [B] int32
sparse [B] bool   topk_indices [T, K] int32 (-1 pads)   kv_b_proj_weight [N*(P+V), L]
-> out [T, N, V], lse [N, T]; rows of dense requests' tokens stay untouched (NaN sentinels here).

The oracle (tests/support/sparse.py): per token, MHA attention over all its c_r + j + 1 keys
(up-projected), the keys outside its selection masked, one softmax.
"""

import math

import pytest
import torch

from mla_ops.ops.sparse import sparse_attention, sparse_reference
from tests.support.batches import context_batch, dense_reference
from tests.support.gpu import DEVICE, needs_cuda
from tests.support.sparse import masked_reference, random_topk

ops = torch.ops.mla_ops
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
SMALL = dict(N=3, L=32, R=8, P=8, V=8)
# Zero context with queries, a long context, T = 1, no queries, a dense request among them.
CONTEXTS, QUERIES = [5, 0, 40, 3, 19, 0], [1, 6, 4, 0, 3, 2]
SPARSE = [True, True, True, True, False, True]
K = 12


def batch_args(batch, sparse, topk):
    """The op's arguments before ``out, lse``."""
    k_scale, device = batch.absorbed_args()[-1], batch.q.device
    return (batch.q, batch.kv_c, batch.k_pe, batch.kv_cache, batch.block_table, batch.query_start_loc,
            batch.context_lens, torch.tensor(sparse, device=device), topk.to(device), batch.kv_b_proj_weight,
            batch.softmax_scale, k_scale)


def check(batch, topk, sparse, tol, dtype=None):
    out, lse = batch.sentinels(SMALL["V"], dtype=dtype)
    ops.sparse_attention(*batch_args(batch, sparse, topk), out, lse)
    want, want_lse, rows = masked_reference(batch, topk, sparse)
    assert torch.isnan(out[~rows]).all() and torch.isnan(lse[:, ~rows]).all(), "dense requests' rows touched"
    assert lse.dtype == (torch.float64 if batch.q.dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(out[rows].double(), want[rows], rtol=0, atol=tol)
    torch.testing.assert_close(lse[:, rows].double(), want_lse[:, rows], rtol=0, atol=tol)
    return out, lse


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_equals_masked_dense_attention(block_size, dtype, tol):
    # Shuffled selections with -1 padding mixed in and positions past the token's own (never attended).
    batch = context_batch(CONTEXTS, QUERIES, block_size=block_size, dtype=dtype, seed=block_size, **SMALL)
    topk = random_topk(CONTEXTS, QUERIES, K, seed=block_size, sparse=SPARSE, future=True)
    check(batch, topk, SPARSE, tol)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache(out_dtype):
    batch = context_batch(CONTEXTS, QUERIES, block_size=16, dtype=torch.float32, fp8_scale=0.25, **SMALL)
    batch.q, batch.kv_c, batch.k_pe, batch.kv_b_proj_weight = (
        x.to(out_dtype) for x in (batch.q, batch.kv_c, batch.k_pe, batch.kv_b_proj_weight))
    topk = random_topk(CONTEXTS, QUERIES, K, seed=3, sparse=SPARSE)
    check(batch, topk, SPARSE, 2e-5 if out_dtype == torch.float32 else 3e-2)


def test_every_candidate_selected_is_dense_mla():
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float64, **SMALL)
    width = max(c + q for c, q in zip(CONTEXTS, QUERIES))
    rows = [list(range(c + j + 1)) + [-1] * (width - c - j - 1) for c, q in zip(CONTEXTS, QUERIES) for j in range(q)]
    out, lse = check(batch, torch.tensor(rows, dtype=torch.int32), [True] * 6, 1e-12)
    want, want_lse = dense_reference(*batch.args(), k_scale=batch.k_scale, return_lse=True)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)


def test_no_valid_key_is_the_empty_partial_and_padding_tokens_stay_untouched():
    batch = context_batch([4, 0], [2, 3], block_size=4, dtype=torch.float64, **SMALL)
    # Tokens at positions 4, 5 (request 0) and 0, 1, 2 (request 1). Tokens 0 and 3 select nothing,
    # token 2 only positions past its own; token 1 selects its own position (5).
    topk = torch.tensor([[-1, -1], [3, 5], [1, 2], [-1, -1], [0, 1]], dtype=torch.int32)
    pad = 2  # tokens past query_start_loc[-1]
    batch.q, batch.kv_c, batch.k_pe = (torch.cat([x, x[:pad]]) for x in (batch.q, batch.kv_c, batch.k_pe))
    topk = torch.cat([topk, topk[:pad]])
    out, lse = batch.sentinels(SMALL["V"])
    ops.sparse_attention(*batch_args(batch, [True, True], topk), out, lse)
    empty = torch.tensor([True, False, True, True, False])
    assert (out[:5][empty] == 0).all() and (lse[:, :5][:, empty] == -math.inf).all()
    assert torch.isfinite(out[:5][~empty]).all() and torch.isfinite(lse[:, :5][:, ~empty]).all()
    assert torch.isnan(out[-pad:]).all() and torch.isnan(lse[:, -pad:]).all()


def test_reference_processes_tokens_in_blocks(monkeypatch):
    from mla_ops.ops import sparse

    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float64, seed=9, **SMALL)
    topk = random_topk(CONTEXTS, QUERIES, K, seed=9, sparse=SPARSE, future=True)
    whole = batch.sentinels(SMALL["V"])
    sparse_reference(*batch_args(batch, SPARSE, topk), *whole)
    monkeypatch.setattr(sparse, "REFERENCE_ROWS", 2 * K)  # two tokens per block
    blocked = batch.sentinels(SMALL["V"])
    sparse_reference(*batch_args(batch, SPARSE, topk), *blocked)
    torch.testing.assert_close(blocked, whole, rtol=0, atol=1e-14, equal_nan=True)


def test_opcheck():
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float32, **SMALL)
    topk = random_topk(CONTEXTS, QUERIES, K, seed=0, sparse=SPARSE)
    t = batch.q.shape[0]
    out, lse = torch.randn(t, 3, 8), torch.randn(3, t)
    torch.library.opcheck(ops.sparse_attention, (*batch_args(batch, SPARSE, topk), out, lse),
                          test_utils=OPCHECK_UTILS)
    # SchemaCheckMode compares inputs with arithmetic that CPU float8 lacks: skip test_schema there.
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float32, fp8_scale=0.5, **SMALL)
    torch.library.opcheck(ops.sparse_attention, (*batch_args(batch, SPARSE, topk), out, lse),
                          test_utils=OPCHECK_UTILS[1:])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_row_marked_without_a_finite_selection_comes_out_nan(dtype):
    """-2 (index_topk's mark of a token whose scores were not finite), anywhere in a row: NaN out and lse for
    that token, every other token as before (the torch op; the Triton kernel: tests/interpreter)."""
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=dtype, **SMALL)
    topk = random_topk(CONTEXTS, QUERIES, K, seed=5, sparse=SPARSE)
    clean_out, clean_lse = sparse_attention(*batch_args(batch, SPARSE, topk))
    marked = topk.clone()
    marked[7] = -2  # request 2, a whole row as index_topk writes it
    marked[1, 3] = -2  # request 1, one entry
    out, lse = sparse_attention(*batch_args(batch, SPARSE, marked))
    nan = torch.zeros(out.shape[0], dtype=torch.bool)
    nan[[1, 7]] = True
    assert torch.isnan(out[nan]).all() and torch.isnan(lse[:, nan]).all()
    torch.testing.assert_close(out[~nan], clean_out[~nan], rtol=0, atol=0)
    torch.testing.assert_close(lse[:, ~nan], clean_lse[:, ~nan], rtol=0, atol=0)


def test_public_function_makes_the_empty_partial_for_other_rows():
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float64, **SMALL)
    topk = random_topk(CONTEXTS, QUERIES, K, seed=2, sparse=SPARSE)
    out, lse = sparse_attention(*batch_args(batch, SPARSE, topk))
    want, want_lse, rows = masked_reference(batch, topk, SPARSE)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
    assert (out[~rows] == 0).all() and (lse[:, ~rows] == -math.inf).all()


def _bad(args, name, value):
    args = list(args)
    index = {"topk_indices": 8, "sparse": 7, "k_scale": 11, "query_start_loc": 5}[name]
    args[index] = value
    return args


BAD = [
    ("topk_indices", lambda a: a.long(), TypeError, "topk_indices must be int32"),
    ("topk_indices", lambda a: a[:-1], ValueError, r"topk_indices must be \[T, index_topk\]"),
    ("topk_indices", lambda a: a[0], ValueError, "topk_indices must be 2-D"),
    ("topk_indices", lambda a: torch.where(a == a.max(), 99, a), ValueError, r"topk_indices\[\d+, \d+\] is 99"),
    ("topk_indices", lambda a: torch.full_like(a, -3), ValueError, r"topk_indices\[0, 0\] is -3"),
    ("sparse", lambda s: s.int(), TypeError, "sparse must be bool"),
    ("sparse", lambda s: s[:-1], ValueError, r"sparse \[B\]"),
    ("query_start_loc", lambda q: q.flip(0), ValueError, "query_start_loc must start at 0"),
]


@pytest.mark.parametrize("name,edit,error,match", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_is_refused_before_anything_is_written(name, edit, error, match):
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float32, **SMALL)
    args = batch_args(batch, SPARSE, random_topk(CONTEXTS, QUERIES, K, seed=0, sparse=SPARSE))
    index = {"topk_indices": 8, "sparse": 7, "query_start_loc": 5}[name]
    out, lse = batch.sentinels(SMALL["V"])
    with pytest.raises(error, match=match):
        sparse_attention(*_bad(args, name, edit(args[index])), out=out, lse=lse)
    assert torch.isnan(out).all() and torch.isnan(lse).all()


def _repeat_a_position(topk, token):
    """``topk`` with token ``token``'s first valid entry copied over its second (-1 pads stay)."""
    row = topk[token]
    first, second = torch.nonzero(row >= 0).squeeze(1)[:2].tolist()
    topk = topk.clone()
    topk[token, second] = row[first]
    return topk, int(row[first])


def test_a_repeated_position_in_a_row_is_refused_by_name_before_anything_is_written():
    """The softmax would count that key twice: a finite wrong number. Repeated -1 padding is fine."""
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float32, **SMALL)
    topk = random_topk(CONTEXTS, QUERIES, K, seed=0, sparse=SPARSE)
    token = 7  # request 2 (40 context keys): K valid entries
    repeated, position = _repeat_a_position(topk, token)
    out, lse = batch.sentinels(SMALL["V"])
    with pytest.raises(ValueError, match=rf"topk_indices row {token} \(request 2\) holds position {position} 2 times"):
        sparse_attention(*batch_args(batch, SPARSE, repeated), out=out, lse=lse)
    assert torch.isnan(out).all() and torch.isnan(lse).all()
    dense_token = sum(QUERIES[:4])  # request 4 is dense-routed: its row is ignored, so not checked
    ignored = topk.clone()
    ignored[dense_token] = 0
    sparse_attention(*batch_args(batch, SPARSE, ignored))


def test_the_debug_switch_asserts_a_repeated_position_where_values_are_not_read():
    """Traced (as on a GPU), nothing is read on the host; ``set_debug(True)`` adds a device assert."""
    import mla_ops
    from mla_ops.ops.sparse import check_topk_values

    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float32, **SMALL)
    repeated, _ = _repeat_a_position(random_topk(CONTEXTS, QUERIES, K, seed=0, sparse=SPARSE), 7)
    lengths = (batch.query_start_loc, batch.context_lens, torch.tensor(SPARSE))

    def check(topk):
        check_topk_values(topk, *lengths)
        return topk + 1

    torch._dynamo.reset()
    try:
        mla_ops.set_debug(True)
        with pytest.raises(RuntimeError, match="must not repeat a position"):
            torch.compile(check, fullgraph=True, backend="eager")(repeated)
    finally:
        mla_ops.set_debug(False)
        torch._dynamo.reset()


def test_dense_rows_are_not_range_checked_and_fp8_needs_k_scale():
    batch = context_batch(CONTEXTS, QUERIES, block_size=4, dtype=torch.float32, fp8_scale=0.5, **SMALL)
    topk = random_topk(CONTEXTS, QUERIES, K, seed=0, sparse=SPARSE)
    dense_rows = torch.repeat_interleave(~torch.tensor(SPARSE), torch.tensor(QUERIES))
    topk[dense_rows] = 1000  # ignored rows
    args = batch_args(batch, SPARSE, topk)
    sparse_attention(*args)
    with pytest.raises(ValueError, match="k_scale is required"):
        sparse_attention(*_bad(args, "k_scale", None))


# ---- GPU: the Triton kernel against the torch reference ----------------------------------------


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_kernel(fp8):
    """bf16 at DeepSeek dims (N=16, L=512, R=64, page 64), 64 selected keys of up to 704 candidates, on
    the GPU against the reference on CPU (float32, same inputs)."""
    dtype = torch.bfloat16
    contexts, queries, sparse = [300, 0, 129, 40, 700], [1, 17, 130, 5, 5], [True, True, True, False, True]
    batch = context_batch(contexts, queries, block_size=64, N=16, L=512, R=64, P=128, V=128, dtype=torch.float32,
                          fp8_scale=0.05 if fp8 else None, seed=5)
    topk = random_topk(contexts, queries, 64, seed=5, sparse=sparse, future=True)
    gpu = batch.to(DEVICE, dtype)
    out, lse = (t.to(DEVICE) for t in gpu.sentinels(128, dtype=dtype))
    ops.sparse_attention(*batch_args(gpu, sparse, topk), out, lse)
    cpu = gpu.to("cpu", torch.float32)
    want, want_lse = cpu.sentinels(128, dtype=torch.float32)
    sparse_reference(*batch_args(cpu, sparse, topk), want, want_lse)
    rows = torch.repeat_interleave(torch.tensor(sparse), torch.tensor(queries))
    out, lse = out.cpu().float(), lse.cpu()
    assert torch.isnan(out[~rows]).all() and torch.isnan(lse[:, ~rows]).all(), "dense requests' rows touched"
    torch.testing.assert_close(out[rows], want[rows], atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse[:, rows], want_lse[:, rows], atol=2e-2, rtol=2e-3)
