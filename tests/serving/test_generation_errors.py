"""Bad input to ``Generator`` and ``mla_ops.generate`` (mla_ops/serving/generation.py, prompts.py): one
TypeError or ValueError naming the argument, raised before anything is written. Each refused call
leaves its inputs, the cache tensor, the block manager and the prefix index bit-identical, and the
runner usable (a good call afterwards gives the reference tokens).

Accepted on purpose (tested at the end): numpy ints, tuples and 1-D integer tensors or arrays as
prompts; ``eos_token_id`` as a 0-d or 1-D integer tensor (read as its ints, never ignored) or a
frozenset."""

import copy

import numpy as np
import pytest
import torch

import mla_ops
from mla_ops.serving import generation
from tests.support.batches import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 1]]
N = 3

# (prompts, max_new_tokens, keywords, error, words of the message)
BAD_CALLS = [
    ([1, 2, 3], N, {}, TypeError, "prompts must be a list of token-id lists, not a flat list"),
    ([np.int64(1)], N, {}, TypeError, "flat list"),
    ([torch.tensor(1)], N, {}, TypeError, "flat list"),
    ([], N, {}, TypeError, "prompts must be a non-empty list"),
    ("1 2 3", N, {}, TypeError, "prompts must be a list of token-id lists"),
    (torch.tensor([[1, 2]]), N, {}, TypeError, "prompts must be a list"),
    (np.array([[1, 2]]), N, {}, TypeError, "prompts must be a list"),
    ({0: [1, 2]}, N, {}, TypeError, "prompts must be a list"),
    ([[1, 2], 3], N, {}, TypeError, r"prompts\[1\] is 3"),
    ([[1, 2], []], N, {}, ValueError, r"prompts\[1\] is empty"),
    ([[1, True]], N, {}, TypeError, r"prompts\[0\]\[1\] must be an int token id, got bool"),
    ([[1, 2.0]], N, {}, TypeError, r"prompts\[0\]\[1\] must be an int token id, got float"),
    ([["1"]], N, {}, TypeError, r"prompts\[0\]\[0\] must be an int token id, got str"),
    ([[1, None]], N, {}, TypeError, r"prompts\[0\]\[1\]"),
    ([[1, torch.tensor(2)]], N, {}, TypeError, r"prompts\[0\]\[1\] must be an int token id, got Tensor"),
    ([[1, 256]], N, {}, ValueError, r"prompts\[0\]\[1\] is 256: token ids must be in \[0, 256\)"),
    ([[0], [-1]], N, {}, ValueError, r"prompts\[1\]\[0\] is -1"),
    ([[1, np.int64(300)]], N, {}, ValueError, r"prompts\[0\]\[1\] is 300"),
    ([[1, 2**70]], N, {}, ValueError, r"prompts\[0\]\[1\]"),
    ([torch.tensor([1.0, 2.0])], N, {}, TypeError, r"prompts\[0\] must be a 1-D integer tensor"),
    ([torch.tensor([True])], N, {}, TypeError, r"prompts\[0\] must be a 1-D integer tensor"),
    ([torch.tensor([[1, 2]])], N, {}, TypeError, r"prompts\[0\] must be a 1-D integer tensor"),
    ([torch.tensor([1, 300])], N, {}, ValueError, r"prompts\[0\]\[1\] is 300"),
    ([np.array([1.5])], N, {}, TypeError, r"prompts\[0\] must be a 1-D integer"),
    (["abc"], N, {}, TypeError, r"prompts\[0\] must be a list of int token ids"),
    ([{1, 2}], N, {}, TypeError, r"prompts\[0\] must be a list of int token ids"),
    ([range(3)], N, {}, TypeError, r"prompts\[0\] must be a list of int token ids"),
    (PROMPTS, -1, {}, ValueError, "max_new_tokens must be an int >= 0, got -1"),
    (PROMPTS, 2.0, {}, TypeError, "max_new_tokens must be an int"),
    (PROMPTS, True, {}, TypeError, "max_new_tokens must be an int"),
    (PROMPTS, "3", {}, TypeError, "max_new_tokens must be an int"),
    (PROMPTS, None, {}, TypeError, "max_new_tokens must be an int"),
    (PROMPTS, N, dict(eos_token_id="7"), TypeError, "eos_token_id must be None, an int.*got str '7'"),
    (PROMPTS, N, dict(eos_token_id=7.0), TypeError, "eos_token_id .*got float"),
    (PROMPTS, N, dict(eos_token_id=True), TypeError, "eos_token_id .*got bool"),
    (PROMPTS, N, dict(eos_token_id=[7, "8"]), TypeError, "eos_token_id .*got str '8'"),
    (PROMPTS, N, dict(eos_token_id={"eos": 7}), TypeError, "eos_token_id .*got dict"),
    (PROMPTS, N, dict(eos_token_id=torch.tensor([7.0])), TypeError, "eos_token_id .*float32"),
    (PROMPTS, N, dict(eos_token_id=torch.tensor([[7]])), TypeError, "eos_token_id .*2-D"),
    (PROMPTS, N, dict(eos_token_id=256), ValueError, r"eos_token_id 256 is outside \[0, 256\)"),
    (PROMPTS, N, dict(eos_token_id=[3, -1]), ValueError, "eos_token_id -1 is outside"),
]
IDS = [f"{i}-{case[3].__name__}" for i, case in enumerate(BAD_CALLS)]


def state_of(generator: mla_ops.Generator):
    """Everything a call could write: the cache (values and storage), the blocks, the index, the stats."""
    m = generator.manager
    caches = generator.kv_caches
    return dict(
        caches=None if caches is None else [(t.data_ptr(), t._version, t.clone()) for t in caches.tensors],
        blocks=(m.num_blocks, list(m._free), list(m._refs), dict(m._hash_of), dict(m._block_of), list(m._evictable)),
        stats=copy.copy(generator.stats), runner=generator._runner, fingerprint=generator._fingerprint,
    )


def assert_same(a, b):
    """Bit-identical: values, dtypes and types, tensors and arrays inside containers too."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, range) or not hasattr(a, "__iter__") or isinstance(a, (str, bytes, set, frozenset)):
        assert a == b or (a != a and b != b)
    else:
        assert a == b



@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def expected(model):
    return mla_ops.Generator(model, block_size=4, prefix_caching=False).generate(PROMPTS, N)


@pytest.fixture(scope="module")
def warm(model, expected):
    """A Generator with a cache and a prefix index: a good call made."""
    generator = mla_ops.Generator(model, block_size=4)
    assert generator.generate(PROMPTS, N) == expected
    return generator


@pytest.mark.parametrize("prompts, max_new_tokens, kwargs, error, words", BAD_CALLS, ids=IDS)
def test_generator_refuses_bad_calls_and_writes_nothing(warm, prompts, max_new_tokens, kwargs, error,
                                                        words):
    inputs = copy.deepcopy((prompts, max_new_tokens, kwargs))
    before = state_of(warm)
    with pytest.raises(error, match=words):
        warm.generate(prompts, max_new_tokens, **kwargs)
    assert_same((prompts, max_new_tokens, kwargs), inputs)
    assert_same(state_of(warm), before)


@pytest.mark.parametrize("prompts, max_new_tokens, kwargs, error, words", BAD_CALLS[::3], ids=IDS[::3])
def test_generate_refuses_bad_calls_and_keeps_its_generator(model, prompts, max_new_tokens, kwargs,
                                                           error, words):
    mla_ops.generate(model, PROMPTS, N, block_size=4)
    generator = generation._generators[model]
    inputs = copy.deepcopy((prompts, max_new_tokens, kwargs))
    before = state_of(generator)
    with pytest.raises(error, match=words):
        mla_ops.generate(model, prompts, max_new_tokens, block_size=4, **kwargs)
    assert_same((prompts, max_new_tokens, kwargs), inputs)
    assert generation._generators[model] is generator
    assert_same(state_of(generator), before)


def test_a_refused_call_on_a_fresh_generator_allocates_nothing(model):
    generator = mla_ops.Generator(model, block_size=4, num_blocks=3)
    before = state_of(generator)
    for prompts, n in (([1, 2, 3], N), (PROMPTS, -1), ([[1] * 9], 5)):  # the last writes 13 rows: 4 blocks of the 3
        with pytest.raises((TypeError, ValueError)):
            generator.generate(prompts, n)
        assert generator.kv_caches is None
        assert_same(state_of(generator), before)
    assert generator.generate([[1, 2, 3]], 2) == mla_ops.Generator(model, block_size=4).generate([[1, 2, 3]], 2)


def test_the_capacity_counts_the_rows_written(model):
    """The last new token is returned, never fed back, so its row is never written: 4 prompt tokens and
    1 new one fit one block of 4; 2 new ones do not."""
    generator = mla_ops.Generator(model, block_size=4, num_blocks=1)
    assert generator.generate([[1, 2, 3, 4]], 1) == mla_ops.Generator(model, block_size=4).generate([[1, 2, 3, 4]], 1)
    with pytest.raises(ValueError, match="num_blocks=1 is too small: this call needs 2 more blocks"):
        generator.generate([[1, 2, 3, 4]], 2)


def test_the_cache_usage_shows_no_leak_after_eviction(model):
    generator = mla_ops.Generator(model, block_size=4, num_blocks=6)
    assert generator.cache_usage == (6, 0, 0, 6)
    seen = []
    generator.generate(PROMPTS, N, callback=lambda stats: seen.append(generator.cache_usage))
    assert all(sum(usage[1:]) == 6 for usage in seen) and all(usage.in_use > 0 for usage in seen[:-1])
    assert generator.cache_usage.in_use == 0 and generator.cache_usage.cached == generator.manager.num_cached
    for seed in range(4):  # other prompts evict the cached prefixes; nothing stays held
        prompt = torch.randint(0, 256, (13,), generator=torch.Generator().manual_seed(seed)).tolist()
        generator.generate([prompt], 3)
        usage = generator.cache_usage
        assert usage.in_use == 0 and usage.total == 6 and usage.cached + usage.free == 6


def test_a_call_too_big_for_num_blocks_keeps_the_cache_and_the_index(model, expected):
    generator = mla_ops.Generator(model, block_size=4, num_blocks=6)
    assert generator.generate(PROMPTS, N) == expected
    assert generator.manager.num_cached == 2  # prompt 0's 2 blocks; prompt 1 shared the first
    before = state_of(generator)
    big = [PROMPTS[0] + [1] * 12]  # reuses prompt 0's first block: 1 pinned, 5 left
    with pytest.raises(ValueError, match="num_blocks=6 is too small: this call needs 6 more blocks of 4 tokens, "
                                         "5 are available"):
        generator.generate(big, 8)
    assert_same(state_of(generator), before)
    assert generator.generate(PROMPTS, N) == expected and generator.stats.cached_tokens == 4 + 4
    assert generator.generate(big, 3) == mla_ops.Generator(model, block_size=4).generate(big, 3)


# (keywords of Generator(model, ...), error, words)
BAD_SETTINGS = [
    (dict(block_size=0), ValueError, "block_size must be a positive int, got 0"),
    (dict(block_size=-4), ValueError, "block_size must be a positive int"),
    (dict(block_size=16.0), TypeError, "block_size must be an int, got float"),
    (dict(block_size="16"), TypeError, "block_size must be an int, got str"),
    (dict(block_size=True), TypeError, "block_size must be an int, got bool"),
    (dict(num_blocks=0), ValueError, "num_blocks must be a positive int"),
    (dict(num_blocks=2.5), TypeError, "num_blocks must be an int"),
    (dict(num_blocks=True), TypeError, "num_blocks must be an int"),
    (dict(workspace_size=0), ValueError, "workspace_size must be a positive int"),
    (dict(workspace_size=None), TypeError, "workspace_size must be an int"),
    (dict(compile="yes"), TypeError, "compile must be a bool, got str"),
    (dict(compile=1), TypeError, "compile must be a bool, got int"),
    (dict(prefix_caching=0), TypeError, "prefix_caching must be a bool"),
    (dict(prefix_caching=None), TypeError, "prefix_caching must be a bool"),
    (dict(absorb_max_query_len=-1), ValueError, "absorb_max_query_len must be an int >= 0"),
    (dict(absorb_max_query_len=1.0), TypeError, "absorb_max_query_len must be an int"),
    (dict(max_absorbed_tokens=-2), ValueError, "max_absorbed_tokens must be an int >= 0"),
    (dict(options="packed"), TypeError, "options must be a mla_ops.PlanOptions or None, got str"),
    (dict(options=dict(block_size=4)), TypeError, "options must be a mla_ops.PlanOptions"),
    (dict(options=mla_ops.PlanOptions(4), block_size=8), ValueError, "block_size=8 was passed beside options="),
    (dict(options=mla_ops.PlanOptions(), workspace_size=64), ValueError, "workspace_size=64 was passed beside"),
    (dict(options=mla_ops.PlanOptions(), absorb_max_query_len=0), ValueError,
     r"absorb_max_query_len=0 was passed beside options=: set it in the PlanOptions \(options.absorb_max_query_len "
     "is None\\)"),
    (dict(options=mla_ops.PlanOptions(), max_absorbed_tokens=8), ValueError, "max_absorbed_tokens=8 was passed"),
    (dict(options=mla_ops.PlanOptions(max_chunks=2)), ValueError, "options.max_chunks must be None, got 2"),
    (dict(options=mla_ops.PlanOptions(policy="whole_requests"), compile=True), ValueError,
     "options: compile=True plans each step on the device.*policy='whole_requests'"),
    (dict(options=mla_ops.PlanOptions(split_alignment=4), compile=True), ValueError,
     "options: compile=True .*split_alignment=4"),
]


@pytest.mark.parametrize("kwargs, error, words", BAD_SETTINGS,
                         ids=[f"{i}-{'+'.join(k)}" for i, (k, *_) in enumerate(BAD_SETTINGS)])
def test_settings_are_refused_by_generator_and_generate(model, kwargs, error, words):
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=words):
        mla_ops.Generator(model, **kwargs)
    if "prefix_caching" not in kwargs:  # generate() has no such keyword
        previous = generation._generators.get(model)
        with pytest.raises(error, match=words):
            mla_ops.generate(model, PROMPTS, N, **kwargs)
        assert generation._generators.get(model) is previous
    assert_same(dict(model.state_dict()), weights)


@pytest.mark.parametrize("bad", [None, "model", 3])
def test_the_model_must_be_a_causal_lm(model, bad):
    for target in (bad, model.model):
        with pytest.raises(TypeError, match="model must be an MLAForCausalLM"):
            mla_ops.Generator(target)
        with pytest.raises(TypeError, match="model must be an MLAForCausalLM"):
            mla_ops.generate(target, PROMPTS, N)


def test_callback_must_be_callable(warm):
    before = state_of(warm)
    with pytest.raises(TypeError, match="callback must be callable"):
        warm.generate(PROMPTS, N, callback=5)
    assert_same(state_of(warm), before)


def test_accepted_forms_give_the_tokens_of_plain_lists(warm, expected):
    forms = [
        [tuple(p) for p in PROMPTS],
        [np.array(p, dtype=np.int64) for p in PROMPTS],
        [torch.tensor(p, dtype=torch.int32) for p in PROMPTS],
        [[np.int32(t) for t in PROMPTS[0]], torch.tensor(PROMPTS[1])],
    ]
    for prompts in forms:
        kept = copy.deepcopy(prompts)
        assert warm.generate(prompts, np.int64(N)) == expected
        assert_same(prompts, kept)
    assert warm.generate(PROMPTS, 0) == [[], []] and warm.stats.prompt_tokens == 11
    stop = expected[0][1]
    cut = [e[: e.index(stop) + 1] if stop in e else e for e in expected]
    for eos in (stop, np.int64(stop), [stop], (stop, 255), {stop}, frozenset([stop]), torch.tensor(stop),
                torch.tensor([stop, 255]), np.array([stop])):
        assert warm.generate(PROMPTS, N, eos_token_id=eos) == cut, eos
    assert warm.generate(PROMPTS, N, eos_token_id=[]) == expected  # an empty list: no stop token


def test_block_manager_checks_its_arguments():
    from mla_ops.serving.paged_cache import BlockManager

    with pytest.raises(ValueError, match="num_blocks must be a positive int"):
        BlockManager(0, 4)
    with pytest.raises(TypeError, match="block_size must be an int"):
        BlockManager(4, 4.0)
    with pytest.raises(TypeError, match="prefix_caching must be a bool"):
        BlockManager(4, 4, prefix_caching="yes")
    m = BlockManager(2, 4)
    for call in (m.acquire, m.release, lambda b: m.register(b, b"x")):
        with pytest.raises(ValueError, match="block id -1 is outside the cache's blocks 0..1"):
            call(-1)  # would index the last block from the end
        with pytest.raises(ValueError, match="block id 2 is outside"):
            call(2)
    assert m.num_available == 2 and m.num_cached == 0 and m._refs == [0, 0]
