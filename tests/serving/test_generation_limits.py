"""``Generator`` at its limits (mla_ops/serving/generation.py):

* a ``max_new_tokens`` (or a fixed ``num_blocks``) whose cache would pass the device's memory or the block
  table's int32 ids is refused by name before anything changes, at once (not after growing the bookkeeping
  to billions of blocks); the next call works;
* an allocation that fails anyway (here: under an address-space limit, in a child process) leaves the
  Generator as it was: ``cache_usage`` matches the cache tensor, and the next call gives the right tokens;
* a call that may reach a position past ``max_position_embeddings`` runs, with one warning naming the limit.
"""

import dataclasses
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import mla_ops
from mla_ops._env import available_memory
from mla_ops.models.kv_caches import cache_tensors
from tests.serving.test_generation_errors import assert_same, state_of
from tests.support.batches import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [[1, 2, 3]]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def expected(model):
    return mla_ops.Generator(model).generate(PROMPT, 4)


def bytes_per_block(model, block_size=16):
    return sum(t.numel() * t.element_size() for t in cache_tensors(model.allocate_kv_caches(1, block_size)))


def past_memory(model, block_size=16):
    """A max_new_tokens whose cache needs twice the memory available now."""
    available = available_memory(torch.device("cpu"))
    assert available, "the test needs to know the memory available"
    return 2 * available // bytes_per_block(model, block_size) * block_size


@pytest.mark.parametrize("size", ["past the memory", "past int32 block ids"])
def test_a_max_new_tokens_the_cache_cannot_hold_is_refused_before_anything_changes(model, expected, size):
    generator = mla_ops.Generator(model)
    assert generator.generate(PROMPT, 4) == expected
    before, usage = state_of(generator), generator.cache_usage
    max_new_tokens = past_memory(model) if size == "past the memory" else 10**12
    words = "GiB available on cpu" if size == "past the memory" else "past the int32 block ids"
    with pytest.raises(ValueError, match=rf"max_new_tokens={max_new_tokens} with these prompts needs a cache of "
                                         rf"\d+ blocks.*{words}"):
        generator.generate(PROMPT, max_new_tokens, eos_token_id=5)
    assert_same(state_of(generator), before)
    assert generator.cache_usage == usage and generator.cache_usage.total == generator.kv_caches[0].shape[0]
    assert generator.generate(PROMPT, 4) == expected
    with pytest.raises(ValueError, match=rf"max_new_tokens={max_new_tokens}"):  # mla_ops.generate: the same
        mla_ops.generate(model, PROMPT, max_new_tokens)


@pytest.mark.parametrize("num_blocks, words", [(10**12, "past the int32 block ids"), (2**30, "GiB available on cpu")])
def test_a_num_blocks_past_the_memory_is_refused_at_once(model, num_blocks, words):
    with pytest.raises(ValueError, match=rf"num_blocks={num_blocks} needs a cache of {num_blocks} blocks.*{words}"):
        mla_ops.Generator(model, num_blocks=num_blocks)


CHILD = """
import resource, sys, torch
sys.path.insert(0, {root!r})
import mla_ops
from tests.support.batches import tiny_model

torch.set_num_threads(1)
model = tiny_model()
generator = mla_ops.Generator(model)
expected = generator.generate([[1, 2, 3]], 4)
usage = generator.cache_usage
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (vm + 2**30, resource.RLIM_INFINITY))  # 1 GiB more address space
try:
    generator.generate([[1, 2, 3]], {max_new_tokens})  # a cache of about 3 GiB: the allocation fails
    print("NOT REFUSED")
except RuntimeError as error:
    print("FAILED:", str(error).splitlines()[0])
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
assert generator.cache_usage == usage, (generator.cache_usage, usage)
assert generator.cache_usage.total == generator.kv_caches[0].shape[0]
assert generator.generate([[1, 2, 3]], 4) == expected
assert generator.generate([[1, 2, 3, 4, 5] * 8], 6) == mla_ops.Generator(model).generate([[1, 2, 3, 4, 5] * 8], 6)
print("USABLE")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc: Linux")
def test_a_failed_allocation_leaves_the_generator_usable(model):
    max_new_tokens = 3 * 2**30 // bytes_per_block(model) * 16
    root = __file__.rsplit("/tests/", 1)[0]
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD.format(root=root,
                                                                                max_new_tokens=max_new_tokens))],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAILED:" in result.stdout and "USABLE" in result.stdout, result.stdout


def short_model(model, max_position_embeddings):
    short = mla_ops.MLAForCausalLM(dataclasses.replace(model.config, max_position_embeddings=max_position_embeddings))
    short.load_state_dict(model.state_dict())
    return short.eval()


def test_generating_past_max_position_embeddings_warns_once(model, expected):
    short = short_model(model, 5)
    generator = mla_ops.Generator(short)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generator.generate(PROMPT, 3)  # positions 0..4: the last new token is never fed back
    with pytest.warns(UserWarning, match=r"to position 5, past the model's max_position_embeddings=5") as record:
        assert generator.generate(PROMPT, 4) == expected  # it runs
    assert len([w for w in record if "max_position_embeddings" in str(w.message)]) == 1
