"""dots3_note's step on the Triton kernels, under Triton's interpreter: one step serves its DSA layers (40-wide
rows, the sparse kernel for requests past ``index_topk``) and its sliding-window layers (56-wide rows, window 6,
the windowed attention and absorbed kernels), each layer's kind on its own plan. The torch backend is the
reference (its float64 run equals transformers': tests/models/test_dots3_note.py)."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 (make test does)", allow_module_level=True)
pytest.importorskip("triton")

import mla_ops  # noqa: E402
from tests.support.families import prompts_of, spread_weights, step, step_inputs  # noqa: E402


@pytest.mark.parametrize("options", [dict(absorb_max_query_len=64), dict(absorb_max_query_len=0, workspace_size=8),
                                     dict(absorb_max_query_len=2, workspace_size=8, max_chunks=6)],
                         ids=["absorbed", "chunked", "device plan"])
@torch.no_grad()
def test_a_cached_step_equals_the_torch_backend(options):
    model = spread_weights(mla_ops.MLAForCausalLM(mla_ops.MLAConfig.from_name("dots3-note-tiny")), 1)
    prompts, cached = prompts_of([13, 7, 21], 96, seed=1), [8, 0, 17]
    logits = {}
    for backend in ("torch", "triton"):
        caches = model.allocate_kv_caches(3 * 8, 4)
        step(model, caches, [p[:c] for p, c in zip(prompts, cached)], [0, 0, 0], index_topk=8)
        ids, positions, slots, table, qsl, ctx = step_inputs(prompts, cached, 4, 8)
        plan = mla_ops.plan_prefill(qsl, ctx, table, 4, index_topk=8, **options)
        logits[backend] = model(ids, positions, caches, slots, plan, backend=backend)
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=0, atol=2e-4 * logits["torch"].abs().max())
