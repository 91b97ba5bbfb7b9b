"""A plan knows the step it was made for (issue: fail-safe surfaces). Lengths or a block table passed
beside a plan must be the plan's own tensors or, on the CPU, equal to them; block ids are read again
at run time on CPU tables; a model step checks its token ids and first positions for free."""

import pytest
import torch

import mla_ops
from tests.prefill.test_validation import BLOCK_SIZE, call, planned, valid_args
from tests.support.batches import model_step


def test_an_equal_copy_of_the_step_is_accepted():
    a, run = planned()
    expect = mla_ops.run_prefill(**run)
    b = {**a, "plan": run["plan"], "workspace_size": 65536, "backend": "torch"}
    for name in ("block_table", "query_start_loc", "context_lens"):
        b[name] = b[name].clone()
    torch.testing.assert_close(call(b), expect, rtol=0, atol=0)


def _other_step(a):
    """Another step of the same shapes: the contexts moved between requests."""
    other = dict(a)
    other["context_lens"] = a["context_lens"].flip(0).contiguous()  # [9, 0, 5]: same B, same blocks
    return other


@pytest.mark.parametrize("change,error,match", [
    ("another step", ValueError, "context_lens is not the one plan was made for"),
    ("int64 block_table", TypeError, "block_table must be int32"),
    ("float context_lens", TypeError, "context_lens must be int32"),
    ("negative context", ValueError, "context_lens is not the one plan was made for"),
    ("decreasing query_start_loc", ValueError, "query_start_loc is not the one plan was made for"),
])
def test_mla_prefill_refuses_lengths_of_another_step(change, error, match):
    a, run = planned()
    b = {**a, "plan": run["plan"], "workspace_size": 65536}
    if change == "another step":
        b = {**_other_step(b), "plan": run["plan"]}
    elif change == "int64 block_table":
        b["block_table"] = b["block_table"].long()
    elif change == "float context_lens":
        b["context_lens"] = b["context_lens"].float()
    elif change == "negative context":
        b["context_lens"] = torch.tensor([5, -5, 9], dtype=torch.int32)
    else:
        b["query_start_loc"] = torch.tensor([0, 5, 3, 6], dtype=torch.int32)
    with pytest.raises(error, match=match):
        call(b)


def test_a_block_id_edited_after_planning_is_caught_at_run_time():
    a, run = planned()
    table = run["plan"].block_table
    table[2, 1] = -1  # the caller's table, edited after plan_prefill
    with pytest.raises(ValueError, match=r"block_table\[2, 1\] is -1: block ids must be >= 0"):
        mla_ops.run_prefill(**run)
    table[2, 1] = a["kv_cache"].shape[0]  # past the cache
    with pytest.raises(ValueError, match="past the .* blocks of kv_cache"):
        mla_ops.run_prefill(**run)


def tiny_step(context_lens=(5, 0, 13), query_lens=(3, 2, 4)):
    config = mla_ops.MLAConfig.from_name("tiny")
    torch.manual_seed(0)
    model = mla_ops.MLAModel(config).eval()
    ids, positions, slots, table, qsl, ctx = model_step(config, list(context_lens), list(query_lens), seed=0)
    caches = model.allocate_kv_caches(64, 4)
    plan = mla_ops.plan_prefill(qsl, ctx, table, 4, workspace_size=8)
    return model, config, dict(input_ids=ids, positions=positions, kv_caches=caches, slot_mapping=slots,
                               block_table=table, plan=plan)


@pytest.mark.parametrize("case,match", [
    ("plan of another step", "block_table is not the one plan was made for"),
    ("equal table, other lengths", r"positions\[0\] is 5, but request 0 has 13 context tokens"),
    ("token id past the vocabulary", r"input_ids\[4\] is \d+: input_ids must lie in \[0, \d+\)"),
    ("negative token id", r"input_ids\[0\] is -1"),
    ("float token ids", "input_ids must be an integer tensor"),
])
def test_model_refuses_a_step_it_was_not_planned_for(case, match):
    model, config, step = tiny_step()
    if case == "plan of another step":
        _, _, other = tiny_step(context_lens=(13, 0, 5), query_lens=(3, 2, 4))
        step["plan"] = other["plan"]  # its own block table: another tensor
    elif case == "equal table, other lengths":
        qsl, ctx = step["plan"].query_start_loc, step["plan"].context_lens
        step["plan"] = mla_ops.plan_prefill(qsl, ctx.flip(0).contiguous(), step["block_table"], 4, workspace_size=8)
    elif case == "token id past the vocabulary":
        step["input_ids"] = step["input_ids"].clone()
        step["input_ids"][4] = config.vocab_size + 3
    elif case == "negative token id":
        step["input_ids"] = step["input_ids"].clone()
        step["input_ids"][0] = -1
    else:
        step["input_ids"] = step["input_ids"].float()
    before = step["kv_caches"].clone()
    inputs = {k: v.clone() for k, v in step.items() if isinstance(v, torch.Tensor)}
    with pytest.raises((ValueError, TypeError), match=match):
        model(**step)
    assert torch.equal(step["kv_caches"], before), "a refused step wrote the cache"
    assert all(torch.equal(step[k], v) for k, v in inputs.items())


def test_model_step_with_its_own_plan_runs():
    model, _, step = tiny_step()
    assert model(**step).shape == (9, model.config.hidden_size)
