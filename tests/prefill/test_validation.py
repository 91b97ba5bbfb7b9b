"""Bad input to ``mla_ops.mla_prefill`` and ``mla_ops.run_prefill`` is rejected loudly, before any
kernel runs.

DESIGN.md §4: a ValueError (or TypeError) that names the argument, for wrong ranks, shapes,
dtypes or devices, negative lengths, a query_start_loc that does not match the tokens, a block
table too short for a context, a workspace smaller than one alignment step, fp8 without k_scale;
and a plan that does not fit the call (made for other tokens, another block size or device, a
block past the cache; planning options or lengths passed beside ``plan=``). mla_prefill has no
out= and writes nothing; that a rejected layer call leaves the cache unchanged is checked in
tests/models/test_decoder.py.

Each case starts from one valid small call and changes one thing.
"""

import math

import pytest
import torch

import mla_ops
from tests.support.batches import caches_equal, clone_caches, model_step, paged_block_table

FP8 = torch.float8_e4m3fn
N, L, P, R, V = 2, 8, 4, 2, 4
BLOCK_SIZE = 4
CTX = [5, 0, 9]  # needs 2, 0 and 3 blocks
QLENS = [2, 3, 1]
T = sum(QLENS)


def valid_args(dtype=torch.float32):
    """Keyword arguments of a valid call (the first nine are passed positionally)."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    num_blocks, table = paged_block_table([math.ceil(c / BLOCK_SIZE) for c in CTX], g, spare_blocks=2, pad_cols=1)
    return dict(
        q=rnd(T, N, P + R), kv_c=rnd(T, L), k_pe=rnd(T, R),
        kv_cache=rnd(num_blocks, BLOCK_SIZE, L + R), block_table=table,
        query_start_loc=torch.tensor([0, 2, 5, 6], dtype=torch.int32),
        context_lens=torch.tensor(CTX, dtype=torch.int32),
        kv_b_proj_weight=rnd(N * (P + V), L) / math.sqrt(L), softmax_scale=1 / math.sqrt(P + R),
        workspace_size=4, policy="packed", k_scale=None, backend="torch")


POSITIONAL = ("q", "kv_c", "k_pe", "kv_cache", "block_table", "query_start_loc",
              "context_lens", "kv_b_proj_weight", "softmax_scale")


def call(a):
    return mla_ops.mla_prefill(*(a[k] for k in POSITIONAL),
                               **{k: v for k, v in a.items() if k not in POSITIONAL})


def _fp8(a, k_scale):
    a["kv_cache"] = (a["kv_cache"] / 0.05).to(FP8)
    a["k_scale"] = k_scale


def _set(**kw):
    return lambda a: a.update({k: (f(a) if callable(f) else f) for k, f in kw.items()})


Q = r"\bq\b"
KV_C = r"\bkv_c\b"  # not kv_cache
ANY_DIM_ARG = r"\bq\b|\bkv_c\b|\bk_pe\b|kv_cache|kv_b_proj_weight"

CASES = [
    # ranks
    ("q_rank2", _set(q=lambda a: a["q"][:, 0]), Q),
    ("q_rank4", _set(q=lambda a: a["q"][None]), Q),
    ("kv_c_rank3", _set(kv_c=lambda a: a["kv_c"][:, None]), KV_C),
    ("k_pe_rank1", _set(k_pe=lambda a: a["k_pe"].reshape(-1)), r"\bk_pe\b"),
    ("kv_cache_rank2", _set(kv_cache=lambda a: a["kv_cache"].flatten(0, 1)), "kv_cache"),
    ("block_table_rank1", _set(block_table=lambda a: a["block_table"].flatten()),
     "block_table"),
    ("query_start_loc_rank2", _set(query_start_loc=lambda a: a["query_start_loc"][None]),
     "query_start_loc"),
    ("context_lens_rank2", _set(context_lens=lambda a: a["context_lens"][:, None]),
     "context_lens"),
    ("kv_b_proj_weight_rank3",
     _set(kv_b_proj_weight=lambda a: a["kv_b_proj_weight"].view(N, P + V, L)),
     "kv_b_proj_weight"),
    # widths
    ("kv_c_width", _set(kv_c=lambda a: torch.randn(T, L + 1)), KV_C),
    ("k_pe_width", _set(k_pe=lambda a: torch.randn(T, R + 1)), ANY_DIM_ARG),
    ("k_pe_wider_than_q_head", _set(k_pe=lambda a: torch.randn(T, P + R + 1)), ANY_DIM_ARG),
    ("kv_b_proj_weight_rows_not_multiple_of_N",
     _set(kv_b_proj_weight=lambda a: torch.randn(N * (P + V) + 1, L)), "kv_b_proj_weight"),
    ("kv_b_proj_weight_cols",
     _set(kv_b_proj_weight=lambda a: torch.randn(N * (P + V), L + 1)), "kv_b_proj_weight"),
    # token counts
    ("kv_c_tokens", _set(kv_c=lambda a: a["kv_c"][:-1]), KV_C),
    ("k_pe_tokens", _set(k_pe=lambda a: torch.randn(T + 1, R)), r"\bk_pe\b"),
    ("q_tokens", _set(q=lambda a: a["q"][:-1]), r"\bq\b|\bkv_c\b|\bk_pe\b|query_start_loc"),
    # dtypes
    ("block_table_int64", _set(block_table=lambda a: a["block_table"].long()), "block_table"),
    ("query_start_loc_int64", _set(query_start_loc=lambda a: a["query_start_loc"].long()),
     "query_start_loc"),
    ("query_start_loc_float", _set(query_start_loc=lambda a: a["query_start_loc"].float()),
     "query_start_loc"),
    ("context_lens_int64", _set(context_lens=lambda a: a["context_lens"].long()),
     "context_lens"),
    ("kv_c_dtype", _set(kv_c=lambda a: a["kv_c"].double()), KV_C),
    ("k_pe_dtype", _set(k_pe=lambda a: a["k_pe"].bfloat16()), r"\bk_pe\b"),
    ("kv_b_proj_weight_dtype",
     _set(kv_b_proj_weight=lambda a: a["kv_b_proj_weight"].double()), "kv_b_proj_weight"),
    ("kv_cache_float16", _set(kv_cache=lambda a: a["kv_cache"].half()), "kv_cache"),
    ("kv_cache_float64", _set(kv_cache=lambda a: a["kv_cache"].double()), "kv_cache"),
    ("kv_cache_int", _set(kv_cache=lambda a: a["kv_cache"].to(torch.int32)), "kv_cache"),
    ("q_integer", _set(q=lambda a: a["q"].to(torch.int32)), Q),
    # devices
    *[(f"{k}_meta", _set(**{k: (lambda a, k=k: a[k].to("meta"))}), (KV_C if k == "kv_c" else k))
      for k in ("kv_c", "k_pe", "kv_cache", "block_table", "query_start_loc", "context_lens",
                "kv_b_proj_weight")],
    # lengths and query_start_loc
    ("context_lens_negative", _set(context_lens=torch.tensor([5, -1, 9], dtype=torch.int32)),
     "context_lens"),
    ("context_lens_short", _set(context_lens=torch.tensor([5, 0], dtype=torch.int32)),
     "context_lens|query_start_loc"),
    ("context_lens_long", _set(context_lens=torch.tensor([5, 0, 9, 1], dtype=torch.int32)),
     "context_lens|query_start_loc"),
    ("query_start_loc_not_from_0",
     _set(query_start_loc=torch.tensor([1, 2, 5, 6], dtype=torch.int32)), "query_start_loc"),
    ("query_start_loc_decreasing",
     _set(query_start_loc=torch.tensor([0, 5, 2, 6], dtype=torch.int32)), "query_start_loc"),
    ("query_start_loc_ends_before_T",
     _set(query_start_loc=torch.tensor([0, 2, 5, 5], dtype=torch.int32)), "query_start_loc"),
    ("query_start_loc_ends_after_T",
     _set(query_start_loc=torch.tensor([0, 2, 5, 7], dtype=torch.int32)), "query_start_loc"),
    # block table
    ("block_table_few_rows", _set(block_table=lambda a: a["block_table"][:2]), "block_table"),
    ("block_table_too_short", _set(block_table=lambda a: a["block_table"][:, :2]),
     "block_table"),
    ("block_id_negative", lambda a: a["block_table"].__setitem__((2, 1), -1), "block_table"),
    ("block_id_past_the_cache", lambda a: a["block_table"].__setitem__((0, 1), a["kv_cache"].shape[0]),
     "block_table"),
    ("block_table_too_short_for_longer_context",
     _set(context_lens=torch.tensor([5, 0, 17], dtype=torch.int32)), "block_table"),
    # workspace
    ("workspace_size_0", _set(workspace_size=0), "workspace_size"),
    ("workspace_size_negative", _set(workspace_size=-8), "workspace_size"),
    # fp8
    ("fp8_without_k_scale", lambda a: _fp8(a, None), "k_scale"),
    ("k_scale_two_elements",
     lambda a: _fp8(a, torch.tensor([0.05, 0.05], dtype=torch.float32)), "k_scale"),
    # strings and scalars
    ("unknown_policy", _set(policy="batch_column_magic"), "policy"),
    ("unknown_backend", _set(backend="no_such_backend"), "backend"),
    ("softmax_scale_str", _set(softmax_scale="0.4"), "softmax_scale"),
    ("softmax_scale_none", _set(softmax_scale=None), "softmax_scale"),
]


def test_valid_call_passes():
    a = valid_args()
    out = call(a)
    assert out.shape == (T, N, V) and out.dtype == torch.float32


def test_valid_fp8_call_passes():
    for k_scale in (0.05, torch.tensor([0.05], dtype=torch.float32)):
        a = valid_args()
        _fp8(a, k_scale)
        assert call(a).shape == (T, N, V)


@pytest.mark.parametrize("name,mutate,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_before_writing(name, mutate, match):
    a = valid_args()
    mutate(a)
    with pytest.raises((ValueError, TypeError), match=match):
        call(a)


def test_block_table_int64_is_a_type_error():
    a = valid_args()
    a["block_table"] = a["block_table"].long()
    with pytest.raises(TypeError, match="block_table"):
        call(a)


# ---- a plan that does not fit the call ------------------------------------------------------------


def planned(**options):
    """run_prefill's arguments (a dict) for the valid call, with a plan made with ``options``."""
    a = valid_args()
    plan_args = dict(query_start_loc=a["query_start_loc"], context_lens=a["context_lens"],
                     block_table=a["block_table"], block_size=BLOCK_SIZE, workspace_size=4)
    plan = mla_ops.plan_prefill(**{**plan_args, **options})
    run = dict(q=a["q"], kv_c=a["kv_c"], k_pe=a["k_pe"], kv_cache=a["kv_cache"],
               kv_b_proj_weight=a["kv_b_proj_weight"], softmax_scale=a["softmax_scale"], plan=plan, backend="torch")
    return a, run


def test_run_prefill_with_its_plan_passes():
    a, run = planned()
    torch.testing.assert_close(mla_ops.run_prefill(**run), call(a), rtol=0, atol=0)


RUN_PLAN_MISFITS = {
    "not a plan": (lambda run: run.update(plan=dict(vars(run["plan"]))), TypeError, "plan must be a PrefillPlan"),
    "tokens": (lambda run: run.update(q=run["q"][:-1], kv_c=run["kv_c"][:-1], k_pe=run["k_pe"][:-1]), ValueError,
               rf"plan was made for T={T} tokens"),
    "block_size": (lambda run: run.update(kv_cache=run["kv_cache"].view(-1, 2, L + R)), ValueError,
                   f"plan was made for block_size {BLOCK_SIZE}, but kv_cache has 2"),
    "block past the cache": (lambda run: run.update(kv_cache=run["kv_cache"][:1]), ValueError,
                             "past the 1 blocks of kv_cache"),
    "device": (lambda run: run.update(**{k: run[k].to("meta") for k in ("q", "kv_c", "k_pe", "kv_cache",
                                                                         "kv_b_proj_weight")}), ValueError,
               "plan must be on meta"),
}


@pytest.mark.parametrize("case", list(RUN_PLAN_MISFITS))
def test_run_prefill_rejects_a_plan_that_does_not_fit(case):
    _, run = planned()
    change, error, match = RUN_PLAN_MISFITS[case]
    change(run)
    with pytest.raises(error, match=match):
        mla_ops.run_prefill(**run)


@pytest.mark.parametrize("option,value", [("workspace_size", 8), ("policy", "whole_requests"),
                                          ("split_alignment", 2), ("max_chunks", 4), ("absorb_max_query_len", 0),
                                          ("max_absorbed_tokens", 2)])
def test_mla_prefill_with_a_plan_rejects_planning_options(option, value):
    a, run = planned()
    a.update(plan=run["plan"], workspace_size=65536)
    a[option] = value
    with pytest.raises(ValueError, match=f"{option} is part of the plan: pass it to plan_prefill"):
        call(a)


@pytest.mark.parametrize("name", ["block_table", "query_start_loc", "context_lens"])
def test_mla_prefill_with_a_plan_rejects_other_lengths(name):
    a, run = planned()
    a.update(plan=run["plan"], workspace_size=65536)
    a[name] = a[name][:-1] if name != "block_table" else a[name][:, :-1]
    with pytest.raises(ValueError, match=f"{name} does not fit plan"):
        call(a)


def test_mla_prefill_rejects_a_plan_of_another_type():
    with pytest.raises(TypeError, match="plan must be a PrefillPlan"):
        call({**valid_args(), "workspace_size": 65536, "plan": "plan"})


# ---- a plan knows its step ----------------------------------------------------------------------
# A plan knows the step it was made for (issue: fail-safe surfaces). Lengths or a block table passed
# beside a plan must be the plan's own tensors or, on the CPU, equal to them; block ids are read again
# at run time on CPU tables; a model step checks its token ids and first positions for free.


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
    return model, config, dict(input_ids=ids, positions=positions, kv_caches=caches, slot_mapping=slots, plan=plan)


@pytest.mark.parametrize("case,match", [
    ("plan of another step", r"positions\[0\] is 5, but request 0 has 13 context tokens"),
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
        step["plan"] = mla_ops.plan_prefill(qsl, ctx.flip(0).contiguous(), step["plan"].block_table, 4,
                                            workspace_size=8)
    elif case == "token id past the vocabulary":
        step["input_ids"] = step["input_ids"].clone()
        step["input_ids"][4] = config.vocab_size + 3
    elif case == "negative token id":
        step["input_ids"] = step["input_ids"].clone()
        step["input_ids"][0] = -1
    else:
        step["input_ids"] = step["input_ids"].float()
    before = clone_caches(step["kv_caches"])
    inputs = {k: v.clone() for k, v in step.items() if isinstance(v, torch.Tensor)}
    with pytest.raises((ValueError, TypeError), match=match):
        model(**step)
    assert caches_equal(step["kv_caches"], before), "a refused step wrote the cache"
    assert all(torch.equal(step[k], v) for k, v in inputs.items())


def test_model_step_with_its_own_plan_runs():
    model, _, step = tiny_step()
    assert model(**step).shape == (9, model.config.hidden_size)


# ---- dims that shapes alone cannot tell apart ----------------------------------------------------


def test_a_q_of_the_wrong_width_is_refused_where_v_is_given():
    """q [T, N, P+R+1] fits kv_b_proj_weight [N*(P+V), L] as P+1 / V-1: shapes alone accept it. ``v_head_dim``
    fixes V (and ``out=`` does too), so the width is checked, by name, in every entry point."""
    a = valid_args()
    a["q"] = torch.randn(T, N, P + R + 1)
    wrong_q = rf"q must be \[T, N, P\+R\] with P\+R = {P}\+{R} = {P + R} .*V={V}.*got \[{T}, {N}, {P + R + 1}\]"
    with pytest.raises(ValueError, match=wrong_q):
        call({**a, "v_head_dim": V})
    _, run = planned()
    run["q"] = a["q"]
    with pytest.raises(ValueError, match=wrong_q):
        mla_ops.run_prefill(**run, v_head_dim=V)
    step = mla_ops.begin_step(run["plan"], run["kv_cache"], backend="torch")
    layer = (run["q"], run["kv_c"], run["k_pe"], run["kv_cache"], run["kv_b_proj_weight"], run["softmax_scale"])
    with pytest.raises(ValueError, match=wrong_q):
        step.run(*layer, v_head_dim=V)
    with pytest.raises(ValueError, match=rf"out must be \[T, N, V\] = \[{T}, {N}, {V - 1}\]"):  # out says V too
        step.run(*layer, out=torch.empty(T, N, V))
    with pytest.raises(TypeError, match="v_head_dim must be an int"):
        step.run(*layer, v_head_dim=float(V))


def test_v_head_dim_of_the_right_value_changes_nothing():
    a = valid_args()
    torch.testing.assert_close(call({**a, "v_head_dim": V}), call(a), rtol=0, atol=0)
