"""The checks every MLA family's test runs against its transformers model (DESIGN §11), on a tiny checkpoint
that transformers' own ``save_pretrained`` wrote:

* float64 logits equal to transformers' forward over each whole sequence: batched with nothing cached, and
  with a cached context then the new tokens, through the absorbed path (the plan's default for short
  queries) and the chunk loop (``absorb_max_query_len=0``, a workspace of 8 rows: 2+ chunks);
* greedy ``Generator`` / ``mla_ops.generate`` tokens equal to ``generate(do_sample=False)``, prefix
  caching included; ``python -m mla_ops generate --model DIR``.
"""

import collections
import os
import shutil

import torch

import mla_ops
from dataclasses import replace

from mla_ops.models import regions


@torch.no_grad()
def spread_weights(model, seed: int):
    """Weights at ~1/sqrt(fan_in) (norms near 1, a random correction bias), so attention, routing and
    the greedy tokens are far from uniform and from ties (the default std 0.02 flattens every softmax)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5 * 1.5)
        else:
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model.eval()


def prompts_of(lengths, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def step_inputs(prompts, starts, block_size=4, max_blocks=8):
    """ids, positions, slot_mapping, block_table, query_start_loc, context_lens of a batched prefill of
    prompts[r][starts[r]:], with prompts[r][:starts[r]] already cached (request r owns blocks r * max_blocks...)."""
    ids, positions, slots, qsl = [], [], [], [0]
    table = (torch.arange(len(prompts))[:, None] * max_blocks + torch.arange(max_blocks)).to(torch.int32)
    for r, (prompt, start) in enumerate(zip(prompts, starts)):
        ids += prompt[start:]
        positions += range(start, len(prompt))
        slots += [int(table[r, p // block_size]) * block_size + p % block_size for p in range(start, len(prompt))]
        qsl.append(qsl[-1] + len(prompt) - start)
    return (torch.tensor(ids), torch.tensor(positions), torch.tensor(slots), table, torch.tensor(qsl, dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32))


def step(model, caches, prompts, starts, block_size=4, max_blocks=8, **plan_options):
    """One batched prefill of prompts[r][starts[r]:], with prompts[r][:starts[r]] already cached."""
    ids, positions, slots, table, qsl, ctx = step_inputs(prompts, starts, block_size, max_blocks)
    plan = mla_ops.plan_prefill(qsl, ctx, table, block_size, **plan_options)
    logits = model(ids, positions, caches, slots, plan)
    return logits.split([len(p) - s for p, s in zip(prompts, starts)])


def rewrite_checkpoint(src, dst, change):
    """A copy of the one-file checkpoint ``src`` at ``dst`` with its tensors edited by ``change(tensors)``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file)
    return dst


def relative_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    assert got.shape == ref.shape and bool(got.isfinite().all()), "logits of the wrong shape, or not finite"
    return float((got - ref).abs().max() / ref.abs().max())


@torch.no_grad()
def check_logits(path, hf, rtol=1e-6) -> float:
    """The largest logit difference (relative to the largest logit) of ``from_pretrained(path)`` against
    ``hf`` in float64, over the three kinds of step; each must be within ``rtol``. A sparse (DSA) model's
    steps are planned with its ``index_topk``."""
    model = mla_ops.MLAForCausalLM.from_pretrained(path, dtype=torch.float64)
    sparse = {"index_topk": model.config.index_topk} if model.config.is_sparse else {}
    hf = hf.to(torch.float64)
    prompts = prompts_of([13, 7, 21], model.config.vocab_size, seed=1)
    expect = [hf(torch.tensor([p])).logits[0] for p in prompts]  # each whole sequence, no cache
    caches = model.allocate_kv_caches(3 * 8, 4)
    worst = 0.0
    for got, ref in zip(step(model, caches, prompts, [0, 0, 0], **sparse), expect):  # batched, nothing cached
        worst = max(worst, relative_diff(got, ref))
    cached = [8, 0, 17]  # request 1 has no context
    step(model, caches, [p[:c] for p, c in zip(prompts, cached)], [0, 0, 0], **sparse)
    for options in ({"absorb_max_query_len": 64}, {"absorb_max_query_len": 0, "workspace_size": 8}):  # absorbed; chunk loop
        for got, ref, c in zip(step(model, caches, prompts, cached, **options, **sparse), expect, cached):
            worst = max(worst, relative_diff(got, ref[c:]))
    assert worst <= rtol, f"largest logit difference {worst:.2e} (relative) > {rtol:.0e}"
    return worst


def transformers_greedy(hf, prompts, max_new_tokens: int, pad_token_id: int = 0) -> list[list[int]]:
    """transformers' greedy new tokens for each prompt alone (``generate(do_sample=False)``, no EOS stop)."""
    out = []
    for p in prompts:
        tokens = hf.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad_token_id)
        out.append(tokens[0, len(p):].tolist())
    return out


def check_generation(path, hf, dtype=torch.float32):
    """Greedy tokens equal transformers', with prefixes cached across prompts and calls (both sides in
    ``dtype``)."""
    model = mla_ops.MLAForCausalLM.from_pretrained(path, dtype=dtype)
    hf = hf.to(dtype)
    vocab = model.config.vocab_size
    shared, other = prompts_of([10, 9], vocab, seed=2)
    prompts = [shared + [3, 4, 5], shared + [6], other[:5], shared + [3, 4, 5]]
    expect = transformers_greedy(hf, prompts, 6, pad_token_id=vocab - 1)
    assert len({t for tokens in expect for t in tokens}) >= 8, f"degenerate greedy tokens {expect}: no test of the cache"
    generator = mla_ops.Generator(model, block_size=4)
    assert generator.generate(prompts, 6) == expect
    # Blocks of 4: prompt 1 reuses prompt 0's 2 shared blocks, prompt 3 (= prompt 0) 3 of them.
    assert generator.stats.cached_tokens == 8 + 12
    assert generator.generate(prompts, 6) == expect  # again: every full prompt block is cached now
    assert generator.stats.cached_tokens == 12 + 8 + 4 + 12
    assert mla_ops.generate(model, prompts[:2], 6, block_size=16) == expect[:2]


def check_cli(path, capsys):
    from mla_ops.__main__ import main

    model = mla_ops.MLAForCausalLM.from_pretrained(path)
    expect = mla_ops.generate(model, [[5, 6, 7]], 4)[0]
    main(["generate", "--model", str(path), "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--ignore-eos"])
    out = capsys.readouterr()
    assert out.out.strip() == ",".join(map(str, expect))
    assert "4/4 tokens" in out.err




@torch.no_grad()
def stacked(caches):
    """A model's caches as stacked tensors (a copy), whether stacked or per layer (``allocate_kv_caches``); layers
    of different widths (dots3_note's two geometries) as a list of copies."""
    def stack(part):
        if isinstance(part, torch.Tensor):
            return part.clone()
        return torch.stack(part) if len({t.shape for t in part}) == 1 else [t.clone() for t in part]
    return replace(caches, latent=stack(caches.latent), index=None if caches.index is None else stack(caches.index))


def check_whole_model_compile(model, prompts, starts, max_regions: int, block_size=4, max_blocks=8):
    """``torch.compile`` of a whole step (its device plan made inside) equals eager, logits and caches, after
    each request's first ``starts[r]`` tokens were prefilled eagerly; its layers are nested regions, at most
    ``max_regions`` distinct ones (one per layer kind, each called by two layers or more: one called once is
    inlined) however many layers call them. The eager reference takes the caches stacked. Traced with
    aot_eager: what is checked is the graph, not Inductor's code. Returns the graph."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    torch._dynamo.reset()
    caches = model.allocate_kv_caches(len(prompts) * max_blocks, block_size)
    step(model, caches, [p[:s] for p, s in zip(prompts, starts)], [0] * len(prompts), block_size, max_blocks,
         index_topk=model.config.index_topk)
    expect_caches = stacked(caches)
    options = mla_ops.PlanOptions(block_size=block_size, workspace_size=8, max_chunks=4,
                                  index_topk=model.config.index_topk)

    def run(ids, positions, caches, slots, table, qsl, ctx):
        plan = mla_ops.plan_prefill(qsl, ctx, table, options=options)
        return model(ids, positions, caches, slots, plan)

    ids, positions, slots, table, qsl, ctx = step_inputs(prompts, starts, block_size, max_blocks)
    backend = AotEagerAndRecordGraphs()
    out = torch.compile(run, backend=backend, fullgraph=True, dynamic=True)(ids, positions, caches, slots, table, qsl,
                                                                           ctx)
    expect = run(ids, positions, expect_caches, slots, table, qsl, ctx)
    torch.testing.assert_close(out, expect, rtol=1e-10, atol=1e-10)
    for got, ref in zip(stacked(caches).tensors, expect_caches.tensors):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    if not regions.NESTED_REGIONS:  # torch before 2.13: the layers inline (and its Dynamo may recompile once)
        return None
    (graph,) = backend.graphs
    calls = collections.Counter(n.args[1] for n in graph.graph.nodes
                                if n.target is torch.ops.higher_order.invoke_subgraph)
    # a region is stamped out for each later layer of its kind (one called once is inlined)
    assert len(calls) <= max_regions and all(count >= 2 for count in calls.values()), calls
    return graph
