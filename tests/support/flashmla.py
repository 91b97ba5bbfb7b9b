"""A torch stand-in of ``flash_mla`` (the sgl-flash-mla 1.0.0 wheel) for dense decoding, on CPU.

Install it with ``monkeypatch.setattr(mla_ops.ops.flashmla, "_import_flash_mla", lambda: (stand_in, ""))``;
``stand_in.calls`` records each kernel call (b, s_q, h_q and the scheduler metadata used).
"""

import dataclasses
import math

import torch

NAN = float("nan")


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
