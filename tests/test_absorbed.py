"""The absorbed ("MQA") context attention op and the FlashMLA adapter, on CPU.

q [T, N, P+R]   kv_cache [num_blocks, block_size, L+R]   kv_b_proj_weight [N*(P+V), L]
block_table [B, max_blocks] int32   query_start_loc [B+1] int32   context_lens [B] int32
-> out [T, N, V], lse [N, T]; rows of requests without context stay untouched (NaN sentinels here).

The reference is checked against the MHA path's context partial (gather -> up-project -> attend,
the library's own ops) and a dense float64 computation written here. The adapter runs against a
torch stand-in of ``flash_mla`` that follows its documented dense-decoding contract.
"""

import dataclasses
import math

import pytest
import torch

import mla_ops  # noqa: F401  (registers the other ops)
from mla_ops._mla import MLADims
from mla_ops.ops import absorbed, flashmla

ops = torch.ops.mla_ops
FP8 = torch.float8_e4m3fn
OPCHECK_UTILS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
NAN = float("nan")

# Small dims for the reference; the FlashMLA stand-in needs L=512, R=64 (its kernel's only shape).
SMALL = dict(num_heads=3, latent=32, rope=8, nope=8, value=8)


@dataclasses.dataclass
class Batch:
    q: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    weight: torch.Tensor
    softmax_scale: float
    k_scale: torch.Tensor | None

    def args(self):
        return (self.q, self.kv_cache, self.block_table, self.query_start_loc, self.context_lens, self.weight,
                self.softmax_scale, self.k_scale)

    def sentinels(self, value_dim, dtype=None):
        """out [T, N, V] and lse [N, T] filled with NaN: rows left untouched stay NaN."""
        t, n = self.q.shape[:2]
        lse_dtype = torch.float64 if self.q.dtype == torch.float64 else torch.float32
        return (torch.full((t, n, value_dim), NAN, dtype=dtype or self.q.dtype),
                torch.full((n, t), NAN, dtype=lse_dtype))


def make_batch(context_lens, query_lens, *, block_size, num_heads, latent, rope, nope, value,
               dtype=torch.float64, fp8_scale=None, seed=0):
    """Context rows in shuffled blocks of a NaN-filled cache; a block table with column stride 2."""
    g = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    blocks = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks) + 3
    order = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.zeros(len(context_lens), 2 * (max(blocks, default=0) + 1), dtype=torch.int32)
    cache = torch.full((num_blocks, block_size, latent + rope), NAN, dtype=torch.float64)
    used = 0
    for r, c in enumerate(context_lens):
        table[r, 0 : 2 * blocks[r] : 2] = order[used : used + blocks[r]]
        used += blocks[r]
        pos = torch.arange(c)
        cache[table[r, 2 * (pos // block_size)].long(), pos % block_size] = randn(c, latent + rope)
    if fp8_scale is None:
        cache, k_scale = cache.to(dtype), None
    else:
        cache, k_scale = (cache / fp8_scale).to(FP8), torch.tensor([fp8_scale], dtype=torch.float32)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    weight = randn(num_heads * (nope + value), latent) / math.sqrt(latent)
    return Batch(randn(sum(query_lens), num_heads, nope + rope).to(dtype), cache, table[:, ::2], qsl,
                 torch.tensor(context_lens, dtype=torch.int32), weight.to(dtype),
                 1.0 / math.sqrt(nope + rope), k_scale)


def dense_mha_partial(batch: Batch):
    """float64 (out [T, N, V], lse [N, T]) by the MHA formula: up-projected keys, one softmax per request."""
    q, cache, w = batch.q.double(), batch.kv_cache, batch.weight.double()
    num_heads, latent, nope, rope, value = MLADims.from_shapes(batch.q, cache, batch.weight)
    out = torch.zeros(q.shape[0], num_heads, value, dtype=torch.float64)
    lse = torch.full((num_heads, q.shape[0]), -math.inf, dtype=torch.float64)
    qsl, ctx = batch.query_start_loc.tolist(), batch.context_lens.tolist()
    for r, c in enumerate(ctx):
        t0, t1 = qsl[r], qsl[r + 1]
        pos = torch.arange(c)
        rows = cache[batch.block_table[r].long()[pos // cache.shape[1]], pos % cache.shape[1]].double()
        if batch.k_scale is not None:
            rows = rows * batch.k_scale.double()
        kv = (rows[:, :latent] @ w.T).view(c, num_heads, nope + value)  # [c, N, P+V]
        k = torch.cat([kv[..., :nope], rows[:, None, latent:].expand(c, num_heads, rope)], dim=-1)
        scores = torch.einsum("mnd,cnd->nmc", q[t0:t1], k) * batch.softmax_scale  # [N, m, c]
        lse[:, t0:t1] = torch.logsumexp(scores, -1)
        out[t0:t1] = torch.einsum("nmc,cnv->mnv", torch.softmax(scores, -1), kv[..., nope:])
    return out, lse


def mha_path_partial(batch: Batch, value_dim: int):
    """The library's MHA context partial over all of each request's context (one chunk)."""
    num_heads, latent, nope, _, _ = MLADims.from_shapes(batch.q, batch.kv_cache, batch.weight)
    ctx = batch.context_lens
    cu = torch.cat([ctx.new_zeros(1), ctx.cumsum(0).to(torch.int32)])
    starts = torch.zeros_like(ctx)
    workspace = batch.q.new_zeros(int(cu[-1]), batch.kv_cache.shape[2])
    ops.gather_context(batch.kv_cache, batch.block_table, cu, starts, batch.k_scale, workspace)
    kv = (workspace[:, :latent] @ batch.weight.T).view(-1, num_heads, nope + value_dim)
    out, lse = batch.sentinels(value_dim)
    ops.context_attention(batch.q, kv[..., :nope], workspace[:, latent:], kv[..., nope:], batch.query_start_loc,
                          cu, starts, batch.softmax_scale, out, lse)
    return out, lse


def written_rows(batch: Batch):
    """bool [T]: tokens of requests with context (the rows the op must write)."""
    lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).long()
    return torch.repeat_interleave(batch.context_lens > 0, lens)


def assert_partial(out, lse, expect_out, expect_lse, written, tol):
    assert torch.isnan(out[~written]).all() and torch.isnan(lse[:, ~written]).all(), "zero-context rows touched"
    err = (out[written].double() - expect_out[written]).abs().max().item() if written.any() else 0.0
    lse_err = (lse[:, written].double() - expect_lse[:, written]).abs().max().item() if written.any() else 0.0
    assert err <= tol and lse_err <= tol, f"max abs diff out {err:.3e}, lse {lse_err:.3e} (tol {tol:.0e})"


# ---- the torch reference / the op --------------------------------------------------------------

# T = 1 and 17 queries, zero context with and without queries, context without queries, a long one.
CONTEXTS, QUERIES = [5, 0, 130, 3, 0, 70, 1], [1, 3, 17, 0, 2, 4, 1]


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_reference_equals_mha_partial_and_dense(block_size, dtype, tol):
    batch = make_batch(CONTEXTS, QUERIES, block_size=block_size, dtype=dtype, seed=block_size, **SMALL)
    out, lse = batch.sentinels(SMALL["value"])
    ops.absorbed_context_attention(*batch.args(), out, lse)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    written = written_rows(batch)
    assert_partial(out, lse, *dense_mha_partial(batch), written, tol)
    mha_out, mha_lse = mha_path_partial(batch, SMALL["value"])
    assert_partial(out, lse, mha_out.double(), mha_lse.double(), written, tol)


def test_reference_merges_key_blocks(monkeypatch):
    monkeypatch.setattr(absorbed, "KEY_BLOCK", 7)  # 130 context rows -> 19 merged blocks
    batch = make_batch(CONTEXTS, QUERIES, block_size=4, **SMALL)
    out, lse = batch.sentinels(SMALL["value"])
    absorbed.absorbed_reference(*batch.args(), out, lse)
    assert_partial(out, lse, *dense_mha_partial(batch), written_rows(batch), 1e-12)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_reference_fp8_cache(out_dtype):
    batch = make_batch(CONTEXTS, QUERIES, block_size=16, dtype=torch.float32, fp8_scale=0.25, **SMALL)
    out, lse = batch.sentinels(SMALL["value"], dtype=out_dtype)
    ops.absorbed_context_attention(*batch.args(), out, lse)
    tol = 2e-5 if out_dtype == torch.float32 else 2e-2
    assert_partial(out, lse, *dense_mha_partial(batch), written_rows(batch), tol)


def test_no_context_writes_nothing():
    batch = make_batch([0, 0], [3, 2], block_size=4, **SMALL)
    out, lse = batch.sentinels(SMALL["value"])
    ops.absorbed_context_attention(*batch.args(), out, lse)
    assert torch.isnan(out).all() and torch.isnan(lse).all()


def test_opcheck():
    batch = make_batch([4, 0, 9], [2, 1, 3], block_size=4, dtype=torch.float32, **SMALL)
    out, lse = torch.randn(6, 3, 8), torch.randn(3, 6)
    torch.library.opcheck(ops.absorbed_context_attention, (*batch.args(), out, lse), test_utils=OPCHECK_UTILS)
    # A static bound of the tokens of requests with context (5 here), as a plan passes it.
    torch.library.opcheck(ops.absorbed_context_attention, (*batch.args(), out, lse, 5), test_utils=OPCHECK_UTILS)
    # SchemaCheckMode compares inputs with arithmetic that CPU float8 lacks: skip test_schema there.
    batch = make_batch([4, 0, 9], [2, 1, 3], block_size=4, dtype=torch.float32, fp8_scale=0.5, **SMALL)
    torch.library.opcheck(ops.absorbed_context_attention, (*batch.args(), out, lse), test_utils=OPCHECK_UTILS[1:])


# ---- the FlashMLA adapter, against a torch stand-in of flash_mla ------------------------------


@dataclasses.dataclass
class StandInSchedMeta:  # flash_mla.FlashMLASchedMeta (1.0.0): empty until the first kernel call fills it
    have_initialized: bool = False  # these two are set and checked by the sparse path only
    config: object = None
    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None


class StandInFlashMLA:
    """``flash_mla`` of the sgl-flash-mla 1.0.0 wheel for dense decoding, on CPU.

    ``flash_mla_with_kvcache`` has the wheel's signature and repeats what its Python wrapper
    (``flash_mla_interface.py``) does on the dense path; ``dense_decode_fwd`` stands for the
    legacy extension's op, with the schema and the checks its binary states::

        flash_mla_legacy::dense_decode_fwd(Tensor q, Tensor kcache, int head_size_v, Tensor seqlens_k,
            Tensor block_table, float softmax_scale, bool is_causal, Tensor(a!)? tile_scheduler_metadata,
            Tensor(b!)? num_splits) -> (Tensor, Tensor, Tensor(a)?, Tensor(b)?)

    q [b, s_q, h_q, 576] and k_cache [num_blocks, 64, 1, 576] in one 16-bit dtype; out
    [b, s_q, h_q, 512] in q's dtype and lse [b, h_q, s_q] float32, natural log, +inf for rows
    with cache_seqlens 0. The scheduler metadata it makes encodes (b, s_q, h_q, seqlens), and
    reusing it for another schedule fails here (the real kernel would silently misschedule).
    """

    def __init__(self):
        self.calls = []

    @staticmethod
    def has_legacy():
        return True

    @staticmethod
    def get_mla_metadata(*args, **kwargs):
        return StandInSchedMeta(), None

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                               num_splits=None, softmax_scale=None, causal=False, is_fp8_kvcache=None, indices=None,
                               attn_sink=None, extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
                               extra_topk_length=None, enable_batch_invariant=False, use_legacy=False, kv_format=None,
                               descale_q=None, descale_k=None):
        sched_meta = tile_scheduler_metadata
        assert isinstance(sched_meta, StandInSchedMeta), "tile_scheduler_metadata must be of type FlashMLASchedMeta"
        assert num_splits is None, "num_splits must be None"
        if is_fp8_kvcache is None:
            is_fp8_kvcache = indices is not None
        assert indices is None, "the adapter uses dense decoding only"
        assert use_legacy, "Dense MLA decoding was removed from the current kernels; pass use_legacy=True"
        assert kv_format is None, "kv_format does not apply to dense decoding"
        assert not is_fp8_kvcache, "the adapter refuses fp8 caches"
        assert descale_q is None and descale_k is None, "descale_q/descale_k apply to the dense fp8 path only"
        assert attn_sink is None and extra_k_cache is None and topk_length is None and not enable_batch_invariant
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        out, lse, new_meta, new_splits = self.dense_decode_fwd(
            q, k_cache, head_dim_v, cache_seqlens, block_table, softmax_scale, causal,
            sched_meta.tile_scheduler_metadata, sched_meta.num_splits,
        )
        sched_meta.tile_scheduler_metadata = new_meta
        sched_meta.num_splits = new_splits
        self.calls.append(dict(b=q.shape[0], s_q=q.shape[1], h_q=q.shape[2], metadata=sched_meta))
        return out, lse

    @staticmethod
    def dense_decode_fwd(q, kcache, head_size_v, seqlens_k, block_table, softmax_scale, is_causal,
                         tile_scheduler_metadata, num_splits):
        b, s_q, h_q, d = q.shape
        assert q.dtype in (torch.bfloat16, torch.float16) and kcache.dtype == q.dtype
        assert d in (576, 512) and head_size_v == 512 and b > 0 and q.is_contiguous()
        num_blocks, page_block_size, h_kv, _ = kcache.shape
        assert page_block_size == 64 and h_kv == 1 and kcache.shape[3] == d and kcache.stride(-1) == 1
        assert block_table.dtype == torch.int32 and block_table.shape[0] == b and block_table.stride(-1) == 1
        assert seqlens_k.dtype == torch.int32 and seqlens_k.shape == (b,)
        assert not is_causal, "the adapter's context attention is non-causal"
        schedule = torch.tensor([b, s_q, h_q, *seqlens_k.tolist()], dtype=torch.int32)
        if tile_scheduler_metadata is None:  # the first call makes the split schedule
            tile_scheduler_metadata, num_splits = schedule, torch.zeros(b + 1, dtype=torch.int32)
        assert torch.equal(tile_scheduler_metadata, schedule), "metadata reused for a different schedule"
        out = torch.full((b, s_q, h_q, head_size_v), NAN, dtype=q.dtype)  # empty rows: unspecified
        lse = torch.full((b, h_q, s_q), math.inf)
        for i in range(b):
            n = int(seqlens_k[i])
            if n == 0:
                continue
            pos = torch.arange(n)
            rows = kcache[block_table[i].long()[pos // 64], pos % 64, 0].float()  # [n, 576]
            scores = torch.einsum("shd,kd->hsk", q[i].float(), rows) * softmax_scale
            lse[i] = torch.logsumexp(scores, -1)
            out[i] = torch.einsum("hsk,kd->shd", torch.softmax(scores, -1), rows[:, :head_size_v]).to(q.dtype)
        return out, lse, tile_scheduler_metadata, num_splits


@pytest.fixture
def stand_in(monkeypatch):
    module = StandInFlashMLA()
    monkeypatch.setattr(flashmla, "_import_flash_mla", lambda: (module, ""))
    return module


FLASHMLA_DIMS = dict(num_heads=2, latent=512, rope=64, nope=16, value=16)
ADAPTER_TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


def reference_partial(batch: Batch):
    """The op's reference in float32 on the same (16-bit) inputs."""
    b32 = dataclasses.replace(batch, q=batch.q.float(), kv_cache=batch.kv_cache.float(), weight=batch.weight.float())
    out, lse = b32.sentinels(FLASHMLA_DIMS["value"])
    absorbed.absorbed_reference(*b32.args(), out, lse)
    return out.double(), lse.double()


def test_lse_to_tokens_first():
    b, n, s_q = 2, 3, 4
    lse = torch.arange(b * n * s_q, dtype=torch.float32).view(b, n, s_q)  # lse[r, h, j] = 12 r + 4 h + j
    lse[1, :, 1] = math.inf  # a row without keys
    lse[0, 2, 0] = -math.inf
    slots = torch.tensor([0, 1, 5, 4, 0])  # slot = r * s_q + j
    got = flashmla._lse_to_tokens_first(lse, slots)
    expect = torch.stack([lse[s // s_q, :, s % s_q] for s in slots.tolist()], dim=1)  # [N, T]
    expect = torch.where(expect == math.inf, -math.inf, expect)
    assert got.shape == (n, slots.numel()) and torch.equal(got, expect)
    assert (got[:, 2] == -math.inf).all() and got[2, 0] == -math.inf and not torch.isinf(got[:, 3]).any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flashmla_adapter_pads_groups_and_unpacks(stand_in, dtype):
    context_lens, query_lens = [70, 0, 5, 130, 0, 64], [3, 2, 1, 4, 0, 2]
    batch = make_batch(context_lens, query_lens, block_size=64, dtype=dtype, seed=7, **FLASHMLA_DIMS)
    out, lse = batch.sentinels(FLASHMLA_DIMS["value"])
    flashmla.absorbed_context_attention(*batch.args(), out, lse, max_query_len=4)
    call = stand_in.calls[-1]
    assert (call["b"], call["s_q"], call["h_q"]) == (len(context_lens), 4, FLASHMLA_DIMS["num_heads"])
    assert_partial(out, lse, *reference_partial(batch), written_rows(batch), ADAPTER_TOL[dtype])


def test_flashmla_adapter_default_query_bound_is_num_tokens(stand_in):
    batch = make_batch([9, 3], [1, 5], block_size=64, dtype=torch.float16, **FLASHMLA_DIMS)
    out, lse = batch.sentinels(FLASHMLA_DIMS["value"])
    flashmla.absorbed_context_attention(*batch.args(), out, lse)
    assert stand_in.calls[-1]["s_q"] == 6
    assert_partial(out, lse, *reference_partial(batch), written_rows(batch), ADAPTER_TOL[torch.float16])


def test_flashmla_adapter_leaves_requests_longer_than_the_bound(stand_in):
    batch = make_batch([9, 3, 4], [2, 5, 1], block_size=64, dtype=torch.float16, **FLASHMLA_DIMS)
    out, lse = batch.sentinels(FLASHMLA_DIMS["value"])
    flashmla.absorbed_context_attention(*batch.args(), out, lse, max_query_len=2)
    written = torch.tensor([True, True] + [False] * 5 + [True])  # request 1 (5 queries) is not served
    assert_partial(out, lse, *reference_partial(batch), written, ADAPTER_TOL[torch.float16])


def test_flashmla_metadata_per_call_or_from_the_caller(stand_in):
    batch = make_batch([9, 0, 4], [2, 1, 1], block_size=64, dtype=torch.float16, **FLASHMLA_DIMS)

    def run(**kwargs):
        out, lse = batch.sentinels(FLASHMLA_DIMS["value"])
        flashmla.absorbed_context_attention(*batch.args(), out, lse, max_query_len=2, **kwargs)
        return out, lse

    shared = flashmla.new_metadata()  # made where the step's schedule is made
    results = [run(), run(), run(metadata=shared), run(metadata=shared)]  # two "layers" share it
    metas = [call["metadata"] for call in stand_in.calls]
    assert metas[0] is not metas[1], "a fresh metadata object per call by default"
    assert metas[2] is shared and metas[3] is shared, "the caller's metadata is used as given"
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], equal_nan=True, rtol=0, atol=0)
        torch.testing.assert_close(lse, results[0][1], equal_nan=True, rtol=0, atol=0)


def test_flashmla_adapter_refuses_what_it_cannot_run(stand_in):
    fp8 = make_batch([3], [1], block_size=64, dtype=torch.float16, fp8_scale=0.5, **FLASHMLA_DIMS)
    with pytest.raises(TypeError, match="fp8"):
        flashmla.absorbed_context_attention(*fp8.args(), *fp8.sentinels(16, dtype=torch.float16))
    paged16 = make_batch([3], [1], block_size=16, dtype=torch.float16, **FLASHMLA_DIMS)
    with pytest.raises(ValueError, match="64"):
        flashmla.absorbed_context_attention(*paged16.args(), *paged16.sentinels(16))
    fp32 = make_batch([3], [1], block_size=64, dtype=torch.float32, **FLASHMLA_DIMS)
    with pytest.raises(TypeError, match="float16"):
        flashmla.absorbed_context_attention(*fp32.args(), *fp32.sentinels(16))
    ok, reason = flashmla.available(fp32.q, fp32.kv_cache)
    assert not ok and "CUDA" in reason  # this CPU machine; the stand-in imports fine


def test_flashmla_available_reports_a_reason():
    ok, reason = flashmla.available()
    assert isinstance(ok, bool) and isinstance(reason, str)
    if not ok:
        assert reason
