"""PrefillGraphs on CPU: the bucketing, padding and eager fallback of the CUDA-graph runner, through
its "eager" and "compile" modes, against the eager model with a host plan. On a GPU: a whole
compiled step captured in one CUDA graph, mode="reduce-overhead", and PrefillGraphs' own captures.

Buckets in these tests: tokens (4, 16, 32), request slots (1, 2, 4, 6), chunk capacity (1, 2, 4)
of an 8-row workspace, 12 block-table columns of 4-row blocks; requests with <= 2 new tokens (and
some context) take the absorbed path, so they need no chunk.
"""

import copy
import math

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

import mla_ops
from mla_ops.serving.buckets import Bucket
from tests.support.batches import BUCKET_4, cache_list, model_step, spread_weights
from tests.support.gpu import DEVICE, needs_cuda

BLOCK_SIZE, WORKSPACE, ABSORB, MAX_BLOCKS = 4, 8, 2, 12
ABSORBED_CAPACITY = 4  # routed tokens per step: the first routed requests that fit, the rest chunked
BUCKETS = dict(token_buckets=(4, 16, 32), request_buckets=(1, 2, 4, 6), chunk_buckets=(1, 2, 4))
NUM_BLOCKS = 128


def make_model(dtype=torch.float64, layers=2):
    config = mla_ops.MLAConfig(**{**mla_ops.models.config.mla_configs["tiny"], "num_hidden_layers": layers})
    return spread_weights(mla_ops.MLAModel(config).to(dtype).eval(), seed=0)


def make_runner(model, mode, **kwargs):
    options = dict(max_tokens=32, max_requests=6, max_blocks_per_request=MAX_BLOCKS, block_size=BLOCK_SIZE,
                   workspace_size=WORKSPACE, mode=mode, absorb_max_query_len=ABSORB,
                   max_absorbed_tokens=ABSORBED_CAPACITY, **BUCKETS)
    return mla_ops.PrefillGraphs(model, **{**options, **kwargs})


def expected_variant(context_lens, query_lens):
    """The bucket a step belongs in, from the spec; None: beyond the buckets (runs eagerly)."""
    def smallest(buckets, n):
        return next((b for b in buckets if b >= n), None)

    chunked, taken = 0, 0
    for c, q in zip(context_lens, query_lens):
        candidate = q <= ABSORB and c > 0
        taken += q if candidate else 0
        chunked += 0 if candidate and taken <= ABSORBED_CAPACITY else c
    if max(math.ceil(c / BLOCK_SIZE) for c in context_lens) > MAX_BLOCKS:
        return None
    sizes = (smallest(BUCKETS["token_buckets"], sum(query_lens)),
             smallest(BUCKETS["request_buckets"], len(context_lens)),
             smallest(BUCKETS["chunk_buckets"], max(1, math.ceil(chunked / WORKSPACE))))
    return None if None in sizes else Bucket(*sizes)


# Edge cases first: B = 1 and T = 1, no context at all, zero contexts first / middle / last,
# more chunks than the largest bucket (5 > 4), more tokens (33 > 32), more requests (7 > 6),
# a context past the block-table width (absorbed: it needs no chunk), empty new-token requests.
EDGE_STEPS = [
    ([0], [1]),
    ([7], [1]),
    ([13], [3]),
    ([0, 0, 0], [2, 3, 1]),
    ([0, 9, 0, 5, 0], [1, 4, 3, 1, 2]),
    ([30, 10], [3, 4]),
    ([3, 0, 5], [11, 11, 11]),
    ([1, 0, 2, 0, 1, 0, 3], [1, 1, 1, 1, 1, 1, 1]),
    ([50], [1]),
    ([6, 8], [0, 5]),
]


def random_steps(count, seed):
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(count):
        batch = int(rng.integers(1, 7))
        contexts = [0 if rng.random() < 0.3 else int(rng.integers(1, 11)) for _ in range(batch)]
        steps.append((contexts, [int(rng.integers(1, 6)) for _ in range(batch)]))
    return steps


def check_steps(runner, model, steps, caches, *, built=()):
    """Each step through the runner equals the eager model (output and cache writes); returns the
    buckets the steps touched. A step in a bucket built before runs under fail_on_recompile. ``caches``: the
    layers' caches stacked, for comparing; the runner is handed them as a list of its layers (views: the writes
    land in ``caches``)."""
    runner_caches = list(caches.unbind())
    touched = set()
    for i, (context_lens, query_lens) in enumerate(steps):
        ids, positions, slots, table, qsl, ctx = model_step(model.config, context_lens, query_lens, seed=i,
                                                            num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
        expect_caches = caches.clone()
        with torch.no_grad():
            plan = mla_ops.plan_prefill(qsl, ctx, table, BLOCK_SIZE, WORKSPACE, absorb_max_query_len=ABSORB)
            expect = model(ids, positions, expect_caches, slots, plan)
        variant = expected_variant(context_lens, query_lens)
        stance = "fail_on_recompile" if variant in touched or variant in built else "default"
        with torch.compiler.set_stance(stance):
            out = runner(ids, positions, runner_caches, slots, table, qsl, ctx)
        torch.testing.assert_close(out, expect, msg=lambda m: f"step {i} {context_lens} {query_lens}: {m}")
        torch.testing.assert_close(caches, expect_caches)
        if variant is not None:
            touched.add(variant)
    return touched


@pytest.mark.parametrize("options", [
    mla_ops.PlanOptions(BLOCK_SIZE, WORKSPACE, policy="whole_requests"),
    mla_ops.PlanOptions(BLOCK_SIZE, WORKSPACE, split_alignment=2),
    mla_ops.PlanOptions(BLOCK_SIZE, WORKSPACE, max_chunks=4),
])
def test_options_must_plan_the_packed_device_form(options):
    with pytest.raises(ValueError, match="options must plan the packed policy"):
        mla_ops.PrefillGraphs(make_model(layers=1), max_tokens=32, max_requests=6, max_blocks_per_request=MAX_BLOCKS,
                              mode="eager", options=options)


def test_options_object_equals_its_keywords():
    model = make_model(layers=1)
    options = mla_ops.PlanOptions(BLOCK_SIZE, WORKSPACE, absorb_max_query_len=ABSORB,
                                  max_absorbed_tokens=ABSORBED_CAPACITY)
    by_object = mla_ops.PrefillGraphs(model, max_tokens=32, max_requests=6, max_blocks_per_request=MAX_BLOCKS,
                                      mode="eager", options=options, **BUCKETS)
    assert by_object.options == make_runner(model, "eager").options
    caches = torch.stack(model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE).latent)
    torch.nn.init.normal_(caches)
    check_steps(by_object, model, EDGE_STEPS[:4], caches)


def test_eager_mode_random_steps_equal_the_eager_model():
    model = make_model()
    runner = make_runner(model, "eager")
    caches = torch.stack(model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE).latent)
    torch.nn.init.normal_(caches)
    steps = EDGE_STEPS + random_steps(40, seed=1)
    touched = check_steps(runner, model, steps, caches)
    beyond = sum(expected_variant(*s) is None for s in steps)
    assert sum(expected_variant(*s) is None for s in EDGE_STEPS) == 4  # chunks, tokens, requests, blocks
    assert len(steps) - beyond >= 30
    assert runner.stats["eager"] == beyond and runner.stats["replays"] == len(steps) - beyond
    assert runner.stats["graphs"] == len(touched) == len(runner.built) and set(runner.built) == touched
    assert any(v.chunks > 1 for v in touched) and any(v.requests == 1 for v in touched)


def test_compile_mode_whole_step_one_graph_per_bucket_and_none_for_a_repeat():
    """A model without ``compile_layers``: each bucket's whole step compiles, static shapes. T = 1 /
    B = 1 reuse the graph of their bucket (under dynamic=True they would specialise); a repeated
    bucket runs under fail_on_recompile."""
    model = WithHead(make_model(layers=1)).eval()
    runner = make_runner(model, "compile", compile_backend="aot_eager")  # Dynamo's graphs, no C++ build
    assert not runner.regional
    caches = torch.stack(model.model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE).latent)
    torch.nn.init.normal_(caches)
    graphs_before = counters["stats"]["unique_graphs"]
    touched = check_steps(runner, model, COMPILE_STEPS, caches)
    assert len(touched) == 4 and runner.stats["graphs"] == 4
    assert counters["stats"]["unique_graphs"] - graphs_before == 4
    assert runner.stats["replays"] == 7 and runner.stats["eager"] == 1


COMPILE_STEPS = [([5], [3]), ([0], [1]), ([9, 0], [1, 2]), ([0, 0], [1, 1]), ([20, 9, 0], [3, 5, 4]),
                 ([7, 1, 0, 2], [4, 4, 4, 3]), ([3, 6, 3], [2, 3, 4]), ([40], [3])]


def test_compile_mode_compiles_the_layers_once_for_every_bucket_and_cache():
    """An MLAModel: regional compilation. Its two dense regions compile once, a graph each, and serve
    every layer, bucket, plan, the eager fallback and a grown cache: nothing recompiles."""
    model = make_model(layers=3)
    reference = copy.deepcopy(model)  # compile_layers compiles the runner's model in place
    runner = make_runner(model, "compile", compile_backend="aot_eager")
    assert runner.regional
    caches = torch.stack(model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE).latent)
    torch.nn.init.normal_(caches)
    graphs_before = counters["stats"]["unique_graphs"]
    check_steps(runner, reference, COMPILE_STEPS[:1], caches)
    assert counters["stats"]["unique_graphs"] - graphs_before == 2
    check_steps(runner, reference, COMPILE_STEPS[1:], caches, built=runner.variants)  # fail_on_recompile
    grown = torch.cat([caches, torch.randn_like(caches[:, :16])], dim=1)  # 16 more blocks
    check_steps(runner, reference, [([13, 2], [3, 4])], grown, built=runner.variants)
    assert counters["stats"]["unique_graphs"] - graphs_before == 2
    assert runner.stats["replays"] == 8 and runner.stats["eager"] == 1


def test_warmup_builds_every_bucket_once_and_writes_nothing():
    model = make_model(layers=1)
    runner = make_runner(model, "compile", compile_backend="eager", token_buckets=(4, 16), request_buckets=(2,),
                         chunk_buckets=(1, 2))
    with pytest.raises(ValueError, match="kv_caches"):
        runner.warmup()
    caches = torch.stack(model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE).latent)
    torch.nn.init.normal_(caches)
    before = caches.clone()
    graphs_before = counters["stats"]["unique_graphs"]
    runner.warmup(caches)
    assert runner.built == runner.variants == tuple(Bucket(t, 2, k) for t in (16, 4) for k in (2, 1))
    assert torch.equal(caches, before)
    runner.warmup()  # the same cache: nothing left to build
    reference = make_model(layers=1)  # the same weights, not compiled (compile_layers works in place)
    check_steps(runner, reference, [([9, 0], [5, 2]), ([1], [1])], caches, built=runner.built)
    # Four buckets set up, two graphs: the model's layers, compiled regionally, serve them all.
    assert runner.stats["graphs"] == 4 and counters["stats"]["unique_graphs"] - graphs_before == 2


class WithHead(torch.nn.Module):
    """A causal-LM shape: the runner only needs an output whose first dim is T."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config
        self.lm_head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False).double()

    def forward(self, input_ids, positions, kv_caches, slot_mapping, plan, *, backend="auto"):
        return self.lm_head(self.model(input_ids, positions, kv_caches, slot_mapping, plan, backend=backend))


def test_any_model_output_whose_first_dim_is_the_tokens():
    model = WithHead(make_model(layers=1)).eval()
    runner = make_runner(model, "eager")
    caches = torch.stack(model.model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE).latent)
    torch.nn.init.normal_(caches)
    check_steps(runner, model, [([5, 0, 13], [3, 2, 4]), ([30, 10], [3, 4])], caches)
    assert runner.stats["replays"] == 1 and runner.stats["eager"] == 1


def test_the_bucketed_step_reads_no_device_value_on_the_host():
    """On meta tensors any host read of a device value raises, as a CUDA-graph capture would
    break: the padded, device-planned step (what mode "cuda_graph" captures) makes none."""
    config = mla_ops.MLAConfig.from_name("tiny")
    with torch.device("meta"):
        model = mla_ops.MLAModel(config).eval()
    runner = make_runner(model, "eager")
    caches = torch.stack(model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE).latent)
    ids, positions, slots, table, qsl, ctx = model_step(config, [0, 9, 17], [4, 1, 6], seed=0,
                                                        num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    out = runner(ids, positions, caches, slots, table, qsl, ctx)
    assert out.shape == (11, config.hidden_size) and out.device.type == "meta"
    assert runner.built == (Bucket(16, 4, 4),)
    with pytest.raises(Exception):  # the control: a host read of a meta tensor does raise
        caches.sum().item()


def valid_call(model):
    ids, positions, slots, table, qsl, ctx = model_step(model.config, [5, 0], [3, 2], seed=0, num_blocks=NUM_BLOCKS,
                                                        block_size=BLOCK_SIZE)
    return dict(input_ids=ids, positions=positions, slot_mapping=slots, block_table=table, query_start_loc=qsl,
                context_lens=ctx)


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(mode="graphs"), ValueError, "mode"),
    (dict(mode="cuda_graph"), ValueError, "mode='cuda_graph'"),
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(token_buckets=(4, 64)), ValueError, "token_buckets"),
    (dict(request_buckets=(2, 7)), ValueError, "request_buckets"),
    (dict(chunk_buckets=()), ValueError, "chunk_buckets"),
    (dict(chunk_buckets=(1, 2.5)), TypeError, "chunk_buckets"),
    (dict(workspace_size=-1), ValueError, "workspace_size"),
    (dict(options=mla_ops.PlanOptions(BLOCK_SIZE, WORKSPACE)), ValueError, "was passed beside options="),
    (dict(options=dict(block_size=BLOCK_SIZE)), TypeError, "options must be a mla_ops.PlanOptions"),
])
def test_bad_construction_names_the_argument(kwargs, error, name):
    with pytest.raises(error, match=name):
        make_runner(make_model(layers=1), **{"mode": "eager", **kwargs})


@pytest.mark.parametrize("change, error, name", [
    (dict(query_start_loc=torch.tensor([0, 3, 5])), TypeError, "query_start_loc"),
    (dict(context_lens=torch.tensor([5, 0, 0], dtype=torch.int32)), ValueError, "query_start_loc"),
    (dict(context_lens=torch.tensor([5, -1], dtype=torch.int32)), ValueError, "context_lens"),
    (dict(input_ids=torch.zeros(4, dtype=torch.long)), ValueError, "input_ids"),
    (dict(slot_mapping=torch.zeros(5, 1, dtype=torch.long)), ValueError, "slot_mapping"),
    (dict(positions=torch.zeros(5)), TypeError, "positions"),
    (dict(block_table=torch.zeros(1, 4, dtype=torch.int32)), ValueError, "block_table"),
])
def test_bad_step_names_the_argument_and_writes_nothing(change, error, name):
    model = make_model(layers=1)
    runner = make_runner(model, "eager")
    caches = torch.stack(model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE).latent)
    call = {**valid_call(model), **change}
    with pytest.raises(error, match=name):
        runner(kv_caches=caches, **call)
    assert not caches.any() and runner.stats["replays"] == runner.stats["eager"] == 0


@pytest.mark.parametrize("k_scale, name", [
    (-1.0, "k_scale"),
    (torch.tensor([0.0]), "k_scale must be finite and positive"),
    (float("inf"), "k_scale must be finite and positive"),
    (1e-46, "k_scale must be finite and positive, a normal float32"),
    ([1e39, 1.0], "k_scale must be finite and positive, a normal float32"),
])
def test_bad_scales_in_the_caches_name_the_argument_and_write_nothing(k_scale, name):
    """The caches' record carries its scales to the runner, which checks them before anything runs."""
    model = make_model(layers=2)
    runner = make_runner(model, "eager")
    latent = [t.to(torch.float8_e4m3fn) for t in model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE).latent]
    with pytest.raises(ValueError, match=name):
        runner(kv_caches=mla_ops.KVCaches(latent, k_scale=k_scale), **valid_call(model))
    assert not any(t.view(torch.uint8).any() for t in latent) and runner.stats["replays"] == runner.stats["eager"] == 0


def test_compiled_buckets_keep_their_cache_geometry():
    """Whole-step graphs are compiled for one cache geometry; regional ones for none."""
    model = WithHead(make_model(layers=1)).eval()
    runner = make_runner(model, "compile", compile_backend="eager")
    caches = model.model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE)
    runner(kv_caches=caches, **valid_call(model))
    runner(kv_caches=mla_ops.KVCaches([c.clone() for c in caches.latent]), **valid_call(model))  # the same geometry
    grown = model.model.allocate_kv_caches(NUM_BLOCKS + 4, BLOCK_SIZE)
    with pytest.raises(ValueError, match="kv_caches"):
        runner(kv_caches=grown, **valid_call(model))
    with pytest.raises(ValueError, match="kv_caches must be on cpu"):
        runner(kv_caches=mla_ops.KVCaches([c.to("meta") for c in caches.latent]), **valid_call(model))
    regional = make_runner(model.model, "compile", compile_backend="eager")
    regional(kv_caches=caches, **valid_call(model))
    regional(kv_caches=grown, **valid_call(model))


# ---- PrefillGraphs refuses what a compiled or captured step could not check itself (it reads no value
# on the host inside the graph), before anything is built or written, and stays usable afterwards.


def test_an_unknown_compile_backend_is_refused_at_construction():
    with pytest.raises(ValueError, match="compile_backend must be a torch.compile backend"):
        make_runner(make_model(layers=1), "compile", compile_backend="no-such-backend")
    make_runner(make_model(layers=1), "compile", compile_backend=lambda gm, inputs: gm)  # a callable is fine


def _past_the_cache(call):
    call["block_table"] = call["block_table"].clone()
    call["block_table"][0, 0] = NUM_BLOCKS
    return "block_table uses block 128, past the 128 blocks"


def _slot_past_the_cache(call):
    call["slot_mapping"] = call["slot_mapping"].clone()
    call["slot_mapping"][1] = NUM_BLOCKS * BLOCK_SIZE
    return "slot_mapping holds slot 512, past the 128 x 4 slots"


def _token_past_the_vocabulary(call, vocab):
    call["input_ids"] = call["input_ids"].clone()
    call["input_ids"][2] = vocab
    return r"input_ids\[2\] is \d+: input_ids must lie in \[0, \d+\)"


def _negative_token(call, vocab):
    call["input_ids"] = call["input_ids"].clone()
    call["input_ids"][0] = -3
    return r"input_ids\[0\] is -3"


@pytest.mark.parametrize("mode", ["compile", "eager"])
@pytest.mark.parametrize("change", ["block past the cache", "slot past the cache", "token past the vocabulary",
                                    "negative token"])
def test_ids_past_the_cache_or_vocabulary_are_refused_in_every_mode(mode, change):
    model = make_model(layers=1)
    runner = make_runner(model, mode, compile_backend="eager")
    caches = torch.stack(model.allocate_kv_caches(NUM_BLOCKS, BLOCK_SIZE).latent)
    call = valid_call(model)
    vocab = model.embed_tokens.num_embeddings
    match = {"block past the cache": lambda: _past_the_cache(call),
             "slot past the cache": lambda: _slot_past_the_cache(call),
             "token past the vocabulary": lambda: _token_past_the_vocabulary(call, vocab),
             "negative token": lambda: _negative_token(call, vocab)}[change]()
    inputs = {k: v.clone() for k, v in call.items()}
    with pytest.raises(ValueError, match=match):
        runner(kv_caches=caches, **call)
    assert not caches.any() and runner.built == () and runner.stats["replays"] == runner.stats["eager"] == 0
    assert all(torch.equal(call[k], v) for k, v in inputs.items())
    out = runner(kv_caches=caches, **valid_call(model))  # still usable
    assert out.shape[0] == 5 and runner.stats["replays"] == 1


# ---- GPU: a whole prefill step captured in one CUDA graph ------------------------------------


class StaticStep:
    """Fixed-shape input buffers of one capacity bucket; batches are copied in, padded."""

    def __init__(self, config, max_tokens, max_requests, max_blocks):
        z = lambda *s, dtype=torch.int32: torch.zeros(*s, dtype=dtype, device=DEVICE)  # noqa: E731
        self.input_ids, self.positions = z(max_tokens, dtype=torch.long), z(max_tokens, dtype=torch.long)
        self.slot_mapping = z(max_tokens, dtype=torch.long)
        self.block_table, self.query_start_loc = z(max_requests, max_blocks), z(max_requests + 1)
        self.context_lens = z(max_requests)

    def args(self):
        return (self.input_ids, self.positions, None, self.slot_mapping, self.block_table, self.query_start_loc,
                self.context_lens)

    def load(self, ids, positions, slots, table, qsl, lens):
        """Real requests first, then padding requests with no context; the first takes the spare
        tokens (slot -1: the cache write skips them)."""
        tokens, requests = ids.shape[0], lens.shape[0]
        spare = self.input_ids.shape[0] - tokens
        assert requests < self.context_lens.shape[0] and table.shape[1] <= self.block_table.shape[1]
        self.input_ids.zero_()[:tokens].copy_(ids)
        self.positions.zero_()[:tokens].copy_(positions)
        self.slot_mapping.fill_(-1)[:tokens].copy_(slots)
        self.block_table.zero_()[:requests, : table.shape[1]].copy_(table)
        self.context_lens.zero_()[:requests].copy_(lens)
        self.query_start_loc.fill_(tokens + spare)[: requests + 1].copy_(qsl)
        return tokens


@pytest.mark.cuda
@needs_cuda
@torch.no_grad()
def test_cuda_graph_capture_replays_changing_batches():
    mla_ops.enable()
    torch.manual_seed(0)
    config = mla_ops.MLAConfig.from_name("tiny")
    model = mla_ops.MLAModel(config).to(DEVICE).eval()
    caches = torch.stack(model.allocate_kv_caches(64, 4).latent)
    torch.nn.init.normal_(caches)
    base = caches.clone()
    static = StaticStep(config, max_tokens=40, max_requests=8, max_blocks=20)
    def planned_step(ids, pos, caches, slots, table, qsl, lens):  # the planner runs inside the graph
        plan = mla_ops.plan_prefill(qsl, lens, table, 4, 32, max_chunks=4, absorb_max_query_len=3)
        return model(ids, pos, caches, slots, plan)  # both context paths in the captured graph

    compiled = torch.compile(planned_step, fullgraph=True, dynamic=False)

    def step():
        ids, pos, _, slots, table, qsl, lens = static.args()
        return compiled(ids, pos, caches, slots, table, qsl, lens)

    static.load(*[t.to(DEVICE) for t in model_step(config, *BUCKET_4[0], seed=0)])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile and warm up outside the capture
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    batches = [BUCKET_4[i] for i in (0, 1, 2, 4, 5, 6, 9)]  # request counts 2..7, zero contexts, empty
    for i, (context_lens, query_lens) in enumerate(batches):
        inputs = [t.to(DEVICE) for t in model_step(config, context_lens, query_lens, seed=i)]
        caches.copy_(base)
        tokens = static.load(*inputs)
        graph.replay()
        expect_caches = base.clone()
        ids, pos, slots, table, qsl, lens = inputs
        plan = mla_ops.plan_prefill(qsl, lens, table, 4, 32, absorb_max_query_len=0)  # eager, host plan
        expect = model(ids, pos, expect_caches, slots, plan)
        torch.testing.assert_close(static_out[:tokens], expect, rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(cache_list(caches), cache_list(expect_caches), rtol=2e-3, atol=2e-3)


@pytest.mark.cuda
@needs_cuda
@torch.no_grad()
def test_reduce_overhead_runs_without_cudagraph_skips():
    mla_ops.enable()
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = mla_ops.MLAConfig.from_name("tiny")
    model = mla_ops.MLAModel(config).to(DEVICE).eval()
    caches = torch.stack(model.allocate_kv_caches(64, 4).latent)
    torch._dynamo.mark_static_address(caches)  # a fixed buffer: cudagraphs may mutate it in place
    with torch._inductor.config.patch({"triton.cudagraph_or_error": True}):
        def planned_step(ids, pos, caches, slots, table, qsl, lens):
            plan = mla_ops.plan_prefill(qsl, lens, table, 4, 32, max_chunks=4)
            return model(ids, pos, caches, slots, plan)

        compiled = torch.compile(planned_step, mode="reduce-overhead", fullgraph=True)
        for i, batch in enumerate(BUCKET_4[:4]):
            ids, pos, slots, table, qsl, lens = [t.to(DEVICE) for t in model_step(config, *batch, seed=i)]
            for _ in range(3):  # warm-up, record, replay
                expect_caches = caches.clone()
                out = compiled(ids, pos, caches, slots, table, qsl, lens).clone()
            expect = model(ids, pos, expect_caches, slots, mla_ops.plan_prefill(qsl, lens, table, 4, 32))
            torch.testing.assert_close(out, expect, rtol=2e-3, atol=2e-3)


# ---- GPU: PrefillGraphs, whole steps captured per bucket ------------------------------------


def graphs_setup(spread=False, **kwargs):
    torch.manual_seed(0)
    config = mla_ops.MLAConfig.from_name("tiny")
    model = mla_ops.MLAModel(config).eval()
    if spread:  # attention far from uniform: outputs follow the context rows closely
        spread_weights(model, seed=0)
    model = model.to(DEVICE)
    caches = torch.stack(model.allocate_kv_caches(64, 4).latent)
    torch.nn.init.normal_(caches)
    options = dict(max_tokens=40, max_requests=8, max_blocks_per_request=20, block_size=4, workspace_size=32,
                   chunk_buckets=(1, 2, 4), token_buckets=(8, 16, 40), absorb_max_query_len=3, mode="cuda_graph")
    return config, model, caches, mla_ops.PrefillGraphs(model, **{**options, **kwargs})


def graphs_step(config, context_lens, query_lens, seed):
    """A step as a scheduler hands it over: token inputs on the GPU, lengths on the CPU."""
    ids, positions, slots, table, qsl, lens = model_step(config, context_lens, query_lens, seed=seed)
    return ids.to(DEVICE), positions.to(DEVICE), slots.to(DEVICE), table.to(DEVICE), qsl, lens


def eager_model_step(model, caches, ids, positions, slots, table, qsl, lens):
    plan = mla_ops.plan_prefill(qsl, lens, table, 4, 32, absorb_max_query_len=3)  # host plan
    return model(ids, positions, caches, slots, plan)


@pytest.mark.cuda
@needs_cuda
@torch.no_grad()
def test_cuda_graph_runner_replays_equal_the_eager_model():
    config, model, caches, runner = graphs_setup()
    # B = T = 1 with and without context; 130 context rows need 5 > 4 chunks of 32: runs eagerly.
    steps = BUCKET_4 + [([0], [1]), ([9], [1]), ([60, 70], [4, 4])]
    for i, (context_lens, query_lens) in enumerate(steps):
        ids, positions, slots, table, qsl, lens = graphs_step(config, context_lens, query_lens, seed=i)
        expect_caches = caches.clone()
        expect = eager_model_step(model, expect_caches, ids, positions, slots, table, qsl, lens)
        out = runner(ids, positions, caches, slots, table, qsl, lens)
        torch.testing.assert_close(out, expect, rtol=2e-3, atol=2e-3, msg=lambda m: f"step {i}: {m}")
        torch.testing.assert_close(cache_list(caches), cache_list(expect_caches), rtol=2e-3, atol=2e-3)
    stats = runner.stats
    assert stats["eager"] == 1 and stats["replays"] == len(steps) - 1
    assert stats["graphs"] == len(runner.built) == len(set(runner.built)) < len(steps)
    assert set(stats["graph_bytes"]) == {str(v) for v in runner.built}
    assert stats["graph_bytes"][str(runner.built[0])] > 0
    print("graph memory per bucket:", stats["graph_bytes"], "static:", stats["static_bytes"])


@pytest.mark.cuda
@needs_cuda
@torch.no_grad()
def test_cuda_graph_runner_replays_read_the_cache_as_it_is_now():
    config, model, caches, runner = graphs_setup(spread=True)
    step = graphs_step(config, [20, 9, 0, 13], [3, 5, 4, 2], seed=3)
    first = runner(step[0], step[1], caches, *step[2:]).clone()
    caches.normal_()  # new contents in the memory the graph reads
    expect = eager_model_step(model, caches.clone(), *step)
    again = runner(step[0], step[1], caches, *step[2:])
    assert runner.stats["graphs"] == 1 and runner.stats["replays"] == 2
    torch.testing.assert_close(again, expect, rtol=1e-2, atol=1e-2)
    change, error = (expect - first).abs().max(), (again - expect).abs().max()
    assert change > 10 * error, (change, error)  # the replay read the new context rows
    with pytest.raises(ValueError, match="kv_caches"):
        runner(step[0], step[1], caches.clone(), *step[2:])  # graphs are bound to the captured cache


@pytest.mark.cuda
@needs_cuda
@torch.no_grad()
def test_cuda_graph_runner_warmup_captures_every_bucket_in_one_pool():
    config, model, caches, runner = graphs_setup(token_buckets=(8, 40), request_buckets=(2, 8), chunk_buckets=(1, 4))
    before = caches.clone()
    runner.warmup(caches)
    assert runner.built == runner.variants and runner.stats["graphs"] == 8
    assert torch.equal(caches, before)  # the capture steps write nothing
    sizes = [runner.stats["graph_bytes"][str(v)] for v in runner.built]
    print("graph memory per bucket, largest bucket first:", dict(zip(map(str, runner.built), sizes)))
    assert sizes[0] > 0 and min(sizes) >= 0
    ids, positions, slots, table, qsl, lens = graphs_step(config, [5, 0, 13], [3, 2, 4], seed=0)
    expect = eager_model_step(model, caches.clone(), ids, positions, slots, table, qsl, lens)
    torch.testing.assert_close(runner(ids, positions, caches, slots, table, qsl, lens), expect, rtol=2e-3, atol=2e-3)
    assert runner.stats["graphs"] == 8 and runner.stats["replays"] == 1
