"""One rank of a "model across ranks" run (tests/parallel/test_model_across_ranks.py launches D of these).

    MLA_OPS_TP_DATA=DIR python -m tests.support.tp_worker RANK WORLD_SIZE STORE_PORT CASE [CASE ...]

DIR holds the tiny checkpoints the launcher wrote (``DIR/<kind>``: v2, v3, fp8 in DeepSeek's release
layout) and ``DIR/expected.pt``: what one process computes from them (``reference``). Cases:

* ``<kind>_i<I>``: ``from_pretrained(..., context_parallel=ContextParallel(interleave=I))``; the rank's
  parameters are its shard (shapes, and values against slices of the checkpoint's tensors); the
  teacher-forced logits of two steps (the second over a sharded context, on both context paths) equal
  one process's within 1e-4; two ``Generator.generate`` calls return one process's greedy tokens, the
  second reusing the prefix cache.
* ``graphs_<kind>_i<I>``: the same logits through ``PrefillGraphs`` (mode ``compile``, ``aot_eager``).
* ``errors``: heads or intermediate sizes not divisible by D, a block size that is no multiple of the
  interleave: ValueErrors naming ``context_parallel``.
* ``disagreement``: ranks passing other prompts, or one rank refusing its call: every rank raises a
  ValueError naming ``context_parallel`` (no hang), and the group stays usable.

Prints one ``RESULT {json}`` line per case; the first failure exits non-zero (the launcher stops the others).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist

import mla_ops
from mla_ops.parallel.layout import slot_mapping, tokens_per_block
from tests.support.cp_worker import run_cases

BLOCK_SIZE = 4
WORKSPACE = 32  # >= one stripe at D = 4, I = 4; small: several chunks
MAX_NEW_TOKENS = 4
KINDS = ("v2", "v3", "fp8")


def prompts(vocab: int):
    """Two calls: the second extends a prompt of the first (a prefix-cache hit) and adds others."""
    g = torch.Generator().manual_seed(11)
    rand = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    first = [rand(21), rand(7), rand(35)]
    second = [first[0] + rand(6), rand(12), first[2][:33] + rand(2)]
    return first, second


# Teacher forcing: step 1 runs prompt[:split], step 2 the rest over the cached prefix. Step 2's query
# lengths 2, 6, 23 with absorb_max_query_len=2: one request on the absorbed(-queries) path, two chunked.
LOGIT_LENGTHS, LOGIT_SPLITS = (23, 9, 40), (21, 3, 17)


def teacher_forced_logits(model, vocab: int, graphs=None) -> torch.Tensor:
    """[sum(LOGIT_LENGTHS), vocab] logits of two prefill steps, through ``model(...)`` directly (or the
    ``PrefillGraphs`` ``graphs`` of ``model.model``), with the slots of ``parallel.layout.slot_mapping``
    (D = 1 for a model on one device)."""
    cp = model.context_parallel
    layout = (cp.rank, cp.world_size, cp.interleave) if cp is not None else (0, 1, 1)
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LOGIT_LENGTHS]
    per_block = tokens_per_block(BLOCK_SIZE, *layout[1:])
    width = -(-max(LOGIT_LENGTHS) // per_block)
    table = (torch.arange(len(seqs))[:, None] * width + torch.arange(width)).to(torch.int32)
    caches = model.allocate_kv_caches(len(seqs) * width, BLOCK_SIZE)
    out = []
    for step in range(2):
        ids, positions, slots, qsl, ctx = [], [], [], [0], []
        for r, seq in enumerate(seqs):
            start, end = (0, LOGIT_SPLITS[r]) if step == 0 else (LOGIT_SPLITS[r], len(seq))
            ids += seq[start:end]
            positions += range(start, end)
            slots += slot_mapping(range(start, end), table[r].tolist(), BLOCK_SIZE, *layout).tolist()
            qsl.append(qsl[-1] + end - start)
            ctx.append(start)
        qsl, ctx = torch.tensor(qsl, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32)
        inputs = (torch.tensor(ids), torch.tensor(positions), caches, torch.tensor(slots))
        with torch.no_grad():
            if graphs is not None:
                out.append(model.lm_head(graphs(*inputs, table, qsl, ctx)))
                continue
            plan = mla_ops.plan_prefill(qsl, ctx, table, BLOCK_SIZE, workspace_size=WORKSPACE, absorb_max_query_len=2,
                                        context_parallel=cp)
            out.append(model(*inputs, plan))
    return torch.cat(out)


def reference(path: str) -> dict:
    """What one process computes from checkpoint ``path`` (the launcher saves it for the ranks)."""
    model = mla_ops.MLAForCausalLM.from_pretrained(path, dtype=torch.float32)
    vocab = model.config.vocab_size
    generator = mla_ops.Generator(model, block_size=BLOCK_SIZE, workspace_size=WORKSPACE)
    first, second = prompts(vocab)
    return {"tokens": [generator.generate(first, MAX_NEW_TOKENS), generator.generate(second, MAX_NEW_TOKENS)],
            "logits": teacher_forced_logits(model, vocab)}


# ---- the cases -----------------------------------------------------------------------------------


def check_shard(model, path: str, kind: str, rank: int, world: int) -> None:
    """Parameter shapes are the rank's shard; values are the checkpoint's slices (not fp8: dequantized
    values are checked through the logits)."""
    c = model.config
    heads, inter, moe = c.num_attention_heads // world, c.intermediate_size // world, c.moe_intermediate_size // world
    p = dict(model.named_parameters())
    attn, dense, moe_layer = "model.layers.0.self_attn", "model.layers.0.mlp", "model.layers.1.mlp"
    expect = {
        f"{attn}.kv_b_proj.weight": [heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank],
        f"{attn}.o_proj.weight": [c.hidden_size, heads * c.v_head_dim],
        f"{attn}.kv_a_proj_with_mqa.weight": [c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size],
        f"{dense}.gate_proj.weight": [inter, c.hidden_size],
        f"{dense}.down_proj.weight": [c.hidden_size, inter],
        f"{moe_layer}.experts.gate_up_proj": [c.n_routed_experts, 2 * moe, c.hidden_size],
        f"{moe_layer}.experts.down_proj": [c.n_routed_experts, c.hidden_size, moe],
        f"{moe_layer}.shared_experts.up_proj.weight": [moe * c.n_shared_experts, c.hidden_size],
        f"{moe_layer}.gate.weight": [c.n_routed_experts, c.hidden_size],
        "model.embed_tokens.weight": [c.vocab_size, c.hidden_size],
        "lm_head.weight": [c.vocab_size, c.hidden_size],
    }
    if c.q_lora_rank is None:
        expect[f"{attn}.q_proj.weight"] = [heads * c.qk_head_dim, c.hidden_size]
    else:
        expect[f"{attn}.q_a_proj.weight"] = [c.q_lora_rank, c.hidden_size]
        expect[f"{attn}.q_b_proj.weight"] = [heads * c.qk_head_dim, c.q_lora_rank]
    for name, shape in expect.items():
        assert list(p[name].shape) == shape, f"{name}: {list(p[name].shape)} on rank {rank}, expected {shape}"
    if kind == "fp8":
        return
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        full = lambda name: f.get_tensor(name).float()  # noqa: E731
        rows = heads * (c.qk_nope_head_dim + c.v_head_dim)
        assert torch.equal(p[f"{attn}.kv_b_proj.weight"], full(f"{attn}.kv_b_proj.weight")[rank * rows:(rank + 1) * rows])
        cols = heads * c.v_head_dim
        assert torch.equal(p[f"{attn}.o_proj.weight"], full(f"{attn}.o_proj.weight")[:, rank * cols:(rank + 1) * cols])
        mine = slice(rank * moe, (rank + 1) * moe)
        gate_up = p[f"{moe_layer}.experts.gate_up_proj"][3]
        assert torch.equal(gate_up[:moe], full(f"{moe_layer}.experts.3.gate_proj.weight")[mine]), "gate rows"
        assert torch.equal(gate_up[moe:], full(f"{moe_layer}.experts.3.up_proj.weight")[mine]), "up rows"
        assert torch.equal(p[f"{moe_layer}.experts.down_proj"][3],
                           full(f"{moe_layer}.experts.3.down_proj.weight")[:, mine])


def check_model(kind: str, interleave: int, rank: int, world: int, data: str, expected: dict) -> dict:
    path = os.path.join(data, kind)
    cp = mla_ops.ContextParallel(interleave=interleave)
    model = mla_ops.MLAForCausalLM.from_pretrained(path, dtype=torch.float32, context_parallel=cp)
    check_shard(model, path, kind, rank, world)
    want = expected[kind]
    logits = teacher_forced_logits(model, model.config.vocab_size)
    err = (logits - want["logits"]).abs().max().item()
    assert err <= 1e-4, f"logits differ from one process by {err:.2e}"
    generator = mla_ops.Generator(model, block_size=BLOCK_SIZE, workspace_size=WORKSPACE)
    first, second = prompts(model.config.vocab_size)
    got = [generator.generate(first, MAX_NEW_TOKENS)]
    got.append(generator.generate(second, MAX_NEW_TOKENS))
    cached = generator.stats.cached_tokens
    assert got == want["tokens"], f"greedy tokens {got}, one process: {want['tokens']}"
    assert cached > 0, "the second call reused no cached block"
    return {"logits_err": err, "cached_tokens": cached}


def check_graphs(kind: str, interleave: int, rank: int, world: int, data: str, expected: dict) -> dict:
    """``PrefillGraphs`` (mode ``compile``: the layers compiled regionally, here with ``aot_eager``, which
    traces the all-reduces as Inductor would without its C++ build) over a model across ranks: the
    device plan across ranks inside each padded step, the bucket chosen from this rank's block table."""
    cp = mla_ops.ContextParallel(interleave=interleave)
    model = mla_ops.MLAForCausalLM.from_pretrained(os.path.join(data, kind), dtype=torch.float32, context_parallel=cp)
    graphs = mla_ops.PrefillGraphs(model.model, max_tokens=128, max_requests=4, max_blocks_per_request=8,
                                   block_size=BLOCK_SIZE, workspace_size=WORKSPACE, mode="compile",
                                   compile_backend="aot_eager")
    logits = teacher_forced_logits(model, model.config.vocab_size, graphs)
    err = (logits - expected[kind]["logits"]).abs().max().item()
    assert err <= 1e-4, f"logits differ from one process by {err:.2e}"
    assert graphs.stats["replays"] == 2 and graphs.stats["eager"] == 0, graphs.stats
    return {"logits_err": err}


def expect_error(fn, *needles) -> str:
    try:
        fn()
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError(f"no ValueError (expected one naming {needles})")
    assert all(n in message for n in needles), message
    return message


def check_errors(rank: int, world: int) -> dict:
    tiny = mla_ops.MLAConfig.from_name("tiny")
    cp = mla_ops.ContextParallel(interleave=4)
    expect_error(lambda: mla_ops.MLAForCausalLM(dataclasses.replace(tiny, num_attention_heads=world + 1),
                                                context_parallel=cp), "context_parallel", "num_attention_heads")
    moe = dataclasses.replace(tiny, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8 * world + 1,
                              first_k_dense_replace=1)
    expect_error(lambda: mla_ops.MLAForCausalLM(moe, context_parallel=cp), "context_parallel", "moe_intermediate_size")
    model = mla_ops.MLAForCausalLM(tiny, context_parallel=cp)
    expect_error(lambda: mla_ops.Generator(model, block_size=2), "context_parallel", "interleave")
    return {}


def check_disagreement(rank: int, world: int) -> dict:
    torch.manual_seed(0)  # the whole weights (embeddings, lm_head) agree across ranks
    model = mla_ops.MLAForCausalLM(mla_ops.MLAConfig.from_name("tiny"), context_parallel=mla_ops.ContextParallel())
    generator = mla_ops.Generator(model, block_size=4)
    good = [[1, 2, 3, 4, 5], [6, 7]]
    other = good if rank < world - 1 else [[1, 2, 3, 4, 6], [6, 7]]
    message = expect_error(lambda: generator.generate(other, 2), "context_parallel")
    refused = good if rank < world - 1 else [[1, 2, 10**6]]  # past the vocabulary: this rank refuses
    own = expect_error(lambda: generator.generate(refused, 2), "context_parallel" if rank < world - 1 else "prompts[0][2]")
    tokens = generator.generate(good, 2)  # the group still works
    every = [None] * world
    dist.all_gather_object(every, tokens)
    assert all(t == tokens for t in every), every

    # The same call on different state: one rank's prefix cache forgotten, then its model in float64.
    long = [list(range(1, 8 * world + 2))]  # two full blocks of block_size * world tokens: cached
    generator.generate(long, 2)
    if rank == world - 1:
        generator.manager.clear_cache()
    state = expect_error(lambda: generator.generate(long, 2), "context_parallel", "prefix cache state")
    generator.manager.clear_cache()  # every rank's: equal again
    if rank == world - 1:
        model.double()
    dtype = expect_error(lambda: generator.generate(good, 2), "context_parallel", "dtype")
    model.float()

    # A rank that raises mid-call (its callback, at the second step): every rank raises at that step.
    class Stop(Exception):
        pass

    def callback(stats):
        if rank == world - 1 and stats.steps == 2:
            raise Stop
    start = time.perf_counter()
    try:
        generator.generate(good, 4, callback=callback)
    except Stop:
        failed = "own"
    except RuntimeError as e:
        assert f"rank(s) [{world - 1}] raised during generate" in str(e), e
        failed = "told"
    else:
        raise AssertionError("a rank that raised mid-call left the others running")
    seconds = time.perf_counter() - start
    assert failed == ("own" if rank == world - 1 else "told")
    assert generator.generate(good, 2) == tokens  # the group still works
    return {"message": message, "refused": own, "state": state, "dtype": dtype, "failed_in_seconds": seconds}


def main(argv: list[str]) -> int:
    data = os.environ["MLA_OPS_TP_DATA"]
    expected = torch.load(os.path.join(data, "expected.pt"))

    def run_case(name: str, rank: int, world: int) -> dict:
        if name == "errors":
            return check_errors(rank, world)
        if name == "disagreement":
            return check_disagreement(rank, world)
        if name.startswith("graphs_"):
            kind, interleave = name.removeprefix("graphs_").split("_i")
            return check_graphs(kind, int(interleave), rank, world, data, expected)
        kind, interleave = name.split("_i")
        return check_model(kind, int(interleave), rank, world, data, expected)

    return run_cases(argv, run_case)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
